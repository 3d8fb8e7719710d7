//! A model the policy adds (`spec.models`), end to end: the real `memguard-webhook` binary with a
//! `MemguardPolicy` manifest as its `--policy-file`, real TLS, real AdmissionReviews.

mod common;

use base64::Engine;
use common::{Ca, Conn, Server, admission_review, fixture_pod, write_secret};
use serde_json::{Value, json};

/// Qwen2.5-Coder-7B-Instruct: not a built-in model.
const NAME: &str = "acme-coder-7b";
const ALIAS: &str = "Qwen/Qwen2.5-Coder-7B-Instruct";

fn coder_config() -> Value {
    serde_json::from_str(include_str!(
        "../../api/fixtures/hf-config/qwen2.5-coder-7b-instruct.json"
    ))
    .expect("fixture")
}

/// The pod memguard sees after the review's patch.
fn patched(pod: &Value, review: &Value) -> Value {
    let mut out = pod.clone();
    if let Some(encoded) = review["response"]["patch"].as_str() {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .expect("base64");
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("JSON patch");
        json_patch::patch(&mut out, &patch).expect("the patch applies to the pod");
    }
    out
}

/// The trainer's env after admission, as (name, value) pairs.
fn trainer_env(pod: &Value) -> Vec<(String, String)> {
    pod["spec"]["containers"][0]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| {
            Some((
                e["name"].as_str()?.to_string(),
                e["value"].as_str()?.to_string(),
            ))
        })
        .collect()
}

/// The LoRA fixture pod (one A10G, batch 8 × 4096 tokens) with its model given by `model`
/// annotations instead of `memguard.io/model: llama-3-8b`.
fn pod_with(model: &[(&str, &str)]) -> Value {
    let mut pod = fixture_pod("single-gpu-lora");
    let annotations = pod["metadata"]["annotations"]
        .as_object_mut()
        .expect("annotations");
    annotations.remove("memguard.io/model");
    for (k, v) in model {
        annotations.insert(format!("memguard.io/{k}"), json!(v));
    }
    pod
}

async fn admit(conn: &mut Conn, pod: &Value, uid: &str) -> (Value, Value) {
    let (status, body) = conn
        .request("POST", "/mutate", admission_review(pod, uid))
        .await
        .expect("mutate");
    assert_eq!(status, 200);
    let review: Value = serde_json::from_slice(&body).expect("AdmissionReview");
    assert_eq!(review["response"]["allowed"], true, "{review}");
    (patched(pod, &review), review)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_model_named_by_name_or_alias_is_planned_like_its_spelled_out_shape() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = Ca::new();
    let (cert, key, _) = ca.leaf("memguard-webhook.memguard.svc");
    write_secret(dir.path(), 1, &cert, &key);
    // What a platform team `kubectl apply`s, as YAML.
    let manifest = json!({
        "apiVersion": "training.memguard.io/v1alpha1",
        "kind": "MemguardPolicy",
        "metadata": {"name": "default"},
        "spec": {"models": [{
            "name": NAME,
            "aliases": [ALIAS],
            "config": coder_config(),
            "params": 7_615_616_512u64,
        }]},
    });
    let file = dir.path().join("policy.yaml");
    std::fs::write(&file, serde_saphyr::to_string(&manifest).expect("YAML")).expect("write");
    let server = Server::start(
        dir.path(),
        &["--policy-file", file.to_str().expect("utf-8")],
    );
    let mut conn = Conn::open(server.https, ca.client_config())
        .await
        .expect("TLS handshake");

    let (by_name, _) = admit(&mut conn, &pod_with(&[("model", NAME)]), "by-name").await;
    let (by_alias, _) = admit(&mut conn, &pod_with(&[("model", ALIAS)]), "by-alias").await;
    let spelled = pod_with(&[
        ("hidden-size", "3584"),
        ("num-layers", "28"),
        ("num-heads", "28"),
        ("num-kv-heads", "4"),
        ("intermediate-size", "18944"),
        ("vocab-size", "152064"),
        ("tie-embeddings", "false"),
        ("model-params", "7615616512"),
    ]);
    let (by_shape, _) = admit(&mut conn, &spelled, "by-shape").await;

    let env = trainer_env(&by_name);
    let value = |name: &str| env.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str());
    // The plan had work to do: 8 × 4096 tokens of a 7.6B model do not fit an A10G as given.
    assert!(
        value("MEMGUARD_GRAD_CHECKPOINTING") == Some("true")
            || value("MEMGUARD_BATCH_SIZE") != Some("8"),
        "{env:?}"
    );
    assert!(value("MEMGUARD_ESTIMATE_BYTES").is_some(), "{env:?}");
    assert_eq!(trainer_env(&by_alias), env, "alias and name");
    assert_eq!(
        trainer_env(&by_shape),
        env,
        "the spelled-out shape and the name"
    );
    let estimate = |pod: &Value| pod["metadata"]["annotations"]["memguard.io/estimate"].clone();
    assert!(estimate(&by_name).is_string(), "{by_name}");
    assert_eq!(estimate(&by_alias), estimate(&by_name));
    assert_eq!(estimate(&by_shape), estimate(&by_name));

    // A name neither the policy nor the catalog knows: admitted unchanged, and the error says
    // the policy's models were looked at too.
    let unknown = pod_with(&[("model", "acme-coder-9b")]);
    let (admitted, review) = admit(&mut conn, &unknown, "unknown").await;
    let error = admitted["metadata"]["annotations"]["memguard.io/error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        error.contains(
            "unknown model `acme-coder-9b`: neither the policy's model nor in the built-in catalog"
        ),
        "{error}\n{review}"
    );
    drop(conn);
    assert!(server.terminate().success());
}
