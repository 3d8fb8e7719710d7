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

/// The server is read from the pod's one search of its command line, with the container's
/// literal env resolved as for a trainer: the kubelet's `$(NAME)` in an argv item, a shell's
/// `$NAME`. Before, the serving check searched without the env and took `$(MODEL)` for the
/// model's name (an unknown model: skipped), and missed a server whose engine is a variable.
#[test]
fn a_server_named_through_the_env_is_read_with_it() {
    let env = json!([
        {"name": "MODEL", "value": "meta-llama/Llama-3.1-8B-Instruct"},
        {"name": "ENGINE", "value": "vllm"},
    ]);
    let launches = [
        json!({"command": ["vllm", "serve", "$(MODEL)", "--max-model-len", "16384"]}),
        json!({"command": ["$(ENGINE)", "serve", "$(MODEL)", "--max-model-len", "16384"]}),
        json!({"command": ["sh", "-c", "exec vllm serve \"$MODEL\" --max-model-len 16384"]}),
    ];
    for launch in launches {
        let mut container = json!({
            "name": "server", "image": "vllm/vllm-openai:v0.10.1", "env": env,
            "resources": {"limits": {"nvidia.com/gpu": "1"}},
        });
        container["command"] = launch["command"].clone();
        let mut pod = server_pod(container);
        pod.spec.as_mut().expect("spec").node_selector = Some(BTreeMap::from([(
            "nvidia.com/gpu.product".to_string(),
            "NVIDIA-H100-80GB-HBM3".to_string(),
        )]));
        let out = crate::mutate(&pod, &Policy::default(), &ClusterView::default());
        let Outcome::Served(served) = &out else {
            panic!("{launch}: {out:?}");
        };
        assert_eq!(served.engine, Engine::Vllm, "{launch}");
        assert_eq!(served.model, "meta-llama/Llama-3.1-8B-Instruct", "{launch}");
        assert_eq!(served.fit.max_length, Some(16384), "{launch}");
        assert!(served.error.is_none(), "{launch}: {out:?}");
    }
}

/// Without the variable in the env, `$(MODEL)` is what the kubelet passes: no model memguard
/// knows, and the server is left alone with the reason.
#[test]
fn a_server_model_the_env_does_not_give_is_not_guessed() {
    let pod = server_pod(json!({
        "name": "server", "image": "vllm",
        "command": ["vllm", "serve", "$(MODEL)"],
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
    }));
    let out = crate::mutate(&pod, &Policy::default(), &ClusterView::default());
    let Outcome::Skipped { error, .. } = &out else {
        panic!("{out:?}");
    };
    assert!(error.contains("vllm server in server"), "{error}");
    assert!(error.contains("$(MODEL)"), "{error}");
}
