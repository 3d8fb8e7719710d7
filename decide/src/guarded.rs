//! A pod whose model admission cannot read (a Guarded pod, issue 37), planned on what its
//! trainer reported in a past run of the same job. Pure.
//!
//! Such a pod has no model key: it is keyed by its launch ([`crate::key::launch_key`]), and the profile
//! controller keeps its trainer's report there. When the report gives everything the estimate
//! needs ([`trainer_config`]), the pod is resolved on it: every knob, the model's shape and
//! the setup come from the report, with provenance [`PROVENANCE`]; nothing of its launch is read
//! or rewritten (it could not be read), so the plan reaches the trainer as `MEMGUARD_*` env.

use crate::key::{LaunchKey, PodKey};
use crate::reported::PROVENANCE;
use crate::trainer_config::training_config;
use k8s_openapi::api::core::v1::Pod;
use memguard_api::annotations as keys;
use memguard_api::annotations::TrainingAnnotations;
use memguard_api::crd::TrainerReport;
use memguard_api::pod::TrainerLaunch;
use memguard_api::{Cluster, Knob, Policy, TrainingPod};
use std::collections::BTreeMap;

/// A Guarded pod resolved on its trainer's report.
#[derive(Debug, Clone, PartialEq)]
pub struct OnLaunchReport<'a> {
    /// The pod as planned: the report's config, every knob's source [`PROVENANCE`].
    pub training: TrainingPod<'a>,
    /// Its profile key: the launch's, with the report's config.
    pub key: PodKey,
}

/// `pod`, keyed by `key` ([`crate::key::launch_key`]), resolved on `reported` (a report's knobs: the
/// profile's [`TrainerReport::config`], or a summary's `trainer_config`); `launched`: its
/// launch already found ([`TrainerLaunch::of_pod`]), else found here. An error says why not:
/// each value the estimate needs that the report lacks, or an impossible one.
pub fn resolve_on_report<'a>(
    pod: &'a Pod,
    policy: &Policy,
    cluster: Cluster<'_>,
    key: &LaunchKey,
    reported: &BTreeMap<String, f64>,
    launched: Option<(usize, TrainerLaunch)>,
) -> Result<OnLaunchReport<'a>, String> {
    let config = training_config(reported)?;
    // The pod's own options (safety ratio, env-map, container, quality) are parsed as for any
    // pod; the model is the report's shape, so that the annotations parse.
    let mut given = pod.metadata.annotations.clone().unwrap_or_default();
    let m = &config.model;
    for (k, v) in [
        (keys::HIDDEN_SIZE, m.hidden_size),
        (keys::NUM_LAYERS, m.num_layers),
        (keys::NUM_HEADS, m.num_heads),
        (keys::NUM_KV_HEADS, m.num_kv_heads),
        (keys::INTERMEDIATE_SIZE, m.intermediate_size),
        (keys::VOCAB_SIZE, m.vocab_size),
    ] {
        given.insert(k.to_string(), v.to_string());
    }
    let mut parsed = TrainingAnnotations::parse(&given, &policy.models).map_err(|errs| {
        errs.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    })?;
    parsed.config = config.clone();
    parsed.device_given = true;
    parsed.knobs_given.clear();
    let mut training =
        TrainingPod::with_annotations_launched(pod, parsed, true, policy, cluster, launched)
            .map_err(|e| e.to_string())?;
    // Nothing of the launch is read: the report says what runs.
    training.config = config;
    training.sources.clear();
    training.unreadable.clear();
    training.set_by_trainer.clear();
    training.args = None;
    training.args_unreadable = None;
    training.config_file = None;
    training.config_unreadable = None;
    training.read_from_args.clear();
    training.read_from_file.clear();
    training.setup_sources.clear();
    training.unknown.clear();
    training.reported = Knob::of(&training.config)
        .into_iter()
        .map(|k| (k, PROVENANCE.to_string()))
        .collect();
    let key = PodKey {
        spec: key.spec.clone(),
        name: key.name.clone(),
        config: training.config.clone(),
        trainer: key.trainer.clone(),
    };
    Ok(OnLaunchReport { training, key })
}

/// What admission does with a Guarded pod's profile: plan on its report, or say why not.
#[derive(Debug, Clone, PartialEq)]
pub enum Planned<'a> {
    /// The report gives everything the estimate needs.
    OnReport(Box<OnLaunchReport<'a>>, TrainerReport),
    /// No report under the launch key yet.
    NoReport,
    /// The report lacks a value the estimate needs (or has an impossible one): stays Guarded.
    Incomplete {
        /// The pod whose run reported it.
        pod: String,
        /// Which values, and why.
        why: String,
    },
}

/// What `pod`'s profile's `report` allows ([`resolve_on_report`]).
pub fn on_profile_report<'a>(
    pod: &'a Pod,
    policy: &Policy,
    cluster: Cluster<'_>,
    key: &LaunchKey,
    report: Option<&TrainerReport>,
    launched: Option<(usize, TrainerLaunch)>,
) -> Planned<'a> {
    let Some(report) = report else {
        return Planned::NoReport;
    };
    match resolve_on_report(pod, policy, cluster, key, &report.config, launched) {
        Ok(on) => Planned::OnReport(Box::new(on), report.clone()),
        Err(why) => Planned::Incomplete {
            pod: report.pod.clone(),
            why,
        },
    }
}

#[cfg(test)]
mod tests;
