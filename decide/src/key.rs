//! The profile key of a pod, and the `MemoryProfile` object name it maps to.
//!
//! The key is computed from the pod's *spec* alone (annotations, resources, node selector and
//! affinity), never from where it ran: the webhook must find the same profile at admission,
//! before the pod has a node, that the controller wrote after it finished. A pod whose model
//! admission cannot read (Guarded) is keyed by its launch instead ([`launch_key`]).

use k8s_openapi::api::core::v1::Pod;
use memguard_api::Cluster;
use memguard_api::Policy;
use memguard_api::crd::{DeviceClass, MemoryProfileSpec};
use memguard_api::pod::{ResolveError, TrainingPod};
use memguard_estimator::params::total_params;
use memguard_estimator::{Device, TrainingConfig};

/// Longest Kubernetes object name we produce (a DNS-1123 label).
pub const MAX_NAME_LEN: usize = 63;
/// `device` of a GPU pod not pinned to exactly one GPU product.
pub const ANY_GPU: &str = "gpu";
/// `device` of a CPU (or Metal) pod.
pub const CPU: &str = "cpu";

/// Why a pod has no profile key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The training annotations are missing or do not parse (the webhook skipped this pod too).
    #[error("training annotations: {0}")]
    Annotations(String),
    /// `memguard.io/container` names no container, or the pod has none.
    #[error("{0}")]
    Trainer(String),
}

impl From<ResolveError> for KeyError {
    fn from(e: ResolveError) -> Self {
        match e {
            ResolveError::Trainer(why) => KeyError::Trainer(why),
            other => KeyError::Annotations(other.to_string()),
        }
    }
}

/// What the webhook and the controller both derive from a pod's spec.
#[derive(Debug, Clone, PartialEq)]
pub struct PodKey {
    /// The profile key.
    pub spec: MemoryProfileSpec,
    /// The `MemoryProfile` object name ([`object_name`] of `spec`).
    pub name: String,
    /// The training config as the webhook resolves it ([`TrainingPod::resolve`]).
    pub config: TrainingConfig,
    /// Name of the trainer container.
    pub trainer: String,
}

/// The profile key of `pod` ([`PodKey::of`] its [`TrainingPod`]), resolved as the webhook did at
/// admission: its model looked up in the `policy`'s models, then the built-in catalog; its DRA
/// claims read from `dra` (the device their driver runs keys a pod that names no other).
pub fn pod_key(pod: &Pod, policy: &Policy, cluster: Cluster<'_>) -> Result<PodKey, KeyError> {
    Ok(PodKey::of(&TrainingPod::resolve(pod, policy, cluster)?))
}

impl PodKey {
    /// The profile key of a resolved pod: model (its name or shape key), method, precision,
    /// device class and device (the one GPU product the pod is pinned to, [`ANY_GPU`], or
    /// [`CPU`]).
    pub fn of(training: &TrainingPod) -> PodKey {
        let config = &training.config;
        let (device_class, device) = match config.device {
            Device::Cuda | Device::Rocm => {
                let device = match training.gpu_products.as_slice() {
                    [one] => one.clone(),
                    _ => ANY_GPU.to_string(),
                };
                (DeviceClass::Gpu, device)
            }
            Device::Cpu | Device::Metal => (DeviceClass::Cpu, CPU.to_string()),
        };
        let spec = MemoryProfileSpec {
            model: model_key(config),
            method: config.method.name().to_string(),
            precision: config.precision.name().to_string(),
            device_class,
            device,
        };
        PodKey {
            name: object_name(&spec),
            spec,
            config: config.clone(),
            trainer: training.trainer.name.clone(),
        }
    }
}

/// The model's name (a policy model's or a built-in one's), or `shape-<params>-<layers>x<hidden>`
/// for a model given by its shape
/// (`shape-7e9-32x4096`).
pub fn model_key(cfg: &TrainingConfig) -> String {
    if let Some(name) = &cfg.model.name {
        return name.clone();
    }
    let m = &cfg.model;
    let params = m.params.unwrap_or_else(|| total_params(m));
    format!(
        "shape-{}-{}x{}",
        compact_count(params),
        m.num_layers,
        m.hidden_size
    )
}

/// The model part of the key of a pod whose model admission cannot read
/// ([`launch_key`]): `launch-` and 16 hex digits.
pub const LAUNCH_PREFIX: &str = "launch-";
/// The method and precision of a [`launch_key`]: admission did not read them (the trainer's
/// report says them, and is kept in the profile).
pub const NOT_READ: &str = "unread";

/// The profile key of a pod whose model admission cannot read (a Guarded pod): computed from
/// the pod's spec alone, so the webhook and the controller find the same profile.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchKey {
    /// The profile key: model `launch-<hash>`, method and precision [`NOT_READ`], the device
    /// as [`PodKey::of`] keys it from the pod's resources.
    pub spec: MemoryProfileSpec,
    /// The `MemoryProfile` object name ([`object_name`] of `spec`).
    pub name: String,
    /// Name of the trainer container.
    pub trainer: String,
    /// What the hash is taken over, one line each (`image=…`, `command=…`, `args=…`,
    /// `configmap=…`, `env=NAME=value`), for `memguard explain`.
    pub identity: Vec<String>,
}

/// The [`LaunchKey`] of `pod`: a stable hash (FNV-1a, 64 bits) of what identifies its
/// trainer's launch, the same for every pod of one job and different for another job:
///
/// - the trainer's image, `command` and `args` (a job's script, its flags, its config file's
///   path);
/// - the names of the ConfigMaps the trainer reads (mounted volumes, projected sources,
///   `envFrom`, `valueFrom`): the JSON or YAML a job ships its settings in;
/// - its literal env, except what memguard itself writes into a trainer (`MEMGUARD_*`,
///   `PYTHONPATH`, `PYTORCH_CUDA_ALLOC_CONF`, the knob variables of the policy's `envNames`
///   and of `memguard.io/env-map`): a planned pod keeps the key of the pod it was.
///
/// Not in it: the pod's name, labels and node (they differ from pod to pod of one job), and
/// the ConfigMaps' contents (not part of the spec: an edited config keeps its key, and the
/// next report replaces the profile's).
pub fn launch_key(pod: &Pod, policy: &Policy) -> Result<LaunchKey, KeyError> {
    let (_, trainer) = memguard_api::pod::pod_trainer(pod).map_err(KeyError::Trainer)?;
    let identity = launch_identity(pod, trainer, policy);
    let hash = fnv1a(identity.join("\n").as_bytes());
    let (device_class, device) =
        match memguard_api::pod::Accelerators::of(pod, trainer).default_device(pod) {
            Device::Cuda => match memguard_api::pod::gpu_products(pod).as_slice() {
                [one] => (DeviceClass::Gpu, one.clone()),
                _ => (DeviceClass::Gpu, ANY_GPU.to_string()),
            },
            Device::Rocm => (DeviceClass::Gpu, ANY_GPU.to_string()),
            Device::Cpu | Device::Metal => (DeviceClass::Cpu, CPU.to_string()),
        };
    let spec = MemoryProfileSpec {
        model: format!("{LAUNCH_PREFIX}{hash:016x}"),
        method: NOT_READ.to_string(),
        precision: NOT_READ.to_string(),
        device_class,
        device,
    };
    Ok(LaunchKey {
        name: object_name(&spec),
        spec,
        trainer: trainer.name.clone(),
        identity,
    })
}

/// The lines [`launch_key`] hashes, in a fixed order.
fn launch_identity(
    pod: &Pod,
    trainer: &k8s_openapi::api::core::v1::Container,
    policy: &Policy,
) -> Vec<String> {
    // Each word with its length first: `["a b"]` and `["a", "b"]` stay apart.
    let json = |v: &Option<Vec<String>>| match v {
        None => "none".to_string(),
        Some(words) => words
            .iter()
            .map(|w| format!("{}:{w}", w.len()))
            .collect::<Vec<_>>()
            .join(" "),
    };
    let mut lines = vec![
        format!("image={}", trainer.image.as_deref().unwrap_or_default()),
        format!("command={}", json(&trainer.command)),
        format!("args={}", json(&trainer.args)),
    ];
    let mut maps = std::collections::BTreeSet::new();
    let volumes = pod
        .spec
        .as_ref()
        .and_then(|s| s.volumes.as_ref())
        .map(Vec::as_slice)
        .unwrap_or_default();
    for mount in trainer.volume_mounts.iter().flatten() {
        let Some(volume) = volumes.iter().find(|v| v.name == mount.name) else {
            continue;
        };
        if let Some(cm) = &volume.config_map {
            maps.insert(cm.name.clone());
        }
        let projected = volume.projected.as_ref().and_then(|p| p.sources.as_ref());
        for source in projected.into_iter().flatten() {
            if let Some(cm) = &source.config_map {
                maps.insert(cm.name.clone());
            }
        }
    }
    for from in trainer.env_from.iter().flatten() {
        if let Some(cm) = &from.config_map_ref {
            maps.insert(cm.name.clone());
        }
    }
    for var in trainer.env.iter().flatten() {
        if let Some(cm) = var
            .value_from
            .as_ref()
            .and_then(|f| f.config_map_key_ref.as_ref())
        {
            maps.insert(cm.name.clone());
        }
    }
    lines.extend(maps.into_iter().map(|m| format!("configmap={m}")));
    let env_map = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(memguard_api::annotations::ENV_MAP))
        .cloned()
        .unwrap_or_default();
    let written_by_memguard = |name: &str| {
        name.starts_with("MEMGUARD_")
            || name == "PYTHONPATH"
            || name == crate::decision::ALLOC_CONF
            || policy.env_names.values().any(|v| v == name)
            || env_map
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .any(|word| word == name)
    };
    lines.extend(
        memguard_api::pod::literal_env(trainer)
            .into_iter()
            .filter(|(name, _)| !written_by_memguard(name))
            .map(|(name, value)| format!("env={name}={value}")),
    );
    lines
}

/// `7000000000` → `7e9`; a count without three trailing zeros stays as it is.
fn compact_count(n: u64) -> String {
    if n == 0 {
        return "0".into();
    }
    let (mut mantissa, mut exp) = (n, 0u32);
    while mantissa.is_multiple_of(10) {
        mantissa /= 10;
        exp += 1;
    }
    if exp >= 3 {
        format!("{mantissa}e{exp}")
    } else {
        n.to_string()
    }
}

/// The object name of a profile: `<model>-<method>-<precision>-<device>`, lower-cased, every
/// run of characters outside `[a-z0-9]` turned into one `-`. When that loses information
/// (upper case, other characters) or exceeds [`MAX_NAME_LEN`], the name is cut to leave room
/// and ends in `-` plus 8 hex digits of a stable hash (FNV-1a) of the exact key, so two keys
/// that sanitize alike still get two profiles.
pub fn object_name(spec: &MemoryProfileSpec) -> String {
    let raw = format!(
        "{}-{}-{}-{}",
        spec.model, spec.method, spec.precision, spec.device
    );
    let mut clean = String::with_capacity(raw.len());
    for c in raw.chars().map(|c| c.to_ascii_lowercase()) {
        if c.is_ascii_lowercase() || c.is_ascii_digit() {
            clean.push(c);
        } else if !clean.is_empty() && !clean.ends_with('-') {
            clean.push('-');
        }
    }
    let clean = clean.trim_end_matches('-').to_string();
    if clean == raw && clean.len() <= MAX_NAME_LEN {
        return clean;
    }
    let hash = format!("{:08x}", fnv1a(raw.as_bytes()) as u32);
    let room = MAX_NAME_LEN - hash.len() - 1;
    let head: String = clean.chars().take(room).collect();
    let head = head.trim_end_matches('-');
    if head.is_empty() {
        format!("p-{hash}")
    } else {
        format!("{head}-{hash}")
    }
}

/// FNV-1a, 64 bits: small, stable across releases and platforms (unlike `DefaultHasher`).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::PodBuilder;
    use memguard_api::wellknown;

    fn spec(model: &str, method: &str, precision: &str, device: &str) -> MemoryProfileSpec {
        MemoryProfileSpec {
            model: model.into(),
            method: method.into(),
            precision: precision.into(),
            device_class: if device == CPU {
                DeviceClass::Cpu
            } else {
                DeviceClass::Gpu
            },
            device: device.into(),
        }
    }

    #[test]
    fn keys_a_pod_by_model_method_precision_and_device() {
        // (name, pod, expected key)
        let table = [
            (
                "catalog model on one pinned GPU product",
                PodBuilder::trainer()
                    .annotate("model", "llama-3-8b")
                    .annotate("method", "lora")
                    .gpus(1)
                    .node_selector(wellknown::NVIDIA_GPU_PRODUCT_LABEL, "NVIDIA-A100-SXM4-80GB"),
                spec("llama-3-8b", "lora", "bf16-mixed", "NVIDIA-A100-SXM4-80GB"),
            ),
            (
                "GPU without a product: any GPU",
                PodBuilder::trainer()
                    .annotate("model", "llama-3-8b")
                    .gpus(2),
                spec("llama-3-8b", "full", "bf16-mixed", ANY_GPU),
            ),
            (
                "no GPU: CPU, whatever the precision",
                PodBuilder::trainer()
                    .annotate("model", "llama-3-8b")
                    .annotate("precision", "fp32"),
                spec("llama-3-8b", "full", "fp32", CPU),
            ),
            (
                "shape instead of a catalog name",
                PodBuilder::trainer()
                    .annotate("model-params", "7e9")
                    .annotate("hidden-size", "4096")
                    .annotate("num-layers", "32")
                    .annotate("num-heads", "32")
                    .annotate("vocab-size", "32000")
                    .gpus(1),
                spec("shape-7e9-32x4096", "full", "bf16-mixed", ANY_GPU),
            ),
        ];
        for (name, pod, want) in table {
            let key = pod_key(&pod.build(), &Policy::default(), Cluster::default())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(key.spec, want, "{name}");
            assert_eq!(key.name, object_name(&want), "{name}");
        }
    }

    /// A GPU known only through a DRA claim keys the pod as admission keys it: the device the
    /// claim's driver runs, read from the same DRA objects. Without them it is a CPU pod.
    #[test]
    fn a_dra_only_gpu_pod_is_keyed_by_its_claims_device() {
        use k8s_openapi::api::core::v1::PodResourceClaim;
        use memguard_api::dra::{DraCatalog, StaticCatalog};
        let catalog = StaticCatalog::from_yaml(include_str!(
            "../../webhook/tests/fixtures/dra/objects.yaml"
        ))
        .expect("fixture objects");
        let mut pod = PodBuilder::trainer()
            .annotate("model", "llama-3-8b")
            .build();
        if let Some(spec) = pod.spec.as_mut() {
            spec.resource_claims = Some(vec![PodResourceClaim {
                name: "gpu".into(),
                resource_claim_template_name: Some("single-h100".into()),
                ..PodResourceClaim::default()
            }]);
        }
        let policy = Policy::default();
        let with = pod_key(
            &pod,
            &policy,
            Cluster::with_dra(Some(&catalog as &dyn DraCatalog)),
        )
        .expect("a key");
        assert_eq!(with.spec, spec("llama-3-8b", "full", "bf16-mixed", ANY_GPU));
        assert_eq!(with.config.device, Device::Cuda);
        let without = pod_key(&pod, &policy, Cluster::default()).expect("a key");
        assert_eq!(without.spec, spec("llama-3-8b", "full", "bf16-mixed", CPU));
    }

    #[test]
    fn a_pod_with_bad_annotations_or_no_container_has_no_key() {
        let bad = PodBuilder::trainer()
            .annotate("model", "no-such-model")
            .build();
        assert!(matches!(
            pod_key(&bad, &Policy::default(), Cluster::default()),
            Err(KeyError::Annotations(_))
        ));
        let wrong = PodBuilder::trainer()
            .annotate("model", "llama-3-8b")
            .annotate("container", "nope")
            .build();
        assert!(matches!(
            pod_key(&wrong, &Policy::default(), Cluster::default()),
            Err(KeyError::Trainer(_))
        ));
    }

    /// The controller keys a pod on the policy's model as the webhook did at admission; without
    /// the policy's models the pod has no key (the webhook skipped it too).
    #[test]
    fn a_policy_model_is_keyed_by_its_policy_name_whatever_spelling_the_pod_used() {
        let config: serde_json::Value = serde_json::from_str(include_str!(
            "../../api/fixtures/hf-config/qwen2.5-coder-7b-instruct.json"
        ))
        .expect("fixture");
        let spec: memguard_api::PolicySpec = serde_json::from_value(serde_json::json!({
            "models": [{"name": "acme-coder-7b", "aliases": ["Qwen/Qwen2.5-Coder-7B-Instruct"],
                        "config": config}],
        }))
        .expect("a policy");
        let policy = spec.resolved().expect("valid");
        for spelling in ["acme-coder-7b", "qwen/qwen2.5-coder-7b-instruct"] {
            let pod = PodBuilder::trainer()
                .annotate("model", spelling)
                .annotate("method", "lora")
                .gpus(1)
                .build();
            let key = pod_key(&pod, &policy, Cluster::default()).expect("a key");
            assert_eq!(key.spec.model, "acme-coder-7b", "{spelling}");
            assert!(
                matches!(
                    pod_key(&pod, &Policy::default(), Cluster::default()),
                    Err(KeyError::Annotations(_))
                ),
                "{spelling}"
            );
        }
    }

    #[test]
    fn object_names_are_dns_labels_and_distinct_for_distinct_keys() {
        let long = "m".repeat(80);
        // (name, key, expected object name; `None`: only check the shape)
        let table: [(&str, MemoryProfileSpec, Option<&str>); 4] = [
            (
                "already clean: kept as is",
                spec("llama-3-8b", "lora", "bf16", CPU),
                Some("llama-3-8b-lora-bf16-cpu"),
            ),
            (
                "upper case and dots: sanitized, hash added",
                spec("llama-3-8b", "lora", "bf16-mixed", "NVIDIA-A100-SXM4-80GB"),
                None,
            ),
            (
                "too long: cut, hash added",
                spec(&long, "lora", "bf16", CPU),
                None,
            ),
            ("nothing usable", spec("___", "", "", ""), None),
        ];
        for (name, key, want) in table {
            let got = object_name(&key);
            assert!(got.len() <= MAX_NAME_LEN, "{name}: {got}");
            assert!(
                got.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "{name}: {got}"
            );
            assert!(
                got.starts_with(|c: char| c.is_ascii_alphanumeric())
                    && got.ends_with(|c: char| c.is_ascii_alphanumeric()),
                "{name}: {got}"
            );
            if let Some(want) = want {
                assert_eq!(got, want, "{name}");
            }
            assert_eq!(got, object_name(&key), "{name}: stable");
        }
        let upper = spec("m", "lora", "bf16", "A100");
        let lower = spec("m", "lora", "bf16", "a100");
        assert_ne!(object_name(&upper), object_name(&lower));
        assert_eq!(object_name(&lower), "m-lora-bf16-a100");
        // Upper case is lower-cased, not dropped: an A100 80GB names itself.
        let a100 = object_name(&spec(
            "llama-3-8b",
            "lora",
            "bf16-mixed",
            "NVIDIA-A100-SXM4-80GB",
        ));
        assert!(
            a100.starts_with("llama-3-8b-lora-bf16-mixed-nvidia-a100-sxm4-80gb-"),
            "{a100}"
        );
    }

    #[test]
    fn counts_are_compacted_only_when_exact() {
        assert_eq!(compact_count(7_000_000_000), "7e9");
        assert_eq!(compact_count(125_000_000), "125e6");
        assert_eq!(compact_count(6_738_415_616), "6738415616");
        assert_eq!(compact_count(1_500), "1500");
    }
}
