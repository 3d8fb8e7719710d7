//! A kill while loading, at the next admission (issue 39), through `mutate`: nothing that
//! lowers a load is safe to rewrite (the load dtype is what trains; FSDP's
//! `cpu_ram_efficient_loading` lowers nothing under transformers 5, measured by
//! bench/host/ram_efficient_load.py), so the launch is kept, the host verdict withdrawn, and
//! the warning says to raise the limit and names the dtype as the user's choice.

mod twice;

use k8s_openapi::api::core::v1::Pod;
use memguard_api::crd::{MemoryProfile, MemoryProfileStatus};
use memguard_api::phase::TrainerPhase;
use memguard_api::{Cluster, Policy};
use memguard_webhook::ClusterView;
use serde_json::{Value, json};

/// A TRL launch on 4 GPUs under FSDP, loading in fp32, its inline FSDP config asking for
/// RAM-efficient loading.
fn fsdp_pod(launcher: &[&str]) -> Value {
    let mut command: Vec<&str> = launcher.to_vec();
    command.extend(["-m", "trl.scripts.sft"]);
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "sft", "namespace": "ml", "labels": {"memguard.io/enabled": "true"},
                     "annotations": {"memguard.io/gpu-memory": "80Gi"}},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "trainer", "image": "x",
            "resources": {"limits": {"nvidia.com/gpu": "4", "memory": "512Gi"}},
            "command": command,
            "args": ["--model_name_or_path", "Qwen/Qwen2.5-0.5B",
                     "--per_device_train_batch_size", "2", "--max_length", "1024",
                     "--dtype", "float32", "--fsdp", "full_shard",
                     "--fsdp_config",
                     "{\"state_dict_type\": \"SHARDED_STATE_DICT\", \"cpu_ram_efficient_loading\": true}",
                     "--output_dir", "/out"]
        }]}
    })
}

/// The view with `pod`'s profile, whose last OOM kill came while loading.
fn view_with_load_kill(pod: &Value) -> ClusterView {
    let typed: Pod = serde_json::from_value(pod.clone()).expect("a Pod");
    let key =
        memguard_decide::pod_key(&typed, &Policy::default(), Cluster::default()).expect("a key");
    let mut profile = MemoryProfile::new(&key.name, key.spec);
    let mut status = MemoryProfileStatus::default();
    status.record_oom(memguard_api::crd::OomEvent {
        pod: "sft-earlier".into(),
        at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(100).expect("in range"),
        ),
        reason: "OOMKilled".into(),
        config: Default::default(),
        phase: Some(TrainerPhase::Load),
    });
    status.oom_kill_phases.count(TrainerPhase::Load);
    profile.status = Some(status);
    let mut view = ClusterView::default();
    view.insert(profile);
    view
}

use twice::admit_mutated as admit;

#[test]
fn a_kill_at_load_keeps_the_launch_and_its_dtype_and_says_what_to_raise() {
    for launcher in [
        &["accelerate", "launch", "--use_fsdp", "--num_processes", "4"][..],
        &["torchrun", "--nproc_per_node", "4"][..],
    ] {
        let pod = fsdp_pod(launcher);
        let (m, applied) = admit(&pod, &view_with_load_kill(&pod));
        assert_eq!(
            applied["spec"]["containers"][0]["args"], pod["spec"]["containers"][0]["args"],
            "{launcher:?}: nothing written"
        );
        let host = m.estimate.host.as_ref().expect("a host plan");
        assert!(host.rewritten.is_empty(), "{:?}", host.rewritten);
        assert_eq!(host.fits, None, "the kill proved the load figure low");
        assert_eq!(
            host.sources["ram-efficient-loading"],
            memguard_api::coupled::INERT_AT_LOAD,
            "{launcher:?}: read, and counted as every rank loading"
        );
        assert!(
            m.warnings.iter().any(|w| w.contains("while loading")
                && w.contains("raise limits.memory")
                && w.contains("changes numerics")),
            "{:?}",
            m.warnings
        );
    }
}
