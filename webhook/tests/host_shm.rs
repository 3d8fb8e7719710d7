//! The memory-backed `/dev/shm` of a trainer with DataLoader workers: the patched pod carries
//! the volume and its mount, sized to the workers' batches, is valid Kubernetes
//! (`kubernetes-validate --strict`), and a second admission of it changes nothing; a trainer
//! that mounts its own `/dev/shm` keeps it.

use k8s_openapi::api::core::v1::Pod;
use memguard_api::{Policy, wellknown};
use memguard_webhook::{ClusterView, Outcome, mutate, patch};
use serde_json::{Value, json};

fn pod(extra_mount: Option<Value>) -> Value {
    let mut container = json!({
        "name": "t", "image": "x",
        "resources": {"limits": {"nvidia.com/gpu": "4", "memory": "200Gi"}},
        "command": ["torchrun", "--nproc_per_node", "4", "-m", "trl.scripts.sft"],
        "args": ["--model_name_or_path", "meta-llama/Llama-3.1-8B", "--use_peft",
                 "--per_device_train_batch_size", "8", "--max_length", "4096",
                 "--dataloader_num_workers", "4", "--output_dir", "/out"]
    });
    let mut spec = json!({"restartPolicy": "Never"});
    if let Some(mount) = extra_mount {
        container["volumeMounts"] = json!([mount]);
        spec["volumes"] = json!([{"name": "own-shm", "emptyDir": {"medium": "Memory"}}]);
    }
    spec["containers"] = json!([container]);
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "sft", "namespace": "ml", "labels": {"memguard.io/enabled": "true"},
                     "annotations": {"memguard.io/gpu-memory": "80Gi"}},
        "spec": spec
    })
}

fn admit(original: &Value) -> (Outcome, Value) {
    let pod: Pod = serde_json::from_value(original.clone()).expect("a Pod");
    let outcome = mutate(&pod, &Policy::default(), &ClusterView::default());
    let mut applied = original.clone();
    json_patch::patch(&mut applied, &patch::build(&pod, &outcome)).expect("applies");
    (outcome, applied)
}

#[test]
fn a_trainer_with_workers_gets_a_memory_backed_dev_shm_sized_to_their_batches() {
    let original = pod(None);
    let (outcome, applied) = admit(&original);
    let Outcome::Mutated(m) = &outcome else {
        panic!("{outcome:?}")
    };
    let size = m.shm.expect("a /dev/shm");
    let volume = applied["spec"]["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == wellknown::SHM_VOLUME)
        .cloned()
        .expect("the shm volume");
    assert_eq!(volume["emptyDir"]["medium"], "Memory");
    assert_eq!(
        volume["emptyDir"]["sizeLimit"],
        format!("{}Mi", size.0 >> 20)
    );
    let mounts = applied["spec"]["containers"][0]["volumeMounts"]
        .as_array()
        .expect("mounts");
    assert!(
        mounts
            .iter()
            .any(|m| m["mountPath"] == "/dev/shm" && m["name"] == wellknown::SHM_VOLUME),
        "{mounts:?}"
    );
    let estimate: Value = serde_json::from_str(
        applied["metadata"]["annotations"]["memguard.io/estimate"]
            .as_str()
            .expect("estimate"),
    )
    .expect("JSON");
    assert_eq!(estimate["host"]["shm"], size.0);

    // Admitted again, memguard's own output changes nothing.
    let (_, again) = admit(&applied);
    assert_eq!(again, applied);

    // Valid Kubernetes: the patched pod as the API server would store it.
    if let Some(tool) = memguard_e2e::kubernetes_validate() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("pod.json");
        std::fs::write(&file, applied.to_string()).expect("write");
        if let Err(out) = memguard_e2e::validate_manifests(&tool, &[file]) {
            panic!("kubernetes-validate rejected the pod with /dev/shm:\n{out}");
        }
    }
}

#[test]
fn a_trainer_that_mounts_its_own_dev_shm_keeps_it() {
    let original = pod(Some(json!({"name": "own-shm", "mountPath": "/dev/shm"})));
    let (outcome, applied) = admit(&original);
    let Outcome::Mutated(m) = &outcome else {
        panic!("{outcome:?}")
    };
    assert_eq!(m.shm, None);
    assert!(
        !applied.to_string().contains(wellknown::SHM_VOLUME),
        "{applied}"
    );
}
