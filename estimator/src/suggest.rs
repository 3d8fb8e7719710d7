//! When a plan cannot fit: the changes outside the knobs that would, each re-planned into the
//! same budget under the same floors and bound, so each comes with its own estimate.

use crate::bound::Bound;
use crate::calibration::Calibration;
use crate::config::{Loss, Method, Optimizer, Parallelism, TrainingConfig};
use crate::estimate::estimate;
use crate::plan::{DowngradePlan, Floors, plan_against};
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
    /// The budget it was planned into: the job's, or a larger GPU's for that suggestion.
    pub budget: Bytes,
    /// Whether it fits `budget`.
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

/// The least a suggested change must save, as a share of the budget: an optimizer change
/// (8-bit states, offload) that saves less is left out (moving 77 MiB of LoRA states is no
/// answer to a job gigabytes over), and the search for a GPU count stops when doubling the
/// world saves less.
pub const MIN_SUGGESTED_SAVING: f64 = 0.02;

/// The changes outside the knobs that `cfg` could make, each planned into `budget`: sharding
/// over the fewest GPUs that fits ([`sharded_over_more_gpus`]), LoRA or QLoRA instead of full
/// fine-tuning, a fused loss (`memguard.io/loss: fused`: no logits held), QLoRA with a fused
/// loss when neither alone fits, an 8-bit optimizer, optimizer offload to the CPU (each
/// only when it saves [`MIN_SUGGESTED_SAVING`] of the budget or more). A change that does not apply to `cfg`
/// (already LoRA, already 8-bit, …) or that the estimator refuses is left out. Those that fit
/// come first.
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
            budget,
            fits: plan.fits,
            config: plan.config,
        })
    };
    let mut out = Vec::new();
    out.extend(sharded_over_more_gpus(
        cfg,
        budget,
        calibration,
        floors,
        bound,
    ));

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
    // An optimizer change (or a loss) is worth naming only when it saves a share of the budget that
    // matters, with every knob as configured.
    let min_saving = budget.as_f64() * MIN_SUGGESTED_SAVING;
    let saves_enough = |c: &TrainingConfig| match (estimate(cfg), estimate(c)) {
        (Ok(before), Ok(after)) => before.total.as_f64() - after.total.as_f64() >= min_saving,
        _ => false,
    };
    // The logits (and their fp32 copy) are often the largest activation of a long sequence
    // over a large vocabulary; a fused loss never holds them.
    let mut fused_loss = cfg.clone();
    fused_loss.loss = Loss::Fused;
    if cfg.loss != Loss::Fused && saves_enough(&fused_loss) {
        let c = fused_loss;
        let fused = planned(
            format!(
                "a fused loss (loss: fused; Liger, Cut Cross-Entropy) instead of {}",
                cfg.loss.name()
            ),
            c,
        );
        // Combined with QLoRA, only when neither alone fits: a combination is named to fix
        // the job, not to stack every change.
        let qlora_fits = out
            .iter()
            .any(|s: &Suggestion| s.fits && s.config.method == Method::Qlora);
        let fused_fits = fused.as_ref().is_some_and(|s| s.fits);
        out.extend(fused);
        if !qlora_fits && !fused_fits && matches!(cfg.method, Method::Full | Method::Lora) {
            let mut c = cfg.clone();
            c.method = Method::Qlora;
            c.loss = Loss::Fused;
            out.extend(planned(
                format!(
                    "QLoRA (rank {}, 4-bit base) and a fused loss, instead of {}",
                    c.lora_rank, cfg.method
                ),
                c,
            ));
        }
    }
    if matches!(cfg.optimizer, Optimizer::AdamW | Optimizer::Adam) {
        let mut c = cfg.clone();
        c.optimizer = Optimizer::AdamW8bit;
        if saves_enough(&c) {
            out.extend(planned("8-bit AdamW instead of 32-bit".to_string(), c));
        }
    }
    if !cfg.optimizer_offload && !matches!(cfg.optimizer, Optimizer::Sgd) {
        let mut c = cfg.clone();
        c.optimizer_offload = true;
        if saves_enough(&c) {
            out.extend(planned("optimizer state offloaded to CPU".to_string(), c));
        }
    }
    out.sort_by_key(|s| !s.fits);
    out
}

/// Sharding over more GPUs: the fewest (doubling from the job's own world, up to
/// [`MAX_SUGGESTED_GPUS`]) on which the plan fits, under FSDP or ZeRO-3 (the job's own scheme
/// when it shards already; both otherwise, named by which fits). `None` when no world fits,
/// and the search stops as soon as doubling the world saves under [`MIN_SUGGESTED_SAVING`]
/// of the budget: what is left is not sharded (activations, logits, gathered units), and a
/// count of GPUs that cannot fit the job is no suggestion.
pub fn sharded_over_more_gpus(
    cfg: &TrainingConfig,
    budget: Bytes,
    calibration: &Calibration,
    floors: &Floors,
    bound: &Bound,
) -> Option<Suggestion> {
    let schemes: &[Parallelism] = match cfg.parallelism {
        Parallelism::Fsdp => &[Parallelism::Fsdp],
        Parallelism::Zero3 => &[Parallelism::Zero3],
        _ => &[Parallelism::Fsdp, Parallelism::Zero3],
    };
    let sharded = matches!(cfg.parallelism, Parallelism::Fsdp | Parallelism::Zero3);
    let from = if sharded { cfg.world_size.max(1) } else { 1 };
    let min_saving = budget.as_f64() * MIN_SUGGESTED_SAVING;
    let mut previous: Option<Bytes> = None;
    let mut n = from.saturating_mul(2);
    while n <= MAX_SUGGESTED_GPUS {
        let plans: Vec<(Parallelism, DowngradePlan)> = schemes
            .iter()
            .filter_map(|&scheme| {
                let mut c = cfg.clone();
                c.parallelism = scheme;
                c.world_size = n;
                let plan = plan_against(&c, budget, calibration, floors, bound).ok()?;
                Some((scheme, plan))
            })
            .collect();
        let fitting: Vec<&(Parallelism, DowngradePlan)> =
            plans.iter().filter(|(_, p)| p.fits).collect();
        if let Some((_, best)) = fitting.iter().min_by_key(|(_, p)| p.upper()) {
            let name = match fitting.as_slice() {
                [(Parallelism::Zero3, _)] => "ZeRO-3",
                [(Parallelism::Fsdp, _)] => "FSDP",
                _ => "FSDP (or ZeRO-3)",
            };
            return Some(Suggestion {
                change: format!("{name} over {n} GPUs"),
                upper: best.upper(),
                budget,
                fits: true,
                config: best.config.clone(),
            });
        }
        let lowest = plans.iter().map(|(_, p)| p.upper()).min()?;
        if previous.is_some_and(|before| before.as_f64() - lowest.as_f64() < min_saving) {
            return None;
        }
        previous = Some(lowest);
        n = n.saturating_mul(2);
    }
    None
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
        cfg.loss = Loss::Fused;
        let s = suggest(
            &cfg,
            Bytes::gib(1),
            &Calibration::none(),
            &Floors::default(),
            &Bound::POINT,
        );
        // Nothing applies: and no count of GPUs, since no world fits 1 GiB.
        assert!(s.is_empty(), "{s:?}");
    }

    fn lora_8b() -> TrainingConfig {
        let mut cfg = TrainingConfig::new(catalog::lookup("llama-3-8b").expect("catalog"));
        cfg.method = Method::Lora;
        cfg.batch_size = 8;
        cfg.seq_length = 4096;
        cfg
    }

    #[test]
    fn no_gpu_count_beyond_what_sharding_can_do() {
        // LoRA at batch 1 × 4096 with checkpointing still holds 10+ GiB of activations and
        // logits on every rank, which no number of GPUs divides: into 12 GiB the old search
        // offered "FSDP (or ZeRO-3) over 256 GPUs: still over".
        let cfg = lora_8b();
        let bound = Bound::at(0.95, &[]);
        let s = suggest(
            &cfg,
            Bytes::gib(12),
            &Calibration::none(),
            &Floors::default(),
            &bound,
        );
        let names: Vec<String> = s.iter().map(ToString::to_string).collect();
        assert!(s.iter().all(|x| !x.change.contains("GPUs")), "{names:?}");
        // Where sharding fits, the fewest GPUs, and never past the world where the next
        // doubling would stop saving.
        let budget = Bytes::from_f64(Bytes::gib(24).as_f64() * 0.9);
        let s = sharded_over_more_gpus(
            &cfg,
            budget,
            &Calibration::none(),
            &Floors::default(),
            &bound,
        )
        .expect("sharding the base fits 21.6 GiB");
        assert!(s.fits && s.config.world_size <= 8, "{s}");
    }

    #[test]
    fn seventy_b_full_finetuning_shards_over_the_fewest_gpus_that_fit() {
        // Llama 3.1 70B, batch 1 × 4096, checkpointing, on 80 GiB GPUs: with per-unit FSDP
        // physics both schemes fit on 64 GPUs, not on 256 (the old FSDP term never fit).
        let mut cfg = TrainingConfig::new(catalog::lookup("llama-3.1-70b").expect("catalog"));
        cfg.batch_size = 1;
        cfg.seq_length = 4096;
        cfg.grad_checkpointing = true;
        let budget = Bytes::from_f64(Bytes::gib(80).as_f64() * 0.9);
        let (bound, floors) = (Bound::at(0.95, &[]), Floors::default());
        let s = sharded_over_more_gpus(&cfg, budget, &Calibration::none(), &floors, &bound)
            .expect("fits");
        let n = s.config.world_size;
        assert!(s.fits && n <= 64, "{s}");
        // The fewest: half as many fit under neither scheme.
        for scheme in [Parallelism::Fsdp, Parallelism::Zero3] {
            let mut fewer = cfg.clone();
            fewer.parallelism = scheme;
            fewer.world_size = n / 2;
            let p =
                plan_against(&fewer, budget, &Calibration::none(), &floors, &bound).expect("ok");
            assert!(!p.fits, "{scheme:?} over {}", n / 2);
        }
    }

    #[test]
    fn no_optimizer_change_that_saves_under_two_percent_of_the_budget() {
        // A LoRA job's AdamW holds tens of MiB: neither 8-bit states nor offload is worth
        // naming against a 20 GiB budget. Full fine-tuning's states are gigabytes: both are.
        let cfg = lora_8b();
        let states = crate::estimate(&cfg)
            .expect("valid")
            .component(crate::Component::OptimizerStates);
        assert!(states < Bytes::mib(100), "the case: {states}");
        let s = suggest(
            &cfg,
            Bytes::gib(20),
            &Calibration::none(),
            &Floors::default(),
            &Bound::POINT,
        );
        let names: Vec<String> = s.iter().map(ToString::to_string).collect();
        assert!(
            s.iter()
                .all(|x| !x.change.contains("AdamW") && !x.change.contains("offload")),
            "{names:?}"
        );
        assert!(!s.is_empty(), "other changes are still named: {names:?}");
        let full = full_8b();
        let s = suggest(
            &full,
            Bytes::gib(40),
            &Calibration::none(),
            &Floors::default(),
            &Bound::POINT,
        );
        assert!(s.iter().any(|x| x.change.contains("8-bit AdamW")));
        assert!(s.iter().any(|x| x.change.contains("offload")));
    }

    /// Issue 38: a fused loss, and QLoRA with a fused loss when neither alone fits, are named
    /// with their estimates; a job already fused is not told to fuse.
    #[test]
    fn a_fused_loss_and_its_combination_with_qlora_are_named() {
        // LoRA on Llama 3 8B at 8 × 4096: its 128k-vocabulary logits are gigabytes.
        let cfg = lora_8b();
        let bound = Bound::at(0.95, &[]);
        let floors = Floors::default();
        let by = |budget: Bytes, c: &TrainingConfig| {
            suggest(c, budget, &Calibration::none(), &floors, &bound)
        };
        let s = by(Bytes::gib(20), &cfg);
        let names: Vec<String> = s.iter().map(ToString::to_string).collect();
        let fused = s
            .iter()
            .find(|x| x.change.starts_with("a fused loss"))
            .unwrap_or_else(|| panic!("{names:?}"));
        assert_eq!(fused.config.loss, Loss::Fused, "{names:?}");
        // Where neither QLoRA nor a fused loss alone fits, but both together do: the
        // combination, named once.
        let tight = (8..40)
            .map(|g| Bytes::from_f64(g as f64 * 0.5 * Bytes::gib(1).as_f64()))
            .find(|&b| {
                by(b, &cfg)
                    .iter()
                    .any(|x| x.fits && x.change.contains("and a fused loss"))
            })
            .expect("a budget where only the combination fits");
        let s = by(tight, &cfg);
        let names: Vec<String> = s.iter().map(ToString::to_string).collect();
        let both = s
            .iter()
            .find(|x| x.change.contains("and a fused loss"))
            .expect("combination");
        assert!(both.fits, "{names:?}");
        assert_eq!(
            (both.config.method, both.config.loss),
            (Method::Qlora, Loss::Fused)
        );
        assert!(
            !s.iter()
                .any(|x| x.fits && x.change.starts_with("a fused loss")),
            "{names:?}"
        );
        // Already fused: no such suggestion.
        let mut done = cfg.clone();
        done.loss = Loss::Fused;
        assert!(
            by(Bytes::gib(20), &done)
                .iter()
                .all(|x| !x.change.contains("fused")),
        );
    }
}
