//! Growing the micro-batch back toward the one the trainer was configured with, when the peaks
//! measured at the current micro-batch show room (issue 37, item 5). Pure: no I/O, no clock.
//!
//! Admission plans a micro-batch against an estimate's upper bound, and downgrades only go down,
//! so a job can run its whole life at a fraction of the micro-batch that fits. This rule moves it
//! back up, one rung at a time, on measured figures only:
//!
//! * **Measured at the current micro-batch.** A window opens when the trainer reports (step and
//!   batch, `POST /v1/report`) that it runs the recommended micro-batch; it holds the highest
//!   figure seen per memory (the cgroup's working set or its peak between samples, against its
//!   limit; a device's reserved peak, against its size). The window must span
//!   [`GrowthConfig::steady_steps`] steps and [`GrowthConfig::min_window_ms`] at level `ok`:
//!   anything above `ok` closes it.
//! * **Projected to the next rung.** The next rung is the smallest divisor of the effective batch
//!   at least twice the current micro-batch (the inverse of the downgrade's halving), or else the
//!   largest divisor above it, never above the ceiling. The peak there is projected from a
//!   per-row slope measured between two micro-batches of this run; with one point only, from the
//!   whole peak scaled by the ratio of the two micro-batches (everything counted as activations:
//!   an upper bound). Growth happens only when every known memory's projection stays under
//!   [`GrowthConfig::watermark`] of its budget (the `warn` threshold, below `downgrade` by the
//!   policy's margin). No memory known: no growth.
//! * **A ceiling that only goes down.** The configured micro-batch (the trainer's own config,
//!   reported at train start); unknown, never grow. Every shrink (a downgrade under pressure, the
//!   sticky downgrade of an OOM) from a rung growth reached lowers it below that rung: a grown
//!   rung that was shrunk from is never tried again in the run, and a rung that ran out of memory
//!   is capped by the sticky downgrade. (A shrink of a rung never grown to, such as the admitted
//!   one under host PSI or while ranks import, is left to the projection: it may be grown to
//!   once, and a second shrink from it is final.) So the two rules never
//!   fight, and grow, shrink, grow cannot cycle.

use crate::config::MAX_BATCH;
use crate::pressure::Knobs;
use memguard_api::Level;
use std::collections::BTreeMap;

/// Policy settings of the growth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrowthConfig {
    /// Grow at all (`--grow-back`).
    pub enabled: bool,
    /// Steps the trainer must report at the current micro-batch, at level `ok`, before growing.
    pub steady_steps: u64,
    /// Least milliseconds the window at the current micro-batch must span (the sampler must
    /// have seen several steps' peaks).
    pub min_window_ms: u64,
    /// The projected peak must stay under this ratio of each budget.
    pub watermark: f64,
}

impl GrowthConfig {
    /// On; 4 steady steps over at least 2 s; under `watermark` (the policy's `warn` threshold).
    pub fn new(watermark: f64) -> Self {
        GrowthConfig {
            enabled: true,
            steady_steps: 4,
            min_window_ms: 2_000,
            watermark,
        }
    }
}

/// The memories a peak is measured in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Memory {
    /// The trainer's cgroup: working set (or its peak between samples) against the limit.
    Cgroup,
    /// The most loaded accelerator: reserved peak (or NVML's used) against its size.
    Device,
}

impl Memory {
    fn name(self) -> &'static str {
        match self {
            Memory::Cgroup => "cgroup",
            Memory::Device => "device",
        }
    }
}

/// One figure read this sample: bytes in use at their highest, and the budget they count against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    /// Which memory.
    pub memory: Memory,
    /// Highest bytes in use since the previous sample, as far as the source can tell.
    pub used: u64,
    /// The budget (limit, device size); never 0.
    pub budget: u64,
}

/// What one sample tells the growth rule.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    /// The pressure level after this sample's assessment.
    pub level: Level,
    /// The knobs recommended after this sample's assessment (downgrades included).
    pub knobs: Knobs,
    /// The micro-batch the trainer was configured with (its own report at train start).
    pub configured_batch: Option<u64>,
    /// The trainer's last reported step and the micro-batch it runs there.
    pub trainer: Option<(u64, u64)>,
    /// The figures read this sample (memories not read are absent).
    pub readings: Vec<Reading>,
}

/// A decision to grow.
#[derive(Debug, Clone, PartialEq)]
pub struct Grow {
    /// The new micro-batch.
    pub batch_size: u64,
    /// The new accumulation (batch × accumulation kept).
    pub grad_accumulation: u64,
    /// Why, for a person.
    pub reason: String,
}

/// The window at the current micro-batch.
#[derive(Debug, Clone, PartialEq)]
struct Window {
    batch: u64,
    first_step: u64,
    last_step: u64,
    opened_ms: u64,
    peaks: BTreeMap<Memory, Reading>,
}

/// What the growth rule remembers over the run.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Growth {
    /// No micro-batch above this is recommended again (lowered by every shrink).
    ceiling: Option<u64>,
    last_batch: Option<u64>,
    /// The micro-batches growth recommended.
    grown_to: std::collections::BTreeSet<u64>,
    window: Option<Window>,
    /// Per memory, the measured peak by micro-batch (for the per-row slope).
    measured: BTreeMap<Memory, BTreeMap<u64, u64>>,
    /// Growths issued.
    pub growths: u64,
}

/// The next rung above `batch`: the smallest divisor of `effective` at least `2 × batch`, or else
/// the largest divisor above `batch`; never above `ceiling` nor [`MAX_BATCH`] (which bounds the
/// search). `None`: nothing above `batch`.
pub fn grown_batch(batch: u64, effective: u64, ceiling: u64) -> Option<u64> {
    let top = ceiling.min(effective).min(MAX_BATCH);
    if batch >= top {
        return None;
    }
    let divisors = (batch + 1..=top).filter(|d| effective.is_multiple_of(*d));
    let doubled = batch.saturating_mul(2);
    let mut largest = None;
    for d in divisors {
        if d >= doubled {
            return Some(d);
        }
        largest = Some(d);
    }
    largest
}

/// The peak projected at `to` from the peaks measured by micro-batch: from the per-row slope
/// between the measured micro-batch nearest below `from` and `from` (never below 0), or, with
/// `from` alone, the whole peak scaled by `to / from`.
pub fn projected_peak(measured: &BTreeMap<u64, u64>, from: u64, to: u64) -> Option<u64> {
    let at = *measured.get(&from)?;
    let below = measured.range(..from).next_back();
    let projected = match below {
        Some((&b0, &p0)) => {
            let slope = at.saturating_sub(p0) as f64 / (from - b0) as f64;
            at as f64 + slope * to.saturating_sub(from) as f64
        }
        None => at as f64 * to as f64 / from.max(1) as f64,
    };
    Some(projected.ceil().min(u64::MAX as f64) as u64)
}

impl Growth {
    /// The highest micro-batch growth may recommend now (`None`: no ceiling from shrinks yet).
    pub fn ceiling(&self) -> Option<u64> {
        self.ceiling
    }

    /// Lowers the ceiling below `batch` for the rest of the run (a sticky downgrade carried over a
    /// sidecar restart: that rung ran out of memory).
    pub fn forbid_from(&mut self, batch: u64) {
        let below = batch.saturating_sub(1).max(1);
        self.ceiling = Some(self.ceiling.map_or(below, |c| c.min(below)));
    }

    /// One sample at `now_ms`: a growth when the window at the current micro-batch allows one.
    pub fn observe(&mut self, o: &Observation, now_ms: u64, c: &GrowthConfig) -> Option<Grow> {
        let batch = o.knobs.batch_size.max(1);
        if let Some(last) = self.last_batch
            && batch < last
        {
            // A shrink, whatever its cause, from a rung growth reached: that rung is not for
            // this run. A shrink of a rung never grown to (the admitted one, shrunk by pressure
            // from outside the trainer, such as the host's PSI or ranks importing at start)
            // leaves it to the projection; an OOM's rung is capped by the sticky downgrade.
            if self.grown_to.contains(&last) {
                self.forbid_from(last);
            }
            self.window = None;
        }
        self.last_batch = Some(batch);
        if !c.enabled || o.level != Level::Ok {
            self.window = None;
            return None;
        }
        let (step, running) = match o.trainer {
            Some((step, running)) if running == batch => (step, running),
            // The trainer does not run the recommended micro-batch (yet): nothing measured.
            Some(_) => {
                self.window = None;
                return None;
            }
            None => return None,
        };
        let window = match &mut self.window {
            Some(w) if w.batch == running && step >= w.last_step => w,
            _ => self.window.insert(Window {
                batch: running,
                first_step: step,
                last_step: step,
                opened_ms: now_ms,
                peaks: BTreeMap::new(),
            }),
        };
        window.last_step = step;
        for r in o.readings.iter().filter(|r| r.budget > 0) {
            window
                .peaks
                .entry(r.memory)
                .and_modify(|p| {
                    p.used = p.used.max(r.used);
                    p.budget = p.budget.min(r.budget);
                })
                .or_insert(*r);
        }
        let span = window.last_step.saturating_sub(window.first_step);
        let steady =
            span >= c.steady_steps && now_ms.saturating_sub(window.opened_ms) >= c.min_window_ms;
        if !steady || window.peaks.is_empty() {
            return None;
        }
        let peaks: Vec<Reading> = window.peaks.values().copied().collect();
        for p in &peaks {
            let seen = self.measured.entry(p.memory).or_default();
            let at = seen.entry(batch).or_default();
            *at = (*at).max(p.used);
        }
        let configured = o.configured_batch?;
        let ceiling = self.ceiling.map_or(configured, |c| c.min(configured));
        let effective = batch.saturating_mul(o.knobs.grad_accumulation.max(1));
        let next = grown_batch(batch, effective, ceiling)?;
        let mut figures = Vec::new();
        for p in &peaks {
            let projected = projected_peak(&self.measured[&p.memory], batch, next)?;
            let ratio = projected as f64 / p.budget as f64;
            if ratio >= c.watermark {
                return None;
            }
            figures.push(format!(
                "{} peak {} MiB at {batch} projects {} MiB ({ratio:.2} of {} MiB) at {next}",
                p.memory.name(),
                p.used >> 20,
                projected >> 20,
                p.budget >> 20,
            ));
        }
        self.window = None;
        self.growths += 1;
        self.grown_to.insert(next);
        Some(Grow {
            batch_size: next,
            grad_accumulation: effective / next,
            reason: format!(
                "room measured over {} steps: {}, under {:.2}; batch {batch} -> {next}, \
                 accumulation {} -> {} (configured {configured})",
                span,
                figures.join("; "),
                c.watermark,
                o.knobs.grad_accumulation,
                effective / next,
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn cfg() -> GrowthConfig {
        GrowthConfig {
            min_window_ms: 1_000,
            ..GrowthConfig::new(0.70)
        }
    }

    fn knobs(batch: u64, accumulation: u64) -> Knobs {
        Knobs {
            batch_size: batch,
            grad_accumulation: accumulation,
            grad_checkpointing: false,
        }
    }

    fn cgroup(used: u64) -> Vec<Reading> {
        vec![Reading {
            memory: Memory::Cgroup,
            used,
            budget: 4 * GIB,
        }]
    }

    /// Drives the rule like the engine: each sample the trainer has moved one step on at the
    /// recommended micro-batch (once it applied it), 250 ms apart; the peak is `peak(batch)`.
    /// Returns the micro-batches recommended, one per sample.
    fn run(
        growth: &mut Growth,
        start: Knobs,
        configured: Option<u64>,
        samples: u64,
        peak: impl Fn(u64) -> u64,
    ) -> Vec<Knobs> {
        let mut k = start;
        let mut out = Vec::new();
        for i in 0..samples {
            let o = Observation {
                level: Level::Ok,
                knobs: k,
                configured_batch: configured,
                trainer: Some((i, k.batch_size)),
                readings: cgroup(peak(k.batch_size)),
            };
            if let Some(g) = growth.observe(&o, i * 250, &cfg()) {
                assert!(g.reason.contains("projects"), "{}", g.reason);
                k = knobs(g.batch_size, g.grad_accumulation);
            }
            out.push(k);
        }
        out
    }

    /// 600 MiB fixed plus 40 MiB a row: 16 rows need about 1.2 GiB of a 4 GiB limit.
    fn roomy(batch: u64) -> u64 {
        600 * MIB + 40 * MIB * batch
    }

    #[test]
    fn grows_rung_by_rung_to_the_configured_batch_and_never_above_it() {
        let mut g = Growth::default();
        let seen = run(&mut g, knobs(2, 8), Some(16), 60, roomy);
        let mut batches: Vec<u64> = seen.iter().map(|k| k.batch_size).collect();
        batches.dedup();
        assert_eq!(batches, [2, 4, 8, 16], "one rung at a time, up to 16");
        assert!(
            seen.iter()
                .all(|k| k.batch_size * k.grad_accumulation == 16),
            "the effective batch is kept: {seen:?}"
        );
        assert_eq!(g.growths, 3);
        // Configured at 8 with an effective batch of 32: stops at 8.
        let mut g = Growth::default();
        let seen = run(&mut g, knobs(1, 32), Some(8), 60, roomy);
        assert_eq!(seen.last().copied(), Some(knobs(8, 4)));
    }

    #[test]
    fn never_grows_when_the_configured_batch_is_unknown() {
        let mut g = Growth::default();
        let seen = run(&mut g, knobs(2, 8), None, 60, roomy);
        assert!(seen.iter().all(|k| k.batch_size == 2));
        assert_eq!(g.growths, 0);
    }

    #[test]
    fn never_grows_on_memory_it_did_not_read() {
        let mut g = Growth::default();
        for i in 0..40 {
            let o = Observation {
                level: Level::Ok,
                knobs: knobs(2, 8),
                configured_batch: Some(16),
                trainer: Some((i, 2)),
                readings: Vec::new(),
            };
            assert_eq!(g.observe(&o, i * 250, &cfg()), None);
        }
    }

    #[test]
    fn waits_for_the_trainer_to_run_the_recommended_batch_for_enough_steps() {
        let mut g = Growth::default();
        let mut o = Observation {
            level: Level::Ok,
            knobs: knobs(2, 8),
            configured_batch: Some(16),
            trainer: None,
            readings: cgroup(roomy(2)),
        };
        // No step reported, or the trainer still runs another batch: nothing measured.
        for i in 0..10 {
            assert_eq!(g.observe(&o, i * 500, &cfg()), None);
        }
        o.trainer = Some((100, 16));
        for i in 10..20 {
            assert_eq!(g.observe(&o, i * 500, &cfg()), None);
        }
        // Running 2 now, but for fewer steps than asked, however long.
        for i in 0..3 {
            o.trainer = Some((200 + i, 2));
            assert_eq!(g.observe(&o, 20_000 + i * 10_000, &cfg()), None);
        }
        // Enough steps but within less than the window.
        let mut g = Growth::default();
        for i in 0..10 {
            o.trainer = Some((i, 2));
            assert_eq!(g.observe(&o, i * 10, &cfg()), None);
        }
        o.trainer = Some((11, 2));
        assert!(g.observe(&o, 1_000, &cfg()).is_some());
    }

    /// The peak swings with every micro-batch; one high sample in the window is what counts, so
    /// a peak that only sometimes reaches the watermark never lets it grow, and a level above ok
    /// closes the window.
    #[test]
    fn hysteresis_holds_under_a_noisy_peak() {
        let mut g = Growth::default();
        let mut grew = 0;
        for i in 0..200u64 {
            // 1.0 GiB most samples; every seventh 1.5 GiB, which at 4 (one point: doubled)
            // projects 3 GiB, over 0.70 of 4 GiB.
            let used = if i % 7 == 0 { 1536 * MIB } else { GIB };
            let o = Observation {
                level: Level::Ok,
                knobs: knobs(2, 8),
                configured_batch: Some(16),
                trainer: Some((i, 2)),
                readings: cgroup(used),
            };
            grew += usize::from(g.observe(&o, i * 250, &cfg()).is_some());
        }
        assert_eq!(grew, 0, "the window's highest figure counts");
        // Room, but the level goes to warn every few samples: the window never fills.
        let mut g = Growth::default();
        for i in 0..200u64 {
            let o = Observation {
                level: if i % 3 == 0 { Level::Warn } else { Level::Ok },
                knobs: knobs(2, 8),
                configured_batch: Some(16),
                trainer: Some((i, 2)),
                readings: cgroup(roomy(2)),
            };
            assert_eq!(g.observe(&o, i * 250, &cfg()), None, "sample {i}");
        }
    }

    #[test]
    fn a_shrink_lowers_the_ceiling_for_the_rest_of_the_run() {
        let mut g = Growth::default();
        let seen = run(&mut g, knobs(2, 8), Some(16), 40, roomy);
        assert_eq!(seen.last().map(|k| k.batch_size), Some(16));
        // A downgrade (pressure, or the sticky one of an OOM) from 16 to 8.
        let after = run(&mut g, knobs(8, 2), Some(16), 60, roomy);
        assert!(
            after.iter().all(|k| k.batch_size == 8),
            "16 is never tried again"
        );
        assert_eq!(g.ceiling(), Some(15));
        // And a second one, from 8 to 4: the ceiling only goes down.
        let after = run(&mut g, knobs(4, 4), Some(16), 60, roomy);
        assert!(after.iter().all(|k| k.batch_size == 4));
        assert_eq!(g.ceiling(), Some(7));
        assert_eq!(g.growths, 3, "no growth after the shrinks");
    }

    /// Host PSI (not the trainer's memory) shrinks the admitted 2 to 1 while the trainer runs
    /// it: 2 was never grown to, so it is left to the projection; once grown to, a second
    /// shrink from it is final.
    #[test]
    fn a_shrink_of_a_rung_never_grown_to_leaves_the_ceiling() {
        let mut g = Growth::default();
        let starting = |knobs, step| Observation {
            level: Level::Downgrade,
            knobs,
            configured_batch: Some(16),
            trainer: Some((step, 2)),
            readings: cgroup(GIB),
        };
        assert_eq!(g.observe(&starting(knobs(2, 8), 1), 0, &cfg()), None);
        assert_eq!(g.observe(&starting(knobs(1, 16), 2), 100, &cfg()), None);
        assert_eq!(g.ceiling(), None, "2 was never grown to");
        let seen = run(&mut g, knobs(1, 16), Some(16), 80, roomy);
        assert_eq!(seen.last().map(|k| k.batch_size), Some(16));
    }

    #[test]
    fn a_projection_over_the_watermark_holds_the_batch() {
        // 2.2 GiB at 2 against 4 GiB: 4 would project 4.4 GiB from one point.
        let mut g = Growth::default();
        let seen = run(&mut g, knobs(2, 8), Some(16), 60, |_| 2253 * MIB);
        assert!(seen.iter().all(|k| k.batch_size == 2));
        // Measured at two micro-batches, the per-row slope is used: 1.5 GiB fixed, 10 MiB a
        // row, goes up to 16 where the one-point bound would stop at 2.
        let mut measured = BTreeMap::new();
        measured.insert(2, 1536 * MIB + 20 * MIB);
        measured.insert(4, 1536 * MIB + 40 * MIB);
        assert_eq!(projected_peak(&measured, 4, 8), Some(1536 * MIB + 80 * MIB));
        assert_eq!(projected_peak(&measured, 2, 4), Some(2 * (1536 + 20) * MIB));
        assert_eq!(projected_peak(&measured, 8, 16), None, "not measured at 8");
    }

    #[test]
    fn the_next_rung_divides_the_effective_batch() {
        assert_eq!(grown_batch(2, 16, 16), Some(4));
        assert_eq!(grown_batch(3, 24, 24), Some(6));
        assert_eq!(grown_batch(8, 24, 12), Some(12), "below the ceiling");
        assert_eq!(grown_batch(5, 15, 15), Some(15));
        assert_eq!(grown_batch(4, 12, 5), None, "no divisor in 5..=5");
        assert_eq!(
            grown_batch(16, 16, 64),
            None,
            "the effective batch is the top"
        );
        assert_eq!(grown_batch(1, 7, 7), Some(7));
        assert_eq!(grown_batch(u64::MAX, u64::MAX, u64::MAX), None);
        // A prime effective batch far above any real one: the search stops at MAX_BATCH.
        assert_eq!(grown_batch(1, 1_099_511_627_689, u64::MAX), None);
        assert_eq!(grown_batch(512, 1 << 40, u64::MAX), Some(1024));
    }
}
