//! The budget stage: how much memory one device of the pod really has, and where that figure
//! came from. Pure: it reads the resolved pod ([`TrainingPod`]) and the policy's product table.
//!
//! For a GPU (`cuda` or `rocm`), in order:
//! 1. `memguard.io/gpu-memory`: the user said so;
//! 2. a sharing system's cap on the pod (HAMi, KAI / Run:ai, MPS): the smallest applies;
//! 3. the device of its DRA claims ([`memguard_api::dra`], read when the pod was resolved);
//! 4. a MIG slice (mixed strategy resource, or single strategy product): its profile's size;
//! 5. the GPU product the pod is pinned to, from the policy's table;
//! 6. the smallest GPU among the nodes the pod may use, when nodes are known;
//! 7. a required affinity's bound on `nvidia.com/gpu.memory`;
//! 8. the policy's default.
//!
//! For a CPU or Metal pod, the trainer's memory limit. Anything the pod asks for that memguard
//! cannot size (an unknown extended resource, an unreadable DRA claim, time-slicing without a cap) is a
//! warning, never a guess.

use crate::warnings::truncate;
use k8s_openapi::api::core::v1::Pod;
use memguard_api::pod::{
    AMD_GPU_PRODUCT_LABEL, AcceleratorKind, Accelerators, GpuNode, HAMI_GPUMEM_PERCENTAGE_RESOURCE,
    HAMI_GPUMEM_RESOURCE, KAI_GPU_FRACTION_ANNOTATION, KAI_GPU_MEMORY_ANNOTATION,
    MIG_PRODUCT_INFIX, MPS_PINNED_MEM_ENV, MigProfile, NVIDIA_GPU_MEMORY_LABEL,
    SHARED_PRODUCT_SUFFIX, gpu_memory_floor_mib, gpu_products, pinned_values,
};
use memguard_api::policy::MAX_DRIVER_RESERVED_MIB;
use memguard_api::{Policy, TrainingPod};
use memguard_estimator::{Bytes, Device};
use serde::Serialize;

/// Where the per-device memory figure came from: `budgetSource` in `memguard.io/estimate`,
/// whose type ([`memguard_api::estimate`]) the profile controller reads back.
pub use memguard_api::estimate::BudgetSource;

/// The memory the plan aims at.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Budget {
    /// Memory of one device (a GPU, a slice, or the container's limit), before the safety ratio.
    pub device_memory: Bytes,
    /// The safety ratio applied.
    pub safety_ratio: f64,
    /// `device_memory × safety_ratio`.
    pub bytes: Bytes,
    /// Where `device_memory` came from.
    pub source: BudgetSource,
}

impl Budget {
    /// `device_memory × safety_ratio`, from `source`.
    pub fn new(device_memory: Bytes, safety_ratio: f64, source: BudgetSource) -> Budget {
        Budget {
            device_memory,
            safety_ratio,
            bytes: Bytes::from_f64(device_memory.as_f64() * safety_ratio),
            source,
        }
    }
}

/// How the warning that the policy's `defaultGpuMemory` was assumed begins (placement that
/// bounds the memory replaces the assumption, and its warning).
pub const ASSUMED_DEFAULT: &str = "memguard: assumed defaultGpuMemory";

/// The container's `limits.memory`: [`memguard_api::pod::memory_limit`].
pub use memguard_api::pod::memory_limit;

/// The budget of the resolved pod's trainer on its device, with `safety_ratio`, and the warnings
/// on the way. `None` for a CPU pod without a memory limit.
pub fn resolve(
    training: &TrainingPod,
    safety_ratio: f64,
    policy: &Policy,
    warnings: &mut Vec<String>,
) -> Option<Budget> {
    let acc = &training.accelerators;
    for problem in &acc.problems {
        warnings.push(truncate(&format!("memguard: ignored {problem}")));
    }
    let host_only = matches!(training.config.device, Device::Cpu | Device::Metal);
    if !acc.unknown.is_empty() {
        // An accelerator memguard cannot size: planning it as a CPU job against the host's
        // memory would be a guess. The pod's own figure, or no plan at all.
        if host_only && let Some(b) = training.annotations.gpu_memory {
            return Some(Budget::new(b, safety_ratio, BudgetSource::Annotation));
        }
        warnings.push(truncate(&format!(
            "memguard: unknown accelerator {}: {}; set {}",
            acc.unknown.join(", "),
            if host_only {
                "no plan"
            } else {
                "its memory is not counted"
            },
            memguard_api::annotations::GPU_MEMORY
        )));
        if host_only {
            return None;
        }
    }
    match training.config.device {
        Device::Cuda | Device::Rocm => {
            let (memory, source) = gpu_memory(training, policy, warnings);
            Some(Budget::new(memory, safety_ratio, source))
        }
        Device::Cpu | Device::Metal => match training.memory_limit {
            Some(limit) => Some(Budget::new(limit, safety_ratio, BudgetSource::MemoryLimit)),
            None => {
                warnings.push(truncate(&format!(
                    "memguard: container {} has no memory limit and no GPU: no fit can be guaranteed",
                    training.trainer.name
                )));
                None
            }
        },
    }
}

/// The memory of one device as the trainer's process sees it (CUDA's total), for a `budget`
/// from [`resolve`]: an enforced cap (HAMi, MPS), a MIG slice or a DRA device is what the
/// process sees; a soft share (KAI's `gpu-fraction` or `gpu-memory`, which KAI does not enforce,
/// or `memguard.io/gpu-memory`) leaves the whole device in view. An inference engine sizes
/// itself as a fraction of this (docs/serving.md).
pub fn seen_by_process(training: &TrainingPod, budget: &Budget, policy: &Policy) -> Bytes {
    if !matches!(
        budget.source,
        BudgetSource::Kai(_) | BudgetSource::Annotation
    ) {
        return budget.device_memory;
    }
    let acc = &training.accelerators;
    let whole = match training.dra_memory.as_ref() {
        Some(m) => m.bytes,
        None => {
            device_memory(
                training.pod,
                training.config.device,
                acc,
                &training.gpu_nodes,
                policy,
                &mut Vec::new(),
            )
            .0
        }
    };
    let enforced = [
        acc.hami_mib.map(Bytes::mib),
        acc.hami_percent
            .map(|p| Bytes::from_f64(whole.as_f64() * p as f64 / 100.0)),
        acc.mps_bytes.map(Bytes),
    ];
    enforced
        .into_iter()
        .flatten()
        .fold(whole, std::cmp::min)
        .max(budget.device_memory)
}

fn gpu_memory(
    training: &TrainingPod,
    policy: &Policy,
    warnings: &mut Vec<String>,
) -> (Bytes, BudgetSource) {
    let (pod, device, acc) = (training.pod, training.config.device, &training.accelerators);
    let (annotated, dra, nodes) = (
        training.annotations.gpu_memory,
        training.dra_memory.as_ref(),
        &training.gpu_nodes,
    );
    if let Some(b) = annotated {
        return (b, BudgetSource::Annotation);
    }
    // The whole device first: a fraction or a percentage is of it. A DRA claim's device
    // is what the pod gets, whatever its node labels say.
    let whole = match dra {
        Some(m) => (m.bytes, BudgetSource::Dra(m.detail.clone())),
        None => device_memory(pod, device, acc, nodes, policy, warnings),
    };
    let mib = |n: u64| Bytes::mib(n);
    let share = |f: f64| Bytes::from_f64(whole.0.as_f64() * f);
    let mut caps: Vec<(Bytes, BudgetSource)> = Vec::new();
    if let Some(n) = acc.hami_mib {
        caps.push((
            mib(n),
            BudgetSource::Hami(format!("{HAMI_GPUMEM_RESOURCE}={n}")),
        ));
    }
    if let Some(p) = acc.hami_percent {
        caps.push((
            share(p as f64 / 100.0),
            BudgetSource::Hami(format!("{HAMI_GPUMEM_PERCENTAGE_RESOURCE}={p}")),
        ));
    }
    if let Some(n) = acc.kai_mib {
        caps.push((
            mib(n),
            BudgetSource::Kai(format!("{KAI_GPU_MEMORY_ANNOTATION}={n}")),
        ));
    }
    if let Some(f) = acc.kai_fraction {
        caps.push((
            share(f),
            BudgetSource::Kai(format!("{KAI_GPU_FRACTION_ANNOTATION}={f}")),
        ));
    }
    if let Some(b) = acc.mps_bytes {
        caps.push((
            Bytes(b),
            BudgetSource::Mps(format!("{MPS_PINNED_MEM_ENV}={b}")),
        ));
    }
    // A cap larger than the device does not give more memory than the device has.
    let capped = !caps.is_empty();
    match caps.into_iter().min_by_key(|(b, _)| *b) {
        Some((b, source)) if b < whole.0 => (b, source),
        Some(_) | None => {
            if acc.time_sliced && !capped {
                warnings.push(truncate(
                    "memguard: time-sliced GPU without a memory cap: other pods share its memory",
                ));
            }
            whole
        }
    }
}

/// One whole device (or MIG slice): the slice's profile, else the smallest pinned product in the
/// table, else the smallest GPU among the nodes the pod may use (their labels; its selector,
/// required affinity and tolerations), else a required affinity's bound, else the policy's
/// default.
fn device_memory(
    pod: &Pod,
    device: Device,
    acc: &Accelerators,
    nodes: &[GpuNode],
    policy: &Policy,
    warnings: &mut Vec<String>,
) -> (Bytes, BudgetSource) {
    let products = match device {
        Device::Rocm => pinned_values(pod, AMD_GPU_PRODUCT_LABEL),
        _ => gpu_products(pod),
    };
    let mixed_profile = acc.kinds.iter().find_map(|k| match k {
        AcceleratorKind::Mig(p) => Some(p.clone()),
        _ => None,
    });
    if let Some(profile) = mixed_profile {
        // Mixed-strategy nodes keep the parent's product label.
        return mig_memory(&profile, &products, policy, warnings);
    }
    let known = products
        .iter()
        .filter_map(|p| product_memory(p, policy, warnings))
        .min_by_key(|(b, _)| *b);
    if let Some(found) = known {
        return found;
    }
    // The nodes the pod may use (its selector, required affinity and tolerations) say more
    // than a bound in its affinity: the smallest of them, when the cluster's nodes are known.
    if device == Device::Cuda
        && products.is_empty()
        && let Some(found) = smallest_node(nodes, policy)
    {
        return found;
    }
    let floor = match device {
        Device::Cuda => gpu_memory_floor_mib(pod),
        _ => None,
    };
    match floor {
        Some(mib) => (
            Bytes::mib(mib.saturating_sub(MAX_DRIVER_RESERVED_MIB)),
            BudgetSource::Placement(format!("{NVIDIA_GPU_MEMORY_LABEL}>{}", mib - 1)),
        ),
        None => {
            if products.is_empty() {
                warnings.push(truncate(&format!(
                    "{ASSUMED_DEFAULT} {} (no GPU product label); set {}",
                    // As the policy wrote it (`24Gi`), not `24.00 GiB`.
                    policy.default_gpu_memory_written,
                    memguard_api::annotations::GPU_MEMORY
                )));
            } else {
                warnings.push(truncate(&format!(
                    "memguard: GPU product {} not in the policy table; assuming {}",
                    products.join("|"),
                    policy.default_gpu_memory_written
                )));
            }
            (policy.default_gpu_memory, BudgetSource::PolicyDefault)
        }
    }
}

/// The smallest GPU among `nodes` ([`node_memory`]). `None` when no node says.
fn smallest_node(nodes: &[GpuNode], policy: &Policy) -> Option<(Bytes, BudgetSource)> {
    let sized: Vec<(Bytes, String)> = nodes
        .iter()
        .filter_map(|n| node_memory(n, policy))
        .collect();
    let count = sized.len();
    let (bytes, what) = sized.into_iter().min_by_key(|(b, _)| *b)?;
    let nodes = if count == 1 { "node" } else { "nodes" };
    Some((
        bytes,
        BudgetSource::Nodes(format!("smallest of {count} GPU {nodes}: {what}")),
    ))
}

/// One node's GPU memory and what said it: its product in the policy's table at its usable
/// figure, else its `nvidia.com/gpu.memory` less the largest driver reservation. `None` when
/// neither says.
pub fn node_memory(node: &GpuNode, policy: &Policy) -> Option<(Bytes, String)> {
    let from_table = node
        .product
        .as_ref()
        .and_then(|p| product_memory(p, policy, &mut Vec::new()).map(|(b, _)| (b, p.clone())));
    from_table.or_else(|| {
        node.memory_mib.map(|mib| {
            (
                Bytes::mib(mib.saturating_sub(MAX_DRIVER_RESERVED_MIB)),
                format!("{NVIDIA_GPU_MEMORY_LABEL}={mib}"),
            )
        })
    })
}

/// The whole-device memory of a pod on `nodes` (the nodes it may use), as [`resolve`] finds it
/// for an unpinned pod: what placement plans a `required` choice for, so that the pod's
/// reinvocation, reading the affinity placement wrote, decides the same.
pub fn placed_memory(
    pod: &Pod,
    device: Device,
    acc: &Accelerators,
    nodes: &[GpuNode],
    policy: &Policy,
) -> (Bytes, BudgetSource) {
    device_memory(pod, device, acc, nodes, policy, &mut Vec::new())
}

/// A product label's memory: the table's entry (a `-SHARED` product is its GPU's), else for a
/// single-strategy MIG product its profile's size; `None` when unknown.
fn product_memory(
    product: &str,
    policy: &Policy,
    warnings: &mut Vec<String>,
) -> Option<(Bytes, BudgetSource)> {
    let product = product
        .strip_suffix(SHARED_PRODUCT_SUFFIX)
        .unwrap_or(product);
    let mig = product.split_once(MIG_PRODUCT_INFIX);
    if let Some(b) = policy.gpu_memory.get(product) {
        let source = match mig {
            Some(_) => BudgetSource::Mig(product.to_string()),
            None => BudgetSource::GpuProduct(product.to_string()),
        };
        return Some((*b, source));
    }
    let (base, profile) = mig?;
    MigProfile::parse(profile)?;
    Some(mig_memory(profile, &[base.to_string()], policy, warnings))
}

/// A MIG slice's memory: the `<product>-MIG-<profile>` entries of the products the pod may
/// land on (all of them known), else the smallest entry for the profile on any product, else
/// the nominal size of its name in GB (below every published slice size), with a warning.
fn mig_memory(
    profile: &str,
    products: &[String],
    policy: &Policy,
    warnings: &mut Vec<String>,
) -> (Bytes, BudgetSource) {
    let entry = |base: &str| {
        let key = format!("{base}{MIG_PRODUCT_INFIX}{profile}");
        policy.gpu_memory.get(&key).map(|b| (*b, key))
    };
    let pinned: Option<Vec<(Bytes, String)>> = products
        .iter()
        .map(|p| entry(p.strip_suffix(SHARED_PRODUCT_SUFFIX).unwrap_or(p)))
        .collect();
    if let Some((b, key)) = pinned.and_then(|all| all.into_iter().min()) {
        return (b, BudgetSource::Mig(key));
    }
    let suffix = format!("{MIG_PRODUCT_INFIX}{profile}");
    let any = policy
        .gpu_memory
        .iter()
        .filter(|(k, _)| k.ends_with(&suffix))
        .map(|(_, b)| *b)
        .min();
    if let Some(b) = any {
        return (
            b,
            BudgetSource::Mig(format!("{profile}: smallest in table")),
        );
    }
    let nominal = MigProfile::parse(profile).map_or(0, |p| u64::from(p.nominal_gb));
    warnings.push(truncate(&format!(
        "memguard: MIG profile {profile} not in the policy table; assuming its nominal {nominal} GB"
    )));
    (
        Bytes(nominal * 1_000_000_000),
        BudgetSource::Mig(format!("{profile}: nominal")),
    )
}
