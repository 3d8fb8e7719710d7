//! The placement stage: where a GPU pod that is not pinned to a product should run.
//!
//! The pod's config is planned for each GPU memory class the policy knows (the distinct sizes of
//! its whole NVIDIA GPUs). The smallest class where the config fits undowngraded is chosen, else
//! the largest (the least downgraded). memguard then adds node affinity on GPU feature
//! discovery's `nvidia.com/gpu.memory` (NVML's total, MiB) toward nodes of that class or
//! larger: `preferred` (the pod may still land anywhere, so its config is planned as before) or
//! `required` (the config is planned for the smallest node the affinity allows, with the largest
//! driver reservation taken off, so it fits every one of them). The user's own affinity is kept:
//! memguard's expression is ANDed into each required term, or appended as one preferred term.

use k8s_openapi::api::core::v1::{
    Affinity, NodeAffinity, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, Pod,
    PreferredSchedulingTerm,
};
use memguard_api::Policy;
use memguard_api::pod::{MIG_PRODUCT_INFIX, NVIDIA_GPU_MEMORY_LABEL};
use memguard_api::policy::{MAX_DRIVER_RESERVED_MIB, PlacementMode};
use memguard_estimator::plan::Floors;
use memguard_estimator::{Bound, Bytes, Calibration, TrainingConfig, plan_against};

/// Weight of memguard's preferred term (the highest the scheduler takes).
pub const PREFERRED_WEIGHT: i32 = 100;

/// What placement decided for one pod.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// The pod's `spec.affinity`, merged.
    pub affinity: Affinity,
    /// Nodes must (required) or should (preferred) have at least this `nvidia.com/gpu.memory`.
    pub min_label_mib: u64,
    /// Memory of one GPU on the smallest node the affinity allows.
    pub device_memory: Bytes,
}

/// The GPU memory classes the policy knows (MiB, ascending): its whole NVIDIA GPUs (no MIG
/// slices, no `AMD_` products).
pub fn classes(policy: &Policy) -> Vec<u64> {
    let mut mib: Vec<u64> = policy
        .gpu_memory
        .iter()
        .filter(|(product, _)| !product.contains(MIG_PRODUCT_INFIX) && !product.starts_with("AMD_"))
        .map(|(_, b)| b.0 >> 20)
        .collect();
    mib.sort_unstable();
    mib.dedup();
    mib
}

/// One GPU on a node labelled with at least `label_mib`: the label less the largest driver
/// reservation.
pub fn usable(label_mib: u64) -> Bytes {
    Bytes::mib(label_mib.saturating_sub(MAX_DRIVER_RESERVED_MIB))
}

/// The placement for `pod` (not pinned; the caller checks), or `None` when placement is off or
/// every class fits undowngraded (nothing to steer).
pub fn place(
    pod: &Pod,
    start: &TrainingConfig,
    calibration: &Calibration,
    bound: &Bound,
    floors: &Floors,
    safety_ratio: f64,
    policy: &Policy,
) -> Option<Placement> {
    if policy.placement == PlacementMode::Off {
        return None;
    }
    let classes = classes(policy);
    let undowngraded = |mib: u64| {
        let budget = Bytes::from_f64(usable(mib).as_f64() * safety_ratio);
        plan_against(start, budget, calibration, floors, bound)
            .is_ok_and(|p| p.fits && p.steps.is_empty())
    };
    let chosen = classes
        .iter()
        .copied()
        .find(|&mib| undowngraded(mib))
        .or_else(|| classes.last().copied())?;
    if Some(&chosen) == classes.first() {
        return None;
    }
    let expression = NodeSelectorRequirement {
        key: NVIDIA_GPU_MEMORY_LABEL.to_string(),
        operator: "Gt".to_string(),
        values: Some(vec![(chosen - 1).to_string()]),
    };
    let mut affinity = pod
        .spec
        .as_ref()
        .and_then(|s| s.affinity.clone())
        .unwrap_or_default();
    let node = affinity
        .node_affinity
        .get_or_insert_with(NodeAffinity::default);
    match policy.placement {
        PlacementMode::Required => {
            let required = node
                .required_during_scheduling_ignored_during_execution
                .get_or_insert_with(NodeSelector::default);
            if required.node_selector_terms.is_empty() {
                required
                    .node_selector_terms
                    .push(NodeSelectorTerm::default());
            }
            // Terms are ORed: the bound goes into each, so it holds whichever term matches.
            for term in &mut required.node_selector_terms {
                term.match_expressions
                    .get_or_insert_with(Vec::new)
                    .push(expression.clone());
            }
        }
        PlacementMode::Preferred | PlacementMode::Off => {
            node.preferred_during_scheduling_ignored_during_execution
                .get_or_insert_with(Vec::new)
                .push(PreferredSchedulingTerm {
                    weight: PREFERRED_WEIGHT,
                    preference: NodeSelectorTerm {
                        match_expressions: Some(vec![expression]),
                        match_fields: None,
                    },
                });
        }
    }
    Some(Placement {
        affinity,
        min_label_mib: chosen,
        device_memory: usable(chosen),
    })
}
