//! What a finished pod taught: [`observe`] reads the trainer's terminated state, the sidecar's
//! summary, the estimate and the knobs the pod ran with. Pure: a `&Pod` in, a value out.

use k8s_openapi::api::core::v1::{ContainerStateTerminated, ContainerStatus, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use memguard_api::Cluster;
use memguard_api::annotations as keys;
use memguard_api::crd::{DeviceClass, TrainingKnobs};
use memguard_api::pod::ResolveError;
use memguard_api::{
    EstimateAnnotation, Level, OomKind, OomOutcome, OomRecord, Policy, Summary, TrainingPod,
    wellknown,
};
use memguard_decide::guarded::resolve_on_report;
use memguard_decide::key::{KeyError, PodKey, launch_key};
use memguard_estimator::{Bytes, TrainingConfig};

/// `reason` of a container the kernel OOM-killed.
pub const OOM_KILLED: &str = "OOMKilled";
/// Exit code of a process killed by SIGKILL (128 + 9), what an OOM kill looks like from outside.
pub const SIGKILL_EXIT: i32 = 137;
/// `reason` recorded for a SIGKILL the kubelet did not attribute to the OOM killer.
pub const KILLED_EXIT_137: &str = "Killed(137)";
/// Reason recorded for a trainer that died of a CUDA (accelerator) out-of-memory error: its OOM
/// record, or a termination message that says so.
pub const CUDA_OOM: &str = "CudaOOM";
/// Reason recorded for a trainer that died of a host out-of-memory error it caught itself
/// (`MemoryError`, torch's CPU allocator): its OOM record or message.
pub const CPU_OOM: &str = "CpuOOM";
/// Pod condition the control plane sets on pods it evicts, preempts or deletes.
pub const DISRUPTION_TARGET: &str = "DisruptionTarget";

/// One terminated trainer, with everything the profile learns from it.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    /// Pod name.
    pub pod: String,
    /// Pod UID.
    pub uid: String,
    /// The profile key, its object name, the annotated config and the trainer's name.
    pub key: PodKey,
    /// When the trainer finished (the container's own `finishedAt`: the same on every replay).
    pub finished_at: Time,
    /// The trainer's exit code.
    pub exit_code: i32,
    /// Set when the trainer ran out of memory: `OOMKilled`, [`KILLED_EXIT_137`], [`CUDA_OOM`] or
    /// [`CPU_OOM`].
    pub oom: Option<String>,
    /// The webhook's estimate for the config the pod ran with, before calibration (the
    /// `uncalibrated` of `memguard.io/estimate`).
    pub estimate: Option<Bytes>,
    /// Why there is no `estimate`: no annotation, or one this version cannot read. The run is
    /// still recorded (its peak and OOM count), but it does not calibrate.
    pub estimate_problem: Option<String>,
    /// Peak the sidecar measured on the profile's device class (GPU or host memory).
    pub measured_peak: Option<Bytes>,
    /// Memory the trainer had: GPU memory per device, or its memory limit.
    pub limit: Option<Bytes>,
    /// The knobs the pod ran with (the trainer's `MEMGUARD_*` env).
    pub knobs: TrainingKnobs,
    /// The annotated config with `knobs` applied: the config that ran.
    pub ran: TrainingConfig,
    /// The sidecar's summary, when it left one.
    pub summary: Option<Summary>,
}

/// Why a pod is not (yet) an observation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotObserved {
    /// No `memguard.io/enabled=true` label.
    NotOptedIn,
    /// The pod has no name or UID.
    NoIdentity,
    /// The trainer has not terminated.
    Running,
    /// The trainer terminated, the sidecar is still writing its summary: wait for it.
    AwaitingSummary,
    /// The trainer's terminated state carries no time (nothing to be idempotent on).
    NoFinishTime,
    /// The pod has no profile key.
    NoKey(String),
}

/// [`try_observe`], for callers that do not care why not.
pub fn observe(pod: &Pod, policy: &Policy, cluster: Cluster<'_>) -> Option<Observation> {
    try_observe(pod, policy, cluster).ok()
}

/// Reads a pod whose trainer has terminated (now, or before a restart in place) into an
/// [`Observation`].
///
/// A trainer that terminated while the sidecar still runs is not observed yet: the summary with
/// the measured peak comes when the sidecar stops, and a run is recorded once. The exceptions
/// are a pod in a final phase (`Succeeded`/`Failed`), a pod without a sidecar status, and a
/// trainer already restarted in place (its `lastState`; the sidecar keeps running and will
/// summarize the whole pod later).
///
/// The pod is resolved as the webhook did at admission ([`TrainingPod::resolve`]): its model
/// looked up in the `policy`'s models, then the built-in catalog; its DRA claims read from `dra`.
pub fn try_observe(
    pod: &Pod,
    policy: &Policy,
    cluster: Cluster<'_>,
) -> Result<Observation, NotObserved> {
    if !memguard_api::pod::opted_in(pod) {
        return Err(NotObserved::NotOptedIn);
    }
    let (Some(name), Some(uid)) = (&pod.metadata.name, &pod.metadata.uid) else {
        return Err(NotObserved::NoIdentity);
    };
    let (training, key, terminated, summary) = match TrainingPod::resolve(pod, policy, cluster) {
        Ok(training) => {
            let key = PodKey::of(&training);
            let (terminated, restarted) = terminated_trainer(pod, &key.trainer)?;
            let summary = sidecar_summary(pod, restarted)?;
            (training, key, terminated, summary)
        }
        Err(ResolveError::NoTrainingInput(_) | ResolveError::LaunchModel(_)) => {
            guarded(pod, policy, cluster)?
        }
        Err(e) => return Err(NotObserved::NoKey(KeyError::from(e).to_string())),
    };
    let finished_at = terminated
        .finished_at
        .clone()
        .or_else(|| terminated.started_at.clone())
        .ok_or(NotObserved::NoFinishTime)?;
    let (annotation, mut estimate_problem) = estimate_annotation(pod);
    let knobs = knobs_ran(&training, terminated, summary.as_ref());
    let ran = knobs.apply_to(&key.config);
    let mut estimate = annotation
        .as_ref()
        .map(|a| a.uncalibrated)
        .filter(|b| b.0 > 0);
    // The trainer ran another config than the one estimated (the sidecar's mismatch): its peak
    // says nothing of the estimate's accuracy, so the run does not calibrate, and an OOM's
    // recovery is not scaled by a factor against the wrong config.
    if let Some(mismatch) = summary
        .as_ref()
        .map(|s| &s.config_mismatch)
        .filter(|m| !m.is_empty())
        && estimate.is_some()
    {
        estimate = None;
        estimate_problem = Some(format!(
            "the trainer ran another config than the estimate's ({} differed): the run does \
             not calibrate",
            mismatch.join(", ")
        ));
    }
    let gpu = key.spec.device_class == DeviceClass::Gpu;
    let measured_peak = summary
        .as_ref()
        .and_then(|s| if gpu { s.gpu_peak_bytes } else { s.peak_bytes })
        .filter(|b| *b > 0)
        .map(Bytes);
    let limit = memory_limit(gpu, annotation.as_ref(), summary.as_ref(), &training);

    Ok(Observation {
        pod: name.clone(),
        uid: uid.clone(),
        finished_at,
        exit_code: terminated.exit_code,
        oom: oom_reason(pod, terminated, summary.as_ref()),
        estimate,
        estimate_problem,
        measured_peak,
        limit,
        knobs,
        ran,
        summary,
        key,
    })
}

/// A finished pod resolved and keyed: the pod, its key, the trainer's terminated state and the
/// sidecar's summary.
type Keyed<'a> = (
    TrainingPod<'a>,
    PodKey,
    &'a ContainerStateTerminated,
    Option<Summary>,
);

/// A pod whose model admission cannot read (Guarded: the sidecar and the client injected, not
/// planned at admission, issue 37): learnt under its launch key
/// ([`memguard_decide::key::launch_key`]) on what its trainer reported at train start, the
/// config that ran. Without a report that gives every value the estimate needs, no run to
/// learn, and the reason says which.
fn guarded<'a>(
    pod: &'a Pod,
    policy: &Policy,
    cluster: Cluster<'_>,
) -> Result<Keyed<'a>, NotObserved> {
    let launch = launch_key(pod, policy).map_err(|e| NotObserved::NoKey(e.to_string()))?;
    let (terminated, restarted) = terminated_trainer(pod, &launch.trainer)?;
    let summary = sidecar_summary(pod, restarted)?;
    let reported = summary
        .as_ref()
        .map(|s| &s.trainer_config)
        .filter(|c| !c.is_empty())
        .ok_or_else(|| {
            NotObserved::NoKey(
                "not planned at admission, and its trainer reported no config at train start"
                    .into(),
            )
        })?;
    let on = resolve_on_report(pod, policy, cluster, &launch, reported, None).map_err(|why| {
        NotObserved::NoKey(format!(
            "not planned at admission, and its trainer's report cannot be planned on: {why}"
        ))
    })?;
    Ok((on.training, on.key, terminated, summary))
}

/// The container statuses of `pod`: its init containers' or its containers'.
fn statuses(pod: &Pod, init: bool) -> &[ContainerStatus] {
    pod.status
        .as_ref()
        .and_then(|s| {
            if init {
                s.init_container_statuses.as_ref()
            } else {
                s.container_statuses.as_ref()
            }
        })
        .map(Vec::as_slice)
        .unwrap_or_default()
}

/// The trainer's terminated state: its current one, else the last before an in-place restart
/// (then `true`).
fn terminated_trainer<'a>(
    pod: &'a Pod,
    trainer: &str,
) -> Result<(&'a ContainerStateTerminated, bool), NotObserved> {
    let (terminated, restarted) = match statuses(pod, false).iter().find(|s| s.name == trainer) {
        Some(ContainerStatus {
            state: Some(state), ..
        }) if state.terminated.is_some() => (state.terminated.as_ref(), false),
        Some(s) => (
            s.last_state.as_ref().and_then(|l| l.terminated.as_ref()),
            true,
        ),
        None => (None, false),
    };
    terminated
        .map(|t| (t, restarted))
        .ok_or(NotObserved::Running)
}

/// The sidecar's summary of the run, once it has written it; none for a trainer restarted in
/// place (the sidecar summarizes the whole pod later), a pod without a sidecar or in a final
/// phase.
fn sidecar_summary(pod: &Pod, restarted: bool) -> Result<Option<Summary>, NotObserved> {
    let sidecar = statuses(pod, true)
        .iter()
        .chain(statuses(pod, false))
        .find(|s| s.name == wellknown::SIDECAR_CONTAINER);
    let sidecar_done = sidecar
        .and_then(|s| s.state.as_ref())
        .and_then(|s| s.terminated.as_ref());
    let final_phase = matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    if !restarted && sidecar.is_some() && sidecar_done.is_none() && !final_phase {
        return Err(NotObserved::AwaitingSummary);
    }
    if restarted {
        return Ok(None);
    }
    Ok(sidecar_done
        .and_then(|t| t.message.as_deref())
        .and_then(parse_summary))
}

/// `memguard.io/estimate`, or why there is none to read.
fn estimate_annotation(pod: &Pod) -> (Option<EstimateAnnotation>, Option<String>) {
    match pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(keys::ESTIMATE))
    {
        None => (None, Some(format!("no {} annotation", keys::ESTIMATE))),
        Some(text) => match EstimateAnnotation::parse(text) {
            Ok(a) => (Some(a), None),
            Err(e) => (None, Some(e.to_string())),
        },
    }
}

/// What the trainer ran with when it ended: its OOM record says (a run-time downgrade or an
/// in-process recovery may have taken it below the env the webhook wrote); else, when the
/// sidecar only grew it back, the summary's final knobs; else the sidecar's plan at train start
/// (the micro-batch the client ran the reported config at), else what the trainer reported at
/// train start (the config it really ran, issue 37), else the env.
fn knobs_ran(
    training: &TrainingPod,
    terminated: &ContainerStateTerminated,
    summary: Option<&Summary>,
) -> TrainingKnobs {
    let mut knobs = TrainingKnobs::from_env(&training.trainer_env);
    let reported = summary.map(|s| &s.trainer_config);
    for (name, value) in reported.into_iter().flatten() {
        if let Some(knob) =
            memguard_api::Knob::parse(name).filter(|k| k.applies_to(&training.config))
            && let Some(value) =
                memguard_decide::reported::knob_value(knob, *value, &training.config)
        {
            knobs.set(knob, &value);
        }
    }
    // The trainer reports what it is configured at; a train-start plan re-chunks that in
    // process, so the micro-batch in force from step 1 is the plan's.
    if let Some(plan) = summary
        .and_then(|s| s.train_start.as_ref())
        .filter(|p| p.planned)
    {
        knobs.batch_size = plan.batch_size.filter(|b| *b > 0).or(knobs.batch_size);
        knobs.grad_accumulation = plan
            .grad_accumulation
            .filter(|a| *a > 0)
            .or(knobs.grad_accumulation);
        knobs.grad_checkpointing = plan.grad_checkpointing.or(knobs.grad_checkpointing);
    }
    at_the_end(knobs, terminated, summary)
}

/// `knobs` with what changed during the run: the OOM record's, else the summary's when it only
/// grew back.
fn at_the_end(
    mut knobs: TrainingKnobs,
    terminated: &ContainerStateTerminated,
    summary: Option<&Summary>,
) -> TrainingKnobs {
    let record = OomRecord::from_termination_message(terminated.message.as_deref().unwrap_or(""))
        .or_else(|| {
            summary
                .and_then(|s| s.last_oom.clone())
                .filter(|r| r.outcome == OomOutcome::Fatal)
        });
    if let Some(r) = &record {
        knobs.batch_size = Some(r.batch_size).filter(|b| *b > 0).or(knobs.batch_size);
        knobs.grad_accumulation = Some(r.grad_accumulation)
            .filter(|a| *a > 0)
            .or(knobs.grad_accumulation);
        knobs.grad_checkpointing = Some(r.grad_checkpointing);
    } else if let Some(s) = summary.filter(|s| s.growths > 0 && s.downgrades == 0) {
        // Grown back on measured peaks and never shrunk (issue 37, item 5): it ended at the
        // largest micro-batch it ran, where its peak was measured; the env is where it began.
        knobs.batch_size = Some(s.batch_size).filter(|b| *b > 0).or(knobs.batch_size);
        knobs.grad_accumulation = Some(s.grad_accumulation)
            .filter(|a| *a > 0)
            .or(knobs.grad_accumulation);
    }
    knobs
}

/// The memory the trainer had: for a GPU profile the device's (the budget stage's figure, else
/// the sidecar's), else the sidecar's limit or the trainer's memory limit.
fn memory_limit(
    gpu: bool,
    annotation: Option<&EstimateAnnotation>,
    summary: Option<&Summary>,
    training: &TrainingPod,
) -> Option<Bytes> {
    if gpu {
        annotation
            .and_then(|a| a.gpu_memory)
            .map(|b| b.0)
            .or_else(|| summary.and_then(|s| s.limit_bytes))
    } else {
        summary
            .and_then(|s| s.limit_bytes)
            .or(training.memory_limit.map(|b| b.0))
    }
    .filter(|b| *b > 0)
    .map(Bytes)
}

/// Whether, and how, the trainer ran out of memory:
///
/// | trainer | sidecar summary | pod | → |
/// | --- | --- | --- | --- |
/// | `reason: OOMKilled` | any | any | `OOMKilled` |
/// | exit 0 | any | any | not an OOM |
/// | termination message is an OOM record (`memguard_api::OomRecord`) | any | any | [`CUDA_OOM`] / [`CPU_OOM`] by its kind |
/// | termination message says so (`CUDA out of memory`, …: [`memguard_api::oom::classify_text`]) | any | any | [`CUDA_OOM`] / [`CPU_OOM`] |
/// | other non-zero exit | carries a fatal OOM record (`last_oom`) | any | [`CUDA_OOM`] / [`CPU_OOM`] by its kind |
/// | exit 137 | counted an OOM kill | any | `OOMKilled` |
/// | exit 137 | none counted | `DisruptionTarget` or being deleted | not an OOM (evicted, preempted, deleted) |
/// | exit 137 | none counted | otherwise | [`KILLED_EXIT_137`] |
/// | other non-zero exit | level `critical` and an OOM kill counted | any | `OOMKilled` |
/// | anything else | | | not an OOM |
pub fn oom_reason(
    pod: &Pod,
    trainer: &ContainerStateTerminated,
    summary: Option<&Summary>,
) -> Option<String> {
    if trainer.reason.as_deref() == Some(OOM_KILLED) {
        return Some(OOM_KILLED.into());
    }
    if trainer.exit_code == 0 {
        return None;
    }
    let message = trainer.message.as_deref().unwrap_or_default();
    let kind = OomRecord::from_termination_message(message)
        .map(|r| r.kind)
        .or_else(|| memguard_api::oom::classify_text(message))
        .or_else(|| {
            summary
                .and_then(|s| s.last_oom.as_ref())
                .filter(|r| r.outcome == OomOutcome::Fatal)
                .map(|r| r.kind)
        });
    if let Some(kind) = kind {
        return Some(oom_kind_reason(kind).into());
    }
    let sidecar_saw_oom = summary.is_some_and(|s| s.oom_events > 0);
    match trainer.exit_code {
        0 => None,
        SIGKILL_EXIT if sidecar_saw_oom => Some(OOM_KILLED.into()),
        SIGKILL_EXIT if disrupted(pod) => None,
        SIGKILL_EXIT => Some(KILLED_EXIT_137.into()),
        _ if sidecar_saw_oom && summary.is_some_and(|s| s.max_level == Level::Critical) => {
            Some(OOM_KILLED.into())
        }
        _ => None,
    }
}

/// The reason recorded for an OOM of `kind`.
pub const fn oom_kind_reason(kind: OomKind) -> &'static str {
    match kind {
        OomKind::CudaOom => CUDA_OOM,
        OomKind::CpuOom => CPU_OOM,
    }
}

fn disrupted(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_some()
        || pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.type_ == DISRUPTION_TARGET && c.status == "True")
            })
}

/// The sidecar's termination message as a [`Summary`]; `None` for anything else (a garbled or
/// truncated message teaches nothing, and is not an error).
pub fn parse_summary(message: &str) -> Option<Summary> {
    let line = message.trim();
    if line.is_empty() || line.len() > memguard_api::summary::MAX_SUMMARY_BYTES {
        return None;
    }
    serde_json::from_str(line).ok()
}

#[cfg(test)]
mod tests;
