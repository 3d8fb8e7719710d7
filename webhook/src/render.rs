//! The plan as the pod will carry it: the trainer's `MEMGUARD_*` env and its own variables,
//! the sidecar and the client to inject, and the `memguard.io/estimate` annotation. Pure.

use crate::outcome::{ClientPlan, Mutation, SidecarPlan};
use k8s_openapi::api::core::v1::Pod;
use memguard_api::estimate::{ESTIMATE_VERSION, EstimateAnnotation};
use memguard_api::pod::TrainingPod;
use memguard_api::{Knob, Policy, env, wellknown};
use memguard_decide::Adjustments;
use memguard_decide::budget::{Budget, BudgetSource};
use memguard_decide::decision::{ALLOC_CONF, Decision, EXPANDABLE_SEGMENTS, user_alloc_conf};
use memguard_decide::warnings::{cannot_fit_warning, truncate};
use memguard_estimator::{Device, DowngradePlan, TrainingConfig};

/// The plan as the pod will carry it: the trainer's `MEMGUARD_*` env, its own variables
/// (env-map), the sidecar, the estimate annotation.
pub(crate) fn render(
    training: &TrainingPod,
    policy: &Policy,
    Decision {
        plan,
        adjust,
        budget,
        affinity,
        verdict,
        mut warnings,
        ..
    }: Decision,
) -> Mutation {
    let trainer = training.trainer;
    // A plan on unread knobs is a guess: none of its values is written, and no verdict is
    // claimed ([`TrainingPod::unknown`]).
    let guessed = !training.guessed().is_empty();
    let verdict = verdict.filter(|_| !guessed);
    let knobs: Vec<Knob> = Knob::of(&plan.config)
        .into_iter()
        .filter(|k| !guessed && !training.unknown.contains_key(k))
        .collect();
    let mut trainer_env: Vec<(String, String)> = knobs
        .iter()
        .map(|k| (k.env().to_string(), k.value(&plan.config)))
        .collect();
    trainer_env.push((env::ESTIMATE_BYTES.into(), plan.total().0.to_string()));
    if let Some(b) = &budget {
        trainer_env.push((env::BUDGET_BYTES.into(), b.bytes.0.to_string()));
    }
    if let Some(verdict) = &verdict {
        // Admitted anyway, at the smallest config tried: a fatal OOM then exits 87, which a
        // Job's podFailurePolicy can turn into FailJob.
        warnings.push(cannot_fit_warning(verdict));
        trainer_env.push((env::CANNOT_FIT.into(), "true".into()));
    }
    if plan.config.device == Device::Cuda && user_alloc_conf(trainer).is_none() {
        trainer_env.push((ALLOC_CONF.into(), EXPANDABLE_SEGMENTS.into()));
    }
    trainer_env.extend(crate::gpu_enforce::env(
        policy.enforce_gpu_memory,
        trainer,
        &plan,
        budget.as_ref(),
        &mut warnings,
    ));
    trainer_env.push((env::SIGNAL_FILE.into(), wellknown::SIGNAL_FILE.into()));
    trainer_env.push((
        env::SIDECAR_URL.into(),
        format!("http://{}", wellknown::SIDECAR_LISTEN),
    ));

    // The pod's own env-map, else the policy's: both checked when they were parsed.
    let env_map = training.env_map(policy);
    let user_env: Vec<(String, String)> = env_map
        .iter()
        .filter(|(knob, _)| knobs.contains(knob))
        .map(|(knob, var)| (var.clone(), knob.value(&plan.config)))
        .collect();
    for (var, _) in &user_env {
        let from_ref = trainer
            .env
            .iter()
            .flatten()
            .any(|e| &e.name == var && e.value_from.is_some());
        if from_ref {
            warnings.push(truncate(&format!(
                "memguard: {var} in {} used valueFrom; replaced by a literal value",
                trainer.name
            )));
        }
    }

    let sidecar = sidecar_plan(policy, training, &plan, budget.as_ref(), guessed);
    let python = training.launch.runs_python();
    let client = client_plan(
        training.pod,
        training.trainer,
        policy,
        python,
        &mut warnings,
    );
    let mut estimate = estimate_annotation(&plan, budget.as_ref(), &training.config, &adjust);
    estimate.sources = knob_sources(training);
    estimate.unknown = training
        .unknown
        .iter()
        .map(|(k, why)| (k.name().to_string(), why.clone()))
        .collect();
    if guessed {
        estimate.fits = None;
    }
    estimate.read = training
        .sources
        .keys()
        .map(|k| (k.name().to_string(), k.value(&training.config)))
        .collect();
    Mutation {
        trainer_index: training.trainer_index,
        trainer: trainer.name.clone(),
        budget,
        plan,
        trainer_env,
        user_env,
        command_line: None,
        changed: Vec::new(),
        sidecar,
        estimate,
        warnings,
        error: verdict,
        affinity,
        client,
        shm: None,
    }
}

/// The client goes into a trainer that runs Python (`runs_python`: the pod's one classification
/// of its launch, [`memguard_api::pod::TrainerLaunch::runs_python`]) unless the policy or the
/// pod (`memguard.io/inject-client: "false"`) opted out. A `PYTHONPATH` from `valueFrom` cannot
/// be prepended to without losing it: then nothing is injected, and a warning says why.
pub(crate) fn client_plan(
    pod: &Pod,
    trainer: &k8s_openapi::api::core::v1::Container,
    policy: &Policy,
    runs_python: bool,
    warnings: &mut Vec<String>,
) -> Option<ClientPlan> {
    let opted_out = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(memguard_api::annotations::INJECT_CLIENT))
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("false"));
    if !policy.client_inject || opted_out || !runs_python {
        return None;
    }
    let from_ref = trainer
        .env
        .iter()
        .flatten()
        .any(|e| e.name == env::PYTHONPATH && e.value_from.is_some());
    if from_ref {
        warnings.push(truncate(&format!(
            "memguard: {} in {} uses valueFrom; the Python client was not injected",
            env::PYTHONPATH,
            trainer.name
        )));
        return None;
    }
    Some(ClientPlan {
        image: policy.client_image.clone(),
    })
}

pub(crate) fn sidecar_plan(
    policy: &Policy,
    training: &TrainingPod,
    plan: &DowngradePlan,
    budget: Option<&Budget>,
    guessed: bool,
) -> SidecarPlan {
    let cfg = &plan.config;
    let mut env = sidecar_base_env(policy, &training.trainer.name);
    // The knobs the sidecar changes at run time, starting where the plan put them (none
    // when the plan is a guess: the sidecar then starts from its own floor).
    env.extend(
        Knob::RUNTIME
            .into_iter()
            .filter(|k| !guessed && !training.unknown.contains_key(k))
            .map(|k| (k.env().to_string(), k.value(cfg))),
    );
    env.push((env::ESTIMATE_BYTES.into(), plan.total().0.to_string()));
    if let Some(b) = budget {
        env.push((env::BUDGET_BYTES.into(), b.bytes.0.to_string()));
    }
    if !guessed {
        env.push((
            env::SIDECAR_ADMITTED_CONFIG.into(),
            admitted_config(
                training,
                &memguard_decide::reported::as_configured(training, cfg),
            ),
        ));
    }
    // A GPU trainer's per-device budget; a CPU trainer's is its cgroup limit, which the
    // sidecar reads itself.
    let gpu_budget = budget.filter(|_| matches!(cfg.device, Device::Cuda | Device::Rocm));
    env.push(train_start_env(
        policy,
        memguard_decide::decision::safety_ratio(training, policy),
        training.annotations.allow_quality,
        gpu_budget,
    ));
    SidecarPlan {
        mode: policy.sidecar_mode,
        image: policy.sidecar_image.clone(),
        resources: policy.sidecar_resources.clone(),
        env,
    }
}

/// What the sidecar plans the trainer's reported config against at train start
/// ([`memguard_api::train_start::TrainStartPolicy`]): the policy's estimate level and floors
/// (quality allowed where the pod allows it), the safety ratio, and a GPU trainer's per-device
/// budget where admission computed one.
pub(crate) fn train_start_env(
    policy: &Policy,
    safety_ratio: f64,
    allow_quality: Option<bool>,
    gpu_budget: Option<&Budget>,
) -> (String, String) {
    let settings = memguard_api::train_start::TrainStartPolicy {
        budget_bytes: gpu_budget.map(|b| b.bytes.0).filter(|&b| b > 0),
        safety_ratio: Some(safety_ratio),
        estimate_level: Some(policy.estimate_level),
        floors: Some(memguard_decide::decision::floors(allow_quality, policy)),
    };
    (env::SIDECAR_TRAIN_START.into(), settings.render())
}

/// What admission planned the trainer at, for the sidecar to compare with what the trainer
/// reports at train start: `knob=value,…` over the knobs it knows (an unknown one is left out).
pub(crate) fn admitted_config(training: &TrainingPod, cfg: &TrainingConfig) -> String {
    let mut knobs = vec![
        (Knob::BatchSize, cfg.batch_size.to_string()),
        (Knob::GradAccumulation, cfg.grad_accumulation.to_string()),
        (Knob::SeqLength, cfg.seq_length.to_string()),
        (
            Knob::GradCheckpointing,
            u8::from(cfg.grad_checkpointing).to_string(),
        ),
    ];
    if cfg.is_adapter() {
        knobs.push((Knob::LoraRank, cfg.lora_rank.to_string()));
    }
    knobs
        .into_iter()
        .filter(|(k, _)| !training.unknown.contains_key(k))
        .map(|(k, v)| format!("{}={v}", k.name()))
        .chain([format!("world-size={}", cfg.world_size.max(1))])
        .collect::<Vec<_>>()
        .join(",")
}

/// The sidecar's env that does not depend on a plan: which container it watches, where it
/// signals and serves, and the policy's thresholds.
pub(crate) fn sidecar_base_env(policy: &Policy, trainer: &str) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = vec![
        (env::TRAINER_CONTAINER.into(), trainer.into()),
        (
            env::SIDECAR_SIGNAL_FILE.into(),
            wellknown::SIGNAL_FILE.into(),
        ),
        (env::SIDECAR_LISTEN.into(), wellknown::SIDECAR_LISTEN.into()),
        (
            env::SIDECAR_METRICS_LISTEN.into(),
            wellknown::SIDECAR_METRICS_LISTEN.into(),
        ),
    ];
    env.extend(
        policy
            .sidecar_env()
            .into_iter()
            .map(|(name, value)| (name.to_string(), value)),
    );
    env
}

/// Each knob's source, when any was read from the trainer's own config, or its launch named the
/// model (else empty: the annotation stays as it was for pods written for memguard).
pub(crate) fn knob_sources(training: &TrainingPod) -> std::collections::BTreeMap<String, String> {
    let setup = training
        .setup_sources
        .iter()
        .map(|(what, source)| (what.to_string(), source.clone()));
    if training.sources.is_empty()
        && training.read_from_args.is_empty()
        && training.read_from_file.is_empty()
        && training.reported.is_empty()
    {
        return setup.collect();
    }
    Knob::of(&training.config)
        .into_iter()
        .map(|k| {
            let cited = training.args.as_ref().and_then(|a| a.defaults.get(&k));
            let source = match training.sources.get(&k) {
                Some(read) => read.clone(),
                None if training.annotations.knobs_given.contains(&k) => "annotation".into(),
                None if let Some(reported) = training.reported.get(&k) => reported.clone(),
                None if training.unknown.contains_key(&k) => "unknown".into(),
                None => cited.map_or("default", |c| *c).into(),
            };
            (k.name().to_string(), source)
        })
        .chain(
            training
                .read_from_args
                .iter()
                .map(|what| (what.to_string(), "args".to_string())),
        )
        .chain(
            training
                .read_from_file
                .iter()
                .map(|(what, source)| (what.to_string(), source.clone())),
        )
        .chain(setup)
        .collect()
}

pub(crate) fn estimate_annotation(
    plan: &DowngradePlan,
    budget: Option<&Budget>,
    config: &TrainingConfig,
    adjust: &Adjustments,
) -> EstimateAnnotation {
    let cfg = &plan.config;
    EstimateAnnotation {
        v: ESTIMATE_VERSION,
        total: plan.total(),
        upper: plan.bound.level.map(|_| plan.upper()),
        upper_level: plan.bound.level,
        tensor_peak: plan.calibration.apply(plan.estimate.tensor_peak),
        budget: budget.map(|b| b.bytes),
        fits: budget.map(|_| plan.fits),
        steps: plan
            .steps
            .iter()
            .map(|s| s.rung.name().to_string())
            .collect(),
        device: config.device.name().to_string(),
        gpu_memory: budget
            .filter(|b| b.source != BudgetSource::MemoryLimit)
            .map(|b| b.device_memory),
        budget_source: budget.map(|b| b.source.clone()),
        config: Knob::of(cfg)
            .into_iter()
            .map(|k| (k.name().to_string(), k.value(cfg)))
            .chain([("world-size".to_string(), config.world_size.to_string())])
            .collect(),
        uncalibrated: plan.estimate.total,
        calibration: adjust.calibration.is_active().then_some(adjust.calibration),
        recovery: adjust.recovery.as_ref().map(|r| r.reason.clone()),
        sources: Default::default(),
        unknown: Default::default(),
        read: Default::default(),
        changed: Vec::new(),
        args: None,
        host: None,
    }
}
