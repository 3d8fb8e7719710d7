//! One sampling step: sample every source, assess, publish. No sockets, no clock of its own (the
//! caller passes milliseconds), so tests drive it with fake sources.

use crate::growth::{self, Growth, GrowthConfig, Memory, Observation, Reading};
use crate::pressure::{self, History, Inputs, PressureConfig};
use crate::sample::gpu::{self, GpuSource};
use crate::sample::psi::{self, Psi};
use crate::sample::{MemorySample, MemorySource};
use crate::signal::SignalWriter;
use crate::state::Shared;
use crate::trace::Point;
use memguard_api::{Pressure, Signal, signal::now_rfc3339};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What a step found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tick {
    /// Keep going.
    Running,
    /// The trainer's cgroup emptied or vanished after having been seen.
    TrainerGone,
}

/// The sampling engine.
pub struct Engine {
    source: Box<dyn MemorySource>,
    gpu: Box<dyn GpuSource>,
    psi_cgroup: Option<PathBuf>,
    psi_host: Option<PathBuf>,
    pressure: PressureConfig,
    state: pressure::State,
    growth_config: GrowthConfig,
    growth: Growth,
    history: History,
    writer: SignalWriter,
    shared: Arc<Shared>,
    seen_sample: bool,
    seen_populated: bool,
    write_failing: bool,
    pending_write: bool,
    errors_logged: u64,
    /// The cgroup (its directory's inode, when known) and its `oom_kill` counter at the last
    /// sample: a restarted trainer's new cgroup counts from 0.
    oom_baseline: Option<(Option<u64>, u64)>,
    /// The trainer now watched (or the one that just left) died of an OOM: a kill counted in
    /// its cgroup, or a fatal OOM record it reported.
    trainer_oom: bool,
    /// Reports received when that OOM was seen: a report after it came from a trainer that
    /// survived it (a worker process was killed, not the trainer).
    reports_at_oom: u64,
    waiting_for_trainer: bool,
    /// What admission passed for the train-start plan (`--train-start`; `None`: nothing).
    train_start_policy: Option<memguard_api::train_start::TrainStartPolicy>,
    /// The train-start decision was made (once, on the first reported config).
    train_start_decided: bool,
    /// A decision made this tick, to answer the report that carried the config with.
    train_start_reply: Option<memguard_api::train_start::TrainStartPlan>,
}

/// Everything one step read, and the state machine's inputs made from it.
struct Readings {
    sample: Option<MemorySample>,
    /// The source answered "nothing there" (not a failed read).
    clean_none: bool,
    psi_cgroup: Option<Psi>,
    psi_host: Option<Psi>,
    gpus: Vec<gpu::GpuMemory>,
    report: Option<memguard_api::Report>,
    limit: Option<u64>,
    working_set: Option<u64>,
    gpu_used: Option<u64>,
    inputs: Inputs,
}

/// Where the engine reads PSI from.
#[derive(Debug, Clone, Default)]
pub struct PsiPaths {
    /// The cgroup's `memory.pressure` (v2).
    pub cgroup: Option<PathBuf>,
    /// `/proc/pressure/memory`.
    pub host: Option<PathBuf>,
}

impl Engine {
    /// An engine publishing into `shared` (whose current signal is the starting one).
    pub fn new(
        source: Box<dyn MemorySource>,
        gpu: Box<dyn GpuSource>,
        psi: PsiPaths,
        pressure: PressureConfig,
        writer: SignalWriter,
        shared: Arc<Shared>,
    ) -> Self {
        let s = shared.signal.borrow().clone();
        let mut growth = Growth::default();
        if let Some(k) = s.sticky {
            // A sticky downgrade carried over a restart: the rung above it ran out of memory.
            growth.forbid_from(k.batch_size.saturating_add(1));
        }
        {
            let mut st = shared.status();
            st.source = source.describe();
            st.source_info = Some(source.info());
        }
        Engine {
            source,
            gpu,
            psi_cgroup: psi.cgroup,
            psi_host: psi.host,
            pressure,
            state: pressure::State::new(s.batch_size, s.grad_accumulation, s.grad_checkpointing)
                .with_sticky(s.sticky),
            growth_config: GrowthConfig::new(pressure.thresholds.warn),
            growth,
            history: History::default(),
            writer,
            shared,
            seen_sample: false,
            seen_populated: false,
            write_failing: false,
            pending_write: true,
            errors_logged: 0,
            oom_baseline: None,
            trainer_oom: false,
            reports_at_oom: 0,
            waiting_for_trainer: false,
            train_start_policy: None,
            train_start_decided: false,
            train_start_reply: None,
        }
    }

    /// Plans the trainer's reported config at train start under `policy` (what admission
    /// passed; `None`: nothing, and the decision says so).
    pub fn with_train_start(
        mut self,
        policy: Option<memguard_api::train_start::TrainStartPolicy>,
    ) -> Self {
        self.train_start_policy = policy;
        self
    }

    /// The growth back toward the configured micro-batch with these settings (default:
    /// [`GrowthConfig::new`] at the `warn` threshold).
    pub fn with_growth(mut self, config: GrowthConfig) -> Self {
        self.growth_config = config;
        self
    }

    /// The sticky downgrade after an OOM kill counted in the cgroup since the last sample, or an
    /// OOM record the trainer reported: the state to move to, and why.
    fn after_oom(
        &mut self,
        state: &pressure::State,
        sample: Option<&MemorySample>,
        now_ms: u64,
    ) -> Option<(pressure::State, String)> {
        let mut out: Option<(pressure::State, String)> = None;
        if let Some(k) = sample.and_then(|s| s.events.oom_kill) {
            let cgroup = self.cgroup_identity();
            let before = match self.oom_baseline.replace((cgroup, k)) {
                // The first cgroup seen: kills before the sidecar started are not this run's.
                None => k,
                Some((seen, b)) if seen == cgroup => b,
                // A new cgroup (the trainer restarted in place): all of its kills are new.
                Some(_) => 0,
            };
            if k > before {
                let mut st = self.shared.status();
                st.oom_kills += k - before;
                st.oom_kill_phase = st.phase;
                self.reports_at_oom = st.reports_total;
                drop(st);
                self.trainer_oom = true;
                let next = pressure::sticky_downgrade(state, self.state.knobs(), None, now_ms);
                let why = format!("OOM kill in the trainer's cgroup (oom_kill {before} -> {k})");
                out = Some((next, why));
            }
        }
        let record = self.shared.status().pending_oom.take();
        if let Some(r) = record {
            if r.outcome == memguard_api::oom::OomOutcome::Fatal {
                self.trainer_oom = true;
                self.reports_at_oom = self.shared.status().reports_total;
            }
            let base = out.as_ref().map_or(state, |(s, _)| s).clone();
            let reported = pressure::Knobs {
                batch_size: r.batch_size.max(1),
                grad_accumulation: r.grad_accumulation.max(1),
                grad_checkpointing: r.grad_checkpointing,
            };
            let in_force = self.keep_effective_batch(reported);
            let next = pressure::sticky_downgrade(&base, in_force, r.new_batch_size, now_ms);
            let step = r.step.map_or_else(|| "?".into(), |s| s.to_string());
            let why = format!("trainer reported a {} {} at step {step}", r.outcome, r.kind);
            out = Some(match out {
                Some((_, first)) => (next, format!("{first}; {why}")),
                None => (next, why),
            });
        }
        out.map(|(next, why)| {
            let what = format!(
                "{why}: sticky downgrade to batch {}, accumulation {}{}",
                next.batch_size,
                next.grad_accumulation,
                if next.grad_checkpointing {
                    ", checkpointing on"
                } else {
                    ""
                }
            );
            tracing::warn!(reason = %what, "out of memory");
            (next, what)
        })
    }

    /// The config an OOM record says was in force, when it keeps the effective batch
    /// (batch × accumulation) in force here; else the sidecar's own, and the record's config is
    /// refused (logged, counted in `oom_records_refused_total`): a sticky downgrade from a
    /// record of 1 × 1 would turn a 4 × 8 run into 1 × 1.
    fn keep_effective_batch(&self, reported: pressure::Knobs) -> pressure::Knobs {
        let own = self.state.knobs();
        let effective = |k: pressure::Knobs| k.batch_size.saturating_mul(k.grad_accumulation);
        if effective(reported) == effective(own) {
            return reported;
        }
        self.shared.status().oom_records_refused += 1;
        tracing::warn!(
            reported = %format!("{} x {}", reported.batch_size, reported.grad_accumulation),
            in_force = %format!("{} x {}", own.batch_size, own.grad_accumulation),
            "OOM record refused: its batch x accumulation is not the effective batch in force; \
             the OOM is counted and the config in force stepped down instead"
        );
        own
    }

    /// The inode of the trainer's cgroup directory: a cgroup created again under the same
    /// name (a container restarted in place) has a new one.
    fn cgroup_identity(&self) -> Option<u64> {
        self.source.cgroup_identity()
    }

    /// The device memory the `dmem` cgroup controller charges to the trainer's cgroup, where
    /// NVML has no figure (sample/dmem.rs); none where the controller is not there.
    fn dmem_gpus(&mut self) -> Vec<gpu::GpuMemory> {
        let read = match self.source.cgroup_dir() {
            Some(dir) => crate::sample::dmem::read(dir),
            None => return Vec::new(),
        };
        match read {
            Ok(found) => found.unwrap_or_default(),
            Err(e) => {
                self.sample_error("dmem", &e);
                Vec::new()
            }
        }
    }

    /// The trainer left: look for it again (a restart in place brings a new process and cgroup).
    /// Ask [`trainer_died_of_oom`](Self::trainer_died_of_oom) first: this forgets it.
    pub fn trainer_left(&mut self) {
        self.source.forget();
        self.trainer_oom = false;
        self.seen_sample = false;
        self.seen_populated = false;
        // The next trainer imports and loads anew: not known to step until it reports so.
        let mut st = self.shared.status();
        st.phase = None;
        st.step_reported = false;
        drop(st);
        self.history = History::default();
    }

    /// The trainer that just left (or the one watched) died of an OOM (a kill counted in its cgroup,
    /// or a fatal OOM record it reported, and no report from it since): a restart in place is to
    /// be expected.
    pub fn trainer_died_of_oom(&self) -> bool {
        self.trainer_oom && self.shared.status().reports_total <= self.reports_at_oom
    }

    /// A trainer is being watched (a sample was read since it was found).
    pub fn has_trainer(&self) -> bool {
        self.seen_sample
    }

    /// The pidfd of a trainer just found, once (see [`MemorySource::take_exit_watch`]).
    pub fn take_exit_watch(&mut self) -> Option<std::os::fd::OwnedFd> {
        self.source.take_exit_watch()
    }

    /// The trainer's cgroup directory, once the source knows it.
    pub fn cgroup_dir(&self) -> Option<PathBuf> {
        self.source.cgroup_dir().map(Path::to_path_buf)
    }

    /// Reads the cgroup's PSI from `path` from now on, unless a path was given at start.
    pub fn set_cgroup_psi(&mut self, path: PathBuf) {
        self.psi_cgroup.get_or_insert(path);
    }

    /// The effective limit of the last sample.
    pub fn limit(&self) -> Option<u64> {
        self.shared
            .status()
            .sample
            .as_ref()
            .and_then(MemorySample::effective_limit)
    }

    /// Writes the current signal when a write is pending (startup, a change, or a failure).
    pub fn flush(&mut self) {
        if !self.pending_write {
            return;
        }
        let signal = self.shared.signal.borrow().clone();
        match self.writer.write(&signal) {
            Ok(_) => {
                if self.write_failing {
                    tracing::info!(path = %self.writer.path().display(), "signal file writable again");
                }
                self.write_failing = false;
                self.pending_write = false;
            }
            Err(error) => {
                self.shared.status().signal_write_errors += 1;
                if !self.write_failing {
                    tracing::error!(%error, "signal file not written; the HTTP API keeps serving the signal");
                }
                self.write_failing = true;
            }
        }
    }

    fn sample_error(&mut self, kind: &'static str, error: &dyn std::fmt::Display) {
        let mut st = self.shared.status();
        *st.sample_errors.entry(kind).or_default() += 1;
        drop(st);
        self.errors_logged += 1;
        if self.errors_logged <= 5 || self.errors_logged.is_power_of_two() {
            tracing::warn!(%error, kind, count = self.errors_logged, "sampler failed; carrying on");
        }
    }

    /// One step at `now_ms` (milliseconds since start), in four stages: read the
    /// [`inputs`](Self::inputs), [`assess`](Self::assess) them, [`record`](Self::record) what was
    /// seen, [`publish`](Self::publish) a changed signal.
    pub fn tick(&mut self, now_ms: u64) -> Tick {
        let readings = self.inputs(now_ms);
        let (reason, changed) = self.assess(&readings, now_ms);
        self.record(&readings);
        if changed {
            self.publish(&readings, reason, now_ms);
        }
        if let Some(plan) = self.train_start_reply.take() {
            let signal = self.shared.signal.borrow().clone();
            self.shared.train_start.send_replace(Some(
                memguard_api::train_start::TrainStartReply {
                    train_start: plan,
                    signal,
                },
            ));
        }
        self.flush();
        self.shared.trace().push(Point {
            ts_us: now_ms * 1000,
            working_set: readings.working_set,
            limit: readings.limit,
            gpu_used: readings.gpu_used,
            allocated: readings.report.as_ref().and_then(|r| r.allocated_bytes),
            level: self.state.level,
        });
        self.gone(&readings.sample, readings.clean_none)
    }

    /// Samples every source (memory, PSI, GPU, the trainer's last report) and turns the
    /// figures into the state machine's [`Inputs`]. Failed reads are counted and carry on.
    fn inputs(&mut self, now_ms: u64) -> Readings {
        let (sample, clean_none) = match self.source.sample() {
            Ok(s) => {
                let none = s.is_none();
                (s, none)
            }
            Err(e) => {
                self.sample_error(e.metric_label(), &e);
                (None, false)
            }
        };
        let psi_cgroup = self.read_psi(self.psi_cgroup.clone());
        let psi_host = self.read_psi(self.psi_host.clone());
        let gpus = match self.gpu.sample() {
            Ok(g) => g,
            Err(e) => {
                self.sample_error("gpu", &e);
                Vec::new()
            }
        };
        let gpus = if gpus.is_empty() {
            self.dmem_gpus()
        } else {
            gpus
        };
        let limit = sample.as_ref().and_then(MemorySample::effective_limit);
        let working_set = sample.as_ref().and_then(|s| s.working_set_bytes);
        let (report, window) = {
            let st = self.shared.status();
            let window = pressure::leak_window(st.phase, st.step_reported);
            (st.report.clone(), window)
        };
        if let Some(ws) = working_set {
            self.history.push_in(window, now_ms, ws);
        }
        let own_eta = limit.and_then(|l| pressure::leak_eta(&self.history.points(), l));
        let reported_eta = report.as_ref().and_then(|r| {
            let rate = r.leak_bytes_per_second?;
            // Device memory when the framework knows the device's size (a GPU, Apple's unified
            // memory); otherwise the leak is in this cgroup's working set (MLX on a CPU).
            match (r.reserved_bytes.or(r.allocated_bytes), r.total_bytes) {
                (Some(used), Some(total)) if total > 0 => {
                    pressure::reported_leak_eta(used, total, rate)
                }
                _ => pressure::reported_leak_eta(working_set?, limit?, rate),
            }
        });
        let seconds_to_limit = pressure::sooner(own_eta, reported_eta);
        let report_ratio = report.as_ref().and_then(|r| {
            let used = r.reserved_bytes.or(r.allocated_bytes)?;
            let total = r.total_bytes.filter(|&t| t > 0)?;
            Some(used as f64 / total as f64)
        });
        let gpu_ratio = match (gpu::max_ratio(&gpus), report_ratio) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let psi_used: Option<Psi> = psi_cgroup.or(psi_host);
        let inputs = Inputs {
            memory_ratio: sample.as_ref().and_then(MemorySample::ratio),
            psi_some_avg10: psi_used.and_then(|p| p.some).map(|s| s.avg10),
            gpu_ratio,
            seconds_to_limit,
            trainer_batch: report.as_ref().and_then(|r| r.batch_size),
        };
        Readings {
            gpu_used: gpus.iter().map(|g| g.used_bytes).max(),
            sample,
            clean_none,
            psi_cgroup,
            psi_host,
            gpus,
            report,
            limit,
            working_set,
            inputs,
        }
    }

    /// The state machine's step, then the sticky downgrade after an OOM; the new state is
    /// kept. Returns why, and whether the signal changed.
    fn assess(&mut self, r: &Readings, now_ms: u64) -> (String, bool) {
        let mut decision = pressure::assess(&self.state, &r.inputs, now_ms, &self.pressure);
        if decision.waiting_for_trainer && !self.waiting_for_trainer {
            tracing::info!(reason = %decision.reason, "downgrade due; waiting for the trainer to apply the last one");
        }
        self.waiting_for_trainer = decision.waiting_for_trainer;
        if let Some((state, why)) = self.after_oom(&decision.state, r.sample.as_ref(), now_ms) {
            decision.state = state;
            decision.reason = why;
        }
        if let Some(plan) = self.train_start(r) {
            if plan.planned
                && let (Some(batch), Some(accumulation), Some(ckpt)) = (
                    plan.batch_size,
                    plan.grad_accumulation,
                    plan.grad_checkpointing,
                )
            {
                // Never above a sticky downgrade: the rung above it ran out of memory.
                let sticky = decision.state.sticky.map_or(u64::MAX, |k| k.batch_size);
                if batch <= sticky {
                    decision.state.batch_size = batch;
                    decision.state.grad_accumulation = accumulation;
                    decision.state.grad_checkpointing = ckpt || decision.state.grad_checkpointing;
                    decision.reason = plan.reason.clone();
                }
            }
            self.train_start_reply = Some(plan);
        }
        if let Some(grow) = self.grow(&decision.state, r, now_ms) {
            tracing::info!(reason = %grow.reason, "micro-batch grown back");
            decision.state.batch_size = grow.batch_size;
            decision.state.grad_accumulation = grow.grad_accumulation;
            decision.reason = grow.reason;
        }
        let changed = decision.state.signal_differs(&self.state)
            || decision.state.sticky != self.state.sticky;
        self.state = decision.state;
        (decision.reason, changed)
    }

    /// The train-start decision, once, on the first config the trainer reported
    /// ([`crate::train_start`]), recorded in the status.
    fn train_start(&mut self, r: &Readings) -> Option<memguard_api::train_start::TrainStartPlan> {
        if self.train_start_decided {
            return None;
        }
        let config = self.shared.status().trainer_config.clone();
        if config.is_empty() {
            return None;
        }
        self.train_start_decided = true;
        let plan = crate::train_start::decide(&config, self.train_start_policy.as_ref(), r.limit);
        tracing::info!(planned = plan.planned, reason = %plan.reason, "train-start decision");
        self.shared.status().train_start = Some(plan.clone());
        Some(plan)
    }

    /// The growth rule's step on the state just assessed (downgrades included, so that a shrink
    /// lowers its ceiling first): a growth when the peaks measured at the current micro-batch
    /// show room for the next rung.
    fn grow(&mut self, state: &pressure::State, r: &Readings, now_ms: u64) -> Option<growth::Grow> {
        let configured = self
            .shared
            .status()
            .trainer_config
            .get("batch-size")
            .copied()
            .filter(|b| b.is_finite() && *b >= 1.0 && b.fract() == 0.0)
            .map(|b| b as u64);
        // Never above a sticky downgrade: the rung above it ran out of memory.
        let configured = match (configured, state.sticky) {
            (Some(c), Some(k)) => Some(c.min(k.batch_size)),
            (c, _) => c,
        };
        let trainer = r
            .report
            .as_ref()
            .and_then(|rep| Some((rep.step?, rep.batch_size?)));
        let observation = Observation {
            level: state.level,
            knobs: state.knobs(),
            configured_batch: configured,
            trainer,
            readings: growth_readings(r),
        };
        self.growth
            .observe(&observation, now_ms, &self.growth_config)
    }

    /// What this step saw, into the status the metrics, the summary and the API read.
    fn record(&mut self, r: &Readings) {
        let mut st = self.shared.status();
        st.samples_total += 1;
        st.source_up = r.sample.is_some();
        let info = self.source.info();
        if st.source_info != Some(info) {
            st.source_info = Some(info);
            st.source = self.source.describe();
        }
        if let Some(ws) = r.working_set {
            st.peak_working_set = Some(st.peak_working_set.map_or(ws, |p| p.max(ws)));
        }
        if let Some(g) = r.gpu_used {
            st.gpu_peak = Some(st.gpu_peak.map_or(g, |p| p.max(g)));
        }
        st.downgrades = self.state.downgrades;
        st.growths = self.growth.growths;
        st.growth_ceiling = self.growth.ceiling();
        st.sticky_batch_size = self.state.sticky.map(|k| k.batch_size);
        st.max_level = st.max_level.max(self.state.level);
        st.seconds_to_limit = r.inputs.seconds_to_limit;
        st.waiting_for_trainer = self.waiting_for_trainer;
        st.psi_cgroup = r.psi_cgroup;
        st.psi_host = r.psi_host;
        st.gpus = r.gpus.clone();
        if r.sample.is_some() {
            st.sample = r.sample.clone();
        }
    }

    /// The next signal (seq + 1) from the new state, logged, marked in the trace, sent to the
    /// API's watchers and queued for the file.
    fn publish(&mut self, r: &Readings, reason: String, now_ms: u64) {
        let mut next = self.shared.signal.borrow().clone();
        next.seq += 1;
        next.level = self.state.level;
        next.batch_size = self.state.batch_size;
        next.grad_accumulation = self.state.grad_accumulation;
        next.grad_checkpointing = self.state.grad_checkpointing;
        next.sticky = self.state.sticky;
        next.reason = reason;
        next.pressure = Pressure {
            memory_ratio: r.inputs.memory_ratio,
            working_set_bytes: r.working_set,
            limit_bytes: r.limit,
            psi_some_avg10: r.inputs.psi_some_avg10,
            gpu_ratio: r.inputs.gpu_ratio,
            seconds_to_limit: r.inputs.seconds_to_limit,
        };
        next.timestamp = now_rfc3339();
        tracing::info!(
            seq = next.seq,
            level = %next.level,
            batch_size = next.batch_size,
            grad_accumulation = next.grad_accumulation,
            reason = %next.reason,
            "signal"
        );
        self.shared
            .trace()
            .mark(now_ms * 1000, next.level, &next.reason);
        self.shared.signal.send_replace(next);
        self.pending_write = true;
    }

    /// A PSI file's figures. Absent (PSI off, a v1 cgroup, a cgroup gone) is `None`, quietly;
    /// a file that cannot be read or holds no `some` line is counted (`sample_errors_total`,
    /// kind `psi`) and logged like any sampler failure, and also `None`.
    fn read_psi(&mut self, path: Option<PathBuf>) -> Option<Psi> {
        match psi::read_psi(&path?) {
            Ok(p) => p,
            Err(e) => {
                self.sample_error("psi", &e);
                None
            }
        }
    }

    /// A failed read is not "gone": only a clean `Ok(None)` after a sample was seen is.
    fn gone(&mut self, sample: &Option<MemorySample>, clean_none: bool) -> Tick {
        match sample {
            Some(s) => {
                self.seen_sample = true;
                match s.populated {
                    Some(true) => self.seen_populated = true,
                    Some(false) if self.seen_populated => return Tick::TrainerGone,
                    _ => {}
                }
                Tick::Running
            }
            None if self.seen_sample && clean_none => Tick::TrainerGone,
            None => Tick::Running,
        }
    }
}

/// The peaks the growth rule measures this step: the cgroup's working set (or its peak since the
/// previous sample) against its limit, and the most loaded device (the trainer's reserved peak,
/// or NVML's used) against its size. A memory whose figure or budget was not read is left out.
fn growth_readings(r: &Readings) -> Vec<Reading> {
    let mut out = Vec::new();
    if let (Some(s), Some(limit)) = (r.sample.as_ref(), r.limit.filter(|&l| l > 0))
        && let Some(ws) = s.working_set_bytes
    {
        let used = ws.max(s.interval_peak_working_set_bytes.unwrap_or(0));
        out.push(Reading {
            memory: Memory::Cgroup,
            used,
            budget: limit,
        });
    }
    let reported = r.report.as_ref().and_then(|rep| {
        let used = rep
            .reserved_peak_bytes
            .or(rep.reserved_bytes)
            .max(rep.peak_bytes)?;
        Some((used, rep.total_bytes.filter(|&t| t > 0)?))
    });
    let nvml = r
        .gpus
        .iter()
        .filter(|g| g.total_bytes > 0)
        .map(|g| (g.used_bytes, g.total_bytes));
    let device = reported
        .into_iter()
        .chain(nvml)
        .max_by(|a, b| (a.0 as f64 / a.1 as f64).total_cmp(&(b.0 as f64 / b.1 as f64)));
    if let Some((used, budget)) = device {
        out.push(Reading {
            memory: Memory::Device,
            used,
            budget,
        });
    }
    out
}

/// The starting signal: the configured knobs, or, when the file already holds a signal of this
/// schema (the sidecar restarted), its knobs and a higher seq so readers see a newer signal.
pub fn starting_signal(existing: Option<&str>, batch: u64, accum: u64, ckpt: bool) -> Signal {
    let mut s = Signal::initial(batch, accum, ckpt);
    if let Some(old) = existing.and_then(|t| serde_json::from_str::<Signal>(t).ok())
        && old.version == s.version
    {
        // A corrupt or hostile file may hold the largest seq: saturate rather than overflow.
        s.seq = old.seq.saturating_add(1);
        s.batch_size = old.batch_size.max(1);
        s.grad_accumulation = old.grad_accumulation.max(1);
        s.grad_checkpointing = old.grad_checkpointing;
        // The sticky downgrade after an OOM holds for the pod's life, restarts included.
        s.sticky = old.sticky;
        if let Some(k) = old.sticky
            && s.batch_size > k.batch_size
        {
            s.batch_size = k.batch_size.max(1);
            s.grad_accumulation = k.grad_accumulation.max(1);
        }
        s.grad_checkpointing |= old.sticky.is_some_and(|k| k.grad_checkpointing);
        s.reason = format!(
            "sidecar restarted; keeping the configuration of signal {}",
            old.seq
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::growth::GrowthConfig;
    use crate::sample::gpu::{GpuError, GpuMemory};
    use crate::sample::{Limit, SampleError};
    use memguard_api::Level;
    use memguard_api::policy::Thresholds;

    /// Scripted memory: each call pops the next answer; the last one repeats.
    struct Script(Vec<Result<Option<MemorySample>, ()>>);

    impl MemorySource for Script {
        fn sample(&mut self) -> Result<Option<MemorySample>, SampleError> {
            let next = if self.0.len() > 1 {
                self.0.remove(0)
            } else {
                self.0[0].clone()
            };
            next.map_err(|_| SampleError::Parse {
                path: "memory.current".into(),
                what: "garbage".into(),
            })
        }
        fn describe(&self) -> String {
            "script".into()
        }
    }

    struct FakeGpu(Result<Vec<GpuMemory>, GpuError>);

    impl GpuSource for FakeGpu {
        fn sample(&mut self) -> Result<Vec<GpuMemory>, GpuError> {
            self.0.clone()
        }
        fn describe(&self) -> String {
            "fake".into()
        }
    }

    fn mem(ws: u64, populated: bool) -> Result<Option<MemorySample>, ()> {
        Ok(Some(MemorySample {
            usage_bytes: Some(ws),
            working_set_bytes: Some(ws),
            max: Some(Limit::Bytes(1000)),
            populated: Some(populated),
            ..Default::default()
        }))
    }

    fn engine(
        script: Vec<Result<Option<MemorySample>, ()>>,
        gpu: FakeGpu,
        dir: &std::path::Path,
    ) -> (Engine, Arc<Shared>) {
        let shared = Arc::new(Shared::new(Signal::initial(8, 2, false)));
        let e = Engine::new(
            Box::new(Script(script)),
            Box::new(gpu),
            PsiPaths::default(),
            PressureConfig::new(Thresholds::default()),
            SignalWriter::new(dir.join("signal.json")),
            shared.clone(),
        );
        (e, shared)
    }

    /// A guarded trainer (the sidecar at its floor, 1 × 1) reports 16 × 1 at train start under
    /// a roomy limit: the plan is published as the next signal, the reply carries it, and a
    /// second report does not decide again.
    #[test]
    fn the_first_reported_config_is_planned_once_and_published_as_a_signal() {
        let dir = tempfile::tempdir().expect("tempdir");
        let roomy = Ok(Some(MemorySample {
            usage_bytes: Some(1 << 30),
            working_set_bytes: Some(1 << 30),
            max: Some(Limit::Bytes(64 << 30)),
            populated: Some(true),
            ..Default::default()
        }));
        let shared = Arc::new(Shared::new(Signal::initial(1, 1, false)));
        let mut e = Engine::new(
            Box::new(Script(vec![roomy])),
            Box::new(FakeGpu(Ok(vec![]))),
            PsiPaths::default(),
            PressureConfig::new(Thresholds::default()),
            SignalWriter::new(dir.path().join("signal.json")),
            shared.clone(),
        )
        .with_train_start(Some(crate::train_start::tests::policy()));
        e.tick(0);
        assert!(
            shared.train_start.borrow().is_none(),
            "no config reported: no decision"
        );
        assert_eq!(shared.signal.borrow().seq, 0);
        shared.status().trainer_config = crate::train_start::tests::tiny_llama();
        e.tick(100);
        let s = on_disk(dir.path());
        assert_eq!((s.seq, s.batch_size, s.grad_accumulation), (1, 16, 1));
        assert!(
            s.reason.starts_with("train-start plan: fits as configured"),
            "{}",
            s.reason
        );
        let reply = shared.train_start.borrow().clone().expect("a reply");
        assert!(reply.train_start.planned && reply.train_start.fits == Some(true));
        assert_eq!(reply.signal, *shared.signal.borrow());
        assert_eq!(shared.status().train_start, Some(reply.train_start.clone()));
        // Another rank's report, or the same trainer again: decided already.
        let mut other = crate::train_start::tests::tiny_llama();
        other.insert("batch-size".into(), 2.0);
        shared.status().trainer_config = other;
        e.tick(200);
        assert_eq!(shared.signal.borrow().seq, 1);
        assert_eq!(shared.status().train_start, Some(reply.train_start));
    }

    fn on_disk(dir: &std::path::Path) -> Signal {
        serde_json::from_str(&std::fs::read_to_string(dir.join("signal.json")).expect("file"))
            .expect("json")
    }

    #[test]
    fn writes_the_start_then_a_downgrade_then_nothing_while_unchanged() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut e, shared) = engine(
            vec![mem(100, true), mem(860, true), mem(870, true)],
            FakeGpu(Ok(vec![])),
            dir.path(),
        );
        e.flush();
        assert_eq!(on_disk(dir.path()).seq, 0);
        assert_eq!(e.tick(0), Tick::Running);
        assert_eq!(on_disk(dir.path()).seq, 0, "ok stays ok: no new signal");
        e.tick(100);
        let s = on_disk(dir.path());
        assert_eq!(
            (s.seq, s.level, s.batch_size, s.grad_accumulation),
            (1, Level::Downgrade, 4, 4)
        );
        assert_eq!(s.pressure.working_set_bytes, Some(860));
        assert_eq!(s.pressure.limit_bytes, Some(1000));
        e.tick(200);
        assert_eq!(
            on_disk(dir.path()).seq,
            1,
            "cooling down: unchanged, not rewritten"
        );
        assert_eq!(*shared.signal.borrow(), s);
        assert_eq!(shared.status().downgrades, 1);
    }

    fn killed(ws: u64, oom_kill: u64, populated: bool) -> Result<Option<MemorySample>, ()> {
        let mut s = mem(ws, populated).expect("ok").expect("some");
        s.events.oom_kill = Some(oom_kill);
        Ok(Some(s))
    }

    #[test]
    fn an_oom_kill_between_samples_writes_a_sticky_downgrade_even_as_the_trainer_goes() {
        let dir = tempfile::tempdir().expect("tempdir");
        // The spike came and went between two samples: only the counter tells, and the cgroup
        // is already empty in the same sample.
        let (mut e, shared) = engine(
            vec![killed(100, 3, true), killed(0, 4, false)],
            FakeGpu(Ok(vec![])),
            dir.path(),
        );
        e.flush();
        assert_eq!(e.tick(0), Tick::Running);
        assert_eq!(e.tick(100), Tick::TrainerGone);
        let s = on_disk(dir.path());
        assert_eq!(
            (s.seq, s.level, s.batch_size, s.grad_accumulation),
            (1, Level::Downgrade, 4, 4)
        );
        assert!(
            s.reason
                .starts_with("OOM kill in the trainer's cgroup (oom_kill 3 -> 4)"),
            "{}",
            s.reason
        );
        assert_eq!(shared.status().sticky_batch_size, Some(4));
    }

    #[test]
    fn an_oom_kill_is_recorded_with_the_phase_last_reported_and_none_when_none_was() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut e, shared) = engine(
            vec![
                killed(100, 0, true),
                killed(100, 1, true),
                killed(100, 2, true),
            ],
            FakeGpu(Ok(vec![])),
            dir.path(),
        );
        e.tick(0);
        e.tick(100);
        assert_eq!(shared.status().oom_kills, 1);
        assert_eq!(
            shared.status().oom_kill_phase,
            None,
            "no phase reported: none recorded"
        );
        shared.status().phase = Some(memguard_api::TrainerPhase::Save);
        e.tick(200);
        let st = shared.status();
        assert_eq!(st.oom_kills, 2);
        assert_eq!(st.oom_kill_phase, Some(memguard_api::TrainerPhase::Save));
        let summary = crate::summary::build(&st, &shared.signal.borrow(), None, "sigterm");
        assert!(
            crate::summary::to_line(&summary).contains(r#""oom_kill_phase":"save""#),
            "{summary:?}"
        );
    }

    #[test]
    fn a_kill_the_trainer_reports_after_is_a_workers_and_no_restart_is_awaited() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut e, shared) = engine(
            vec![
                killed(100, 0, true),
                killed(100, 1, true),
                killed(0, 1, false),
            ],
            FakeGpu(Ok(vec![])),
            dir.path(),
        );
        shared.status().reports_total = 5;
        e.tick(0);
        e.tick(100);
        assert_eq!(shared.status().oom_kills, 1);
        assert!(
            e.trainer_died_of_oom(),
            "no word from the trainer since the kill"
        );
        // The trainer reports on: the kill was a worker's, and it runs the sticky downgrade.
        shared.status().reports_total = 6;
        assert_eq!(e.tick(200), Tick::TrainerGone);
        assert!(
            !e.trainer_died_of_oom(),
            "it left on its own after the kill"
        );
    }

    /// Scripted memory read from a cgroup directory that is created anew at each restart
    /// (`forget`), as a runtime recreates a restarted container's cgroup.
    struct Restarting {
        script: Script,
        dirs: Vec<std::path::PathBuf>,
        at: usize,
    }

    impl MemorySource for Restarting {
        fn sample(&mut self) -> Result<Option<MemorySample>, SampleError> {
            self.script.sample()
        }
        fn describe(&self) -> String {
            "restarting".into()
        }
        fn cgroup_dir(&self) -> Option<&Path> {
            self.dirs.get(self.at).map(|d| d.as_path())
        }
        fn forget(&mut self) {
            self.at += 1;
        }
    }

    #[test]
    fn each_kill_of_a_trainer_restarted_in_new_cgroups_is_counted_once() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dirs: Vec<_> = (0..3).map(|i| tmp.path().join(format!("cg{i}"))).collect();
        for d in &dirs {
            std::fs::create_dir(d).expect("mkdir");
        }
        let shared = Arc::new(Shared::new(Signal::initial(8, 1, false)));
        let script = Script(vec![
            // The first cgroup, seen with 2 kills from before the sidecar: not this run's.
            killed(100, 2, true),
            killed(0, 3, false),
            // The restart's new cgroup: its counter starts at 0; it was killed before it was
            // first sampled, and once more later.
            killed(100, 1, true),
            killed(100, 1, true),
            killed(0, 2, false),
            // The third cgroup: no kill, it finishes.
            killed(100, 0, true),
            killed(0, 0, false),
        ]);
        let mut e = Engine::new(
            Box::new(Restarting {
                script,
                dirs,
                at: 0,
            }),
            Box::new(FakeGpu(Ok(vec![]))),
            PsiPaths::default(),
            PressureConfig::new(Thresholds::default()),
            SignalWriter::new(tmp.path().join("signal.json")),
            shared.clone(),
        );
        let mut t = 0;
        let mut step = |e: &mut Engine| {
            t += 100;
            e.tick(t)
        };
        assert_eq!(step(&mut e), Tick::Running);
        assert_eq!(step(&mut e), Tick::TrainerGone);
        assert!(e.trainer_died_of_oom(), "3 -> 4 in its cgroup");
        e.trainer_left();
        assert!(!e.has_trainer() && !e.trainer_died_of_oom());
        assert_eq!(step(&mut e), Tick::Running);
        assert_eq!(
            shared.status().oom_kills,
            2,
            "the new cgroup's first kill counts"
        );
        assert_eq!(step(&mut e), Tick::Running);
        assert_eq!(step(&mut e), Tick::TrainerGone);
        assert_eq!(shared.status().oom_kills, 3);
        e.trainer_left();
        assert_eq!(step(&mut e), Tick::Running);
        assert_eq!(step(&mut e), Tick::TrainerGone);
        assert!(!e.trainer_died_of_oom(), "the last start finished");
        assert_eq!(shared.status().oom_events(), 3);
        assert_eq!(
            shared.status().sticky_batch_size,
            Some(1),
            "8 -> 4 -> 2 -> 1"
        );
    }

    #[test]
    fn a_reported_oom_record_writes_a_sticky_downgrade_below_the_trainers_config() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut e, shared) = engine(vec![mem(100, true)], FakeGpu(Ok(vec![])), dir.path());
        e.tick(0);
        let mut record: memguard_api::OomRecord =
            serde_json::from_str(include_str!("../../api/fixtures/oom-record-v1.json"))
                .expect("fixture");
        record.batch_size = 8;
        record.grad_accumulation = 2;
        record.outcome = memguard_api::OomOutcome::Recovered;
        record.new_batch_size = Some(2);
        shared.status().pending_oom = Some(record);
        e.tick(100);
        let s = on_disk(dir.path());
        assert_eq!((s.batch_size, s.grad_accumulation), (2, 8));
        assert!(
            s.reason
                .contains("trainer reported a recovered cuda_oom at step 412"),
            "{}",
            s.reason
        );
        assert!(shared.status().pending_oom.is_none(), "taken once");
        e.tick(10_000);
        assert_eq!(on_disk(dir.path()).batch_size, 2, "never relaxed");
    }

    /// An OOM record whose batch × accumulation is not the effective batch in force (1 × 1
    /// against 8 × 2) does not set the sticky downgrade: refused, logged and counted; the
    /// config in force steps down instead, effective batch kept.
    #[test]
    fn an_oom_record_that_breaks_the_effective_batch_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut e, shared) = engine(vec![mem(100, true)], FakeGpu(Ok(vec![])), dir.path());
        e.tick(0);
        let mut record: memguard_api::OomRecord =
            serde_json::from_str(include_str!("../../api/fixtures/oom-record-v1.json"))
                .expect("fixture");
        record.batch_size = 1;
        record.grad_accumulation = 1;
        record.new_batch_size = None;
        shared.status().pending_oom = Some(record);
        e.tick(100);
        let s = on_disk(dir.path());
        assert_eq!((s.batch_size, s.grad_accumulation), (4, 4), "8 × 2 halved");
        let st = shared.status();
        assert_eq!(st.oom_records_refused, 1);
        assert!(
            crate::metrics::render(&st, &s).contains("oom_records_refused_total 1"),
            "the metric says so"
        );
    }

    /// A recovery batch that does not divide the effective batch is not taken either.
    #[test]
    fn a_new_batch_that_does_not_divide_the_effective_batch_is_ignored() {
        let start = pressure::State::new(8, 2, false);
        let in_force = start.knobs();
        let s = pressure::sticky_downgrade(&start, in_force, Some(3), 0);
        assert_eq!((s.batch_size, s.grad_accumulation), (4, 4));
    }

    #[test]
    fn the_gpu_path_downgrades_on_device_memory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let gpu = FakeGpu(Ok(vec![GpuMemory {
            uuid: "GPU-1".into(),
            used_bytes: 77,
            total_bytes: 80,
        }]));
        let (mut e, shared) = engine(vec![mem(100, true)], gpu, dir.path());
        e.tick(0);
        let s = shared.signal.borrow().clone();
        assert_eq!(s.level, Level::Critical);
        assert!(s.reason.contains("GPU memory 0.96"), "{}", s.reason);
        assert_eq!(shared.status().gpu_peak, Some(77));
    }

    #[test]
    fn without_nvml_the_dmem_controller_of_the_trainers_cgroup_is_the_gpu_figure() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cg = dir.path().join("trainer");
        std::fs::create_dir(&cg).expect("mkdir");
        std::fs::write(cg.join("dmem.current"), "drm/0000:03:00.0/vram0 77\n").expect("w");
        std::fs::write(cg.join("dmem.max"), "drm/0000:03:00.0/vram0 80\n").expect("w");
        let source = Restarting {
            script: Script(vec![mem(100, true)]),
            dirs: vec![cg],
            at: 0,
        };
        let shared = Arc::new(Shared::new(Signal::initial(8, 2, false)));
        let mut e = Engine::new(
            Box::new(source),
            Box::new(FakeGpu(Ok(Vec::new()))),
            PsiPaths::default(),
            PressureConfig::new(Thresholds::default()),
            SignalWriter::new(dir.path().join("signal.json")),
            shared.clone(),
        );
        e.tick(0);
        let s = shared.signal.borrow().clone();
        assert_eq!(s.level, Level::Critical);
        assert!(s.reason.contains("GPU memory 0.96"), "{}", s.reason);
        assert_eq!(shared.status().gpus[0].uuid, "drm/0000:03:00.0/vram0");
    }

    /// Two ranks importing and loading their model climb steadily before the first step: the
    /// climb reaches the limit within the leak horizon, and is no leak. Only what the working
    /// set does once the trainer reports it steps is extrapolated.
    #[test]
    fn the_climb_before_the_first_step_is_not_taken_for_a_leak() {
        let dir = tempfile::tempdir().expect("tempdir");
        // 1000 + 125 a second of 10 000: 52 s to the limit at 20 s, the 60 s horizon's reach;
        // a ratio under the downgrade threshold all along.
        let climb: Vec<_> = (0..60u64)
            .map(|i| {
                Ok(Some(MemorySample {
                    usage_bytes: Some(1000 + 125 * i),
                    working_set_bytes: Some(1000 + 125 * i),
                    max: Some(Limit::Bytes(10_000)),
                    populated: Some(true),
                    ..Default::default()
                }))
            })
            .collect();
        let (mut e, shared) = engine(climb, FakeGpu(Ok(vec![])), dir.path());
        for i in 0..30 {
            if i == 10 {
                // The client attached (an HF Trainer): still loading.
                shared.status().phase = Some(memguard_api::TrainerPhase::Load);
            }
            e.tick(i * 1000);
            assert_eq!(shared.signal.borrow().batch_size, 8, "tick {i}: loading");
        }
        assert_eq!(shared.status().seconds_to_limit, None);
        shared.status().phase = Some(memguard_api::TrainerPhase::Step);
        // Stepping from tick 30: the rule needs 20 s of steps before it sees a trend.
        for i in 30..50 {
            e.tick(i * 1000);
            assert_eq!(
                shared.signal.borrow().batch_size,
                8,
                "tick {i}: too few steps"
            );
        }
        e.tick(50_000);
        let s = shared.signal.borrow().clone();
        assert_eq!(
            (s.level, s.batch_size),
            (Level::Downgrade, 4),
            "{}",
            s.reason
        );
        assert!(s.reason.contains("steady growth"), "{}", s.reason);
        // A trainer restarted in place loads anew: what the last one reported no longer says.
        shared.status().step_reported = true;
        e.trainer_left();
        let st = shared.status();
        assert_eq!((st.phase, st.step_reported), (None, false));
        drop(st);
        assert!(e.history.points().is_empty());
    }

    #[test]
    fn a_leak_the_trainer_reports_downgrades_through_the_leak_horizon() {
        let dir = tempfile::tempdir().expect("tempdir");
        // Working set 500 of 1000: no pressure of its own, and no history to see a growth in.
        let (mut e, shared) = engine(vec![mem(500, true)], FakeGpu(Ok(vec![])), dir.path());
        e.tick(0);
        assert_eq!(shared.signal.borrow().level, Level::Ok);
        let slow = memguard_api::Report {
            framework: Some("mlx".into()),
            leak_bytes_per_second: Some(1), // 500 s to the limit: beyond the 60 s horizon
            ..Default::default()
        };
        shared.status().report = Some(slow);
        e.tick(1000);
        assert_eq!(shared.signal.borrow().level, Level::Ok);
        assert_eq!(shared.status().seconds_to_limit, Some(500.0));
        let fast = memguard_api::Report {
            framework: Some("mlx".into()),
            leak_bytes_per_second: Some(10), // 50 s to the cgroup limit
            ..Default::default()
        };
        shared.status().report = Some(fast);
        e.tick(2000);
        let s = shared.signal.borrow().clone();
        assert_eq!((s.level, s.batch_size), (Level::Downgrade, 4));
        assert!(s.reason.contains("steady growth"), "{}", s.reason);
        assert_eq!(s.pressure.seconds_to_limit, Some(50.0));
        // With the device's size in the report the leak is measured against the device.
        shared.status().report = Some(memguard_api::Report {
            allocated_bytes: Some(90),
            total_bytes: Some(100),
            leak_bytes_per_second: Some(1),
            ..Default::default()
        });
        e.tick(3000);
        assert_eq!(shared.status().seconds_to_limit, Some(10.0));
    }

    #[test]
    fn the_next_downgrade_waits_for_the_trainer_to_report_the_last_one_applied() {
        let dir = tempfile::tempdir().expect("tempdir");
        // 880 of 1000 all along: downgrade pressure that only the trainer can relieve.
        let (mut e, shared) = engine(vec![mem(880, true)], FakeGpu(Ok(vec![])), dir.path());
        let runs = |batch| {
            Some(memguard_api::Report {
                batch_size: Some(batch),
                step: Some(1),
                ..Default::default()
            })
        };
        shared.status().report = runs(8);
        e.tick(0);
        assert_eq!(shared.signal.borrow().batch_size, 4);
        // A cooldown later the trainer still runs 8: no second halving, and it shows.
        e.tick(31_000);
        assert_eq!(shared.signal.borrow().batch_size, 4);
        assert!(shared.status().waiting_for_trainer);
        let metrics = crate::metrics::render(&shared.status(), &shared.signal.borrow());
        assert!(
            metrics.contains("memguard_sidecar_waiting_for_trainer 1"),
            "{metrics}"
        );
        // It applies at 40 s; the cooldown counts from then.
        shared.status().report = runs(4);
        e.tick(40_000);
        assert!(!shared.status().waiting_for_trainer);
        e.tick(69_000);
        assert_eq!(shared.signal.borrow().batch_size, 4);
        e.tick(70_000);
        assert_eq!(shared.signal.borrow().batch_size, 2);
        assert_eq!(on_disk(dir.path()).batch_size, 2);
    }

    #[test]
    fn sampler_failures_are_counted_and_survived() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut e, shared) = engine(
            vec![Err(()), Err(()), mem(100, true)],
            FakeGpu(Err(GpuError("lost".into()))),
            dir.path(),
        );
        assert_eq!(e.tick(0), Tick::Running);
        assert_eq!(e.tick(100), Tick::Running);
        assert_eq!(e.tick(200), Tick::Running);
        let st = shared.status();
        assert_eq!(st.sample_errors.get("parse"), Some(&2));
        assert_eq!(st.sample_errors.get("gpu"), Some(&3));
        assert_eq!(st.samples_total, 3);
    }

    /// PSI that is not there (PSI off, a v1 cgroup) is quiet; PSI that is there but cannot be
    /// read, or reads as garbage, is counted like any sampler failure.
    #[test]
    fn psi_read_failures_are_counted_and_absent_psi_is_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let garbage = dir.path().join("memory.pressure");
        std::fs::write(&garbage, "not psi at all\n").expect("write");
        let shared = Arc::new(Shared::new(Signal::initial(8, 2, false)));
        let mut e = Engine::new(
            Box::new(Script(vec![mem(100, true)])),
            Box::new(FakeGpu(Ok(vec![]))),
            PsiPaths {
                cgroup: Some(garbage.clone()),
                // A directory where the file should be: read fails (EISDIR).
                host: Some(dir.path().to_path_buf()),
            },
            PressureConfig::new(Thresholds::default()),
            SignalWriter::new(dir.path().join("signal.json")),
            shared.clone(),
        );
        e.tick(0);
        e.tick(100);
        assert_eq!(shared.status().sample_errors.get("psi"), Some(&4));
        std::fs::write(
            &garbage,
            "some avg10=12.50 avg60=3.00 avg300=1.00 total=1000\n\
             full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        )
        .expect("write");
        e.tick(200);
        assert_eq!(
            shared.status().sample_errors.get("psi"),
            Some(&5),
            "only the host's"
        );
        assert_eq!(
            shared
                .status()
                .psi_cgroup
                .and_then(|p| p.some)
                .map(|s| s.avg10),
            Some(12.5)
        );
        let mut quiet = Engine::new(
            Box::new(Script(vec![mem(100, true)])),
            Box::new(FakeGpu(Ok(vec![]))),
            PsiPaths {
                cgroup: Some(dir.path().join("gone/memory.pressure")),
                host: None,
            },
            PressureConfig::new(Thresholds::default()),
            SignalWriter::new(dir.path().join("signal2.json")),
            shared.clone(),
        );
        quiet.tick(300);
        assert_eq!(
            shared.status().sample_errors.get("psi"),
            Some(&5),
            "absent: not counted"
        );
    }

    #[test]
    fn an_emptied_cgroup_ends_the_run_only_after_it_held_the_trainer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut e, _) = engine(
            vec![mem(0, false), mem(100, true), mem(0, false)],
            FakeGpu(Ok(vec![])),
            dir.path(),
        );
        assert_eq!(e.tick(0), Tick::Running, "trainer not started yet");
        assert_eq!(e.tick(100), Tick::Running);
        assert_eq!(e.tick(200), Tick::TrainerGone);
        let (mut e, _) = engine(
            vec![mem(100, true), Ok(None)],
            FakeGpu(Ok(vec![])),
            dir.path(),
        );
        assert_eq!(e.tick(0), Tick::Running);
        assert_eq!(e.tick(100), Tick::TrainerGone, "cgroup removed");
    }

    #[test]
    fn a_restarted_sidecar_continues_the_sequence_and_keeps_the_knobs() {
        let old = r#"{"version":1,"seq":4,"level":"downgrade","batch_size":2,"grad_accumulation":8,
            "grad_checkpointing":true,"reason":"x","pressure":{},"timestamp":"t"}"#;
        let s = starting_signal(Some(old), 8, 2, false);
        assert_eq!(
            (s.seq, s.batch_size, s.grad_accumulation, s.level),
            (5, 2, 8, Level::Ok)
        );
        assert!(s.grad_checkpointing);
        let s = starting_signal(Some("not json"), 8, 2, false);
        assert_eq!((s.seq, s.batch_size), (0, 8));
    }

    #[test]
    fn a_signal_file_holding_the_largest_seq_does_not_overflow() {
        // Found by reading for the fuzz target `signal_report`: `seq + 1` on u64::MAX.
        let text = include_str!("../../api/fixtures/signal-v1.json")
            .replace("\"seq\": 3", &format!("\"seq\": {}", u64::MAX));
        assert!(
            text.contains(&u64::MAX.to_string()),
            "the fixture's seq was replaced"
        );
        let s = starting_signal(Some(&text), 8, 2, false);
        assert_eq!(s.seq, u64::MAX);
        assert_eq!(s.batch_size, 4, "the kept knobs still apply");
    }

    /// The trainer, configured at 16, admitted at 2 × 8: with room measured over its steps it
    /// grows back 4, 8, 16, the effective batch kept, and never above 16; a downgrade then lowers the ceiling so 16 is not tried
    /// again. Counted in the metrics and the summary.
    #[test]
    fn measured_room_grows_the_batch_back_and_a_downgrade_lowers_the_ceiling() {
        let dir = tempfile::tempdir().expect("tempdir");
        let shared = Arc::new(Shared::new(Signal::initial(2, 8, false)));
        // 300 of 1000 for 120 samples, then 900: pressure.
        let mut script = vec![mem(300, true); 120];
        script.push(mem(900, true));
        let mut e = Engine::new(
            Box::new(Script(script)),
            Box::new(FakeGpu(Ok(vec![]))),
            PsiPaths::default(),
            PressureConfig::new(Thresholds::default()),
            SignalWriter::new(dir.path().join("signal.json")),
            shared.clone(),
        )
        .with_growth(GrowthConfig {
            min_window_ms: 500,
            ..GrowthConfig::new(0.70)
        });
        let mut batches = Vec::new();
        let mut step = 0;
        for i in 0..80u64 {
            // The trainer runs what the signal says, one step per sample.
            let running = shared.signal.borrow().batch_size;
            step += 1;
            shared.status().report = Some(memguard_api::Report {
                step: Some(step),
                batch_size: Some(running),
                ..Default::default()
            });
            if i == 5 {
                // Its config arrives at train start; until then the ceiling is unknown.
                assert_eq!(
                    shared.signal.borrow().batch_size,
                    2,
                    "no growth while unknown"
                );
                shared.status().trainer_config = [("batch-size".to_string(), 16.0)].into();
            }
            e.tick(i * 100);
            let s = shared.signal.borrow().clone();
            assert_eq!(s.effective_batch(), 16, "sample {i}");
            batches.push(s.batch_size);
        }
        batches.dedup();
        assert_eq!(batches, [2, 4, 8, 16]);
        let s = on_disk(dir.path());
        assert_eq!(
            (s.batch_size, s.grad_accumulation, s.level),
            (16, 1, Level::Ok)
        );
        assert!(s.reason.contains("batch 8 -> 16"), "{}", s.reason);
        assert_eq!(shared.status().growths, 3);
        // Pressure: down to 8, and 16 is off the table for the run even once it is gone.
        for i in 80..400u64 {
            let running = shared.signal.borrow().batch_size;
            step += 1;
            shared.status().report = Some(memguard_api::Report {
                step: Some(step),
                batch_size: Some(running),
                ..Default::default()
            });
            e.tick(i * 100);
        }
        let s = shared.signal.borrow().clone();
        assert!(s.batch_size <= 8, "{s:?}");
        let st = shared.status();
        assert!(st.growth_ceiling.is_some_and(|c| c < 16));
        assert_eq!(st.growths, 3);
        let metrics = crate::metrics::render(&st, &s);
        assert!(
            metrics.contains("memguard_sidecar_growths_total 3"),
            "{metrics}"
        );
        assert!(
            metrics.contains("memguard_sidecar_growth_ceiling 15"),
            "{metrics}"
        );
        assert_eq!(crate::summary::build(&st, &s, None, "x").growths, 3);
    }

    /// Fault injection (docs/reliability.md): the clock the loop passes jumps forward by days and
    /// back again while the pressure holds. No panic; the batch never grows back under pressure;
    /// each change is a newer seq, on disk as in memory.
    #[test]
    fn the_clock_jumping_back_and_forth_under_pressure() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut e, shared) = engine(vec![mem(900, true)], FakeGpu(Ok(vec![])), dir.path());
        e.flush();
        const DAY: u64 = 86_400_000;
        let times = [
            0,
            100,
            50,
            0,
            3 * DAY,
            3 * DAY + 10,
            DAY,
            0,
            400 * DAY,
            400 * DAY - 1,
            10,
            3650 * DAY,
        ];
        let mut last_seq = 0;
        let mut last_batch = 8;
        for (i, now) in times.into_iter().enumerate() {
            assert_eq!(e.tick(now), Tick::Running, "tick {i} at {now}");
            let sig = shared.signal.borrow().clone();
            assert!(sig.level >= Level::Downgrade, "tick {i}: {sig:?}");
            assert!(
                sig.batch_size <= last_batch,
                "tick {i}: grew back under pressure"
            );
            assert_eq!(sig.effective_batch(), 16, "tick {i}: effective batch kept");
            assert!(sig.seq >= last_seq);
            assert_eq!(on_disk(dir.path()), sig, "tick {i}: the file follows");
            (last_seq, last_batch) = (sig.seq, sig.batch_size);
        }
        assert_eq!(last_batch, 1, "repeated downgrades reached the floor");
    }
}
