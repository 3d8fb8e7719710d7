//! What a profile changes at admission. Pure: the webhook calls these with a profile from its
//! watch cache, and `memguard mutate --profile` with one from a file.

use memguard_api::crd::{MemoryProfileStatus, Recovery, TrainerReport};
use memguard_api::phase::TrainerPhase;
use memguard_estimator::calibration::{FACTOR_RANGE, MIN_RUNS};
use memguard_estimator::{Calibration, Floors, GradSync, TrainingConfig};

/// The adjustments a profile asks for.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Adjustments {
    /// The median correction factor of the profile's runs (none before 3 runs).
    pub calibration: Calibration,
    /// The job's own factor on its estimate from its measured runs
    /// ([`memguard_estimator::bound::learned_factor`]): it replaces the population's upper bound.
    pub learned_bound: Option<f64>,
    /// The pending recovery after an OOM kill.
    pub recovery: Option<Recovery>,
    /// The profile's `cannot fit: …` verdict (OOM recoveries exhausted, or every knob at its
    /// floor): the pod is admitted at the smallest config tried, with this as its error.
    pub verdict: Option<String>,
    /// What the trainer of the latest run reported of its config at train start: admission
    /// plans on it where it could not read a knob, or read another value
    /// ([`crate::reported`]).
    pub trainer_report: Option<TrainerReport>,
    /// The phase of the newest OOM kill, when it has one: the host plan accounts for a kill
    /// at `load` or `save` ([`crate::host::after_kill`]).
    pub last_kill_phase: Option<TrainerPhase>,
}

impl Adjustments {
    /// Whether anything changes.
    pub fn is_empty(&self) -> bool {
        !self.calibration.is_active() && self.recovery.is_none()
    }

    /// The calibration to plan with: the profile's, raised to the recovery's factor while a
    /// recovery is pending (a factor the profile has not earned by runs still counts: the OOM
    /// kill proved it).
    pub fn effective_calibration(&self) -> Calibration {
        let floor = self
            .recovery
            .as_ref()
            .and_then(|r| r.factor)
            .filter(|f| f.is_finite())
            .map(|f| f.clamp(FACTOR_RANGE.0, FACTOR_RANGE.1));
        match floor {
            Some(f) if !self.calibration.is_active() || f > self.calibration.factor => {
                Calibration {
                    factor: f,
                    runs: self.calibration.runs.max(MIN_RUNS),
                }
            }
            _ => self.calibration,
        }
    }

    /// What the plan checks against the budget: the upper bound at `level`, the job's own
    /// runs' factor in place of the population's once it has enough.
    pub fn bound(&self, level: f64) -> memguard_estimator::Bound {
        memguard_estimator::Bound {
            level: Some(level),
            learned: self.learned_bound,
        }
    }

    /// The config to start planning from: `cfg` with the recovery's knobs where they are more
    /// conservative (see [`recovery_start`]); `cfg` itself without a recovery.
    pub fn start(&self, cfg: &TrainingConfig, floors: &Floors) -> TrainingConfig {
        match &self.recovery {
            Some(r) => recovery_start(cfg, r, floors),
            None => cfg.clone(),
        }
    }
}

/// The adjustments of a profile's status.
pub fn adjustments(status: &MemoryProfileStatus) -> Adjustments {
    Adjustments {
        calibration: status.calibration(),
        learned_bound: memguard_estimator::bound::learned_factor(
            &memguard_api::crd::calibration_pairs(&status.runs),
        ),
        recovery: status.recovery.clone(),
        verdict: status.verdict.clone(),
        trainer_report: status.trainer_report.clone(),
        last_kill_phase: status.last_kill_phase(),
    }
}

/// `cfg` with each knob of the recovery that is smaller than the pod's own (batch, sequence,
/// LoRA rank and layers; checkpointing switched on), never below `floors`. When the batch
/// shrinks, gradient accumulation grows to keep the pod's effective batch (when it divides).
/// A pod whose own annotations are already more conservative keeps them.
pub fn recovery_start(
    cfg: &TrainingConfig,
    recovery: &Recovery,
    floors: &Floors,
) -> TrainingConfig {
    let k = &recovery.config;
    let mut out = cfg.clone();
    let smaller = |own: u64, rec: Option<u64>, floor: u64| match rec {
        Some(r) if r < own => r.max(floor.max(1)).min(own),
        _ => own,
    };
    out.batch_size = smaller(cfg.batch_size, k.batch_size, floors.batch_size);
    if out.batch_size != cfg.batch_size {
        let effective = cfg.batch_size * cfg.grad_accumulation;
        out.grad_accumulation = if effective.is_multiple_of(out.batch_size) {
            effective / out.batch_size
        } else {
            k.grad_accumulation.unwrap_or(cfg.grad_accumulation)
        };
    }
    if k.grad_checkpointing == Some(true) {
        out.grad_checkpointing = true;
    }
    if k.grad_sync.as_deref().and_then(|s| s.parse().ok()) == Some(GradSync::EachBatch) {
        out.grad_sync = GradSync::EachBatch;
    }
    out.seq_length = smaller(cfg.seq_length, k.seq_length, floors.seq_length);
    if cfg.is_adapter() {
        out.lora_rank = smaller(cfg.lora_rank, k.lora_rank, floors.lora_rank);
        let layers = cfg.adapted_layers();
        let reduced = smaller(layers, k.lora_layers, floors.lora_layers);
        if reduced != layers {
            out.lora_layers = Some(reduced);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use memguard_api::crd::TrainingKnobs;
    use memguard_estimator::{Method, catalog};

    fn cfg() -> TrainingConfig {
        let mut c = TrainingConfig::new(catalog::lookup("llama-3-8b").expect("catalog"));
        c.method = Method::Lora;
        c.batch_size = 16;
        c.grad_accumulation = 2;
        c.seq_length = 4096;
        c.lora_rank = 64;
        c
    }

    fn recovery(knobs: TrainingKnobs, factor: Option<f64>) -> Recovery {
        Recovery {
            rungs: 1,
            config: knobs,
            factor,
            reason: "test".into(),
        }
    }

    /// (batch, accumulation, checkpointing, seq, rank, layers)
    type Knobs = (u64, u64, bool, u64, u64, Option<u64>);

    #[test]
    fn recovery_knobs_apply_only_where_more_conservative() {
        let base = cfg();
        // (name, recovery knobs, expected (batch, accumulation, checkpointing, seq, rank, layers))
        let table: [(&str, TrainingKnobs, Knobs); 5] = [
            (
                "halved batch keeps the effective batch",
                TrainingKnobs {
                    batch_size: Some(8),
                    grad_accumulation: Some(2),
                    ..TrainingKnobs::default()
                },
                (8, 4, false, 4096, 64, None),
            ),
            (
                "a larger value never raises the pod's own",
                TrainingKnobs {
                    batch_size: Some(64),
                    seq_length: Some(8192),
                    ..TrainingKnobs::default()
                },
                (16, 2, false, 4096, 64, None),
            ),
            (
                "checkpointing switched on, shorter sequence, smaller rank",
                TrainingKnobs {
                    grad_checkpointing: Some(true),
                    seq_length: Some(2048),
                    lora_rank: Some(32),
                    lora_layers: Some(16),
                    ..TrainingKnobs::default()
                },
                (16, 2, true, 2048, 32, Some(16)),
            ),
            (
                "never below the floors",
                TrainingKnobs {
                    seq_length: Some(16),
                    lora_rank: Some(1),
                    ..TrainingKnobs::default()
                },
                (16, 2, false, 256, 4, None),
            ),
            (
                "batch that does not divide the effective batch: the recovery's accumulation",
                TrainingKnobs {
                    batch_size: Some(5),
                    grad_accumulation: Some(7),
                    ..TrainingKnobs::default()
                },
                (5, 7, false, 4096, 64, None),
            ),
        ];
        for (name, knobs, want) in table {
            let out = recovery_start(&base, &recovery(knobs, None), &Floors::default());
            let got = (
                out.batch_size,
                out.grad_accumulation,
                out.grad_checkpointing,
                out.seq_length,
                out.lora_rank,
                out.lora_layers,
            );
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn the_recovery_factor_raises_the_calibration_never_lowers_it() {
        let three = |f: f64| Calibration { factor: f, runs: 3 };
        // (name, profile calibration, recovery factor, expected factor)
        let table = [
            ("no recovery", three(1.2), None, 1.2),
            ("recovery above the median", three(1.2), Some(1.5), 1.5),
            ("recovery below the median", three(1.2), Some(1.1), 1.2),
            ("recovery without runs", Calibration::none(), Some(1.3), 1.3),
            (
                "recovery factor absurd: clamped",
                Calibration::none(),
                Some(50.0),
                FACTOR_RANGE.1,
            ),
        ];
        for (name, calibration, factor, want) in table {
            let adj = Adjustments {
                calibration,
                recovery: factor.map(|f| recovery(TrainingKnobs::default(), Some(f))),
                ..Adjustments::default()
            };
            let eff = adj.effective_calibration();
            assert!((eff.factor - want).abs() < 1e-9, "{name}: {eff:?}");
            assert!(eff.runs >= MIN_RUNS || want == 1.0, "{name}: applied");
        }
    }

    #[test]
    fn an_empty_profile_adjusts_nothing() {
        let adj = adjustments(&MemoryProfileStatus::default());
        assert!(adj.is_empty());
        assert_eq!(adj.start(&cfg(), &Floors::default()), cfg());
        assert_eq!(adj.effective_calibration(), Calibration::none());
    }
}
