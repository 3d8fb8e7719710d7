//! What the sampling loop publishes and the HTTP handlers read.

use crate::sample::MemorySample;
use crate::sample::gpu::GpuMemory;
use crate::sample::psi::Psi;
use crate::trace::Trace;
use memguard_api::{Level, OomKind, OomOutcome, OomRecord, Report, Signal, TrainerPhase};
use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use tokio::sync::watch;

/// The latest figures, for `/metrics` and the summary.
#[derive(Debug, Clone, Default)]
pub struct Status {
    /// Where memory figures come from (`cgroup-v1 /sys/…`).
    pub source: String,
    /// Which view of the trainer's memory the source has (`/metrics` `source_info`).
    pub source_info: Option<crate::sample::SourceInfo>,
    /// The latest memory sample.
    pub sample: Option<MemorySample>,
    /// PSI of the trainer's cgroup (v2).
    pub psi_cgroup: Option<Psi>,
    /// PSI of the host (`/proc/pressure/memory`).
    pub psi_host: Option<Psi>,
    /// GPU devices (NVML).
    pub gpus: Vec<GpuMemory>,
    /// The trainer's last report.
    pub report: Option<Report>,
    /// Reports received.
    pub reports_total: u64,
    /// The trainer's own cgroup figures, from its last report that had them.
    pub container_memory: Option<crate::sample::reported::Reported>,
    /// Reports refused (not JSON, unknown fields, impossible figures).
    pub reports_rejected: u64,
    /// Whether the last sample read the trainer's memory (false while the source is missing or
    /// failing: the memory figures are then the last good ones).
    pub source_up: bool,
    /// Samples taken.
    pub samples_total: u64,
    /// Sampler errors by kind (`read`, `parse`, `gpu`).
    pub sample_errors: BTreeMap<&'static str, u64>,
    /// Signal-file write failures.
    pub signal_write_errors: u64,
    /// Kernel events that woke the loop.
    pub wakeups_total: u64,
    /// Highest working set seen.
    pub peak_working_set: Option<u64>,
    /// Highest GPU memory used seen (NVML or report).
    pub gpu_peak: Option<u64>,
    /// Highest level reached.
    pub max_level: Level,
    /// OOM kills counted in the trainer's cgroups since the sidecar started, across in-place
    /// restarts (each restart brings a new cgroup whose counter starts at 0).
    pub oom_kills: u64,
    /// The phase the trainer last reported (`None` until it reports one).
    pub phase: Option<TrainerPhase>,
    /// Whether any report carried a step number: the trainer steps (the leak rule's window
    /// for a trainer that reports no phase).
    pub step_reported: bool,
    /// The phase the trainer had last reported when the last OOM kill was counted: `None` when
    /// it had reported none (never guessed).
    pub oom_kill_phase: Option<TrainerPhase>,
    /// Checkpoint saves the trainer put off under pressure, from its last report that said.
    pub saves_deferred: Option<u64>,
    /// Downgrades issued.
    pub downgrades: u64,
    /// Growths of the micro-batch back toward the configured one, on measured peaks.
    pub growths: u64,
    /// The highest micro-batch growth may recommend, once a shrink lowered it.
    pub growth_ceiling: Option<u64>,
    /// OOM records the trainer reported, by kind and outcome.
    pub oom_records: BTreeMap<(OomKind, OomOutcome), u64>,
    /// OOM records whose batch × accumulation is not the effective batch in force: their
    /// config is ignored (the OOM still counts).
    pub oom_records_refused: u64,
    /// The last OOM record the trainer reported.
    pub last_oom: Option<OomRecord>,
    /// Fatal OOM records the trainer reported, by the phase each came in (the record's own,
    /// else the phase last reported); records in no known phase are not counted here.
    pub fatal_oom_phases: BTreeMap<TrainerPhase, u64>,
    /// A reported OOM record the sampling loop has not turned into a sticky downgrade yet.
    pub pending_oom: Option<OomRecord>,
    /// The batch of the sticky downgrade in force (after an OOM kill or record).
    pub sticky_batch_size: Option<u64>,
    /// Seconds to the limit of a steady growth, when one is seen.
    pub seconds_to_limit: Option<f64>,
    /// A downgrade is due but waits for the trainer to apply the last one.
    pub waiting_for_trainer: bool,
    /// What admission planned the trainer at (`--admitted-config`).
    pub admitted_config: BTreeMap<String, f64>,
    /// The config the trainer reported at train start (the last report that had one).
    pub trainer_config: BTreeMap<String, f64>,
    /// The plan made at train start on the first reported config, or why none was.
    pub train_start: Option<memguard_api::train_start::TrainStartPlan>,
}

impl Status {
    /// The knobs both admission and the trainer say, and whether they differ (1) or not (0).
    pub fn config_mismatch(&self) -> BTreeMap<&str, bool> {
        self.trainer_config
            .iter()
            .filter_map(|(k, v)| {
                let admitted = self.admitted_config.get(k)?;
                Some((
                    k.as_str(),
                    (admitted - v).abs() > f64::EPSILON * v.abs().max(1.0),
                ))
            })
            .collect()
    }
}

impl Status {
    /// OOM kills in the cgroup since the sidecar started watching.
    pub fn oom_events(&self) -> u64 {
        self.oom_kills
    }
}

impl Status {
    /// OOM records reported, all kinds and outcomes.
    pub fn oom_reports(&self) -> u64 {
        self.oom_records.values().sum()
    }
}

/// State shared by the loop and the handlers.
#[derive(Debug)]
pub struct Shared {
    /// The current signal; long-polls wait on it.
    pub signal: watch::Sender<Signal>,
    /// Latest figures.
    pub status: Mutex<Status>,
    /// The memory timeline.
    pub trace: Mutex<Trace>,
    /// The train-start decision and the signal after it, once made: the report that carried
    /// the config waits on it for its reply.
    pub train_start: watch::Sender<Option<memguard_api::train_start::TrainStartReply>>,
    /// Wakes the sampling loop before its next tick (a config reported: plan now).
    pub wake: tokio::sync::Notify,
}

impl Shared {
    /// Shared state starting from `signal`.
    pub fn new(signal: Signal) -> Self {
        Shared {
            signal: watch::Sender::new(signal),
            status: Mutex::new(Status::default()),
            trace: Mutex::new(Trace::default()),
            train_start: watch::Sender::new(None),
            wake: tokio::sync::Notify::new(),
        }
    }

    /// The status (a poisoned lock still holds usable figures).
    pub fn status(&self) -> MutexGuard<'_, Status> {
        self.status.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The trace.
    pub fn trace(&self) -> MutexGuard<'_, Trace> {
        self.trace.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
