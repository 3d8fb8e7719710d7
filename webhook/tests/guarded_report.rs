//! The next admission of a job admission cannot read plans on its trainer's report (issue 37,
//! done-when "the next admission of the same job plans on it"), through `mutate`: a stock HF
//! script whose only argument is a JSON file in a ConfigMap is Guarded (no plan); the sidecar's
//! summary of its run, built with the sidecar's own types, carries the trainer's report; the
//! profile controller learns it under the pod's launch key; the next admission of the same pod
//! is planned on it, the plan delivered as `MEMGUARD_*` env, every source
//! `profile:trainer-report`, and it agrees with the sidecar's plan at train start.

mod twice;

use k8s_openapi::api::core::v1::Pod;
use memguard_api::crd::{MemoryProfile, MemoryProfileStatus};
use memguard_api::train_start::TrainStartPolicy;
use memguard_api::{Policy, Signal, env};
use memguard_decide::reported::PROVENANCE;
use memguard_estimator::Bound;
use memguard_webhook::{ClusterView, Outcome, mutate};
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// A tiny Llama, full fine-tuning on the CPU, as the client reports it at train start.
fn tiny_llama() -> BTreeMap<String, f64> {
    memguard_decide::testutil::tiny_llama_report()
}

/// A limit (bytes) between what 4 and 8 rows of the tiny Llama need at the policy's level and
/// safety ratio: the plan must lower the micro-batch from 16.
fn tight_limit(policy: &Policy) -> u64 {
    let start = memguard_decide::trainer_config::training_config(&tiny_llama()).expect("a config");
    let at = |batch: u64| {
        let mut c = start.clone();
        c.batch_size = batch;
        c.grad_accumulation = 16 / batch;
        let e = memguard_estimator::estimate(&c).expect("estimate");
        let bound = Bound {
            level: Some(policy.estimate_level),
            learned: None,
        };
        bound.upper(&c, e.total, e.total).0
    };
    ((at(4) + at(8)) as f64 / 2.0 / policy.safety_ratio) as u64
}

/// The transformers examples' convention: every setting in a JSON file, its only argument.
fn json_script_pod(name: &str, limit: u64) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "uid": format!("uid-{name}"),
                     "labels": {"memguard.io/enabled": "true"}},
        "spec": {"restartPolicy": "Never",
            "containers": [{
                "name": "trainer", "image": "memguard-trainer:1",
                "command": ["python", "/job/train_json.py", "/config/train.json"],
                "resources": {"limits": {"memory": limit.to_string()}},
                "volumeMounts": [{"name": "config", "mountPath": "/config"}]
            }],
            "volumes": [{"name": "config", "configMap": {"name": "tiny-llama-json"}}]}
    })
}

use twice::admit_twice as admit;

fn sidecar_env(sidecar: &[(String, String)], name: &str) -> String {
    sidecar
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
        .unwrap_or_else(|| panic!("{name} not in the sidecar's env"))
}

/// `pod` (as admitted) finished, its sidecar's summary the one the sidecar writes for a trainer
/// that reported `knobs` at train start and got `plan`.
fn finished(
    applied: &Value,
    knobs: &BTreeMap<String, f64>,
    limit: u64,
    ts: &str,
    admitted: Option<&str>,
) -> Pod {
    let mut status = memguard_sidecar::state::Status {
        trainer_config: knobs.clone(),
        admitted_config: admitted
            .map(|a| memguard_api::signal::parse_admitted_config(a).0)
            .unwrap_or_default(),
        ..Default::default()
    };
    let policy = TrainStartPolicy::parse(ts).expect("the webhook's train-start settings");
    status.train_start = Some(memguard_sidecar::train_start::decide(
        knobs,
        Some(&policy),
        Some(limit),
    ));
    let summary = memguard_sidecar::summary::build(
        &status,
        &Signal::initial(16, 1, false),
        None,
        "trainer-exited",
    );
    let line = memguard_sidecar::summary::to_line(&summary);
    let mut pod = applied.clone();
    pod["status"] = json!({"phase": "Succeeded",
        "containerStatuses": [{"name": "trainer", "image": "x", "imageID": "", "ready": false,
            "restartCount": 0, "state": {"terminated": {"exitCode": 0, "reason": "Completed",
            "finishedAt": "2026-11-29T06:00:00Z"}}}],
        "initContainerStatuses": [{"name": "memguard-sidecar", "image": "x", "imageID": "",
            "ready": false, "restartCount": 0, "state": {"terminated": {"exitCode": 0,
            "reason": "Completed", "finishedAt": "2026-11-29T06:00:01Z",
            "message": line.trim_end()}}}]});
    serde_json::from_value(pod).expect("a Pod")
}

/// The controller's observe/update of `pod` into a view holding the profile it writes.
fn learn(pod: &Pod, view: &ClusterView) -> (ClusterView, memguard_learn::observe::Observation) {
    let obs = memguard_learn::observe::try_observe(pod, &Policy::default(), view.cluster())
        .expect("a Guarded pod with a full report is observed");
    let status = memguard_learn::update::apply(&MemoryProfileStatus::default(), &obs);
    let mut profile = MemoryProfile::new(&obs.key.name, obs.key.spec.clone());
    profile.status = Some(status);
    let mut learnt = view.clone();
    learnt.insert(profile);
    (learnt, obs)
}

#[test]
fn a_guarded_jobs_report_is_learnt_and_the_next_admission_plans_on_it() {
    let policy = Policy::default();
    let limit = tight_limit(&policy);
    let pod = json_script_pod("tiny-1", limit);
    let view = ClusterView::default();

    // First admission: the model cannot be read, the pod is Guarded, nothing planned.
    let (first, applied) = admit(&pod, &view);
    let Outcome::Guarded(guarded) = &first else {
        panic!("guarded: {first:?}")
    };
    let ts = sidecar_env(&guarded.sidecar.env, env::SIDECAR_TRAIN_START);

    // Its run: the trainer reports its config at train start; the sidecar plans on it.
    let done = finished(&applied, &tiny_llama(), limit, &ts, None);
    let (learnt, obs) = learn(&done, &view);
    let typed: Pod = serde_json::from_value(pod.clone()).expect("a Pod");
    let launch = memguard_decide::key::launch_key(&typed, &policy).expect("a launch key");
    assert_eq!(obs.key.name, launch.name, "learnt under the launch key");
    assert_eq!(obs.key.spec, launch.spec);
    // Configured at 16 × 1, run at the train-start plan's micro-batch.
    assert_eq!(
        obs.knobs.batch_size,
        obs.summary
            .as_ref()
            .and_then(|s| s.train_start.as_ref())
            .and_then(|p| p.batch_size)
    );
    assert_eq!(obs.ran.batch_size * obs.ran.grad_accumulation, 16);
    let train_start_batch = obs
        .summary
        .as_ref()
        .and_then(|s| s.train_start.as_ref())
        .and_then(|p| p.batch_size)
        .expect("the sidecar planned at train start");
    assert!(train_start_batch < 16, "the limit is tight");

    // The next pod of the job: planned on the report, its launch searched once.
    let typed_next: Pod = serde_json::from_value(json_script_pod("tiny-2", limit)).expect("a Pod");
    memguard_api::launch::launcher::SEARCHES.with(|n| n.set(0));
    let _ = mutate(&typed_next, &policy, &learnt);
    assert_eq!(
        memguard_api::launch::launcher::SEARCHES.with(|n| n.get()),
        1
    );
    let (next, applied) = admit(&json_script_pod("tiny-2", limit), &learnt);
    let Outcome::Mutated(m) = &next else {
        panic!("planned: {next:?}")
    };
    assert!(
        m.warnings[0].contains("planned on the trainer's report of tiny-1"),
        "{:?}",
        m.warnings
    );
    let env: BTreeMap<&str, &str> = m
        .trainer_env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let batch: u64 = env[env::BATCH_SIZE].parse().expect("a batch");
    let accumulation: u64 = env[env::GRAD_ACCUMULATION]
        .parse()
        .expect("an accumulation");
    assert!(batch < 16, "{env:?}");
    assert_eq!(
        batch * accumulation,
        16,
        "the effective batch kept: {env:?}"
    );
    // The same mapping and the same budget: admission's plan is the sidecar's at train start.
    assert_eq!(batch, train_start_batch);
    assert_eq!(m.plan.config.seq_length, 512);
    for (knob, source) in &m.estimate.sources {
        assert_eq!(source, PROVENANCE, "{knob}");
    }
    assert!(m.estimate.sources.contains_key("batch-size"));
    assert!(m.client.is_some(), "the client applies the env");
    assert_eq!(m.command_line, None, "the launch is not rewritten");
    assert_eq!(
        applied["spec"]["containers"][0]["command"],
        pod["spec"]["containers"][0]["command"]
    );
    // The sidecar starts where admission planned, and still plans at train start.
    assert_eq!(
        sidecar_env(&m.sidecar.env, env::BATCH_SIZE),
        batch.to_string()
    );
    let ts = sidecar_env(&m.sidecar.env, env::SIDECAR_TRAIN_START);
    let again = memguard_sidecar::train_start::decide(
        &tiny_llama(),
        Some(&TrainStartPolicy::parse(&ts).expect("settings")),
        Some(limit),
    );
    assert_eq!(again.batch_size, Some(batch), "{}", again.reason);

    // The planned pod keeps the launch key: its own run is learnt under the same profile.
    let planned: Pod = serde_json::from_value(applied.clone()).expect("a Pod");
    assert_eq!(
        memguard_decide::key::launch_key(&planned, &policy)
            .expect("a key")
            .name,
        launch.name
    );
    // The sidecar compares the report with the launch as configured (the env plan is applied
    // by re-chunking): the same report is no mismatch, and the run calibrates.
    let admitted = sidecar_env(&m.sidecar.env, env::SIDECAR_ADMITTED_CONFIG);
    assert!(
        admitted.contains("batch-size=16") && admitted.contains("grad-accumulation=1"),
        "{admitted}"
    );
    let done = finished(&applied, &tiny_llama(), limit, &ts, Some(&admitted));
    let (_, second_obs) = learn(&done, &learnt);
    assert_eq!(second_obs.key.name, launch.name);
    let summary = second_obs.summary.as_ref().expect("a summary");
    assert!(summary.config_mismatch.is_empty(), "{summary:?}");
    assert_eq!(
        second_obs.estimate,
        Some(m.plan.estimate.total),
        "it calibrates"
    );
}

#[test]
fn a_report_missing_a_shape_value_leaves_the_pod_guarded_and_says_which() {
    let policy = Policy::default();
    let limit = tight_limit(&policy);
    let pod = json_script_pod("tiny-1", limit);
    let typed: Pod = serde_json::from_value(pod.clone()).expect("a Pod");
    let launch = memguard_decide::key::launch_key(&typed, &policy).expect("a launch key");
    let mut knobs = tiny_llama();
    knobs.remove("vocab-size");
    // A run whose report lacks a value is not learnt as a run (the estimate could not be
    // made), and says why.
    let (first, applied) = admit(&pod, &ClusterView::default());
    let Outcome::Guarded(g) = &first else {
        panic!("guarded: {first:?}")
    };
    let ts = sidecar_env(&g.sidecar.env, env::SIDECAR_TRAIN_START);
    let not = memguard_learn::observe::try_observe(
        &finished(&applied, &knobs, limit, &ts, None),
        &policy,
        ClusterView::default().cluster(),
    )
    .expect_err("not observed");
    assert!(format!("{not:?}").contains("vocab-size"), "{not:?}");
    // A profile that holds such a report (written by hand, or by an older trainer): Guarded.
    let mut status = MemoryProfileStatus::default();
    status.record_trainer_report(memguard_api::crd::TrainerReport {
        pod: "tiny-0".into(),
        uid: "uid-tiny-0".into(),
        finished_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(100).expect("in range"),
        ),
        config: knobs,
        mismatch: Vec::new(),
    });
    let mut profile = MemoryProfile::new(&launch.name, launch.spec.clone());
    profile.status = Some(status);
    let mut view = ClusterView::default();
    view.insert(profile);
    let (outcome, _) = admit(&pod, &view);
    let Outcome::Guarded(g) = &outcome else {
        panic!("still guarded: {outcome:?}")
    };
    assert!(
        g.reason.contains("report of tiny-0") && g.reason.contains("not reported: vocab-size"),
        "{}",
        g.reason
    );
    assert!(
        g.warnings.iter().any(
            |w| w.contains("not planned on the trainer's report of tiny-0")
                && w.contains("vocab-size")
        ),
        "{:?}",
        g.warnings
    );
}

/// A GPU job admission cannot read, pinned to one GPU product: keyed by its launch on that
/// product, and planned on its report against the per-device budget admission computes, which
/// the sidecar's train-start plan then aims at too.
#[test]
fn a_guarded_gpu_job_is_planned_on_its_report_against_the_per_device_budget() {
    let policy = Policy::default();
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "gpu-1", "namespace": "ml", "uid": "uid-gpu-1",
                     "labels": {"memguard.io/enabled": "true"}},
        "spec": {"restartPolicy": "Never",
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
            "containers": [{
                "name": "trainer", "image": "memguard-trainer:1",
                "command": ["python", "/job/train_json.py", "/config/train.json"],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                "volumeMounts": [{"name": "config", "mountPath": "/config"}]
            }],
            "volumes": [{"name": "config", "configMap": {"name": "llama-7b-json"}}]}
    });
    let typed: Pod = serde_json::from_value(pod.clone()).expect("a Pod");
    let launch = memguard_decide::key::launch_key(&typed, &policy).expect("a launch key");
    assert_eq!(launch.spec.device, "NVIDIA-A100-SXM4-80GB");
    // A 1B Llama (Llama-3.2-1B's shape) in bf16 mixed precision, 8 rows of 4096 tokens: its
    // activations and logits are far over 80 GB.
    let mut knobs = tiny_llama();
    for (k, v) in [
        ("gpu", 1.0),
        ("bf16", 1.0),
        ("batch-size", 8.0),
        ("seq-length", 4096.0),
        ("hidden-size", 2048.0),
        ("num-layers", 16.0),
        ("num-heads", 32.0),
        ("num-kv-heads", 8.0),
        ("head-dim", 64.0),
        ("intermediate-size", 8192.0),
        ("vocab-size", 128_256.0),
        ("tie-embeddings", 1.0),
        ("params", 1_235_814_400.0),
        ("trainable-params", 1_235_814_400.0),
    ] {
        knobs.insert(k.into(), v);
    }
    let mut status = MemoryProfileStatus::default();
    status.record_trainer_report(memguard_api::crd::TrainerReport {
        pod: "gpu-0".into(),
        uid: "uid-gpu-0".into(),
        finished_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(100).expect("in range"),
        ),
        config: knobs.clone(),
        mismatch: Vec::new(),
    });
    let mut profile = MemoryProfile::new(&launch.name, launch.spec.clone());
    profile.status = Some(status);
    let mut view = ClusterView::default();
    view.insert(profile);
    let (outcome, _) = admit(&pod, &view);
    let Outcome::Mutated(m) = &outcome else {
        panic!("planned: {outcome:?}")
    };
    let budget = m.budget.as_ref().expect("a per-device budget");
    assert_eq!(m.plan.config.device, memguard_estimator::Device::Cuda);
    assert!(m.plan.fits, "{:?}", m.warnings);
    assert!(
        m.plan.config.batch_size < 8 || m.plan.config.grad_checkpointing,
        "8 rows of 4096 do not fit 80 GB unchanged: {:?}",
        m.plan.steps
    );
    assert_eq!(
        m.plan.config.batch_size * m.plan.config.grad_accumulation,
        8,
        "effective batch kept"
    );
    // The sidecar plans the same report against the same per-device budget at train start.
    let ts = sidecar_env(&m.sidecar.env, env::SIDECAR_TRAIN_START);
    let settings = TrainStartPolicy::parse(&ts).expect("settings");
    assert_eq!(settings.budget_bytes, Some(budget.bytes.0));
    let at_start = memguard_sidecar::train_start::decide(&knobs, Some(&settings), None);
    assert!(at_start.planned, "{}", at_start.reason);
    assert_eq!(
        (at_start.batch_size, at_start.grad_checkpointing),
        (
            Some(m.plan.config.batch_size),
            Some(m.plan.config.grad_checkpointing)
        ),
        "{}",
        at_start.reason
    );
}

/// A Guarded pod's own `safety-ratio` and `allow-quality`, honoured at admission for a pod it
/// plans, reach its sidecar's train-start settings too; one that does not parse is said.
#[test]
fn a_guarded_pods_own_options_reach_its_train_start_settings() {
    let policy = Policy::default();
    assert!(
        !policy.floors.allow_quality,
        "the default policy keeps quality"
    );
    let settings = |annotations: Value| {
        let mut pod = json_script_pod("tiny-opts", 1 << 30);
        pod["metadata"]["annotations"] = annotations;
        let (outcome, _) = admit(&pod, &ClusterView::default());
        let Outcome::Guarded(g) = outcome else {
            panic!("guarded: {outcome:?}")
        };
        let ts = sidecar_env(&g.sidecar.env, env::SIDECAR_TRAIN_START);
        (
            TrainStartPolicy::parse(&ts).expect("settings"),
            g.warnings.clone(),
        )
    };

    let (own, _) = settings(json!({
        "memguard.io/safety-ratio": "0.6",
        "memguard.io/allow-quality": "true"
    }));
    assert_eq!(own.safety_ratio, Some(0.6));
    assert!(own.floors.expect("floors").allow_quality);

    let (none, _) = settings(json!({}));
    assert_eq!(none.safety_ratio, Some(policy.safety_ratio));
    assert!(!none.floors.expect("floors").allow_quality);

    let (bad, warnings) = settings(json!({"memguard.io/safety-ratio": "2"}));
    assert_eq!(bad.safety_ratio, Some(policy.safety_ratio));
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("memguard.io/safety-ratio: 2 is not in (0, 1]")),
        "{warnings:?}"
    );
}
