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
use memguard_api::pod::{GpuNode, MIG_PRODUCT_INFIX, NVIDIA_GPU_MEMORY_LABEL};
use memguard_api::policy::{MAX_DRIVER_RESERVED_MIB, PlacementMode};
use memguard_estimator::plan::Floors;
use memguard_estimator::{
    Bound, Bytes, Calibration, Cost, Suggestion, TrainingConfig, plan_against,
};

/// Weight of memguard's preferred term (the highest the scheduler takes).
pub const PREFERRED_WEIGHT: i32 = 100;

/// What placement decided for one pod.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    /// The pod's `spec.affinity`, merged.
    pub affinity: Affinity,
    /// The bound in words (`nvidia.com/gpu.memory>81919`), for the warning and the budget
    /// source.
    pub bound: String,
    /// Memory of one GPU on the smallest node the affinity allows.
    pub device_memory: Bytes,
    /// The known nodes the affinity allows (empty when placed on the policy's table alone).
    pub nodes: Vec<GpuNode>,
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
    let affinity = merged(pod, &[expression], policy.placement);
    Some(Placement {
        affinity,
        bound: format!("{NVIDIA_GPU_MEMORY_LABEL}>{}", chosen - 1),
        device_memory: usable(chosen),
        nodes: Vec::new(),
    })
}

/// The pod's affinity with `expressions` (alternatives: a node matching any one is in) merged
/// in: `required` ANDs each into every term of the pod's own (terms are ORed, so the bound
/// holds whichever matches), one term per alternative; `preferred` appends one term each.
fn merged(pod: &Pod, expressions: &[NodeSelectorRequirement], mode: PlacementMode) -> Affinity {
    let mut affinity = pod
        .spec
        .as_ref()
        .and_then(|s| s.affinity.clone())
        .unwrap_or_default();
    let node = affinity
        .node_affinity
        .get_or_insert_with(NodeAffinity::default);
    match mode {
        PlacementMode::Required => {
            let required = node
                .required_during_scheduling_ignored_during_execution
                .get_or_insert_with(NodeSelector::default);
            let users = std::mem::take(&mut required.node_selector_terms);
            let users = if users.is_empty() {
                vec![NodeSelectorTerm::default()]
            } else {
                users
            };
            for term in users {
                for expression in expressions {
                    let mut term = term.clone();
                    term.match_expressions
                        .get_or_insert_with(Vec::new)
                        .push(expression.clone());
                    required.node_selector_terms.push(term);
                }
            }
        }
        PlacementMode::Preferred | PlacementMode::Off => {
            let preferred = node
                .preferred_during_scheduling_ignored_during_execution
                .get_or_insert_with(Vec::new);
            for expression in expressions {
                preferred.push(PreferredSchedulingTerm {
                    weight: PREFERRED_WEIGHT,
                    preference: NodeSelectorTerm {
                        match_expressions: Some(vec![expression.clone()]),
                        match_fields: None,
                    },
                });
            }
        }
    }
    affinity
}

/// One GPU class among the nodes a pod may use: the usable memory of one GPU, and the nodes.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeClass {
    /// One GPU's memory ([`crate::budget::node_memory`]).
    pub device_memory: Bytes,
    /// What sized it (`NVIDIA-A100-SXM4-80GB`, `nvidia.com/gpu.memory=24576`): the class's
    /// name in messages.
    pub name: String,
    /// Its nodes.
    pub nodes: Vec<GpuNode>,
}

/// The GPU classes of `nodes` (distinct usable sizes, ascending); a node nothing sizes is left
/// out.
pub fn node_classes(nodes: &[GpuNode], policy: &Policy) -> Vec<NodeClass> {
    let mut classes: Vec<NodeClass> = Vec::new();
    for node in nodes {
        let Some((bytes, name)) = crate::budget::node_memory(node, policy) else {
            continue;
        };
        match classes.iter_mut().find(|c| c.device_memory == bytes) {
            Some(c) => c.nodes.push(node.clone()),
            None => classes.push(NodeClass {
                device_memory: bytes,
                name,
                nodes: vec![node.clone()],
            }),
        }
    }
    classes.sort_by_key(|c| c.device_memory);
    classes
}

/// Whether `start` fits `budget` with free or compute knobs only (no quality cut).
pub fn fits_without_quality(
    start: &TrainingConfig,
    budget: Bytes,
    calibration: &Calibration,
    floors: &Floors,
    bound: &Bound,
) -> bool {
    plan_against(start, budget, calibration, floors, bound)
        .is_ok_and(|p| p.fits && p.steps.iter().all(|s| s.rung.cost() != Cost::Quality))
}

/// The placement for `pod` (not pinned; the caller checks) among the known GPU `nodes` it may
/// use: the smallest class where `start` fits with free or compute knobs, else the largest;
/// `None` when placement is off, the nodes make one class, or the smallest class is chosen
/// (every node the pod may use fits it: nothing to steer).
#[allow(clippy::too_many_arguments)]
pub fn place_on_nodes(
    pod: &Pod,
    start: &TrainingConfig,
    calibration: &Calibration,
    bound: &Bound,
    floors: &Floors,
    safety_ratio: f64,
    policy: &Policy,
    nodes: &[GpuNode],
) -> Option<Placement> {
    if policy.placement == PlacementMode::Off {
        return None;
    }
    let classes = node_classes(nodes, policy);
    let fits = |c: &NodeClass| {
        let budget = Bytes::from_f64(c.device_memory.as_f64() * safety_ratio);
        fits_without_quality(start, budget, calibration, floors, bound)
    };
    let at = classes
        .iter()
        .position(fits)
        .unwrap_or(classes.len().checked_sub(1)?);
    if at == 0 {
        return None;
    }
    let chosen: Vec<GpuNode> = classes[at..]
        .iter()
        .flat_map(|c| c.nodes.iter().cloned())
        .collect();
    let (expressions, words) = node_expressions(&chosen);
    if expressions.is_empty() {
        return None;
    }
    Some(Placement {
        affinity: merged(pod, &expressions, policy.placement),
        bound: words,
        device_memory: classes[at].device_memory,
        nodes: chosen,
    })
}

/// Node-selector expressions that admit `nodes` (alternatives), and the same in words: the
/// nodes labelled with `nvidia.com/gpu.memory` by a `Gt` on it (a new node of that size or
/// larger is in too), the others by `In` on the label that names their GPU.
fn node_expressions(nodes: &[GpuNode]) -> (Vec<NodeSelectorRequirement>, String) {
    let mut expressions = Vec::new();
    let mut words = Vec::new();
    if let Some(min) = nodes.iter().filter_map(|n| n.memory_mib).min() {
        expressions.push(NodeSelectorRequirement {
            key: NVIDIA_GPU_MEMORY_LABEL.to_string(),
            operator: "Gt".to_string(),
            values: Some(vec![(min - 1).to_string()]),
        });
        words.push(format!("{NVIDIA_GPU_MEMORY_LABEL}>{}", min - 1));
    }
    let mut by_label: std::collections::BTreeMap<&str, Vec<String>> = Default::default();
    for n in nodes.iter().filter(|n| n.memory_mib.is_none()) {
        if let Some((label, value)) = &n.product_label {
            by_label.entry(label).or_default().push(value.clone());
        }
    }
    for (label, mut values) in by_label {
        values.sort();
        values.dedup();
        words.push(format!("{label} in ({})", values.join(", ")));
        expressions.push(NodeSelectorRequirement {
            key: label.to_string(),
            operator: "In".to_string(),
            values: Some(values),
        });
    }
    (expressions, words.join(" or "))
}

/// A GPU with more memory than `current` (one device) on which `start`'s plan fits, as a
/// suggestion: the smallest such class among the GPU `nodes` the pod may use when they are
/// known, else among the policy's whole NVIDIA GPUs (named by product, to pin). `None` when no
/// larger GPU fits.
#[allow(clippy::too_many_arguments)]
pub fn larger_gpu(
    start: &TrainingConfig,
    current: Bytes,
    safety_ratio: f64,
    calibration: &Calibration,
    floors: &Floors,
    bound: &Bound,
    policy: &Policy,
    nodes: &[GpuNode],
) -> Option<Suggestion> {
    let candidates: Vec<(Bytes, String)> = if nodes.is_empty() {
        let mut by_size: std::collections::BTreeMap<Bytes, Vec<&str>> = Default::default();
        for (product, b) in &policy.gpu_memory {
            if !product.contains(MIG_PRODUCT_INFIX) && !product.starts_with("AMD_") {
                by_size.entry(*b).or_default().push(product);
            }
        }
        by_size
            .into_iter()
            .map(|(b, products)| {
                let shown: Vec<&str> = products.into_iter().take(2).collect();
                (
                    b,
                    format!(
                        "a larger GPU: {}, {b}, pinned by nvidia.com/gpu.product",
                        shown.join(" or ")
                    ),
                )
            })
            .collect()
    } else {
        node_classes(nodes, policy)
            .into_iter()
            .map(|c| {
                (
                    c.device_memory,
                    format!(
                        "a larger GPU among the nodes the pod may use: {}, {}",
                        c.name, c.device_memory
                    ),
                )
            })
            .collect()
    };
    candidates
        .into_iter()
        .filter(|(b, _)| *b > current)
        .find_map(|(b, change)| {
            let budget = Bytes::from_f64(b.as_f64() * safety_ratio);
            let plan = plan_against(start, budget, calibration, floors, bound).ok()?;
            plan.fits.then(|| Suggestion {
                change,
                upper: plan.upper(),
                budget,
                fits: true,
                config: plan.config,
            })
        })
}
