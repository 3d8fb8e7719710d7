//! The decision: what memguard wants a training pod to look like. Pure: no I/O, no async.
//!
//! [`mutate`] reads the pod's annotations and resources, derives the memory budget the pod will
//! really have, runs the estimator's downgrade plan and returns an [`Outcome`]. It never fails:
//! anything wrong becomes [`Outcome::Skipped`] with a short warning, and the pod is admitted
//! unchanged. Turning a [`Mutation`] into a JSON patch is [`crate::patch`]'s job.
//!
//! Idempotency rests on one fact: memguard never edits its *input* annotations. A second call
//! (`reinvocationPolicy: IfNeeded`) parses the same original config, reaches the same plan, and
//! the patch, computed as a difference against the pod, comes out empty.

use k8s_openapi::api::core::v1::Pod;
use memguard_api::annotations as keys;
use memguard_api::crd::MemoryProfile;
use memguard_api::estimate::{ESTIMATE_VERSION, EstimateAnnotation};
use memguard_api::pod::TrainingPod;
use memguard_api::policy::{PlacementMode, SidecarMode, SidecarResources};
use memguard_api::{Knob, Policy, env, wellknown};
use memguard_estimator::{Bytes, Device, DowngradePlan, Parallelism, TrainingConfig, plan_against};
use memguard_learn::observe::knobs_of;
use memguard_learn::update::describe_knobs;
use memguard_learn::{Adjustments, PodKey, adjustments};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Kubernetes advises keeping admission warnings under 120 characters.
pub const MAX_WARNING_CHARS: usize = 120;

/// A read-only view of `MemoryProfile`s: the webhook's watch cache (a kube reflector store) or
/// profiles read from files. Lookups never call the API.
pub trait ProfileSource: Send + Sync {
    /// The profile `name` in `namespace`, if cached.
    fn get(&self, namespace: &str, name: &str) -> Option<MemoryProfile>;
}

/// What memguard learnt from past runs, as the mutation sees it. The webhook fills it from a
/// watch cache ([`Profiles::from_source`]); `memguard mutate --profile` from files
/// ([`Profiles::insert`]); tests and a webhook without a cluster pass [`Profiles::default`].
#[derive(Clone, Default)]
pub struct Profiles {
    /// Profiles given directly, matched by key (spec), whatever their name or namespace.
    listed: Vec<MemoryProfile>,
    source: Option<Arc<dyn ProfileSource>>,
    /// The DRA objects (claims, templates, classes, slices) the budget stage reads; carried
    /// here because it is the one read-only cluster view every caller already passes.
    dra: Option<Arc<dyn DraCatalog>>,
}

impl std::fmt::Debug for Profiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Profiles")
            .field("listed", &self.listed.len())
            .field("source", &self.source.is_some())
            .field("dra", &self.dra.is_some())
            .finish()
    }
}

impl Profiles {
    /// Profiles looked up in `source` by namespace and object name.
    pub fn from_source(source: Arc<dyn ProfileSource>) -> Self {
        Profiles {
            listed: Vec::new(),
            source: Some(source),
            dra: None,
        }
    }

    /// The same, reading DRA objects from `catalog` (the webhook's watch caches, or
    /// `memguard mutate --dra`).
    pub fn with_dra(mut self, catalog: Arc<dyn DraCatalog>) -> Self {
        self.dra = Some(catalog);
        self
    }

    /// The DRA catalog, when there is one.
    pub fn dra(&self) -> Option<&dyn DraCatalog> {
        self.dra.as_deref()
    }

    /// Adds a profile; it applies to every pod with its key (`spec`).
    pub fn insert(&mut self, profile: MemoryProfile) {
        self.listed.push(profile);
    }

    /// The adjustments for a pod with `key` in `namespace`: from the first listed profile with
    /// that key, else from the source's profile named after the key (when its spec matches:
    /// a profile edited into another key adjusts nothing).
    pub fn adjustments(&self, namespace: Option<&str>, key: &PodKey) -> Option<Adjustments> {
        let status = |p: &MemoryProfile| adjustments(&p.status.clone().unwrap_or_default());
        if let Some(p) = self.listed.iter().find(|p| p.spec == key.spec) {
            return Some(status(p));
        }
        let found = self.source.as_ref()?.get(namespace?, &key.name)?;
        (found.spec == key.spec).then(|| status(&found))
    }
}

/// What memguard does with a pod.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Not for memguard (not opted in): nothing to do, no warning.
    Unchanged,
    /// The pod as memguard wants it (which may already be how it is).
    Mutated(Box<Mutation>),
    /// Opted in but unusable (bad annotations, no container, internal error): admitted unchanged
    /// except `memguard.io/error`.
    Skipped {
        /// The full reason, for the `memguard.io/error` annotation.
        error: String,
        /// A short form (≤ [`MAX_WARNING_CHARS`]) for the admission response.
        warning: String,
    },
}

pub use crate::budget::{Budget, BudgetSource};
use crate::dra::{DraCatalog, DraMemory};

/// The sidecar to inject, as decided (rendered into a container by [`crate::patch`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SidecarPlan {
    /// Native (`initContainers`, `restartPolicy: Always`) or classic (`containers`).
    pub mode: SidecarMode,
    /// Image.
    pub image: String,
    /// Resources.
    pub resources: SidecarResources,
    /// Literal env of the sidecar (the downward-API limit is added by the patch).
    pub env: Vec<(String, String)>,
}

/// Everything memguard wants changed on one pod.
#[derive(Debug, Clone, PartialEq)]
pub struct Mutation {
    /// Index of the trainer in `spec.containers`.
    pub trainer_index: usize,
    /// Name of the trainer container.
    pub trainer: String,
    /// The budget, when the pod has one (a CPU pod without a memory limit has none).
    pub budget: Option<Budget>,
    /// The downgrade plan from the original config.
    pub plan: DowngradePlan,
    /// `MEMGUARD_*` variables for the trainer, in a stable order.
    pub trainer_env: Vec<(String, String)>,
    /// The user's own variables (env-map), rewritten in place.
    pub user_env: Vec<(String, String)>,
    /// The sidecar.
    pub sidecar: SidecarPlan,
    /// The `memguard.io/estimate` annotation.
    pub estimate: EstimateAnnotation,
    /// Warnings for the admission response, each ≤ [`MAX_WARNING_CHARS`].
    pub warnings: Vec<String>,
    /// `memguard.io/error` to keep on the mutated pod: "cannot fit: …", the profile's verdict
    /// (OOM recoveries exhausted) or the plan's (every knob at its floor and still over budget).
    pub error: Option<String>,
    /// The pod's `spec.affinity` with memguard's placement merged in, when placement added any.
    pub affinity: Option<k8s_openapi::api::core::v1::Affinity>,
}

impl Mutation {
    /// Number of downgrade steps the plan applied.
    pub fn steps(&self) -> usize {
        self.plan.steps.len()
    }
}

/// Decides what to do with `pod` under `policy`. Never panics, never fails.
pub fn mutate(pod: &Pod, policy: &Policy, profiles: &Profiles) -> Outcome {
    let empty = BTreeMap::new();
    let labels_map = pod.metadata.labels.as_ref().unwrap_or(&empty);
    if labels_map.get(wellknown::ENABLED_LABEL).map(String::as_str)
        != Some(wellknown::ENABLED_VALUE)
    {
        return Outcome::Unchanged;
    }
    match decide(pod, policy, profiles) {
        Ok(mutation) => Outcome::Mutated(Box::new(mutation)),
        Err(error) => skipped(error),
    }
}

/// An [`Outcome::Skipped`] with the warning cut to size.
pub fn skipped(error: String) -> Outcome {
    let warning = truncate(&format!("memguard skipped this pod: {error}"));
    Outcome::Skipped { error, warning }
}

/// The decision, in four named stages: [`resolve`](TrainingPod::resolve) the pod, find its
/// [`budget`], [`plan`] the config into it, [`render`] the result.
fn decide(pod: &Pod, policy: &Policy, profiles: &Profiles) -> Result<Mutation, String> {
    let mut training = TrainingPod::resolve(pod, &policy.models).map_err(|e| e.to_string())?;
    let mut warnings = Vec::new();
    let dra = dra_devices(pod, &mut training, policy, profiles, &mut warnings);
    let budget = budget(pod, &training, dra.as_ref(), policy, &mut warnings);
    let planned = plan(pod, &training, budget, policy, profiles, &mut warnings)?;
    Ok(render(&training, policy, planned, warnings))
}

/// The memory of the trainer's DRA devices ([`crate::dra`]), and its device when the pod
/// names none and asks for no other accelerator ([`DraReading::on`](crate::dra::DraReading::on)):
/// a claim on NVIDIA's driver makes a `cuda` pod, AMD's a `rocm` one. What cannot be read is a warning, unless `memguard.io/gpu-memory`
/// already says how much memory there is.
fn dra_devices(
    pod: &Pod,
    training: &mut TrainingPod,
    policy: &Policy,
    profiles: &Profiles,
    warnings: &mut Vec<String>,
) -> Option<DraMemory> {
    let reading = crate::dra::read(pod, training.trainer, profiles.dra(), policy);
    if training.annotations.gpu_memory.is_none() {
        for w in &reading.warnings {
            warnings.push(truncate(&format!("memguard: {w}")));
        }
    }
    let (device, memory) = reading.on(training.config.device, training.annotations.device_given);
    training.config.device = device;
    memory.cloned()
}

/// The pod's safety ratio (`memguard.io/safety-ratio`), else the policy's.
fn safety_ratio(training: &TrainingPod, policy: &Policy) -> f64 {
    training
        .annotations
        .safety_ratio
        .unwrap_or(policy.safety_ratio)
}

/// The memory the plan aims at ([`crate::budget`]), with the pod's safety ratio or the
/// policy's.
fn budget(
    pod: &Pod,
    training: &TrainingPod,
    dra: Option<&DraMemory>,
    policy: &Policy,
    warnings: &mut Vec<String>,
) -> Option<Budget> {
    crate::budget::resolve(
        pod,
        training.trainer,
        training.config.device,
        crate::budget::Known {
            annotated: training.annotations.gpu_memory,
            dra,
        },
        safety_ratio(training, policy),
        policy,
        warnings,
    )
}

/// A downgrade plan, what past runs taught it, the budget it was made for (placement may have
/// raised it), the placement's node affinity, and the "cannot fit" verdict when there is one.
struct Planned {
    plan: DowngradePlan,
    adjust: Adjustments,
    budget: Option<Budget>,
    affinity: Option<k8s_openapi::api::core::v1::Affinity>,
    verdict: Option<String>,
}

/// What past runs of this profile teach (a calibration, a recovery after an OOM kill), where
/// the pod may be placed, then the downgrade plan from there into the budget. A pod without a
/// profile plans as before.
fn plan(
    pod: &Pod,
    training: &TrainingPod,
    mut budget: Option<Budget>,
    policy: &Policy,
    profiles: &Profiles,
    warnings: &mut Vec<String>,
) -> Result<Planned, String> {
    let key = PodKey::of(training);
    let adjust = profiles
        .adjustments(pod.metadata.namespace.as_deref(), &key)
        .unwrap_or_default();
    let calibration = adjust.effective_calibration();
    // Planned against the upper bound at the policy's level, not the point estimate.
    let bound = adjust.bound(policy.estimate_level);
    let mut start = adjust.start(&training.config, &policy.floors);
    start.expandable_segments = expandable_segments(
        start.device,
        user_alloc_conf(training.trainer)
            .as_ref()
            .map(Option::as_deref),
    );
    if let Some(recovery) = &adjust.recovery {
        warnings.push(truncate(&format!(
            "memguard: recovery: {}",
            recovery.reason
        )));
    }
    let placement = match &budget {
        Some(b)
            if b.source == BudgetSource::PolicyDefault
                && placeable(pod, training.trainer, &training.config) =>
        {
            crate::placement::place(
                pod,
                &start,
                &calibration,
                &bound,
                &policy.floors,
                safety_ratio(training, policy),
                policy,
            )
        }
        _ => None,
    };
    if let Some(p) = &placement {
        let bound = format!(
            "{}>{}",
            memguard_api::pod::NVIDIA_GPU_MEMORY_LABEL,
            p.min_label_mib - 1
        );
        if policy.placement == PlacementMode::Required {
            // Every node the affinity allows has at least this much: plan for it.
            budget = Some(Budget::new(
                p.device_memory,
                safety_ratio(training, policy),
                BudgetSource::Placement(bound.clone()),
            ));
        }
        warnings.push(truncate(&format!(
            "memguard: placement {}: node affinity {bound} (MiB)",
            match policy.placement {
                PlacementMode::Required => "required",
                _ => "preferred",
            }
        )));
    }
    let target = budget.as_ref().map_or(Bytes(u64::MAX), |b| b.bytes);
    let plan =
        plan_against(&start, target, &calibration, &policy.floors, &bound).map_err(|errs| {
            errs.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ")
        })?;

    // Every knob at its floor and still over the budget: admitted anyway, at the smallest config
    // tried, saying so (the profile's verdict, when it has one, says more).
    let floor_verdict = budget.as_ref().filter(|_| !plan.fits).map(|b| {
        format!(
            "cannot fit: estimate {}{} exceeds budget {} with every knob at its floor; smallest \
             config tried: {}",
            plan.total(),
            plan.bound
                .level
                .map(|level| format!(" (upper bound {} at {level})", plan.upper()))
                .unwrap_or_default(),
            b.bytes,
            describe_knobs(&knobs_of(&plan.config))
        )
    });
    let verdict = adjust.verdict.clone().or(floor_verdict);
    if let Some(b) = &budget
        && plan.fits
        && !plan.steps.is_empty()
    {
        let names: Vec<&str> = plan.steps.iter().map(|s| s.rung.name()).collect();
        warnings.push(truncate(&format!(
            "memguard: downgraded to fit {} ({}); see {}",
            b.bytes,
            names.join(", "),
            keys::ESTIMATE
        )));
    }
    Ok(Planned {
        plan,
        adjust,
        budget,
        affinity: placement.map(|p| p.affinity),
        verdict,
    })
}

/// The plan as the pod will carry it: the trainer's `MEMGUARD_*` env, its own variables
/// (env-map), the sidecar, the estimate annotation.
fn render(
    training: &TrainingPod,
    policy: &Policy,
    Planned {
        plan,
        adjust,
        budget,
        affinity,
        verdict,
    }: Planned,
    mut warnings: Vec<String>,
) -> Mutation {
    let trainer = training.trainer;
    let knobs = knobs_for(&plan.config);
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
    trainer_env.push((env::SIGNAL_FILE.into(), wellknown::SIGNAL_FILE.into()));
    trainer_env.push((
        env::SIDECAR_URL.into(),
        format!("http://{}", wellknown::SIDECAR_LISTEN),
    ));

    // The pod's own env-map, else the policy's: both checked when they were parsed.
    let env_map = if training.annotations.env_map.is_empty() {
        &policy.env_names
    } else {
        &training.annotations.env_map
    };
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

    let sidecar = sidecar_plan(policy, &trainer.name, &plan, budget.as_ref());
    let estimate = estimate_annotation(&plan, budget.as_ref(), &training.config, &adjust);
    Mutation {
        trainer_index: training.trainer_index,
        trainer: trainer.name.clone(),
        budget,
        plan,
        trainer_env,
        user_env,
        sidecar,
        estimate,
        warnings,
        error: verdict,
        affinity,
    }
}

/// PyTorch's CUDA caching-allocator settings. memguard sets `expandable_segments:True` on CUDA
/// trainers that do not set the variable themselves: varying batch shapes then no longer
/// fragment the allocator's reserve (docs/webhook.md, "Expandable segments", for the trade).
pub const ALLOC_CONF: &str = "PYTORCH_CUDA_ALLOC_CONF";
/// The value memguard sets.
pub const EXPANDABLE_SEGMENTS: &str = "expandable_segments:True";

/// The trainer's own `PYTORCH_CUDA_ALLOC_CONF`: `None` when unset, `Some(None)` when it comes
/// from a reference (`valueFrom`: its value is not known here).
pub fn user_alloc_conf(trainer: &k8s_openapi::api::core::v1::Container) -> Option<Option<String>> {
    trainer
        .env
        .iter()
        .flatten()
        .find(|e| e.name == ALLOC_CONF)
        .map(|e| e.value.clone().filter(|_| e.value_from.is_none()))
}

/// Whether a trainer on `device` with its own allocator setting `user` (as
/// [`user_alloc_conf`] reads it) runs with expandable segments: on CUDA, when memguard sets the
/// variable (unset) or the user's value turns them on; a value from a reference counts as off.
pub fn expandable_segments(device: Device, user: Option<Option<&str>>) -> bool {
    device == Device::Cuda
        && match user {
            None => true,
            Some(Some(v)) => v
                .split(',')
                .any(|kv| kv.trim().eq_ignore_ascii_case(EXPANDABLE_SEGMENTS)),
            Some(None) => false,
        }
}

/// Placement applies to a pod on whole NVIDIA GPUs, not pinned to a product, not time-sliced,
/// whose affinity says nothing of `nvidia.com/gpu.memory` yet (the user's, or memguard's from an
/// earlier call: then the budget stage reads the bound).
fn placeable(
    pod: &Pod,
    trainer: &k8s_openapi::api::core::v1::Container,
    config: &TrainingConfig,
) -> bool {
    use memguard_api::pod::{AcceleratorKind, Accelerators, constrains_gpu_memory, gpu_products};
    let acc = Accelerators::of(pod, trainer);
    config.device == Device::Cuda
        && acc.kinds == [AcceleratorKind::NvidiaGpu]
        && !acc.time_sliced
        && gpu_products(pod).is_empty()
        && !constrains_gpu_memory(pod)
}

/// The knobs that mean something for this config (LoRA knobs only for adapter methods, the
/// gradient sync only for FSDP across ranks, where it decides whether gradients stay sharded).
fn knobs_for(cfg: &TrainingConfig) -> Vec<Knob> {
    let fsdp_ranks = cfg.parallelism == Parallelism::Fsdp && cfg.world_size > 1;
    Knob::ALL
        .into_iter()
        .filter(|k| cfg.is_adapter() || !matches!(k, Knob::LoraRank | Knob::LoraLayers))
        .filter(|k| fsdp_ranks || *k != Knob::GradSync)
        .collect()
}

fn sidecar_plan(
    policy: &Policy,
    trainer: &str,
    plan: &DowngradePlan,
    budget: Option<&Budget>,
) -> SidecarPlan {
    let cfg = &plan.config;
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
    env.extend([
        (env::BATCH_SIZE.into(), cfg.batch_size.to_string()),
        (
            env::GRAD_ACCUMULATION.into(),
            cfg.grad_accumulation.to_string(),
        ),
        (
            env::GRAD_CHECKPOINTING.into(),
            cfg.grad_checkpointing.to_string(),
        ),
        (env::ESTIMATE_BYTES.into(), plan.total().0.to_string()),
    ]);
    if let Some(b) = budget {
        env.push((env::BUDGET_BYTES.into(), b.bytes.0.to_string()));
    }
    SidecarPlan {
        mode: policy.sidecar_mode,
        image: policy.sidecar_image.clone(),
        resources: policy.sidecar_resources.clone(),
        env,
    }
}

fn estimate_annotation(
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
        config: knobs_for(cfg)
            .into_iter()
            .map(|k| (k.name().to_string(), k.value(cfg)))
            .chain([("world-size".to_string(), config.world_size.to_string())])
            .collect(),
        uncalibrated: plan.estimate.total,
        calibration: adjust.calibration.is_active().then_some(adjust.calibration),
        recovery: adjust.recovery.as_ref().map(|r| r.reason.clone()),
    }
}

/// The admission warning for a "cannot fit: <why>; smallest config tried: <config>" verdict:
/// the config first, so that cutting it to [`MAX_WARNING_CHARS`] loses the figures, not the
/// config (the full text is in `memguard.io/error`).
pub fn cannot_fit_warning(verdict: &str) -> String {
    const TRIED: &str = "; smallest config tried: ";
    let body = verdict.strip_prefix("cannot fit: ").unwrap_or(verdict);
    match body.split_once(TRIED) {
        Some((why, config)) => truncate(&format!(
            "memguard: cannot fit; smallest config tried: {config} ({why})"
        )),
        None => truncate(&format!("memguard: cannot fit: {body}")),
    }
}

/// Cuts `s` to [`MAX_WARNING_CHARS`] characters, marking the cut with `…`.
pub fn truncate(s: &str) -> String {
    if s.chars().count() <= MAX_WARNING_CHARS {
        return s.to_string();
    }
    let mut out: String = s.chars().take(MAX_WARNING_CHARS - 1).collect();
    out.push('…');
    out
}

#[cfg(test)]
mod tests;
