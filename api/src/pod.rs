//! Reading a pod spec the way every part of memguard must agree on: [`TrainingPod::resolve`]
//! (the annotations, which container is the trainer, how many GPUs it asks for, which GPU
//! products the pod is pinned to, the device and its DRA claims, the accelerators, the memory
//! limit, the trainer's env), the opt-in check and Kubernetes resource quantities. The webhook
//! (at admission), `memguard estimate` and `memguard explain`, and the profile controller (after
//! the run) all decide from these answers, read once, so they live here once.

use crate::Policy;
use crate::annotations::{self, AnnotationError, Knob, TrainingAnnotations};
use crate::cluster::Cluster;
use crate::dra::{DraMemory, DraReading};
use crate::wellknown;
use k8s_openapi::api::core::v1::{Container, Pod, PodResourceClaim};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use memguard_estimator::{Bytes, Device, Parallelism, TrainingConfig};
use std::collections::{BTreeMap, BTreeSet};

/// Kubernetes quantities are read where every size is ([`crate::quantity`]).
pub use crate::quantity::parse_quantity;

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

/// Why a pod is not a training pod memguard can read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// Opted in, but no `memguard.io/` training annotation at all, and the trainer's launch
    /// names no model memguard can read (why, when it says).
    #[error("{}", no_input(.0.as_deref()))]
    NoTrainingInput(Option<String>),
    /// The trainer's launch names a model that neither the catalog nor the policy knows.
    #[error("{0}")]
    LaunchModel(String),
    /// The training annotations do not parse: every problem.
    #[error("{}", join(.0))]
    Annotations(Vec<AnnotationError>),
    /// `memguard.io/container` names no container, or the pod has none.
    #[error("{0}")]
    Trainer(String),
}

/// [`ResolveError::NoTrainingInput`]'s message: what was seen and not read leads (a warning
/// is cut at 120 characters), then the opt-in without annotations.
fn no_input(why: Option<&str>) -> String {
    let opted_in = format!(
        "labelled {}={} but no training annotations (e.g. {})",
        wellknown::ENABLED_LABEL,
        wellknown::ENABLED_VALUE,
        annotations::MODEL
    );
    match why {
        Some(why) => format!("{why} ({opted_in})"),
        None => opted_in,
    }
}

fn join(errors: &[AnnotationError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// A training pod as every part of memguard reads it from its spec alone (never from where it
/// ran): the webhook at admission, the profile controller after the run. One reading, so the
/// two always agree on the trainer, the config and the device.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainingPod<'a> {
    /// The parsed annotations, as given.
    pub annotations: TrainingAnnotations,
    /// Index of the trainer in `spec.containers`.
    pub trainer_index: usize,
    /// The trainer container.
    pub trainer: &'a Container,
    /// GPUs the trainer asks for.
    pub gpus: u64,
    /// The GPU products the pod is pinned to, for its device: `nvidia.com/gpu.product` values
    /// for `cuda` ([`gpu_products`]), [`AMD_GPU_PRODUCT_LABEL`] values for `rocm`, else none.
    pub gpu_products: Vec<String>,
    /// The training config with the device resolved (`memguard.io/device`, else
    /// [`default_device`]) and, for data parallelism on GPUs without `memguard.io/world-size`,
    /// the world size set to the pod's GPUs; a `cpu` device not given becomes the device of
    /// the trainer's DRA claims ([`DraReading::on`]).
    pub config: TrainingConfig,
    /// The pod.
    pub pod: &'a Pod,
    /// What the trainer asks of accelerators ([`Accelerators::of`], read once).
    pub accelerators: Accelerators,
    /// The trainer's DRA claims as the catalog sizes them, with the warnings on the way.
    pub dra: DraReading,
    /// The DRA memory that counts for [`config`](Self::config)'s device.
    pub dra_memory: Option<DraMemory>,
    /// The trainer's memory limit ([`memory_limit`]).
    pub memory_limit: Option<Bytes>,
    /// The trainer's literal env ([`literal_env`]).
    pub trainer_env: BTreeMap<String, String>,
    /// Where each knob of [`config`](Self::config) came from, for the knobs read from the
    /// trainer's own config (`env:<NAME>`); empty when every knob came from annotations or
    /// defaults.
    pub sources: BTreeMap<Knob, String>,
    /// The knobs whose variable (env-map, else the policy's `envNames`) the trainer sets in a
    /// way memguard cannot read (`valueFrom`), with the variable, and no annotation says.
    pub unreadable: BTreeMap<Knob, String>,
    /// The knobs whose mapped variable the trainer sets itself (not a value memguard wrote):
    /// a downgrade must rewrite them all consistently.
    pub set_by_trainer: BTreeSet<Knob>,
    /// The trainer's command line, when it is a launch read with Hugging Face argument rules.
    pub args: Option<ArgsReading>,
    /// Why the trainer's command line could not be read (inline code, a shell expansion as the
    /// program, an unsplittable string): the pod is planned on its annotations.
    pub args_unreadable: Option<String>,
    /// What the launch gave besides the knobs (`model`, `method`), for the estimate's sources.
    pub read_from_args: BTreeSet<&'static str>,
    /// The launch's coupled settings (a DeepSpeed config that pins the micro-batch, FSDP's own
    /// activation checkpointing): what a change must respect.
    pub coupled: crate::coupled::Coupled,
    /// Where the job's setup was read from the launch: `parallelism` (`args`,
    /// `configmap:<name>/<key>`) and `world-size` (`args`, `env:PET_NNODES`); absent: the
    /// annotation, or the default (the pod's own GPUs).
    pub setup_sources: BTreeMap<&'static str, String>,
    /// Why the config file the trainer's launch names could not be read (baked into the image,
    /// not a ConfigMap, an unknown ConfigMap, not valid YAML): its knobs are planned without it.
    pub config_unreadable: Option<String>,
    /// The trainer's config file (axolotl, LLaMA-Factory, TRL or LitGPT `--config`), when its
    /// launch names one and memguard read it from a ConfigMap.
    pub config_file: Option<ConfigFileReading>,
    /// What the config file gave besides the knobs (`model`, `method`), with its source
    /// (`configmap:<name>/<key>`).
    pub read_from_file: BTreeMap<&'static str, String>,
    /// The GPU nodes the pod could land on (their labels match its `nodeSelector`), as GPU
    /// Feature Discovery labels them; empty when no node's labels are known.
    pub gpu_nodes: Vec<GpuNode>,
    /// The knobs a launch's own parser sets that nothing gives: no annotation, not read from
    /// the trainer's launch, not a default of a parser memguard knows for it (a bespoke
    /// script's absent flags), each with what to add ([`unknown_knobs`]). Never written;
    /// [`guessed`](Self::guessed) says which of them leave the plan a guess.
    pub unknown: BTreeMap<Knob, String>,
}

/// The knobs a launch's own parser may set without memguard seeing it. Of them, the batch and
/// the sequence decide the verdict ([`TrainingPod::guessed`]); an unknown accumulation pins
/// the batch (the product could not be kept); an unknown checkpointing is planned off, the
/// larger figure, and turning it on is safe whatever it was.
pub const PARSER_KNOBS: [Knob; 4] = [
    Knob::BatchSize,
    Knob::GradAccumulation,
    Knob::GradCheckpointing,
    Knob::SeqLength,
];

/// The [`PARSER_KNOBS`] that decide the verdict: while one is unknown, no verdict is claimed.
pub const VERDICT_KNOBS: [Knob; 2] = [Knob::BatchSize, Knob::SeqLength];

/// The [`PARSER_KNOBS`] of a launch read with HF rules that are neither given by an
/// annotation or a mapped variable, nor read, nor a known default of its parser: each with the
/// flag or annotation that would say it. Launches read otherwise (a flag map, `tune run`, a
/// config-file trainer) have every knob at a known default.
fn unknown_knobs(
    args: Option<&ArgsReading>,
    given: &BTreeSet<Knob>,
    sources: &BTreeMap<Knob, String>,
) -> BTreeMap<Knob, String> {
    let Some(args) = args.filter(|a| a.tune.is_none()) else {
        return BTreeMap::new();
    };
    // A flag map (the policy's, or ms-swift's) names the flag that says each knob.
    let mapped = |k: Knob| {
        args.flag_map
            .as_ref()
            .and_then(|m| m.iter().find(|(knob, _)| *knob == k))
            .map(|(_, f)| f.clone())
    };
    PARSER_KNOBS
        .into_iter()
        .filter(|k| {
            !given.contains(k) && !sources.contains_key(k) && !args.defaults.contains_key(k)
        })
        .map(|k| {
            let flag = HF_FLAGS
                .iter()
                .find(|(knob, _)| *knob == k)
                .map_or("", |(_, f)| *f);
            let add = match mapped(k) {
                Some(f) => f,
                None if args.flag_map.is_some() => "a flag for it to the policy's flag map".into(),
                None if k == Knob::SeqLength => {
                    "its sequence flag (--max_length, --model_max_length, …)".to_string()
                }
                None => format!("--{flag}"),
            };
            (k, format!("add {add} or annotate memguard.io/{}", k.name()))
        })
        .collect()
}

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
fn gpu_nodes(pod: &Pod, cluster: Cluster<'_>) -> Vec<GpuNode> {
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
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
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
fn expression_matches(
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
fn tolerates(
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

/// A trainer's config file read from the ConfigMap its launch names, with the overrides on its
/// command line.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigFileReading {
    /// The container's `command` followed by its `args`.
    pub items: Vec<String>,
    /// How many of `items` are `command`.
    pub command_len: usize,
    /// The launch in them.
    pub launch: crate::launch::Launch,
    /// The trainer, the file and the overrides as written (memguard's own included).
    pub config: crate::launch::config_file::ConfigLaunch,
    /// The file, parsed.
    pub doc: serde_json::Value,
    /// Where it came from, `configmap:<name>/<key>`.
    pub source: String,
    /// What the trainer reads: the file under the overrides the user wrote (an override
    /// memguard wrote at an earlier admission is read as the value it replaced).
    pub reading: crate::launch::config_file::Reading,
    /// The DeepSpeed config the file names (`deepspeed: ds.json`), with its path: parsed when it
    /// is in a ConfigMap too, else why not. A pinned micro-batch there conflicts with a rewrite.
    pub deepspeed: Option<(String, Result<serde_json::Value, String>)>,
}

/// What memguard wrote at an earlier admission (reinvocation, a pod recreated from its own
/// output), from its estimate annotation.
fn earlier_estimate(pod: &Pod) -> Option<crate::estimate::EstimateAnnotation> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(annotations::ESTIMATE))
        .and_then(|text| crate::estimate::EstimateAnnotation::parse(text).ok())
}

/// The trainer's own value of `knob`, given the value found now: a value equal to what memguard
/// wrote earlier is memguard's, and the value read then is the trainer's (`None`: memguard
/// added it, the trainer set nothing).
fn as_read<'a>(
    earlier: Option<&'a crate::estimate::EstimateAnnotation>,
    knob: Knob,
    found: &'a str,
) -> Option<&'a str> {
    match earlier.filter(|e| e.config.get(knob.name()).map(String::as_str) == Some(found)) {
        Some(e) => e.read.get(knob.name()).map(String::as_str),
        None => Some(found),
    }
}

/// A trainer's command line read with Hugging Face argument rules (HF Trainer, TRL scripts).
#[derive(Debug, Clone, PartialEq)]
pub struct ArgsReading {
    /// The container's `command` followed by its `args`.
    pub items: Vec<String>,
    /// How many of `items` are `command`.
    pub command_len: usize,
    /// The launch in them.
    pub launch: crate::launch::Launch,
    /// Its flags.
    pub flags: crate::launch::Flags,
    /// Whether its parser is known to be `HfArgumentParser` over `TrainingArguments` (a flag
    /// only that defines, or a TRL launch): then the flags it defines may be appended.
    pub hf_parser: bool,
    /// The knobs the launch leaves out that run at its parser's known default, with the
    /// citation (`default:trl`): a knob neither read nor here is unknown.
    pub defaults: BTreeMap<Knob, &'static str>,
    /// Flags that look like a sequence length and that memguard does not read as one.
    pub unread_sequence_flags: Vec<String>,
    /// The policy's flag map for the trainer's image (knob → flag as written), when one
    /// matches: the launch was read, and is rewritten, with [`crate::launch::MappedRules`].
    pub flag_map: Option<Vec<(Knob, String)>>,
    /// A `tune run` launch (its `flags` are then empty: torchtune takes `key=value` overrides).
    pub tune: Option<TuneReading>,
}

/// A `tune run` launch as read.
#[derive(Debug, Clone, PartialEq)]
pub struct TuneReading {
    /// The recipe, config and overrides.
    pub run: crate::launch::tune::TuneRun,
    /// The method its model component trains (`lora`, `qlora`, `full`), when known: LoRA
    /// overrides are written only to a LoRA model.
    pub method: Option<&'static str>,
}

/// The torchtune config key of each knob.
pub const TUNE_KEYS: &[(Knob, &str)] = &[
    (Knob::BatchSize, crate::launch::tune::BATCH_SIZE),
    (
        Knob::GradAccumulation,
        crate::launch::tune::GRAD_ACCUMULATION,
    ),
    (
        Knob::GradCheckpointing,
        crate::launch::tune::ACTIVATION_CHECKPOINTING,
    ),
    (Knob::SeqLength, crate::launch::tune::MAX_SEQ_LEN),
    (Knob::LoraRank, crate::launch::tune::LORA_RANK),
];

/// What a `tune run`'s config says: its knobs' values, its model component, and the source
/// to name (`config:<name>` for a built-in config, `configmap:<name>/<key>` for a file).
struct TuneConfig {
    values: Vec<(&'static str, String)>,
    component: Option<String>,
    source: String,
}

/// The config of `run`: a built-in one's defaults, or its file read from the ConfigMap the
/// trainer mounts it from. `Err`: the file cannot be read, and why.
fn tune_config(
    pod: &Pod,
    trainer: &Container,
    run: &crate::launch::tune::TuneRun,
    cluster: Cluster<'_>,
) -> Result<TuneConfig, String> {
    use crate::launch::tune::{self, ConfigRef};
    match &run.config {
        ConfigRef::Builtin(b) => Ok(TuneConfig {
            values: b.values.iter().map(|(k, v)| (*k, v.to_string())).collect(),
            component: Some(b.component.to_string()),
            source: format!("config:{}", b.name),
        }),
        ConfigRef::File(path) => {
            let file = crate::mounted::read(pod, trainer, path, cluster.config_maps)
                .map_err(|e| format!("tune run --config {path}: {e}"))?;
            let y = tune::yaml_values(&file.text)
                .map_err(|e| format!("tune run --config {path} ({}): {e}", file.source))?;
            Ok(TuneConfig {
                values: y.values,
                component: y.component,
                source: file.source,
            })
        }
    }
}

/// A trainer's `tune run`: its `command` + `args`, how many are `command`, the launch, the run.
type TuneLaunch = (
    Vec<String>,
    usize,
    crate::launch::Launch,
    crate::launch::tune::TuneRun,
);

/// The trainer's `tune run`, if it runs one. `Err`: a launch that cannot be read.
fn tune_launch(trainer: &Container) -> Result<Option<TuneLaunch>, String> {
    use crate::launch;
    let (items, command_len) = command_items(trainer);
    let found = match find_launch(trainer) {
        Ok(found) => found,
        Err(_) => return Ok(None),
    };
    match launch::tune::TuneRun::read(&found) {
        Ok(Some(run)) => Ok(Some((items, command_len, found, run))),
        Ok(None) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// The HF flag that carries each knob, in its canonical spelling.
pub const HF_FLAGS: &[(Knob, &str)] = &[
    (Knob::BatchSize, "per_device_train_batch_size"),
    (Knob::GradAccumulation, "gradient_accumulation_steps"),
    (Knob::GradCheckpointing, "gradient_checkpointing"),
    (Knob::SeqLength, "max_length"),
    (Knob::LoraRank, "lora_r"),
];

/// A trainer's launch read with Hugging Face argument rules.
struct HfLaunch {
    items: Vec<String>,
    command_len: usize,
    launch: crate::launch::Launch,
    flags: crate::launch::Flags,
}

/// The trainer's `command` followed by its `args` (what a launch is found in), and how many of
/// them are `command` (a rewrite splits them back there).
fn command_items(trainer: &Container) -> (Vec<String>, usize) {
    let command = trainer.command.clone().unwrap_or_default();
    let command_len = command.len();
    let items = command
        .into_iter()
        .chain(trainer.args.clone().unwrap_or_default())
        .collect();
    (items, command_len)
}

/// The trainer's launch ([`crate::launch::find_in_env`]): its `command` + `args`, with the
/// shell's and the kubelet's variables resolved from its literal env.
pub fn find_launch(
    trainer: &Container,
) -> Result<crate::launch::Launch, crate::launch::LaunchError> {
    let (items, _) = command_items(trainer);
    crate::launch::find_in_env(&items, &literal_env(trainer))
}

/// ms-swift's `swift sft|pt|rlhf`: `HfArgumentParser` over its own arguments (ms-swift 3.x,
/// `swift/llm/argument/train_args.py`), `--model`, `--train_type`, `--lora_rank`.
fn is_swift(launch: &crate::launch::Launch) -> bool {
    launch.program.name() == "swift"
        && launch
            .texts()
            .first()
            .is_some_and(|sub| matches!(*sub, "sft" | "pt" | "rlhf"))
}

/// ms-swift's flag for each knob, read and rewritten as a flag map with its own names.
fn swift_flags() -> crate::policy::FlagMap {
    crate::policy::FlagMap {
        image: String::new(),
        flags: [
            (Knob::BatchSize, "--per_device_train_batch_size"),
            (Knob::GradAccumulation, "--gradient_accumulation_steps"),
            (Knob::GradCheckpointing, "--gradient_checkpointing"),
            (Knob::SeqLength, "--max_length"),
            (Knob::LoraRank, "--lora_rank"),
        ]
        .into_iter()
        .map(|(k, f)| (k, f.to_string()))
        .collect(),
    }
}

/// The method of a `swift` launch: `--tuner_type` or `--train_type` (ms-swift's default `lora`; `full` is full
/// fine-tuning), QLoRA with `--quant_bits 4`, an 8-bit base with `--quant_bits 8`.
fn swift_method(
    flags: &crate::launch::Flags,
) -> (Option<memguard_estimator::Method>, Option<(u32, String)>) {
    use memguard_estimator::Method;
    // ms-swift 3.x renamed `--train_type` to `--tuner_type`, keeping the old name.
    let tuner = flags
        .value("tuner_type")
        .or_else(|| flags.value("train_type"));
    let adapters = tuner.unwrap_or("lora") != "full";
    match flags.value("quant_bits") {
        Some("4") if adapters => (Some(Method::Qlora), None),
        Some("8") if adapters => (Some(Method::Lora), Some((8, "args".to_string()))),
        _ => (adapters.then_some(Method::Lora), None),
    }
}

/// The trainer's `command` + `args` as a launch with HF rules (Python scripts and modules, and
/// `trl`). `Ok(None)`: no launch, or not one with HF rules; `Err`: a launch that cannot be read.
fn hf_launch(trainer: &Container) -> Result<Option<HfLaunch>, String> {
    use crate::launch::{self, Flags, HfRules, Program};
    let (items, command_len) = command_items(trainer);
    let found = match find_launch(trainer) {
        Ok(found) => found,
        Err(
            launch::LaunchError::Empty
            | launch::LaunchError::NoProgram
            | launch::LaunchError::NestedShell(_),
        ) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let hf = match &found.program {
        // axolotl's module takes fire keyword arguments, read by its config-file reader.
        Program::Module(m) => m != "axolotl.cli.train",
        Program::Script(_) => true,
        Program::Command(_) => found.program.name() == "trl" || is_swift(&found),
    };
    if !hf {
        return Ok(None);
    }
    let flags = Flags::parse(&found.texts(), &HfRules);
    Ok(Some(HfLaunch {
        items,
        command_len,
        launch: found,
        flags,
    }))
}

/// The flags that name the model in a launch with HF rules: HF scripts, then TRL's `trl sft`.
/// `--model_id` and `--model_name` last: ms-swift's `--model_name` names the model being
/// taught its own name, and `--model` comes first there.
const HF_MODEL_FLAGS: &[&str] = &["model_name_or_path", "model", "model_id", "model_name"];

/// What a launch says about the model: its HF id and whether it trains LoRA adapters.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LaunchModel {
    /// The flag as written and its value, for messages.
    flag: String,
    value: String,
    /// The HF id (`org/name`; a cache path `…/models--org--name/snapshots/…` read as one).
    id: String,
    /// The method it trains with: `--use_peft` or `--lora_r` (TRL) is LoRA; a config file
    /// says (`adapter`, `finetuning_type`, …); `None`: full.
    method: Option<memguard_estimator::Method>,
    /// Where the model was read: `None` the command line, else the config file's source.
    source: Option<String>,
    /// Where the method was read, likewise.
    method_source: Option<String>,
    /// The base model's storage bits the config file sets (8-bit LoRA), with its source.
    model_bits: Option<(u32, String)>,
    /// Other annotations the launch implies, with the name the estimate's sources give them
    /// and their source (`tune run`'s `*_distributed` recipes shard with FSDP over
    /// `nproc_per_node × nnodes`: `args`; its config's `dtype`: the config).
    implied: Vec<(&'static str, &'static str, String, String)>,
}

/// The model a launch names (`Ok(None)`: no HF launch, or no model flag, or a value that is
/// shell-expanded); `Err`: the launch cannot be read, and why.
fn launch_model(
    pod: &Pod,
    trainer: &Container,
    cluster: Cluster<'_>,
) -> Result<Option<LaunchModel>, String> {
    use crate::launch::HfRules;
    if let Some((_, _, _, run)) = tune_launch(trainer)? {
        let config = tune_config(pod, trainer, &run, cluster)?;
        let Some(component) = config.component else {
            return Ok(None);
        };
        let Some((id, method)) = crate::launch::tune::component_model(&component) else {
            return Err(format!(
                "tune run's model component {component} ({}) is not one memguard knows",
                config.source
            ));
        };
        let mut implied = Vec::new();
        // torchtune trains in its config's dtype throughout (no fp32 master weights): the
        // estimator's pure-bf16 (or fp32) regime, not mixed precision.
        let dtype = config
            .values
            .iter()
            .find(|(k, _)| *k == crate::launch::tune::DTYPE)
            .map(|(_, v)| v.as_str());
        let (dtype, dtype_source) = match run.value(crate::launch::tune::DTYPE, dtype) {
            Some((v, crate::launch::tune::Origin::Args)) => (v, "args".to_string()),
            Some((v, _)) => (v, config.source.clone()),
            // Every built-in config of the pinned commit sets `dtype: bf16`.
            None => ("bf16".to_string(), config.source.clone()),
        };
        let precision = match dtype.as_str() {
            "fp32" | "float32" => "fp32",
            "fp16" | "float16" => "fp16",
            _ => "bf16",
        };
        implied.push((
            annotations::PRECISION,
            "precision",
            precision.to_string(),
            dtype_source,
        ));
        if run.recipe.ends_with("_distributed") {
            // torchtune's distributed recipes shard parameters, gradients and optimizer state
            // with FSDP over every rank.
            let args = || "args".to_string();
            implied.push((
                annotations::PARALLELISM,
                "parallelism",
                "fsdp".to_string(),
                args(),
            ));
            let count = |v: &Option<String>| v.as_deref().and_then(|n| n.parse::<u64>().ok());
            if let (Some(nproc), Some(nnodes)) = (count(&run.nproc_per_node), count(&run.nnodes))
                && nnodes > 1
            {
                let world = (nproc * nnodes).to_string();
                implied.push((annotations::WORLD_SIZE, "world-size", world, args()));
            }
        }
        let method = match method {
            "qlora" => Some(memguard_estimator::Method::Qlora),
            "lora" => Some(memguard_estimator::Method::Lora),
            _ => None,
        };
        return Ok(Some(LaunchModel {
            flag: "--config".into(),
            value: component,
            id: id.to_string(),
            method,
            // The model component is the config's: a built-in one or a mounted file.
            source: Some(config.source.clone()),
            method_source: Some(config.source),
            model_bits: None,
            implied,
        }));
    }
    let Some(hf) = hf_launch(trainer)? else {
        return Ok(None);
    };
    let Some(flag) = HF_MODEL_FLAGS.iter().find_map(|k| hf.flags.get(k)) else {
        return Ok(None);
    };
    let value_at = match flag.value_at {
        crate::launch::flags::ValueAt::Next(i) => Some(i),
        _ => None,
    };
    // A value the shell expands (`$MODEL`) is not the model.
    let known = [Some(flag.at), value_at]
        .into_iter()
        .flatten()
        .all(|i| hf.launch.args.get(i).is_some_and(|a| !a.expands));
    let Some(value) = flag.value.clone().filter(|_| known) else {
        return Ok(None);
    };
    let on = |key| hf.flags.bool(key, &HfRules) == Some(true);
    // TRL's `--use_peft`, PEFT's examples' `--use_peft_lora`, the Qwen and FastChat scripts'
    // `--use_lora` / `--lora_enable`, or a rank given (`--lora_r`, `--lora_rank`).
    let lora = ["use_peft", "use_peft_lora", "use_lora", "lora_enable"]
        .iter()
        .any(|k| on(k))
        || ["lora_r", "lora_rank"]
            .iter()
            .any(|k| hf.flags.get(k).is_some());
    // TRL's `get_quantization_config`: 4 bits first, then 8 (`--use_bnb_nested_quant` only
    // refines the 4-bit one). TRL trains a quantized base only through adapters: a 4-bit base
    // is QLoRA, an 8-bit one LoRA on an 8-bit base.
    let (method, model_bits) = if is_swift(&hf.launch) {
        swift_method(&hf.flags)
    } else if on("load_in_4bit") || on("q_lora") {
        // `--q_lora` (FastChat, Qwen): LoRA on a 4-bit bitsandbytes base.
        (Some(memguard_estimator::Method::Qlora), None)
    } else if on("load_in_8bit") {
        (
            Some(memguard_estimator::Method::Lora),
            Some((8, "args".to_string())),
        )
    } else {
        (lora.then_some(memguard_estimator::Method::Lora), None)
    };
    let mut implied = Vec::new();
    let args = || "args".to_string();
    // `--use_bnb_nested_quant` with 4 bits: the quantization constants quantized again.
    if on("load_in_4bit") && on("use_bnb_nested_quant") {
        implied.push((
            annotations::DOUBLE_QUANT,
            "double-quant",
            "true".into(),
            args(),
        ));
    }
    // Liger's kernels (`TrainingArguments.use_liger_kernel`, ms-swift's and TRL's too) fuse the
    // LM head with the cross-entropy: the estimator's fused loss.
    if on("use_liger_kernel") || on("use_liger") {
        implied.push((annotations::LOSS, "loss", "fused".into(), args()));
    }
    let adapters = method.is_some_and(|m| m != memguard_estimator::Method::Full);
    if let Some(targets) = hf_lora_targets(&hf.flags).filter(|_| adapters) {
        implied.push((annotations::LORA_TARGETS, "lora-targets", targets, args()));
    }
    // Dropout on the adapters' input keeps a mask per adapted projection.
    if let Some(dropout) = hf.flags.value("lora_dropout").filter(|_| adapters)
        && let Ok(p) = dropout.trim().parse::<f64>()
    {
        let on = if p > 0.0 { "true" } else { "false" };
        implied.push((annotations::LORA_DROPOUT, "lora-dropout", on.into(), args()));
    }
    Ok(Some(LaunchModel {
        flag: format!("--{}", flag.spelled.trim_start_matches('-')),
        id: hf_model_id(&value),
        value,
        method,
        source: None,
        method_source: None,
        model_bits,
        implied,
    }))
}

/// The trainer of `pod` ([`pick_trainer`] over its containers and `memguard.io/container`),
/// with its index.
pub fn pod_trainer(pod: &Pod) -> Result<(usize, &Container), String> {
    let containers = pod
        .spec
        .as_ref()
        .map(|s| s.containers.as_slice())
        .unwrap_or_default();
    let named = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(annotations::CONTAINER))
        .map(|s| s.trim());
    pick_trainer(containers, named)
}

/// What memguard saw of a trainer whose launch names no model it reads: the program it
/// recognised (or why none), the part not read and why, and what to add. For the skip message
/// of a pod opted in with the label alone.
fn unread_launch(pod: &Pod) -> String {
    use crate::launch::{HfRules, LaunchError, Program};
    let Ok((_, trainer)) = pod_trainer(pod) else {
        return "no trainer container was found".into();
    };
    let add = format!("annotate {} (and the knobs it runs at)", annotations::MODEL);
    let launch = match find_launch(trainer) {
        Ok(launch) => launch,
        Err(LaunchError::Empty) => {
            return format!(
                "the trainer `{}` has no command or args: its image's entrypoint runs, which \
                 memguard cannot read; {add}",
                trainer.name
            );
        }
        Err(e) => {
            let (items, _) = command_items(trainer);
            let mut shown = items.join(" ");
            if shown.chars().count() > 80 {
                shown = format!("{}…", shown.chars().take(80).collect::<String>());
            }
            return format!("`{shown}` is not a launch memguard reads ({e}); {add}");
        }
    };
    let program = match &launch.program {
        Program::Module(m) => format!("python -m {m}"),
        p => p.name().to_string(),
    };
    let flags = crate::launch::Flags::parse(&launch.texts(), &HfRules);
    let model_flag = HF_MODEL_FLAGS.iter().find_map(|k| flags.get(k));
    let why = match model_flag {
        Some(f) => format!(
            "its {} is `{}`, a value the shell or the kubelet gives that memguard could not \
             resolve",
            f.spelled,
            f.value.as_deref().unwrap_or_default()
        ),
        None if flags.flags.is_empty() && !launch.args.is_empty() => format!(
            "its arguments (`{}`) are not flags memguard reads: a config file or script \
             arguments in {program}'s own format",
            launch
                .args
                .iter()
                .take(3)
                .map(|a| a.text.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        ),
        None => format!(
            "it names no model with a flag memguard reads (--{})",
            HF_MODEL_FLAGS.join(", --")
        ),
    };
    format!("memguard recognised {program}, but {why}; {add}")
}

/// The LoRA target modules a launch names (`--lora_target_modules`, ms-swift's
/// `--target_modules`, LLaMA-Factory's `--lora_target`), as the estimator's list: `all-linear`
/// (or `all`), or projection names (`q_proj,v_proj`, `[q_proj,v_proj]`). A value it cannot
/// map (another architecture's module names) is not read.
fn hf_lora_targets(flags: &crate::launch::Flags) -> Option<String> {
    let value = ["lora_target_modules", "target_modules", "lora_target"]
        .iter()
        .find_map(|k| flags.value(k))?;
    let cleaned: String = value
        .chars()
        .filter(|c| !matches!(c, '[' | ']' | '"' | '\'' | ' '))
        .collect();
    cleaned
        .parse::<memguard_estimator::LoraTargets>()
        .ok()
        .map(|t| t.to_list())
}

/// `…/hub/models--meta-llama--Llama-3.1-8B/snapshots/<sha>` → `meta-llama/Llama-3.1-8B` (the
/// HF cache layout); anything else as it is.
fn hf_model_id(value: &str) -> String {
    value
        .split('/')
        .find_map(|part| part.strip_prefix("models--"))
        .map(|repo| repo.replace("--", "/"))
        .unwrap_or_else(|| value.to_string())
}

/// The model the trainer's launch names in its flags ([`launch_model`]), else in the config
/// file it names; the method from the flags (LoRA), else from the file. `Err`: neither could be
/// read, and why.
fn launch_or_file_model(
    pod: &Pod,
    trainer: &Container,
    cluster: Cluster<'_>,
    file: &Result<Option<ConfigFileReading>, String>,
) -> Result<Option<LaunchModel>, String> {
    use crate::launch::config_file::{Origin, Trainer};
    let flags = launch_model(pod, trainer, cluster);
    let file = match file {
        Ok(file) => file,
        Err(_) if matches!(flags, Ok(Some(_))) => &None,
        Err(why) => return flags.and(Err(why.clone())),
    };
    let Some(file) = file else {
        return flags;
    };
    let method = file.reading.method;
    let method_source = Some(file.source.clone());
    if let Some(mut m) = flags? {
        if m.method.is_none() && method.is_some_and(|m| m != memguard_estimator::Method::Full) {
            m.method = method;
            m.method_source = method_source;
        }
        return Ok(Some(m));
    }
    let Some((value, read)) = &file.reading.model else {
        return Ok(None);
    };
    let id = match file.config.trainer {
        // LitGPT's checkpoint directory ends `<org>/<name>` (`checkpoints/meta-llama/…`).
        Trainer::LitGpt => {
            let parts: Vec<&str> = value.trim_end_matches('/').rsplit('/').take(2).collect();
            match parts.as_slice() {
                [name, org] => format!("{org}/{name}"),
                _ => value.clone(),
            }
        }
        _ => hf_model_id(value),
    };
    let source = match read.origin {
        Origin::Args => None,
        Origin::File => Some(file.source.clone()),
    };
    Ok(Some(LaunchModel {
        flag: match &source {
            Some(s) => format!("`{}` in {s}", read.key),
            None => read.key.to_string(),
        },
        value: value.clone(),
        id,
        method,
        source,
        method_source,
        model_bits: file.reading.model_bits.map(|b| (b, file.source.clone())),
        implied: Vec::new(),
    }))
}

/// The config file the trainer's launch names ([`crate::launch::config_file`]), read from the
/// pod's ConfigMaps. `Ok(None)`: the launch names none; `Err`: it names one that cannot be
/// read, and why.
fn read_config_file(
    pod: &Pod,
    trainer: &Container,
    cluster: Cluster<'_>,
) -> Result<Option<ConfigFileReading>, String> {
    use crate::launch::config_file;
    let (items, command_len) = command_items(trainer);
    let Ok(found) = find_launch(trainer) else {
        return Ok(None);
    };
    let Some(config) = config_file::find(&found) else {
        return Ok(None);
    };
    let name = config.trainer.name();
    let file = crate::mounted::read(pod, trainer, &config.path, cluster.config_maps)
        .map_err(|e| format!("{name}'s config `{}` was not read: {e}", config.path))?;
    let doc: serde_json::Value = if config.path.ends_with(".json") {
        serde_json::from_str(&file.text)
            .map_err(|e| format!("{name}'s config {} is not valid JSON: {e}", file.source))?
    } else {
        serde_saphyr::from_str(&file.text)
            .map_err(|e| format!("{name}'s config {} is not valid YAML: {e}", file.source))?
    };
    if !doc.is_object() {
        return Err(format!("{name}'s config {} is not a mapping", file.source));
    }
    // An override memguard wrote at an earlier admission (it holds the value planned then, and
    // that differs from the value read then) is not the trainer's: the value read then counts
    // when it came from the command line (memguard replaced the user's word), the file's
    // otherwise (memguard appended the word).
    let earlier = earlier_estimate(pod);
    let mut own = config.clone();
    for (knob, read) in config.read(&doc).knobs {
        let Some(e) = earlier.as_ref().filter(|e| {
            read.origin == config_file::Origin::Args
                && e.config.get(knob.name()) == Some(&read.value)
                && e.read.get(knob.name()) != Some(&read.value)
        }) else {
            continue;
        };
        let users = e.sources.get(knob.name()).is_some_and(|s| s == "args");
        match e.read.get(knob.name()).filter(|_| users) {
            Some(value) => own.restore(read.key, knob, value),
            None => own.overrides.retain(|o| o.key != read.key),
        }
    }
    let reading = own.read(&doc);
    let deepspeed = own
        .lookup_text(&doc, "deepspeed")
        .filter(|p| !p.is_empty() && p != "null")
        .map(|path| {
            let parsed = crate::mounted::read(pod, trainer, &path, cluster.config_maps)
                .map_err(|e| e.to_string())
                .and_then(|f| {
                    serde_json::from_str(&f.text)
                        .map_err(|e| format!("{} is not valid JSON: {e}", f.source))
                });
            (path, parsed)
        });
    Ok(Some(ConfigFileReading {
        items,
        command_len,
        launch: found,
        config,
        doc,
        source: file.source,
        reading,
        deepspeed,
    }))
}

/// Reads a bespoke script's command line with the policy's flag map for its image: the
/// knobs it maps, from the flags as written (`--bs 16`, `--bs=16`; the last wins), for the
/// knobs no annotation gives, each recorded as `args`. Any program: the map says the script
/// defines these flags.
fn read_mapped_flags(
    pod: &Pod,
    trainer: &Container,
    parsed: &TrainingAnnotations,
    config: &mut TrainingConfig,
    sources: &mut BTreeMap<Knob, String>,
    map: &crate::policy::FlagMap,
) -> Result<Option<ArgsReading>, String> {
    use crate::launch::{self, Flags, MappedRules};
    let (items, command_len) = command_items(trainer);
    let found = match find_launch(trainer) {
        Ok(found) => found,
        Err(launch::LaunchError::Empty | launch::LaunchError::NoProgram) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let bools = map
        .flags
        .iter()
        .filter(|(k, _)| **k == Knob::GradCheckpointing)
        .map(|(_, f)| f.as_str());
    let rules = MappedRules::new(map.flags.values().map(String::as_str), bools);
    let flags = Flags::parse(&found.texts(), &rules);
    let earlier = earlier_estimate(pod);
    for (knob, flag) in &map.flags {
        if parsed.knobs_given.contains(knob) {
            continue;
        }
        let key = MappedRules::key_of(flag);
        let Some(f) = flags.get(&key) else { continue };
        let known = [
            Some(f.at),
            match f.value_at {
                launch::flags::ValueAt::Next(i) => Some(i),
                _ => None,
            },
        ]
        .into_iter()
        .flatten()
        .all(|i| found.args.get(i).is_some_and(|a| !a.expands));
        let value = if *knob == Knob::GradCheckpointing {
            flags.bool(&key, &rules).map(|b| b.to_string())
        } else {
            f.value.clone()
        };
        if known
            && let Some(value) = value
            && let Some(value) = as_read(earlier.as_ref(), *knob, &value)
            && knob.set(config, value)
        {
            sources.insert(*knob, "args".into());
        }
    }
    Ok(Some(ArgsReading {
        items,
        command_len,
        launch: found,
        flags,
        hf_parser: false,
        defaults: BTreeMap::new(),
        unread_sequence_flags: Vec::new(),
        flag_map: Some(map.flags.iter().map(|(k, f)| (*k, f.clone())).collect()),
        tune: None,
    }))
}

/// Reads the trainer's command line with HF rules into `config`, for the knobs no annotation
/// gives; each knob read is recorded in `sources` as `args`. `Ok(None)`: no launch, or not one
/// with HF rules; `Err`: a launch that cannot be read, and why.
fn read_args(
    pod: &Pod,
    trainer: &Container,
    parsed: &TrainingAnnotations,
    config: &mut TrainingConfig,
    sources: &mut BTreeMap<Knob, String>,
    cluster: Cluster<'_>,
    policy: &Policy,
) -> Result<Option<ArgsReading>, String> {
    use crate::launch::{self, HfRules};
    let image = trainer.image.as_deref().unwrap_or_default();
    if let Some(map) = policy.flag_map_for(image) {
        return read_mapped_flags(pod, trainer, parsed, config, sources, map);
    }
    if let Some(hf) = hf_launch(trainer)?
        && is_swift(&hf.launch)
    {
        let mut reading = read_mapped_flags(pod, trainer, parsed, config, sources, &swift_flags())?;
        // ms-swift's own `TrainingArguments` (`swift/trainers/arguments.py`): 1 per device,
        // checkpointing on. Its accumulation is derived at run time (16 / batch / world size)
        // and its sequence from the model's config: both unknown when left out.
        for (knob, value) in [(Knob::BatchSize, "1"), (Knob::GradCheckpointing, "true")] {
            if !parsed.knobs_given.contains(&knob) && !sources.contains_key(&knob) {
                knob.set(config, value);
                if let Some(r) = reading.as_mut() {
                    r.defaults.insert(knob, "default:ms-swift");
                }
            }
        }
        return Ok(reading);
    }
    if let Some((items, command_len, found, run)) = tune_launch(trainer)? {
        let tc = tune_config(pod, trainer, &run, cluster)?;
        let earlier = earlier_estimate(pod);
        for (knob, key) in TUNE_KEYS {
            if parsed.knobs_given.contains(knob) {
                continue;
            }
            let base = tc
                .values
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str());
            let Some((value, origin)) = run.value(key, base) else {
                continue;
            };
            let found = match *knob {
                // YAML's and OmegaConf's `True`.
                Knob::GradCheckpointing => match launch::tune::parse_bool(&value) {
                    Some(b) => b.to_string(),
                    None => continue,
                },
                _ => value,
            };
            if let Some(value) = as_read(earlier.as_ref(), *knob, &found)
                && knob.set(config, value)
            {
                // An override memguard appended earlier stands for what the trainer had, from
                // where it had it: a second admission says the same.
                let earlier_source = earlier
                    .as_ref()
                    .filter(|e| e.config.get(knob.name()) == Some(&found))
                    .and_then(|e| e.sources.get(knob.name()).cloned());
                let source = match (earlier_source, origin) {
                    (Some(source), _) => source,
                    (None, launch::tune::Origin::Args) => "args".to_string(),
                    (None, launch::tune::Origin::Config) => tc.source.clone(),
                };
                sources.insert(*knob, source);
            }
        }
        let method = tc
            .component
            .as_deref()
            .and_then(launch::tune::component_model)
            .map(|(_, method)| method);
        return Ok(Some(ArgsReading {
            items,
            command_len,
            launch: found,
            flags: launch::Flags::default(),
            hf_parser: false,
            defaults: BTreeMap::new(),
            unread_sequence_flags: Vec::new(),
            flag_map: None,
            tune: Some(TuneReading { run, method }),
        }));
    }
    let Some(HfLaunch {
        items,
        command_len,
        launch: found,
        flags,
    }) = hf_launch(trainer)?
    else {
        return Ok(None);
    };
    for (knob, key) in HF_FLAGS {
        if parsed.knobs_given.contains(knob) {
            continue;
        }
        let Some(flag) = flags.get(key) else { continue };
        let known = [
            Some(flag.at),
            match flag.value_at {
                launch::flags::ValueAt::Next(i) => Some(i),
                _ => None,
            },
        ]
        .into_iter()
        .flatten()
        .all(|i| found.args.get(i).is_some_and(|a| !a.expands));
        if !known {
            continue;
        }
        let value = if *knob == Knob::GradCheckpointing {
            flags.bool(key, &HfRules).map(|b| b.to_string())
        } else {
            flag.value.clone()
        };
        let earlier = earlier_estimate(pod);
        if let Some(value) = value
            && let Some(read) = as_read(earlier.as_ref(), *knob, &value)
            && knob.set(config, read)
        {
            // memguard's own flag (appended over a config file's value) keeps the source
            // the value was read from then.
            let source = earlier
                .as_ref()
                .filter(|e| e.config.get(knob.name()) == Some(&value))
                .and_then(|e| e.sources.get(knob.name()))
                .cloned()
                .unwrap_or_else(|| "args".into());
            sources.insert(*knob, source);
        }
    }
    // A knob the launch leaves out runs at its parser's default where memguard knows the
    // parser (TRL, transformers' example scripts); in a bespoke script it is unknown.
    let parser = hf_parser(&found, &flags);
    let mut defaults = BTreeMap::new();
    for (knob, value) in &parser.defaults {
        if !parsed.knobs_given.contains(knob) && !sources.contains_key(knob) {
            knob.set(config, value);
            defaults.insert(*knob, parser.citation);
        }
    }
    let unread_sequence_flags = crate::launch::flags::unread_sequence_flags(&flags);
    Ok(Some(ArgsReading {
        items,
        command_len,
        launch: found,
        flags,
        hf_parser: parser.accepts_training_arguments,
        defaults,
        unread_sequence_flags,
        flag_map: None,
        tune: None,
    }))
}

/// What memguard knows of the parser of a launch with HF rules.
struct HfParser {
    /// The parser is `HfArgumentParser` over `TrainingArguments` (or a TRL config, its
    /// subclass): it accepts the flags `TrainingArguments` defines, so they may be appended
    /// where their current value is known.
    accepts_training_arguments: bool,
    /// The values the knobs the launch leaves out run at, where the script's parser and its
    /// defaults are fixed and known; empty for a bespoke script, whose own dataclasses or
    /// `TrainingArguments` subclass may set any default.
    defaults: Vec<(Knob, &'static str)>,
    /// Where `defaults` come from, as the estimate's sources name it.
    citation: &'static str,
}

/// transformers' example scripts (`examples/pytorch/*/run_*.py`): `HfArgumentParser` over
/// stock `TrainingArguments` (8 per device, accumulation 1, no checkpointing), and for the
/// language-modeling ones the sequence they cut to when `--block_size` / `--max_seq_length` is
/// left out: `min(1024, tokenizer.model_max_length)`, 1024 for every catalog model.
const TRANSFORMERS_EXAMPLES: &[(&str, Option<&str>)] = &[
    ("run_clm.py", Some("1024")),
    ("run_mlm.py", Some("1024")),
    ("run_plm.py", None),
    ("run_glue.py", None),
    ("run_ner.py", None),
    ("run_qa.py", None),
    ("run_summarization.py", None),
    ("run_translation.py", None),
    ("run_swag.py", None),
];

/// The parser of a launch with HF rules ([`HfParser`]): TRL's (the `trl` command, `trl/scripts/…`
/// or TRL's `examples/scripts/…`, or TRL's `--use_peft`), whose base config turns checkpointing
/// on and whose SFT, DPO, reward, KTO, CPO, ORPO and PRM configs cut sequences at `max_length`
/// 1024 (any other TRL trainer's sequence is unknown);
/// transformers' example scripts ([`TRANSFORMERS_EXAMPLES`]); else a bespoke script, which
/// accepts `TrainingArguments`' flags when it is given one only that defines, and whose
/// defaults memguard does not know.
fn hf_parser(launch: &crate::launch::Launch, flags: &crate::launch::Flags) -> HfParser {
    use crate::launch::Program;
    let program = &launch.program;
    let trl = match program {
        Program::Command(_) => program.name() == "trl",
        // TRL's own layout: its package's scripts, and the repository's examples (its docs
        // launch them as `python examples/scripts/orpo.py …`).
        Program::Script(path) => {
            path.contains("trl/scripts/") || path.contains("examples/scripts/")
        }
        Program::Module(m) => m.starts_with("trl."),
    } || flags.get("use_peft").is_some();
    let training_arguments = [
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "output_dir",
    ]
    .iter()
    .any(|k| flags.get(k).is_some());
    let stock = [
        (Knob::BatchSize, "8"),
        (Knob::GradAccumulation, "1"),
        (Knob::GradCheckpointing, "false"),
    ];
    if trl {
        let mut defaults = stock.to_vec();
        defaults[2].1 = "true";
        // The trainer: `trl sft`'s subcommand, else the script's name (`…/dpo.py`).
        let trainer = match program {
            Program::Command(_) => launch.args.first().map_or("", |a| a.text.as_str()),
            _ => program.name().trim_end_matches(".py"),
        };
        if ["sft", "dpo", "reward", "kto", "cpo", "orpo", "prm"].contains(&trainer) {
            defaults.push((Knob::SeqLength, "1024"));
        }
        return HfParser {
            accepts_training_arguments: true,
            defaults,
            citation: "default:trl",
        };
    }
    let example = match program {
        Program::Script(_) => TRANSFORMERS_EXAMPLES
            .iter()
            .find(|(name, _)| program.name() == *name),
        _ => None,
    };
    if let Some((_, seq)) = example {
        let mut defaults = stock.to_vec();
        defaults.extend(seq.map(|s| (Knob::SeqLength, s)));
        return HfParser {
            accepts_training_arguments: true,
            defaults,
            citation: "default:transformers-example",
        };
    }
    HfParser {
        accepts_training_arguments: training_arguments,
        defaults: Vec::new(),
        citation: "",
    }
}

impl<'a> TrainingPod<'a> {
    /// Reads `pod`: its training annotations (`memguard.io/model` looked up in the policy's
    /// models, then the built-in catalog), its trainer, its device (its DRA claims' driver read
    /// from `dra` when nothing else names one), its accelerators, memory limit and env.
    pub fn resolve(
        pod: &'a Pod,
        policy: &Policy,
        cluster: Cluster<'_>,
    ) -> Result<Self, ResolveError> {
        let empty = BTreeMap::new();
        let given = pod.metadata.annotations.as_ref().unwrap_or(&empty);
        let has_input = annotations::has_training_input(given);
        let mut file_read = None;
        // The model (and with it the method) from the trainer's launch, unless an annotation
        // names the model or its shape.
        let from_launch = if annotations::names_model(given) {
            Ok(None)
        } else {
            match pod_trainer(pod) {
                Ok((index, trainer)) => {
                    // Read once: the knobs come from the same file below.
                    let file = read_config_file(pod, trainer, cluster);
                    let model = launch_or_file_model(pod, trainer, cluster, &file);
                    file_read = Some((index, file));
                    model
                }
                Err(_) => Ok(None),
            }
        };
        let launched = match from_launch {
            Ok(Some(m)) => Some(m),
            Ok(None) if has_input => None,
            Err(_) if has_input => None,
            Ok(None) => return Err(ResolveError::NoTrainingInput(Some(unread_launch(pod)))),
            Err(why) => {
                return Err(ResolveError::NoTrainingInput(Some(format!(
                    "the trainer's launch could not be read ({why})"
                ))));
            }
        };
        let mut with_launch;
        let mut read_from_args = BTreeSet::new();
        let mut read_from_file = BTreeMap::new();
        let given = match &launched {
            None => given,
            Some(m) => {
                if policy.models.lookup(&m.id).is_none() {
                    return Err(ResolveError::LaunchModel(format!(
                        "the trainer's launch names the model `{}` ({} {}): unknown model, {}; \
                         nearest known: {}; add it to the policy's spec.models (its name and \
                         config.json), or annotate {} with a known model of the same shape",
                        m.id,
                        m.flag,
                        m.value,
                        policy.models.searched(),
                        memguard_estimator::catalog::nearest(&m.id, 3).join(", "),
                        annotations::MODEL
                    )));
                }
                with_launch = given.clone();
                with_launch.insert(annotations::MODEL.into(), m.id.clone());
                let mut read = |what: &'static str, from: &Option<String>| match from {
                    None => {
                        read_from_args.insert(what);
                    }
                    Some(source) => {
                        read_from_file.insert(what, source.clone());
                    }
                };
                read("model", &m.source);
                if !given.contains_key(annotations::METHOD) {
                    let method = m.method.map(|m| m.name()).unwrap_or("full");
                    with_launch.insert(annotations::METHOD.into(), method.into());
                    read("method", &m.method_source);
                }
                if let Some((bits, source)) = &m.model_bits
                    && !given.contains_key(annotations::MODEL_BITS)
                {
                    with_launch.insert(annotations::MODEL_BITS.into(), bits.to_string());
                    read_from_file.insert("model-bits", source.clone());
                }
                for (key, name, value, source) in &m.implied {
                    if !given.contains_key(*key) {
                        with_launch.insert(key.to_string(), value.clone());
                        read_from_file.insert(name, source.clone());
                    }
                }
                &with_launch
            }
        };
        let parsed =
            TrainingAnnotations::parse(given, &policy.models).map_err(ResolveError::Annotations)?;
        let mut training = Self::with_file(
            pod,
            parsed,
            given.contains_key(annotations::WORLD_SIZE),
            policy,
            cluster,
            file_read,
        )?;
        training.read_from_args = read_from_args;
        training.read_from_file = read_from_file;
        // A launch that names its own model, or passes `TrainingArguments`' flags, is not
        // written for memguard: what it leaves to its script's parser is unknown (a pod that
        // annotates its model and runs a script without them reads memguard's `MEMGUARD_*`
        // variables, so memguard's values are the ones that run).
        let hf_script = training.args.as_ref().is_some_and(|a| a.hf_parser);
        if launched.is_some() || hf_script {
            training.unknown = unknown_knobs(
                training.args.as_ref(),
                &training.annotations.knobs_given,
                &training.sources,
            );
            if training.unknown.contains_key(&Knob::GradAccumulation)
                && training.coupled.batch_pinned.is_none()
            {
                let program = training
                    .args
                    .as_ref()
                    .map(|a| a.launch.program.name().to_string())
                    .unwrap_or_default();
                training.coupled.batch_pinned = Some(format!(
                    "the accumulation of {program} is not read (its own parser sets it), so \
                     batch × accumulation could not be kept; add --gradient_accumulation_steps \
                     or annotate memguard.io/grad-accumulation"
                ));
            }
        }
        Ok(training)
    }

    /// [`resolve`](Self::resolve) with the annotations already parsed (`memguard estimate`
    /// parses its flags as annotations); `world_size_given` says whether they named the world
    /// size.
    pub fn with_annotations(
        pod: &'a Pod,
        parsed: TrainingAnnotations,
        world_size_given: bool,
        policy: &Policy,
        cluster: Cluster<'_>,
    ) -> Result<Self, ResolveError> {
        Self::with_file(pod, parsed, world_size_given, policy, cluster, None)
    }

    /// [`with_annotations`](Self::with_annotations), given the config file already read for
    /// the container at that index (or `None`: read it here).
    fn with_file(
        pod: &'a Pod,
        parsed: TrainingAnnotations,
        world_size_given: bool,
        policy: &Policy,
        cluster: Cluster<'_>,
        file_read: Option<(usize, Result<Option<ConfigFileReading>, String>)>,
    ) -> Result<Self, ResolveError> {
        let containers = pod
            .spec
            .as_ref()
            .map(|s| s.containers.as_slice())
            .unwrap_or_default();
        let (trainer_index, trainer) =
            pick_trainer(containers, parsed.container.as_deref()).map_err(ResolveError::Trainer)?;
        let gpus = gpu_count(trainer);
        let accelerators = Accelerators::of(pod, trainer);
        let mut config = parsed.config.clone();
        if !parsed.device_given {
            config.device = accelerators.default_device(pod);
        }
        let on_gpus = matches!(config.device, Device::Cuda | Device::Rocm);
        let products = match config.device {
            Device::Cuda => gpu_products(pod),
            Device::Rocm => pinned_values(pod, AMD_GPU_PRODUCT_LABEL),
            Device::Cpu | Device::Metal => Vec::new(),
        };
        // Last, as admission always did: the claims' driver names a device nothing else named.
        let reading = crate::dra::read(pod, trainer, cluster.dra, policy);
        let (device, dra_memory) = reading.on(config.device, parsed.device_given);
        config.device = device;
        let dra_memory = dra_memory.cloned();
        let MappedEnv {
            mut sources,
            unreadable,
            set_by_trainer,
        } = read_mapped_env(pod, trainer, &parsed, policy, &mut config);
        let (args, args_unreadable) = match read_args(
            pod,
            trainer,
            &parsed,
            &mut config,
            &mut sources,
            cluster,
            policy,
        ) {
            Ok(args) => (args, None),
            Err(why) => (None, Some(why)),
        };
        let file = match file_read {
            Some((index, file)) if index == trainer_index => file,
            _ => read_config_file(pod, trainer, cluster),
        };
        let (config_file, config_unreadable) = match file {
            Ok(file) => (file, None),
            Err(why) => (None, Some(why)),
        };
        if let Some(file) = &config_file {
            // Precedence: an annotation, then what the command line (or a mapped variable)
            // says, then the file.
            for (knob, read) in &file.reading.knobs {
                if parsed.knobs_given.contains(knob) || sources.contains_key(knob) {
                    continue;
                }
                if knob.set(&mut config, &read.value) {
                    let source = match read.origin {
                        crate::launch::config_file::Origin::Args => "args".to_string(),
                        crate::launch::config_file::Origin::File => file.source.clone(),
                    };
                    sources.insert(*knob, source);
                }
            }
        }
        let coupled = args
            .as_ref()
            .map(|a| crate::coupled::read(pod, trainer, &a.launch, &a.flags, cluster.config_maps))
            .unwrap_or_default();
        // FSDP's own activation checkpointing is checkpointing: the plan counts it as on (and
        // so never adds `--gradient_checkpointing`, which transformers refuses with it).
        if let Some(fsdp) = &coupled.fsdp_checkpointing
            && !parsed.knobs_given.contains(&Knob::GradCheckpointing)
            && !config.grad_checkpointing
        {
            config.grad_checkpointing = true;
            sources.insert(Knob::GradCheckpointing, fsdp.source.clone());
        }
        let mut setup_sources = BTreeMap::new();
        // The launch's sharding, unless the annotation says.
        let parallelism_given = pod
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(annotations::PARALLELISM));
        if !parallelism_given && let Some((parallelism, source)) = &coupled.parallelism {
            config.parallelism = *parallelism;
            setup_sources.insert("parallelism", source.clone());
        }
        // Data parallelism over the pod's own GPUs unless the user says how many devices take
        // part; a multi-pod job's launch or operator says it, the same in every pod of the job
        // ([`crate::job_world`]).
        if !world_size_given && config.parallelism != Parallelism::None && on_gpus {
            config.world_size = gpus.max(1);
            let launch = find_launch(trainer).ok();
            if let Some((n, source)) = crate::job_world::read(launch.as_ref(), trainer, gpus) {
                config.world_size = n;
                setup_sources.insert("world-size", source);
            }
        }
        Ok(TrainingPod {
            annotations: parsed,
            trainer_index,
            trainer,
            gpus,
            gpu_products: products,
            config,
            pod,
            accelerators,
            dra: reading,
            dra_memory,
            memory_limit: memory_limit(trainer),
            trainer_env: literal_env(trainer),
            sources,
            unreadable,
            set_by_trainer,
            args,
            args_unreadable,
            read_from_args: BTreeSet::new(),
            coupled,
            setup_sources,
            config_file,
            config_unreadable,
            read_from_file: BTreeMap::new(),
            gpu_nodes: gpu_nodes(pod, cluster),
            unknown: BTreeMap::new(),
        })
    }

    /// What the verdict rests on and nobody said ([`VERDICT_KNOBS`] unknown, the sharding not
    /// read), by annotation name: while any is, the plan is a guess, the launch is left as it
    /// is and no verdict is claimed.
    pub fn guessed(&self) -> Vec<&'static str> {
        let mut out: Vec<&'static str> = VERDICT_KNOBS
            .into_iter()
            .filter(|k| self.unknown.contains_key(k))
            .map(Knob::name)
            .collect();
        if self.coupled.sharding_unknown.is_some()
            && !self.setup_sources.contains_key("parallelism")
        {
            out.push("parallelism");
        }
        out
    }

    /// The variables the trainer's knobs are written to: the pod's `env-map`, else the
    /// policy's `envNames`.
    pub fn env_map<'p>(&'p self, policy: &'p Policy) -> &'p annotations::EnvMap {
        if self.annotations.env_map.is_empty() {
            &policy.env_names
        } else {
            &self.annotations.env_map
        }
    }
}

/// Reads the literal values of the trainer's mapped variables into `config`, for the knobs no
/// annotation gives (an annotation overrides what was read; what was read overrides defaults).
struct MappedEnv {
    sources: BTreeMap<Knob, String>,
    unreadable: BTreeMap<Knob, String>,
    set_by_trainer: BTreeSet<Knob>,
}

/// Returns the sources of what was read, the mapped variables set by `valueFrom`, and the
/// knobs whose variable the trainer sets.
fn read_mapped_env(
    pod: &Pod,
    trainer: &Container,
    parsed: &TrainingAnnotations,
    policy: &Policy,
    config: &mut TrainingConfig,
) -> MappedEnv {
    let map = if parsed.env_map.is_empty() {
        &policy.env_names
    } else {
        &parsed.env_map
    };
    let earlier = earlier_estimate(pod);
    let mut sources = BTreeMap::new();
    let mut unreadable = BTreeMap::new();
    let mut set_by_trainer = BTreeSet::new();
    for (knob, var) in map {
        let Some(entry) = trainer.env.iter().flatten().rev().find(|e| &e.name == var) else {
            continue;
        };
        match &entry.value {
            Some(value) if entry.value_from.is_none() => {
                let Some(value) = as_read(earlier.as_ref(), *knob, value) else {
                    continue;
                };
                set_by_trainer.insert(*knob);
                if parsed.knobs_given.contains(knob) {
                    continue;
                }
                // A value that is not one of the knob's (`BS=auto`) is left to the default.
                if knob.set(config, value) {
                    sources.insert(*knob, format!("env:{var}"));
                }
            }
            _ => {
                set_by_trainer.insert(*knob);
                if !parsed.knobs_given.contains(knob) {
                    unreadable.insert(*knob, var.clone());
                }
            }
        }
    }
    MappedEnv {
        sources,
        unreadable,
        set_by_trainer,
    }
}

/// The trainer: the container `memguard.io/container` names, else the first requesting a GPU,
/// else the first. memguard's own sidecar (classic mode) is never the trainer. Returns its
/// index among `containers`.
pub fn pick_trainer<'a>(
    containers: &'a [Container],
    named: Option<&str>,
) -> Result<(usize, &'a Container), String> {
    let candidates = || {
        containers
            .iter()
            .enumerate()
            .filter(|(_, c)| c.name != wellknown::SIDECAR_CONTAINER)
    };
    if let Some(name) = named {
        let key = annotations::CONTAINER.trim_start_matches(annotations::PREFIX);
        return candidates()
            .find(|(_, c)| c.name == name)
            .ok_or_else(|| format!("{key}: no container named `{name}`"));
    }
    candidates()
        .find(|(_, c)| gpu_count(c) > 0)
        .or_else(|| candidates().next())
        .ok_or_else(|| "the pod has no container".to_string())
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
fn resources(c: &Container) -> impl Iterator<Item = (&str, &Quantity)> {
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

fn device_kind(resource: &str) -> Option<AcceleratorKind> {
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
const KNOWN_SETTINGS: [&str; 3] = [
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

/// Whether `pod` opted in (`memguard.io/enabled=true`): the one check the webhook and the
/// profile controller both make.
pub fn opted_in(pod: &Pod) -> bool {
    pod.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(wellknown::ENABLED_LABEL))
        .is_some_and(|v| v == wellknown::ENABLED_VALUE)
}

/// The literal env of `container` (`value`, not `valueFrom`): what the webhook wrote for the
/// trainer, as the profile controller and `memguard explain` read it back.
pub fn literal_env(container: &Container) -> BTreeMap<String, String> {
    container
        .env
        .iter()
        .flatten()
        .filter_map(|v| Some((v.name.clone(), v.value.clone()?)))
        .collect()
}

/// The container's `limits.memory` (LimitRange defaults are applied before webhooks run), read
/// as the Kubernetes quantity it is (`m` is milli); `None` without one, or for zero.
pub fn memory_limit(c: &Container) -> Option<Bytes> {
    c.resources
        .as_ref()?
        .limits
        .as_ref()?
        .get("memory")
        .and_then(|q| parse_quantity(&q.0))
        .filter(|b| *b > 0)
        .map(Bytes)
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
fn is_not_accelerator(name: &str) -> bool {
    NOT_ACCELERATOR_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// An extended resource: a domain-prefixed name outside `kubernetes.io` (`example.com/npu`);
/// not `cpu`, `memory`, `ephemeral-storage` or `hugepages-*`.
fn is_extended(name: &str) -> bool {
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
const CLOUD_ACCELERATOR_NAMES: &[(&str, &str)] = &[
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
const AWS_GPU_NAMES: &[(&str, &str)] = &[
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
const AZURE_GPU_VM_SIZES: &[(&str, &str)] = &[
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
const AWS_GPU_INSTANCE_FAMILIES: &[(&str, &str)] = &[
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

/// The values of node label `label` the pod is pinned to, read as [`gpu_products`] reads
/// `nvidia.com/gpu.product` (AMD: [`AMD_GPU_PRODUCT_LABEL`]).
pub fn pinned_values(pod: &Pod, label: &str) -> Vec<String> {
    let Some(spec) = pod.spec.as_ref() else {
        return Vec::new();
    };
    if let Some(p) = spec.node_selector.as_ref().and_then(|s| s.get(label)) {
        return vec![p.clone()];
    }
    let terms = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
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

#[cfg(test)]
mod tests {
    use super::*;
    use memguard_estimator::Method;

    /// Resolves against the built-in catalog only.
    fn resolve(pod: &Pod) -> Result<TrainingPod<'_>, ResolveError> {
        TrainingPod::resolve(pod, &Policy::default(), Cluster::default())
    }

    fn pod(annotations: &[(&str, &str)], containers: Vec<Container>) -> Pod {
        let mut p = Pod::default();
        p.metadata.annotations = Some(
            annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        p.spec = Some(k8s_openapi::api::core::v1::PodSpec {
            containers,
            ..Default::default()
        });
        p
    }

    fn gpus(name: &str, n: &str) -> Container {
        Container {
            name: name.into(),
            resources: Some(k8s_openapi::api::core::v1::ResourceRequirements {
                limits: Some(BTreeMap::from([(
                    wellknown::NVIDIA_GPU_RESOURCE.to_string(),
                    Quantity(n.into()),
                )])),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn launching(args: &[&str]) -> Container {
        Container {
            args: Some(args.iter().map(|a| a.to_string()).collect()),
            ..gpus("trainer", "1")
        }
    }

    /// The model from the launch: `--model_name_or_path`, TRL's `--model`, a cache path; an
    /// annotation overrides it, an expanded value is not read, and the method follows
    /// `--use_peft`/`--lora_r`.
    #[test]
    fn the_launch_names_the_model_and_the_method() {
        // The launch, and the model and method it names (`None`: not read, the plain skip).
        type Case<'a> = (&'a [&'a str], Option<(&'a str, Method)>);
        let cases: [Case; 6] = [
            (
                &[
                    "python",
                    "train.py",
                    "--model_name_or_path",
                    "Qwen/Qwen2.5-7B",
                ],
                Some(("qwen2.5-7b", Method::Full)),
            ),
            (
                &["trl", "sft", "--model=google/gemma-2b", "--use_peft"],
                Some(("gemma-2b", Method::Lora)),
            ),
            (
                &[
                    "bash",
                    "-c",
                    "torchrun t.py --model-name-or-path \
                  /hf/hub/models--meta-llama--Llama-3.1-8B/snapshots/0e9e --lora_r 8",
                ],
                Some(("llama-3.1-8b", Method::Lora)),
            ),
            (
                &[
                    "trl",
                    "sft",
                    "--use_peft",
                    "--no_use_peft",
                    "--model",
                    "gpt2",
                ],
                Some(("gpt2", Method::Full)),
            ),
            (
                &["bash", "-c", "python t.py --model_name_or_path $MODEL"],
                None,
            ),
            (
                &["python", "t.py", "--per_device_train_batch_size", "4"],
                None,
            ),
        ];
        for (args, want) in cases {
            let p = pod(&[], vec![launching(args)]);
            match (resolve(&p), want) {
                (Ok(t), Some((name, method))) => {
                    assert_eq!(t.config.model.name.as_deref(), Some(name), "{args:?}");
                    assert_eq!(t.config.method, method, "{args:?}");
                    assert_eq!(
                        t.read_from_args,
                        BTreeSet::from(["model", "method"]),
                        "{args:?}"
                    );
                }
                (Err(ResolveError::NoTrainingInput(Some(_))), None) => {}
                (got, want) => panic!("{args:?}: {got:?}, wanted {want:?}"),
            }
        }
        let annotated = pod(
            &[(annotations::MODEL, "llama-3-8b")],
            vec![launching(&["trl", "sft", "--model", "gpt2", "--use_peft"])],
        );
        let t = resolve(&annotated).expect("resolves");
        assert_eq!(t.config.model.name.as_deref(), Some("llama-3-8b"));
        assert!(t.read_from_args.is_empty(), "the annotation overrides");
    }

    /// One reading for the webhook and the controller: the trainer, the device, the world size.
    #[test]
    fn resolve_reads_the_trainer_the_device_and_the_world_size() {
        let model = (annotations::MODEL, "llama-3-8b");
        let p = pod(&[model], vec![gpus("trainer", "2")]);
        let t = resolve(&p).expect("valid");
        assert_eq!(
            (
                t.trainer_index,
                t.gpus,
                t.config.device,
                t.config.world_size
            ),
            (0, 2, Device::Cuda, 1)
        );
        let p = pod(
            &[model, (annotations::PARALLELISM, "fsdp")],
            vec![Container::default(), gpus("trainer", "4")],
        );
        let t = resolve(&p).expect("valid");
        assert_eq!(
            (t.trainer.name.as_str(), t.config.world_size),
            ("trainer", 4)
        );
        let p = pod(
            &[
                model,
                (annotations::PARALLELISM, "fsdp"),
                (annotations::WORLD_SIZE, "16"),
            ],
            vec![gpus("trainer", "4")],
        );
        assert_eq!(resolve(&p).expect("valid").config.world_size, 16);
        let p = pod(&[model, (annotations::DEVICE, "cpu")], vec![gpus("t", "1")]);
        assert_eq!(resolve(&p).expect("valid").config.device, Device::Cpu);
        let cpu = pod(&[model], vec![Container::default()]);
        assert_eq!(resolve(&cpu).expect("valid").config.device, Device::Cpu);
    }

    #[test]
    fn resolve_says_why_a_pod_cannot_be_read() {
        let none = pod(&[("other.io/x", "1")], vec![Container::default()]);
        assert!(matches!(
            resolve(&none),
            Err(ResolveError::NoTrainingInput(_))
        ));
        let bad = pod(
            &[
                (annotations::MODEL, "gpt-9"),
                (annotations::BATCH_SIZE, "many"),
            ],
            vec![Container::default()],
        );
        let e = resolve(&bad).expect_err("bad annotations");
        assert!(
            matches!(&e, ResolveError::Annotations(errors) if errors.len() == 2),
            "{e}"
        );
        assert!(e.to_string().contains("; "), "every problem, joined: {e}");
        let missing = pod(
            &[
                (annotations::MODEL, "llama-3-8b"),
                (annotations::CONTAINER, "nope"),
            ],
            vec![Container::default()],
        );
        assert!(matches!(resolve(&missing), Err(ResolveError::Trainer(_))));
    }

    use std::collections::BTreeMap;

    #[test]
    fn parses_the_quantity_spellings_the_api_server_writes() {
        let table = [
            ("64Gi", Some(64 << 30)),
            ("500M", Some(500_000_000)),
            ("1e9", Some(1_000_000_000)),
            ("128974848", Some(128_974_848)),
            ("1.5Gi", Some(3 << 29)),
            ("2", Some(2)),
            ("1500m", Some(2)),
            ("0", Some(0)),
        ];
        for (input, expected) in table {
            assert_eq!(parse_quantity(input), expected, "{input}");
        }
    }

    #[test]
    fn rejects_what_is_not_a_quantity() {
        for bad in ["", "Gi", "64GiB", "sixty", "1e", "-1Gi", "1e400"] {
            assert_eq!(parse_quantity(bad), None, "{bad}");
        }
    }

    fn container(name: &str, gpus: Option<&str>) -> Container {
        let mut c = Container {
            name: name.into(),
            ..Default::default()
        };
        if let Some(g) = gpus {
            c.resources = Some(k8s_openapi::api::core::v1::ResourceRequirements {
                limits: Some(BTreeMap::from([(
                    wellknown::NVIDIA_GPU_RESOURCE.to_string(),
                    Quantity(g.into()),
                )])),
                ..Default::default()
            });
        }
        c
    }

    #[test]
    fn the_trainer_is_the_named_container_else_the_gpu_one_else_the_first_never_the_sidecar() {
        let pod = [
            container(wellknown::SIDECAR_CONTAINER, None),
            container("loader", None),
            container("trainer", Some("2")),
        ];
        assert_eq!(pick_trainer(&pod, None).map(|(i, _)| i), Ok(2));
        assert_eq!(pick_trainer(&pod, Some("loader")).map(|(i, _)| i), Ok(1));
        assert_eq!(pick_trainer(&pod[..2], None).map(|(i, _)| i), Ok(1));
        let missing = pick_trainer(&pod, Some("nope")).expect_err("no such container");
        assert!(missing.starts_with("container: "), "{missing}");
        assert!(pick_trainer(&pod[..1], None).is_err());
        assert_eq!(gpu_count(&pod[2]), 2);
    }

    /// The scheduler's rules, where a slip would let a pod "use" a node it cannot: an empty
    /// term matches nothing, `Gt`/`Lt` need a number, an unknown operator matches nothing,
    /// `NoExecute` needs its own toleration, `PreferNoSchedule` never excludes.
    #[test]
    fn a_node_is_usable_as_the_scheduler_decides() {
        use crate::cluster::{NodeInfo, NodeTaint};
        let node = NodeInfo {
            name: "n".into(),
            labels: BTreeMap::from([("mem".to_string(), "40960".to_string())]),
            taints: vec![NodeTaint {
                key: "k".into(),
                value: "v".into(),
                effect: "NoExecute".into(),
            }],
        };
        let pod_with = |spec: serde_json::Value| -> Pod {
            serde_json::from_value(serde_json::json!({"spec": spec})).expect("pod")
        };
        let everything = serde_json::json!([{"operator": "Exists"}]);
        let affinity = |term: serde_json::Value| {
            pod_with(
                serde_json::json!({"containers": [], "tolerations": everything,
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution":
                    {"nodeSelectorTerms": [term]}}}}),
            )
        };
        let expr = |op: &str, values: &[&str]| {
            affinity(serde_json::json!({"matchExpressions": [
                {"key": "mem", "operator": op, "values": values}]}))
        };
        assert!(!pod_may_use(&affinity(serde_json::json!({})), &node));
        assert!(pod_may_use(&expr("Gt", &["40000"]), &node));
        assert!(!pod_may_use(&expr("Gt", &["40960"]), &node));
        assert!(!pod_may_use(&expr("Gt", &["forty"]), &node));
        assert!(pod_may_use(&expr("Lt", &["50000"]), &node));
        assert!(!pod_may_use(&expr("Near", &["40960"]), &node));
        let tolerating = |t: serde_json::Value| {
            pod_may_use(
                &pod_with(serde_json::json!({"containers": [], "tolerations": t})),
                &node,
            )
        };
        assert!(!tolerating(serde_json::json!([])));
        assert!(!tolerating(
            serde_json::json!([{"key": "k", "value": "v", "effect": "NoSchedule"}])
        ));
        assert!(tolerating(serde_json::json!([{"key": "k", "value": "v"}])));
        assert!(tolerating(
            serde_json::json!([{"key": "k", "operator": "Exists", "effect": "NoExecute"}])
        ));
        assert!(!tolerating(serde_json::json!([{"key": "k", "value": "w"}])));
        let soft = NodeInfo {
            taints: vec![NodeTaint {
                key: "k".into(),
                value: String::new(),
                effect: "PreferNoSchedule".into(),
            }],
            ..node.clone()
        };
        assert!(pod_may_use(
            &pod_with(serde_json::json!({"containers": []})),
            &soft
        ));
        // A pod bound to another node by name cannot use this one.
        assert!(!pod_may_use(
            &pod_with(serde_json::json!({"containers": [], "nodeName": "other",
                "tolerations": everything})),
            &node
        ));
    }
}
