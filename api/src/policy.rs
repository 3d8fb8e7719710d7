//! The cluster policy: how the webhook budgets pods and configures the sidecar.
//!
//! One type serves as the webhook's config file, its flags' defaults, and the `spec` of the
//! `MemguardPolicy` CRD, so the three can never drift apart. Every field is optional in the
//! document; [`PolicySpec::resolved`] fills the documented defaults.

use crate::annotations::{EnvMap, edit_distance, env_map_entry};
use crate::duration::{format_duration, parse_duration};
use crate::env;
use crate::knobs::Knob;
use crate::models::{ModelCatalog, ModelSpec};
use crate::quantity::Size;
use memguard_estimator::Bytes;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::time::Duration;

/// Default fraction of device memory a plan may use.
pub const DEFAULT_SAFETY_RATIO: f64 = 0.9;
/// Default GPU memory when neither annotation nor product table says (an 80 GiB A100/H100).
pub const DEFAULT_GPU_MEMORY: &str = "80Gi";
/// Usable memory per device by product label value: `nvidia.com/gpu.product` (GPU feature
/// discovery) for NVIDIA, `amd.com/gpu.product-name` (the ROCm node labeller) for AMD. Usable
/// means what a training process can allocate: NVML's total (`nvidia-smi --query-gpu=
/// memory.total`, GFD's `nvidia.com/gpu.memory`) less the memory the driver reserves (the
/// `Reserved` line of `nvidia-smi -q`, R510 and later; older drivers left it out of the total).
/// Where no reserved figure is published for a product, the largest one seen on any product
/// (834 MiB) is taken off. Each figure and its source is in docs/webhook.md ("GPU memory
/// table"). MIG entries are keyed as the single strategy's product label,
/// `<product>-MIG-<profile>`, with GFD's `nvidia.com/mig-<profile>.memory`. A policy's own
/// `gpuMemory` entries override these and add to them.
pub const BUILTIN_GPU_MEMORY: &[(&str, &str)] = &[
    // NVIDIA, whole GPUs.
    ("Tesla-T4", "15109Mi"),
    ("Tesla-V100-SXM2-16GB", "16160Mi"),
    ("Tesla-V100-SXM2-32GB", "32510Mi"),
    ("NVIDIA-A10", "22194Mi"),
    ("NVIDIA-A10G", "22194Mi"),
    ("NVIDIA-L4", "22478Mi"),
    ("NVIDIA-L40", "45383Mi"),
    ("NVIDIA-L40S", "45383Mi"),
    ("NVIDIA-RTX-6000-Ada-Generation", "48571Mi"),
    ("NVIDIA-RTX-A6000", "48306Mi"),
    ("NVIDIA-GeForce-RTX-3090", "23742Mi"),
    ("NVIDIA-GeForce-RTX-4090", "23730Mi"),
    ("NVIDIA-A100-PCIE-40GB", "40536Mi"),
    ("NVIDIA-A100-SXM4-40GB", "40536Mi"),
    ("NVIDIA-A100-80GB-PCIe", "81086Mi"),
    ("NVIDIA-A100-SXM4-80GB", "81086Mi"),
    ("NVIDIA-H100-PCIe", "81008Mi"),
    ("NVIDIA-H100-80GB-HBM3", "81008Mi"),
    ("NVIDIA-H100-NVL", "94996Mi"),
    ("NVIDIA-GH200-480GB", "97037Mi"),
    ("NVIDIA-H200", "143071Mi"),
    ("NVIDIA-H200-NVL", "143071Mi"),
    ("NVIDIA-B200", "182525Mi"),
    // NVIDIA MIG slices (GFD's `nvidia.com/mig-<profile>.memory`).
    ("NVIDIA-A100-PCIE-40GB-MIG-1g.5gb", "4864Mi"),
    ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "4864Mi"),
    ("NVIDIA-A100-80GB-PCIe-MIG-1g.10gb", "9728Mi"),
    ("NVIDIA-A100-80GB-PCIe-MIG-2g.20gb", "19968Mi"),
    ("NVIDIA-A100-80GB-PCIe-MIG-3g.40gb", "40192Mi"),
    ("NVIDIA-A100-SXM4-80GB-MIG-1g.10gb", "9728Mi"),
    ("NVIDIA-A100-SXM4-80GB-MIG-2g.20gb", "19968Mi"),
    ("NVIDIA-A100-SXM4-80GB-MIG-3g.40gb", "40192Mi"),
    ("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", "9984Mi"),
    ("NVIDIA-H100-80GB-HBM3-MIG-2g.20gb", "20096Mi"),
    ("NVIDIA-H100-PCIe-MIG-1g.10gb", "9984Mi"),
    ("NVIDIA-H100-PCIe-MIG-2g.20gb", "20096Mi"),
    // AMD: one entry per device the ROCm device plugin exposes (an MI250X is two GCDs).
    ("AMD_Instinct_MI210", "65520Mi"),
    ("AMD_Instinct_MI250X", "65520Mi"),
    ("AMD_Instinct_MI250X_MI250", "65520Mi"),
    ("AMD_Instinct_MI300X", "196288Mi"),
    ("AMD_Instinct_MI300X_OAM", "196288Mi"),
];

/// Default of [`PolicySpec::max_oom_recoveries`]: OOM recoveries in a row (each a step down
/// from the config that died) before the webhook stops downgrading and says "cannot fit".
pub const DEFAULT_MAX_OOM_RECOVERIES: u32 = 3;
/// Highest [`PolicySpec::max_oom_recoveries`] accepted: the ladder has far fewer rungs than this,
/// so a larger figure can only be a typo (and would let a Job loop on OOMs).
pub const MAX_OOM_RECOVERIES_LIMIT: u32 = 20;

/// The largest driver reservation seen on any product (MiB): what a node that GPU feature
/// discovery labels with `nvidia.com/gpu.memory` (NVML's total) may hold back beyond it.
pub const MAX_DRIVER_RESERVED_MIB: u64 = 834;

/// Default sidecar image.
pub const DEFAULT_SIDECAR_IMAGE: &str = "ghcr.io/memguard/memguard:0.1.0";
/// Default sampling interval of the sidecar.
pub const DEFAULT_SIDECAR_INTERVAL: Duration = Duration::from_millis(100);

/// How the sidecar is injected.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum SidecarMode {
    /// `initContainers` entry with `restartPolicy: Always` (Kubernetes ≥ 1.29): Jobs finish.
    #[default]
    Native,
    /// A regular container that exits when the trainer exits (older clusters).
    Classic,
}

/// Whether memguard steers a GPU pod that is not pinned to a product onto nodes whose GPU memory
/// fits it (node affinity on `nvidia.com/gpu.memory`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum PlacementMode {
    /// No affinity: the pod is planned for the policy's default GPU memory.
    Off,
    /// A preferred affinity toward nodes where the undowngraded config fits; the pod may still
    /// land anywhere, so its config is planned as with `off`.
    #[default]
    Preferred,
    /// A required affinity toward such nodes, and the config planned for the smallest of them.
    Required,
}

/// Resources of the injected sidecar (Kubernetes quantities).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SidecarResources {
    /// CPU request, e.g. `10m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_request: Option<String>,
    /// Memory request, e.g. `16Mi`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_request: Option<String>,
    /// Memory limit, e.g. `32Mi`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_limit: Option<String>,
}

/// The injected sidecar.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SidecarSpec {
    /// Image holding `memguard-sidecar`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// `native` (default) or `classic`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<SidecarMode>,
    /// Resources.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<SidecarResources>,
    /// Sampling interval, more than 0: one or more `<number><unit>` groups (`ns`, `us`, `ms`,
    /// `s`, `m`, `h`), e.g. `100ms` (default) or `1m30s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(regex(pattern = crate::duration::PATTERN)))]
    pub interval: Option<String>,
}

/// The Python client the webhook injects into trainers that run Python (docs/python-client.md,
/// "Injected into the pod").
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClientSpec {
    /// Inject the client (default `true`); a pod opts out with `memguard.io/inject-client: "false"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inject: Option<bool>,
    /// Image holding the `memguard` binary that writes the client (default: the sidecar's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

/// Pressure thresholds of the sidecar, as fractions of the effective limit.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Thresholds {
    /// Level `warn` at or above this ratio (default 0.70).
    #[serde(default = "default_warn")]
    #[cfg_attr(feature = "crd", schemars(range(min = 0.0, max = 1.0)))]
    pub warn: f64,
    /// Level `downgrade` at or above this ratio (default 0.85).
    #[serde(default = "default_downgrade")]
    #[cfg_attr(feature = "crd", schemars(range(min = 0.0, max = 1.0)))]
    pub downgrade: f64,
    /// Level `critical` at or above this ratio (default 0.95).
    #[serde(default = "default_critical")]
    #[cfg_attr(feature = "crd", schemars(range(min = 0.0, max = 1.0)))]
    pub critical: f64,
    /// PSI memory `some avg10` percentage that counts as `downgrade` pressure (default 10).
    #[serde(default = "default_psi")]
    #[cfg_attr(feature = "crd", schemars(range(min = 0.0, max = 100.0)))]
    pub psi_some_avg10: f64,
}

fn default_warn() -> f64 {
    0.70
}
fn default_downgrade() -> f64 {
    0.85
}
fn default_critical() -> f64 {
    0.95
}
fn default_psi() -> f64 {
    10.0
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            warn: default_warn(),
            downgrade: default_downgrade(),
            critical: default_critical(),
            psi_some_avg10: default_psi(),
        }
    }
}

impl Thresholds {
    /// Checks `0 < warn < downgrade < critical ≤ 1` and a non-negative PSI threshold.
    pub fn validate(&self) -> Result<(), String> {
        let ordered = 0.0 < self.warn
            && self.warn < self.downgrade
            && self.downgrade < self.critical
            && self.critical <= 1.0;
        if !ordered {
            return Err(format!(
                "thresholds must satisfy 0 < warn < downgrade < critical <= 1 (got {}, {}, {})",
                self.warn, self.downgrade, self.critical
            ));
        }
        if !(0.0..=100.0).contains(&self.psi_some_avg10) {
            return Err(format!(
                "psiSomeAvg10 must be in [0, 100] (got {})",
                self.psi_some_avg10
            ));
        }
        Ok(())
    }
}

/// Lowest values a plan may reach.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FloorsSpec {
    /// Smallest per-device batch (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u64>,
    /// Shortest sequence (default 256).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_length: Option<u64>,
    /// Smallest LoRA rank (default 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_rank: Option<u64>,
    /// Fewest adapted layers (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_layers: Option<u64>,
    /// Whether plans may cut the quality knobs (sequence length, LoRA rank and layers) down to
    /// these floors, where a cut saves at least 2 % of the budget (default false: a pod may
    /// allow it with `memguard.io/allow-quality: "true"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_quality: Option<bool>,
}

impl FloorsSpec {
    /// The floors with defaults filled in.
    pub fn resolved(&self) -> memguard_estimator::plan::Floors {
        let d = memguard_estimator::plan::Floors::default();
        memguard_estimator::plan::Floors {
            batch_size: self.batch_size.unwrap_or(d.batch_size).max(1),
            seq_length: self.seq_length.unwrap_or(d.seq_length).max(1),
            lora_rank: self.lora_rank.unwrap_or(d.lora_rank).max(1),
            lora_layers: self.lora_layers.unwrap_or(d.lora_layers).max(1),
            allow_quality: self.allow_quality.unwrap_or(d.allow_quality),
        }
    }
}

/// The policy document (config file, and `spec` of `MemguardPolicy`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PolicySpec {
    /// Fraction of device memory a plan may use, in (0, 1] (default 0.9).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(range(min = 0.0, max = 1.0)))]
    pub safety_ratio: Option<f64>,
    /// GPU memory per device when no product is known (default `80Gi`): a number and a unit
    /// (`24Gi`, `80G`, `23028Mi`, `24GiB`); a bare number is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(regex(pattern = crate::quantity::SIZE_PATTERN)))]
    pub default_gpu_memory: Option<String>,
    /// GPU memory per `nvidia.com/gpu.product` label value, e.g. `NVIDIA-A10G: 23028Mi`; these
    /// entries override (and add to) memguard's built-in table of common NVIDIA products. Each
    /// is a number and a unit, as `defaultGpuMemory`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[cfg_attr(feature = "crd", schemars(schema_with = "sizes_schema"))]
    pub gpu_memory: BTreeMap<String, String>,
    /// The injected sidecar.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sidecar: Option<SidecarSpec>,
    /// Sidecar pressure thresholds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thresholds: Option<Thresholds>,
    /// The injected Python client.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<ClientSpec>,
    /// Default `env-map` (knob → the trainer's own variable) for pods that give none, e.g.
    /// `batch-size: PER_DEVICE_TRAIN_BATCH_SIZE`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env_names: BTreeMap<String, String>,
    /// Downgrade floors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub floors: Option<FloorsSpec>,
    /// OOM recoveries in a row a profile may take, each admitting the next pod one step below
    /// the config that died, before the webhook stops downgrading and admits the pod with
    /// `memguard.io/error: cannot fit: …` (default 3, at most 20; 0: never retry smaller).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(range(max = 20)))]
    pub max_oom_recoveries: Option<u32>,
    /// The level of the upper bound on the estimate that pods are planned against, in
    /// [0.5, 0.99] (default 0.95): the share of unseen configurations whose peak the bound
    /// covers (docs/accuracy.md, "The upper bound").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "crd", schemars(range(min = 0.5, max = 0.99)))]
    pub estimate_level: Option<f64>,
    /// `off`, `preferred` (default) or `required`: node affinity on `nvidia.com/gpu.memory` for
    /// GPU pods not pinned to a product (docs/webhook.md, "Placement").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<PlacementMode>,
    /// Models pods may name in `memguard.io/model` besides the built-in catalog, each with its
    /// Hugging Face `config.json` (docs/webhook.md, "Models in the policy"). Looked up before the built-in
    /// catalog; an entry named like a built-in model shadows it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(
        feature = "crd",
        schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))
    )]
    pub models: Vec<ModelSpec>,
    /// Whether memguard may lower an inference server's maximum length (vLLM's
    /// `--max-model-len`, SGLang's `--context-length`) to what its KV cache holds in the pod's
    /// share, down to `floors.seqLength` (default false: a quality change; the pod gets
    /// `memguard.io/error` with the numbers instead). docs/serving.md.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serving_shorten_max_length: Option<bool>,
    /// Whether the webhook writes `NVIDIA_GPU_MEMORY_REQUEST` and `NVIDIA_GPU_MEMORY_LIMIT` on a
    /// GPU trainer from its planned share, for nodes whose driver enforces a per-container GPU
    /// memory budget through the container toolkit (driver r615 or later, kernel 6.14 or later:
    /// the `dmem` cgroup controller). Default false. A value the pod sets is kept. Untested on
    /// hardware (docs/webhook.md, "Enforcing the GPU budget").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforce_gpu_memory: Option<bool>,
    /// Flag names of bespoke training scripts, by container image: for a trainer whose image
    /// matches `image` (`*` matches any run of characters), knob → the script's flag. The first
    /// matching entry wins. The trainer's command line is read and rewritten with these flags
    /// (`--bs 16`, `--bs=16`; an absent mapped flag is appended).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub flag_maps: Vec<FlagMapSpec>,
}

/// A map of sizes, each checked by [`crate::quantity::SIZE_PATTERN`].
#[cfg(feature = "crd")]
fn sizes_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    // The field's doc comment becomes the description.
    schemars::json_schema!({
        "type": "object",
        "additionalProperties": {
            "type": "string",
            "pattern": crate::quantity::SIZE_PATTERN,
        },
    })
}

/// One entry of the policy's `flagMaps`, as written.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FlagMapSpec {
    /// The trainer's container image, `*` matching any run of characters, e.g.
    /// `registry.example.com/team/trainer*`.
    pub image: String,
    /// Knob name (as in the annotations, e.g. `batch-size`) → the script's flag (e.g. `--bs`).
    pub flags: BTreeMap<String, String>,
}

/// A checked [`FlagMapSpec`].
#[derive(Debug, Clone, PartialEq)]
pub struct FlagMap {
    /// The image glob (only `*` is special).
    pub image: String,
    /// Knob → flag, each flag starting with `-`.
    pub flags: BTreeMap<Knob, String>,
}

impl FlagMap {
    /// Whether `image` matches the glob: `*` matches any run of characters, all else itself.
    pub fn matches(&self, image: &str) -> bool {
        glob_match(&self.image, image)
    }
}

/// `*`-only glob matching, anchored at both ends.
fn glob_match(pattern: &str, text: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = text.strip_prefix(first) else {
        return false;
    };
    let mut middle: Vec<&str> = parts.collect();
    let Some(last) = middle.pop() else {
        // No `*`: the whole text must be the pattern.
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

/// Checks one flag-map entry; `at` names it in errors.
fn flag_map(spec: &FlagMapSpec, at: &str) -> Result<FlagMap, Vec<String>> {
    let mut errors = Vec::new();
    let image = spec.image.trim();
    if image.is_empty() || image.chars().any(char::is_whitespace) {
        errors.push(format!(
            "{at}.image: `{}` is not an image pattern (a name with optional `*`, no spaces)",
            spec.image
        ));
    } else if image.contains(['?', '[', ']']) {
        errors.push(format!(
            "{at}.image: `{image}`: only `*` is a wildcard (`?` and `[...]` are not supported)"
        ));
    }
    if spec.flags.is_empty() {
        errors.push(format!(
            "{at}.flags: empty (map at least one knob to a flag)"
        ));
    }
    let mut flags = BTreeMap::new();
    let mut seen: BTreeMap<&str, &str> = BTreeMap::new();
    for (name, flag) in &spec.flags {
        let Some(knob) = Knob::parse(name.trim()) else {
            errors.push(format!("{at}.flags[{name}]: {}", unknown_knob(name.trim())));
            continue;
        };
        let flag = flag.trim();
        let valid = flag.starts_with('-')
            && !flag.trim_start_matches('-').is_empty()
            && !flag.contains(['=', ' ', '\t']);
        if !valid {
            errors.push(format!(
                "{at}.flags[{name}]: `{flag}` is not a flag (like `--bs` or `-b`, no `=` or spaces)"
            ));
            continue;
        }
        if let Some(other) = seen.insert(flag, name) {
            errors.push(format!(
                "{at}.flags[{name}]: `{flag}` is also the flag of `{other}`"
            ));
            continue;
        }
        flags.insert(knob, flag.to_string());
    }
    if errors.is_empty() {
        Ok(FlagMap {
            image: image.to_string(),
            flags,
        })
    } else {
        Err(errors)
    }
}

/// "unknown knob" with the closest known one when a couple of edits away, and the full list.
fn unknown_knob(name: &str) -> String {
    let known = Knob::ALL.map(Knob::name);
    let suggestion = known
        .iter()
        .map(|k| (edit_distance(name, k), *k))
        .min()
        .filter(|(d, k)| *d <= 3 || k.replace('-', "") == name.replace(['-', '_'], ""))
        .map(|(_, k)| format!(" (did you mean `{k}`?)"))
        .unwrap_or_default();
    format!(
        "unknown knob `{name}`{suggestion}; known knobs: {}",
        known.join(", ")
    )
}

/// A policy with every default applied and every quantity parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Safety ratio in (0, 1].
    pub safety_ratio: f64,
    /// GPU memory when no product is known.
    pub default_gpu_memory: Bytes,
    /// The same, as the policy wrote it: messages say it back in the user's unit.
    pub default_gpu_memory_written: Size,
    /// GPU memory per product.
    pub gpu_memory: BTreeMap<String, Bytes>,
    /// Sidecar image.
    pub sidecar_image: String,
    /// Sidecar injection mode.
    pub sidecar_mode: SidecarMode,
    /// Sidecar resources.
    pub sidecar_resources: SidecarResources,
    /// Sidecar sampling interval (more than 0).
    pub sidecar_interval: Duration,
    /// Whether the Python client is injected into trainers that run Python.
    pub client_inject: bool,
    /// Image of the client's init container (the sidecar's unless the policy names another).
    pub client_image: String,
    /// Thresholds.
    pub thresholds: Thresholds,
    /// Default env-map (knob → the trainer's own variable), checked like the annotation's.
    pub env_names: EnvMap,
    /// Floors.
    pub floors: memguard_estimator::plan::Floors,
    /// OOM recoveries in a row before "cannot fit" (see [`PolicySpec::max_oom_recoveries`]).
    pub max_oom_recoveries: u32,
    /// The level of the upper bound pods are planned against (see
    /// [`PolicySpec::estimate_level`]).
    pub estimate_level: f64,
    /// Placement of GPU pods not pinned to a product.
    pub placement: PlacementMode,
    /// The models pods may name: the policy's, then the built-in catalog.
    pub models: ModelCatalog,
    /// Whether an inference server's maximum length may be lowered to fit.
    pub serving_shorten_max_length: bool,
    /// Whether the trainer gets `NVIDIA_GPU_MEMORY_REQUEST`/`LIMIT` from its planned share.
    pub enforce_gpu_memory: bool,
    /// Flag maps of bespoke training scripts, in order (the first match wins).
    pub flag_maps: Vec<FlagMap>,
}

impl Default for Policy {
    fn default() -> Self {
        PolicySpec::default()
            .resolved()
            .expect("the built-in defaults are valid")
    }
}

impl PolicySpec {
    /// Applies defaults and validates; returns every problem, each naming its field.
    pub fn resolved(&self) -> Result<Policy, Vec<String>> {
        let mut errors = Vec::new();
        let safety_ratio = self.safety_ratio.unwrap_or(DEFAULT_SAFETY_RATIO);
        if !(safety_ratio > 0.0 && safety_ratio <= 1.0) {
            errors.push(format!("safetyRatio: {safety_ratio} is not in (0, 1]"));
        }
        // Every size goes through the one parser (`crate::quantity`): a bare number is refused
        // with the unit it most likely meant, never read as bytes.
        let mut quantity = |field: &str, s: &str| match Size::parse(s) {
            Ok(size) => Some(size),
            Err(e) => {
                errors.push(format!("{field}: {e}"));
                None
            }
        };
        let default_gpu_memory = quantity(
            "defaultGpuMemory",
            self.default_gpu_memory
                .as_deref()
                .unwrap_or(DEFAULT_GPU_MEMORY),
        );
        let builtin = BUILTIN_GPU_MEMORY
            .iter()
            .map(|(product, q)| (product.to_string(), q.to_string()));
        let mut entries: BTreeMap<String, String> = builtin.collect();
        entries.extend(self.gpu_memory.clone());
        let gpu_memory: BTreeMap<String, Bytes> = entries
            .iter()
            .filter_map(|(product, q)| {
                quantity(&format!("gpuMemory[{product}]"), q).map(|s| (product.clone(), s.bytes()))
            })
            .collect();
        let thresholds = self.thresholds.unwrap_or_default();
        if let Err(e) = thresholds.validate() {
            errors.push(format!("thresholds: {e}"));
        }
        let max_oom_recoveries = self
            .max_oom_recoveries
            .unwrap_or(DEFAULT_MAX_OOM_RECOVERIES);
        if max_oom_recoveries > MAX_OOM_RECOVERIES_LIMIT {
            errors.push(format!(
                "maxOomRecoveries: {max_oom_recoveries} is more than {MAX_OOM_RECOVERIES_LIMIT}"
            ));
        }
        let estimate_level = self
            .estimate_level
            .unwrap_or(memguard_estimator::bound::DEFAULT_LEVEL);
        let (lo, hi) = memguard_estimator::bound::LEVEL_RANGE;
        if !(lo..=hi).contains(&estimate_level) {
            errors.push(format!(
                "estimateLevel: {estimate_level} is not in [{lo}, {hi}]"
            ));
        }
        let mut env_names = EnvMap::new();
        for (knob, var) in &self.env_names {
            match env_map_entry(knob, var) {
                Ok((knob, var)) => {
                    env_names.insert(knob, var);
                }
                Err(e) => errors.push(format!("envNames[{knob}]: {e}")),
            }
        }
        let models = ModelCatalog::from_specs(&self.models).unwrap_or_else(|problems| {
            errors.extend(problems);
            ModelCatalog::default()
        });
        let sidecar = self.sidecar.clone().unwrap_or_default();
        let sidecar_interval = match sidecar.interval.as_deref().map(parse_duration) {
            None => Some(DEFAULT_SIDECAR_INTERVAL),
            Some(Ok(d)) if !d.is_zero() => Some(d),
            Some(Ok(_)) => {
                errors.push("sidecar.interval: must be more than 0".into());
                None
            }
            Some(Err(e)) => {
                errors.push(format!("sidecar.interval: {e}"));
                None
            }
        };
        let mut flag_maps = Vec::new();
        for (i, spec) in self.flag_maps.iter().enumerate() {
            match flag_map(spec, &format!("flagMaps[{i}]")) {
                Ok(map) => flag_maps.push(map),
                Err(problems) => errors.extend(problems),
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        // Parsed above, and an error returned had it failed; the constant is a size.
        let default_gpu_memory = default_gpu_memory
            .unwrap_or_else(|| Size::parse(DEFAULT_GPU_MEMORY).expect("the default is a size"));
        let client = self.client.clone().unwrap_or_default();
        let sidecar_image = sidecar
            .image
            .unwrap_or_else(|| DEFAULT_SIDECAR_IMAGE.to_string());
        Ok(Policy {
            safety_ratio,
            default_gpu_memory: default_gpu_memory.bytes(),
            default_gpu_memory_written: default_gpu_memory,
            gpu_memory,
            client_inject: client.inject.unwrap_or(true),
            client_image: client
                .image
                .filter(|image| !image.trim().is_empty())
                .unwrap_or_else(|| sidecar_image.clone()),
            sidecar_image,
            sidecar_mode: sidecar.mode.unwrap_or_default(),
            sidecar_resources: sidecar.resources.unwrap_or_else(|| SidecarResources {
                cpu_request: Some("10m".into()),
                memory_request: Some("16Mi".into()),
                memory_limit: Some("32Mi".into()),
            }),
            sidecar_interval: sidecar_interval.unwrap_or(DEFAULT_SIDECAR_INTERVAL),
            thresholds,
            env_names,
            floors: self.floors.unwrap_or_default().resolved(),
            max_oom_recoveries,
            estimate_level,
            placement: self.placement.unwrap_or_default(),
            models,
            serving_shorten_max_length: self.serving_shorten_max_length.unwrap_or(false),
            enforce_gpu_memory: self.enforce_gpu_memory.unwrap_or(false),
            flag_maps,
        })
    }
}

impl Policy {
    /// The flag map of the first entry whose image glob matches `image`, if any.
    pub fn flag_map_for(&self, image: &str) -> Option<&FlagMap> {
        self.flag_maps.iter().find(|m| m.matches(image))
    }

    /// The `MEMGUARD_SIDECAR_*` variables that carry the policy's sidecar settings (interval and
    /// thresholds), spelled so the sidecar's own flag parsing reads back the same values.
    pub fn sidecar_env(&self) -> Vec<(&'static str, String)> {
        let t = &self.thresholds;
        vec![
            (
                env::SIDECAR_INTERVAL,
                format_duration(self.sidecar_interval),
            ),
            (env::SIDECAR_WARN, t.warn.to_string()),
            (env::SIDECAR_DOWNGRADE, t.downgrade.to_string()),
            (env::SIDECAR_CRITICAL, t.critical.to_string()),
            (env::SIDECAR_PSI_THRESHOLD, t.psi_some_avg10.to_string()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flag_maps(json: serde_json::Value) -> Result<Policy, Vec<String>> {
        serde_json::from_value::<PolicySpec>(serde_json::json!({ "flagMaps": json }))
            .expect("a policy")
            .resolved()
    }

    /// A flag map is checked at load and the first entry whose image glob matches wins.
    #[test]
    fn flag_maps_resolve_to_knobs_and_the_first_matching_image_wins() {
        let p = flag_maps(serde_json::json!([
            {"image": "registry.example.com/team/trainer*",
             "flags": {"batch-size": "--bs", "grad-accumulation": "--accum", "seq-length": "--seq"}},
            {"image": "*/trainer:*", "flags": {"batch-size": "--batch"}},
        ]))
        .expect("valid");
        let map = p
            .flag_map_for("registry.example.com/team/trainer:1.2")
            .expect("first entry");
        assert_eq!(map.flags[&Knob::BatchSize], "--bs");
        assert_eq!(map.flags[&Knob::GradAccumulation], "--accum");
        assert_eq!(map.flags.get(&Knob::GradCheckpointing), None);
        let map = p
            .flag_map_for("other.io/x/trainer:3")
            .expect("second entry");
        assert_eq!(map.flags[&Knob::BatchSize], "--batch");
        assert_eq!(p.flag_map_for("other.io/x/serve:3"), None);
        assert_eq!(p.flag_map_for("registry.example.com/team/other:1"), None);
        assert!(
            PolicySpec::default()
                .resolved()
                .expect("valid")
                .flag_maps
                .is_empty()
        );
    }

    #[test]
    fn image_globs_match_only_with_star_and_are_anchored() {
        assert!(glob_match("a*c", "abbbc"));
        assert!(glob_match("a*c", "ac"));
        assert!(!glob_match("a*c", "abcd"));
        assert!(!glob_match("abc", "abcd"));
        assert!(glob_match("abc", "abc"));
        assert!(glob_match("*", ""));
        assert!(glob_match("a*b*a", "aba"));
        assert!(
            !glob_match("ab*ba", "aba"),
            "prefix and suffix may not overlap"
        );
        assert!(glob_match("reg/*/t:*", "reg/team/t:1"));
        assert!(
            !glob_match("reg/t?", "reg/t1"),
            "`?` is itself, not a wildcard"
        );
    }

    /// An unknown knob names the closest known one and lists them all; bad globs and flags are
    /// refused with their place; every problem is reported at once.
    #[test]
    fn bad_flag_maps_are_refused_with_a_did_you_mean() {
        let errs = flag_maps(serde_json::json!([
            {"image": "reg/trainer*", "flags": {"batch_size": "--bs", "seq-lenght": "--seq"}},
        ]))
        .expect_err("unknown knobs");
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert!(
            errs[0].starts_with("flagMaps[0].flags[batch_size]: unknown knob `batch_size`")
                && errs[0].contains("did you mean `batch-size`?")
                && errs[0].contains("known knobs: batch-size, grad-accumulation"),
            "{errs:?}"
        );
        assert!(errs[1].contains("did you mean `seq-length`?"), "{errs:?}");
        let errs = flag_maps(serde_json::json!([
            {"image": "reg/trainer*", "flags": {"zzz": "--z"}},
        ]))
        .expect_err("unknown knob");
        assert!(!errs[0].contains("did you mean"), "{errs:?}");
        let errs = flag_maps(serde_json::json!([
            {"image": "reg/trainer?", "flags": {"batch-size": "bs"}},
            {"image": " ", "flags": {"batch-size": "--bs", "seq-length": "--bs"}},
            {"image": "reg/x", "flags": {"batch-size": "--bs=2"}},
            {"image": "reg/y", "flags": {}},
        ]))
        .expect_err("bad entries");
        let expected = [
            "flagMaps[0].image: `reg/trainer?`: only `*` is a wildcard",
            "flagMaps[0].flags[batch-size]: `bs` is not a flag",
            "flagMaps[1].image: ` ` is not an image pattern",
            "flagMaps[1].flags[seq-length]: `--bs` is also the flag of `batch-size`",
            "flagMaps[2].flags[batch-size]: `--bs=2` is not a flag",
            "flagMaps[3].flags: empty",
        ];
        assert_eq!(errs.len(), expected.len(), "{errs:?}");
        for (e, want) in errs.iter().zip(expected) {
            assert!(e.starts_with(want), "{e} should start with {want}");
        }
    }

    #[test]
    fn empty_spec_resolves_to_documented_defaults() {
        let p = PolicySpec::default()
            .resolved()
            .expect("defaults are valid");
        assert_eq!(p.safety_ratio, 0.9);
        assert_eq!(p.default_gpu_memory, Bytes::gib(80));
        assert_eq!(p.sidecar_mode, SidecarMode::Native);
        assert_eq!(p.thresholds.downgrade, 0.85);
        assert_eq!(p.floors.batch_size, 1);
        assert_eq!(p.max_oom_recoveries, DEFAULT_MAX_OOM_RECOVERIES);
    }

    /// The client is injected by default, in the sidecar's image unless one is named (an empty
    /// name, as the chart's default value renders, is no name).
    #[test]
    fn the_client_is_on_in_the_sidecars_image_unless_the_policy_says_otherwise() {
        let resolve = |json: serde_json::Value| {
            serde_json::from_value::<PolicySpec>(json)
                .expect("a policy")
                .resolved()
                .expect("valid")
        };
        let p = resolve(serde_json::json!({"sidecar": {"image": "reg/mg:2"}}));
        assert!(p.client_inject);
        assert_eq!(p.client_image, "reg/mg:2");
        let p = resolve(serde_json::json!({"client": {"inject": false, "image": ""}}));
        assert!(!p.client_inject);
        assert_eq!(p.client_image, DEFAULT_SIDECAR_IMAGE);
        let p = resolve(serde_json::json!({"client": {"image": "reg/client:1"}}));
        assert_eq!(p.client_image, "reg/client:1");
    }

    #[test]
    fn estimate_level_defaults_to_095_and_is_checked_at_load() {
        assert_eq!(
            PolicySpec::default()
                .resolved()
                .expect("valid")
                .estimate_level,
            0.95
        );
        let at = |level: f64| PolicySpec {
            estimate_level: Some(level),
            ..PolicySpec::default()
        };
        assert_eq!(at(0.9).resolved().expect("valid").estimate_level, 0.9);
        for bad in [0.4, 1.0, f64::NAN] {
            let errors = at(bad).resolved().expect_err("out of range");
            assert!(
                errors.iter().any(|e| e.starts_with("estimateLevel:")),
                "{errors:?}"
            );
        }
    }

    #[test]
    fn max_oom_recoveries_is_checked_at_load() {
        let spec = |json: &str| serde_json::from_str::<PolicySpec>(json);
        let five = spec(r#"{"maxOomRecoveries": 5}"#).expect("valid");
        assert_eq!(five.resolved().expect("valid").max_oom_recoveries, 5);
        let zero = spec(r#"{"maxOomRecoveries": 0}"#).expect("valid");
        assert_eq!(zero.resolved().expect("valid").max_oom_recoveries, 0);
        let errors = spec(r#"{"maxOomRecoveries": 300}"#)
            .expect("shape is valid")
            .resolved()
            .expect_err("too many");
        assert_eq!(
            errors,
            ["maxOomRecoveries: 300 is more than 20"],
            "names the field"
        );
        for bad in [
            r#"{"maxOomRecoveries": -1}"#,
            r#"{"maxOomRecoveries": "3"}"#,
        ] {
            let e = spec(bad).expect_err("not a count").to_string();
            assert!(e.contains("invalid"), "{bad}: {e}");
        }
    }

    #[test]
    fn reports_every_bad_field() {
        let spec: PolicySpec = serde_json::from_str(
            r#"{"safetyRatio": 1.5, "gpuMemory": {"NVIDIA-A10G": "24 parsecs"},
                "thresholds": {"warn": 0.9, "downgrade": 0.8}}"#,
        )
        .expect("shape is valid");
        let errors = spec.resolved().expect_err("values are not");
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(errors[1].starts_with("gpuMemory[NVIDIA-A10G]"));
    }

    /// Issue 38: `defaultGpuMemory: 24` and `gpuMemory: {NVIDIA-A10G: 22}` were 24 and 22
    /// bytes, and every pod planned against them "cannot fit". Both are refused now, each with
    /// its field and the unit it most likely meant; the policy is not loaded.
    #[test]
    fn sizes_without_a_unit_are_refused_with_the_unit_they_most_likely_meant() {
        for doc in [
            r#"{"defaultGpuMemory": "24", "gpuMemory": {"NVIDIA-A10G": "22"}}"#,
            r#"{"defaultGpuMemory": " 24 ", "gpuMemory": {"NVIDIA-A10G": " 22 "}}"#,
        ] {
            let spec: PolicySpec = serde_json::from_str(doc).expect("the shape is valid");
            let errors = spec.resolved().expect_err("no unit");
            assert_eq!(
                errors,
                [
                    "defaultGpuMemory: `24` has no unit: did you mean `24Gi`? (sizes are like \
                     24Gi, 80G, 23028Mi or 24GiB)",
                    "gpuMemory[NVIDIA-A10G]: `22` has no unit: did you mean `22Gi`? (sizes are \
                     like 24Gi, 80G, 23028Mi or 24GiB)",
                ]
            );
        }
        let zero: PolicySpec =
            serde_json::from_str(r#"{"defaultGpuMemory": "0Gi"}"#).expect("shape");
        assert_eq!(
            zero.resolved(),
            Err(vec![
                "defaultGpuMemory: `0Gi` is zero: a size must be more than 0".to_string()
            ])
        );
        // Both spellings as before, and the size kept as written for messages.
        let spec: PolicySpec =
            serde_json::from_str(r#"{"defaultGpuMemory": "24GiB", "gpuMemory": {"X": "22G"}}"#)
                .expect("shape");
        let p = spec.resolved().expect("valid");
        assert_eq!(p.default_gpu_memory, Bytes::gib(24));
        assert_eq!(p.default_gpu_memory_written.to_string(), "24GiB");
        assert_eq!(p.gpu_memory.get("X"), Some(&Bytes(22_000_000_000)));
        assert_eq!(
            Policy::default().default_gpu_memory_written.to_string(),
            "80Gi"
        );
    }

    #[test]
    fn builtin_gpu_table_applies_and_policy_entries_override_it() {
        let p = PolicySpec::default()
            .resolved()
            .expect("defaults are valid");
        assert_eq!(p.gpu_memory.get("NVIDIA-A10G"), Some(&Bytes::mib(22194)));
        assert_eq!(
            p.gpu_memory.get("NVIDIA-H100-80GB-HBM3"),
            Some(&Bytes::mib(81008))
        );
        let spec: PolicySpec =
            serde_json::from_str(r#"{"gpuMemory": {"NVIDIA-A10G": "20Gi", "Custom-GPU": "12Gi"}}"#)
                .expect("valid");
        let p = spec.resolved().expect("valid");
        assert_eq!(p.gpu_memory.get("NVIDIA-A10G"), Some(&Bytes::gib(20)));
        assert_eq!(p.gpu_memory.get("Custom-GPU"), Some(&Bytes::gib(12)));
        assert_eq!(p.gpu_memory.get("NVIDIA-L4"), Some(&Bytes::mib(22478)));
    }

    /// NVML's total less the driver's reservation, from the `nvidia-smi -q` figures cited in
    /// docs/webhook.md: (product, total MiB, reserved MiB). A table edit that drifts from the
    /// published figures fails here.
    #[test]
    fn builtin_figures_are_the_published_nvml_totals_less_the_reserved_memory() {
        let p = Policy::default();
        let published = [
            ("NVIDIA-H100-80GB-HBM3", 81559, 551),
            ("NVIDIA-H100-PCIe", 81559, 551),
            ("NVIDIA-H200", 143771, 700),
            ("NVIDIA-L40S", 46068, 685),
            ("NVIDIA-L4", 23034, 556),
            ("NVIDIA-RTX-6000-Ada-Generation", 49140, 569),
            ("NVIDIA-A100-SXM4-80GB", 81920, 834),
            // No published reservation: the largest seen (834 MiB) is taken off.
            ("NVIDIA-H100-NVL", 95830, 834),
            ("NVIDIA-B200", 183359, 834),
            ("NVIDIA-GH200-480GB", 97871, 834),
            ("NVIDIA-A10G", 23028, 834),
        ];
        for (product, total, reserved) in published {
            assert_eq!(
                p.gpu_memory.get(product),
                Some(&Bytes::mib(total - reserved)),
                "{product}"
            );
        }
        // rocm-smi's "VRAM Total Memory (B)": MI300X 205822885888, one MI250X GCD 68702699520.
        assert_eq!(
            p.gpu_memory.get("AMD_Instinct_MI300X_OAM"),
            Some(&Bytes(205_822_885_888))
        );
        assert_eq!(
            p.gpu_memory.get("AMD_Instinct_MI250X"),
            Some(&Bytes(68_702_699_520))
        );
        // Every entry is below the nominal size a product's name claims (a "1g.10gb" slice
        // has 9.5 GiB): no entry may promise more than the device has.
        for (product, bytes) in &p.gpu_memory {
            let nominal_gb = product
                .rsplit_once(".")
                .and_then(|(_, m)| m.strip_suffix("gb"))
                .and_then(|m| m.parse::<u64>().ok());
            if let Some(gb) = nominal_gb {
                assert!(bytes.0 <= (gb + 1) * (1 << 30), "{product}: {bytes}");
            }
        }
    }

    #[test]
    fn a_sidecar_interval_that_is_not_a_duration_is_refused_at_load() {
        let spec: PolicySpec = serde_json::from_str(r#"{"sidecar": {"interval": "10 parsecs"}}"#)
            .expect("the shape is valid: a string");
        let errors = spec.resolved().expect_err("the value is not");
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(
            errors[0].starts_with("sidecar.interval: \"10 parsecs\" is not a duration"),
            "{errors:?}"
        );
        let zero: PolicySpec =
            serde_json::from_str(r#"{"sidecar": {"interval": "0ms"}}"#).expect("shape");
        assert_eq!(
            zero.resolved(),
            Err(vec!["sidecar.interval: must be more than 0".to_string()])
        );
        let fine: PolicySpec =
            serde_json::from_str(r#"{"sidecar": {"interval": "1m30s"}}"#).expect("shape");
        let policy = fine.resolved().expect("valid");
        assert_eq!(policy.sidecar_interval, Duration::from_secs(90));
        assert!(
            policy
                .sidecar_env()
                .contains(&(env::SIDECAR_INTERVAL, "90s".into()))
        );
    }

    #[test]
    fn unknown_fields_are_rejected() {
        assert!(serde_json::from_str::<PolicySpec>(r#"{"safetyRatoi": 0.8}"#).is_err());
        assert!(serde_json::from_str::<PolicySpec>(r#"{"placement": "requried"}"#).is_err());
        let spec: PolicySpec = serde_json::from_str(r#"{"placement": "required"}"#).expect("valid");
        assert_eq!(
            spec.resolved().expect("valid").placement,
            PlacementMode::Required
        );
        assert_eq!(Policy::default().placement, PlacementMode::Preferred);
    }
}
