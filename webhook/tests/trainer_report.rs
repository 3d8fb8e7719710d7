//! The next admission plans on what the trainer reported (issue 37, item 4), through `mutate`
//! with a `MemoryProfile` in the cluster view: a knob admission could not read is planned on
//! the trainer's report and never written into its launch; a knob the trainer ran otherwise
//! than its launch says is planned on the report, the launch kept, and the admission says so.

mod twice;

use k8s_openapi::api::core::v1::Pod;
use memguard_api::crd::{MemoryProfile, MemoryProfileStatus, TrainerReport};
use memguard_api::{Cluster, Policy, env};
use memguard_webhook::ClusterView;
use serde_json::{Value, json};

/// A bespoke `train.py` with `TrainingArguments`' flags on one 80 GB GPU; what it does not
/// pass, its own parser sets.
fn script_pod(flags: &[&str]) -> Value {
    let mut args: Vec<&str> = vec![
        "--model_name_or_path",
        "Qwen/Qwen2.5-0.5B",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "4",
        "--output_dir",
        "/out",
    ];
    args.extend(flags);
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "sft", "namespace": "ml",
                     "labels": {"memguard.io/enabled": "true"},
                     "annotations": {"memguard.io/gpu-memory": "80Gi"}},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "trainer", "image": "x",
            "resources": {"limits": {"nvidia.com/gpu": "1"}},
            "command": ["python", "train.py"],
            "args": args
        }]}
    })
}

/// The view with the pod's profile, whose latest run reported `config` (`mismatch`: where
/// admission believed otherwise).
fn view_with_report(pod: &Value, config: &[(&str, f64)], mismatch: &[&str]) -> ClusterView {
    let typed: Pod = serde_json::from_value(pod.clone()).expect("a Pod");
    let key =
        memguard_decide::pod_key(&typed, &Policy::default(), Cluster::default()).expect("a key");
    let mut profile = MemoryProfile::new(&key.name, key.spec);
    let mut status = MemoryProfileStatus::default();
    status.record_trainer_report(TrainerReport {
        pod: "sft-earlier".into(),
        uid: "uid-earlier".into(),
        finished_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(100).expect("in range"),
        ),
        config: config.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        mismatch: mismatch.iter().map(|k| k.to_string()).collect(),
    });
    profile.status = Some(status);
    let mut view = ClusterView::default();
    view.insert(profile);
    view
}

use twice::admit_mutated as admit;

fn sidecar_env<'a>(m: &'a memguard_webhook::Mutation, name: &str) -> Option<&'a str> {
    m.sidecar
        .env
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

#[test]
fn a_sequence_admission_could_not_read_is_planned_on_the_trainers_report() {
    let pod = script_pod(&[]);
    // Without a profile: the sequence is unknown, the launch unplanned.
    let (before, _) = admit(&pod, &ClusterView::default());
    assert!(before.estimate.unknown.contains_key("seq-length"));
    assert_eq!(before.estimate.fits, None);

    let view = view_with_report(&pod, &[("seq-length", 1024.0), ("batch-size", 2.0)], &[]);
    let (m, applied) = admit(&pod, &view);
    assert_eq!(
        m.estimate.sources.get("seq-length").map(String::as_str),
        Some("profile:trainer-report")
    );
    assert!(
        !m.estimate.unknown.contains_key("seq-length"),
        "{:?}",
        m.estimate.unknown
    );
    assert_eq!(m.estimate.fits, Some(true), "planned now");
    assert_eq!(m.plan.config.seq_length, 1024);
    assert_eq!(m.estimate.config["seq-length"], "1024");
    // Not a value read from the launch, and nothing written into it.
    assert!(!m.estimate.read.contains_key("seq-length"));
    assert_eq!(
        applied["spec"]["containers"][0]["args"],
        pod["spec"]["containers"][0]["args"]
    );
    // The sidecar compares the next report with the value planned on.
    let admitted = sidecar_env(&m, env::SIDECAR_ADMITTED_CONFIG).expect("admitted config");
    assert!(admitted.contains("seq-length=1024"), "{admitted}");
    assert!(
        m.warnings
            .iter()
            .any(|w| w.contains("planned on the trainer's report for seq-length 1024")),
        "{:?}",
        m.warnings
    );
}

#[test]
fn a_read_sequence_the_trainer_ran_otherwise_is_planned_on_the_report_with_a_warning() {
    let pod = script_pod(&["--max_length", "512"]);
    let view = view_with_report(&pod, &[("seq-length", 1024.0)], &["seq-length"]);
    let (m, applied) = admit(&pod, &view);
    assert_eq!(m.plan.config.seq_length, 1024, "planned on what runs");
    assert_eq!(
        m.estimate.read.get("seq-length").map(String::as_str),
        Some("512"),
        "what the launch says is kept as read"
    );
    let args = applied["spec"]["containers"][0]["args"].clone();
    assert_eq!(
        args, pod["spec"]["containers"][0]["args"],
        "the launch kept"
    );
    assert!(
        m.warnings
            .iter()
            .any(|w| w.contains("the trainer ran seq-length 1024 where the launch says 512")),
        "{:?}",
        m.warnings
    );
    // The same figure as a pod that says 1024 itself.
    let (said, _) = admit(
        &script_pod(&["--max_length", "1024"]),
        &ClusterView::default(),
    );
    assert_eq!(m.estimate.total, said.estimate.total);
}

#[test]
fn a_batch_filled_from_the_report_is_planned_as_env_and_never_written_into_the_launch() {
    let mut pod = script_pod(&["--max_length", "2048"]);
    // No batch flag: its script's parser sets it.
    let args = pod["spec"]["containers"][0]["args"]
        .as_array_mut()
        .expect("args");
    args.drain(2..4);
    pod["metadata"]["annotations"]["memguard.io/gpu-memory"] = json!("24Gi");
    let view = view_with_report(&pod, &[("batch-size", 64.0)], &[]);
    let (m, applied) = admit(&pod, &view);
    assert_eq!(
        m.estimate.sources.get("batch-size").map(String::as_str),
        Some("profile:trainer-report")
    );
    assert!(
        m.plan.config.batch_size < 64,
        "downgraded: {:?}",
        m.plan.config
    );
    let written = |name: &str| {
        m.trainer_env
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(
        written(env::BATCH_SIZE),
        Some(m.plan.config.batch_size.to_string()),
        "the plan reaches the trainer as env"
    );
    let after = applied["spec"]["containers"][0]["args"].clone();
    let said: Vec<&str> = after
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(!said.contains(&"--per_device_train_batch_size"), "{said:?}");
    assert!(
        said.windows(2)
            .any(|w| w == ["--gradient_accumulation_steps", "4"]),
        "{said:?}"
    );
    // The trainer stays configured at 64 × 4 (the client re-chunks to the env plan), and
    // reports that at train start: the sidecar compares it with that, not with the plan, or
    // a planned run would be flagged as a mismatch and never calibrate.
    let admitted = sidecar_env(&m, env::SIDECAR_ADMITTED_CONFIG).expect("admitted config");
    let knobs = memguard_api::signal::parse_admitted_config(admitted).0;
    assert_eq!(knobs.get("batch-size"), Some(&64.0), "{admitted}");
    assert_eq!(knobs.get("grad-accumulation"), Some(&4.0), "{admitted}");
}

/// A TRL launch on 4 GPUs with room in `limits.memory`: its host plan fits as estimated.
fn trl_pod() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "sft", "namespace": "ml", "labels": {"memguard.io/enabled": "true"},
                     "annotations": {"memguard.io/gpu-memory": "80Gi"}},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "trainer", "image": "x",
            "resources": {"limits": {"nvidia.com/gpu": "4", "memory": "512Gi"}},
            "command": ["torchrun", "--nproc_per_node", "4", "-m", "trl.scripts.sft"],
            "args": ["--model_name_or_path", "Qwen/Qwen2.5-0.5B",
                     "--per_device_train_batch_size", "2", "--max_length", "1024",
                     "--output_dir", "/out"]
        }]}
    })
}

/// The view with `pod`'s profile, whose last OOM kill came in `phase`.
fn view_with_kill(pod: &Value, phase: memguard_api::phase::TrainerPhase) -> ClusterView {
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
        phase: Some(phase),
    });
    status.oom_kill_phases.count(phase);
    profile.status = Some(status);
    let mut view = ClusterView::default();
    view.insert(profile);
    view
}

#[test]
fn a_kill_at_save_gets_model_only_checkpoints_even_where_the_estimate_fits() {
    use memguard_api::phase::TrainerPhase;
    let pod = trl_pod();
    let (fresh, untouched) = admit(&pod, &ClusterView::default());
    let host = fresh.estimate.host.as_ref().expect("a host plan");
    assert_eq!(host.fits, Some(true), "fits as estimated");
    assert_eq!(
        untouched["spec"]["containers"][0]["args"],
        pod["spec"]["containers"][0]["args"]
    );

    let (m, applied) = admit(&pod, &view_with_kill(&pod, TrainerPhase::Save));
    let args: Vec<String> =
        serde_json::from_value(applied["spec"]["containers"][0]["args"].clone()).expect("args");
    let line = args.join(" ");
    assert!(line.contains("save_only_model"), "{line}");
    let host = m.estimate.host.as_ref().expect("a host plan");
    assert_eq!(host.rewritten["save"].to, "true");
    assert!(
        m.warnings.iter().any(|w| w.contains("while saving")),
        "{:?}",
        m.warnings
    );

    // A kill at load: no rewrite, and no host verdict claimed.
    let (m, applied) = admit(&pod, &view_with_kill(&pod, TrainerPhase::Load));
    assert_eq!(
        applied["spec"]["containers"][0]["args"],
        pod["spec"]["containers"][0]["args"]
    );
    assert_eq!(m.estimate.host.as_ref().expect("host").fits, None);
    assert!(
        m.warnings.iter().any(|w| w.contains("while loading")),
        "{:?}",
        m.warnings
    );
}

/// The whole loop for a trainer whose config is a file in a ConfigMap (issue 37, item 4): the
/// sidecar's summary carries the trainer's report, the profile controller keys the finished pod
/// with the same cluster view admission has (ConfigMaps included) and learns the report, and
/// the next admission, reading that profile through `mutate`, plans on it.
#[test]
fn a_config_map_trainers_report_is_learnt_and_planned_on_by_the_next_admission() {
    use std::collections::BTreeMap;
    use std::sync::Arc;
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/config-files/axolotl-lora-8b.yml"),
    )
    .expect("fixture");
    let maps = memguard_api::cluster::ConfigMapList(BTreeMap::from([(
        ("ml".to_string(), "axolotl".to_string()),
        BTreeMap::from([("lora-8b.yml".to_string(), text)]),
    )]));
    let view = ClusterView::default().with_config_maps(Arc::new(maps));
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "train", "namespace": "ml", "uid": "uid-train",
                     "labels": {"memguard.io/enabled": "true"}},
        "spec": {"restartPolicy": "Never",
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
            "containers": [{
                "name": "trainer", "image": "x",
                "command": ["axolotl", "train", "/config/lora-8b.yml"],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                "volumeMounts": [{"name": "config", "mountPath": "/config"}]
            }],
            "volumes": [{"name": "config", "configMap": {"name": "axolotl"}}]}
    });
    let (first, _) = admit(&pod, &view);
    assert_eq!(
        first.plan.config.seq_length, 4096,
        "read from the ConfigMap"
    );

    // The run: the trainer reported a sequence of 2048 (say, its dataset's packing).
    let summary = json!({"version": 1, "downgrades": 0, "oom_events": 0, "max_level": "ok",
        "batch_size": 2, "grad_accumulation": 4, "exit_reason": "trainer-exited",
        "trainer_config": {"seq-length": 2048.0, "batch-size": 2.0},
        "config_mismatch": ["seq-length"]});
    let mut finished = pod.clone();
    finished["status"] = json!({"phase": "Succeeded",
        "containerStatuses": [{"name": "trainer", "image": "x", "imageID": "", "ready": false,
            "restartCount": 0, "state": {"terminated": {"exitCode": 0, "reason": "Completed",
            "finishedAt": "2026-11-29T06:00:00Z"}}}]});
    finished["status"]["initContainerStatuses"] = json!([{"name": "memguard-sidecar",
        "image": "x", "imageID": "", "ready": false, "restartCount": 0,
        "state": {"terminated": {"exitCode": 0, "reason": "Completed",
            "finishedAt": "2026-11-29T06:00:01Z", "message": summary.to_string()}}}]);
    let finished: Pod = serde_json::from_value(finished).expect("a Pod");
    let obs = memguard_learn::observe::try_observe(&finished, &Policy::default(), view.cluster())
        .expect("the controller keys it with the ConfigMaps");
    let status = memguard_learn::update::apply(&MemoryProfileStatus::default(), &obs);
    assert_eq!(
        status.trainer_report.as_ref().expect("learnt").mismatch,
        ["seq-length"]
    );
    let mut profile = MemoryProfile::new(&obs.key.name, obs.key.spec.clone());
    profile.status = Some(status);
    let mut learnt = view.clone();
    learnt.insert(profile);

    // The next pod of the job: admission finds the profile the controller wrote.
    let (next, _) = admit(&pod, &learnt);
    assert_eq!(next.plan.config.seq_length, 2048, "planned on what ran");
    assert!(
        next.warnings
            .iter()
            .any(|w| w.contains("the trainer ran seq-length 2048 where the launch says 4096")),
        "{:?}",
        next.warnings
    );
}
