//! Inference servers at admission: a container that launches vLLM or SGLang
//! ([`ServerLaunch`]) gets its memory fraction and maximum length fitted to the memory the pod
//! really has ([`serving_fit::fit`]). Pure, like [`crate::mutate`]. The server is read from the
//! pod's one search of its command line ([`TrainerLaunch::server`], the container's literal env
//! resolved as for a trainer), which the training decision then takes over
//! ([`admit_launched`]).
//!
//! The model is the one the command line serves (`memguard.io/model` overrides it, for a local
//! path the catalog cannot name), the budget stage is the one every pod goes through
//! ([`decision::budget`]), and the device the engine sizes itself on is what its process sees
//! ([`memguard_decide::budget::seen_by_process`]). A server that fits as written keeps its
//! command line byte for byte; one that cannot start in its share gets `memguard.io/error` with
//! the numbers.

use crate::outcome::{Outcome, skipped};
use k8s_openapi::api::core::v1::Pod;
use memguard_api::annotations::{self as keys, TrainingAnnotations};
use memguard_api::launch::{ArgvEdit, ServerLaunch};
use memguard_api::pod::TrainerLaunch;
use memguard_api::{BudgetSource, Policy, TrainingPod};
use memguard_decide::decision;
use memguard_estimator::estimate::runtime_overhead;
use memguard_estimator::serving_fit::{self, Change, DeviceShare, Engine, FitRules, ServerFit};
use memguard_estimator::{Bytes, Device};
use serde_json::json;
use std::collections::BTreeMap;

pub use crate::watch::view::ClusterView;

/// What memguard decided for an inference server.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerAdmission {
    /// Index of the server in `spec.containers`.
    pub container_index: usize,
    /// Its name.
    pub container: String,
    /// The engine.
    pub engine: Engine,
    /// The model as the command line names it.
    pub model: String,
    /// The memory of one device as the process sees it.
    pub seen: Bytes,
    /// The pod's share of it.
    pub share: Bytes,
    /// Where the share came from.
    pub source: BudgetSource,
    /// The fit.
    pub fit: ServerFit,
    /// The changes to the container's argv (empty: left as written).
    pub edits: Vec<ArgvEdit>,
    /// `memguard.io/estimate`.
    pub estimate: String,
    /// `memguard.io/error`, when the server cannot start in its share.
    pub error: Option<String>,
    /// Warnings for the admission response.
    pub warnings: Vec<String>,
}

/// The server `pod` runs, fitted: `None` when its container launches no server (a training
/// pod: [`crate::mutate`] goes on). Never panics.
pub fn admit(pod: &Pod, policy: &Policy, profiles: &ClusterView) -> Option<Outcome> {
    match admit_launched(pod, policy, profiles) {
        Launched::Server(outcome) => Some(outcome),
        Launched::Trainer(_) => None,
    }
}

/// What the pod's one search of its command line launches ([`TrainerLaunch::of_pod`]).
#[derive(Debug)]
pub enum Launched {
    /// A server, admitted as one: the admission's outcome.
    Server(Outcome),
    /// No server: the trainer's launch (with its container's index; `None`: no container is
    /// the trainer), for the training decision to read rather than search again. Boxed: a
    /// launch is large, an outcome is not.
    Trainer(Box<Option<(usize, TrainerLaunch)>>),
}

/// [`admit`], handing the launch it found back when it is no server's. Never panics.
pub fn admit_launched(pod: &Pod, policy: &Policy, profiles: &ClusterView) -> Launched {
    let (index, launch, server) = match TrainerLaunch::of_pod(pod) {
        Some((index, launch)) => match launch.server().cloned() {
            Some(server) => (index, launch, server),
            None => return Launched::Trainer(Box::new(Some((index, launch)))),
        },
        None => return Launched::Trainer(Box::new(None)),
    };
    let annotations = pod.metadata.annotations.clone().unwrap_or_default();
    let name = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.get(index))
        .map(|c| c.name.clone())
        .unwrap_or_default();
    Launched::Server(
        match decide(pod, policy, profiles, annotations, (index, launch), &server) {
            Ok(admission) => Outcome::Served(Box::new(admission)),
            Err(error) => skipped(format!(
                "{} server in {name}: {error}",
                server.engine.name()
            )),
        },
    )
}

fn decide(
    pod: &Pod,
    policy: &Policy,
    profiles: &ClusterView,
    mut annotations: BTreeMap<String, String>,
    launched: (usize, TrainerLaunch),
    launch: &ServerLaunch,
) -> Result<ServerAdmission, String> {
    let index = launched.0;
    // The served model, read as `memguard.io/model` would be (policy models, then the catalog).
    annotations
        .entry(keys::MODEL.to_string())
        .or_insert_with(|| launch.model.clone());
    let model_name = annotations[keys::MODEL].clone();
    let parsed = TrainingAnnotations::parse(&annotations, &policy.models).map_err(|errors| {
        errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    })?;
    let model_bits = policy.models.lookup(&model_name).and_then(|m| m.model_bits);
    let shape = parsed.config.model.clone();
    let training = TrainingPod::with_annotations_launched(
        pod,
        parsed,
        false,
        policy,
        profiles.cluster(),
        Some(launched),
    )
    .map_err(|e| e.to_string())?;
    let device_kind = training.config.device;
    if !matches!(device_kind, Device::Cuda | Device::Rocm) {
        return Err(format!(
            "it runs on {}: memguard fits servers to GPU memory only",
            device_kind.name()
        ));
    }
    let (budget, warnings) = decision::budget(&training, policy);
    let budget = budget.ok_or_else(|| "no GPU memory to fit it to".to_string())?;
    let seen = memguard_decide::budget::seen_by_process(&training, &budget, policy);
    let settings = launch
        .settings(shape, model_bits)
        .map_err(|errors| errors.join("; "))?;
    let device = DeviceShare {
        seen,
        share: budget.device_memory,
    };
    let rules = FitRules {
        may_shorten: policy.serving_shorten_max_length,
        shortest: policy.floors.seq_length,
    };
    let fit = serving_fit::fit(
        &settings,
        device,
        runtime_overhead(training.config.device),
        rules,
    );
    let edits = launch
        .rewrite(&flag_values(launch, &fit))
        .map_err(|e| format!("its command line cannot be rewritten: {e}"))?;
    let mut warnings = warnings;
    if !settings.max_length_given {
        warnings.push(memguard_decide::warnings::truncate(&format!(
            "memguard: {} takes {model_name}'s own maximum length, which memguard does not \
             know: give {} to have it checked",
            launch.engine.name(),
            launch.engine.length_flag()
        )));
    }
    let estimate = estimate_annotation(launch.engine, &fit, seen, &budget.source, device.share);
    Ok(ServerAdmission {
        container_index: index,
        container: training.trainer.name.clone(),
        engine: launch.engine,
        model: model_name,
        seen,
        share: device.share,
        source: budget.source,
        error: fit.error.clone(),
        fit,
        edits,
        estimate,
        warnings,
    })
}

/// The flag values the fit's changes set. A server that cannot start keeps only a lowered
/// fraction: it must not take its neighbour's memory while it fails.
fn flag_values(launch: &ServerLaunch, fit: &ServerFit) -> Vec<(&'static str, String)> {
    let flags = launch.flags();
    let failing = fit.error.is_some();
    fit.changes
        .iter()
        .filter_map(|c| match c {
            Change::Fraction { from, to } if *to > 0.0 && (!failing || to < from) => {
                Some((flags.fraction, fraction_text(launch.engine, *to)))
            }
            Change::Fraction { .. } => None,
            Change::MaxLength { .. } if failing => None,
            Change::MaxLength { to, .. } => Some((flags.max_length, to.to_string())),
        })
        .collect()
}

/// `0.48`, `0.375`: the engine's precision, no trailing zeros.
pub fn fraction_text(engine: Engine, fraction: f64) -> String {
    let digits = match engine {
        Engine::Vllm => 2,
        Engine::Sglang => 3,
    };
    let text = format!("{fraction:.digits$}");
    let text = text.trim_end_matches('0');
    text.strip_suffix('.').unwrap_or(text).to_string()
}

/// `memguard.io/estimate` of a server: the KV cache, the tokens it holds and the sequences of
/// the maximum length it serves at once, with the fraction and the share they come from.
fn estimate_annotation(
    engine: Engine,
    fit: &ServerFit,
    seen: Bytes,
    source: &BudgetSource,
    share: Bytes,
) -> String {
    json!({
        "mode": "serve",
        "engine": engine.name(),
        "fraction": fit.fraction,
        "maxLength": fit.max_length,
        "kvCacheBytes": fit.kv_cache.0,
        "tokensFit": fit.tokens_fit,
        "concurrency": fit.concurrency.map(|c| (c * 100.0).floor() / 100.0),
        "weights": fit.weights.0,
        "reserve": fit.reserve.0,
        "peak": fit.peak.0,
        "seen": seen.0,
        "budget": share.0,
        "budgetSource": source,
        "fits": fit.error.is_none(),
    })
    .to_string()
}

#[cfg(test)]
mod tests;
