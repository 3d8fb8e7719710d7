//! Folding an [`Observation`] into a `MemoryProfile` status. Pure and idempotent.

use crate::observe::Observation;
use memguard_api::crd::{
    MemoryProfileStatus, OomEvent, ProfileRun, Recovery, TrainerReport, TrainingKnobs,
};
use memguard_api::policy::DEFAULT_MAX_OOM_RECOVERIES;
use memguard_estimator::calibration::FACTOR_RANGE;
use memguard_estimator::{Bytes, Calibration, Floors, Rung, TrainingConfig, best_step, estimate};

/// What the policy in force says about recovering from OOMs: how many recoveries in a row, and
/// the floors no recovery steps below (the webhook clamps to the same floors, so a recovery
/// below them would send the next pod back to the config that died).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OomRules {
    /// The policy's `maxOomRecoveries`.
    pub max_recoveries: u32,
    /// The policy's floors.
    pub floors: Floors,
}

impl Default for OomRules {
    /// The default policy's: [`DEFAULT_MAX_OOM_RECOVERIES`] and the default floors.
    fn default() -> Self {
        OomRules {
            max_recoveries: DEFAULT_MAX_OOM_RECOVERIES,
            floors: Floors::default(),
        }
    }
}

impl OomRules {
    /// The rules of a resolved policy.
    pub fn of(policy: &memguard_api::policy::Policy) -> Self {
        OomRules {
            max_recoveries: policy.max_oom_recoveries,
            floors: policy.floors,
        }
    }
}

/// [`apply_limited`] under the default policy's rules ([`OomRules::default`]).
pub fn apply(status: &MemoryProfileStatus, obs: &Observation) -> MemoryProfileStatus {
    apply_limited(status, obs, &OomRules::default())
}

/// The status after `obs`. Recording the same pod again (same UID and `finishedAt`) returns
/// `status` unchanged, also once the run has left the bounded history (see
/// [`MemoryProfileStatus::record_run`]): the controller may replay every pod after a restart.
///
/// Every run is recorded with its (uncalibrated) estimate and measured peak, and the config its
/// trainer reported at train start (the latest run's is kept, see
/// [`MemoryProfileStatus::record_trainer_report`]); a run that ran out of memory also adds an
/// [`OomEvent`] with the phase it was killed in (counted in `oomKillPhases`), counts one more OOM in a row and, while fewer than
/// `rules.max_recoveries` recoveries were made, sets the [`Recovery`] from [`recovery`]. Past
/// that limit, or when every knob is already at its floor, the recovery stays where it is and
/// the status carries a `cannot fit: …` verdict naming the smallest config tried. A later
/// successful run keeps the recovery (it shows the recovery config works, while dropping it
/// would send the next pod back to the config that died; a person clears it, see the docs),
/// and clears the count and the verdict.
///
/// There is no `now`: every time recorded is the container's own `finishedAt`, so a replay
/// writes exactly what the first pass wrote.
pub fn apply_limited(
    status: &MemoryProfileStatus,
    obs: &Observation,
    rules: &OomRules,
) -> MemoryProfileStatus {
    let max_oom_recoveries = rules.max_recoveries;
    let mut next = status.clone();
    let recorded = next.record_run(ProfileRun {
        pod: obs.pod.clone(),
        uid: obs.uid.clone(),
        estimate_bytes: obs.estimate.map_or(0, |b| b.0),
        measured_peak_bytes: obs.measured_peak.map(|b| b.0),
        finished_at: obs.finished_at.clone(),
        oom_killed: obs.oom.is_some(),
    });
    if !recorded {
        return status.clone();
    }
    if let Some(report) = trainer_report(obs) {
        next.record_trainer_report(report);
    }
    if let Some(reason) = &obs.oom {
        let phase = obs.summary.as_ref().and_then(|s| s.oom_kill_phase);
        if let Some(phase) = phase {
            next.oom_kill_phases.count(phase);
        }
        next.record_oom(OomEvent {
            pod: obs.pod.clone(),
            at: obs.finished_at.clone(),
            reason: reason.clone(),
            config: obs.knobs.clone(),
            phase,
        });
        next.oom_recoveries = status.oom_recoveries.saturating_add(1);
        // The config that died is the smallest tried so far: every recovery starts below the
        // one before.
        let tried = TrainingKnobs::of(&obs.ran).describe();
        if status.oom_recoveries >= max_oom_recoveries {
            // The limit: keep the recovery in force instead of shrinking forever.
            let n = next.oom_recoveries;
            next.verdict = Some(format!(
                "cannot fit: {n} OOM{} in a row (limit {max_oom_recoveries}); smallest config \
                 tried: {tried}",
                if n == 1 { "" } else { "s" },
            ));
        } else {
            let r = recovery(obs, status.recovery.as_ref(), &rules.floors);
            next.verdict = (r.rungs == 0).then(|| {
                format!("cannot fit: every knob is at its floor; smallest config tried: {tried}")
            });
            next.recovery = Some(r);
        }
    } else if obs.exit_code == 0 {
        next.oom_recoveries = 0;
        next.verdict = None;
    }
    next
}

/// What the trainer of `obs` reported of its config at train start, and where admission
/// believed otherwise (the sidecar's summary); `None` when it reported nothing.
fn trainer_report(obs: &Observation) -> Option<TrainerReport> {
    let summary = obs.summary.as_ref()?;
    if summary.trainer_config.is_empty() && summary.config_mismatch.is_empty() {
        return None;
    }
    Some(TrainerReport {
        pod: obs.pod.clone(),
        uid: obs.uid.clone(),
        finished_at: obs.finished_at.clone(),
        config: summary.trainer_config.clone(),
        mismatch: summary.config_mismatch.clone(),
    })
}

/// The recovery after an OOM kill: start the next pod one step below the config that died (the
/// step the planner would take next: [`best_step`]), *and* plan it with the factor the kill implies (the memory the pod had, or its
/// measured peak if higher, over the estimate of the config that died). Doing both is at least
/// as safe as either; the factor also covers an estimate that was far off, the rung a kill that
/// the factor alone would not prevent (a config already estimated above the limit). A factor
/// never falls below the previous recovery's.
/// Rungs stop at `floors`, the policy's: the webhook never plans below them.
pub fn recovery(obs: &Observation, previous: Option<&Recovery>, floors: &Floors) -> Recovery {
    let died = &obs.ran;
    // The step the planner would take next from the config that died (the most bytes saved
    // per unit of cost; a quality rung only with the policy's permission).
    let step = estimate(died)
        .ok()
        .and_then(|e| best_step(died, e.total, &Calibration::none(), floors, Bytes::ZERO))
        .map(|best| {
            // Syncing each batch without accumulation changes nothing by itself: it is what
            // lets the halving after it save, so the recovery takes both (as the planner does).
            if best.rung == Rung::SyncEachBatch
                && died.grad_accumulation == 1
                && let Some((halved, more)) = Rung::HalveBatch.apply(&best.config, floors)
            {
                return (2, halved, format!("{}, then {more}", best.explanation));
            }
            (1, best.config, best.explanation)
        });
    let implied = match (obs.limit, obs.estimate) {
        (Some(limit), Some(estimate)) if estimate.0 > 0 => {
            let need = limit.max(obs.measured_peak.unwrap_or(Bytes::ZERO));
            Some((need.as_f64() / estimate.as_f64()).clamp(1.0, FACTOR_RANGE.1))
        }
        _ => None,
    };
    let factor = match (implied, previous.and_then(|r| r.factor)) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    let mut figures = Vec::new();
    if let Some(limit) = obs.limit {
        figures.push(format!("limit {limit}"));
    }
    if let Some(peak) = obs.measured_peak {
        figures.push(format!("peak {peak}"));
    }
    let figures = if figures.is_empty() {
        String::new()
    } else {
        format!(" ({})", figures.join(", "))
    };
    let oom = obs.oom.as_deref().unwrap_or("ran out of memory");
    let what = describe(died);
    let (rungs, config, action) = match step {
        Some((rungs, next, explanation)) => (
            rungs,
            TrainingKnobs::of(&next),
            format!("start with {explanation}"),
        ),
        None => (
            0,
            TrainingKnobs::of(died),
            "every knob is at its floor: start from the same config".to_string(),
        ),
    };
    let mut reason = format!("pod {} {oom} at {what}{figures}: {action}", obs.pod);
    if let Some(f) = factor {
        reason.push_str(&format!("; plan with factor ≥ {f:.2}"));
    }
    Recovery {
        rungs,
        config,
        factor,
        reason,
    }
}

/// `batch 16, seq 4096` (and `rank 64` for adapters): what a person recognizes of a config.
fn describe(cfg: &TrainingConfig) -> String {
    let mut parts = vec![
        format!("batch {}", cfg.batch_size),
        format!("seq {}", cfg.seq_length),
    ];
    if cfg.is_adapter() {
        parts.push(format!("rank {}", cfg.lora_rank));
    }
    parts.join(", ")
}

#[cfg(test)]
mod tests;
