//! Reading a pod spec the way every part of memguard must agree on: [`TrainingPod::resolve`]
//! (the annotations, which container is the trainer, how many GPUs it asks for, which GPU
//! products the pod is pinned to, the device and its DRA claims, the accelerators, the memory
//! limit, the trainer's env), the opt-in check and Kubernetes resource quantities. The webhook
//! (at admission), `memguard estimate` and `memguard explain`, and the profile controller (after
//! the run) all decide from these answers, read once, so they live here once.
//!
//! Three parts: this file holds the pod core (the trainer, the resolution, the env);
//! `pod/trainer_launch.rs` finds the trainer's launch once and classifies its dialect;
//! `pod/launch.rs` reads the trainer's own launch and config file, with each knob's provenance;
//! `pod/accelerators.rs` holds what the pod asks of accelerators, the vendor and cloud tables and
//! the nodes it may use.

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

mod accelerators;
mod host_knobs;
mod launch;
mod trainer_launch;
pub use accelerators::*;
pub use host_knobs::{HOST_FLAGS, HostKnob, HostKnobs, HostRead};
pub use launch::*;
pub use trainer_launch::{Dialect, TrainerLaunch};

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
    /// The trainer's launch, found and classified once ([`TrainerLaunch::of`]): every reading of
    /// the command line below, and its rewrite, start from it.
    pub launch: TrainerLaunch,
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
    /// Knobs admission could not read that it plans on the value the trainer reported in a
    /// past run of the same profile, each with that provenance (`profile:trainer-report`).
    /// Empty from [`resolve`](Self::resolve): the decision stage fills it
    /// (`memguard_decide::reported`). Never written into the trainer's launch.
    pub reported: BTreeMap<Knob, String>,
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

impl<'a> TrainingPod<'a> {
    /// Reads `pod`: its training annotations (`memguard.io/model` looked up in the policy's
    /// models, then the built-in catalog), its trainer, its device (its DRA claims' driver read
    /// from `dra` when nothing else names one), its accelerators, memory limit and env.
    pub fn resolve(
        pod: &'a Pod,
        policy: &Policy,
        cluster: Cluster<'_>,
    ) -> Result<Self, ResolveError> {
        Self::resolve_launched(pod, TrainerLaunch::of_pod(pod), policy, cluster)
    }

    /// [`resolve`](Self::resolve), given the pod's launch already found
    /// ([`TrainerLaunch::of_pod`]: the webhook finds it once, to tell a server from a trainer).
    pub fn resolve_launched(
        pod: &'a Pod,
        launched: Option<(usize, TrainerLaunch)>,
        policy: &Policy,
        cluster: Cluster<'_>,
    ) -> Result<Self, ResolveError> {
        let empty = BTreeMap::new();
        let given = pod.metadata.annotations.as_ref().unwrap_or(&empty);
        let has_input = annotations::has_training_input(given);
        let mut file_read = None;
        // The trainer's launch, found once: with_file reads its knobs from the same value.
        let first = pod_trainer(pod).ok().map(|(index, trainer)| {
            let launch = match launched {
                Some((found_at, launch)) if found_at == index => launch,
                _ => TrainerLaunch::of(pod, trainer),
            };
            (index, trainer, launch)
        });
        // The model (and with it the method) from the trainer's launch, unless an annotation
        // names the model or its shape.
        let from_launch = if annotations::names_model(given) {
            Ok(None)
        } else {
            match &first {
                Some((index, trainer, launch)) => {
                    // Read once: the knobs come from the same file below.
                    let file = read_config_file(pod, trainer, launch, cluster);
                    let model = launch_or_file_model(pod, trainer, launch, cluster, &file);
                    file_read = Some((*index, file));
                    model
                }
                None => Ok(None),
            }
        };
        let launched = match from_launch {
            Ok(Some(m)) => Some(m),
            Ok(None) if has_input => None,
            Err(_) if has_input => None,
            Ok(None) => {
                let trainer = first
                    .as_ref()
                    .map(|(_, trainer, launch)| (*trainer, launch));
                return Err(ResolveError::NoTrainingInput(Some(unread_launch(trainer))));
            }
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
        let launch_read = first.map(|(index, _, launch)| (index, launch));
        let mut training = Self::with_file(
            pod,
            parsed,
            given.contains_key(annotations::WORLD_SIZE),
            policy,
            cluster,
            launch_read,
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
        Self::with_file(pod, parsed, world_size_given, policy, cluster, None, None)
    }

    /// [`with_annotations`](Self::with_annotations), given the launch already found for the
    /// container at that index ([`TrainerLaunch::of_pod`]).
    pub fn with_annotations_launched(
        pod: &'a Pod,
        parsed: TrainingAnnotations,
        world_size_given: bool,
        policy: &Policy,
        cluster: Cluster<'_>,
        launched: Option<(usize, TrainerLaunch)>,
    ) -> Result<Self, ResolveError> {
        Self::with_file(
            pod,
            parsed,
            world_size_given,
            policy,
            cluster,
            launched,
            None,
        )
    }

    /// [`with_annotations`](Self::with_annotations), given the launch found and the config
    /// file already read for the container at that index (or `None`: read them here).
    fn with_file(
        pod: &'a Pod,
        parsed: TrainingAnnotations,
        world_size_given: bool,
        policy: &Policy,
        cluster: Cluster<'_>,
        launch_read: Option<(usize, TrainerLaunch)>,
        file_read: Option<(usize, Result<Option<ConfigFileReading>, String>)>,
    ) -> Result<Self, ResolveError> {
        let containers = pod
            .spec
            .as_ref()
            .map(|s| s.containers.as_slice())
            .unwrap_or_default();
        let (trainer_index, trainer) =
            pick_trainer(containers, parsed.container.as_deref()).map_err(ResolveError::Trainer)?;
        let launch = match launch_read {
            Some((index, launch)) if index == trainer_index => launch,
            _ => TrainerLaunch::of(pod, trainer),
        };
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
        } = read_mapped_env(&launch, trainer, &parsed, policy, &mut config);
        let (args, args_unreadable) = match read_args(
            pod,
            trainer,
            &launch,
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
            _ => read_config_file(pod, trainer, &launch, cluster),
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
            if let Some((n, source)) = crate::job_world::read(launch.launch(), trainer, gpus) {
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
            launch,
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
            reported: BTreeMap::new(),
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
    launch: &TrainerLaunch,
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
    let earlier = &launch.earlier;
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

    /// Resolving a pod searches the trainer's command line for its launch once
    /// ([`TrainerLaunch::of`]), whichever readers ask (the model, the knobs, the config file,
    /// the world size) and whichever dialect it is.
    #[test]
    fn resolving_a_pod_searches_its_command_line_once() {
        let cases: [&[&str]; 3] = [
            &[
                "torchrun",
                "--nproc_per_node",
                "2",
                "train.py",
                "--model_name_or_path",
                "Qwen/Qwen2.5-7B",
                "--per_device_train_batch_size",
                "4",
            ],
            &[
                "tune",
                "run",
                "lora_finetune_single_device",
                "--config",
                "llama3_1/8B_lora_single_device",
            ],
            &[
                "swift",
                "sft",
                "--model",
                "Qwen/Qwen2.5-7B",
                "--train_type",
                "lora",
            ],
        ];
        for args in cases {
            let p = pod(&[], vec![launching(args)]);
            crate::launch::launcher::SEARCHES.with(|n| n.set(0));
            let training = resolve(&p).expect("resolves");
            assert!(training.launch.found.is_ok(), "{args:?}");
            let searches = crate::launch::launcher::SEARCHES.with(|n| n.get());
            assert_eq!(searches, 1, "{args:?}");
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
