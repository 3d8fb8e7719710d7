//! When a plan cannot fit: the changes outside the knobs that would, each re-planned into the
//! same budget under the same floors and bound, so each comes with its own estimate.

use crate::bound::Bound;
use crate::calibration::Calibration;
use crate::config::{Method, Optimizer, Parallelism, TrainingConfig};
use crate::plan::{Floors, plan_against};
use crate::units::Bytes;
use std::fmt;

/// The largest data-parallel world a suggestion names.
pub const MAX_SUGGESTED_GPUS: u64 = 256;

/// One change outside the knobs, and what the config needs with it.
#[derive(Debug, Clone, PartialEq)]
pub struct Suggestion {
    /// The change, in words ("FSDP over 4 GPUs", "LoRA instead of full fine-tuning", …).
    pub change: String,
    /// The changed config after its own plan (free and compute rungs, quality ones where
    /// allowed).
    pub config: TrainingConfig,
    /// The figure compared with the budget (the upper bound at the plan's level).
    pub upper: Bytes,
    /// Whether it fits the budget.
    pub fits: bool,
}

impl fmt::Display for Suggestion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}{}",
            self.change,
            self.upper,
            if self.fits {
                " (fits)"
            } else {
                " (still over)"
            }
        )
    }
}

/// The changes outside the knobs that `cfg` could make, each planned into `budget`: sharding
/// over the fewest GPUs that fits (FSDP / ZeRO-3, up to [`MAX_SUGGESTED_GPUS`]), LoRA or
/// QLoRA instead of full fine-tuning, an 8-bit optimizer, optimizer offload to the CPU. A
/// change that does not apply to `cfg` (already LoRA, already 8-bit, …) or that the estimator
/// refuses is left out. Those that fit come first.
pub fn suggest(
    cfg: &TrainingConfig,
    budget: Bytes,
    calibration: &Calibration,
    floors: &Floors,
    bound: &Bound,
) -> Vec<Suggestion> {
    let planned = |change: String, candidate: TrainingConfig| {
        let plan = plan_against(&candidate, budget, calibration, floors, bound).ok()?;
        Some(Suggestion {
            change,
            upper: plan.upper(),
            fits: plan.fits,
            config: plan.config,
        })
    };
    let mut out = Vec::new();

    // More GPUs, sharded: the fewest that fits, or the most tried when none does.
    let sharded = matches!(cfg.parallelism, Parallelism::Fsdp | Parallelism::Zero3);
    let from = if sharded { cfg.world_size } else { 1 };
    let mut gpus = None;
    let mut n = from.max(1) * 2;
    while n <= MAX_SUGGESTED_GPUS {
        let mut c = cfg.clone();
        c.parallelism = if cfg.parallelism == Parallelism::Zero3 {
            Parallelism::Zero3
        } else {
            Parallelism::Fsdp
        };
        c.world_size = n;
        let name = if c.parallelism == Parallelism::Zero3 {
            "ZeRO-3"
        } else {
            "FSDP (or ZeRO-3)"
        };
        gpus = planned(format!("{name} over {n} GPUs"), c);
        if gpus.as_ref().is_some_and(|s| s.fits) {
            break;
        }
        n *= 2;
    }
    out.extend(gpus);

    if cfg.method == Method::Full {
        let mut c = cfg.clone();
        c.method = Method::Lora;
        out.extend(planned(
            format!("LoRA (rank {}) instead of full fine-tuning", c.lora_rank),
            c,
        ));
    }
    if matches!(cfg.method, Method::Full | Method::Lora) {
        let mut c = cfg.clone();
        c.method = Method::Qlora;
        out.extend(planned(
            format!(
                "QLoRA (rank {}, 4-bit base) instead of {}",
                c.lora_rank, cfg.method
            ),
            c,
        ));
    }
    if matches!(cfg.optimizer, Optimizer::AdamW | Optimizer::Adam) {
        let mut c = cfg.clone();
        c.optimizer = Optimizer::AdamW8bit;
        out.extend(planned("8-bit AdamW instead of 32-bit".to_string(), c));
    }
    if !cfg.optimizer_offload && !matches!(cfg.optimizer, Optimizer::Sgd) {
        let mut c = cfg.clone();
        c.optimizer_offload = true;
        out.extend(planned("optimizer state offloaded to CPU".to_string(), c));
    }
    out.sort_by_key(|s| !s.fits);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog;
    use crate::plan::plan_against;

    /// Full fine-tuning of Llama 3 8B, batch 8, sequence 2048, on one 80 GiB GPU.
    fn full_8b() -> TrainingConfig {
        let mut cfg = TrainingConfig::new(catalog::lookup("llama-3-8b").expect("catalog"));
        cfg.batch_size = 8;
        cfg
    }

    #[test]
    fn an_8b_full_finetune_on_80_gib_gets_changes_that_fit_each_with_its_estimate() {
        let cfg = full_8b();
        let budget = Bytes::from_f64(Bytes::gib(80).as_f64() * 0.9);
        let bound = Bound::at(0.95, &[]);
        let floors = Floors::default();
        let plan =
            plan_against(&cfg, budget, &Calibration::none(), &floors, &bound).expect("valid");
        assert!(!plan.fits, "the case: it does not fit alone");
        let s = suggest(&cfg, budget, &Calibration::none(), &floors, &bound);
        let names: Vec<String> = s.iter().map(ToString::to_string).collect();
        let find = |prefix: &str| {
            s.iter()
                .find(|x| x.change.starts_with(prefix))
                .unwrap_or_else(|| panic!("{prefix}: {names:?}"))
        };
        let gpus = find("FSDP");
        assert!(gpus.fits && gpus.config.world_size >= 2, "{names:?}");
        // The fewest: half as many GPUs do not fit.
        let mut fewer = cfg.clone();
        fewer.parallelism = Parallelism::Fsdp;
        fewer.world_size = gpus.config.world_size / 2;
        if fewer.world_size >= 2 {
            let p =
                plan_against(&fewer, budget, &Calibration::none(), &floors, &bound).expect("valid");
            assert!(!p.fits, "{names:?}");
        }
        assert!(find("LoRA").fits, "{names:?}");
        for s in &s {
            assert!(s.upper > Bytes::ZERO);
            assert_eq!(s.fits, s.upper <= budget, "{s}");
            // The changed config keeps the effective batch.
            assert_eq!(s.config.batch_size * s.config.grad_accumulation, 8, "{s}");
        }
        find("8-bit AdamW");
        find("optimizer state offloaded");
        assert!(
            s.first().is_some_and(|x| x.fits),
            "those that fit come first"
        );
    }

    #[test]
    fn changes_that_do_not_apply_are_left_out() {
        let mut cfg = full_8b();
        cfg.method = Method::Qlora;
        cfg.optimizer = Optimizer::AdamW8bit;
        cfg.optimizer_offload = true;
        let s = suggest(
            &cfg,
            Bytes::gib(1),
            &Calibration::none(),
            &Floors::default(),
            &Bound::POINT,
        );
        assert_eq!(s.len(), 1, "{s:?}");
        assert!(s[0].change.contains("GPUs"), "{s:?}");
        assert!(!s[0].fits);
        assert_eq!(s[0].config.world_size, MAX_SUGGESTED_GPUS);
    }
}
