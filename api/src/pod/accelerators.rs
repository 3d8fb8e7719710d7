//! What a pod asks of accelerators and where it may run: GPU counts and products, the
//! vendor and cloud tables that pin a GPU, MIG, HAMi, KAI, MPS and DRA claims, and the nodes
//! whose selector, affinity and taints let the pod in.

use super::*;
/// NVIDIA MIG, mixed strategy: one resource per profile, `nvidia.com/mig-<g>g.<m>gb`.
pub const NVIDIA_MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";
/// NVIDIA MIG, single strategy: `nvidia.com/gpu.product` of a MIG node ends `-MIG-<profile>`.
pub const MIG_PRODUCT_INFIX: &str = "-MIG-";
/// Time-sliced or MPS-shared GPUs under the device plugin's `renameByDefault`.
pub const NVIDIA_GPU_SHARED_RESOURCE: &str = "nvidia.com/gpu.shared";
/// The device plugin's suffix on `nvidia.com/gpu.product` of a shared (time-sliced) GPU.
pub const SHARED_PRODUCT_SUFFIX: &str = "-SHARED";
/// GPU feature discovery: `time-slicing`, `mps` or `none`.
pub const NVIDIA_SHARING_STRATEGY_LABEL: &str = "nvidia.com/gpu.sharing-strategy";
/// GPU feature discovery: a node's GPU memory in MiB (NVML's total).
pub const NVIDIA_GPU_MEMORY_LABEL: &str = "nvidia.com/gpu.memory";
/// HAMi: device memory per vGPU, in MiB.
pub const HAMI_GPUMEM_RESOURCE: &str = "nvidia.com/gpumem";
/// HAMi: device memory per vGPU, in percent of the card.
pub const HAMI_GPUMEM_PERCENTAGE_RESOURCE: &str = "nvidia.com/gpumem-percentage";
/// HAMi: compute per vGPU, in percent (not memory; known, so not "unknown").
pub const HAMI_GPUCORES_RESOURCE: &str = "nvidia.com/gpucores";
/// KAI Scheduler / Run:ai: pod annotation, the fraction of one GPU's memory (`"0.5"`).
pub const KAI_GPU_FRACTION_ANNOTATION: &str = "gpu-fraction";
/// KAI Scheduler / Run:ai: pod annotation, GPU memory in MiB (`"2000"`).
pub const KAI_GPU_MEMORY_ANNOTATION: &str = "gpu-memory";
/// NVIDIA MPS: the client's pinned device-memory limit, `<ordinal>=<size>[,…]` (`0=2G`).
pub const MPS_PINNED_MEM_ENV: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// AMD GPUs (ROCm device plugin).
pub const AMD_GPU_RESOURCE: &str = "amd.com/gpu";
/// AMD node labeller: the GPU product (`AMD_Instinct_MI300X_OAM`).
pub const AMD_GPU_PRODUCT_LABEL: &str = "amd.com/gpu.product-name";

/// A node's GPU, from its labels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuNode {
    /// The GPU product, as GPU Feature Discovery's `nvidia.com/gpu.product` names it: that
    /// label, else the product a cloud's label names ([`node_gpu_product`]).
    pub product: Option<String>,
    /// `nvidia.com/gpu.memory`, MiB (NVML's total).
    pub memory_mib: Option<u64>,
    /// The label and value that named `product` (`cloud.google.com/gke-accelerator`,
    /// `nvidia-l4`): what placement pins such a node by when it has no memory label.
    pub product_label: Option<(String, String)>,
}

/// The GPU nodes in `cluster` that `pod` may be scheduled on ([`pod_may_use`]); a node
/// without a GPU label is not one.
pub(crate) fn gpu_nodes(pod: &Pod, cluster: Cluster<'_>) -> Vec<GpuNode> {
    let Some(nodes) = cluster.nodes else {
        return Vec::new();
    };
    nodes
        .nodes()
        .into_iter()
        .filter(|node| pod_may_use(pod, node))
        .filter_map(|node| {
            let named = node_gpu_product(&node.labels);
            let gpu = GpuNode {
                product: named.as_ref().map(|(p, _)| p.clone()),
                memory_mib: node
                    .labels
                    .get(NVIDIA_GPU_MEMORY_LABEL)
                    .and_then(|m| m.trim().parse().ok()),
                product_label: named.map(|(_, l)| l),
            };
            (gpu.product.is_some() || gpu.memory_mib.is_some()).then_some(gpu)
        })
        .collect()
}

/// The GPU product a node's labels name, and the label that names it: GPU Feature Discovery's
/// `nvidia.com/gpu.product`, else a GPU instance type (AKS, AWS), else a cloud's accelerator
/// label ([`CLOUD_ACCELERATOR_LABELS`]; an unknown value kept as `label=value`, as on pods).
pub fn node_gpu_product(labels: &BTreeMap<String, String>) -> Option<(String, (String, String))> {
    let found = |label: &str, product: String| {
        let value = labels.get(label).cloned().unwrap_or_default();
        Some((product, (label.to_string(), value)))
    };
    if let Some(p) = labels.get(wellknown::NVIDIA_GPU_PRODUCT_LABEL) {
        return found(wellknown::NVIDIA_GPU_PRODUCT_LABEL, p.clone());
    }
    if let Some(p) = labels
        .get(INSTANCE_TYPE_LABEL)
        .and_then(|v| instance_type_gpu(v))
    {
        return found(INSTANCE_TYPE_LABEL, p.to_string());
    }
    for (label, table) in CLOUD_ACCELERATOR_LABELS {
        if let Some(v) = labels.get(*label) {
            let product = table
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(v.trim()))
                .map_or_else(|| format!("{label}={v}"), |(_, p)| (*p).to_string());
            return found(label, product);
        }
    }
    None
}

/// Whether the scheduler may put `pod` on `node`: its `nodeName`, `nodeSelector`, required
/// node affinity (terms ORed, expressions ANDed; `In`, `NotIn`, `Exists`, `DoesNotExist`, `Gt`,
/// `Lt`, and `matchFields` on `metadata.name`) and tolerations of the node's `NoSchedule` /
/// `NoExecute` taints. What is not known of the node (its name) does not exclude it.
pub fn pod_may_use(pod: &Pod, node: &crate::cluster::NodeInfo) -> bool {
    let Some(spec) = pod.spec.as_ref() else {
        return true;
    };
    let named = |name: &str| node.name.is_empty() || node.name == name;
    if let Some(name) = spec.node_name.as_deref().filter(|n| !n.is_empty())
        && !named(name)
    {
        return false;
    }
    let selected = spec
        .node_selector
        .iter()
        .flatten()
        .all(|(k, v)| node.labels.get(k) == Some(v));
    if !selected {
        return false;
    }
    let required = required_node_selector(spec);
    if let Some(required) = required {
        // An empty or absent term matches no node, as the scheduler reads it.
        let any = required.node_selector_terms.iter().any(|term| {
            let exprs = term.match_expressions.as_deref().unwrap_or_default();
            let fields = term.match_fields.as_deref().unwrap_or_default();
            (!exprs.is_empty() || !fields.is_empty())
                && exprs
                    .iter()
                    .all(|e| expression_matches(e, node.labels.get(&e.key)))
                && fields.iter().all(|f| {
                    f.key != "metadata.name"
                        || node.name.is_empty()
                        || expression_matches(f, Some(&node.name))
                })
        });
        if !any {
            return false;
        }
    }
    let tolerations = spec.tolerations.as_deref().unwrap_or_default();
    node.taints
        .iter()
        .filter(|t| crate::cluster::blocks(&t.effect))
        .all(|taint| tolerations.iter().any(|t| tolerates(t, taint)))
}

/// One node-selector requirement against the label's value (`None`: the node lacks it).
pub(crate) fn expression_matches(
    e: &k8s_openapi::api::core::v1::NodeSelectorRequirement,
    value: Option<&String>,
) -> bool {
    let values = e.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.trim().parse::<i64>().ok();
    let compare = |ordering: std::cmp::Ordering| match (value, values) {
        (Some(v), [bound]) => match (number(v), number(bound)) {
            (Some(v), Some(b)) => v.cmp(&b) == ordering,
            _ => false,
        },
        _ => false,
    };
    match e.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => compare(std::cmp::Ordering::Greater),
        "Lt" => compare(std::cmp::Ordering::Less),
        // The API server refuses any other operator: nothing matches it.
        _ => false,
    }
}

/// Whether `toleration` tolerates `taint`, as the scheduler decides it: the effect (empty: any),
/// and `Exists` on the key (an empty key: every taint) or `Equal` on key and value.
pub(crate) fn tolerates(
    toleration: &k8s_openapi::api::core::v1::Toleration,
    taint: &crate::cluster::NodeTaint,
) -> bool {
    let effect = toleration.effect.as_deref().unwrap_or_default();
    if !effect.is_empty() && effect != taint.effect {
        return false;
    }
    let key = toleration.key.as_deref().unwrap_or_default();
    match toleration.operator.as_deref().unwrap_or("Equal") {
        "Exists" => key.is_empty() || key == taint.key,
        "Equal" | "" => {
            key == taint.key && toleration.value.as_deref().unwrap_or_default() == taint.value
        }
        _ => false,
    }
}

/// Accelerator devices the container asks for: whole or shared NVIDIA GPUs, MIG slices, AMD
/// GPUs (`limits`, else `requests`). Extended resources memguard does not know count 0.
pub fn gpu_count(c: &Container) -> u64 {
    resources(c)
        .filter(|(name, _)| device_kind(name).is_some())
        .filter_map(|(_, q)| parse_quantity(&q.0))
        .sum()
}

/// The device the trainer runs on when the `device` annotation does not say: `rocm` for AMD
/// GPUs, `cuda` for any NVIDIA GPU (whole, shared or a MIG slice, or a KAI / Run:ai GPU share,
/// which the pod asks for by annotation and not as a resource), else `cpu`. The webhook and
/// the profile controller both resolve the device with this.
pub fn default_device(pod: &Pod, c: &Container) -> Device {
    Accelerators::of(pod, c).default_device(pod)
}

/// The container's resources, `limits` first: a name given in both counts once, as its limit
/// (for extended resources Kubernetes requires the two to be equal anyway).
pub(crate) fn resources(c: &Container) -> impl Iterator<Item = (&str, &Quantity)> {
    let r = c.resources.as_ref();
    let limits = r.and_then(|r| r.limits.as_ref());
    let requests = r.and_then(|r| r.requests.as_ref());
    let limits_iter = limits.into_iter().flatten();
    let requests_iter = requests
        .into_iter()
        .flatten()
        .filter(move |(k, _)| !limits.is_some_and(|l| l.contains_key(*k)));
    limits_iter
        .chain(requests_iter)
        .map(|(k, q)| (k.as_str(), q))
}

/// What kind of accelerator device a resource name is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AcceleratorKind {
    /// `nvidia.com/gpu` (a whole GPU, a MIG slice under the single strategy, or a time-slice).
    NvidiaGpu,
    /// `nvidia.com/gpu.shared`: a time-sliced or MPS-shared GPU under `renameByDefault`.
    NvidiaShared,
    /// `nvidia.com/mig-<profile>`, with the profile (`1g.10gb`).
    Mig(String),
    /// `amd.com/gpu`.
    AmdGpu,
}

pub(crate) fn device_kind(resource: &str) -> Option<AcceleratorKind> {
    match resource {
        wellknown::NVIDIA_GPU_RESOURCE => Some(AcceleratorKind::NvidiaGpu),
        NVIDIA_GPU_SHARED_RESOURCE => Some(AcceleratorKind::NvidiaShared),
        AMD_GPU_RESOURCE => Some(AcceleratorKind::AmdGpu),
        _ => resource
            .strip_prefix(NVIDIA_MIG_RESOURCE_PREFIX)
            .filter(|p| MigProfile::parse(p).is_some())
            .map(|p| AcceleratorKind::Mig(p.to_string())),
    }
}

/// A MIG profile name, `<g>g.<m>gb` with an optional `+me` or other suffix after the size
/// (`1g.10gb`, `1g.10gb+me`, `2c.7g.40gb` is not a GPU-instance profile and is refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigProfile {
    /// Compute slices (`g`).
    pub slices: u32,
    /// The nominal memory in the name, in GB (`m`): a label, not the usable size.
    pub nominal_gb: u32,
}

impl MigProfile {
    /// Parses `1g.10gb` (or `1g.10gb+me`); `None` for anything else.
    pub fn parse(s: &str) -> Option<MigProfile> {
        let (g, rest) = s.split_once("g.")?;
        let size = rest.split('+').next()?;
        let m = size.strip_suffix("gb")?;
        let all_digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        if !all_digits(g) || !all_digits(m) {
            return None;
        }
        Some(MigProfile {
            slices: g.parse().ok()?,
            nominal_gb: m.parse().ok()?,
        })
    }
}

/// Extended resources that are accelerator settings rather than devices: not "unknown".
pub(crate) const KNOWN_SETTINGS: [&str; 3] = [
    HAMI_GPUMEM_RESOURCE,
    HAMI_GPUMEM_PERCENTAGE_RESOURCE,
    HAMI_GPUCORES_RESOURCE,
];

/// What the trainer asks for in accelerators and their memory, read from the pod alone.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Accelerators {
    /// The device kinds requested with a count above 0 (usually one).
    pub kinds: Vec<AcceleratorKind>,
    /// HAMi's `nvidia.com/gpumem`, in MiB per device.
    pub hami_mib: Option<u64>,
    /// HAMi's `nvidia.com/gpumem-percentage`, in percent of one device.
    pub hami_percent: Option<u64>,
    /// KAI / Run:ai `gpu-memory` annotation, in MiB.
    pub kai_mib: Option<u64>,
    /// KAI / Run:ai `gpu-fraction` annotation, in (0, 1].
    pub kai_fraction: Option<f64>,
    /// MPS: the smallest per-device limit in the trainer's `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`.
    pub mps_bytes: Option<u64>,
    /// The GPU is time-sliced: `nvidia.com/gpu.shared`, a `-SHARED` product, or the
    /// `time-slicing` sharing-strategy label in the node selector.
    pub time_sliced: bool,
    /// Extended resources that are no accelerator memguard knows (`example.com/npu`).
    pub unknown: Vec<String>,
    /// `spec.resourceClaims` the trainer uses (DRA): `<claim name> (<template or claim>)`.
    pub dra_claims: Vec<String>,
    /// Values that are there but unreadable, each naming its key: a warning, and ignored.
    pub problems: Vec<String>,
}

impl Accelerators {
    /// The device these accelerators make ([`default_device`]): `cuda` for a KAI / Run:ai GPU
    /// share (asked for by `pod`'s annotations) or any NVIDIA GPU, `rocm` for AMD GPUs only,
    /// else `cpu`.
    pub fn default_device(&self, pod: &Pod) -> Device {
        let annotations = pod.metadata.annotations.as_ref();
        let kai_share = [KAI_GPU_FRACTION_ANNOTATION, KAI_GPU_MEMORY_ANNOTATION]
            .iter()
            .any(|k| annotations.is_some_and(|a| a.contains_key(*k)));
        if kai_share || self.kinds.iter().any(|k| *k != AcceleratorKind::AmdGpu) {
            Device::Cuda
        } else if self.kinds.is_empty() {
            Device::Cpu
        } else {
            Device::Rocm
        }
    }

    /// Reads the trainer's resources and env, and the pod's annotations, claims and placement.
    pub fn of(pod: &Pod, trainer: &Container) -> Accelerators {
        let mut a = Accelerators::default();
        for (name, q) in resources(trainer) {
            let count = parse_quantity(&q.0);
            let some = count.is_some_and(|n| n > 0);
            match (device_kind(name), name) {
                (Some(kind), _) if some && !a.kinds.contains(&kind) => a.kinds.push(kind),
                (Some(_), _) => {}
                (None, HAMI_GPUMEM_RESOURCE) => match count {
                    Some(n) if n > 0 => a.hami_mib = Some(n),
                    _ => a
                        .problems
                        .push(format!("{name}: `{}` is not a size in MiB", q.0)),
                },
                (None, HAMI_GPUMEM_PERCENTAGE_RESOURCE) => match count {
                    Some(n) if (1..=100).contains(&n) => a.hami_percent = Some(n),
                    _ => a
                        .problems
                        .push(format!("{name}: `{}` is not in 1..=100", q.0)),
                },
                (None, other)
                    if some
                        && is_extended(other)
                        && !KNOWN_SETTINGS.contains(&other)
                        && !is_not_accelerator(other) =>
                {
                    a.unknown.push(other.to_string());
                }
                _ => {}
            }
        }
        if a.kinds.contains(&AcceleratorKind::NvidiaShared) {
            a.time_sliced = true;
        }
        let annotations = pod.metadata.annotations.as_ref();
        let annotation = |key: &str| annotations.and_then(|m| m.get(key)).map(|v| v.trim());
        if let Some(v) = annotation(KAI_GPU_MEMORY_ANNOTATION) {
            match v.parse::<u64>() {
                Ok(n) if n > 0 => a.kai_mib = Some(n),
                _ => a.problems.push(format!(
                    "{KAI_GPU_MEMORY_ANNOTATION}: `{v}` is not a whole number of MiB"
                )),
            }
        }
        if let Some(v) = annotation(KAI_GPU_FRACTION_ANNOTATION) {
            match v.parse::<f64>() {
                Ok(f) if f > 0.0 && f <= 1.0 => a.kai_fraction = Some(f),
                _ => a.problems.push(format!(
                    "{KAI_GPU_FRACTION_ANNOTATION}: `{v}` is not a fraction in (0, 1]"
                )),
            }
        }
        let mps = trainer
            .env
            .iter()
            .flatten()
            .find(|e| e.name == MPS_PINNED_MEM_ENV);
        if let Some(e) = mps {
            match e.value.as_deref().map(parse_mps_limit) {
                Some(Ok(bytes)) => a.mps_bytes = Some(bytes),
                Some(Err(why)) => a.problems.push(format!("{MPS_PINNED_MEM_ENV}: {why}")),
                None => a.problems.push(format!(
                    "{MPS_PINNED_MEM_ENV}: set from a reference, not a literal; not read"
                )),
            }
        }
        let spec = pod.spec.as_ref();
        let selector = spec.and_then(|s| s.node_selector.as_ref());
        let shared_strategy = selector
            .and_then(|s| s.get(NVIDIA_SHARING_STRATEGY_LABEL))
            .is_some_and(|v| v == "time-slicing");
        let shared_product = gpu_products(pod)
            .iter()
            .any(|p| p.ends_with(SHARED_PRODUCT_SUFFIX));
        a.time_sliced |= shared_strategy || shared_product;

        for claim in trainer_claims(pod, trainer) {
            let source = match (
                &claim.resource_claim_template_name,
                &claim.resource_claim_name,
            ) {
                (Some(t), _) => format!("template {t}"),
                (None, Some(c)) => format!("claim {c}"),
                (None, None) => "no source".to_string(),
            };
            a.dra_claims.push(format!("{} ({source})", claim.name));
        }
        a
    }
}

/// The pod's DRA claims the trainer uses: those it names in `resources.claims`, all of them when
/// it names none (a claim is for some container, and the trainer is the one that counts).
pub fn trainer_claims<'a>(
    pod: &'a Pod,
    trainer: &'a Container,
) -> impl Iterator<Item = &'a PodResourceClaim> {
    let used: Vec<&str> = trainer
        .resources
        .as_ref()
        .and_then(|r| r.claims.as_ref())
        .map(|c| c.iter().map(|c| c.name.as_str()).collect())
        .unwrap_or_default();
    pod.spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_ref())
        .into_iter()
        .flatten()
        .filter(move |c| used.is_empty() || used.contains(&c.name.as_str()))
}

/// Extended resources that are devices but no accelerator with memory (network adapters,
/// FUSE): asking for one says nothing about the trainer's memory. By prefix.
pub const NOT_ACCELERATOR_PREFIXES: &[&str] = &[
    // AWS: Elastic Fabric Adapter, branch ENIs, IP addresses.
    "vpc.amazonaws.com/",
    // RDMA shared device plugin, Mellanox/NVIDIA network operators, SR-IOV (OpenShift, Intel).
    "rdma/",
    "mellanox.com/",
    "nvidia.com/rdma",
    "nvidia.com/hostdev",
    "openshift.io/",
    "intel.com/sriov",
    "networking.gke.io/",
    // FUSE device plugins.
    "smarter-devices/",
    "github.com/fuse",
    "squat.ai/",
];

/// Whether an extended resource is a known non-accelerator ([`NOT_ACCELERATOR_PREFIXES`]).
pub(crate) fn is_not_accelerator(name: &str) -> bool {
    NOT_ACCELERATOR_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// An extended resource: a domain-prefixed name outside `kubernetes.io` (`example.com/npu`);
/// not `cpu`, `memory`, `ephemeral-storage` or `hugepages-*`.
pub(crate) fn is_extended(name: &str) -> bool {
    name.contains('/') && !name.contains("kubernetes.io/")
}

/// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`: `<ordinal>=<n><unit>` entries, comma-separated, units
/// `K`, `M`, `G`, `T` (binary, as the MPS control daemon reads them); a bare number is bytes.
/// Returns the smallest limit: the pod's per-device budget.
pub fn parse_mps_limit(value: &str) -> Result<u64, String> {
    let mut smallest: Option<u64> = None;
    for entry in value.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (ordinal, size) = entry
            .split_once('=')
            .ok_or_else(|| format!("`{entry}` is not <device>=<size>"))?;
        if ordinal.trim().is_empty() {
            return Err(format!("`{entry}` names no device"));
        }
        let size = size.trim();
        let digits = size.trim_end_matches(|c: char| c.is_ascii_alphabetic());
        let unit = &size[digits.len()..];
        let shift = match unit.to_ascii_uppercase().as_str() {
            "" | "B" => 0,
            "K" | "KB" => 10,
            "M" | "MB" => 20,
            "G" | "GB" => 30,
            "T" | "TB" => 40,
            _ => return Err(format!("`{size}`: unknown unit `{unit}`")),
        };
        let n: u64 = digits
            .parse()
            .map_err(|_| format!("`{size}` is not a whole number with a unit"))?;
        let bytes = n
            .checked_shl(shift)
            .filter(|b| *b >> shift == n && *b > 0)
            .ok_or_else(|| format!("`{size}` is out of range"))?;
        smallest = Some(smallest.map_or(bytes, |s| s.min(bytes)));
    }
    smallest.ok_or_else(|| "empty".to_string())
}

/// The `nvidia.com/gpu.product` values the pod is pinned to: the node selector's, else the
/// union of the required node-affinity terms' `In` values when every term constrains it (terms
/// are ORed: one unconstrained term means any product). Empty when unknown.
///
/// A pod pinned by a cloud's own accelerator label instead ([`CLOUD_ACCELERATOR_LABELS`]: GKE's
/// `cloud.google.com/gke-accelerator`, EKS's `k8s.amazonaws.com/accelerator`, Karpenter's and
/// EKS Auto Mode's `instance-gpu-name`; AKS's GPU VM sizes and AWS's GPU instance families by
/// `node.kubernetes.io/instance-type`, [`instance_type_gpu`])
/// is pinned as surely: each value is read as the
/// `nvidia.com/gpu.product` GPU feature discovery writes on such a node (the smallest where the
/// cloud's name covers several, as AWS's `a100` covers 40 and 80 GB), or kept as
/// `label=value` when unknown (then "not in the policy table", named).
pub fn gpu_products(pod: &Pod) -> Vec<String> {
    let nvidia = pinned_values(pod, wellknown::NVIDIA_GPU_PRODUCT_LABEL);
    if !nvidia.is_empty() {
        return nvidia;
    }
    // AKS (and EKS without GPU labels) name no GPU product in a label: the instance type does.
    // An instance type not in the tables (a CPU size) pins nothing here.
    let sizes: Vec<String> = pinned_values(pod, INSTANCE_TYPE_LABEL)
        .iter()
        .filter_map(|v| instance_type_gpu(v).map(str::to_string))
        .collect();
    if !sizes.is_empty() {
        return sizes;
    }
    for (label, table) in CLOUD_ACCELERATOR_LABELS {
        let values = pinned_values(pod, label);
        if !values.is_empty() {
            return values
                .iter()
                .map(|v| {
                    table
                        .iter()
                        .find(|(name, _)| name.eq_ignore_ascii_case(v.trim()))
                        .map_or_else(|| format!("{label}={v}"), |(_, p)| (*p).to_string())
                })
                .collect();
        }
    }
    Vec::new()
}

/// GKE's and EKS's accelerator values, as GKE documents them (`nvidia-tesla-a100`, …) and EKS
/// node groups label them; each read as the GPU feature discovery product of that GPU.
pub(crate) const CLOUD_ACCELERATOR_NAMES: &[(&str, &str)] = &[
    ("nvidia-tesla-t4", "Tesla-T4"),
    ("nvidia-tesla-v100", "Tesla-V100-SXM2-16GB"),
    ("nvidia-tesla-a100", "NVIDIA-A100-SXM4-40GB"),
    ("nvidia-a100-80gb", "NVIDIA-A100-SXM4-80GB"),
    ("nvidia-a10g", "NVIDIA-A10G"),
    ("nvidia-l4", "NVIDIA-L4"),
    ("nvidia-l40s", "NVIDIA-L40S"),
    ("nvidia-h100-80gb", "NVIDIA-H100-80GB-HBM3"),
    ("nvidia-h100-mega-80gb", "NVIDIA-H100-80GB-HBM3"),
    ("nvidia-h200-141gb", "NVIDIA-H200"),
    ("nvidia-b200", "NVIDIA-B200"),
];

/// Karpenter's and EKS Auto Mode's `instance-gpu-name` values (lower-case GPU names); where
/// AWS offers one name in two sizes (A100 40/80 GB, V100 16/32 GB), the smaller.
pub(crate) const AWS_GPU_NAMES: &[(&str, &str)] = &[
    ("t4", "Tesla-T4"),
    ("t4g", "Tesla-T4"),
    ("v100", "Tesla-V100-SXM2-16GB"),
    ("a100", "NVIDIA-A100-SXM4-40GB"),
    ("a10g", "NVIDIA-A10G"),
    ("l4", "NVIDIA-L4"),
    ("l40s", "NVIDIA-L40S"),
    ("h100", "NVIDIA-H100-80GB-HBM3"),
    ("h200", "NVIDIA-H200"),
    ("b200", "NVIDIA-B200"),
];

/// The well-known node label of a node's VM size.
pub const INSTANCE_TYPE_LABEL: &str = "node.kubernetes.io/instance-type";

/// AKS GPU VM sizes and the GPU each carries, as GPU feature discovery names it (Microsoft's VM
/// size pages: NCasT4_v3, NCv3, NDv2, NC A100 v4, ND A100 v4, ND A100 v4 80GB, NC H100 v5,
/// ND H100 v5, ND H200 v5). AKS labels GPU nodes `kubernetes.azure.com/accelerator: nvidia`
/// only: a pod pinned to one of these sizes by `node.kubernetes.io/instance-type` is pinned to
/// its GPU. Partial-GPU sizes (NVads A10 v5) are left out: their share is not a whole card.
/// NCv3's V100 is the PCIe card, counted as the table's 16 GB V100 (the same memory).
pub(crate) const AZURE_GPU_VM_SIZES: &[(&str, &str)] = &[
    ("Standard_NC4as_T4_v3", "Tesla-T4"),
    ("Standard_NC8as_T4_v3", "Tesla-T4"),
    ("Standard_NC16as_T4_v3", "Tesla-T4"),
    ("Standard_NC64as_T4_v3", "Tesla-T4"),
    ("Standard_NC6s_v3", "Tesla-V100-SXM2-16GB"),
    ("Standard_NC12s_v3", "Tesla-V100-SXM2-16GB"),
    ("Standard_NC24s_v3", "Tesla-V100-SXM2-16GB"),
    ("Standard_NC24rs_v3", "Tesla-V100-SXM2-16GB"),
    ("Standard_ND40rs_v2", "Tesla-V100-SXM2-32GB"),
    ("Standard_NC24ads_A100_v4", "NVIDIA-A100-80GB-PCIe"),
    ("Standard_NC48ads_A100_v4", "NVIDIA-A100-80GB-PCIe"),
    ("Standard_NC96ads_A100_v4", "NVIDIA-A100-80GB-PCIe"),
    ("Standard_ND96asr_v4", "NVIDIA-A100-SXM4-40GB"),
    ("Standard_ND96amsr_A100_v4", "NVIDIA-A100-SXM4-80GB"),
    ("Standard_NC40ads_H100_v5", "NVIDIA-H100-NVL"),
    ("Standard_NC80adis_H100_v5", "NVIDIA-H100-NVL"),
    ("Standard_ND96isr_H100_v5", "NVIDIA-H100-80GB-HBM3"),
    ("Standard_ND96isr_H200_v5", "NVIDIA-H200"),
];

/// AWS GPU instance families and the GPU each carries (AWS's accelerated-computing instance
/// pages), matched on the instance type's prefix up to its dot: `g5.12xlarge` is an A10G
/// (`g5g.*`, Graviton with T4G, is another family). EKS labels no GPU product by default: a pod
/// pinned to one of these types by `node.kubernetes.io/instance-type` is pinned to its GPU.
pub(crate) const AWS_GPU_INSTANCE_FAMILIES: &[(&str, &str)] = &[
    ("g5.", "NVIDIA-A10G"),
    ("g6.", "NVIDIA-L4"),
    ("g6e.", "NVIDIA-L40S"),
    ("p4d.", "NVIDIA-A100-SXM4-40GB"),
    ("p4de.", "NVIDIA-A100-SXM4-80GB"),
    ("p5.", "NVIDIA-H100-80GB-HBM3"),
    ("p5e.", "NVIDIA-H200"),
    ("p5en.", "NVIDIA-H200"),
];

/// The GPU product of a GPU instance type (`node.kubernetes.io/instance-type`): an AKS VM size
/// ([`AZURE_GPU_VM_SIZES`]) or an AWS instance family ([`AWS_GPU_INSTANCE_FAMILIES`]); `None`
/// for any other (a CPU size, another cloud's).
pub fn instance_type_gpu(value: &str) -> Option<&'static str> {
    let v = value.trim();
    let azure = AZURE_GPU_VM_SIZES
        .iter()
        .find(|(size, _)| size.eq_ignore_ascii_case(v));
    let lower = v.to_ascii_lowercase();
    let aws = AWS_GPU_INSTANCE_FAMILIES
        .iter()
        .find(|(family, _)| lower.starts_with(family));
    azure.or(aws).map(|(_, p)| *p)
}

/// Node labels by which a cloud names a node's GPU, read after `nvidia.com/gpu.product` and an
/// AKS VM size ([`AZURE_GPU_VM_SIZES`]), each with its values.
pub const CLOUD_ACCELERATOR_LABELS: &[(&str, &[(&str, &str)])] = &[
    ("cloud.google.com/gke-accelerator", CLOUD_ACCELERATOR_NAMES),
    ("k8s.amazonaws.com/accelerator", CLOUD_ACCELERATOR_NAMES),
    ("karpenter.k8s.aws/instance-gpu-name", AWS_GPU_NAMES),
    ("eks.amazonaws.com/instance-gpu-name", AWS_GPU_NAMES),
];

/// The GPU memory (MiB, GPU feature discovery's `nvidia.com/gpu.memory`) every node the pod may
/// be scheduled on has at least: each required node-affinity term holds a `Gt` expression on the
/// label (memguard's placement writes one), and the smallest bound applies. `None` otherwise.
pub fn gpu_memory_floor_mib(pod: &Pod) -> Option<u64> {
    let terms = pod
        .spec
        .as_ref()?
        .affinity
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required_during_scheduling_ignored_during_execution
        .as_ref()?
        .node_selector_terms
        .as_slice();
    let floors: Option<Vec<u64>> = terms
        .iter()
        .map(|term| {
            term.match_expressions
                .iter()
                .flatten()
                .filter(|e| e.key == NVIDIA_GPU_MEMORY_LABEL && e.operator == "Gt")
                .filter_map(|e| match e.values.as_deref() {
                    Some([v]) => v.trim().parse::<u64>().ok()?.checked_add(1),
                    _ => None,
                })
                .max()
        })
        .collect();
    floors?.into_iter().min()
}

/// Whether the pod's node affinity (required or preferred) says anything about
/// `nvidia.com/gpu.memory`: then the user (or memguard, earlier) has placed it.
pub fn constrains_gpu_memory(pod: &Pod) -> bool {
    let Some(na) = pod
        .spec
        .as_ref()
        .and_then(|s| s.affinity.as_ref())
        .and_then(|a| a.node_affinity.as_ref())
    else {
        return false;
    };
    let required = na
        .required_during_scheduling_ignored_during_execution
        .iter()
        .flat_map(|r| &r.node_selector_terms);
    let preferred = na
        .preferred_during_scheduling_ignored_during_execution
        .iter()
        .flatten()
        .map(|p| &p.preference);
    required.chain(preferred).any(|term| {
        term.match_expressions
            .iter()
            .flatten()
            .any(|e| e.key == NVIDIA_GPU_MEMORY_LABEL)
    })
}

/// The pod's required node affinity (`requiredDuringSchedulingIgnoredDuringExecution`).
fn required_node_selector(
    spec: &k8s_openapi::api::core::v1::PodSpec,
) -> Option<&k8s_openapi::api::core::v1::NodeSelector> {
    spec.affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
}

/// The values of node label `label` the pod is pinned to, read as [`gpu_products`] reads
/// `nvidia.com/gpu.product` (AMD: [`AMD_GPU_PRODUCT_LABEL`]).
pub fn pinned_values(pod: &Pod, label: &str) -> Vec<String> {
    let Some(spec) = pod.spec.as_ref() else {
        return Vec::new();
    };
    if let Some(p) = spec.node_selector.as_ref().and_then(|s| s.get(label)) {
        return vec![p.clone()];
    }
    let terms = required_node_selector(spec)
        .map(|r| r.node_selector_terms.as_slice())
        .unwrap_or_default();
    let mut products = Vec::new();
    for term in terms {
        let values: Vec<&String> = term
            .match_expressions
            .iter()
            .flatten()
            .filter(|e| e.key == label && e.operator == "In")
            .flat_map(|e| e.values.iter().flatten())
            .collect();
        if values.is_empty() {
            return Vec::new();
        }
        products.extend(values.into_iter().cloned());
    }
    products.sort();
    products.dedup();
    products
}
