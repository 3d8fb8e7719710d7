//! Where one admission's CPU goes: `cargo run --release -p memguard-webhook --example review_cost`.
use memguard_api::Policy;
use memguard_webhook::{ClusterView, patch, review};
use std::time::Instant;

fn main() {
    let body = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../bench/webhook/admission-review.json"
    ))
    .expect("bench body");
    let policy = Policy::default();
    let profiles = ClusterView::default();
    let n = 2000;
    let time = |name: &str, f: &mut dyn FnMut()| {
        let start = Instant::now();
        for _ in 0..n {
            f();
        }
        println!(
            "{name:>28}: {:>8.1} µs",
            start.elapsed().as_secs_f64() * 1e6 / n as f64
        );
    };
    let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
    let pod: k8s_openapi::api::core::v1::Pod =
        serde_json::from_value(v["request"]["object"].clone()).expect("pod");
    time("parse body as Value", &mut || {
        let _: serde_json::Value = serde_json::from_slice(&body).expect("json");
    });
    time("parse pod (typed)", &mut || {
        let _: k8s_openapi::api::core::v1::Pod =
            serde_json::from_value(v["request"]["object"].clone()).expect("pod");
    });
    time("mutate", &mut || {
        let _ = memguard_webhook::mutate(&pod, &policy, &profiles);
    });
    let outcome = memguard_webhook::mutate(&pod, &policy, &profiles);
    time("patch::build", &mut || {
        let _ = patch::build(&pod, &outcome);
    });
    time("review (all)", &mut || {
        let r = review::review(&body, &policy, &profiles).expect("ok");
        let _ = serde_json::to_vec(&r.review);
    });
    // What every opted-in pod now pays to be told it is not an inference server.
    time("serving::admit (no server)", &mut || {
        let _ = memguard_webhook::serving::admit(&pod, &policy, &profiles);
    });
    // An inference server (vLLM on half an H100 through KAI): its launch line read, fitted,
    // rewritten.
    let server: k8s_openapi::api::core::v1::Pod =
        serde_saphyr::from_str(include_str!("../tests/fixtures/serving/vllm-kai-half.yaml"))
            .expect("server pod");
    time("mutate (vLLM server)", &mut || {
        let _ = memguard_webhook::mutate(&server, &policy, &profiles);
    });
    let outcome = memguard_webhook::mutate(&server, &policy, &profiles);
    time("patch::build (vLLM server)", &mut || {
        let _ = patch::build(&server, &outcome);
    });
}
