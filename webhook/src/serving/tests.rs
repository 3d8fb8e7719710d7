use super::*;
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;

#[test]
fn fractions_are_written_in_the_engines_precision() {
    assert_eq!(fraction_text(Engine::Vllm, 0.48), "0.48");
    assert_eq!(fraction_text(Engine::Vllm, 0.5), "0.5");
    assert_eq!(fraction_text(Engine::Sglang, 0.375), "0.375");
    assert_eq!(fraction_text(Engine::Sglang, 0.9), "0.9");
}

fn server_pod(container: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "s", "namespace": "ml", "labels": {"memguard.io/enabled": "true"}},
        "spec": {"containers": [container]},
    }))
    .expect("a pod")
}

#[test]
fn a_server_without_a_gpu_is_told_why_and_left_alone() {
    let pod = server_pod(json!({
        "name": "server", "image": "vllm",
        "command": ["vllm", "serve", "meta-llama/Llama-3.1-8B"],
        "resources": {"limits": {"memory": "32Gi"}},
    }));
    let out = crate::mutate(&pod, &Policy::default(), &ClusterView::default());
    let Outcome::Skipped { error, .. } = &out else {
        panic!("{out:?}");
    };
    assert!(error.contains("GPU memory only"), "{error}");
}

#[test]
fn an_unreadable_server_line_names_its_flag() {
    let pod = server_pod(json!({
        "name": "server", "image": "vllm",
        "command": ["vllm", "serve", "meta-llama/Llama-3.1-8B", "--gpu-memory-utilization", "high"],
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
    }));
    let out = crate::mutate(&pod, &Policy::default(), &ClusterView::default());
    let Outcome::Skipped { error, .. } = &out else {
        panic!("{out:?}");
    };
    assert!(
        error.contains("--gpu-memory-utilization \"high\""),
        "{error}"
    );
    // And the patch only says so: the command line is the user's.
    let patch = crate::patch::build(&pod, &out);
    assert!(
        patch
            .0
            .iter()
            .all(|op| op.path().to_string().starts_with("/metadata"))
    );
}

#[test]
fn a_training_pod_is_not_a_server() {
    let pod = server_pod(json!({
        "name": "train", "image": "t",
        "command": ["python", "train.py", "--model", "x"],
    }));
    assert!(admit(&pod, &Policy::default(), &ClusterView::default()).is_none());
}
