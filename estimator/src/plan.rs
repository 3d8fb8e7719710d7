//! The downgrade plan: take steps until the config fits the budget, each time the step that saves
//! the most bytes per unit of cost ([`Rung::cost_units`]). Each rung has a cost class ([`Cost`]):
//! free and compute rungs are taken by default; quality rungs (they change what the model sees
//! or is) only with permission ([`Floors::allow_quality`]), only once no free or compute step
//! saves anything, and never for a saving below [`QUALITY_MIN_SAVING`] of the budget.

use crate::bound::{self, Bound, Class, Figure};
use crate::calibration::Calibration;
use crate::config::{ConfigError, GradSync, Parallelism, TrainingConfig};
use crate::estimate::{Estimate, estimate};
use crate::units::Bytes;
use std::fmt;

/// One kind of downgrade. The order of [`LADDER`] is the order of the quality cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum Rung {
    /// Recompute activations in the backward pass: costs time, not quality.
    GradCheckpointing,
    /// FSDP across ranks: reduce-scatter gradients at every micro-batch instead of holding them
    /// unsharded until the last (Accelerate's `sync_each_batch`). Costs communication, not
    /// quality; tried before the batch is halved, since halving raises accumulation.
    SyncEachBatch,
    /// Halve the per-device batch and double gradient accumulation: same effective batch.
    HalveBatch,
    /// Halve the sequence length: sees less context per sample.
    HalveSeqLength,
    /// Halve the LoRA rank: a smaller adapter.
    HalveLoraRank,
    /// Halve the number of adapted layers.
    HalveLoraLayers,
}

/// Every rung, cheapest first: the order breaks ties between equal savings per unit of cost.
pub const LADDER: [Rung; 6] = [
    Rung::GradCheckpointing,
    Rung::SyncEachBatch,
    Rung::HalveBatch,
    Rung::HalveSeqLength,
    Rung::HalveLoraRank,
    Rung::HalveLoraLayers,
];

/// What a rung costs the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum Cost {
    /// Same math: the effective batch and the gradients are what they were.
    Free,
    /// Same math, more time: recomputation, communication.
    Compute,
    /// Different training: truncated sequences, a smaller adapter. Never applied silently.
    Quality,
}

impl Cost {
    /// Lower-case name, for messages.
    pub const fn name(self) -> &'static str {
        match self {
            Cost::Free => "free",
            Cost::Compute => "compute",
            Cost::Quality => "quality",
        }
    }
}

/// Tokens per micro-batch at which halving the batch starts to cost speed: a few thousand tokens
/// keep a GPU's matrix units busy on the models people fine-tune; below that each halving leaves
/// more of the device idle per step.
pub const SATURATING_TOKENS: u64 = 4096;

/// The least a quality rung must save, as a share of the budget, to be taken even with
/// permission: truncating data or shrinking the adapter for less is a trade no one would make.
pub const QUALITY_MIN_SAVING: f64 = 0.02;

impl Rung {
    /// What the rung costs: halving the batch (accumulation doubled) is free, checkpointing and
    /// syncing each batch cost compute, the sequence and the adapter cost quality.
    pub const fn cost(self) -> Cost {
        match self {
            Rung::HalveBatch => Cost::Free,
            Rung::GradCheckpointing | Rung::SyncEachBatch => Cost::Compute,
            Rung::HalveSeqLength | Rung::HalveLoraRank | Rung::HalveLoraLayers => Cost::Quality,
        }
    }

    /// What taking the rung to `next` costs, in units where a compute step costs 2: the plan
    /// takes the step that saves the most bytes per unit. Checkpointing runs the forward pass
    /// again (about a third more time per step) and syncing each batch adds a reduce-scatter per
    /// micro-batch: 2 each. Halving the batch keeps the math but not the speed once the
    /// micro-batch is small: 1 unit at [`SATURATING_TOKENS`] tokens per micro-batch, a quarter
    /// of that far above it, up to 8 far below. Quality rungs are weighed among themselves only
    /// (see [`plan_against`]): 1 each.
    pub fn cost_units(self, next: &TrainingConfig) -> f64 {
        match self {
            Rung::HalveBatch => {
                let tokens = (next.batch_size * next.seq_length).max(1) as f64;
                (SATURATING_TOKENS as f64 / tokens).clamp(0.25, 8.0)
            }
            Rung::GradCheckpointing | Rung::SyncEachBatch => 2.0,
            Rung::HalveSeqLength | Rung::HalveLoraRank | Rung::HalveLoraLayers => 1.0,
        }
    }

    /// Kebab-case name used in annotations and JSON.
    pub const fn name(self) -> &'static str {
        match self {
            Rung::GradCheckpointing => "grad-checkpointing",
            Rung::SyncEachBatch => "sync-each-batch",
            Rung::HalveBatch => "halve-batch",
            Rung::HalveSeqLength => "halve-seq-length",
            Rung::HalveLoraRank => "halve-lora-rank",
            Rung::HalveLoraLayers => "halve-lora-layers",
        }
    }

    /// Applies the rung to `cfg` once; `None` when it cannot apply (already on, at the floor,
    /// or not an adapter method).
    pub fn apply(self, cfg: &TrainingConfig, floors: &Floors) -> Option<(TrainingConfig, String)> {
        let mut next = cfg.clone();
        let why = match self {
            Rung::GradCheckpointing => {
                if cfg.grad_checkpointing {
                    return None;
                }
                next.grad_checkpointing = true;
                "enable gradient checkpointing".to_string()
            }
            Rung::SyncEachBatch => {
                // Only FSDP across ranks holds unsharded gradients, and only while it
                // accumulates or a halved batch would make it accumulate.
                let could_accumulate =
                    cfg.grad_accumulation > 1 || cfg.batch_size > floors.batch_size.max(1);
                if cfg.parallelism != Parallelism::Fsdp
                    || cfg.world_size <= 1
                    || cfg.grad_sync == GradSync::EachBatch
                    || !could_accumulate
                {
                    return None;
                }
                next.grad_sync = GradSync::EachBatch;
                "sync gradients at every micro-batch: FSDP keeps them sharded".to_string()
            }
            Rung::HalveBatch => {
                let floor = floors.batch_size.max(1);
                if cfg.batch_size <= floor {
                    return None;
                }
                // Keep batch × accumulation exactly: take the largest divisor of the effective
                // batch at or below half the batch (5 → 1 with accumulation ×5, not 5 → 2).
                let effective = cfg.batch_size * cfg.grad_accumulation;
                let half = (cfg.batch_size / 2).max(floor);
                next.batch_size = (floor..=half)
                    .rev()
                    .find(|d| effective.is_multiple_of(*d))?;
                next.grad_accumulation = effective / next.batch_size;
                format!(
                    "batch {} → {}, gradient accumulation {} → {} (effective batch {} kept)",
                    cfg.batch_size,
                    next.batch_size,
                    cfg.grad_accumulation,
                    next.grad_accumulation,
                    effective
                )
            }
            Rung::HalveSeqLength => {
                let half = cfg.seq_length / 2;
                if half < floors.seq_length.max(1) {
                    return None;
                }
                next.seq_length = half;
                format!("sequence length {} → {}", cfg.seq_length, half)
            }
            Rung::HalveLoraRank => {
                let half = cfg.lora_rank / 2;
                if !cfg.is_adapter() || half < floors.lora_rank.max(1) {
                    return None;
                }
                next.lora_rank = half;
                format!("LoRA rank {} → {}", cfg.lora_rank, half)
            }
            Rung::HalveLoraLayers => {
                let layers = cfg.adapted_layers();
                let half = layers / 2;
                if !cfg.is_adapter() || half < floors.lora_layers.max(1) {
                    return None;
                }
                next.lora_layers = Some(half);
                format!("LoRA layers {layers} → {half}")
            }
        };
        Some((next, why))
    }
}

impl fmt::Display for Rung {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The lowest values a plan may reach (policy: "downgrade floors").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Floors {
    /// Smallest per-device batch.
    pub batch_size: u64,
    /// Shortest sequence.
    pub seq_length: u64,
    /// Smallest LoRA rank.
    pub lora_rank: u64,
    /// Fewest adapted layers.
    pub lora_layers: u64,
    /// Whether quality rungs ([`Cost::Quality`]: sequence, LoRA rank and layers) may be taken at
    /// all: the policy's or the pod's permission. Off by default.
    #[cfg_attr(feature = "serde", serde(default))]
    pub allow_quality: bool,
}

impl Default for Floors {
    /// Batch 1, sequence 256, rank 4, 1 layer; no quality rung.
    fn default() -> Self {
        Floors {
            batch_size: 1,
            seq_length: 256,
            lora_rank: 4,
            lora_layers: 1,
            allow_quality: false,
        }
    }
}

/// One applied downgrade and what it bought.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Step {
    /// Which rung.
    pub rung: Rung,
    /// What changed, in words.
    pub explanation: String,
    /// Calibrated total after this step.
    pub total_after: Bytes,
    /// What this step saved: the calibrated total before it less [`total_after`](Self::total_after).
    pub saved: Bytes,
}

/// The result of planning against a budget.
#[derive(Debug, Clone, PartialEq)]
pub struct DowngradePlan {
    /// The budget the plan aimed at.
    pub budget: Bytes,
    /// Whether the final config fits.
    pub fits: bool,
    /// Steps applied, in order. Empty when the original config fits.
    pub steps: Vec<Step>,
    /// The config to run with (the original when it fits or nothing helped).
    pub config: TrainingConfig,
    /// The uncalibrated estimate of the original config.
    pub initial: Estimate,
    /// The uncalibrated estimate of the final config.
    pub estimate: Estimate,
    /// The calibration honoured at every step.
    pub calibration: Calibration,
    /// What each step was checked against: the point estimate or the upper bound.
    pub bound: Bound,
}

impl DowngradePlan {
    /// The calibrated total of the final config: what is compared with the budget.
    pub fn total(&self) -> Bytes {
        self.calibration.apply(self.estimate.total)
    }

    /// The calibrated total of the original config.
    pub fn initial_total(&self) -> Bytes {
        self.calibration.apply(self.initial.total)
    }

    /// The upper bound on the final config (its calibrated total when the plan was made
    /// against the point estimate): what is compared with the budget.
    pub fn upper(&self) -> Bytes {
        self.bound
            .upper(&self.config, self.estimate.total, self.total())
    }
}

/// Plans with the default [`Floors`].
pub fn plan(
    cfg: &TrainingConfig,
    budget: Bytes,
    calibration: &Calibration,
) -> Result<DowngradePlan, Vec<ConfigError>> {
    plan_with_floors(cfg, budget, calibration, &Floors::default())
}

/// Plans against the calibrated point estimate ([`Bound::POINT`]).
pub fn plan_with_floors(
    cfg: &TrainingConfig,
    budget: Bytes,
    calibration: &Calibration,
    floors: &Floors,
) -> Result<DowngradePlan, Vec<ConfigError>> {
    plan_against(cfg, budget, calibration, floors, &Bound::POINT)
}

/// Plans from `cfg`, taking at each step the rung that saves the most per unit of cost
/// (re-estimated, calibrated), and stopping as soon as `bound`'s figure (the upper bound at its level, or the point estimate) fits `budget`. When
/// nothing fits, `fits` is false and the config is the most downgraded one reached, so a caller
/// can still report how far short it is.
pub fn plan_against(
    cfg: &TrainingConfig,
    budget: Bytes,
    calibration: &Calibration,
    floors: &Floors,
    bound: &Bound,
) -> Result<DowngradePlan, Vec<ConfigError>> {
    let initial = estimate(cfg)?;
    let mut current = cfg.clone();
    let mut current_estimate = initial.clone();
    let mut steps = Vec::new();
    // The bound's factor depends on the config's class only (method, quantization,
    // parallelism), which few rungs change: computed once per class.
    let mut factors: Vec<(Class, Option<f64>)> = Vec::new();
    let mut fits = |c: &TrainingConfig, e: &Estimate| {
        let class = Class::of(c, Figure::Device);
        let factor = match factors.iter().find(|(k, _)| *k == class) {
            Some((_, f)) => *f,
            None => {
                let f = bound.factor(c);
                factors.push((class, f));
                f
            }
        };
        bound::apply(factor, e.total, calibration.apply(e.total)) <= budget
    };

    let min_quality_saving = Bytes::from_f64(budget.as_f64() * QUALITY_MIN_SAVING);
    // Greedy, by bytes saved per unit of cost: at each step every rung is tried once from the
    // current config, and the one that saves the most per unit is taken. Quality rungs are
    // weighed only when no free or compute rung saves anything: no amount of memory makes a
    // truncation better than a recomputation.
    while !fits(&current, &current_estimate) {
        let Some(best) = best_step(
            &current,
            current_estimate.total,
            calibration,
            floors,
            min_quality_saving,
        ) else {
            break;
        };
        let before = calibration.apply(current_estimate.total);
        let after = calibration.apply(best.estimate.total);
        steps.push(Step {
            rung: best.rung,
            explanation: best.explanation,
            total_after: after,
            saved: Bytes(before.0.saturating_sub(after.0)),
        });
        current = best.config;
        current_estimate = best.estimate;
    }

    // The greedy walk never steps back: a batch halved before checkpointing went on may fit
    // whole again after it. Undo what the fitting plan no longer needs, checked against the
    // same figure.
    if steps.len() > 1 && fits(&current, &current_estimate) {
        let rungs: Vec<Rung> = steps.iter().map(|s| s.rung).collect();
        let kept = step_back(&rungs, |kept| {
            let (config, estimate, replayed) = replay(cfg, &initial, kept, calibration, floors)?;
            // Every step kept must still save something: under FSDP's `no_sync` a halving
            // without the sync before it would add memory.
            let saves = replayed.iter().all(|s| s.saved > Bytes::ZERO);
            Some(saves && fits(&config, &estimate))
        });
        if kept.len() < rungs.len()
            && let Some((config, estimate, replayed)) =
                replay(cfg, &initial, &kept, calibration, floors)
        {
            current = config;
            current_estimate = estimate;
            steps = replayed;
        }
    }

    Ok(DowngradePlan {
        budget,
        fits: fits(&current, &current_estimate),
        steps,
        config: current,
        initial,
        estimate: current_estimate,
        calibration: *calibration,
        bound: *bound,
    })
}

/// The order in which the final pass of [`plan_against`] tries to take steps back: what
/// costs the run most first. Quality cuts (the data or the adapter), then halvings of the
/// batch (so the job keeps the largest micro-batch that fits, which is what the halvings
/// cost), then the compute rungs, which cost time at any batch.
pub const STEP_BACK_ORDER: [Rung; 6] = [
    Rung::HalveLoraLayers,
    Rung::HalveLoraRank,
    Rung::HalveSeqLength,
    Rung::HalveBatch,
    Rung::GradCheckpointing,
    Rung::SyncEachBatch,
];

/// The steps to keep of `taken`: in [`STEP_BACK_ORDER`], the last step of each rung is dropped
/// again and again while `fits` says the plan without it still fits (`None`: it cannot be
/// replayed). Each rung is tried until it fails once, then the next.
fn step_back(taken: &[Rung], mut fits: impl FnMut(&[Rung]) -> Option<bool>) -> Vec<Rung> {
    let mut kept = taken.to_vec();
    for rung in STEP_BACK_ORDER {
        while let Some(at) = kept.iter().rposition(|r| *r == rung) {
            let mut fewer = kept.clone();
            fewer.remove(at);
            if fewer.is_empty() || fits(&fewer) != Some(true) {
                break;
            }
            kept = fewer;
        }
    }
    kept
}

/// `rungs` applied one after another to `cfg` (whose estimate is `initial`), with each step's
/// explanation and saving as the plan reports them; `None` when one does not apply or the
/// estimator refuses its result.
fn replay(
    cfg: &TrainingConfig,
    initial: &Estimate,
    rungs: &[Rung],
    calibration: &Calibration,
    floors: &Floors,
) -> Option<(TrainingConfig, Estimate, Vec<Step>)> {
    let mut config = cfg.clone();
    let mut current = initial.clone();
    let mut steps = Vec::with_capacity(rungs.len());
    for rung in rungs {
        let (next, explanation) = rung.apply(&config, floors)?;
        let next_estimate = estimate(&next).ok()?;
        let before = calibration.apply(current.total);
        let after = calibration.apply(next_estimate.total);
        steps.push(Step {
            rung: *rung,
            explanation,
            total_after: after,
            saved: Bytes(before.0.saturating_sub(after.0)),
        });
        config = next;
        current = next_estimate;
    }
    Some((config, current, steps))
}

/// The step [`best_step`] chose.
#[derive(Debug, Clone, PartialEq)]
pub struct BestStep {
    /// Which rung.
    pub rung: Rung,
    /// The config after it.
    pub config: TrainingConfig,
    /// Its estimate (uncalibrated).
    pub estimate: Estimate,
    /// What changed, in words.
    pub explanation: String,
}

/// The one step from `current` (whose uncalibrated total is `total`) that saves the most bytes
/// per unit of cost ([`Rung::cost_units`]): free and compute rungs first, quality rungs (with
/// permission) only when none of those saves, and not for under `min_quality_saving`. Ties go
/// to the rung earlier in [`LADDER`]. `None` when no rung saves. The planner takes it until
/// the config fits; the profile controller takes one after an OOM kill.
pub fn best_step(
    current: &TrainingConfig,
    total: Bytes,
    calibration: &Calibration,
    floors: &Floors,
    min_quality_saving: Bytes,
) -> Option<BestStep> {
    let mut best: Option<(f64, BestStep)> = None;
    for quality in [false, true] {
        if quality && !floors.allow_quality {
            break;
        }
        for rung in LADDER
            .into_iter()
            .filter(|r| (r.cost() == Cost::Quality) == quality)
        {
            let Some((next, explanation)) = rung.apply(current, floors) else {
                continue;
            };
            // A step past a sanity limit (accumulation doubled beyond it) is not a config
            // anyone can run.
            let Ok(next_estimate) = estimate(&next) else {
                continue;
            };
            let saving = |reached: Bytes, units: f64| {
                let saved = calibration
                    .apply(total)
                    .0
                    .saturating_sub(calibration.apply(reached).0);
                (reached < total).then_some((saved, units))
            };
            let mut options = vec![saving(next_estimate.total, rung.cost_units(&next))];
            // Syncing each batch saves the unsharded gradients by itself when the trainer
            // accumulates, and otherwise lets the halving after it save: weighed both ways.
            if rung == Rung::SyncEachBatch
                && let Some((halved, reached)) = halved(&next, floors)
            {
                let units = rung.cost_units(&next) + Rung::HalveBatch.cost_units(&halved);
                options.push(saving(reached, units));
            }
            let Some((saved, units)) = options
                .into_iter()
                .flatten()
                .max_by(|a, b| (a.0 as f64 / a.1).total_cmp(&(b.0 as f64 / b.1)))
            else {
                continue;
            };
            // A quality cut that saves next to nothing is not worth what it costs.
            if rung.cost() == Cost::Quality && Bytes(saved) < min_quality_saving {
                continue;
            }
            let score = saved as f64 / units;
            if best.as_ref().is_none_or(|(b, _)| score > *b) {
                let step = BestStep {
                    rung,
                    config: next,
                    estimate: next_estimate,
                    explanation,
                };
                best = Some((score, step));
            }
        }
        if best.is_some() {
            break;
        }
    }
    best.map(|(_, step)| step)
}

/// `cfg` with its batch halved and its total, when that is a valid config.
fn halved(cfg: &TrainingConfig, floors: &Floors) -> Option<(TrainingConfig, Bytes)> {
    let (halved, _) = Rung::HalveBatch.apply(cfg, floors)?;
    let total = estimate(&halved).ok()?.total;
    Some((halved, total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;
    use crate::config::Method;

    /// LoRA on Llama 3 8B, batch 8 × accumulation 2, sequence 4096, rank 64, no checkpointing.
    fn heavy() -> TrainingConfig {
        let mut cfg = TrainingConfig::new(catalog::lookup("llama-3-8b").expect("catalog"));
        cfg.method = Method::Lora;
        cfg.batch_size = 8;
        cfg.grad_accumulation = 2;
        cfg.seq_length = 4096;
        cfg.lora_rank = 64;
        cfg
    }

    fn total(cfg: &TrainingConfig) -> Bytes {
        estimate(cfg).expect("valid").total
    }

    /// The default floors with quality rungs allowed.
    fn allowed() -> Floors {
        Floors {
            allow_quality: true,
            ..Floors::default()
        }
    }

    /// Plans with quality rungs allowed.
    fn plan_allowed(cfg: &TrainingConfig, budget: Bytes) -> DowngradePlan {
        plan_with_floors(cfg, budget, &Calibration::none(), &allowed()).expect("valid")
    }

    fn with(f: impl Fn(&mut TrainingConfig)) -> TrainingConfig {
        let mut cfg = heavy();
        f(&mut cfg);
        cfg
    }

    fn calibrated(factor: f64) -> Calibration {
        let runs: Vec<(Bytes, Bytes)> = (0..3)
            .map(|_| (Bytes(1000), Bytes::from_f64(1000.0 * factor)))
            .collect();
        Calibration::from_runs(&runs)
    }

    #[test]
    fn takes_the_step_that_saves_most_per_unit_of_cost_and_stops_as_soon_as_it_fits() {
        use Rung::*;
        // Sequence 4096: even batch 1 is a full micro-batch, so halving the batch (same math,
        // hardly slower) saves more per unit than checkpointing (a third more time), down to
        // batch 1. Then checkpointing; the sequence only with permission and last.
        // (name, budget = the total of the config the plan should reach, expected rungs)
        let table: Vec<(&str, Bytes, Vec<Rung>)> = vec![
            ("already fits", total(&heavy()), vec![]),
            (
                "halving twice is enough",
                total(&with(|c| c.batch_size = 2)),
                vec![HalveBatch, HalveBatch],
            ),
            (
                "then checkpointing at batch 1",
                total(&with(|c| {
                    c.grad_checkpointing = true;
                    c.batch_size = 1;
                })),
                vec![HalveBatch, HalveBatch, HalveBatch, GradCheckpointing],
            ),
            (
                "then the sequence once nothing free or compute is left",
                total(&with(|c| {
                    c.grad_checkpointing = true;
                    c.batch_size = 1;
                    c.seq_length = 1024;
                })),
                vec![
                    HalveBatch,
                    HalveBatch,
                    HalveBatch,
                    GradCheckpointing,
                    HalveSeqLength,
                    HalveSeqLength,
                ],
            ),
        ];
        for (name, budget, expected) in table {
            let p = plan_allowed(&heavy(), budget);
            let rungs: Vec<Rung> = p.steps.iter().map(|s| s.rung).collect();
            assert_eq!(rungs, expected, "{name}");
            assert!(p.fits, "{name}");
            assert!(p.total() <= budget, "{name}");
            let c = &p.config;
            assert_eq!(
                c.batch_size * c.grad_accumulation,
                16,
                "{name}: effective batch"
            );
        }
    }

    #[test]
    fn short_sequences_checkpoint_before_the_batch_gets_small() {
        // Sequence 256, batch 8: 1024 tokens per micro-batch already; halving it would leave
        // the device idle, so checkpointing (which saves most of the activations) goes first.
        let start = with(|c| c.seq_length = 256);
        let target = with(|c| {
            c.seq_length = 256;
            c.grad_checkpointing = true;
        });
        let p = plan(&start, total(&target), &Calibration::none()).expect("valid");
        let rungs: Vec<Rung> = p.steps.iter().map(|s| s.rung).collect();
        assert_eq!(rungs, vec![Rung::GradCheckpointing]);
        assert_eq!(p.config.batch_size, 8);
    }

    #[test]
    fn every_step_is_the_best_saving_per_unit_among_the_rungs_that_apply() {
        let starts = [
            heavy(),
            with(|c| c.seq_length = 512),
            with(|c| c.seq_length = 256),
            fsdp(),
        ];
        for start in starts {
            let p = plan_allowed(&start, Bytes::gib(1));
            let mut current = start.clone();
            for step in &p.steps {
                let now = estimate(&current).expect("valid").total;
                let best_other = LADDER
                    .into_iter()
                    .filter(|r| r.cost() == step.rung.cost() || r.cost() != Cost::Quality)
                    .filter(|r| *r != Rung::SyncEachBatch && *r != step.rung)
                    .filter_map(|r| {
                        let (next, _) = r.apply(&current, &allowed())?;
                        let after = estimate(&next).ok()?.total;
                        Some(now.0.saturating_sub(after.0) as f64 / r.cost_units(&next))
                    })
                    .fold(0.0, f64::max);
                let (next, _) = step.rung.apply(&current, &allowed()).expect("it applied");
                let mine = step.saved.as_f64() / step.rung.cost_units(&next);
                if step.rung != Rung::SyncEachBatch && step.rung.cost() != Cost::Quality {
                    assert!(mine >= best_other, "{:?} over a better rung", step.rung);
                }
                current = next;
            }
            assert_eq!(current, p.config);
        }
    }

    #[test]
    fn reaches_lora_rank_and_layers_last() {
        // Rank 1024: the adapter is large enough that halving it is worth its cost.
        let start = with(|c| c.lora_rank = 1024);
        let target = with(|c| {
            c.grad_checkpointing = true;
            c.batch_size = 1;
            c.seq_length = 256;
            c.lora_rank = 256;
            c.lora_layers = Some(8);
        });
        let floors = Floors {
            lora_rank: 256,
            ..allowed()
        };
        let p =
            plan_with_floors(&start, total(&target), &Calibration::none(), &floors).expect("valid");
        assert!(p.fits, "{:?}", p.steps);
        let rungs: Vec<Rung> = p.steps.iter().map(|s| s.rung).collect();
        let first = |r: Rung| rungs.iter().position(|x| *x == r);
        assert!(first(Rung::HalveSeqLength) < first(Rung::HalveLoraRank));
        assert!(first(Rung::HalveLoraRank) < first(Rung::HalveLoraLayers));
        assert_eq!(p.config.lora_rank, 256);
        assert_eq!(p.config.lora_layers, Some(8));
    }

    #[test]
    fn says_clearly_when_nothing_fits_and_keeps_the_most_downgraded_config() {
        let p = plan_allowed(&heavy(), Bytes::gib(1));
        assert!(!p.fits);
        let c = &p.config;
        let floors = allowed();
        assert!(c.grad_checkpointing);
        assert_eq!(c.batch_size, floors.batch_size);
        assert_eq!(c.grad_accumulation, 16);
        assert_eq!(c.seq_length, floors.seq_length);
        // The adapter is cut only while a cut saves 2 % of the budget: rank 64 → 32 does, the
        // cuts below it save a few MiB each.
        assert!(c.lora_rank >= floors.lora_rank && c.lora_rank < 64);
        for step in p.steps.iter().filter(|s| s.rung.cost() == Cost::Quality) {
            assert!(step.saved.as_f64() >= p.budget.as_f64() * QUALITY_MIN_SAVING);
        }
        assert!(p.total() > p.budget);
        assert!(p.total() < p.initial_total());
    }

    #[test]
    fn every_step_saves_memory_and_a_rung_that_saves_nothing_is_skipped() {
        let p = plan_allowed(&heavy(), Bytes::gib(1));
        let mut before = p.initial_total();
        for step in &p.steps {
            assert!(
                step.total_after < before,
                "{} saved nothing",
                step.explanation
            );
            assert_eq!(
                step.saved.0,
                before.0 - step.total_after.0,
                "{}",
                step.explanation
            );
            before = step.total_after;
        }
        // Checkpointing already on: the first rung is skipped, not repeated.
        let on = with(|c| c.grad_checkpointing = true);
        let p = plan(&on, Bytes(total(&on).0 / 2), &Calibration::none()).expect("valid");
        assert!(p.steps.iter().all(|s| s.rung != Rung::GradCheckpointing));
    }

    #[test]
    fn full_finetuning_never_touches_lora_rungs() {
        let mut cfg = heavy();
        cfg.method = Method::Full;
        let p = plan_allowed(&cfg, Bytes::gib(1));
        assert!(!p.fits);
        assert!(
            p.steps
                .iter()
                .all(|s| !matches!(s.rung, Rung::HalveLoraRank | Rung::HalveLoraLayers))
        );
    }

    #[test]
    fn calibration_is_honoured_at_every_step() {
        let cfg = heavy();
        let budget = total(&cfg);
        let none = plan(&cfg, budget, &Calibration::none()).expect("valid");
        assert!(none.fits && none.steps.is_empty());

        let cal = calibrated(1.2);
        assert!(cal.is_active());
        let p = plan(&cfg, budget, &cal).expect("valid");
        assert!(!p.steps.is_empty(), "a 1.2 factor must force downgrades");
        assert!(p.fits);
        for step in &p.steps {
            assert!(step.total_after.as_f64() > 0.0);
        }
        let last = p.steps.last().expect("steps");
        assert_eq!(last.total_after, cal.apply(p.estimate.total));
        assert!(p.total() <= budget);
    }

    #[test]
    fn planning_against_the_bound_downgrades_where_the_point_estimate_fits() {
        let cfg = heavy();
        let budget = total(&cfg);
        let floors = Floors::default();
        let point = plan_with_floors(&cfg, budget, &Calibration::none(), &floors).expect("valid");
        assert!(point.fits && point.steps.is_empty());
        let bound = Bound::at(0.95, &[]);
        let p = plan_against(&cfg, budget, &Calibration::none(), &floors, &bound).expect("valid");
        assert!(
            bound.upper(&cfg, budget, budget) > budget,
            "the bound is above the estimate"
        );
        assert!(!p.steps.is_empty(), "the bound must force downgrades");
        assert!(p.fits);
        assert!(p.upper() <= budget && p.total() < p.upper());
    }

    /// Full fine-tuning of Llama 3 8B under FSDP on 8 ranks, batch 8, no accumulation,
    /// sequence 1024: unsharded gradients (`Pt·4`, 32 GB) outweigh what halving the batch saves
    /// once checkpointing is on.
    fn fsdp() -> TrainingConfig {
        let mut cfg = TrainingConfig::new(catalog::lookup("llama-3-8b").expect("catalog"));
        cfg.parallelism = Parallelism::Fsdp;
        cfg.world_size = 8;
        cfg.batch_size = 8;
        cfg.seq_length = 1024;
        cfg
    }

    fn fsdp_with(f: impl Fn(&mut TrainingConfig)) -> TrainingConfig {
        let mut cfg = fsdp();
        f(&mut cfg);
        cfg
    }

    #[test]
    fn fsdp_syncs_each_batch_before_halving_so_that_halving_saves() {
        use Rung::*;
        // Halving under no_sync would hold the gradients unsharded: more memory, not less.
        let ckpt = fsdp_with(|c| c.grad_checkpointing = true);
        let halved_no_sync = fsdp_with(|c| {
            c.grad_checkpointing = true;
            c.batch_size = 4;
            c.grad_accumulation = 2;
        });
        assert!(
            total(&halved_no_sync) > total(&ckpt),
            "the defect this rung cures"
        );
        let synced = |f: &dyn Fn(&mut TrainingConfig)| {
            fsdp_with(|c| {
                c.grad_sync = GradSync::EachBatch;
                f(c)
            })
        };
        // (name, start, budget = the total of the config the plan should reach, rungs)
        let table: Vec<(&str, TrainingConfig, Bytes, Vec<Rung>)> = vec![
            (
                "accumulation 1: sync (free there) lets the batch halve",
                fsdp(),
                total(&synced(&|c| {
                    c.grad_checkpointing = true;
                    c.batch_size = 2;
                    c.grad_accumulation = 4;
                })),
                vec![GradCheckpointing, SyncEachBatch, HalveBatch, HalveBatch],
            ),
            (
                "already accumulating: syncing alone is enough",
                fsdp_with(|c| {
                    c.batch_size = 4;
                    c.grad_accumulation = 2;
                }),
                total(&synced(&|c| {
                    c.grad_checkpointing = true;
                    c.batch_size = 4;
                    c.grad_accumulation = 2;
                })),
                // The unsharded gradients outweigh the activations here.
                vec![SyncEachBatch, GradCheckpointing],
            ),
            (
                "the trainer syncs each batch already: no rung for it",
                synced(&|_| {}),
                total(&synced(&|c| {
                    c.grad_checkpointing = true;
                    c.batch_size = 2;
                    c.grad_accumulation = 4;
                })),
                // Batch 8 → 4 is cheap (long micro-batches), then checkpointing saves more per
                // unit than 4 → 2.
                vec![HalveBatch, GradCheckpointing, HalveBatch],
            ),
            (
                "checkpointing is enough: the trainer's sync is left alone",
                fsdp(),
                total(&ckpt),
                vec![GradCheckpointing],
            ),
        ];
        for (name, start, budget, expected) in table {
            let p = plan(&start, budget, &Calibration::none()).expect("valid");
            let rungs: Vec<Rung> = p.steps.iter().map(|s| s.rung).collect();
            assert_eq!(rungs, expected, "{name}");
            assert!(p.fits, "{name}");
            let synced =
                expected.contains(&SyncEachBatch) || start.grad_sync == GradSync::EachBatch;
            assert_eq!(
                p.config.grad_sync == GradSync::EachBatch,
                synced,
                "{name}: grad sync"
            );
            assert_eq!(
                p.config.batch_size * p.config.grad_accumulation,
                start.batch_size * start.grad_accumulation,
                "{name}: effective batch"
            );
        }
    }

    #[test]
    fn sync_each_batch_only_where_fsdp_would_hold_unsharded_gradients() {
        let floors = Floors::default();
        let applies = |cfg: &TrainingConfig| Rung::SyncEachBatch.apply(cfg, &floors).is_some();
        assert!(applies(&fsdp()));
        assert!(applies(&fsdp_with(|c| {
            c.batch_size = 1;
            c.grad_accumulation = 8;
        })));
        let not = [
            ("one rank", fsdp_with(|c| c.world_size = 1)),
            (
                "ZeRO-3 reduces every micro-batch",
                fsdp_with(|c| c.parallelism = Parallelism::Zero3),
            ),
            ("DDP", fsdp_with(|c| c.parallelism = Parallelism::Ddp)),
            (
                "already each batch",
                fsdp_with(|c| c.grad_sync = GradSync::EachBatch),
            ),
            (
                "batch at its floor and no accumulation: nothing will accumulate",
                fsdp_with(|c| c.batch_size = 1),
            ),
        ];
        for (name, cfg) in not {
            assert!(!applies(&cfg), "{name}");
            let p = plan(&cfg, Bytes(1), &Calibration::none()).expect("valid");
            assert!(
                p.steps.iter().all(|s| s.rung != Rung::SyncEachBatch),
                "{name}: {:?}",
                p.steps
            );
        }
        // At accumulation 1 with no batch to halve below a high floor, syncing enables nothing.
        let high_floor = Floors {
            batch_size: 8,
            ..Floors::default()
        };
        let p =
            plan_with_floors(&fsdp(), Bytes(1), &Calibration::none(), &high_floor).expect("valid");
        assert!(p.steps.iter().all(|s| s.rung != Rung::SyncEachBatch));
        assert_eq!(p.config.grad_sync, GradSync::Accumulate);
    }

    #[test]
    fn sync_each_batch_saves_the_unsharded_gradients_when_accumulating() {
        let accumulating = fsdp_with(|c| {
            c.batch_size = 4;
            c.grad_accumulation = 2;
        });
        let (synced, why) = Rung::SyncEachBatch
            .apply(&accumulating, &Floors::default())
            .expect("applies");
        assert!(why.contains("every micro-batch"), "{why}");
        let grads = |c: &TrainingConfig| {
            estimate(c)
                .expect("valid")
                .component(crate::Component::Gradients)
        };
        // bf16-mixed: fp32 gradients of 8.03B parameters, whole vs one eighth.
        assert_eq!(grads(&accumulating).0, grads(&synced).0 * 8);
        assert!(total(&synced) < total(&accumulating));
    }

    #[test]
    fn halving_an_odd_batch_keeps_the_effective_batch_exactly() {
        let mut cfg = heavy();
        cfg.batch_size = 5;
        cfg.grad_accumulation = 3;
        let (next, why) = Rung::HalveBatch
            .apply(&cfg, &Floors::default())
            .expect("applies");
        assert_eq!(next.batch_size * next.grad_accumulation, 15);
        assert!(next.batch_size <= 2);
        assert!(why.contains("effective batch 15 kept"));
    }

    #[test]
    fn a_step_past_a_sanity_limit_ends_its_rung_not_the_plan() {
        let mut cfg = heavy();
        cfg.batch_size = 2;
        cfg.grad_accumulation = crate::config::limits::COUNT;
        let plan = plan_with_floors(&cfg, Bytes::gib(1), &Calibration::none(), &allowed())
            .expect("a plan, not an error");
        assert!(!plan.fits);
        assert!(
            plan.steps.iter().all(|s| s.rung != Rung::HalveBatch),
            "doubling the accumulation past its limit is not a step: {:?}",
            plan.steps
        );
        assert_eq!(plan.config.grad_accumulation, crate::config::limits::COUNT);
        assert!(
            plan.steps.iter().any(|s| s.rung == Rung::HalveSeqLength),
            "later rungs still run: {:?}",
            plan.steps
        );
    }

    #[test]
    fn quality_rungs_need_permission() {
        // Floors reached without permission: free and compute rungs only.
        let p = plan(&heavy(), Bytes::gib(1), &Calibration::none()).expect("valid");
        assert!(!p.fits);
        assert!(
            p.steps.iter().all(|s| s.rung.cost() != Cost::Quality),
            "{:?}",
            p.steps
        );
        assert_eq!(p.config.seq_length, 4096);
        assert_eq!(p.config.lora_rank, 64);
        assert_eq!(p.config.lora_layers, None);
        assert_eq!(p.config.batch_size, 1);
        // With it, the same budget takes them.
        let p = plan_allowed(&heavy(), Bytes::gib(1));
        assert!(p.steps.iter().any(|s| s.rung.cost() == Cost::Quality));
    }

    #[test]
    fn a_quality_rung_that_saves_under_two_percent_of_the_budget_is_not_taken() {
        // Batch at its floor, checkpointing on, sequence 4096, rank 64: halving the rank saves
        // the adapter and its optimizer state (tens of MiB) against a budget of many GiB.
        let start = with(|c| {
            c.grad_checkpointing = true;
            c.batch_size = 1;
            c.grad_accumulation = 16;
            c.seq_length = 256;
        });
        let (halved, _) = Rung::HalveLoraRank
            .apply(&start, &allowed())
            .expect("applies");
        let saving = total(&start).0 - total(&halved).0;
        let budget = total(&halved);
        assert!(
            (saving as f64) < budget.as_f64() * QUALITY_MIN_SAVING,
            "the case: a saving of {saving} bytes is small"
        );
        let p = plan_allowed(&start, budget);
        assert!(
            p.steps.iter().all(|s| s.rung != Rung::HalveLoraRank),
            "{:?}",
            p.steps
        );
        assert_eq!(p.config.lora_rank, 64);
    }

    #[test]
    fn steps_back_to_the_largest_micro_batch_that_fits_once_checkpointing_is_on() {
        use Rung::*;
        // The README's example: LoRA on Llama 3 8B, batch 8 × 4096, against the 0.95 bound.
        // The greedy walk halves the batch to 1 (each halving saves more per unit than
        // checkpointing) and then turns checkpointing on. Into 48 GiB, batch 2 with
        // checkpointing fits too (upper bound 44.3 GiB), so a halving is taken back; into the
        // README's 40 GiB it does not, and batch 1 is already the largest that fits.
        let mut cfg = TrainingConfig::new(catalog::lookup("llama-3-8b").expect("catalog"));
        cfg.method = Method::Lora;
        cfg.batch_size = 8;
        cfg.seq_length = 4096;
        let (bound, floors) = (Bound::at(0.95, &[]), Floors::default());
        for (budget, batch) in [(Bytes::gib(48), 2), (Bytes::gib(40), 1)] {
            let p =
                plan_against(&cfg, budget, &Calibration::none(), &floors, &bound).expect("valid");
            assert!(p.fits && p.upper() <= budget, "{budget}: {:?}", p.steps);
            let c = &p.config;
            assert!(c.grad_checkpointing, "{budget}");
            assert_eq!(c.batch_size, batch, "{budget}");
            assert_eq!(
                c.batch_size * c.grad_accumulation,
                8,
                "{budget}: effective batch"
            );
            // The largest that fits: one doubling more does not.
            let mut larger = c.clone();
            larger.batch_size *= 2;
            larger.grad_accumulation /= 2;
            let e = total(&larger);
            assert!(bound.upper(&larger, e, e) > budget, "{budget}: {larger:?}");
            // The steps reported are the steps that lead from the config to the plan's.
            let rungs: Vec<Rung> = p.steps.iter().map(|s| s.rung).collect();
            let halvings = (8 / c.batch_size).ilog2() as usize;
            assert_eq!(rungs.iter().filter(|r| **r == HalveBatch).count(), halvings);
            assert_eq!(rungs.last(), Some(&GradCheckpointing), "{budget}");
            let mut replayed = cfg.clone();
            let mut before = p.initial_total();
            for step in &p.steps {
                replayed = step.rung.apply(&replayed, &floors).expect("applies").0;
                assert_eq!(step.total_after, total(&replayed), "{}", step.explanation);
                assert_eq!(step.saved.0, before.0 - step.total_after.0);
                before = step.total_after;
            }
            assert_eq!(&replayed, c);
        }
    }

    #[test]
    fn steps_back_quality_cuts_first_then_halvings_then_compute() {
        use Rung::*;
        // (name, taken, what fits, kept)
        type Fits = fn(&[Rung]) -> bool;
        let table: Vec<(&str, Vec<Rung>, Fits, Vec<Rung>)> = vec![
            (
                "halvings undone while checkpointing holds",
                vec![HalveBatch, HalveBatch, HalveBatch, GradCheckpointing],
                |k| k.contains(&GradCheckpointing) && k.contains(&HalveBatch),
                vec![HalveBatch, GradCheckpointing],
            ),
            (
                "a sequence cut goes back before any halving",
                vec![HalveBatch, GradCheckpointing, HalveSeqLength],
                |k| k.len() >= 2,
                vec![HalveBatch, GradCheckpointing],
            ),
            (
                "nothing fits with less: nothing undone",
                vec![HalveBatch, GradCheckpointing],
                |k| k.len() == 2,
                vec![HalveBatch, GradCheckpointing],
            ),
            (
                "checkpointing goes back when the halvings alone fit",
                vec![GradCheckpointing, HalveBatch, HalveBatch],
                |k| k.iter().filter(|r| **r == HalveBatch).count() == 2,
                vec![HalveBatch, HalveBatch],
            ),
        ];
        for (name, taken, fits, kept) in table {
            assert_eq!(step_back(&taken, |k| Some(fits(k))), kept, "{name}");
        }
        // A step that cannot be replayed is kept.
        let taken = [HalveBatch, GradCheckpointing];
        assert_eq!(step_back(&taken, |_| None), taken);
    }

    #[test]
    fn every_rung_has_its_cost_class() {
        use Rung::*;
        let class =
            |c: Cost| -> Vec<Rung> { LADDER.into_iter().filter(|r| r.cost() == c).collect() };
        assert_eq!(class(Cost::Free), [HalveBatch]);
        assert_eq!(class(Cost::Compute), [GradCheckpointing, SyncEachBatch]);
        assert_eq!(
            class(Cost::Quality),
            [HalveSeqLength, HalveLoraRank, HalveLoraLayers]
        );
    }
}
