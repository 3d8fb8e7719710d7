//! One admission searches the pod's command line for its launch once: the serving check, the
//! trainer's readers (model, knobs, config file, world size), the rewrite and the client
//! injection's "does it run Python?" all read that one classification
//! ([`memguard_api::pod::TrainerLaunch`]). Counted through the webhook's own `mutate`, with the
//! launch reader's per-thread count (feature `search-count` of memguard-api).

use k8s_openapi::api::core::v1::Pod;
use memguard_api::Policy;
use memguard_api::launch::launcher::SEARCHES;
use memguard_webhook::{ClusterView, Outcome, mutate};
use serde_json::{Value, json};

fn pod(annotations: Value, container: Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "p", "namespace": "ml",
            "labels": {"memguard.io/enabled": "true"},
            "annotations": annotations,
        },
        "spec": {
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "containers": [container],
        },
    }))
    .expect("a pod")
}

/// The outcome of admitting `pod`, and how many command-line searches it took.
fn admit(pod: &Pod) -> (Outcome, usize) {
    SEARCHES.with(|n| n.set(0));
    let outcome = mutate(pod, &Policy::default(), &ClusterView::default());
    (outcome, SEARCHES.with(|n| n.get()))
}

fn gpu() -> Value {
    json!({"limits": {"nvidia.com/gpu": "1", "memory": "64Gi"}})
}

#[test]
fn an_hf_trainer_is_admitted_on_one_search() {
    let p = pod(
        json!({}),
        json!({
            "name": "trainer", "image": "t", "resources": gpu(),
            "command": ["torchrun", "--nproc_per_node", "1", "train.py"],
            "args": ["--model_name_or_path", "Qwen/Qwen2.5-0.5B",
                     "--per_device_train_batch_size", "4", "--max_seq_length", "1024"],
        }),
    );
    let (outcome, searches) = admit(&p);
    let Outcome::Mutated(m) = &outcome else {
        panic!("{outcome:?}");
    };
    // The client went in: the Python answer came from the same search.
    assert!(m.client.is_some(), "{outcome:?}");
    assert_eq!(searches, 1, "{outcome:?}");
}

#[test]
fn a_trainer_in_a_shell_script_with_its_env_is_admitted_on_one_search() {
    let p = pod(
        json!({}),
        json!({
            "name": "trainer", "image": "t", "resources": gpu(),
            "env": [{"name": "MODEL", "value": "Qwen/Qwen2.5-0.5B"}],
            "command": ["bash", "-c"],
            "args": ["pip install -q x && accelerate launch train.py \
                      --model_name_or_path $MODEL --per_device_train_batch_size 2"],
        }),
    );
    let (outcome, searches) = admit(&p);
    assert!(matches!(outcome, Outcome::Mutated(_)), "{outcome:?}");
    assert_eq!(searches, 1, "{outcome:?}");
}

#[test]
fn a_server_is_admitted_on_one_search() {
    let p = pod(
        json!({}),
        json!({
            "name": "server", "image": "vllm/vllm-openai:v0.10.1", "resources": gpu(),
            "command": ["sh", "-c",
                        "python download.py && vllm serve meta-llama/Llama-3.1-8B-Instruct \
                         --max-model-len 16384"],
        }),
    );
    let (outcome, searches) = admit(&p);
    assert!(matches!(outcome, Outcome::Served(_)), "{outcome:?}");
    assert_eq!(searches, 1, "{outcome:?}");
}

/// A pod whose config cannot be read is guarded at run time: the client goes into a Python
/// trainer, known from the same one search.
#[test]
fn a_guarded_trainer_is_admitted_on_one_search() {
    let p = pod(
        json!({}),
        json!({
            "name": "trainer", "image": "t", "resources": gpu(),
            "command": ["python", "train.py", "--epochs", "3"],
        }),
    );
    let (outcome, searches) = admit(&p);
    let Outcome::Guarded(g) = &outcome else {
        panic!("{outcome:?}");
    };
    assert!(g.client.is_some(), "{outcome:?}");
    assert_eq!(searches, 1, "{outcome:?}");
}
