//! The downgrade plan: walk the quality-preserving ladder until the step fits the budget.

use crate::calibration::Calibration;
use crate::config::{ConfigError, TrainingConfig};
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
    /// Halve the per-device batch and double gradient accumulation: same effective batch.
    HalveBatch,
    /// Halve the sequence length: sees less context per sample.
    HalveSeqLength,
    /// Halve the LoRA rank: a smaller adapter.
    HalveLoraRank,
    /// Halve the number of adapted layers.
    HalveLoraLayers,
}

/// The ladder, cheapest quality cost first. Each rung is applied as often as it helps (down to
/// its floor) before the next is tried.
pub const LADDER: [Rung; 5] = [
    Rung::GradCheckpointing,
    Rung::HalveBatch,
    Rung::HalveSeqLength,
    Rung::HalveLoraRank,
    Rung::HalveLoraLayers,
];

impl Rung {
    /// Kebab-case name used in annotations and JSON.
    pub const fn name(self) -> &'static str {
        match self {
            Rung::GradCheckpointing => "grad-checkpointing",
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
}

impl Default for Floors {
    /// Batch 1, sequence 256, rank 4, 1 layer.
    fn default() -> Self {
        Floors {
            batch_size: 1,
            seq_length: 256,
            lora_rank: 4,
            lora_layers: 1,
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
}

/// Plans with the default [`Floors`].
pub fn plan(
    cfg: &TrainingConfig,
    budget: Bytes,
    calibration: &Calibration,
) -> Result<DowngradePlan, Vec<ConfigError>> {
    plan_with_floors(cfg, budget, calibration, &Floors::default())
}

/// Walks [`LADDER`] from `cfg`, re-estimating (calibrated) after each step and stopping as soon
/// as the total fits `budget`. When nothing fits, `fits` is false and the config is the most
/// downgraded one reached, so a caller can still report how far short it is.
pub fn plan_with_floors(
    cfg: &TrainingConfig,
    budget: Bytes,
    calibration: &Calibration,
    floors: &Floors,
) -> Result<DowngradePlan, Vec<ConfigError>> {
    let initial = estimate(cfg)?;
    let mut current = cfg.clone();
    let mut current_estimate = initial.clone();
    let mut steps = Vec::new();
    let fits = |e: &Estimate| calibration.apply(e.total) <= budget;

    'ladder: for rung in LADDER {
        while !fits(&current_estimate) {
            let Some((next, explanation)) = rung.apply(&current, floors) else {
                continue 'ladder;
            };
            let next_estimate = estimate(&next)?;
            steps.push(Step {
                rung,
                explanation,
                total_after: calibration.apply(next_estimate.total),
            });
            current = next;
            current_estimate = next_estimate;
        }
        break;
    }

    Ok(DowngradePlan {
        budget,
        fits: fits(&current_estimate),
        steps,
        config: current,
        initial,
        estimate: current_estimate,
        calibration: *calibration,
    })
}
