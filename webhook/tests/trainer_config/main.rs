//! The trainer's own config through the webhook's review (issue 27): coupled settings, and
//! every pod of a job. One test binary (each costs CI a link).

mod coupled;
mod flag_maps;
mod jobs;
mod provenance;

use base64::Engine;
use memguard_api::Policy;
use memguard_webhook::mutate::ClusterView;
use memguard_webhook::review::review;
use serde_json::{Value, json};

/// What the webhook's review makes of `pod` (in namespace `ml`) under `policy` and `view`: the
/// pod after its patch, and the warnings.
pub fn admitted(pod: &Value, policy: &Policy, view: &ClusterView) -> (Value, Vec<String>) {
    let body = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod["metadata"]["name"], "namespace": "ml", "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:ml:trainer"},
            "object": pod, "dryRun": false,
        },
    });
    let reviewed = review(body.to_string().as_bytes(), policy, view).expect("a review");
    let response = serde_json::to_value(&reviewed.review).expect("JSON")["response"].clone();
    let mut out = pod.clone();
    if let Some(encoded) = response["patch"].as_str() {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .expect("base64");
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).expect("a JSON patch");
        json_patch::patch(&mut out, &patch).expect("the patch applies");
    }
    (out, reviewed.warnings)
}

/// The `memguard.io/estimate` annotation of an admitted pod (`null` when there is none).
pub fn estimate_of(pod: &Value) -> Value {
    pod["metadata"]["annotations"]["memguard.io/estimate"]
        .as_str()
        .map(|t| serde_json::from_str(t).expect("JSON"))
        .unwrap_or(Value::Null)
}
