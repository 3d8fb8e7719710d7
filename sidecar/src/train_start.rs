//! The plan at train start (issue 37, item 3): the trainer's reported config
//! ([`memguard_api::Report::config`]) made into the estimator's config by the mapping admission
//! also uses ([`memguard_decide::trainer_config`]), and planned with the
//! code admission uses ([`memguard_decide::decision::plan_into`]) against the pod's budget: a
//! GPU trainer's per-device budget from admission, a CPU trainer's cgroup limit times the
//! safety ratio. Pure: the engine passes the limit it read.
//!
//! A value the estimate depends on that the trainer did not report is unknown: no plan, and the
//! reason names it. The plan moves only what the client applies in-process (the micro-batch,
//! with the effective batch kept, and checkpointing): quality rungs are never taken here.

use memguard_api::train_start::{TrainStartPlan, TrainStartPolicy};
pub use memguard_decide::trainer_config::{REQUIRED, training_config};
use memguard_estimator::{Bound, Bytes, Calibration, Device, Floors, Rung, TrainingConfig};
use std::collections::BTreeMap;

/// The budget the plan aims at: admission's per-device budget for a GPU trainer; for a CPU one
/// the cgroup's limit times the safety ratio, shared by the ranks in the container
/// (`local-ranks`); or why there is none.
pub fn budget(
    cfg: &TrainingConfig,
    knobs: &BTreeMap<String, f64>,
    policy: &TrainStartPolicy,
    cgroup_limit: Option<u64>,
) -> Result<Bytes, String> {
    match cfg.device {
        Device::Cpu | Device::Metal => {
            let limit = cgroup_limit.ok_or("the trainer's cgroup limit is not known")?;
            let ratio = policy
                .safety_ratio
                .ok_or("admission passed no safety ratio")?;
            let ranks = match knobs.get("local-ranks") {
                Some(r) if r.fract() == 0.0 && (1.0..=1024.0).contains(r) => *r,
                Some(r) => return Err(format!("local-ranks is {r}, not a count of ranks")),
                None => return Err("not reported: local-ranks (they share the limit)".into()),
            };
            Ok(Bytes::from_f64(limit as f64 * ratio / ranks))
        }
        Device::Cuda | Device::Rocm => policy
            .budget_bytes
            .map(Bytes)
            .ok_or_else(|| "admission passed no per-device budget for a GPU trainer".into()),
    }
}

/// The decision on `knobs` under `policy` (`None`: admission passed none) with the trainer's
/// cgroup limit as last read.
pub fn decide(
    knobs: &BTreeMap<String, f64>,
    policy: Option<&TrainStartPolicy>,
    cgroup_limit: Option<u64>,
) -> TrainStartPlan {
    match plan(knobs, policy, cgroup_limit) {
        Ok(plan) => plan,
        Err(why) => TrainStartPlan {
            planned: false,
            reason: format!("no train-start plan: {why}"),
            ..TrainStartPlan::default()
        },
    }
}

fn plan(
    knobs: &BTreeMap<String, f64>,
    policy: Option<&TrainStartPolicy>,
    cgroup_limit: Option<u64>,
) -> Result<TrainStartPlan, String> {
    let policy = policy.ok_or("admission passed no train-start settings (--train-start)")?;
    let start = training_config(knobs)?;
    let budget = budget(&start, knobs, policy, cgroup_limit)?;
    let level = policy
        .estimate_level
        .ok_or("admission passed no estimate level")?;
    let floors = policy.floors.ok_or("admission passed no floors")?;
    // The client re-chunks and checkpoints; it cannot cut the sequence or the adapter.
    let floors = Floors {
        allow_quality: false,
        ..floors
    };
    let bound = Bound {
        level: Some(level),
        learned: None,
    };
    let plan = memguard_decide::decision::plan_into(
        &start,
        Some(budget),
        &Calibration::none(),
        &floors,
        &bound,
    )
    .map_err(|errs| errs.join("; "))?;
    // The signal carries the micro-batch and checkpointing, not FSDP's gradient sync.
    if plan.steps.iter().any(|s| s.rung == Rung::SyncEachBatch) {
        return Err(
            "the plan needs FSDP's gradients synced at every micro-batch, which a signal \
             cannot carry"
                .into(),
        );
    }
    let cfg = &plan.config;
    let steps: Vec<&str> = plan.steps.iter().map(|s| s.explanation.as_str()).collect();
    let reason = match (plan.fits, steps.is_empty()) {
        (true, true) => format!(
            "train-start plan: fits as configured ({} of budget {})",
            plan.upper(),
            budget
        ),
        (true, false) => format!(
            "train-start plan: {} ({} of budget {})",
            steps.join(", "),
            plan.upper(),
            budget
        ),
        (false, _) => format!(
            "train-start plan: cannot fit, needs {} of budget {} at the smallest config tried \
             ({})",
            plan.upper(),
            budget,
            if steps.is_empty() {
                "nothing to lower".to_string()
            } else {
                steps.join(", ")
            }
        ),
    };
    Ok(TrainStartPlan {
        planned: true,
        reason,
        batch_size: Some(cfg.batch_size),
        grad_accumulation: Some(cfg.grad_accumulation),
        grad_checkpointing: Some(cfg.grad_checkpointing),
        fits: Some(plan.fits),
        upper_bytes: Some(plan.upper().0),
        budget_bytes: Some(budget.0),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A tiny Llama as the client reports it at train start (full fine-tuning on the CPU).
    pub(crate) fn tiny_llama() -> BTreeMap<String, f64> {
        memguard_decide::testutil::tiny_llama_report()
    }

    pub(crate) fn policy() -> TrainStartPolicy {
        TrainStartPolicy {
            budget_bytes: None,
            safety_ratio: Some(0.9),
            estimate_level: Some(0.95),
            floors: Some(Floors::default()),
        }
    }

    #[test]
    fn an_unknown_or_impossible_value_means_no_plan_and_says_which() {
        let mut knobs = tiny_llama();
        knobs.remove("vocab-size");
        knobs.remove("optimizer");
        let plan = decide(&knobs, Some(&policy()), Some(1 << 30));
        assert!(!plan.planned);
        assert_eq!(plan.batch_size, None);
        assert!(
            plan.reason.contains("not reported: vocab-size, optimizer"),
            "{}",
            plan.reason
        );
        for (knob, value, says) in [
            ("optimizer", 99.0, "optimizer code 99"),
            ("tie-embeddings", 2.0, "not 0 or 1"),
            ("batch-size", 2.5, "not a whole number"),
            ("param-bits", 8.0, "not 16 or 32"),
            ("trainable-params", 1000.0, "adapters and partly frozen"),
            ("num-experts", 8.0, "mixture of 8 experts"),
            ("quant-bits", 4.0, "4-bit base"),
            ("hidden-size", 0.0, "hidden-size"),
        ] {
            let mut knobs = tiny_llama();
            knobs.insert(knob.into(), value);
            let plan = decide(&knobs, Some(&policy()), Some(1 << 30));
            assert!(!plan.planned, "{knob}");
            assert!(plan.reason.contains(says), "{knob}: {}", plan.reason);
        }
        let mut mixed = tiny_llama();
        mixed.remove("bf16");
        mixed.remove("fp16");
        assert!(
            decide(&mixed, Some(&policy()), Some(1 << 30))
                .reason
                .contains("mixed precision")
        );
    }

    #[test]
    fn no_budget_means_no_plan_never_a_guess() {
        let knobs = tiny_llama();
        let none = decide(&knobs, None, Some(1 << 30));
        assert!(
            none.reason.contains("no train-start settings"),
            "{}",
            none.reason
        );
        let no_limit = decide(&knobs, Some(&policy()), None);
        assert!(
            no_limit.reason.contains("cgroup limit is not known"),
            "{}",
            no_limit.reason
        );
        let mut gpu = knobs.clone();
        gpu.insert("gpu".into(), 1.0);
        let no_device_budget = decide(&gpu, Some(&policy()), Some(1 << 30));
        assert!(
            no_device_budget.reason.contains("no per-device budget"),
            "{}",
            no_device_budget.reason
        );
        let mut ranks = knobs.clone();
        ranks.remove("local-ranks");
        assert!(
            decide(&ranks, Some(&policy()), Some(1 << 30))
                .reason
                .contains("not reported: local-ranks"),
        );
        let no_ratio = TrainStartPolicy {
            safety_ratio: None,
            ..policy()
        };
        assert!(
            decide(&knobs, Some(&no_ratio), Some(1 << 30))
                .reason
                .contains("safety ratio")
        );
    }

    #[test]
    fn a_tight_budget_lowers_the_micro_batch_and_keeps_the_effective_batch() {
        let knobs = tiny_llama();
        let roomy = decide(&knobs, Some(&policy()), Some(64 << 30));
        assert!(roomy.planned, "{}", roomy.reason);
        assert_eq!((roomy.batch_size, roomy.fits), (Some(16), Some(true)));
        let start = training_config(&knobs).expect("a config");
        let at = |batch: u64| {
            let mut c = start.clone();
            c.batch_size = batch;
            c.grad_accumulation = 16 / batch;
            let bound = Bound {
                level: Some(0.95),
                learned: None,
            };
            let e = memguard_estimator::estimate(&c).expect("estimate");
            bound.upper(&c, e.total, e.total).0
        };
        // A limit between the bounds at 4 and 8 rows: the plan runs 4 × 4, or checkpoints.
        let limit = ((at(4) + at(8)) as f64 / 2.0 / 0.9) as u64;
        let tight = decide(&knobs, Some(&policy()), Some(limit));
        assert!(
            tight.planned && tight.fits == Some(true),
            "{}",
            tight.reason
        );
        let batch = tight.batch_size.expect("a batch");
        let accumulation = tight.grad_accumulation.expect("an accumulation");
        assert!(batch < 16, "{}", tight.reason);
        assert_eq!(batch * accumulation, 16, "{}", tight.reason);
        assert!(tight.upper_bytes <= tight.budget_bytes);
        // Two ranks in the container share its limit: each is planned against half.
        let mut two = knobs.clone();
        two.insert("local-ranks".into(), 2.0);
        let halved = decide(&two, Some(&policy()), Some(limit));
        assert_eq!(
            halved.budget_bytes.map(|b| b as f64),
            tight.budget_bytes.map(|b| (b as f64 / 2.0).ceil())
        );
        assert!(halved.batch_size < tight.batch_size, "{}", halved.reason);
        // Nothing fits a few bytes: the smallest config, said so.
        let hopeless = decide(&knobs, Some(&policy()), Some(1 << 20));
        assert_eq!((hopeless.fits, hopeless.batch_size), (Some(false), Some(1)));
        assert!(
            hopeless.reason.contains("cannot fit"),
            "{}",
            hopeless.reason
        );
    }

    #[test]
    fn a_plan_that_needs_fsdp_to_sync_every_micro_batch_is_refused() {
        // A 7B-like shape under FSDP on 8 GPUs, accumulating: unsharded gradients under
        // `no_sync` are what the sync rung saves first.
        let mut knobs = tiny_llama();
        for (k, v) in [
            ("gpu", 1.0),
            ("bf16", 1.0),
            ("fsdp", 1.0),
            ("world-size", 8.0),
            ("grad-accumulation", 4.0),
            ("batch-size", 4.0),
            ("seq-length", 2048.0),
            ("hidden-size", 4096.0),
            ("num-layers", 32.0),
            ("num-heads", 32.0),
            ("num-kv-heads", 32.0),
            ("head-dim", 128.0),
            ("intermediate-size", 11008.0),
            ("params", 6_738_415_616.0),
            ("trainable-params", 6_738_415_616.0),
        ] {
            knobs.insert(k.into(), v);
        }
        let refused: Vec<String> = (10..=80)
            .map(|gib: u64| {
                let p = TrainStartPolicy {
                    budget_bytes: Some(gib << 30),
                    ..policy()
                };
                decide(&knobs, Some(&p), None).reason
            })
            .filter(|r| r.contains("synced at every micro-batch"))
            .collect();
        assert!(
            !refused.is_empty(),
            "no budget made the plan sync every micro-batch"
        );
    }
}
