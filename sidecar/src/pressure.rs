//! The pressure state machine: figures in, a level and the recommended knobs out. Pure: no
//! I/O, no clock (time is passed in as milliseconds).
//!
//! Each source gives a pressure figure (working set / effective limit, PSI `some avg10`, GPU
//! used/total, time to the limit of a steady growth). The level is the worst of them, with
//! hysteresis: a level is left only when its figure falls below its threshold minus a margin,
//! and has stayed there for a hold time (a trainer's memory swings with every micro-batch;
//! without the hold the level would flap at the sampling rate).
//! At `downgrade` or above, the batch is halved (floor 1) and accumulation doubled so the
//! effective batch is kept; then a cooldown must pass before the next downgrade (entering
//! `critical` skips it once). At batch 1, gradient checkpointing is the last lever.
//!
//! A trainer applies a downgrade at its next step boundary, which on a loaded machine or with
//! long steps can be later than the cooldown. When it reports the batch it runs, the next
//! downgrade waits until that batch is the one recommended, and the cooldown counts from when
//! it was: otherwise pressure the trainer has not yet had the chance to relieve is answered
//! again (seen: 32 → 8 where 32 → 16 was enough). The wait is bounded
//! ([`PressureConfig::apply_wait_ms`]), for a trainer that reports but never applies, and
//! entering `critical` does not wait.

use memguard_api::policy::Thresholds;
use memguard_api::{Level, TrainerPhase};
use std::collections::VecDeque;

/// Policy settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PressureConfig {
    /// Ratio thresholds and the PSI threshold.
    pub thresholds: Thresholds,
    /// A level is left only below its threshold minus this (ratio units; default 0.05).
    pub hysteresis: f64,
    /// Least milliseconds between two downgrades.
    pub cooldown_ms: u64,
    /// Milliseconds the figures must allow a lower level before the level falls.
    pub relax_after_ms: u64,
    /// A steady growth reaching the limit within this many seconds counts as downgrade pressure.
    pub leak_horizon_s: f64,
    /// The longest a downgrade waits for the trainer to apply the previous one (milliseconds
    /// after it was issued).
    pub apply_wait_ms: u64,
}

impl PressureConfig {
    /// Defaults: 0.05 hysteresis, 30 s cooldown, 5 s hold before a level falls, 60 s leak
    /// horizon, and a wait for the trainer of four cooldowns.
    pub fn new(thresholds: Thresholds) -> Self {
        PressureConfig::with_cooldown(thresholds, 30_000)
    }

    /// The defaults with another cooldown; the trainer is waited for four cooldowns (a step with
    /// accumulation can take minutes; `critical` does not wait).
    pub fn with_cooldown(thresholds: Thresholds, cooldown_ms: u64) -> Self {
        PressureConfig {
            thresholds,
            hysteresis: 0.05,
            cooldown_ms,
            relax_after_ms: 5_000,
            leak_horizon_s: 60.0,
            apply_wait_ms: cooldown_ms.saturating_mul(4),
        }
    }
}

/// The figures of one assessment. `None`: not known from that source.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Inputs {
    /// Working set / effective limit.
    pub memory_ratio: Option<f64>,
    /// PSI memory `some avg10`, percent.
    pub psi_some_avg10: Option<f64>,
    /// GPU used / total (the most loaded device).
    pub gpu_ratio: Option<f64>,
    /// Seconds until the limit at a steady growth, when one is seen.
    pub seconds_to_limit: Option<f64>,
    /// The batch the trainer last reported running (`POST /v1/report`), when it reports one.
    pub trainer_batch: Option<u64>,
}

/// What the state machine remembers between assessments.
#[derive(Debug, Clone, PartialEq)]
pub struct State {
    /// The current level.
    pub level: Level,
    /// Recommended batch.
    pub batch_size: u64,
    /// Recommended accumulation.
    pub grad_accumulation: u64,
    /// Recommended checkpointing.
    pub grad_checkpointing: bool,
    /// When the last downgrade was issued (ms).
    pub last_downgrade_ms: Option<u64>,
    /// When the trainer was first seen running the batch of the last downgrade (ms).
    pub applied_ms: Option<u64>,
    /// Downgrades issued.
    pub downgrades: u64,
    /// Since when (ms) the figures have allowed a level below the current one.
    pub relax_since_ms: Option<u64>,
    /// The sticky downgrade after an OOM: the knobs are never relaxed above it for the pod's life.
    pub sticky: Option<Knobs>,
}

/// Batch, accumulation, checkpointing: the knobs the sidecar changes at run time
/// ([`memguard_api::knobs::RuntimeKnobs`]).
pub type Knobs = memguard_api::knobs::RuntimeKnobs;

impl State {
    /// The starting state.
    pub fn new(batch_size: u64, grad_accumulation: u64, grad_checkpointing: bool) -> Self {
        State {
            level: Level::Ok,
            batch_size: batch_size.max(1),
            grad_accumulation: grad_accumulation.max(1),
            grad_checkpointing,
            last_downgrade_ms: None,
            applied_ms: None,
            downgrades: 0,
            relax_since_ms: None,
            sticky: None,
        }
    }

    /// The state holding `sticky` (a sticky downgrade carried over a sidecar restart): the
    /// knobs are brought down to it at once.
    pub fn with_sticky(mut self, sticky: Option<Knobs>) -> Self {
        self.sticky = sticky;
        self.hold_sticky();
        self
    }

    /// The knobs recommended now.
    pub fn knobs(&self) -> Knobs {
        Knobs {
            batch_size: self.batch_size,
            grad_accumulation: self.grad_accumulation,
            grad_checkpointing: self.grad_checkpointing,
        }
    }

    fn hold_sticky(&mut self) {
        if let Some(s) = self.sticky
            && self.batch_size > s.batch_size
        {
            self.batch_size = s.batch_size;
            self.grad_accumulation = s.grad_accumulation;
        }
        if self.sticky.is_some_and(|s| s.grad_checkpointing) {
            self.grad_checkpointing = true;
        }
    }

    /// Whether the trainer-visible part (level and knobs) differs.
    pub fn signal_differs(&self, other: &State) -> bool {
        self.level != other.level
            || self.batch_size != other.batch_size
            || self.grad_accumulation != other.grad_accumulation
            || self.grad_checkpointing != other.grad_checkpointing
    }
}

/// The outcome of one assessment.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// The new state.
    pub state: State,
    /// Why, for a person.
    pub reason: String,
    /// A downgrade was issued now.
    pub downgraded: bool,
    /// A downgrade was due but waits for the trainer to apply the last one.
    pub waiting_for_trainer: bool,
}

fn ratio_level(r: f64, t: &Thresholds, margin: f64) -> Level {
    if r >= t.critical - margin {
        Level::Critical
    } else if r >= t.downgrade - margin {
        Level::Downgrade
    } else if r >= t.warn - margin {
        Level::Warn
    } else {
        Level::Ok
    }
}

/// The level the figures call for, and the figure responsible. `relaxed`: thresholds lowered by
/// the hysteresis margin (the level to keep, not to enter).
fn raw_level(i: &Inputs, c: &PressureConfig, relaxed: bool) -> (Level, String) {
    let t = &c.thresholds;
    let margin = if relaxed { c.hysteresis } else { 0.0 };
    let mut worst = (Level::Ok, String::from("no pressure"));
    let mut consider = |level: Level, why: String| {
        if level > worst.0 {
            worst = (level, why);
        }
    };
    if let Some(r) = i.memory_ratio {
        let l = ratio_level(r, t, margin);
        consider(
            l,
            format!(
                "working set {r:.2} of the limit ({l} at {:.2})",
                threshold(t, l)
            ),
        );
    }
    if let Some(r) = i.gpu_ratio {
        let l = ratio_level(r, t, margin);
        consider(
            l,
            format!("GPU memory {r:.2} used ({l} at {:.2})", threshold(t, l)),
        );
    }
    if let Some(p) = i.psi_some_avg10 {
        let limit = if relaxed {
            t.psi_some_avg10 * 0.5
        } else {
            t.psi_some_avg10
        };
        if t.psi_some_avg10 > 0.0 && p >= limit {
            consider(
                Level::Downgrade,
                format!(
                    "memory stall (PSI some avg10) {p:.1}% (threshold {:.1}%)",
                    t.psi_some_avg10
                ),
            );
        }
    }
    if let Some(s) = i.seconds_to_limit
        && s <= c.leak_horizon_s
    {
        consider(
            Level::Downgrade,
            format!("steady growth reaches the limit in {s:.0} s"),
        );
    }
    worst
}

fn threshold(t: &Thresholds, l: Level) -> f64 {
    match l {
        Level::Ok => 0.0,
        Level::Warn => t.warn,
        Level::Downgrade => t.downgrade,
        Level::Critical => t.critical,
    }
}

/// The largest divisor of `effective` that is at most `batch / 2` (at least 1): halving the
/// batch while keeping batch × accumulation exactly.
pub fn halved_batch(batch: u64, accumulation: u64) -> (u64, u64) {
    let effective = batch.saturating_mul(accumulation.max(1));
    let half = (batch / 2).max(1);
    let d = (1..=half)
        .rev()
        .find(|d| effective.is_multiple_of(*d))
        .unwrap_or(1);
    (d, effective / d)
}

/// One assessment: the next state from the current one, the figures and the time.
pub fn assess(state: &State, inputs: &Inputs, now_ms: u64, c: &PressureConfig) -> Decision {
    let (enter, enter_why) = raw_level(inputs, c, false);
    let (keep, keep_why) = raw_level(inputs, c, true);
    let mut next = state.clone();
    let (level, mut reason) = if enter >= state.level {
        next.relax_since_ms = None;
        (enter, enter_why)
    } else {
        // Falling: leave a level only when the relaxed figures allow it, for the hold time.
        let l = keep.min(state.level).max(enter);
        if l == state.level {
            next.relax_since_ms = None;
            (l, keep_why)
        } else {
            let since = state.relax_since_ms.unwrap_or(now_ms);
            if now_ms.saturating_sub(since) >= c.relax_after_ms {
                next.relax_since_ms = None;
                (l, if l == enter { enter_why } else { keep_why })
            } else {
                next.relax_since_ms = Some(since);
                (
                    state.level,
                    format!("{keep_why}; holding {} before relaxing", state.level),
                )
            }
        }
    };
    next.level = level;
    let mut downgraded = false;
    let mut waiting_for_trainer = false;
    // The trainer runs what was recommended (or less): from now the downgrade is in effect.
    let applied = inputs.trainer_batch.is_none_or(|b| b <= state.batch_size);
    // A trainer that does not report its batch is taken to apply at once, as before.
    if inputs.trainer_batch.is_some()
        && applied
        && state.last_downgrade_ms.is_some()
        && state.applied_ms.is_none()
    {
        next.applied_ms = Some(now_ms);
    }
    // Downgrade again only while the figures are over the threshold, not merely held by hysteresis.
    if level >= Level::Downgrade && enter >= Level::Downgrade {
        let in_effect_since = state
            .last_downgrade_ms
            .map(|t| next.applied_ms.unwrap_or(t).max(t));
        let cooled = in_effect_since.is_none_or(|t| now_ms.saturating_sub(t) >= c.cooldown_ms);
        let waited_out = state
            .last_downgrade_ms
            .is_some_and(|t| now_ms.saturating_sub(t) >= c.apply_wait_ms);
        let escalated = level == Level::Critical && state.level < Level::Critical;
        if !applied && !waited_out && !escalated {
            waiting_for_trainer = true;
            reason.push_str(&format!(
                "; waiting for the trainer to apply batch {} (it reports {})",
                state.batch_size,
                inputs.trainer_batch.unwrap_or_default()
            ));
        } else if cooled || waited_out || escalated {
            if state.batch_size > 1 {
                let (b, a) = halved_batch(state.batch_size, state.grad_accumulation);
                reason.push_str(&format!(
                    "; batch {} -> {b}, accumulation {} -> {a}",
                    state.batch_size, state.grad_accumulation
                ));
                next.batch_size = b;
                next.grad_accumulation = a;
                downgraded = true;
            } else if !state.grad_checkpointing {
                reason.push_str("; batch at its floor of 1: enable gradient checkpointing");
                next.grad_checkpointing = true;
                downgraded = true;
            } else {
                reason.push_str("; nothing left to downgrade (batch 1, checkpointing on)");
            }
        } else {
            reason.push_str("; cooling down since the last downgrade");
        }
    }
    if downgraded {
        next.downgrades += 1;
        next.last_downgrade_ms = Some(now_ms);
        next.applied_ms = None;
    }
    next.hold_sticky();
    Decision {
        state: next,
        reason,
        downgraded,
        waiting_for_trainer,
    }
}

/// The sticky downgrade after an out-of-memory error: one rung below `in_force` (the batch
/// halved with the effective batch kept, or checkpointing on once the batch is 1), never above
/// what `state` already recommends nor above a sticky downgrade in force. `at_most_batch`: a
/// batch the trainer already recovered with (an OOM record's `new_batch_size`).
pub fn sticky_downgrade(
    state: &State,
    in_force: Knobs,
    at_most_batch: Option<u64>,
    now_ms: u64,
) -> State {
    let mut rung = in_force;
    if in_force.batch_size > 1 {
        let (b, a) = halved_batch(in_force.batch_size, in_force.grad_accumulation);
        rung.batch_size = b;
        rung.grad_accumulation = a;
    } else {
        rung.grad_checkpointing = true;
    }
    // Only a batch that divides the effective batch: another would break batch × accumulation.
    let effective = in_force
        .batch_size
        .saturating_mul(in_force.grad_accumulation);
    if let Some(b) =
        at_most_batch.filter(|b| *b >= 1 && *b < rung.batch_size && effective.is_multiple_of(*b))
    {
        rung.batch_size = b;
        rung.grad_accumulation = effective / b;
    }
    let mut next = state.clone();
    let current = state.knobs();
    if rung.batch_size > current.batch_size {
        rung.batch_size = current.batch_size;
        rung.grad_accumulation = current.grad_accumulation;
    }
    rung.grad_checkpointing |= current.grad_checkpointing;
    if let Some(old) = state.sticky
        && old.batch_size < rung.batch_size
    {
        rung.batch_size = old.batch_size;
        rung.grad_accumulation = old.grad_accumulation;
    }
    next.sticky = Some(rung);
    next.batch_size = rung.batch_size;
    next.grad_accumulation = rung.grad_accumulation;
    next.grad_checkpointing = rung.grad_checkpointing;
    next.level = next.level.max(Level::Downgrade);
    next.relax_since_ms = None;
    if next.knobs() != current {
        next.downgrades += 1;
        next.last_downgrade_ms = Some(now_ms);
        next.applied_ms = None;
    }
    next
}

/// Which working-set samples the leak rule ([`leak_eta`]) may count, from what the trainer
/// reported. Imports and model loading climb steadily for tens of seconds, which is no leak:
/// only samples taken while the trainer is known to step count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeakWindow {
    /// Not known to step (nothing reported yet, or loading): the sample is not counted and
    /// the history is forgotten, so no trend spans a load and the steps after it.
    NotStepping,
    /// Writing a checkpoint: the sample is not counted, the history is kept (memory returns
    /// to the step level once it is written).
    Saving,
    /// Stepping: the sample counts.
    Stepping,
}

/// The window for a trainer whose last reported phase is `phase` and which has (or has not)
/// reported a step number. A trainer that reports no phase (an old client, a loop outside
/// Python) steps from its first report that carries a step; one that reports nothing is never
/// known to step, and its working set is not extrapolated (the ratio, PSI and OOM rules still
/// apply).
pub fn leak_window(phase: Option<TrainerPhase>, step_reported: bool) -> LeakWindow {
    match phase {
        Some(TrainerPhase::Step) => LeakWindow::Stepping,
        Some(TrainerPhase::Save) => LeakWindow::Saving,
        Some(TrainerPhase::Load) => LeakWindow::NotStepping,
        None if step_reported => LeakWindow::Stepping,
        None => LeakWindow::NotStepping,
    }
}

/// A short history of (ms, working-set bytes), about one point a second, for leak detection.
#[derive(Debug, Clone, Default)]
pub struct History {
    points: VecDeque<(u64, u64)>,
}

/// Points kept (about two minutes).
const HISTORY_POINTS: usize = 120;
/// Least spacing between kept points.
const HISTORY_SPACING_MS: u64 = 1000;

impl History {
    /// Adds a point, keeping about one a second.
    pub fn push(&mut self, now_ms: u64, bytes: u64) {
        if let Some(&(t, _)) = self.points.back()
            && now_ms.saturating_sub(t) < HISTORY_SPACING_MS
        {
            return;
        }
        if self.points.len() == HISTORY_POINTS {
            self.points.pop_front();
        }
        self.points.push_back((now_ms, bytes));
    }

    /// Adds a point when `window` counts it ([`LeakWindow`]), forgets them all when the trainer
    /// is not known to step.
    pub fn push_in(&mut self, window: LeakWindow, now_ms: u64, bytes: u64) {
        match window {
            LeakWindow::Stepping => self.push(now_ms, bytes),
            LeakWindow::Saving => {}
            LeakWindow::NotStepping => self.points.clear(),
        }
    }

    /// The points, oldest first.
    pub fn points(&self) -> Vec<(u64, u64)> {
        self.points.iter().copied().collect()
    }
}

/// Seconds until `limit` at the current growth, when the growth is steady: at least 20 points
/// spanning 20 s or more, at least 90 % of steps non-decreasing, and a positive least-squares
/// slope. `None` otherwise (no leak seen).
pub fn leak_eta(points: &[(u64, u64)], limit: u64) -> Option<f64> {
    if points.len() < 20 {
        return None;
    }
    let (t0, _) = points[0];
    let (tn, last) = points[points.len() - 1];
    if tn.saturating_sub(t0) < 20_000 {
        return None;
    }
    let rising = points.windows(2).filter(|w| w[1].1 >= w[0].1).count();
    if (rising as f64) < 0.9 * (points.len() - 1) as f64 {
        return None;
    }
    let n = points.len() as f64;
    let xs = points.iter().map(|&(t, _)| (t - t0) as f64 / 1000.0);
    let ys = points.iter().map(|&(_, b)| b as f64);
    let mx = xs.clone().sum::<f64>() / n;
    let my = ys.clone().sum::<f64>() / n;
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for (x, y) in xs.zip(ys) {
        sxy += (x - mx) * (y - my);
        sxx += (x - mx) * (x - mx);
    }
    if sxx <= 0.0 {
        return None;
    }
    let slope = sxy / sxx; // bytes per second
    if slope <= 0.0 {
        return None;
    }
    Some(limit.saturating_sub(last) as f64 / slope)
}

/// Seconds until `limit` from `used` at a growth the trainer reported
/// ([`memguard_api::Report::leak_bytes_per_second`]: its own leak check, on live framework
/// memory read after releasing the cache at step boundaries). `None` without growth.
pub fn reported_leak_eta(used: u64, limit: u64, bytes_per_second: u64) -> Option<f64> {
    if bytes_per_second == 0 {
        return None;
    }
    Some(limit.saturating_sub(used) as f64 / bytes_per_second as f64)
}

/// The sooner of two times to the limit: the sidecar's working-set rule ([`leak_eta`]) and the
/// trainer's report each see leaks the other cannot (memory outside the framework; growth
/// hidden in allocator noise), so whichever sees the limit first counts.
pub fn sooner(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The defaults without the hold time, so each table isolates one mechanism; the hold has
    /// its own test.
    fn cfg() -> PressureConfig {
        PressureConfig {
            relax_after_ms: 0,
            ..PressureConfig::new(Thresholds::default())
        }
    }

    #[test]
    fn a_level_falls_only_after_the_figures_stay_low_for_the_hold_time() {
        let c = PressureConfig::new(Thresholds::default());
        assert_eq!(c.relax_after_ms, 5_000);
        // A trainer whose memory swings with every micro-batch: 0.72 at the top, 0.40 between.
        let mut state = State::new(4, 1, false);
        let mut levels = Vec::new();
        for (t, r) in [
            (0, 0.72),
            (100, 0.40),
            (200, 0.72),
            (300, 0.40),
            (1_000, 0.40),
            (5_200, 0.40),
            (5_300, 0.40),
            (10_300, 0.40),
        ] {
            state = assess(&state, &mem(r), t, &c).state;
            levels.push(state.level);
        }
        use Level::*;
        // Warn is held through the swings (no flapping), and released once the figures have
        // been low for 5 s without interruption (from 300 ms on: at 5.3 s, not at 5.2 s).
        assert_eq!(levels, vec![Warn, Warn, Warn, Warn, Warn, Warn, Ok, Ok]);
        // Rising is never delayed.
        let rising = assess(&State::new(4, 1, false), &mem(0.90), 0, &c);
        assert_eq!(rising.state.level, Downgrade);
        assert!(rising.downgraded);
    }

    fn mem(r: f64) -> Inputs {
        Inputs {
            memory_ratio: Some(r),
            ..Default::default()
        }
    }

    /// Runs a sequence of (ms, inputs) from a starting state; returns (level, batch, accum).
    fn run(start: State, steps: &[(u64, Inputs)]) -> Vec<(Level, u64, u64)> {
        let mut s = start;
        let c = cfg();
        steps
            .iter()
            .map(|(t, i)| {
                s = assess(&s, i, *t, &c).state;
                (s.level, s.batch_size, s.grad_accumulation)
            })
            .collect()
    }

    #[test]
    fn levels_follow_the_documented_thresholds() {
        let table = [
            ("idle", 0.10, Level::Ok),
            ("just under warn", 0.699, Level::Ok),
            ("warn", 0.70, Level::Warn),
            ("downgrade", 0.85, Level::Downgrade),
            ("critical", 0.95, Level::Critical),
            ("over the limit", 1.20, Level::Critical),
        ];
        for (name, r, want) in table {
            let d = assess(&State::new(8, 1, false), &mem(r), 0, &cfg());
            assert_eq!(d.state.level, want, "{name}");
        }
    }

    #[test]
    fn downgrade_halves_batch_and_doubles_accumulation() {
        let d = assess(&State::new(8, 4, false), &mem(0.87), 0, &cfg());
        assert!(d.downgraded);
        assert_eq!((d.state.batch_size, d.state.grad_accumulation), (4, 8));
        assert_eq!(d.state.downgrades, 1);
        assert!(d.reason.contains("working set 0.87"), "{}", d.reason);
        assert!(d.reason.contains("batch 8 -> 4"), "{}", d.reason);
    }

    #[test]
    fn odd_batches_keep_the_effective_batch_exactly() {
        let table = [
            ((8, 4), (4, 8)),
            ((3, 1), (1, 3)),
            ((5, 2), (2, 5)),
            ((6, 1), (3, 2)),
            ((9, 2), (3, 6)),
            ((7, 1), (1, 7)),
            ((2, 1), (1, 2)),
        ];
        for ((b, a), want) in table {
            let got = halved_batch(b, a);
            assert_eq!(got, want, "({b}, {a})");
            assert_eq!(got.0 * got.1, b * a);
        }
    }

    #[test]
    fn hysteresis_prevents_flapping_around_a_threshold() {
        let steps = [
            (0, mem(0.71)),   // warn
            (100, mem(0.69)), // just under warn: stays warn (needs < 0.65)
            (200, mem(0.70)), // warn
            (300, mem(0.66)), // still warn
            (400, mem(0.64)), // below 0.65: ok
            (500, mem(0.69)), // under 0.70: ok, not warn again
        ];
        let levels: Vec<Level> = run(State::new(4, 1, false), &steps)
            .into_iter()
            .map(|x| x.0)
            .collect();
        use Level::*;
        assert_eq!(levels, vec![Warn, Warn, Warn, Warn, Ok, Ok]);
    }

    #[test]
    fn cooldown_spaces_downgrades_and_critical_skips_it_once() {
        let steps = [
            (0, mem(0.86)),      // downgrade: 16 -> 8
            (1_000, mem(0.88)),  // cooling down
            (29_999, mem(0.88)), // still cooling down
            (30_000, mem(0.88)), // 8 -> 4
            (31_000, mem(0.96)), // entering critical: 4 -> 2 despite cooldown
            (32_000, mem(0.97)), // still critical, cooling down
        ];
        let got = run(State::new(16, 1, false), &steps);
        use Level::*;
        assert_eq!(
            got,
            vec![
                (Downgrade, 8, 2),
                (Downgrade, 8, 2),
                (Downgrade, 8, 2),
                (Downgrade, 4, 4),
                (Critical, 2, 8),
                (Critical, 2, 8),
            ]
        );
    }

    fn reporting(r: f64, batch: u64) -> Inputs {
        Inputs {
            trainer_batch: Some(batch),
            ..mem(r)
        }
    }

    #[test]
    fn a_downgrade_waits_for_the_trainer_to_apply_the_last_one_and_cools_from_then() {
        let c = cfg();
        let steps = [
            // (ms, memory ratio, batch the trainer reports) -> recommended batch, and why
            (0, 0.86, 32, 16, "batch 32 -> 16"),
            (
                30_000,
                0.88,
                32,
                16,
                "waiting for the trainer to apply batch 16 (it reports 32)",
            ),
            (44_000, 0.88, 32, 16, "waiting for the trainer"),
            (45_000, 0.88, 16, 16, "cooling down"), // applied: the cooldown starts now
            (74_999, 0.88, 16, 16, "cooling down"),
            (75_000, 0.88, 16, 8, "batch 16 -> 8"),
        ];
        let mut s = State::new(32, 1, false);
        for (t, ratio, reported, want, why) in steps {
            let d = assess(&s, &reporting(ratio, reported), t, &c);
            assert_eq!(d.state.batch_size, want, "at {t} ms: {}", d.reason);
            assert!(d.reason.contains(why), "at {t} ms: {}", d.reason);
            s = d.state;
        }
        // Without the trainer's batch (a trainer that does not report it), the cooldown alone
        // spaces the downgrades, as before.
        let got = run(
            State::new(32, 1, false),
            &[(0, mem(0.86)), (30_000, mem(0.88))],
        );
        assert_eq!(got[1].1, 8);
    }

    #[test]
    fn a_trainer_that_never_applies_is_waited_for_four_cooldowns() {
        let c = cfg();
        assert_eq!(c.apply_wait_ms, 4 * c.cooldown_ms);
        let mut s = assess(&State::new(32, 1, false), &reporting(0.86, 32), 0, &c).state;
        for t in [30_000, 60_000, 119_999] {
            s = assess(&s, &reporting(0.88, 32), t, &c).state;
            assert_eq!(s.batch_size, 16, "at {t} ms");
        }
        let d = assess(&s, &reporting(0.88, 32), 120_000, &c);
        assert_eq!(d.state.batch_size, 8, "{}", d.reason);
        assert!(d.downgraded);
    }

    #[test]
    fn entering_critical_does_not_wait_for_the_trainer() {
        let c = cfg();
        let s = assess(&State::new(32, 1, false), &reporting(0.86, 32), 0, &c).state;
        let d = assess(&s, &reporting(0.96, 32), 1_000, &c);
        assert_eq!((d.state.level, d.state.batch_size), (Level::Critical, 8));
    }

    #[test]
    fn a_trainer_running_less_than_recommended_has_applied() {
        let c = cfg();
        let s = assess(&State::new(32, 1, false), &reporting(0.86, 32), 0, &c).state;
        let s = assess(&s, &reporting(0.88, 4), 10_000, &c).state;
        assert_eq!(s.applied_ms, Some(10_000));
        assert_eq!(
            assess(&s, &reporting(0.88, 4), 40_000, &c).state.batch_size,
            8
        );
    }

    #[test]
    fn a_level_held_by_hysteresis_does_not_downgrade_again() {
        let steps = [(0, mem(0.86)), (40_000, mem(0.82)), (80_000, mem(0.83))];
        let got = run(State::new(8, 1, false), &steps);
        assert_eq!(got, vec![(Level::Downgrade, 4, 2); 3]);
    }

    #[test]
    fn batch_never_goes_below_one_then_checkpointing_then_nothing() {
        let mut s = State::new(2, 3, false);
        let c = PressureConfig {
            cooldown_ms: 0,
            ..cfg()
        };
        let d = assess(&s, &mem(0.9), 0, &c);
        assert_eq!((d.state.batch_size, d.state.grad_accumulation), (1, 6));
        s = d.state;
        let d = assess(&s, &mem(0.9), 1, &c);
        assert!(d.downgraded && d.state.grad_checkpointing);
        assert_eq!(d.state.batch_size, 1);
        s = d.state;
        let d = assess(&s, &mem(0.9), 2, &c);
        assert!(!d.downgraded);
        assert_eq!((d.state.batch_size, d.state.downgrades), (1, 2));
        assert!(d.reason.contains("nothing left"), "{}", d.reason);
    }

    #[test]
    fn psi_gpu_and_leaks_raise_the_level_and_unknown_figures_do_not() {
        let c = cfg();
        let s = State::new(4, 1, false);
        let psi = Inputs {
            psi_some_avg10: Some(25.0),
            memory_ratio: Some(0.2),
            ..Default::default()
        };
        let d = assess(&s, &psi, 0, &c);
        assert_eq!(d.state.level, Level::Downgrade);
        assert!(d.reason.contains("PSI"), "{}", d.reason);
        let gpu = Inputs {
            gpu_ratio: Some(0.96),
            ..Default::default()
        };
        assert_eq!(assess(&s, &gpu, 0, &c).state.level, Level::Critical);
        let leak = Inputs {
            memory_ratio: Some(0.5),
            seconds_to_limit: Some(45.0),
            ..Default::default()
        };
        let d = assess(&s, &leak, 0, &c);
        assert_eq!(d.state.level, Level::Downgrade);
        assert!(d.reason.contains("steady growth"), "{}", d.reason);
        let far = Inputs {
            seconds_to_limit: Some(600.0),
            ..Default::default()
        };
        assert_eq!(assess(&s, &far, 0, &c).state.level, Level::Ok);
        assert_eq!(assess(&s, &Inputs::default(), 0, &c).state.level, Level::Ok);
    }

    #[test]
    fn detects_a_steady_leak_but_not_noise_or_a_plateau() {
        let gib = 1u64 << 30;
        // 10 MiB/s for 30 s from 1 GiB: ~ (2 GiB - 1.29 GiB) / 10 MiB/s ≈ 72 s to a 2 GiB limit.
        let leak: Vec<(u64, u64)> = (0..30).map(|i| (i * 1000, gib + i * (10 << 20))).collect();
        let eta = leak_eta(&leak, 2 * gib).expect("leak seen");
        assert!((eta - 73.4).abs() < 1.0, "{eta}");
        let plateau: Vec<(u64, u64)> = (0..30).map(|i| (i * 1000, gib)).collect();
        assert_eq!(leak_eta(&plateau, 2 * gib), None);
        let saw: Vec<(u64, u64)> = (0..30)
            .map(|i| (i * 1000, gib + if i % 2 == 0 { i << 20 } else { 0 }))
            .collect();
        assert_eq!(
            leak_eta(&saw, 2 * gib),
            None,
            "training steps go up and down"
        );
        assert_eq!(leak_eta(&leak[..10], 2 * gib), None, "too short to tell");
    }

    #[test]
    fn an_oom_sets_a_sticky_downgrade_one_rung_below_what_was_in_force() {
        let k = |b, a, c| Knobs {
            batch_size: b,
            grad_accumulation: a,
            grad_checkpointing: c,
        };
        let start = State::new(8, 2, false);
        let s = sticky_downgrade(&start, start.knobs(), None, 10);
        assert_eq!(s.knobs(), k(4, 4, false));
        assert_eq!(
            (s.level, s.downgrades, s.sticky),
            (Level::Downgrade, 1, Some(k(4, 4, false)))
        );
        // A second OOM goes one more rung; a record's own recovery batch caps it.
        let s2 = sticky_downgrade(&s, s.knobs(), None, 20);
        assert_eq!(s2.knobs(), k(2, 8, false));
        let rec = sticky_downgrade(&start, k(8, 2, false), Some(1), 30);
        assert_eq!(rec.knobs(), k(1, 16, false));
        // At batch 1: checkpointing.
        let one = sticky_downgrade(&State::new(1, 16, false), k(1, 16, false), None, 40);
        assert_eq!(one.knobs(), k(1, 16, true));
        // An OOM at a config above what is already recommended does not raise it.
        let low = State::new(2, 8, false);
        assert_eq!(
            sticky_downgrade(&low, k(8, 2, false), None, 50).knobs(),
            k(2, 8, false)
        );
        // Never relaxed: calm figures for a long time keep the sticky knobs.
        let mut state = s;
        for t in 0..100 {
            state = assess(&state, &mem(0.1), 1_000 * t, &cfg()).state;
        }
        assert_eq!(state.level, Level::Ok);
        assert_eq!(state.knobs(), k(4, 4, false));
        // Even a state someone raised by hand is held down at the next assessment.
        state.batch_size = 8;
        state.grad_accumulation = 2;
        assert_eq!(
            assess(&state, &mem(0.1), 200_000, &cfg()).state.knobs(),
            k(4, 4, false)
        );
    }

    #[test]
    fn only_samples_taken_while_stepping_count_toward_a_leak() {
        use TrainerPhase::{Load, Save, Step};
        // A reported phase decides; without one, a report that carried a step number does.
        assert_eq!(leak_window(None, false), LeakWindow::NotStepping);
        assert_eq!(leak_window(None, true), LeakWindow::Stepping);
        assert_eq!(leak_window(Some(Load), true), LeakWindow::NotStepping);
        assert_eq!(leak_window(Some(Step), false), LeakWindow::Stepping);
        assert_eq!(leak_window(Some(Save), false), LeakWindow::Saving);

        let gib = 1u64 << 30;
        let climb = |i: u64| (i * 1000, gib + i * (10 << 20));
        let mut h = History::default();
        // 30 s of load climbing 10 MiB/s: a leak's shape, not counted.
        for i in 0..30 {
            h.push_in(LeakWindow::NotStepping, climb(i).0, climb(i).1);
        }
        assert!(h.points().is_empty());
        // Steps: counted, from the first one only.
        for i in 30..45 {
            h.push_in(LeakWindow::Stepping, climb(i).0, climb(i).1);
        }
        assert_eq!(h.points().len(), 15);
        assert_eq!(
            leak_eta(&h.points(), 2 * gib),
            None,
            "15 s of steps: too short to tell"
        );
        // A checkpoint written: its samples are skipped and the steps' history is kept.
        for i in 45..50 {
            h.push_in(LeakWindow::Saving, climb(i).0, climb(i).1 + gib / 2);
        }
        for i in 50..60 {
            h.push_in(LeakWindow::Stepping, climb(i).0, climb(i).1);
        }
        assert_eq!(h.points().len(), 25);
        assert!(
            leak_eta(&h.points(), 2 * gib).is_some(),
            "the steps' leak is seen"
        );
        // A new load (the trainer restarted and reports it): the history is forgotten.
        h.push_in(LeakWindow::NotStepping, 60_000, gib);
        assert!(h.points().is_empty());
    }

    #[test]
    fn a_reported_leak_is_a_time_to_the_limit_and_the_sooner_one_counts() {
        let mib = 1u64 << 20;
        assert_eq!(reported_leak_eta(900 * mib, 1000 * mib, mib), Some(100.0));
        assert_eq!(reported_leak_eta(1100 * mib, 1000 * mib, mib), Some(0.0));
        assert_eq!(reported_leak_eta(900 * mib, 1000 * mib, 0), None);
        assert_eq!(sooner(Some(100.0), Some(40.0)), Some(40.0));
        assert_eq!(sooner(None, Some(40.0)), Some(40.0));
        assert_eq!(sooner(Some(100.0), None), Some(100.0));
        assert_eq!(sooner(None, None), None);
    }

    #[test]
    fn history_keeps_about_one_point_a_second() {
        let mut h = History::default();
        for t in (0..5_000).step_by(100) {
            h.push(t, t);
        }
        assert_eq!(h.points().len(), 5);
        for t in (0..300_000).step_by(1000) {
            h.push(10_000 + t, t);
        }
        assert_eq!(h.points().len(), HISTORY_POINTS);
    }
}
