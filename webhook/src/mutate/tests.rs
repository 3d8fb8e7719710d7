use super::*;
use crate::testutil::{PodBuilder, bare_pod, trainer_pod};
use memguard_api::PolicySpec;
use memguard_api::annotations as keys;
use memguard_api::crd::MemoryProfile;
use memguard_api::policy::SidecarMode;
use memguard_estimator::{Bytes, Device};

fn policy_with_products() -> Policy {
    let spec: PolicySpec = serde_json::from_value(serde_json::json!({
        "gpuMemory": {"NVIDIA-A10G": "24Gi", "NVIDIA-H100-80GB-HBM3": "80Gi", "NVIDIA-L4": "24Gi",
                      "Tesla-T4": "16Gi"},
        "envNames": {"batch-size": "PER_DEVICE_TRAIN_BATCH_SIZE"},
    }))
    .expect("valid policy");
    spec.resolved().expect("valid values")
}

fn run(pod: PodBuilder, policy: &Policy) -> Outcome {
    mutate(&pod.build(), policy, &ClusterView::default())
}

fn mutated(pod: PodBuilder, policy: &Policy) -> Mutation {
    match run(pod, policy) {
        Outcome::Mutated(m) => *m,
        other => panic!("expected a mutation, got {other:?}"),
    }
}

fn env_of<'a>(m: &'a Mutation, name: &str) -> Option<&'a str> {
    m.trainer_env
        .iter()
        .chain(&m.user_env)
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

fn annotation(m: &Mutation) -> serde_json::Value {
    serde_json::from_str(&m.estimate.to_json()).expect("estimate annotation is JSON")
}

/// One row per behaviour: the pod, and what must hold of the outcome.
#[test]
fn outcome_table() {
    type Check = fn(&Outcome);
    let policy = policy_with_products();
    let rows: Vec<(&str, PodBuilder, Check)> = vec![
        (
            "unlabelled pods are not memguard's",
            trainer_pod().unlabelled(),
            |o| assert_eq!(*o, Outcome::Unchanged),
        ),
        (
            "labelled without annotations is skipped with a hint",
            bare_pod(),
            |o| match o {
                Outcome::Skipped { error, warning } => {
                    assert!(error.contains("no training annotations"), "{error}");
                    assert!(warning.chars().count() <= MAX_WARNING_CHARS);
                }
                other => panic!("{other:?}"),
            },
        ),
        (
            "every annotation error is collected, not just the first",
            trainer_pod()
                .annotate(keys::BATCH_SIZE, "many")
                .annotate(keys::OPTIMIZER, "adamx")
                .annotate("memguard.io/seq-lenght", "4096"),
            |o| match o {
                Outcome::Skipped { error, warning } => {
                    for key in ["batch-size", "optimizer", "seq-lenght"] {
                        assert!(error.contains(key), "{key} missing from {error}");
                    }
                    assert!(warning.chars().count() <= MAX_WARNING_CHARS, "{warning}");
                }
                other => panic!("{other:?}"),
            },
        ),
        (
            "a named container that does not exist is skipped",
            trainer_pod().annotate(keys::CONTAINER, "nope"),
            |o| match o {
                Outcome::Skipped { error, .. } => assert!(error.contains("`nope`"), "{error}"),
                other => panic!("{other:?}"),
            },
        ),
        (
            "a pod without containers is skipped, not a panic",
            trainer_pod().spec("containers", serde_json::json!([])),
            |o| assert!(matches!(o, Outcome::Skipped { .. }), "{o:?}"),
        ),
    ];
    for (name, pod, check) in rows {
        let outcome = run(pod, &policy);
        eprintln!("row: {name}");
        check(&outcome);
    }
}

#[test]
fn trainer_is_the_named_container_else_the_gpu_one_else_the_first() {
    let policy = Policy::default();
    let rows: Vec<(&str, PodBuilder, &str, usize)> = vec![
        (
            "first by default",
            trainer_pod().container("logger"),
            "train",
            0,
        ),
        (
            "the one requesting a GPU",
            trainer_pod().container("gpu-worker").gpus(1),
            "gpu-worker",
            1,
        ),
        (
            "the annotation wins",
            trainer_pod()
                .container("gpu-worker")
                .gpus(1)
                .annotate(keys::CONTAINER, "train"),
            "train",
            0,
        ),
    ];
    for (name, pod, trainer, index) in rows {
        let m = mutated(pod, &policy);
        assert_eq!(
            (m.trainer.as_str(), m.trainer_index),
            (trainer, index),
            "{name}"
        );
    }
}

#[test]
fn gpu_budget_comes_from_annotation_then_product_then_policy_default() {
    let policy = policy_with_products();
    let rows: Vec<(&str, PodBuilder, Bytes, BudgetSource)> = vec![
        (
            "annotation beats the node selector",
            trainer_pod()
                .gpus(1)
                .node_selector("NVIDIA-A10G")
                .annotate(keys::GPU_MEMORY, "40Gi"),
            Bytes::gib(40),
            BudgetSource::Annotation,
        ),
        (
            "node selector product from the table",
            trainer_pod().gpus(1).node_selector("NVIDIA-A10G"),
            Bytes::gib(24),
            BudgetSource::GpuProduct("NVIDIA-A10G".into()),
        ),
        (
            "smallest of the affinity's candidates",
            trainer_pod()
                .gpus(1)
                .affinity(&[&["NVIDIA-H100-80GB-HBM3", "NVIDIA-A10G"], &["Tesla-T4"]]),
            Bytes::gib(16),
            BudgetSource::GpuProduct("Tesla-T4".into()),
        ),
        (
            "a term without a product means any product: policy default",
            trainer_pod().gpus(1).affinity(&[&["Tesla-T4"], &[]]),
            Bytes::gib(80),
            BudgetSource::PolicyDefault,
        ),
        (
            "nothing pinned: policy default",
            trainer_pod().gpus(1),
            Bytes::gib(80),
            BudgetSource::PolicyDefault,
        ),
    ];
    for (name, pod, memory, source) in rows {
        let m = mutated(pod, &policy);
        let b = m.budget.expect("GPU pods have a budget");
        assert_eq!(b.device_memory, memory, "{name}");
        assert_eq!(b.source, source, "{name}");
        assert_eq!(b.bytes, Bytes::from_f64(memory.as_f64() * 0.9), "{name}");
        assert_eq!(
            m.plan.budget, b.bytes,
            "{name}: the plan aims at the budget"
        );
    }
}

#[test]
fn unknown_product_falls_back_to_the_default_with_a_warning() {
    let m = mutated(
        trainer_pod().gpus(1).node_selector("NVIDIA-X9000"),
        &policy_with_products(),
    );
    assert_eq!(
        m.budget.expect("budget").source,
        BudgetSource::PolicyDefault
    );
    assert!(
        m.warnings.iter().any(|w| w.contains("NVIDIA-X9000")),
        "{:?}",
        m.warnings
    );
}

#[test]
fn cpu_budget_is_the_memory_limit_times_the_safety_ratio() {
    let m = mutated(
        trainer_pod()
            .memory_limit("64Gi")
            .annotate(keys::SAFETY_RATIO, "0.5"),
        &Policy::default(),
    );
    let b = m.budget.clone().expect("a limit gives a budget");
    assert_eq!(b.source, BudgetSource::MemoryLimit);
    assert_eq!(b.bytes, Bytes::gib(32));
    assert_eq!(annotation(&m)["device"], "cpu");
    assert_eq!(env_of(&m, env::BUDGET_BYTES), Some("34359738368"));
}

#[test]
fn no_limit_and_no_gpu_warns_that_nothing_can_be_guaranteed() {
    let m = mutated(trainer_pod(), &Policy::default());
    assert!(m.budget.is_none());
    assert!(m.plan.steps.is_empty(), "no budget, no downgrade");
    assert!(
        m.warnings.iter().any(|w| w.contains("no memory limit")),
        "{:?}",
        m.warnings
    );
    assert_eq!(env_of(&m, env::BUDGET_BYTES), None);
    assert_eq!(annotation(&m)["budget"], serde_json::Value::Null);
}

#[test]
fn explicit_device_beats_inference() {
    let m = mutated(
        trainer_pod()
            .memory_limit("64Gi")
            .annotate(keys::DEVICE, "cuda"),
        &Policy::default(),
    );
    assert_eq!(annotation(&m)["device"], "cuda");
    assert_eq!(
        m.budget.expect("budget").source,
        BudgetSource::PolicyDefault
    );
}

#[test]
fn world_size_defaults_to_the_pods_gpus_under_data_parallelism() {
    let pod = || {
        trainer_pod()
            .annotate(keys::METHOD, "full")
            .annotate(keys::PARALLELISM, "fsdp")
            .gpus(4)
    };
    let m = mutated(pod(), &Policy::default());
    assert_eq!(m.plan.config.world_size, 4);
    assert_eq!(annotation(&m)["config"]["world-size"], "4");
    let m = mutated(pod().annotate(keys::WORLD_SIZE, "16"), &Policy::default());
    assert_eq!(
        m.plan.config.world_size, 16,
        "an explicit world size is kept"
    );
    let m = mutated(trainer_pod().gpus(4), &Policy::default());
    assert_eq!(m.plan.config.world_size, 1, "no parallelism, no sharding");
}

#[test]
fn a_config_that_fits_is_left_as_annotated() {
    let m = mutated(
        trainer_pod().gpus(1).annotate(keys::GPU_MEMORY, "100Ti"),
        &Policy::default(),
    );
    assert!(m.plan.fits && m.plan.steps.is_empty());
    assert_eq!(env_of(&m, env::BATCH_SIZE), Some("4"));
    assert_eq!(env_of(&m, env::GRAD_CHECKPOINTING), Some("false"));
    assert!(m.warnings.is_empty(), "{:?}", m.warnings);
    assert_eq!(annotation(&m)["fits"], true);
}

#[test]
fn downgrades_are_written_to_env_and_keep_the_effective_batch() {
    // 8 × 8192 tokens per device on a 64 GiB card needs downgrading under any sane estimate,
    // and fits with checkpointing and a smaller batch (no quality cut).
    let m = mutated(
        trainer_pod()
            .gpus(1)
            .annotate(keys::BATCH_SIZE, "8")
            .annotate(keys::SEQ_LENGTH, "8192")
            .annotate(keys::GPU_MEMORY, "64Gi")
            .annotate(keys::ENV_MAP, "batch-size=BS,grad-accumulation=GA"),
        &Policy::default(),
    );
    assert!(!m.plan.steps.is_empty());
    assert!(m.plan.fits);
    let cfg = &m.plan.config;
    assert_eq!(cfg.seq_length, 8192, "no quality cut without permission");
    assert_eq!(
        cfg.batch_size * cfg.grad_accumulation,
        8,
        "effective batch kept"
    );
    assert_eq!(
        env_of(&m, env::BATCH_SIZE),
        Some(cfg.batch_size.to_string().as_str())
    );
    assert_eq!(env_of(&m, "BS"), Some(cfg.batch_size.to_string().as_str()));
    assert_eq!(
        env_of(&m, "GA"),
        Some(cfg.grad_accumulation.to_string().as_str())
    );
    assert_eq!(
        env_of(&m, env::ESTIMATE_BYTES),
        Some(m.plan.total().0.to_string().as_str())
    );
    let steps: Vec<&str> = m.plan.steps.iter().map(|s| s.rung.name()).collect();
    assert_eq!(annotation(&m)["steps"], serde_json::json!(steps));
    assert_eq!(m.warnings.len(), 1, "{:?}", m.warnings);
    assert!(m.warnings[0].chars().count() <= MAX_WARNING_CHARS);
    // The warning states what the first step saved.
    let first = &m.plan.steps[0];
    assert!(
        m.warnings[0].contains(&format!("{} -{}", first.rung.name(), first.saved)),
        "{:?}",
        m.warnings
    );
}

#[test]
fn a_config_that_cannot_fit_says_so() {
    let m = mutated(
        trainer_pod()
            .gpus(1)
            .annotate(keys::GPU_MEMORY, "1Gi")
            .annotate(keys::ALLOW_QUALITY, "true"),
        &Policy::default(),
    );
    assert!(!m.plan.fits);
    assert_eq!(annotation(&m)["fits"], false);
    // Every knob at its floor (the pod allows quality cuts): batch 1, checkpointing, the
    // shortest sequence.
    let floors = Policy::default().floors;
    assert_eq!(m.plan.config.batch_size, floors.batch_size);
    assert!(m.plan.config.grad_checkpointing);
    assert_eq!(m.plan.config.seq_length, floors.seq_length);
    let error = m.error.clone().expect("memguard.io/error");
    assert!(
        error.starts_with("cannot fit: needs ")
            && error.contains("of budget 921.60 MiB with every knob at its floor")
            && error.contains("smallest config tried: batch 1 × "),
        "{error}"
    );
    // The warning names the smallest config tried first: a cut to 120 characters keeps it.
    let tried = error
        .split_once("smallest config tried: ")
        .expect("named")
        .1
        .split("; ")
        .next()
        .expect("config");
    assert!(
        m.warnings.iter().any(|w| w.starts_with(&format!(
            "memguard: cannot fit; smallest config tried: {tried}; "
        ))),
        "{:?}",
        m.warnings
    );
    // And what was tried outside the knobs: nothing fits 1 GiB, the closest is named.
    assert!(error.contains("; nothing tried fits, closest: "), "{error}");

    assert!(
        m.warnings
            .iter()
            .all(|w| w.chars().count() <= MAX_WARNING_CHARS)
    );
    assert_eq!(env_of(&m, env::CANNOT_FIT), Some("true"));
    // A config that fits says nothing of the kind.
    let roomy = mutated(
        trainer_pod().gpus(1).annotate(keys::GPU_MEMORY, "80Gi"),
        &Policy::default(),
    );
    assert_eq!(
        (roomy.error.as_deref(), env_of(&roomy, env::CANNOT_FIT)),
        (None, None)
    );
}

#[test]
fn env_map_comes_from_the_annotation_else_the_policy() {
    let policy = policy_with_products();
    let roomy = || trainer_pod().gpus(1).annotate(keys::GPU_MEMORY, "100Ti");
    let m = mutated(roomy(), &policy);
    assert_eq!(env_of(&m, "PER_DEVICE_TRAIN_BATCH_SIZE"), Some("4"));
    let m = mutated(
        roomy().annotate(keys::ENV_MAP, "batch-size=MY_BATCH"),
        &policy,
    );
    assert_eq!(env_of(&m, "MY_BATCH"), Some("4"));
    assert_eq!(env_of(&m, "PER_DEVICE_TRAIN_BATCH_SIZE"), None);
}

#[test]
fn a_user_variable_from_value_from_is_replaced_with_a_warning() {
    let m = mutated(
        trainer_pod()
            .gpus(1)
            .env_from_configmap("BS")
            .annotate(keys::ENV_MAP, "batch-size=BS,grad-accumulation=GA"),
        &Policy::default(),
    );
    assert!(
        m.warnings
            .iter()
            .any(|w| w.contains("BS") && w.contains("valueFrom"))
    );
}

#[test]
fn lora_knobs_only_for_adapter_methods() {
    let lora = mutated(trainer_pod().gpus(1), &Policy::default());
    assert!(env_of(&lora, env::LORA_RANK).is_some());
    let full = mutated(
        trainer_pod().gpus(1).annotate(keys::METHOD, "full"),
        &Policy::default(),
    );
    assert_eq!(env_of(&full, env::LORA_RANK), None);
    assert_eq!(env_of(&full, env::LORA_LAYERS), None);
}

/// A profile for the key of `pod`, with `status`.
fn profile_for(pod: &Pod, status: memguard_api::crd::MemoryProfileStatus) -> MemoryProfile {
    let key = memguard_decide::pod_key(pod, &Policy::default(), memguard_api::Cluster::default())
        .expect("a key");
    let mut p = MemoryProfile::new(&key.name, key.spec);
    p.status = Some(status);
    p
}

fn runs_at(factor: f64, n: usize) -> memguard_api::crd::MemoryProfileStatus {
    let mut status = memguard_api::crd::MemoryProfileStatus::default();
    for i in 0..n {
        status.record_run(memguard_api::crd::ProfileRun {
            pod: format!("p{i}"),
            uid: format!("u{i}"),
            estimate_bytes: 1000,
            measured_peak_bytes: Some((1000.0 * factor) as u64),
            finished_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::from_second(i as i64).expect("in range"),
            ),
            oom_killed: false,
        });
    }
    status
}

#[test]
fn calibration_from_profiles_scales_the_estimate() {
    let pod = || trainer_pod().gpus(1).annotate(keys::GPU_MEMORY, "100Ti");
    let plain = mutated(pod(), &Policy::default());
    let mut profiles = ClusterView::default();
    profiles.insert(profile_for(&pod().build(), runs_at(2.0, 5)));
    let Outcome::Mutated(calibrated) = mutate(&pod().build(), &Policy::default(), &profiles) else {
        panic!("mutated")
    };
    assert_eq!(calibrated.plan.total().0, 2 * plain.plan.total().0);
    let a = annotation(&calibrated);
    assert_eq!(a["calibration"]["runs"], 5);
    assert_eq!(a["calibration"]["factor"], 2.0);
    assert_eq!(a["uncalibrated"], plain.plan.total().0);
    assert!(annotation(&plain).get("calibration").is_none());
}

#[test]
fn the_plan_is_made_against_the_upper_bound_which_measured_runs_narrow() {
    let pod = |memory: &str| trainer_pod().gpus(1).annotate(keys::GPU_MEMORY, memory);
    let roomy = mutated(pod("100Ti"), &Policy::default());
    let (point, upper) = (roomy.plan.total(), roomy.plan.upper());
    let a = annotation(&roomy);
    assert_eq!(a["total"], point.0);
    assert_eq!(a["upper"], upper.0);
    assert_eq!(a["upperLevel"], 0.95);
    assert!(upper > point, "the bound is above the point estimate");

    // A budget between the two: the point estimate fits, the bound does not, so it downgrades.
    let between = Bytes::from_f64((point.as_f64() + upper.as_f64()) / 2.0 / 0.9);
    let m = mutated(pod(&format!("{}B", between.0)), &Policy::default());
    assert!(
        m.plan.fits && !m.plan.steps.is_empty(),
        "{:?}",
        m.plan.steps
    );
    assert!(m.plan.upper() <= m.budget.as_ref().expect("budget").bytes);

    // Three measured runs at the estimate: the job's own spread replaces the population's, and
    // the same config fits as it is.
    let mut profiles = ClusterView::default();
    profiles.insert(profile_for(&pod("1Gi").build(), runs_at(1.0, 3)));
    let Outcome::Mutated(learned) = mutate(
        &pod(&format!("{}B", between.0)).build(),
        &Policy::default(),
        &profiles,
    ) else {
        panic!("mutated")
    };
    assert!(learned.plan.fits && learned.plan.steps.is_empty());
    assert_eq!(annotation(&learned)["upper"], point.0);

    // A lower level gives a lower bound; the policy's level is what the annotation states.
    let policy = Policy {
        estimate_level: 0.8,
        ..Policy::default()
    };
    let lower = mutated(pod("100Ti"), &policy);
    assert!(lower.plan.upper() <= upper);
    assert_eq!(annotation(&lower)["upperLevel"], 0.8);
}

#[test]
fn expandable_segments_are_set_unless_the_user_set_the_allocator_and_the_estimate_follows() {
    let pod = || {
        trainer_pod()
            .gpus(1)
            .annotate(keys::GPU_MEMORY, "100Ti")
            .annotate(keys::SEQ_LENGTH_SPREAD, "0.8")
    };
    // Not set by the user: memguard sets it, and the spread does not fragment.
    let set = mutated(pod(), &Policy::default());
    assert_eq!(env_of(&set, ALLOC_CONF), Some(EXPANDABLE_SEGMENTS));
    assert!(set.plan.config.expandable_segments);
    let even = mutated(
        trainer_pod().gpus(1).annotate(keys::GPU_MEMORY, "100Ti"),
        &Policy::default(),
    );
    assert_eq!(set.plan.total(), even.plan.total());

    // The user's own setting is kept, and without expandable segments the spread costs reserve.
    let own = mutated(
        pod().env(ALLOC_CONF, "max_split_size_mb:128"),
        &Policy::default(),
    );
    assert_eq!(env_of(&own, ALLOC_CONF), None, "not patched");
    assert!(!own.plan.config.expandable_segments);
    assert!(own.plan.total() > set.plan.total());
    let on = mutated(
        pod().env(
            ALLOC_CONF,
            "max_split_size_mb:128, expandable_segments:True",
        ),
        &Policy::default(),
    );
    assert!(on.plan.config.expandable_segments);
    assert_eq!(on.plan.total(), set.plan.total());

    // CPU pods: PyTorch's CPU allocator has no such setting.
    let cpu = mutated(trainer_pod().memory_limit("64Gi"), &Policy::default());
    assert_eq!(env_of(&cpu, ALLOC_CONF), None);
    assert!(!expandable_segments(Device::Cpu, None));
    assert!(
        !expandable_segments(Device::Cuda, Some(None)),
        "valueFrom: unknown, off"
    );
}

#[test]
fn a_profile_of_another_key_or_with_too_few_runs_changes_nothing() {
    let pod = || trainer_pod().gpus(1).annotate(keys::GPU_MEMORY, "100Ti");
    let plain = mutated(pod(), &Policy::default());
    let mut other = profile_for(&pod().build(), runs_at(2.0, 5));
    other.spec.method = "qlora".into();
    let mut profiles = ClusterView::default();
    profiles.insert(other);
    profiles.insert(profile_for(&pod().build(), runs_at(2.0, 2)));
    let Outcome::Mutated(m) = mutate(&pod().build(), &Policy::default(), &profiles) else {
        panic!("mutated")
    };
    assert_eq!(m.plan.total(), plain.plan.total());
    assert!(annotation(&m).get("calibration").is_none());
}

#[test]
fn a_pending_recovery_starts_below_the_config_that_died_and_says_why() {
    let pod = || {
        trainer_pod()
            .gpus(1)
            .annotate(keys::GPU_MEMORY, "100Ti")
            .annotate(keys::BATCH_SIZE, "16")
    };
    let status = memguard_api::crd::MemoryProfileStatus {
        recovery: Some(memguard_api::crd::Recovery {
            rungs: 1,
            config: memguard_api::crd::TrainingKnobs {
                batch_size: Some(8),
                grad_accumulation: Some(2),
                grad_checkpointing: Some(true),
                ..Default::default()
            },
            factor: None,
            reason: "pod t-0 OOMKilled at batch 16: start with batch 16 → 8".into(),
        }),
        ..Default::default()
    };
    let mut profiles = ClusterView::default();
    profiles.insert(profile_for(&pod().build(), status));
    let Outcome::Mutated(m) = mutate(&pod().build(), &Policy::default(), &profiles) else {
        panic!("mutated")
    };
    assert_eq!(m.plan.config.batch_size, 8);
    assert!(m.plan.config.grad_checkpointing);
    assert_eq!(env_of(&m, env::BATCH_SIZE), Some("8"));
    assert_eq!(
        annotation(&m)["recovery"],
        "pod t-0 OOMKilled at batch 16: start with batch 16 → 8"
    );
    assert!(
        m.warnings
            .iter()
            .any(|w| w.starts_with("memguard: recovery: pod t-0"))
    );
}

#[test]
fn a_cannot_fit_verdict_admits_the_smallest_config_with_an_error_and_a_warning() {
    let pod = || {
        trainer_pod()
            .gpus(1)
            .annotate(keys::GPU_MEMORY, "80Gi")
            .annotate(keys::BATCH_SIZE, "16")
    };
    let verdict = "cannot fit: 4 OOMs in a row (limit 3); smallest config tried: batch 2 × 8";
    let status = memguard_api::crd::MemoryProfileStatus {
        recovery: Some(memguard_api::crd::Recovery {
            rungs: 1,
            config: memguard_api::crd::TrainingKnobs {
                batch_size: Some(2),
                grad_accumulation: Some(8),
                ..Default::default()
            },
            factor: None,
            reason: "pod t-3 CudaOOM at batch 4: start with batch 4 → 2".into(),
        }),
        oom_recoveries: 4,
        verdict: Some(verdict.into()),
        ..Default::default()
    };
    let mut profiles = ClusterView::default();
    profiles.insert(profile_for(&pod().build(), status));
    let built = pod().build();
    let Outcome::Mutated(m) = mutate(&built, &Policy::default(), &profiles) else {
        panic!("mutated")
    };
    assert_eq!(env_of(&m, env::BATCH_SIZE), Some("2"));
    assert_eq!(env_of(&m, env::CANNOT_FIT), Some("true"));
    assert!(
        m.warnings.iter().any(|w| w
            == "memguard: cannot fit; smallest config tried: batch 2 × 8 (4 OOMs in a row (limit 3))"),
        "{:?}",
        m.warnings
    );
    let patch = crate::patch::build(&built, &Outcome::Mutated(m));
    let mut out = serde_json::to_value(&built).expect("json");
    json_patch::patch(&mut out, &patch).expect("applies");
    assert_eq!(out["metadata"]["annotations"]["memguard.io/error"], verdict);
}

#[test]
fn sidecar_plan_follows_the_policy() {
    let spec: PolicySpec = serde_json::from_value(serde_json::json!({
        "sidecar": {"image": "registry.local/memguard:dev", "mode": "classic", "interval": "50ms"},
        "thresholds": {"warn": 0.6, "downgrade": 0.8, "critical": 0.9},
    }))
    .expect("valid");
    let m = mutated(trainer_pod().gpus(1), &spec.resolved().expect("valid"));
    assert_eq!(m.sidecar.mode, SidecarMode::Classic);
    assert_eq!(m.sidecar.image, "registry.local/memguard:dev");
    let get = |k: &str| {
        m.sidecar
            .env
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(get(env::SIDECAR_WARN), Some("0.6"));
    assert_eq!(get(env::SIDECAR_INTERVAL), Some("50ms"));
    assert_eq!(get(env::TRAINER_CONTAINER), Some("train"));
}

/// A watch cache that answers for one namespace and records what admission asked it.
struct OneNamespace {
    namespace: &'static str,
    profile: MemoryProfile,
    asked: std::sync::Mutex<Vec<(String, String)>>,
}

impl crate::mutate::ProfileSource for OneNamespace {
    fn get(&self, namespace: &str, name: &str) -> Option<MemoryProfile> {
        self.asked
            .lock()
            .expect("not poisoned")
            .push((namespace.to_string(), name.to_string()));
        (namespace == self.namespace && name == self.profile.metadata.name.as_deref()?)
            .then(|| self.profile.clone())
    }
}

#[test]
fn admission_looks_profiles_up_in_the_request_namespace_when_the_pod_has_none() {
    let pod = || trainer_pod().gpus(1).annotate(keys::GPU_MEMORY, "100Ti");
    let source = std::sync::Arc::new(OneNamespace {
        namespace: "ml",
        profile: profile_for(&pod().build(), runs_at(2.0, 5)),
        asked: std::sync::Mutex::new(Vec::new()),
    });
    let profiles = ClusterView::from_source(source.clone());
    // At CREATE the pod usually has no namespace: only the request carries it.
    let mut object = pod().json();
    object["metadata"]
        .as_object_mut()
        .expect("metadata")
        .remove("namespace");
    let body = crate::testutil::admission_review(object, "CREATE", false);
    let body = serde_json::to_vec(&body).expect("serializes");
    let reviewed = crate::review::review(&body, &Policy::default(), &profiles).expect("reviewed");
    let asked = source.asked.lock().expect("not poisoned").clone();
    assert_eq!(asked.len(), 1, "{asked:?}");
    assert_eq!(asked[0].0, "ml", "looked up in the request's namespace");
    // The profile found there was applied: the estimate annotation says so.
    let response = serde_json::to_value(&reviewed.review).expect("serializes");
    let encoded = response["response"]["patch"].as_str().expect("a patch");
    use base64::Engine as _;
    let patch = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .expect("base64");
    let patch = String::from_utf8(patch).expect("utf-8");
    assert!(
        patch.contains(r#"\"calibration\":{\"factor\":2.0,\"runs\":5}"#),
        "{patch}"
    );
}

#[test]
fn grad_sync_is_written_for_fsdp_across_ranks_only_and_follows_the_plan() {
    let fsdp = || {
        trainer_pod()
            .gpus(1)
            .annotate(keys::METHOD, "full")
            .annotate(keys::PARALLELISM, "fsdp")
            .annotate(keys::WORLD_SIZE, "8")
            .annotate(keys::SEQ_LENGTH, "1024")
            .annotate(keys::GRAD_ACCUMULATION, "2")
            .annotate(keys::GPU_MEMORY, "192GiB")
            .annotate(keys::ENV_MAP, "grad-sync=TRAINER_GRAD_SYNC")
    };
    // Roomy: nothing to plan, the trainer's own choice is repeated.
    let roomy = mutated(fsdp(), &Policy::default());
    assert!(roomy.plan.steps.is_empty(), "{:?}", roomy.plan.steps);
    assert_eq!(env_of(&roomy, env::GRAD_SYNC), Some("accumulate"));
    assert_eq!(env_of(&roomy, "TRAINER_GRAD_SYNC"), Some("accumulate"));
    assert_eq!(annotation(&roomy)["config"]["grad-sync"], "accumulate");

    // Tight: the plan syncs each batch (accumulating, the unsharded gradients are the largest
    // saving), and the trainer, its own variable and the estimate annotation all say so.
    let tight = mutated(
        fsdp().annotate(keys::GPU_MEMORY, "72GiB"),
        &Policy::default(),
    );
    let rungs: Vec<&str> = tight.plan.steps.iter().map(|s| s.rung.name()).collect();
    assert_eq!(rungs[0], "sync-each-batch", "{rungs:?}");
    assert_eq!(env_of(&tight, env::GRAD_SYNC), Some("each-batch"));
    assert_eq!(env_of(&tight, "TRAINER_GRAD_SYNC"), Some("each-batch"));
    assert_eq!(annotation(&tight)["config"]["grad-sync"], "each-batch");
    assert_eq!(annotation(&tight)["steps"][0], "sync-each-batch");

    // One rank, or not FSDP: the variable would mean nothing and is not written.
    for (key, value) in [(keys::WORLD_SIZE, "1"), (keys::PARALLELISM, "ddp")] {
        let m = mutated(fsdp().annotate(key, value), &Policy::default());
        assert_eq!(env_of(&m, env::GRAD_SYNC), None, "{key}={value}");
        assert!(annotation(&m)["config"].get("grad-sync").is_none());
    }
}

/// Issue 27, defect 1: the literal values of mapped variables are read, so a downgrade keeps
/// the effective batch the trainer really runs (`BATCH_SIZE=8`, `GRAD_ACC=4` is 32, not 8).
#[test]
fn mapped_literal_values_are_read_and_the_effective_batch_is_kept() {
    for accumulation in [4u64, 8] {
        let m = mutated(
            trainer_pod()
                .gpus(1)
                .annotate(keys::BATCH_SIZE, "8")
                .annotate(keys::SEQ_LENGTH, "8192")
                .annotate(keys::GPU_MEMORY, "24Gi")
                .annotate(
                    keys::ENV_MAP,
                    "batch-size=BATCH_SIZE,grad-accumulation=GRAD_ACC",
                )
                .env("BATCH_SIZE", "8")
                .env("GRAD_ACC", &accumulation.to_string()),
            &Policy::default(),
        );
        assert!(!m.plan.steps.is_empty(), "the pod needs a downgrade");
        let read = |var| -> u64 {
            env_of(&m, var)
                .and_then(|v| v.parse().ok())
                .expect("written")
        };
        assert_eq!(
            read("BATCH_SIZE") * read("GRAD_ACC"),
            8 * accumulation,
            "effective batch of the trainer's own variables"
        );
        assert_eq!(
            annotation(&m)["sources"]["grad-accumulation"],
            "env:GRAD_ACC"
        );
    }
}

/// Where the trainer's variables cannot carry the whole change (no accumulation variable, or
/// one set by `valueFrom`), the pod is not changed and the error says why.
#[test]
fn an_effective_batch_that_cannot_be_kept_leaves_the_pod_unchanged_with_the_reason() {
    let pod = || {
        trainer_pod()
            .gpus(1)
            .annotate(keys::BATCH_SIZE, "8")
            .annotate(keys::SEQ_LENGTH, "8192")
            .annotate(keys::GPU_MEMORY, "24Gi")
            .env("BATCH_SIZE", "8")
    };
    let only_batch = run(
        pod().annotate(keys::ENV_MAP, "batch-size=BATCH_SIZE"),
        &Policy::default(),
    );
    let Outcome::Skipped { error, .. } = only_batch else {
        panic!("expected the pod unchanged, got {only_batch:?}")
    };
    assert!(
        error.contains("effective batch cannot be kept") && error.contains("BATCH_SIZE"),
        "{error}"
    );
    let from_ref = run(
        pod().env_from_configmap("GRAD_ACC").annotate(
            keys::ENV_MAP,
            "batch-size=BATCH_SIZE,grad-accumulation=GRAD_ACC",
        ),
        &Policy::default(),
    );
    let Outcome::Skipped { error, .. } = from_ref else {
        panic!("expected the pod unchanged, got {from_ref:?}")
    };
    assert!(error.contains("GRAD_ACC is set by valueFrom"), "{error}");
    // Annotating the value makes it known: the pod is rewritten.
    let annotated = mutated(
        pod()
            .env_from_configmap("GRAD_ACC")
            .annotate(keys::GRAD_ACCUMULATION, "2")
            .annotate(
                keys::ENV_MAP,
                "batch-size=BATCH_SIZE,grad-accumulation=GRAD_ACC",
            ),
        &Policy::default(),
    );
    let cfg = &annotated.plan.config;
    assert_eq!(cfg.batch_size * cfg.grad_accumulation, 16);
}

/// A launch memguard cannot read (`python -c`) falls back to the annotations and says so.
#[test]
fn an_unreadable_launch_is_planned_on_annotations_and_says_so() {
    let mut pod = trainer_pod()
        .gpus(1)
        .annotate(keys::GPU_MEMORY, "24Gi")
        .build();
    if let Some(c) = pod.spec.as_mut().and_then(|s| s.containers.first_mut()) {
        c.command = Some(vec!["python".into(), "-c".into(), "import train".into()]);
    }
    let Outcome::Mutated(m) = mutate(&pod, &Policy::default(), &ClusterView::default()) else {
        panic!("mutated")
    };
    assert!(
        m.warnings
            .iter()
            .any(|w| w.contains("command line was not read") && w.contains("python -c")),
        "{:?}",
        m.warnings
    );
    assert!(m.command_line.is_none());
}

/// Issue 27, item 2: a trainer whose launch memguard recognises but whose config it does not
/// read (here `axolotl train` with its YAML in the image) applies no sequence length or LoRA
/// size from memguard's variables, and the client applies none either: with quality cuts
/// allowed, the plan keeps them where they are and says so, instead of reporting a cut nothing
/// applies.
#[test]
fn quality_knobs_nothing_applies_are_not_planned_and_the_warning_says_so() {
    let pod = || {
        trainer_pod()
            .gpus(1)
            .annotate(keys::MODEL, "llama-3-8b")
            .annotate(keys::METHOD, "lora")
            .annotate(keys::SEQ_LENGTH, "8192")
            .annotate(keys::GPU_MEMORY, "24Gi")
            .annotate("memguard.io/allow-quality", "true")
    };
    // As written for memguard (no launch memguard recognises): the sequence is cut, and the
    // trainer reads MEMGUARD_SEQ_LENGTH.
    let written = mutated(pod(), &Policy::default());
    assert!(
        written.plan.config.seq_length < 8192,
        "{:?}",
        written.plan.steps
    );
    // `axolotl train config.yaml`: axolotl reads its YAML, not MEMGUARD_SEQ_LENGTH.
    let axolotl = mutated(
        pod().command_line(&["axolotl", "train"], &["/app/config.yaml"]),
        &Policy::default(),
    );
    assert_eq!(
        axolotl.plan.config.seq_length, 8192,
        "{:?}",
        axolotl.plan.steps
    );
    assert!(
        !axolotl
            .plan
            .steps
            .iter()
            .any(|s| s.rung.cost() == memguard_estimator::Cost::Quality),
        "{:?}",
        axolotl.plan.steps
    );
    assert_eq!(env_of(&axolotl, "MEMGUARD_SEQ_LENGTH"), Some("8192"));
    let said = axolotl.warnings.join("\n");
    assert!(
        said.contains("seq-length") && said.contains("nothing in the trainer's launch applies"),
        "{said}"
    );
}

/// Issue 29: an unpinned GPU pod is planned for the smallest GPU among the nodes it could land
/// on (their GPU Feature Discovery labels), not the policy's assumed 80 GiB.
#[test]
fn an_unpinned_gpu_pod_is_planned_for_the_smallest_gpu_of_its_nodes() {
    use memguard_api::cluster::NodeLabelList;
    use std::collections::BTreeMap;
    let node = |product: &str, mib: &str, pool: &str| {
        BTreeMap::from([
            ("nvidia.com/gpu.product".to_string(), product.to_string()),
            ("nvidia.com/gpu.memory".to_string(), mib.to_string()),
            ("pool".to_string(), pool.to_string()),
        ])
    };
    let nodes = NodeLabelList(vec![
        node("NVIDIA-A30", "24576", "small"),
        node("NVIDIA-A100-SXM4-80GB", "81920", "big"),
        // A node without GPU labels is no candidate.
        BTreeMap::from([("pool".to_string(), "cpu".to_string())]),
    ]);
    let view = ClusterView::default().with_nodes(std::sync::Arc::new(nodes));
    let admit = |pod: PodBuilder| match mutate(&pod.build(), &Policy::default(), &view) {
        Outcome::Mutated(m) => *m,
        other => panic!("not mutated: {other:?}"),
    };
    let m = admit(trainer_pod().gpus(1));
    let a = annotation(&m);
    assert_eq!(a["budgetSource"]["kind"], "nodes", "{a}");
    assert_eq!(
        a["budgetSource"]["detail"],
        "smallest of 2 GPU nodes: nvidia.com/gpu.memory=24576"
    );
    let gpu = a["gpuMemory"].as_u64().expect("gpu memory");
    assert!(gpu < Bytes::gib(24).0 && gpu > Bytes::gib(23).0, "{gpu}");
    assert!(
        !m.warnings
            .iter()
            .any(|w| w.contains("assumed defaultGpuMemory")),
        "{:?}",
        m.warnings
    );
    // A nodeSelector narrows the candidates: on the A100 pool, the A100's table figure.
    let big = admit(
        trainer_pod()
            .gpus(1)
            .spec("nodeSelector", serde_json::json!({"pool": "big"})),
    );
    let a = annotation(&big);
    assert_eq!(
        a["budgetSource"]["detail"],
        "smallest of 1 GPU node: NVIDIA-A100-SXM4-80GB"
    );
    // No node labels known: the assumed default, said.
    let none = mutated(trainer_pod().gpus(1), &Policy::default());
    assert_eq!(annotation(&none)["budgetSource"]["kind"], "policy-default");
    assert!(
        none.warnings
            .iter()
            .any(|w| w.contains("assumed defaultGpuMemory"))
    );
}

/// A pending OOM recovery starts below a batch that a DeepSpeed config pins: the batch stays
/// (writing it would break the launch), the recovery is still said, and so is why the batch
/// was kept.
#[test]
fn a_recovery_below_a_pinned_batch_keeps_the_batch_and_says_why() {
    let pod = || {
        bare_pod()
            .annotate(keys::MODEL, "llama-3-8b")
            .annotate(keys::METHOD, "lora")
            .gpus(1)
            .annotate(keys::GPU_MEMORY, "100Ti")
            .command_line(
                &["python"],
                &[
                    "sft.py",
                    "--per_device_train_batch_size",
                    "16",
                    "--deepspeed",
                    r#"{"train_micro_batch_size_per_gpu": 16}"#,
                    "--output_dir",
                    "/out",
                ],
            )
    };
    let status = memguard_api::crd::MemoryProfileStatus {
        recovery: Some(memguard_api::crd::Recovery {
            rungs: 1,
            config: memguard_api::crd::TrainingKnobs {
                batch_size: Some(8),
                grad_accumulation: Some(2),
                ..Default::default()
            },
            factor: None,
            reason: "pod t-0 OOMKilled at batch 16: start with batch 16 → 8".into(),
        }),
        ..Default::default()
    };
    let mut profiles = ClusterView::default();
    profiles.insert(profile_for(&pod().build(), status));
    let Outcome::Mutated(m) = mutate(&pod().build(), &Policy::default(), &profiles) else {
        panic!("mutated")
    };
    assert_eq!(m.plan.config.batch_size, 16);
    assert_eq!(m.plan.config.grad_accumulation, 1);
    assert!(
        m.changed.iter().all(|c| !c.contains("batch")),
        "{:?}",
        m.changed
    );
    let said = m.warnings.join("\n");
    assert!(said.contains("memguard: recovery: pod t-0"), "{said}");
    assert!(
        said.contains("batch and accumulation kept: --deepspeed (inline JSON) pins"),
        "{said}"
    );
}

/// A TRL full fine-tune on four GPUs whose trainer's `limits.memory` holds its load but not its
/// save (the model and AdamW's states gathered on one rank, copied and written) nor its deep
/// input pipeline: the host plan saves the model only and keeps as many workers as fit, in the
/// launch's own flags,
/// keeps the batch, and writes the host figure into the estimate annotation; a limit below the
/// load is an error naming the memory to request, and nothing is rewritten for it.
#[test]
fn a_gpu_pod_over_its_memory_limit_is_planned_on_the_host() {
    let pod = |limit: &str| {
        bare_pod()
            .gpus(4)
            .memory_limit(limit)
            .annotate(keys::GPU_MEMORY, "100Ti")
            .command_line(
                &["torchrun"],
                &[
                    "--nproc_per_node",
                    "4",
                    "-m",
                    "trl.scripts.sft",
                    "--model_name_or_path",
                    "meta-llama/Llama-3.1-8B",
                    "--per_device_train_batch_size",
                    "16",
                    "--max_length",
                    "8192",
                    "--dataloader_num_workers",
                    "16",
                    "--dataloader_prefetch_factor",
                    "8",
                    "--dtype",
                    "bfloat16",
                    "--output_dir",
                    "/out",
                ],
            )
    };
    let m = mutated(pod("63Gi"), &Policy::default());
    let host = &annotation(&m)["host"];
    assert_eq!(host["ranks"], 4, "{host}");
    assert_eq!(host["limit"], 63u64 << 30, "{host}");
    assert_eq!(host["sources"]["dataloader-workers"], "memguard", "{host}");
    assert_eq!(host["rewritten"]["dataloader-workers"]["source"], "args");
    assert_eq!(host["rewritten"]["save"]["source"], "default:trl");
    assert_eq!(host["rewritten"]["dataloader-workers"]["from"], "16");
    assert_eq!(host["rewritten"]["save"]["to"], "true");
    assert!(
        host["bytes"].as_u64().expect("bytes") <= 80u64 << 30,
        "{host}"
    );
    // The checkpoint's dtype is not read, and an fp32 one would be copied per rank at load:
    // no fit is claimed.
    assert_eq!(host["fits"], serde_json::Value::Null, "{host}");
    let line = m
        .command_line
        .as_ref()
        .and_then(|c| c.args.clone())
        .expect("rewritten");
    let joined = line.join(" ");
    assert!(joined.contains("--save_only_model"), "{joined}");
    assert!(!joined.contains("--dataloader_num_workers 16"), "{joined}");
    assert!(
        joined.contains("--per_device_train_batch_size 16"),
        "batch kept: {joined}"
    );
    assert!(
        m.changed
            .iter()
            .any(|c| c.starts_with("--dataloader_num_workers 16→")),
        "{:?}",
        m.changed
    );
    assert!(m.error.is_none(), "{:?}", m.error);

    // Below the load: no rewrite helps; the error says what to request.
    let m = mutated(pod("8Gi"), &Policy::default());
    let error = m.error.clone().expect("an error");
    assert!(error.contains("set limits.memory ≥"), "{error}");
    assert!(
        m.changed.iter().all(|c| !c.contains("dataloader")),
        "{:?}",
        m.changed
    );
    assert_eq!(annotation(&m)["host"]["fits"], false);
}
