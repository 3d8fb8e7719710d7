//! The host plan of a GPU pod: its host memory ([`memguard_estimator::host_estimate`]) planned
//! against the trainer's `limits.memory`, as the GPU plan is against the GPU budget. Pure.
//!
//! The limit is the trainer container's own: Kubernetes gives each container its own memory
//! cgroup, and the ranks, their DataLoader workers and the launcher all run in the trainer's,
//! so its limit is the one that OOM-kills them, whatever the other containers hold.
//!
//! A knob memguard did not read is unknown: the figure is then a range (each unknown at its
//! smallest, and at its largest where it has one), the pod "fits" only when the largest does,
//! and "does not fit" only when the smallest does not. Rewrites, cheapest first, touch only
//! knobs whose value was read and whose flag the parser accepts; none changes the batch.

use memguard_api::TrainingPod;
use memguard_api::phase::TrainerPhase;
use memguard_api::pod::{HOST_FLAGS, HostKnob, HostKnobs};
use memguard_estimator::{
    Bytes, Component, Device, HostConfig, HostEstimate, Method, Offload, Optimizer, Precision,
    SaveMode, TrainingConfig, host_estimate, params,
};
use std::collections::BTreeMap;

/// The host memory of `cfg`'s pod with `ranks` ranks, from the training config alone: the
/// model, its state and optimizer bytes, one micro-batch, what is offloaded. The loading, input
/// and save knobs are left at [`HostConfig::new`]'s values for the caller to set from what it
/// read (`memguard estimate`'s flags, the webhook's launch).
pub fn training_host_config(cfg: &TrainingConfig, ranks: u32) -> HostConfig {
    let world = u32::try_from(cfg.world_size.max(1)).unwrap_or(u32::MAX);
    // Full-precision state under fp32 and mixed precision (master weights), 16-bit otherwise.
    let state = match cfg.precision {
        Precision::Bf16 | Precision::Fp16 => 2.0,
        Precision::Fp32 | Precision::Bf16Mixed | Precision::Fp16Mixed => 4.0,
    };
    let optimizer = match cfg.optimizer {
        Optimizer::AdamW | Optimizer::Adam => 2.0 * state,
        Optimizer::SgdMomentum => state,
        Optimizer::AdamW8bit | Optimizer::AdamW8bitTorchao => 2.0,
        Optimizer::Sgd | Optimizer::Adafactor => 0.0,
    };
    let params = cfg
        .model
        .params
        .unwrap_or_else(|| params::total_params(&cfg.model)) as f64;
    let mut host = HostConfig::new(params, 2.0);
    host.ranks_in_pod = ranks.max(1);
    host.world_size = world.max(host.ranks_in_pod);
    // input_ids, labels and attention_mask, int64, as a tokenised causal-LM batch.
    host.batch_bytes = Bytes::from_f64((cfg.batch_size * cfg.seq_length) as f64 * 3.0 * 8.0);
    // A GPU job's state is copied into host memory to be written.
    host.state_on_host = false;
    host.state_bytes_per_param = state;
    host.optimizer_bytes_per_param = if cfg.method != Method::Full {
        0.0
    } else {
        optimizer
    };
    host.offload = if cfg.optimizer_offload {
        Offload::Optimizer
    } else if cfg.activation_offload {
        Offload::Activations(offloaded_activations(cfg, host.ranks_in_pod))
    } else {
        Offload::None
    };
    host
}

/// The saved activations of the pod's ranks, as the GPU estimate counts them without
/// offloading: what activation offloading moves to the host.
fn offloaded_activations(cfg: &TrainingConfig, ranks: u32) -> Bytes {
    let mut on_device = cfg.clone();
    on_device.activation_offload = false;
    memguard_estimator::estimate(&on_device)
        .map(|e| Bytes::from_f64(e.component(Component::Activations).as_f64() * f64::from(ranks)))
        .unwrap_or(Bytes::ZERO)
}

/// Whether a pod on `device` has a host figure beside its GPU figure (on a CPU or unified
/// memory the estimate itself is the host's).
pub fn applies(device: Device) -> bool {
    matches!(device, Device::Cuda | Device::Rocm)
}

/// One rewrite of a host knob, in the trainer's flag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostRewrite {
    /// The knob.
    pub knob: HostKnob,
    /// Its `TrainingArguments` flag (`dataloader_num_workers`).
    pub flag: &'static str,
    /// Its value before, as the flag spells it.
    pub from: String,
    /// Its value after.
    pub to: String,
}

/// The host plan of one pod.
#[derive(Debug, Clone, PartialEq)]
pub struct HostPlan {
    /// Ranks in the pod.
    pub ranks: u32,
    /// The planned pod, every unknown at its smallest.
    pub config: HostConfig,
    /// Its host memory: at least this.
    pub estimate: HostEstimate,
    /// The peak with every unknown at its largest, where each has one; `None` while an
    /// unknown has no bound (a worker count). Equal to the estimate's peak when nothing is
    /// unknown.
    pub most: Option<Bytes>,
    /// The trainer's `limits.memory`.
    pub limit: Option<Bytes>,
    /// `Some(true)`: fits whatever the unknowns; `Some(false)`: over whatever they are;
    /// `None`: no limit, or the unknowns decide.
    pub fits: Option<bool>,
    /// The rewrites that bring the pod into its limit, cheapest first (none when nothing does).
    pub rewrites: Vec<HostRewrite>,
    /// Where each host knob came from.
    pub sources: BTreeMap<String, String>,
    /// The host knobs not read, with what would say each.
    pub unknown: BTreeMap<String, String>,
    /// "host memory cannot fit: …, set limits.memory ≥ …", when nothing fits.
    pub verdict: Option<String>,
    /// What the admission should say (no limit; the unknowns decide; the rewrites).
    pub warning: Option<String>,
    /// What the plan did about the profile's last OOM kill, when it came at `load` or `save`
    /// ([`plan_host_after`]).
    pub after_kill: Option<String>,
}

/// Every host config `knobs` allows over `base`: each read knob at its value, each unknown
/// with a bound at each of its values (the checkpoint's and the load's dtype interact: an fp32
/// load copies a bf16 checkpoint and maps an fp32 one), each unknown without one (workers,
/// their prefetch) at its smallest.
fn configs(base: &HostConfig, knobs: &HostKnobs) -> Vec<HostConfig> {
    let checkpoints: Vec<f64> = match &knobs.checkpoint_bytes_per_param {
        Some(r) => vec![r.value],
        None => vec![2.0, 4.0],
    };
    let loads: Vec<Option<f64>> = match &knobs.load_bytes_per_param {
        Some(r) => vec![r.value],
        None => vec![None, Some(2.0), Some(4.0)],
    };
    let pins: Vec<bool> = match &knobs.pin_memory {
        Some(r) => vec![r.value],
        None => vec![false, true],
    };
    let saves: Vec<SaveMode> = match &knobs.save {
        Some(r) => vec![r.value],
        None => SaveMode::ALL.to_vec(),
    };
    // RAM-efficient loading lowers nothing at load under transformers 5 (every rank reads the
    // files; `memguard_api::coupled::INERT_AT_LOAD`): whatever it is, every rank loads.
    let ram_efficient: Vec<bool> = match &knobs.ram_efficient_loading {
        Some(r) => vec![r.value],
        None => vec![false],
    };
    // A sharding config's offload adds to what the training config offloads (activations).
    let offloads: Vec<Offload> = match &knobs.offload {
        Some(r) if r.value == Offload::None => vec![base.offload],
        Some(r) => vec![r.value],
        None => vec![
            base.offload,
            Offload::Optimizer,
            Offload::ParamsAndOptimizer,
        ],
    };
    let mut out = Vec::new();
    for &checkpoint in &checkpoints {
        for &load in &loads {
            for &pin in &pins {
                for &save in &saves {
                    for &ram in &ram_efficient {
                        for &offload in &offloads {
                            let mut host = base.clone();
                            host.checkpoint_bytes_per_param = checkpoint;
                            host.load_bytes_per_param = load;
                            host.pin_memory = pin;
                            host.save = save;
                            host.ram_efficient_loading = ram;
                            host.offload = offload;
                            host.dataloader_workers = knobs.workers.as_ref().map_or(0, |r| r.value);
                            host.prefetch_factor =
                                knobs.prefetch_factor.as_ref().map_or(1, |r| r.value);
                            out.push(host);
                        }
                    }
                }
            }
        }
    }
    out
}

/// Whether an unknown knob leaves the largest figure without a bound: the worker count, or
/// the prefetch of workers that run.
fn unbounded(knobs: &HostKnobs) -> bool {
    match &knobs.workers {
        None => true,
        Some(r) => r.value > 0 && knobs.prefetch_factor.is_none(),
    }
}

/// The smallest pod `knobs` allow, its host memory, and the largest peak where bounded.
fn peaks(base: &HostConfig, knobs: &HostKnobs) -> (HostConfig, HostEstimate, Option<Bytes>) {
    let mut least: Option<(HostConfig, HostEstimate)> = None;
    let mut most = Bytes::ZERO;
    for host in configs(base, knobs) {
        let estimate = host_estimate(&host);
        most = most.max(estimate.peak);
        if least.as_ref().is_none_or(|(_, e)| estimate.peak < e.peak) {
            least = Some((host, estimate));
        }
    }
    let (config, estimate) = least.unwrap_or_else(|| {
        let host = base.clone();
        let estimate = host_estimate(&host);
        (host, estimate)
    });
    (config, estimate, (!unbounded(knobs)).then_some(most))
}

/// `bytes` rounded up to whole GiB, as a Kubernetes quantity.
pub fn gib_quantity(bytes: Bytes) -> String {
    const GIB: u64 = 1 << 30;
    format!("{}Gi", bytes.0.div_ceil(GIB))
}

/// The host plan of `training`'s pod for the GPU config `planned` (the GPU plan's: its batch
/// is what the DataLoader yields), with the host knobs `knobs` read from its launch; `None`
/// for a pod that is not on GPUs.
pub fn plan_host(
    training: &TrainingPod,
    planned: &TrainingConfig,
    knobs: &HostKnobs,
) -> Option<HostPlan> {
    plan_host_after(training, planned, knobs, None)
}

/// [`plan_host`], accounting for the profile's last OOM kill when it came in `last_kill`
/// ([`plan_after_kill`]).
pub fn plan_host_after(
    training: &TrainingPod,
    planned: &TrainingConfig,
    knobs: &HostKnobs,
    last_kill: Option<TrainerPhase>,
) -> Option<HostPlan> {
    if !applies(training.config.device) {
        return None;
    }
    let ranks = match u32::try_from(training.gpus).unwrap_or(u32::MAX) {
        0 => u32::try_from(planned.world_size.max(1)).unwrap_or(u32::MAX),
        n => n,
    };
    let base = training_host_config(planned, ranks);
    Some(plan_after_kill(
        base,
        knobs,
        training.memory_limit,
        last_kill,
    ))
}

/// The host plan when the profile's last OOM kill came in `phase` (issue 39): a kill proves
/// the host figure wrong for that phase, whatever the estimate said.
///
/// - `save`: the save is cut even when the estimate said it fit: a launch whose checkpoints
///   carry the optimizer (`--save_only_model` read as false, and writable) gets model-only
///   checkpoints, the cheapest cut of the save spike; a launch that cannot be rewritten so is
///   told to raise its limit.
/// - `load`: nothing that lowers the load is safe to rewrite (the load dtype changes what
///   trains, [`dtype_suggestion`]; FSDP's `cpu_ram_efficient_loading` lowers nothing under
///   transformers 5), so the plan claims no host verdict (`fits` is `null`), says to raise the
///   limit, and names the dtype as the user's choice where the launch loads in fp32.
/// - `step`, or no phase: the GPU plan and the recovery answer it; the host plan is unchanged.
pub fn plan_after_kill(
    base: HostConfig,
    knobs: &HostKnobs,
    limit: Option<Bytes>,
    phase: Option<TrainerPhase>,
) -> HostPlan {
    let limit_said = limit.map_or_else(
        || "no limits.memory".to_string(),
        |l| format!("limits.memory {l}"),
    );
    match phase {
        Some(TrainerPhase::Save) => {
            let plan = plan_against(base.clone(), knobs, limit);
            if plan.rewrites.iter().any(|r| r.knob == HostKnob::Save) {
                return HostPlan {
                    after_kill: Some(format!(
                        "memguard: last OOM kill was while saving: checkpoints made model-only \
                         ({limit_said})"
                    )),
                    ..plan
                };
            }
            let Some(step) = candidates(knobs)
                .into_iter()
                .find(|s| s.rewrite.knob == HostKnob::Save)
            else {
                return HostPlan {
                    after_kill: Some(format!(
                        "memguard: last OOM kill was while saving, and the save cannot be \
                         rewritten: raise {limit_said} (save {})",
                        plan.estimate.save
                    )),
                    ..plan
                };
            };
            let mut cut = knobs.clone();
            step.apply(&mut cut);
            let mut plan = plan_against(base, &cut, limit);
            plan.after_kill = Some(format!(
                "memguard: last OOM kill was while saving: --{} {}→{} (model-only \
                 checkpoints, save {})",
                step.rewrite.flag, step.rewrite.from, step.rewrite.to, plan.estimate.save
            ));
            plan.rewrites.insert(0, step.rewrite);
            plan
        }
        Some(TrainerPhase::Load) => {
            let mut plan = plan_against(base, knobs, limit);
            if plan.fits == Some(true) {
                plan.fits = None;
            }
            // Admission warnings are cut at 120 characters: the dtype in a few words.
            let suggestion = dtype_suggestion(knobs)
                .map(|_| "; bf16 --dtype: less, changes numerics")
                .unwrap_or_default();
            plan.after_kill = Some(format!(
                "memguard: last OOM kill while loading (load {}): raise limits.memory{suggestion}",
                plan.estimate.load
            ));
            plan
        }
        Some(TrainerPhase::Step) | None => plan_against(base, knobs, limit),
    }
}

/// The host plan of `base` with `knobs` against `limit` ([`plan_host`] once the pod is read).
pub fn plan_against(base: HostConfig, knobs: &HostKnobs, limit: Option<Bytes>) -> HostPlan {
    let ranks = base.ranks_in_pod;
    let (config, estimate, most) = peaks(&base, knobs);
    let unknown: BTreeMap<String, String> = knobs
        .unknown
        .iter()
        .map(|(k, why)| (k.name().to_string(), why.clone()))
        .collect();
    let depends = || {
        knobs
            .unknown
            .keys()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut plan = HostPlan {
        ranks,
        config,
        estimate,
        most,
        limit,
        fits: None,
        rewrites: Vec::new(),
        sources: knobs.sources(),
        unknown,
        verdict: None,
        warning: None,
        after_kill: None,
    };
    let figure = |least: Bytes, most: Option<Bytes>, unknowns: bool| match (most, unknowns) {
        (_, false) => least.to_string(),
        (Some(most), true) if most == least => least.to_string(),
        (Some(most), true) => format!("{least} to {most}"),
        (None, true) => format!("at least {least}"),
    };
    let unknowns = !knobs.unknown.is_empty();
    let Some(limit) = limit else {
        plan.warning = Some(format!(
            "memguard: host memory {} per pod at {} ({ranks} rank(s)); the trainer has no \
             limits.memory: not planned",
            figure(plan.estimate.peak, most, unknowns),
            plan.estimate.peak_phase.name()
        ));
        return plan;
    };
    let fits_largest = |most: Option<Bytes>| most.is_some_and(|m| m <= limit);
    if plan.estimate.peak <= limit {
        plan.fits = fits_largest(most).then_some(true);
        if plan.fits.is_none() {
            plan.warning = Some(format!(
                "memguard: host memory {} of limits.memory {limit}: no host verdict, it depends \
                 on {} (not read)",
                figure(plan.estimate.peak, most, unknowns),
                depends()
            ));
        }
        return plan;
    }
    // Over whatever the unknowns are: the cheapest rewrites that bring it in.
    let mut rewritten = knobs.clone();
    let mut rewrites = Vec::new();
    let mut least = plan.estimate.peak;
    for step in candidates(knobs) {
        let mut next = rewritten.clone();
        step.apply(&mut next);
        let peak = peaks(&base, &next).1.peak;
        if peak < least {
            least = peak;
            rewritten = next;
            rewrites.push(step.rewrite);
        }
        if least <= limit {
            break;
        }
    }
    if least <= limit {
        let (rewritten, rewrites) = undo_unneeded(&base, knobs, rewritten, &rewrites, limit);
        let (config, estimate, most) = peaks(&base, &rewritten);
        plan.config = config;
        plan.estimate = estimate;
        plan.most = most;
        plan.sources = rewritten.sources();
        plan.fits = fits_largest(most).then_some(true);
        plan.rewrites = rewrites;
        let said: Vec<String> = plan
            .rewrites
            .iter()
            .map(|r| format!("--{} {}→{}", r.flag, r.from, r.to))
            .collect();
        plan.warning = Some(format!(
            "memguard: host memory rewritten to fit limits.memory {limit} ({}): {}",
            said.join(", "),
            figure(estimate.peak, most, unknowns)
        ));
        return plan;
    }
    plan.fits = Some(false);
    let need = most.unwrap_or(plan.estimate.peak);
    // With every rewrite the launch allows, the pod needs less: say that figure too.
    let (_, cheaper, cheaper_most) = peaks(&base, &rewritten);
    let cheaper_need = cheaper_most.unwrap_or(cheaper.peak);
    let with_rewrites = if !rewrites.is_empty() && gib_quantity(cheaper_need) != gib_quantity(need)
    {
        let said: Vec<String> = merged(&rewrites)
            .iter()
            .map(|r| format!("--{} {}", r.flag, r.to))
            .collect();
        format!(
            ", or ≥ {} with {}",
            gib_quantity(cheaper_need),
            said.join(" ")
        )
    } else {
        String::new()
    };
    let suggestion = dtype_suggestion(knobs)
        .filter(|_| plan.estimate.peak_phase == memguard_estimator::Phase::Load)
        .map(|s| format!("; {s}"))
        .unwrap_or_default();
    plan.verdict = Some(format!(
        "host memory cannot fit: needs {} per pod at {} ({ranks} rank(s)) of limits.memory \
         {limit}; set limits.memory ≥ {}{with_rewrites}{}{suggestion}",
        figure(plan.estimate.peak, most, unknowns),
        plan.estimate.peak_phase.name(),
        gib_quantity(need),
        if most.is_none() && unknowns {
            format!(" (at least; it depends on {}, not read)", depends())
        } else {
            String::new()
        }
    ));
    plan
}

impl HostPlan {
    /// The `host` field of the estimate annotation.
    pub fn annotation(&self, before: &HostKnobs) -> memguard_api::estimate::HostAnnotation {
        let est = &self.estimate;
        let before_sources = before.sources();
        memguard_api::estimate::HostAnnotation {
            bytes: est.peak,
            most: self.most.filter(|m| *m != est.peak),
            phase: est.peak_phase.name().to_string(),
            components: [
                ("load", est.load),
                ("input", est.input),
                ("save", est.save),
                ("offload", est.offload),
                ("runtime", est.runtime),
            ]
            .into_iter()
            .map(|(k, b)| (k.to_string(), b))
            .collect(),
            limit: self.limit,
            fits: self.fits,
            ranks: self.ranks,
            sources: self.sources.clone(),
            unknown: self.unknown.clone(),
            rewritten: self
                .rewrites
                .iter()
                .map(|r| {
                    let change = memguard_api::estimate::HostChange {
                        from: r.from.clone(),
                        source: before_sources
                            .get(r.knob.name())
                            .cloned()
                            .unwrap_or_default(),
                        to: r.to.clone(),
                    };
                    (r.knob.name().to_string(), change)
                })
                .collect(),
            shm: None,
            verdict: self.verdict.clone(),
        }
    }

    /// The `sizeLimit` of a memory-backed `/dev/shm` for the planned DataLoader workers: every
    /// rank's batches in flight (the workers' prefetched ones and those in hand), which the
    /// workers hand over through shared memory, and at least [`SHM_FLOOR`]; `None` without
    /// workers (or with a worker count not read). Its pages are the input component's batches,
    /// charged to the trainer's cgroup: the host figure counts them already.
    pub fn shm_size(&self) -> Option<Bytes> {
        let cfg = &self.config;
        if cfg.dataloader_workers == 0 {
            return None;
        }
        let batches = f64::from(cfg.ranks_in_pod)
            * (f64::from(cfg.dataloader_workers) * f64::from(cfg.prefetch_factor) + 2.0);
        let bytes = Bytes::from_f64(batches * cfg.batch_bytes.as_f64()).max(SHM_FLOOR);
        Some(Bytes(bytes.0.div_ceil(1 << 20) << 20))
    }
}

/// The smallest `/dev/shm` memguard mounts: room for the collate buffers and the tensors
/// torch's multiprocessing shares besides the batches themselves.
pub const SHM_FLOOR: Bytes = Bytes::mib(1024);

/// The rewrites that fit, less those a later one made unneeded: each knob but the last changed
/// is put back as far as the pod still fits (the workers to the most that fit), so a cheap knob
/// is not spent for a few MiB when a dearer one had to move anyway.
fn undo_unneeded(
    base: &HostConfig,
    before: &HostKnobs,
    mut knobs: HostKnobs,
    steps: &[HostRewrite],
    limit: Bytes,
) -> (HostKnobs, Vec<HostRewrite>) {
    let fits = |k: &HostKnobs| peaks(base, k).1.peak <= limit;
    let mut changes = merged(steps);
    let last = changes.pop();
    let mut kept = Vec::new();
    for change in changes {
        let mut trial = knobs.clone();
        match change.knob {
            HostKnob::DataloaderWorkers => {
                let from: u32 = change.from.parse().unwrap_or(0);
                let mut w = from;
                let mut best = None;
                loop {
                    trial.workers.clone_from(&before.workers);
                    if let Some(r) = &mut trial.workers {
                        r.value = w;
                    }
                    if fits(&trial) {
                        best = Some(w);
                        break;
                    }
                    if w == 0 {
                        break;
                    }
                    w /= 2;
                }
                let w = best.unwrap_or(0);
                if w == from {
                    knobs.workers.clone_from(&before.workers);
                    continue;
                }
                if let Some(r) = &mut knobs.workers {
                    r.value = w;
                }
                kept.push(HostRewrite {
                    to: w.to_string(),
                    ..change
                });
            }
            HostKnob::PinMemory => {
                trial.pin_memory.clone_from(&before.pin_memory);
                if fits(&trial) {
                    knobs = trial;
                } else {
                    kept.push(change);
                }
            }
            _ => {
                trial.save.clone_from(&before.save);
                if fits(&trial) {
                    knobs = trial;
                } else {
                    kept.push(change);
                }
            }
        }
    }
    kept.extend(last);
    (knobs, kept)
}

/// A rewrite the host plan may try.
struct Step {
    rewrite: HostRewrite,
    apply: fn(&mut HostKnobs, &str),
}

impl Step {
    fn apply(&self, knobs: &mut HostKnobs) {
        (self.apply)(knobs, &self.rewrite.to);
    }
}

fn flag(knob: HostKnob) -> &'static str {
    HOST_FLAGS
        .iter()
        .find(|(k, _)| *k == knob)
        .map_or("", |(_, f)| *f)
}

/// The rewrites of `knobs`, cheapest first: no pinned copies (slower host-to-device copies,
/// nothing else), fewer DataLoader workers (halved down to none: a slower input pipeline), a
/// model-only checkpoint (a run resumed from it restarts its optimizer). Only known values of
/// writable knobs.
fn candidates(knobs: &HostKnobs) -> Vec<Step> {
    let mut out = Vec::new();
    let writable = |k: HostKnob| knobs.writable.contains(&k);
    if writable(HostKnob::PinMemory) && knobs.pin_memory.as_ref().is_some_and(|r| r.value) {
        out.push(Step {
            rewrite: HostRewrite {
                knob: HostKnob::PinMemory,
                flag: flag(HostKnob::PinMemory),
                from: "true".into(),
                to: "false".into(),
            },
            apply: |k, _| {
                if let Some(r) = &mut k.pin_memory {
                    r.value = false;
                    r.source = "memguard".into();
                }
            },
        });
    }
    if writable(HostKnob::DataloaderWorkers)
        && let Some(workers) = knobs.workers.as_ref().map(|r| r.value)
    {
        let mut from = workers;
        while from > 0 {
            let to = from / 2;
            out.push(Step {
                rewrite: HostRewrite {
                    knob: HostKnob::DataloaderWorkers,
                    flag: flag(HostKnob::DataloaderWorkers),
                    from: from.to_string(),
                    to: to.to_string(),
                },
                apply: |k, to| {
                    if let (Some(r), Ok(n)) = (&mut k.workers, to.parse()) {
                        r.value = n;
                        r.source = "memguard".into();
                    }
                },
            });
            from = to;
        }
    }
    if writable(HostKnob::Save)
        && knobs
            .save
            .as_ref()
            .is_some_and(|r| r.value == SaveMode::FullWithOptimizer)
    {
        out.push(Step {
            rewrite: HostRewrite {
                knob: HostKnob::Save,
                flag: flag(HostKnob::Save),
                from: "false".into(),
                to: "true".into(),
            },
            apply: |k, _| {
                if let Some(r) = &mut k.save {
                    r.value = SaveMode::ModelOnlyFull;
                    r.source = "memguard".into();
                }
            },
        });
    }
    out
}

/// What would lower a load that memguard does not rewrite: loading in the checkpoint's own
/// dtype where the launch loads in fp32 (a bf16 checkpoint loaded as fp32 costs one fp32 copy
/// per rank; in its own dtype the files' pages are shared by every rank). Said, never written:
/// the load dtype is the dtype the weights and the optimizer's state train in (the Trainer's
/// `--bf16` autocasts the compute but keeps the parameters as loaded), so changing it changes
/// the training's numerics, which the user did not ask for.
fn dtype_suggestion(knobs: &HostKnobs) -> Option<&'static str> {
    knobs
        .load_bytes_per_param
        .as_ref()
        .is_some_and(|r| r.value == Some(4.0))
        .then_some(
            "if the checkpoint's files are bf16, --dtype bfloat16 (or auto) loads them once \
             instead of once per rank, but trains in bf16: it changes numerics, so memguard \
             does not make that change for you",
        )
}

/// Collapses a run of worker halvings into one rewrite (`8→0`, not `8→4, 4→2, 2→1, 1→0`).
fn merged(rewrites: &[HostRewrite]) -> Vec<HostRewrite> {
    let mut out: Vec<HostRewrite> = Vec::new();
    for r in rewrites {
        match out.last_mut() {
            Some(last) if last.knob == r.knob => last.to = r.to.clone(),
            _ => out.push(r.clone()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use memguard_api::pod::HostRead;
    use memguard_api::{Cluster, Policy};

    const GIB: u64 = 1 << 30;

    fn read<T>(value: T, source: &str) -> Option<HostRead<T>> {
        Some(HostRead {
            value,
            source: source.into(),
        })
    }

    /// Eight ranks of an 8B model with a busy input pipeline and a full save: every host knob
    /// read and writable.
    fn busy() -> (HostConfig, HostKnobs) {
        let mut base = HostConfig::new(8e9, 2.0);
        base.ranks_in_pod = 8;
        base.world_size = 8;
        base.batch_bytes = Bytes::mib(96);
        let knobs = HostKnobs {
            workers: read(8, "args"),
            pin_memory: read(true, "default:trl"),
            prefetch_factor: read(4, "args"),
            save: read(SaveMode::FullWithOptimizer, "default:trl"),
            load_bytes_per_param: read(None, "args"),
            checkpoint_bytes_per_param: read(2.0, "test"),
            ram_efficient_loading: read(false, "args"),
            offload: read(Offload::None, "args"),
            unknown: BTreeMap::new(),
            writable: [
                HostKnob::DataloaderWorkers,
                HostKnob::PinMemory,
                HostKnob::Save,
            ]
            .into(),
        };
        (base, knobs)
    }

    /// A kill at save cuts the save even where the estimate said the pod fits; a kill at load
    /// withdraws the host verdict; a kill at step, or none, changes nothing (issue 39).
    #[test]
    fn the_last_kill_phase_moves_the_host_plan() {
        let (base, knobs) = busy();
        let roomy = Some(Bytes(2048 * GIB));
        let fits = plan_against(base.clone(), &knobs, roomy);
        assert_eq!(fits.fits, Some(true));
        assert!(fits.rewrites.is_empty());

        let saved = plan_after_kill(base.clone(), &knobs, roomy, Some(TrainerPhase::Save));
        assert_eq!(saved.rewrites.len(), 1, "{:?}", saved.rewrites);
        assert_eq!(saved.rewrites[0].knob, HostKnob::Save);
        assert_eq!(saved.rewrites[0].to, "true");
        assert!(
            saved.estimate.save < fits.estimate.save,
            "the save spike is cut"
        );
        let said = saved.after_kill.as_deref().unwrap_or_default();
        assert!(
            said.contains("while saving") && said.contains("save_only_model"),
            "{said}"
        );

        let loaded = plan_after_kill(base.clone(), &knobs, roomy, Some(TrainerPhase::Load));
        assert_eq!(
            loaded.fits, None,
            "the kill contradicts the estimate's verdict"
        );
        assert!(loaded.rewrites.is_empty());
        let said = loaded.after_kill.as_deref().unwrap_or_default();
        assert!(
            said.contains("while loading") && said.contains("raise limits.memory"),
            "{said}"
        );
        assert!(
            !said.contains("--dtype"),
            "loads in the files' dtype: {said}"
        );
        // Loading in fp32: the dtype is named as the user's choice, and still not written.
        let mut fp32 = knobs.clone();
        fp32.load_bytes_per_param = read(Some(4.0), "args");
        let loaded = plan_after_kill(base.clone(), &fp32, roomy, Some(TrainerPhase::Load));
        assert!(loaded.rewrites.is_empty());
        let said = loaded.after_kill.as_deref().unwrap_or_default();
        assert!(
            said.contains("bf16 --dtype: less, changes numerics"),
            "{said}"
        );
        assert!(
            said.chars().count() <= crate::warnings::MAX_WARNING_CHARS,
            "{said}"
        );

        for phase in [Some(TrainerPhase::Step), None] {
            assert_eq!(plan_after_kill(base.clone(), &knobs, roomy, phase), fits);
        }

        // A save that cannot be rewritten (model-only already): said, nothing written.
        let mut model_only = knobs.clone();
        model_only.save = read(SaveMode::ModelOnlyFull, "args");
        let kept = plan_after_kill(base, &model_only, roomy, Some(TrainerPhase::Save));
        assert!(kept.rewrites.is_empty());
        assert!(
            kept.after_kill
                .as_deref()
                .unwrap_or_default()
                .contains("cannot be rewritten"),
            "{:?}",
            kept.after_kill
        );
    }

    /// The peak with every rewrite applied: pinning off, no workers, a model-only save.
    fn fully_rewritten(base: &HostConfig, knobs: &HostKnobs) -> Bytes {
        let mut k = knobs.clone();
        k.pin_memory = read(false, "x");
        k.workers = read(0, "x");
        k.save = read(SaveMode::ModelOnlyFull, "x");
        peaks(base, &k).1.peak
    }

    #[test]
    fn over_its_limit_a_pod_is_rewritten_cheapest_first_and_keeps_its_batch() {
        let (base, knobs) = busy();
        let limit = fully_rewritten(&base, &knobs);
        let plan = plan_against(base.clone(), &knobs, Some(limit));
        let said: Vec<(HostKnob, &str, &str)> = plan
            .rewrites
            .iter()
            .map(|r| (r.knob, r.from.as_str(), r.to.as_str()))
            .collect();
        assert_eq!(
            said,
            [
                (HostKnob::PinMemory, "true", "false"),
                (HostKnob::DataloaderWorkers, "8", "0"),
                (HostKnob::Save, "false", "true"),
            ]
        );
        assert_eq!(plan.fits, Some(true));
        assert!(plan.estimate.peak <= limit);
        assert!(plan.verdict.is_none());
        // The batch the DataLoader yields is the GPU plan's, untouched.
        assert_eq!(plan.config.batch_bytes, base.batch_bytes);
        assert_eq!(plan.sources["dataloader-workers"], "memguard");
        let warning = plan.warning.expect("the rewrites are said");
        assert!(
            warning.contains("--dataloader_num_workers 8→0"),
            "{warning}"
        );
    }

    /// Where the save must move anyway, the cheaper knobs that helped on the way by a few MiB
    /// are put back.
    #[test]
    fn a_cheap_rewrite_a_dearer_one_made_unneeded_is_undone() {
        let (mut base, knobs) = busy();
        base.batch_bytes = Bytes(64 << 10);
        let mut model_only = knobs.clone();
        model_only.save = read(SaveMode::ModelOnlyFull, "x");
        let limit = peaks(&base, &model_only).1.peak;
        let plan = plan_against(base, &knobs, Some(limit));
        let moved: Vec<HostKnob> = plan.rewrites.iter().map(|r| r.knob).collect();
        assert_eq!(moved, [HostKnob::Save], "{:?}", plan.rewrites);
        assert_eq!(plan.config.dataloader_workers, 8);
        assert!(plan.config.pin_memory);
        assert_eq!(plan.fits, Some(true));
    }

    #[test]
    fn the_cheapest_rewrite_that_fits_is_the_only_one() {
        let (base, knobs) = busy();
        let mut unpinned = knobs.clone();
        unpinned.pin_memory = read(false, "x");
        let limit = peaks(&base, &unpinned).1.peak;
        let plan = plan_against(base, &knobs, Some(limit));
        assert_eq!(plan.rewrites.len(), 1, "{:?}", plan.rewrites);
        assert_eq!(plan.rewrites[0].knob, HostKnob::PinMemory);
    }

    #[test]
    fn an_unknown_value_is_never_written_and_never_fits() {
        let (base, mut knobs) = busy();
        let limit = fully_rewritten(&base, &knobs);
        knobs.workers = None;
        knobs.writable.remove(&HostKnob::DataloaderWorkers);
        knobs
            .unknown
            .insert(HostKnob::DataloaderWorkers, "not read".into());
        let plan = plan_against(base, &knobs, Some(limit + Bytes::mib(1)));
        assert!(
            plan.rewrites
                .iter()
                .all(|r| r.knob != HostKnob::DataloaderWorkers),
            "{:?}",
            plan.rewrites
        );
        // Unknown workers have no bound: a fit is never claimed.
        assert_eq!(plan.fits, None);
        assert_eq!(plan.most, None);
        assert!(plan.unknown.contains_key("dataloader-workers"));
    }

    #[test]
    fn an_unknown_that_could_change_the_verdict_leaves_no_verdict() {
        let (base, mut knobs) = busy();
        knobs.checkpoint_bytes_per_param = None;
        knobs
            .unknown
            .insert(HostKnob::CheckpointDtype, "not in the catalog".into());
        // Where the save dominates, the checkpoint's dtype cannot change the verdict.
        let saving = plan_against(base.clone(), &knobs, None);
        assert_eq!(saving.most, Some(saving.estimate.peak));
        // Where loading dominates, it can.
        knobs.workers = read(0, "args");
        knobs.save = read(SaveMode::None, "args");
        let least = plan_against(base.clone(), &knobs, None);
        let most = least.most.expect("bounded");
        assert!(most > least.estimate.peak);
        let between = Bytes((least.estimate.peak.0 + most.0) / 2);
        let plan = plan_against(base.clone(), &knobs, Some(between));
        assert_eq!(plan.fits, None);
        assert!(plan.rewrites.is_empty());
        let warning = plan.warning.expect("says why");
        assert!(warning.contains("checkpoint-dtype"), "{warning}");
        assert_eq!(plan_against(base, &knobs, Some(most)).fits, Some(true));
    }

    /// An fp32 load maps an fp32 checkpoint and copies a bf16 one once per rank: with the
    /// checkpoint's dtype unknown, the range spans both.
    #[test]
    fn the_load_and_checkpoint_dtypes_are_ranged_together() {
        let (mut base, mut knobs) = busy();
        base.ranks_in_pod = 4;
        knobs.workers = read(0, "args");
        knobs.save = read(SaveMode::None, "args");
        knobs.load_bytes_per_param = read(Some(4.0), "default:trl");
        knobs.checkpoint_bytes_per_param = None;
        let plan = plan_against(base, &knobs, None);
        let runtime = plan.estimate.runtime.as_f64();
        // fp32 files, mapped: 32 GB.
        assert!((plan.estimate.peak.as_f64() - runtime - 8e9 * 4.0).abs() < 2.0);
        // bf16 files and four fp32 copies: 16 + 128 GB.
        let most = plan.most.expect("bounded").as_f64();
        assert!((most - runtime - 8e9 * 2.0 - 4.0 * 8e9 * 4.0).abs() < 2.0);
    }

    #[test]
    fn when_nothing_fits_the_verdict_names_the_memory_to_request() {
        let (base, knobs) = busy();
        // Below the load phase: no input or save rewrite brings it in.
        let limit = Bytes(16 * GIB);
        let plan = plan_against(base, &knobs, Some(limit));
        assert_eq!(plan.fits, Some(false));
        assert!(plan.rewrites.is_empty(), "nothing is rewritten in vain");
        let verdict = plan.verdict.expect("a verdict");
        let need = gib_quantity(plan.estimate.peak);
        assert!(
            verdict.contains(&format!("set limits.memory ≥ {need}")),
            "{verdict}"
        );
        assert!(verdict.starts_with("host memory cannot fit"), "{verdict}");
    }

    /// A load in fp32 over the limit: the dtype is suggested beside the memory to request,
    /// and never rewritten (it is what trains).
    #[test]
    fn an_fp32_load_over_its_limit_is_told_the_dtype_and_the_memory_not_rewritten() {
        let (base, mut knobs) = busy();
        knobs.load_bytes_per_param = read(Some(4.0), "args");
        let plan = plan_against(base.clone(), &knobs, Some(Bytes(16 * GIB)));
        assert_eq!(plan.fits, Some(false));
        assert_eq!(plan.estimate.peak_phase, memguard_estimator::Phase::Load);
        assert_eq!(plan.config.load_bytes_per_param, Some(4.0));
        assert!(plan.rewrites.is_empty(), "{:?}", plan.rewrites);
        let verdict = plan.verdict.expect("a verdict");
        assert!(
            verdict.contains("set limits.memory ≥")
                && verdict.contains("--dtype bfloat16")
                && verdict.contains("changes numerics"),
            "{verdict}"
        );
        // A load in the files' own dtype has nothing to suggest.
        let (base, knobs) = busy();
        let plan = plan_against(base, &knobs, Some(Bytes(16 * GIB)));
        assert!(!plan.verdict.expect("a verdict").contains("--dtype"));
    }

    /// Over the limit even with every rewrite, the error names both figures: the launch as it
    /// is, and with the rewrites that would help.
    #[test]
    fn the_verdict_names_the_memory_with_the_rewrites_too() {
        let (base, knobs) = busy();
        let plan = plan_against(base, &knobs, Some(Bytes(48 * GIB)));
        let verdict = plan.verdict.expect("a verdict");
        assert!(verdict.contains(", or ≥ "), "{verdict}");
        assert!(verdict.contains("--save_only_model true"), "{verdict}");
        assert!(plan.rewrites.is_empty());
    }

    #[test]
    fn shared_memory_is_sized_to_the_workers_batches_with_a_floor() {
        let (base, knobs) = busy();
        let plan = plan_against(base, &knobs, None);
        // 8 ranks × (8 workers × 4 prefetched + 2 in hand) × 96 MiB.
        assert_eq!(plan.shm_size(), Some(Bytes::mib(8 * 34 * 96)));
        let (mut base, mut knobs) = busy();
        base.batch_bytes = Bytes(1000);
        assert_eq!(
            plan_against(base.clone(), &knobs, None).shm_size(),
            Some(SHM_FLOOR)
        );
        knobs.workers = read(0, "args");
        assert_eq!(plan_against(base, &knobs, None).shm_size(), None);
    }

    #[test]
    fn without_a_limit_the_figure_is_said_and_nothing_decided() {
        let (base, knobs) = busy();
        let plan = plan_against(base, &knobs, None);
        assert_eq!(plan.fits, None);
        assert!(plan.rewrites.is_empty() && plan.verdict.is_none());
        assert!(
            plan.warning
                .expect("a warning")
                .contains("no limits.memory")
        );
    }

    fn trl_pod(flags: &str, limit: &str) -> k8s_openapi::api::core::v1::Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "sft", "labels": {"memguard.io/enabled": "true"}},
            "spec": {"containers": [{
                "name": "t", "image": "x",
                "resources": {"limits": {"nvidia.com/gpu": "4", "memory": limit}},
                "command": ["bash", "-c"],
                "args": [format!("torchrun --nproc_per_node 4 -m trl.scripts.sft \
                    --model_name_or_path meta-llama/Llama-3.1-8B \
                    --per_device_train_batch_size 2 --output_dir /out {flags}")]
            }]}
        }))
        .expect("a pod")
    }

    #[test]
    fn a_trl_launch_gives_its_host_knobs_with_their_sources() {
        let pod = trl_pod("--dataloader_num_workers 4", "64Gi");
        let training =
            TrainingPod::resolve(&pod, &Policy::default(), Cluster::default()).expect("resolves");
        let knobs = HostKnobs::read(&training);
        assert_eq!(knobs.workers.as_ref().map(|r| r.value), Some(4));
        let sources = knobs.sources();
        assert_eq!(sources["dataloader-workers"], "args");
        assert_eq!(sources["pin-memory"], "default:trl");
        assert_eq!(sources["load-dtype"], "default:trl");
        assert!(knobs.unknown.contains_key(&HostKnob::CheckpointDtype));
        assert!(knobs.writable.contains(&HostKnob::PinMemory));
        let plan = plan_host(&training, &training.config, &knobs).expect("a GPU pod");
        assert_eq!(plan.ranks, 4);
        assert_eq!(plan.limit, Some(Bytes(64 * GIB)));
    }

    #[test]
    fn a_bespoke_script_leaves_its_host_knobs_unknown_and_unwritable() {
        let mut pod = trl_pod("", "64Gi");
        let args = pod.spec.as_mut().expect("spec").containers[0]
            .args
            .as_mut()
            .expect("args");
        args[0] = args[0].replace("-m trl.scripts.sft", "train.py");
        let training =
            TrainingPod::resolve(&pod, &Policy::default(), Cluster::default()).expect("resolves");
        let knobs = HostKnobs::read(&training);
        assert!(knobs.workers.is_none() && knobs.pin_memory.is_none());
        assert!(knobs.writable.is_empty(), "{:?}", knobs.writable);
        assert!(knobs.unknown.contains_key(&HostKnob::DataloaderWorkers));
    }

    #[test]
    fn an_fsdp_launch_gives_its_save_loading_and_offload_from_its_config() {
        let full = trl_pod(
            r#"--fsdp full_shard --fsdp_config '{"state_dict_type": "FULL_STATE_DICT", "cpu_ram_efficient_loading": true}'"#,
            "64Gi",
        );
        let training =
            TrainingPod::resolve(&full, &Policy::default(), Cluster::default()).expect("resolves");
        let knobs = HostKnobs::read(&training);
        assert_eq!(
            knobs.save.as_ref().map(|r| (r.value, r.source.as_str())),
            Some((SaveMode::FullWithOptimizer, "args"))
        );
        // Read, and counted as loading on every rank: it lowers nothing under transformers 5.
        assert_eq!(
            knobs
                .ram_efficient_loading
                .as_ref()
                .map(|r| (r.value, r.source.as_str())),
            Some((false, memguard_api::coupled::INERT_AT_LOAD))
        );
        assert_eq!(
            knobs.offload.as_ref().map(|r| (r.value, r.source.as_str())),
            Some((Offload::None, "default:transformers"))
        );
        assert!(knobs.writable.contains(&HostKnob::Save));
        let plan = plan_host(&training, &training.config, &knobs).expect("a GPU pod");
        assert!(!plan.config.ram_efficient_loading);
        assert_eq!(
            plan.sources["ram-efficient-loading"],
            memguard_api::coupled::INERT_AT_LOAD
        );

        let sharded = trl_pod(
            r#"--fsdp "full_shard offload" --fsdp_config '{"state_dict_type": "SHARDED_STATE_DICT"}'"#,
            "64Gi",
        );
        let training = TrainingPod::resolve(&sharded, &Policy::default(), Cluster::default())
            .expect("resolves");
        let knobs = HostKnobs::read(&training);
        assert_eq!(
            knobs.save.as_ref().map(|r| r.value),
            Some(SaveMode::Sharded)
        );
        assert_eq!(
            knobs.offload.as_ref().map(|r| r.value),
            Some(Offload::ParamsAndOptimizer)
        );
        let plan = plan_host(&training, &training.config, &knobs).expect("a GPU pod");
        assert!(plan.estimate.offload > Bytes::ZERO, "{:?}", plan.estimate);
    }

    #[test]
    fn a_sharding_config_in_the_image_leaves_save_loading_and_offload_unknown() {
        let pod = trl_pod("--fsdp full_shard --fsdp_config /app/fsdp.json", "64Gi");
        let training =
            TrainingPod::resolve(&pod, &Policy::default(), Cluster::default()).expect("resolves");
        let knobs = HostKnobs::read(&training);
        for knob in [HostKnob::Save, HostKnob::Offload] {
            let why = knobs.unknown.get(&knob).expect("unknown");
            assert!(why.contains("/app/fsdp.json"), "{knob:?}: {why}");
        }
        // Whatever the config says, every rank loads under transformers 5: not unknown.
        assert_eq!(
            knobs
                .ram_efficient_loading
                .as_ref()
                .map(|r| (r.value, r.source.as_str())),
            Some((false, memguard_api::coupled::INERT_AT_LOAD))
        );
        assert!(!knobs.unknown.contains_key(&HostKnob::RamEfficientLoading));
        assert!(!knobs.writable.contains(&HostKnob::Save));
        // Unknown, the figure spans them: RAM-efficient or not, offloaded or not.
        let plan = plan_host(&training, &training.config, &knobs).expect("a GPU pod");
        assert!(plan.most.expect("bounded") > plan.estimate.peak);
    }
}
