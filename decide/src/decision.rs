//! The budget stage of the decision, once for every caller: the webhook's admission
//! (`memguard mutate`), `memguard estimate`, `memguard explain` and the profile controller's key.
//! Pure: no I/O.
//!
//! From a resolved pod ([`TrainingPod::resolve`]: its device, DRA claims, accelerators, memory
//! limit), [`decide`] derives the profile key ([`PodKey::of`]), the memory budget
//! ([`crate::budget`]), what past runs teach ([`Adjustments`]), the placement
//! ([`crate::placement`]) and the downgrade plan into the budget under the policy's floors
//! ([`plan_into`]). Rendering the plan into a pod is the webhook's job.

use crate::Adjustments;
use crate::budget::{Budget, BudgetSource};
use crate::key::PodKey;
use crate::warnings::truncate;
use k8s_openapi::api::core::v1::Affinity;
use memguard_api::annotations as keys;
use memguard_api::crd::TrainingKnobs;
use memguard_api::pod::{AcceleratorKind, constrains_gpu_memory, gpu_products};
use memguard_api::policy::PlacementMode;
use memguard_api::{Policy, TrainingPod};
use memguard_estimator::{
    Bound, Bytes, Calibration, Device, DowngradePlan, Floors, Suggestion, TrainingConfig,
    plan_against, suggest,
};

/// Everything decided for one pod, before it is rendered.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The profile key: the one the controller learns under and admission reads.
    pub key: PodKey,
    /// The budget the plan was made for (placement may have raised it); `None` for a CPU pod
    /// without a memory limit.
    pub budget: Option<Budget>,
    /// The downgrade plan, from the profile's start into the budget, under the policy's floors.
    pub plan: DowngradePlan,
    /// What past runs of this profile taught.
    pub adjust: Adjustments,
    /// The pod's affinity with the placement merged in, when placement added any.
    pub affinity: Option<Affinity>,
    /// "cannot fit: …": the profile's verdict, or every knob at its floor and still over.
    pub verdict: Option<String>,
    /// When the plan does not fit: the changes outside the knobs that would
    /// ([`memguard_estimator::suggest`]), those that fit first, each with its estimate.
    pub suggestions: Vec<Suggestion>,
    /// Warnings on the way, each cut to size.
    pub warnings: Vec<String>,
}

/// Decides `training` under `policy`; `adjustments` finds what past runs of a key taught (the
/// webhook's profiles; none offline). An error is a config the estimator refuses.
pub fn decide(
    training: &TrainingPod,
    policy: &Policy,
    adjustments: impl FnOnce(&PodKey) -> Option<Adjustments>,
) -> Result<Decision, String> {
    let (budget, warnings) = budget(training, policy);
    let key = PodKey::of(training);
    let adjust = adjustments(&key).unwrap_or_default();
    plan(training, key, budget, adjust, policy, warnings)
}

/// The memory the plan aims at ([`crate::budget`]) with the pod's safety ratio or the policy's,
/// and the warnings on the way (the DRA reading's first).
pub fn budget(training: &TrainingPod, policy: &Policy) -> (Option<Budget>, Vec<String>) {
    let mut warnings = dra_warnings(training);
    let budget = crate::budget::resolve(
        training,
        safety_ratio(training, policy),
        policy,
        &mut warnings,
    );
    (budget, warnings)
}

/// The DRA reading's warnings, unless `memguard.io/gpu-memory` already says how much memory
/// there is.
fn dra_warnings(training: &TrainingPod) -> Vec<String> {
    if training.annotations.gpu_memory.is_some() {
        return Vec::new();
    }
    training
        .dra
        .warnings
        .iter()
        .map(|w| truncate(&format!("memguard: {w}")))
        .collect()
}

/// The pod's safety ratio (`memguard.io/safety-ratio`), else the policy's.
pub fn safety_ratio(training: &TrainingPod, policy: &Policy) -> f64 {
    pod_safety_ratio(training.annotations.safety_ratio, policy)
}

/// The pod's `memguard.io/safety-ratio` where given (`pod_ratio`), else the policy's.
pub fn pod_safety_ratio(pod_ratio: Option<f64>, policy: &Policy) -> f64 {
    pod_ratio.unwrap_or(policy.safety_ratio)
}

/// The policy's floors, with quality knobs allowed where the pod allows them
/// (`memguard.io/allow-quality`, which overrides the policy's `floors.allowQuality`).
pub fn floors(pod_allows_quality: Option<bool>, policy: &Policy) -> Floors {
    Floors {
        allow_quality: pod_allows_quality.unwrap_or(policy.floors.allow_quality),
        ..policy.floors
    }
}

/// The downgrade plan of `start` into `budget` (none: no limit) under `floors` ([`floors`]),
/// checked against `bound` (the upper bound at the policy's level). An error is each problem
/// the estimator found in `start`.
pub fn plan_into(
    start: &TrainingConfig,
    budget: Option<Bytes>,
    calibration: &Calibration,
    floors: &Floors,
    bound: &Bound,
) -> Result<DowngradePlan, Vec<String>> {
    plan_against(
        start,
        budget.unwrap_or(Bytes(u64::MAX)),
        calibration,
        floors,
        bound,
    )
    .map_err(|errs| errs.iter().map(ToString::to_string).collect())
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

/// What past runs teach (a calibration, a recovery after an OOM kill), where the pod may be
/// placed, then the downgrade plan from there into the budget.
fn plan(
    training: &TrainingPod,
    key: PodKey,
    mut budget: Option<Budget>,
    adjust: Adjustments,
    policy: &Policy,
    mut warnings: Vec<String>,
) -> Result<Decision, String> {
    let calibration = adjust.effective_calibration();
    // Planned against the upper bound at the policy's level, not the point estimate.
    let bound = adjust.bound(policy.estimate_level);
    let floors = floors(training.annotations.allow_quality, policy);
    let mut start = adjust.start(&training.config, &floors);
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
        Some(b) if b.source == BudgetSource::PolicyDefault && placeable(training) => {
            crate::placement::place(
                training.pod,
                &start,
                &calibration,
                &bound,
                &floors,
                safety_ratio(training, policy),
                policy,
            )
        }
        // The nodes the pod may use are known: placement chooses among them.
        Some(b) if matches!(b.source, BudgetSource::Nodes(_)) && placeable(training) => {
            crate::placement::place_on_nodes(
                training.pod,
                &start,
                &calibration,
                &bound,
                &floors,
                safety_ratio(training, policy),
                policy,
                &training.gpu_nodes,
            )
        }
        _ => None,
    };
    if let Some(p) = &placement {
        if policy.placement == PlacementMode::Required {
            // Every node the affinity allows has at least this much: plan for it, not the
            // assumed default or the smallest node.
            warnings.retain(|w| !w.starts_with(crate::budget::ASSUMED_DEFAULT));
            let (memory, source) = if p.nodes.is_empty() {
                (p.device_memory, BudgetSource::Placement(p.bound.clone()))
            } else {
                // As the budget stage reads the placed pod back on reinvocation.
                let mut placed = training.pod.clone();
                if let Some(spec) = placed.spec.as_mut() {
                    spec.affinity = Some(p.affinity.clone());
                }
                crate::budget::placed_memory(
                    &placed,
                    training.config.device,
                    &training.accelerators,
                    &p.nodes,
                    policy,
                )
            };
            budget = Some(Budget::new(memory, safety_ratio(training, policy), source));
        }
        warnings.push(truncate(&format!(
            "memguard: placement {}: node affinity {}{}",
            match policy.placement {
                PlacementMode::Required => "required",
                _ => "preferred",
            },
            p.bound,
            if p.nodes.is_empty() { " (MiB)" } else { "" }
        )));
    }
    let plan = plan_into(
        &start,
        budget.as_ref().map(|b| b.bytes),
        &calibration,
        &floors,
        &bound,
    )
    .map_err(|errs| errs.join("; "))?;

    // Every knob at its floor and still over the budget: admitted anyway, at the smallest config
    // tried, saying so and what would fit (the profile's verdict, when it has one, says more).
    let suggestions = match &budget {
        Some(b) if !plan.fits => {
            let mut out = suggest(&start, b.bytes, &calibration, &floors, &bound);
            // A larger GPU helps only where the budget is a whole device the pod could trade
            // (not a share, a slice, a claim or the user's own figure).
            let whole_device = matches!(
                b.source,
                BudgetSource::PolicyDefault
                    | BudgetSource::GpuProduct(_)
                    | BudgetSource::Nodes(_)
                    | BudgetSource::Placement(_)
            );
            // A time-sliced GPU is shared whatever its size.
            if whole_device
                && training.config.device == Device::Cuda
                && !training.accelerators.time_sliced
            {
                let larger = crate::placement::larger_gpu(
                    &start,
                    b.device_memory,
                    b.safety_ratio,
                    &calibration,
                    &floors,
                    &bound,
                    policy,
                    &training.gpu_nodes,
                );
                out.splice(0..0, larger);
                out.sort_by_key(|s| !s.fits);
            }
            out
        }
        _ => Vec::new(),
    };
    let floor_verdict = budget.as_ref().filter(|_| !plan.fits).map(|b| {
        format!(
            "cannot fit: needs {}{} of budget {} with every knob at its floor; smallest \
             config tried: {}{}{}",
            plan.total(),
            plan.bound
                .level
                .map(|level| format!(" (upper bound {} at {level})", plan.upper()))
                .unwrap_or_default(),
            b.bytes,
            TrainingKnobs::of(&plan.config).describe(),
            quality_note(&plan, &floors),
            would_fit(&suggestions)
        )
    });
    let verdict = adjust.verdict.clone().or(floor_verdict);
    if let Some(b) = &budget
        && plan.fits
        && !plan.steps.is_empty()
    {
        let names: Vec<String> = plan
            .steps
            .iter()
            .map(|s| format!("{} -{}", s.rung.name(), s.saved))
            .collect();
        warnings.push(truncate(&format!(
            "memguard: downgraded to fit {} ({}); see {}",
            b.bytes,
            names.join(", "),
            keys::ESTIMATE
        )));
    }
    Ok(Decision {
        key,
        budget,
        plan,
        adjust,
        affinity: placement.map(|p| p.affinity),
        verdict,
        suggestions,
        warnings,
    })
}

/// "; sequence kept (…)" when the plan could have cut a quality knob (the sequence, the
/// adapter) but had no permission; empty otherwise.
fn quality_note(plan: &DowngradePlan, floors: &Floors) -> String {
    use memguard_estimator::Rung;
    if floors.allow_quality {
        return String::new();
    }
    let allowed = Floors {
        allow_quality: true,
        ..*floors
    };
    let could = |r: Rung| r.apply(&plan.config, &allowed).is_some();
    let kept: Vec<&str> = [
        (could(Rung::HalveSeqLength), "sequence"),
        (
            could(Rung::HalveLoraRank) || could(Rung::HalveLoraLayers),
            "adapter",
        ),
    ]
    .into_iter()
    .filter_map(|(c, name)| c.then_some(name))
    .collect();
    if kept.is_empty() {
        return String::new();
    }
    format!(
        "; {} kept ({}: \"true\" lets the plan cut {})",
        kept.join(" and "),
        keys::ALLOW_QUALITY,
        if kept.len() > 1 { "them" } else { "it" }
    )
}

/// "; would fit: A (estimate), B (estimate)" from the suggestions that fit, else "; nothing
/// tried fits: …" with the closest; empty without suggestions.
pub fn would_fit(suggestions: &[Suggestion]) -> String {
    let fitting: Vec<String> = suggestions
        .iter()
        .filter(|s| s.fits)
        .map(|s| format!("{} ({})", s.change, s.upper))
        .collect();
    if !fitting.is_empty() {
        return format!("; would fit: {}", fitting.join(", "));
    }
    match suggestions.iter().min_by_key(|s| s.upper) {
        Some(s) => format!("; nothing tried fits, closest: {} ({})", s.change, s.upper),
        None => String::new(),
    }
}

/// Placement applies to a pod on whole NVIDIA GPUs, not pinned to a product, not time-sliced,
/// whose affinity says nothing of `nvidia.com/gpu.memory` yet (the user's, or memguard's from an
/// earlier call: then the budget stage reads the bound).
fn placeable(training: &TrainingPod) -> bool {
    let acc = &training.accelerators;
    training.config.device == Device::Cuda
        && acc.kinds == [AcceleratorKind::NvidiaGpu]
        && !acc.time_sliced
        && gpu_products(training.pod).is_empty()
        && !constrains_gpu_memory(training.pod)
}
