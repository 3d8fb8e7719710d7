//! The pod as admission plans it on what its trainer reported (issue 37, item 4). Pure.
//!
//! At train start the injected client reports the config the trainer really runs
//! (`Report.config`); the sidecar compares it with what admission believed and the profile
//! controller keeps both in the profile ([`TrainerReport`]). The next admission of a pod with
//! the same key reads it:
//!
//! - a knob admission could not read (unknown: a script's own parser sets it) is planned on the
//!   reported value, with provenance [`PROVENANCE`], so a launch that was left unplanned is now
//!   planned. Its value is never written into the trainer's launch (nothing there says it):
//!   the plan reaches the trainer as `MEMGUARD_*` env, as for any launch memguard cannot
//!   rewrite;
//! - a knob admission read, where the trainer reported another value (the `mismatch` the
//!   sidecar exported), is planned on the reported value, while the rewrite keeps what it read
//!   ([`OnReport::rewrite_target`]), and a warning says so.
//!
//! A reported value that is not one of the knob's (`0` batches, a fraction, a flag other than
//! 0 or 1) is ignored: a value memguard cannot read is unknown.

use crate::warnings::truncate;
use memguard_api::crd::TrainerReport;
use memguard_api::{Knob, TrainingPod};
use memguard_estimator::TrainingConfig;

/// The provenance of a knob planned on the trainer's report, in the estimate's `sources`.
pub const PROVENANCE: &str = "profile:trainer-report";

/// A knob admission read where the trainer ran another value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// The knob.
    pub knob: Knob,
    /// What admission read (the launch's value).
    pub read: String,
    /// What the trainer reported.
    pub reported: String,
}

/// A pod read again on its trainer's report.
#[derive(Debug, Clone, PartialEq)]
pub struct OnReport<'a> {
    /// The pod as admission plans it: the unknown knobs the report gives filled in, the
    /// mismatched knobs at the reported value.
    pub planning: TrainingPod<'a>,
    /// The pod as admission rewrites and renders it: the unknown knobs filled in (never
    /// written into the launch: they stay out of `sources`), the mismatched knobs as read.
    pub admitted: TrainingPod<'a>,
    /// The knobs filled in from the report, with their value.
    pub filled: Vec<(Knob, String)>,
    /// The knobs read that the trainer ran otherwise.
    pub mismatches: Vec<Mismatch>,
    /// What the admission says of it.
    pub warnings: Vec<String>,
}

impl OnReport<'_> {
    /// The config the rewrite aims at for `planned` (the plan made on
    /// [`planning`](Self::planning)): a mismatched knob the plan left at the reported value is
    /// put back to what the launch says, so the rewrite only writes what the plan changed; a
    /// knob filled from the report is never written (nothing in the launch says it), and when
    /// it is the batch or the accumulation both stay as they are, so the launch keeps its
    /// effective batch: that plan reaches the trainer as `MEMGUARD_*` env.
    pub fn rewrite_target(&self, planned: &TrainingConfig) -> TrainingConfig {
        let mut target = planned.clone();
        for m in &self.mismatches {
            if m.knob.value(planned) == m.reported {
                m.knob.set(&mut target, &m.read);
            }
        }
        as_configured(&self.admitted, &target)
    }

    /// Whether the report changed anything of the pod.
    pub fn changes_anything(&self) -> bool {
        !self.filled.is_empty() || !self.mismatches.is_empty()
    }
}

/// What the trainer of `training` will report as configured at train start when `planned` is
/// admitted: `planned`, except each knob planned on a trainer's report
/// ([`TrainingPod::reported`]), which nothing writes into the launch, stays as the trainer
/// reported it, and when it is the batch or the accumulation both stay, so the launch keeps its
/// effective batch (the plan reaches the trainer as `MEMGUARD_*` env and the client re-chunks).
/// Both the rewrite and the sidecar's admitted config are this, so that a planned run is not
/// flagged as a mismatch.
pub fn as_configured(training: &TrainingPod, planned: &TrainingConfig) -> TrainingConfig {
    let mut configured = planned.clone();
    let batch_pair = [Knob::BatchSize, Knob::GradAccumulation];
    let mut untouched: Vec<Knob> = training.reported.keys().copied().collect();
    if untouched.iter().any(|k| batch_pair.contains(k)) {
        untouched.extend(batch_pair);
    }
    for knob in untouched {
        knob.set(&mut configured, &knob.value(&training.config));
    }
    configured
}

/// `value` as `knob`'s, as [`Knob::value`] writes it: a count is a whole number of at least 1,
/// checkpointing is 0 or 1; `None` otherwise (and for the gradient sync, never reported).
pub fn knob_value(knob: Knob, value: f64, base: &TrainingConfig) -> Option<String> {
    if !value.is_finite() {
        return None;
    }
    let text = match knob {
        Knob::GradCheckpointing if value == 0.0 => "false".to_string(),
        Knob::GradCheckpointing if value == 1.0 => "true".to_string(),
        Knob::GradCheckpointing | Knob::GradSync => return None,
        _ if value >= 1.0 && value.fract() == 0.0 && value <= u32::MAX as f64 => {
            format!("{}", value as u64)
        }
        _ => return None,
    };
    // The same check every reading of a knob makes.
    let mut probe = base.clone();
    knob.set(&mut probe, &text).then_some(text)
}

/// `training` read again on `report` (see the module's doc).
pub fn on_report<'a>(training: &TrainingPod<'a>, report: &TrainerReport) -> OnReport<'a> {
    let mut planning = training.clone();
    let mut admitted = training.clone();
    let mut filled = Vec::new();
    let mut mismatches = Vec::new();
    for knob in Knob::of(&training.config) {
        let Some(value) = report
            .config
            .get(knob.name())
            .and_then(|v| knob_value(knob, *v, &training.config))
        else {
            continue;
        };
        if training.unknown.contains_key(&knob) {
            for pod in [&mut planning, &mut admitted] {
                knob.set(&mut pod.config, &value);
                pod.unknown.remove(&knob);
                pod.reported.insert(knob, PROVENANCE.to_string());
            }
            filled.push((knob, value));
        } else if report.mismatch.iter().any(|m| m == knob.name()) {
            let read = knob.value(&training.config);
            if read != value {
                knob.set(&mut planning.config, &value);
                mismatches.push(Mismatch {
                    knob,
                    read,
                    reported: value,
                });
            }
        }
    }
    // Each warning is cut at 120 characters: what was planned on leads, whose report trails.
    let mut warnings = Vec::new();
    if !filled.is_empty() {
        let said: Vec<String> = filled
            .iter()
            .map(|(k, v)| format!("{} {v}", k.name()))
            .collect();
        warnings.push(truncate(&format!(
            "memguard: planned on the trainer's report for {}; never written in the launch \
             (pod {})",
            said.join(", "),
            report.pod
        )));
    }
    for m in &mismatches {
        warnings.push(truncate(&format!(
            "memguard: the trainer ran {} {} where the launch says {}: planned on {}, launch \
             kept (pod {}'s report)",
            m.knob.name(),
            m.reported,
            m.read,
            m.reported,
            report.pod
        )));
    }
    OnReport {
        planning,
        admitted,
        filled,
        mismatches,
        warnings,
    }
}

#[cfg(test)]
mod tests;
