use super::*;
use crate::testutil::{admission_review, bare_pod, trainer_pod};
use axum::body::Body;
use axum::http::Request;
use base64::Engine;
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tower::ServiceExt;

fn state() -> AppState {
    AppState {
        policy: Arc::new(ArcSwap::from_pointee(memguard_api::Policy::default())),
        profiles: Arc::new(ClusterView::default()),
        metrics: Arc::new(Metrics::new()),
        not_ready: None,
    }
}

async fn post(app: Router, body: impl Into<Body>) -> (StatusCode, Vec<u8>) {
    let request = Request::post(wellknown::WEBHOOK_PATH)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.into())
        .expect("request");
    let response = app.oneshot(request).await.expect("infallible");
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, bytes.to_vec())
}

async fn review(app: Router, review: Value) -> Value {
    let (status, body) = post(app, review.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    serde_json::from_slice(&body).expect("an AdmissionReview comes back")
}

fn apply_response(pod: &Value, response: &Value) -> Value {
    let patch_b64 = response["response"]["patch"].as_str().expect("a patch");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(patch_b64)
        .expect("base64");
    let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("a JSON patch");
    let mut out = pod.clone();
    json_patch::patch(&mut out, &patch).expect("applies");
    out
}

#[tokio::test]
async fn mutates_a_training_pod_and_always_allows() {
    let pod = trainer_pod().gpus(1).json();
    let r = review(
        router(state(), Duration::from_secs(4)),
        admission_review(pod.clone(), "CREATE", false),
    )
    .await;
    assert_eq!(r["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(r["kind"], "AdmissionReview");
    assert_eq!(r["response"]["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002");
    assert_eq!(r["response"]["allowed"], true);
    assert_eq!(r["response"]["patchType"], "JSONPatch");
    let out = apply_response(&pod, &r);
    assert_eq!(out["spec"]["initContainers"][0]["restartPolicy"], "Always");
}

#[tokio::test]
async fn dry_run_is_answered_the_same_way() {
    let pod = trainer_pod().gpus(1).json();
    let app = router(state(), Duration::from_secs(4));
    let wet = review(app.clone(), admission_review(pod.clone(), "CREATE", false)).await;
    let dry = review(app, admission_review(pod, "CREATE", true)).await;
    assert_eq!(wet["response"]["patch"], dry["response"]["patch"]);
}

#[tokio::test]
async fn bad_annotations_admit_with_a_warning_and_the_error_annotation() {
    let pod = bare_pod().annotate("memguard.io/batch-size", "lots").json();
    let r = review(
        router(state(), Duration::from_secs(4)),
        admission_review(pod.clone(), "CREATE", false),
    )
    .await;
    assert_eq!(r["response"]["allowed"], true);
    let warnings = r["response"]["warnings"].as_array().expect("warnings");
    assert!(
        warnings
            .iter()
            .all(|w| w.as_str().is_some_and(|w| w.chars().count() <= 120))
    );
    let out = apply_response(&pod, &r);
    assert!(out["metadata"]["annotations"]["memguard.io/error"].is_string());
}

#[tokio::test]
async fn other_operations_and_non_pods_are_allowed_untouched() {
    let app = router(state(), Duration::from_secs(4));
    let update = review(
        app.clone(),
        admission_review(trainer_pod().json(), "UPDATE", false),
    )
    .await;
    assert_eq!(update["response"]["allowed"], true);
    assert!(update["response"].get("patch").is_none());
    let broken = json!({"metadata": {"name": "x"}, "spec": {"containers": "not a list"}});
    let r = review(app, admission_review(broken, "CREATE", false)).await;
    assert_eq!(r["response"]["allowed"], true);
    assert!(r["response"].get("patch").is_none());
    assert!(
        r["response"]["warnings"][0]
            .as_str()
            .is_some_and(|w| w.contains("not a valid Pod"))
    );
}

#[tokio::test]
async fn not_an_admission_review_is_a_400() {
    let app = router(state(), Duration::from_secs(4));
    for body in [
        "",
        "{}",
        "[1,2]",
        r#"{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1"}"#,
    ] {
        let (status, _) = post(app.clone(), body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body:?}");
    }
}

#[tokio::test]
async fn bodies_over_the_cap_are_refused() {
    let big = vec![b' '; MAX_BODY_BYTES + 1];
    let (status, _) = post(router(state(), Duration::from_secs(4)), big).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn health_endpoints_and_metrics() {
    let s = state();
    let app = router(s.clone(), Duration::from_secs(4));
    for path in ["/healthz", "/readyz"] {
        let response = app
            .clone()
            .oneshot(Request::get(path).body(Body::empty()).expect("request"))
            .await
            .expect("infallible");
        assert_eq!(response.status(), StatusCode::OK, "{path}");
    }
    review(
        app,
        admission_review(trainer_pod().gpus(1).json(), "CREATE", false),
    )
    .await;
    let response = metrics_router(s.metrics.clone())
        .oneshot(
            Request::get("/metrics")
                .body(Body::empty())
                .expect("request"),
        )
        .await
        .expect("infallible");
    let text = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let text = String::from_utf8_lossy(&text);
    assert!(
        text.contains("memguard_webhook_admission_requests_total{outcome=\"mutated\"} 1"),
        "{text}"
    );
}

/// The `memguard.io/estimate` annotation a review wrote.
fn estimate(pod: &Value, response: &Value) -> Value {
    let out = apply_response(pod, response);
    let text = out["metadata"]["annotations"]["memguard.io/estimate"]
        .as_str()
        .expect("an estimate annotation");
    serde_json::from_str(text).expect("JSON")
}

#[tokio::test]
async fn a_policy_swapped_in_by_the_watch_applies_to_the_next_review() {
    use crate::watch::policy::{Change, PolicyWatch};
    use kube::runtime::watcher::Event;
    use memguard_api::crd::{MemguardPolicy, MemguardPolicySpec};

    let s = state();
    let file = Arc::new(memguard_api::Policy::default());
    let mut watch = PolicyWatch::new(
        "default",
        None,
        crate::policy_sources::Overrides::default(),
        file,
        s.policy.clone(),
        s.metrics.clone(),
    );
    let app = router(s, Duration::from_secs(4));
    let pod = trainer_pod()
        .annotate(memguard_api::annotations::GRAD_CHECKPOINTING, "true")
        .gpus(1)
        .json();
    let before = estimate(
        &pod,
        &review(app.clone(), admission_review(pod.clone(), "CREATE", false)).await,
    );
    assert_eq!(before["fits"], true, "{before}");
    assert_eq!(before["steps"], json!([]), "fits as annotated: {before}");

    // `kubectl edit memguardpolicy default`: a quarter of the 80 GiB default only.
    let spec = serde_json::from_value(json!({"safetyRatio": 0.25})).expect("spec");
    let mut edited = MemguardPolicy::new("default", MemguardPolicySpec(spec));
    edited.metadata.generation = Some(2);
    assert_eq!(
        watch.handle(Event::Apply(edited)),
        Some(Change::Applied { generation: 2 })
    );

    let after = estimate(
        &pod,
        &review(app, admission_review(pod.clone(), "CREATE", false)).await,
    );
    let budget = |e: &Value| e["budget"].as_u64().expect("a budget");
    assert_eq!(
        budget(&after) * 90,
        budget(&before) * 25,
        "{before} {after}"
    );
    assert_ne!(after["steps"], json!([]), "downgraded to fit: {after}");
}

/// A profile store with a bug: every lookup panics.
struct PanickingProfiles;

impl crate::mutate::ProfileSource for PanickingProfiles {
    fn get(&self, _namespace: &str, _name: &str) -> Option<memguard_api::crd::MemoryProfile> {
        panic!("a bug in a profile lookup");
    }
}

#[tokio::test]
async fn a_panic_while_deciding_admits_the_pod_unchanged_and_the_server_goes_on() {
    let mut s = state();
    s.profiles = Arc::new(ClusterView::from_source(Arc::new(PanickingProfiles)));
    let app = router(s.clone(), Duration::from_secs(4));
    for _ in 0..2 {
        let r = review(
            app.clone(),
            admission_review(trainer_pod().gpus(1).json(), "CREATE", false),
        )
        .await;
        assert_eq!(r["response"]["allowed"], true);
        assert_eq!(r["response"]["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002");
        assert!(r["response"]["patch"].is_null(), "unchanged: {r}");
        assert_eq!(
            r["response"]["warnings"],
            json!([crate::review::INTERNAL_ERROR])
        );
    }
    let text = s.metrics.encode();
    assert!(
        text.contains("memguard_webhook_admission_requests_total{outcome=\"error\"} 2"),
        "{text}"
    );
    // What makes this hold in the shipped binary: a release profile that unwinds. With
    // `panic = "abort"` the first panic would take every in-flight review down with the process.
    let manifest = include_str!("../../../Cargo.toml");
    let release = manifest
        .split("[profile.release]")
        .nth(1)
        .and_then(|rest| rest.split("\n[").next())
        .unwrap_or_default();
    assert!(
        !release.contains("panic = \"abort\""),
        "the release profile must unwind:\n{release}"
    );
}

/// Issue 38: with an invalid policy at start the webhook is not ready, says why on `/readyz`,
/// stays live (a restart would not fix the policy), and admits every pod unchanged with a
/// warning instead of guarding it with a policy it could not read.
#[tokio::test]
async fn not_ready_with_an_invalid_policy_says_why_and_admits_pods_unchanged() {
    let why = "invalid policy in /etc/memguard/policy.yaml: defaultGpuMemory: `24` has no unit: \
               did you mean `24Gi`?";
    let s = AppState {
        not_ready: Some(why.into()),
        ..state()
    };
    let app = router(s.clone(), Duration::from_secs(4));
    let get = |path: &'static str| {
        let app = app.clone();
        async move {
            let response = app
                .oneshot(Request::get(path).body(Body::empty()).expect("request"))
                .await
                .expect("infallible");
            let status = response.status();
            let body = response
                .into_body()
                .collect()
                .await
                .expect("body")
                .to_bytes();
            (status, String::from_utf8_lossy(&body).into_owned())
        }
    };
    assert_eq!(
        get("/healthz").await.0,
        StatusCode::OK,
        "live: no restart loop"
    );
    let (status, body) = get("/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body, format!("not ready: {why}\n"));
    let pod = trainer_pod().gpus(1).json();
    let r = review(app, admission_review(pod, "CREATE", false)).await;
    assert_eq!(r["response"]["allowed"], true);
    assert!(r["response"].get("patch").is_none(), "unchanged: {r}");
    assert_eq!(r["response"]["warnings"], json!([review::NOT_READY]));
}
