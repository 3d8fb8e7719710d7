//! `memguard explain`: what happened to a pod's memory, from the pod as `kubectl get pod -o yaml`
//! gives it (spec, annotations and status). The input is read as `memguard mutate` reads it:
//! Pods, or workloads whose every pod template is explained as the pod its controller creates
//! (in the workload's namespace), with the ConfigMaps and Nodes the decision reads. Several
//! pods are explained in turn (JSON: an array of them).
//!
//! Everything comes from the manifest: the webhook's `memguard.io/estimate` (budget, its source,
//! the steps), the estimator run again on the config the trainer was given (the breakdown), the
//! sidecar's termination summary (measured peak, run-time downgrades, OOM kills and records), the
//! trainer's terminated state (the OOM and its kind, as the profile controller classifies it).
//! What the next pod gets is computed, not guessed: the profile controller's update
//! ([`memguard_learn::update::apply_limited`]) folds this pod into the profile's status (the one
//! given with `--profile`, as `kubectl get memoryprofile -o yaml` gives it, else an empty one),
//! and the webhook's own decision ([`memguard_webhook::mutate`]) admits the pod again under it.

use k8s_openapi::api::core::v1::{ContainerStateTerminated, ContainerStatus, Pod};
use memguard_api::crd::{MemoryProfile, MemoryProfileSpec, MemoryProfileStatus, TrainingKnobs};
use memguard_api::dra::{DraCatalog, StaticCatalog};
use memguard_api::{
    BudgetSource, EstimateAnnotation, OomRecord, Summary, annotations as keys, wellknown,
};
use memguard_api::{Knob, Policy, TrainingPod};
use memguard_estimator::{Bytes, estimate};
use memguard_learn::observe::{NotObserved, oom_reason, parse_summary, try_observe};
use memguard_learn::update::{OomRules, apply_limited};
use memguard_webhook::policy_sources::{Overrides, policy_from_str};
use serde::Serialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

/// Flags of `memguard explain`.
#[derive(clap::Args)]
pub struct Args {
    /// The pod with its status (`kubectl get pod NAME -o yaml`), or `-` for stdin; or the pods
    /// of a `kind: List`, or a workload (Job, PyTorchJob, Deployment, … as `memguard mutate`
    /// takes them, e.g. its output), each pod template explained; with the ConfigMaps and Nodes
    /// the decision reads.
    #[arg(short = 'f', long = "filename", value_name = "FILE")]
    pub file: PathBuf,

    /// `table` or `json`.
    #[arg(short, long, value_enum, default_value_t = Output::Table)]
    pub output: Output,

    /// The pod's `MemoryProfile` (`kubectl get memoryprofile NAME -o yaml`): what the profile
    /// has learnt before this pod, so that the next pod's config, the OOMs in a row and the
    /// verdict are the ones the cluster will see. Without it: a profile that knows only this pod.
    #[arg(long = "profile", value_name = "FILE")]
    pub profile: Option<PathBuf>,

    /// Policy document (YAML or JSON `PolicySpec`, or a `MemguardPolicy` manifest), as given to
    /// the webhook: its budget rules, floors and `maxOomRecoveries` decide the next pod.
    #[arg(long, value_name = "FILE")]
    pub policy_file: Option<PathBuf>,

    /// DRA objects (`resource.k8s.io/v1` ResourceClaimTemplate, ResourceClaim, DeviceClass,
    /// ResourceSlice), as given to `memguard mutate --dra`: a pod known as a GPU pod only
    /// through its claims is keyed and admitted as the cluster does. Repeat for several files.
    #[arg(long = "dra", value_name = "FILE")]
    pub dra: Vec<PathBuf>,
}

/// Output format.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Output {
    /// Aligned `field  value` lines, section by section.
    Table,
    /// One JSON object.
    Json,
}

/// What happened to one pod's memory.
#[derive(Debug, Serialize)]
pub struct Explanation {
    pod: String,
    /// For a workload's pod template: the workload and the template's path in it
    /// (`Job ml/sft /spec/template`).
    #[serde(skip_serializing_if = "Option::is_none")]
    workload: Option<String>,
    trainer: Option<String>,
    /// `memguard.io/error`, when the webhook left the pod unchanged or said "cannot fit".
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    /// Why `memguard.io/estimate` could not be read (another version, a damaged value).
    #[serde(skip_serializing_if = "Option::is_none")]
    estimate_error: Option<String>,
    /// The config the trainer was given (annotations with its `MEMGUARD_*` env).
    config: BTreeMap<&'static str, String>,
    /// Where each knob came from (`args`, `env:<NAME>`, `annotation`, `default`), when the
    /// webhook read any from the trainer's own config.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    sources: BTreeMap<String, String>,
    /// The values the trainer's own config had before memguard rewrote them.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    read: BTreeMap<String, String>,
    /// The trainer's flags memguard rewrote, in its words.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    changed: Vec<String>,
    /// The trainer's command line before and after the rewrite.
    #[serde(skip_serializing_if = "Option::is_none")]
    args: Option<memguard_api::estimate::ArgsChange>,
    #[serde(skip_serializing_if = "Option::is_none")]
    estimate: Option<EstimateView>,
    #[serde(skip_serializing_if = "Option::is_none")]
    budget: Option<BudgetView>,
    /// The pod's host memory as admitted, planned against the trainer's `limits.memory`.
    #[serde(skip_serializing_if = "Option::is_none")]
    host: Option<memguard_api::estimate::HostAnnotation>,
    /// Downgrade steps the webhook applied at admission.
    steps: Vec<String>,
    /// The pending recovery the webhook applied at admission (after an earlier pod's OOM).
    #[serde(skip_serializing_if = "Option::is_none")]
    admitted_after: Option<String>,
    /// Whether memguard's webhook admitted the pod (it carries `memguard.io/estimate` or
    /// `memguard.io/error`).
    admitted: bool,
    /// What the sidecar measured and did (its termination summary).
    #[serde(skip_serializing_if = "Option::is_none")]
    run: Option<RunView>,
    /// Why the sidecar's termination message could not be read as its summary.
    #[serde(skip_serializing_if = "Option::is_none")]
    summary_error: Option<String>,
    /// The trainer's OOMs: its current and last terminated states.
    ooms: Vec<OomView>,
    restarts: i32,
    /// What the Job's next pod will get.
    next: NextView,
    /// A pod whose model admission cannot read (Guarded): the profile key of its launch, and
    /// what it is taken over.
    #[serde(skip_serializing_if = "Option::is_none")]
    launch_key: Option<LaunchKeyView>,
    /// What the profile (after this pod) holds of the trainer's own report at train start,
    /// beside what admission gave this pod, and the phases its OOM kills came in.
    #[serde(skip_serializing_if = "Option::is_none")]
    learnt: Option<LearntView>,
}

/// The key of a Guarded pod ([`memguard_decide::key::launch_key`]).
#[derive(Debug, Serialize)]
struct LaunchKeyView {
    /// Object name of its `MemoryProfile`.
    name: String,
    /// What the key's hash is taken over (`image=…`, `command=…`, `configmap=…`, `env=…`).
    identity: Vec<String>,
}

/// The profile's truth from inside the trainer, beside admission's belief.
#[derive(Debug, Serialize)]
struct LearntView {
    /// The pod whose run reported it.
    #[serde(skip_serializing_if = "Option::is_none")]
    reported_by: Option<String>,
    /// Each knob the trainer reported, with admission's value for this pod.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    knobs: BTreeMap<String, ReportedKnob>,
    /// OOM kills per phase (`load`, `step`, `save`).
    kill_phases: memguard_api::crd::OomKillPhases,
    /// The phase of the newest OOM kill, what the next admission's host plan accounts for.
    #[serde(skip_serializing_if = "Option::is_none")]
    last_kill_phase: Option<memguard_api::phase::TrainerPhase>,
}

#[derive(Debug, Serialize)]
struct ReportedKnob {
    /// The trainer's value.
    reported: f64,
    /// What admission gave this pod; absent when it is not one of admission's knobs
    /// (`params`) or admission did not read it.
    #[serde(skip_serializing_if = "Option::is_none")]
    admitted: Option<String>,
    /// What admission read in the trainer's own config, before it planned (absent when the
    /// knob came from annotations or defaults).
    #[serde(skip_serializing_if = "Option::is_none")]
    read: Option<String>,
    /// The sidecar flagged it: admission believed otherwise than the trainer ran.
    mismatch: bool,
}

/// [`LearntView`] of `status`, beside the knobs admission gave the pod (`config`); `None`
/// when the profile holds neither a report nor a kill phase.
fn learnt_view(
    status: &MemoryProfileStatus,
    config: &BTreeMap<&'static str, String>,
    read: &BTreeMap<String, String>,
) -> Option<LearntView> {
    let report = status.trainer_report.as_ref();
    if report.is_none() && status.oom_kill_phases.is_empty() {
        return None;
    }
    let knobs = report
        .map(|r| {
            r.config
                .iter()
                .map(|(knob, value)| {
                    let reported = ReportedKnob {
                        reported: *value,
                        admitted: config.get(knob.as_str()).cloned(),
                        read: read.get(knob).cloned(),
                        mismatch: r.mismatch.contains(knob),
                    };
                    (knob.clone(), reported)
                })
                .collect()
        })
        .unwrap_or_default();
    Some(LearntView {
        reported_by: report.map(|r| r.pod.clone()),
        knobs,
        kill_phases: status.oom_kill_phases,
        last_kill_phase: status.last_kill_phase(),
    })
}

#[derive(Debug, Serialize)]
struct EstimateView {
    total_bytes: Option<u64>,
    uncalibrated_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    calibration_factor: Option<f64>,
    /// The estimator's terms for the config the trainer was given, name → bytes.
    components: BTreeMap<&'static str, u64>,
    tensor_peak_bytes: Option<u64>,
}

#[derive(Debug, Serialize)]
struct BudgetView {
    bytes: Option<u64>,
    source: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu_memory_bytes: Option<u64>,
    fits: Option<bool>,
}

#[derive(Debug, Serialize)]
struct RunView {
    peak_bytes: Option<u64>,
    gpu_peak_bytes: Option<u64>,
    limit_bytes: Option<u64>,
    downgrades: u64,
    max_level: String,
    final_batch_size: u64,
    final_grad_accumulation: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    sticky_batch_size: Option<u64>,
    oom_kills: u64,
    /// The trainer's phase (load, step, save) when the last OOM kill came; absent when it
    /// reported none.
    #[serde(skip_serializing_if = "Option::is_none")]
    oom_kill_phase: Option<&'static str>,
    oom_records: u64,
    exit_reason: String,
}

#[derive(Debug, Serialize)]
struct OomView {
    /// `current` (the trainer's state now) or `last` (before an in-place restart).
    state: &'static str,
    exit_code: i32,
    /// The profile controller's reason: `OOMKilled`, `CudaOOM`, `CpuOOM`, `Killed(137)`.
    reason: String,
    /// The OOM record the trainer wrote as its termination message, if it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    record: Option<OomRecord>,
}

#[derive(Debug, Serialize)]
struct NextView {
    /// `same` (no OOM), `one step down` (a recovery), `floor` (nothing left to shrink), or
    /// `cannot fit` (OOM recoveries exhausted, or over budget with every knob at its floor).
    verdict: &'static str,
    reason: String,
    /// The knobs the webhook gives the next pod of this Job.
    #[serde(skip_serializing_if = "Option::is_none")]
    config: Option<TrainingKnobs>,
    /// `memguard.io/error` the next pod will carry (`cannot fit: …`).
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    /// For a pod admission cannot read: the next admission's plan on the trainer's report
    /// (what it says, and each knob's source), or why it stays guarded.
    #[serde(skip_serializing_if = "Option::is_none")]
    planned_on: Option<String>,
    /// Where each knob of the next pod's plan came from, when it was planned on a report.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    sources: BTreeMap<String, String>,
    /// The profile's status once the controller has recorded this pod.
    #[serde(skip_serializing_if = "Option::is_none")]
    profile: Option<ProfileView>,
}

#[derive(Debug, Serialize)]
struct ProfileView {
    /// Object name of the pod's `MemoryProfile`.
    name: String,
    /// Its key.
    spec: MemoryProfileSpec,
    /// Whether this pod was already in the given profile's runs.
    already_recorded: bool,
    /// The status after this pod.
    status: MemoryProfileStatus,
}

/// What the next pod is decided from: the pod's profile and the policy.
pub struct NextContext {
    /// The pod's profile before this pod (or an empty one).
    pub profile: Option<MemoryProfile>,
    /// The policy in force.
    pub policy: Policy,
    /// The DRA objects the webhook reads, when given.
    pub dra: Option<Arc<StaticCatalog>>,
    /// The ConfigMaps in the input (trainers' config files).
    pub config_maps: memguard_api::cluster::ConfigMapList,
    /// The Nodes in the input (names, labels, taints).
    pub nodes: memguard_api::cluster::NodeList,
}

impl NextContext {
    /// The webhook's view of the cluster these objects make (no profile yet).
    fn view(&self) -> memguard_webhook::ClusterView {
        let mut view = memguard_webhook::ClusterView::default();
        if let Some(dra) = &self.dra {
            view = view.with_dra(dra.clone());
        }
        if !self.config_maps.0.is_empty() {
            view = view.with_config_maps(Arc::new(self.config_maps.clone()));
        }
        if !self.nodes.0.is_empty() {
            view = view.with_nodes(Arc::new(self.nodes.clone()));
        }
        view
    }

    fn cluster(&self) -> memguard_api::Cluster<'_> {
        memguard_api::Cluster {
            dra: self.dra.as_deref().map(|c| c as &dyn DraCatalog),
            config_maps: (!self.config_maps.0.is_empty())
                .then_some(&self.config_maps as &dyn memguard_api::cluster::ConfigMaps),
            nodes: (!self.nodes.0.is_empty())
                .then_some(&self.nodes as &dyn memguard_api::cluster::NodeLabels),
        }
    }
}

/// Bad input: reported, exit code 2.
fn bad_input(message: impl std::fmt::Display) -> anyhow::Result<ExitCode> {
    eprintln!("error: {message}");
    Ok(ExitCode::from(crate::EXIT_BAD_INPUT))
}

/// The pods `explain` describes in the input: each Pod, and each pod template of a workload
/// (Job, PyTorchJob, Deployment, …) as the pod its controller creates, in the workload's
/// namespace ([`memguard_webhook::manifest::pods`], as `mutate` finds them); with where each is.
fn subjects(input: &crate::input::Input) -> Result<Vec<Subject>, String> {
    let mut subjects = Vec::new();
    for doc in &input.documents {
        let pods = memguard_webhook::manifest::pods(&doc.value)
            .map_err(|e| format!("{}: {}: {e}", input.source, doc.place))?;
        for (path, pod) in pods {
            let workload = (!path.is_empty()).then(|| {
                let meta = &doc.value["metadata"];
                let kind = doc.value["kind"].as_str().unwrap_or("object");
                let name = meta["name"].as_str().unwrap_or("unnamed");
                match meta["namespace"].as_str() {
                    Some(ns) => format!("{kind} {ns}/{name} {path}"),
                    None => format!("{kind} {name} {path}"),
                }
            });
            let place = match &workload {
                Some(w) => format!("{} {w}", doc.place),
                None => doc.place.clone(),
            };
            subjects.push(Subject {
                place,
                workload,
                pod,
            });
        }
    }
    Ok(subjects)
}

/// One pod to explain.
struct Subject {
    /// Where it is in the input (`document 2`, `document 1 item 3 Job ml/sft /spec/template`).
    place: String,
    /// The workload and the template's path in it, for a pod template.
    workload: Option<String>,
    /// The pod (a template's, in its workload's namespace).
    pod: Pod,
}

/// Runs `memguard explain`.
pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let input = match crate::input::read(&args.file) {
        Ok(input) => input,
        Err(e) => return bad_input(e),
    };
    let subjects = match subjects(&input) {
        Ok(s) if s.is_empty() => {
            return bad_input(format!(
                "{}: no Pod and no workload with a pod template in the input (explain reads pods \
                 as the API server reports them, kubectl get pod NAME -o yaml, or a workload: \
                 Job, PyTorchJob, Deployment, …)",
                input.source
            ));
        }
        Ok(s) => s,
        Err(e) => return bad_input(e),
    };
    let policy_text = match &args.policy_file {
        Some(path) => match std::fs::read_to_string(path) {
            Ok(text) => Some(text),
            Err(e) => return bad_input(format!("reading {}: {e}", path.display())),
        },
        None => None,
    };
    let policy = match policy_from_str(policy_text.as_deref(), &Overrides::default()) {
        Ok(p) => p,
        Err(errors) => return bad_input(format!("invalid policy: {}", errors.join("; "))),
    };
    let dra = match crate::mutate::read_dra(&args.dra) {
        Ok(dra) => dra,
        Err(e) => return bad_input(format!("--dra: {e}")),
    };
    let mut ctx = NextContext {
        profile: None,
        policy,
        dra,
        config_maps: input.config_maps,
        nodes: input.nodes,
    };
    // The profile, for each pod: the one given when it holds that pod's key. With one pod, a
    // profile for another key is an error; with several, it must be some pod's.
    let mut profiles: Vec<Option<MemoryProfile>> = vec![None; subjects.len()];
    if let Some(path) = &args.profile {
        let mut first_error = None;
        for (Subject { place, pod, .. }, profile) in subjects.iter().zip(profiles.iter_mut()) {
            match read_profile(path, pod, &ctx) {
                Ok(p) => *profile = Some(p),
                Err(e) if subjects.len() == 1 => return bad_input(e),
                Err(e) => {
                    first_error.get_or_insert(format!("{place}: {e}"));
                }
            }
        }
        if profiles.iter().all(Option::is_none)
            && let Some(e) = first_error
        {
            return bad_input(e);
        }
    }
    let json = matches!(args.output, Output::Json);
    let several = subjects.len() > 1;
    let mut explained: Vec<Value> = Vec::new();
    let mut first = true;
    let mut out = std::io::stdout().lock();
    for (subject, profile) in subjects.iter().zip(profiles) {
        let place = &subject.place;
        ctx.profile = profile;
        let mut one: Vec<u8> = Vec::new();
        if let Err(e) = explain_one(&mut one, json, subject, &ctx)? {
            return bad_input(if several { format!("{place}: {e}") } else { e });
        }
        if !several {
            out.write_all(&one)?;
        } else if json {
            explained.push(serde_json::from_slice(&one)?);
        } else {
            if !first {
                writeln!(out)?;
            }
            first = false;
            writeln!(out, "== {place}")?;
            out.write_all(&one)?;
        }
    }
    if several && json {
        serde_json::to_writer_pretty(&mut out, &explained)?;
        writeln!(out)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// One pod explained on `out`: an inference server's admission, or what happened to a
/// trainer's memory; `Err` for bad input.
fn explain_one(
    out: &mut Vec<u8>,
    json: bool,
    subject: &Subject,
    ctx: &NextContext,
) -> anyhow::Result<Result<(), String>> {
    let pod = &subject.pod;
    // An inference server: the admission's decision on its command line.
    let profiles = ctx.view();
    if let Some(written) = crate::serving::write(out, json, pod, &ctx.policy, &profiles) {
        return Ok(written?.map(|_| ()));
    }
    let mut explanation = explain_with(pod, ctx);
    explanation.workload.clone_from(&subject.workload);
    if json {
        serde_json::to_writer_pretty(&mut *out, &explanation)?;
        writeln!(out)?;
    } else {
        write_table(out, &explanation)?;
    }
    Ok(Ok(()))
}

/// A profile key and its object name.
struct KeyOf {
    spec: MemoryProfileSpec,
    name: String,
}

/// The one `MemoryProfile` in `path`, which must hold the pod's key.
fn read_profile(
    path: &std::path::Path,
    pod: &Pod,
    ctx: &NextContext,
) -> Result<MemoryProfile, String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {shown}: {e}"))?;
    let value: serde_json::Value =
        serde_saphyr::from_str(&text).map_err(|e| format!("{shown}: not valid YAML: {e}"))?;
    let profile: MemoryProfile =
        serde_json::from_value(value).map_err(|e| format!("{shown}: not a MemoryProfile: {e}"))?;
    // A pod admission cannot read (Guarded) is keyed by its launch.
    let key = match memguard_decide::key::pod_key(pod, &ctx.policy, ctx.cluster()) {
        Ok(key) => (key.spec, key.name),
        Err(e) => memguard_decide::key::launch_key(pod, &ctx.policy)
            .map(|k| (k.spec, k.name))
            .map_err(|_| format!("{shown}: the pod has no profile key to match it with: {e}"))?,
    };
    let key = KeyOf {
        spec: key.0,
        name: key.1,
    };
    if profile.spec != key.spec {
        let json = |v: &MemoryProfileSpec| serde_json::to_string(v).unwrap_or_default();
        return Err(format!(
            "{shown}: profile {} is for {}, but the pod's key is {} (profile {})",
            profile.metadata.name.as_deref().unwrap_or("?"),
            json(&profile.spec),
            json(&key.spec),
            key.name
        ));
    }
    Ok(profile)
}

/// What happened to `pod`'s memory, and what its Job's next pod gets under `ctx`.
pub fn explain_with(pod: &Pod, ctx: &NextContext) -> Explanation {
    let empty = BTreeMap::new();
    let annotations = pod.metadata.annotations.as_ref().unwrap_or(&empty);
    let training = TrainingPod::resolve(pod, &ctx.policy, ctx.cluster()).ok();
    let launch_key = training
        .is_none()
        .then(|| memguard_decide::key::launch_key(pod, &ctx.policy).ok())
        .flatten();
    let trainer = training
        .as_ref()
        .map(|t| t.trainer.name.clone())
        .or_else(|| launch_key.as_ref().map(|k| k.trainer.clone()));
    let ran = training
        .as_ref()
        .map(|t| TrainingKnobs::from_env(&t.trainer_env).apply_to(&t.config));
    let (annotation, estimate_error) = match annotations.get(keys::ESTIMATE) {
        None => (None, None),
        Some(text) => match EstimateAnnotation::parse(text) {
            Ok(a) => (Some(a), None),
            Err(e) => (None, Some(e.to_string())),
        },
    };
    let estimate_view = estimate_view(annotation.as_ref(), ran.as_ref());
    let budget = annotation.as_ref().map(|a| BudgetView {
        bytes: a.budget.map(|b| b.0),
        source: a.budget_source.as_ref().map(describe_source),
        gpu_memory_bytes: a.gpu_memory.map(|b| b.0),
        fits: a.fits,
    });
    let steps = annotation
        .as_ref()
        .map(|a| a.steps.clone())
        .unwrap_or_default();

    let (summary, summary_error) = match sidecar_summary(pod) {
        Ok(summary) => (summary, None),
        Err(why) => (None, Some(why)),
    };
    let run = summary.as_ref().map(run_view);
    let admitted =
        annotations.contains_key(keys::ESTIMATE) || annotations.contains_key(keys::ERROR);

    let status = trainer
        .as_deref()
        .and_then(|t| trainer_status(pod, t))
        .cloned();
    let ooms = status
        .as_ref()
        .map(|s| ooms(pod, s, summary.as_ref()))
        .unwrap_or_default();

    let next = next_view(pod, ran.as_ref(), ctx);
    // The knobs the trainer was given, named as the annotations and env-map name them.
    let config: BTreeMap<&'static str, String> = ran
        .as_ref()
        .map(|c| {
            Knob::of(c)
                .into_iter()
                .map(|k| (k.name(), k.value(c)))
                .collect()
        })
        .unwrap_or_default();
    let learnt = next.profile.as_ref().and_then(|p| {
        let read = annotation.as_ref().map(|a| &a.read);
        learnt_view(&p.status, &config, read.unwrap_or(&BTreeMap::new()))
    });
    Explanation {
        pod: pod.metadata.name.clone().unwrap_or_default(),
        workload: None,
        trainer,
        error: annotations.get(keys::ERROR).cloned(),
        estimate_error,
        sources: annotation
            .as_ref()
            .map(|a| a.sources.clone())
            .unwrap_or_default(),
        read: annotation
            .as_ref()
            .map(|a| a.read.clone())
            .unwrap_or_default(),
        changed: annotation
            .as_ref()
            .map(|a| a.changed.clone())
            .unwrap_or_default(),
        args: annotation.as_ref().and_then(|a| a.args.clone()),
        config,
        estimate: estimate_view,
        budget,
        host: annotation.as_ref().and_then(|a| a.host.clone()),
        steps,
        admitted_after: annotation.and_then(|a| a.recovery),
        admitted,
        run,
        summary_error,
        ooms,
        restarts: status.as_ref().map_or(0, |s| s.restart_count),
        next,
        launch_key: launch_key.map(|k| LaunchKeyView {
            name: k.name,
            identity: k.identity,
        }),
        learnt,
    }
}

/// The estimate as admitted (`memguard.io/estimate`), with the estimator's breakdown of the
/// config that ran.
fn estimate_view(
    annotation: Option<&EstimateAnnotation>,
    ran: Option<&memguard_estimator::TrainingConfig>,
) -> Option<EstimateView> {
    let estimated = ran.and_then(|c| estimate(c).ok());
    (annotation.is_some() || estimated.is_some()).then(|| EstimateView {
        total_bytes: annotation.map(|a| a.total.0),
        uncalibrated_bytes: annotation.map(|a| a.uncalibrated.0),
        calibration_factor: annotation.and_then(|a| a.calibration).map(|c| c.factor),
        components: estimated
            .as_ref()
            .map(|e| e.components.iter().map(|(c, b)| (c.name(), b.0)).collect())
            .unwrap_or_default(),
        tensor_peak_bytes: annotation
            .map(|a| a.tensor_peak.0)
            .or(estimated.as_ref().map(|e| e.tensor_peak.0)),
    })
}

/// What the sidecar's summary says of the run.
fn run_view(s: &Summary) -> RunView {
    RunView {
        peak_bytes: s.peak_bytes,
        gpu_peak_bytes: s.gpu_peak_bytes,
        limit_bytes: s.limit_bytes,
        downgrades: s.downgrades,
        max_level: s.max_level.to_string(),
        final_batch_size: s.batch_size,
        final_grad_accumulation: s.grad_accumulation,
        sticky_batch_size: s.sticky_batch_size,
        oom_kills: s.oom_events,
        oom_kill_phase: s.oom_kill_phase.map(|p| p.name()),
        oom_records: s.oom_reports,
        exit_reason: s.exit_reason.clone(),
    }
}

/// The trainer's OOMs: its current and last terminated states, as the profile controller
/// classifies them.
fn ooms(pod: &Pod, status: &ContainerStatus, summary: Option<&Summary>) -> Vec<OomView> {
    let states = [
        (
            "current",
            status.state.as_ref().and_then(|x| x.terminated.as_ref()),
        ),
        (
            "last",
            status
                .last_state
                .as_ref()
                .and_then(|x| x.terminated.as_ref()),
        ),
    ];
    let mut ooms = Vec::new();
    for (state, terminated) in states {
        let Some(t) = terminated else { continue };
        // The summary describes the pod's whole run: it explains the current state only.
        let s = if state == "current" { summary } else { None };
        if let Some(reason) = oom_reason(pod, t, s) {
            ooms.push(oom_view(state, t, reason));
        }
    }
    ooms
}

/// `kind (detail)`, or `kind` alone: the annotation's `budgetSource` for a person.
pub(crate) fn describe_source(source: &BudgetSource) -> String {
    let value = serde_json::to_value(source).unwrap_or_default();
    match (value["kind"].as_str(), value["detail"].as_str()) {
        (Some(kind), Some(detail)) => format!("{kind} ({detail})"),
        (Some(kind), None) => kind.to_string(),
        _ => value.to_string(),
    }
}

fn oom_view(state: &'static str, t: &ContainerStateTerminated, reason: String) -> OomView {
    OomView {
        state,
        exit_code: t.exit_code,
        reason,
        record: t
            .message
            .as_deref()
            .and_then(OomRecord::from_termination_message),
    }
}

/// What the profile controller records for this pod, and what the webhook then gives the next
/// pod: the controller's update and the webhook's decision, run here.
fn next_view(
    pod: &Pod,
    ran: Option<&memguard_estimator::TrainingConfig>,
    ctx: &NextContext,
) -> NextView {
    // A manifest saved without its UID still explains: the UID only makes the controller's
    // records idempotent.
    let mut pod = pod.clone();
    pod.metadata.uid.get_or_insert_with(|| "explain".into());
    pod.metadata.name.get_or_insert_with(|| "unnamed".into());
    let obs = match try_observe(&pod, &ctx.policy, ctx.cluster()) {
        Ok(obs) => obs,
        Err(why) => {
            return NextView {
                verdict: "same",
                reason: format!(
                    "nothing learned from this pod yet: {}",
                    match why {
                        NotObserved::NotOptedIn => "not opted in (memguard.io/enabled)".to_string(),
                        NotObserved::NoIdentity => "no name".to_string(),
                        NotObserved::Running => "the trainer has not terminated".to_string(),
                        NotObserved::AwaitingSummary =>
                            "the sidecar has not written its summary".to_string(),
                        NotObserved::NoFinishTime => "no finish time".to_string(),
                        NotObserved::NoKey(e) => format!("no profile key: {e}"),
                    }
                ),
                config: ran.map(TrainingKnobs::of),
                error: None,
                planned_on: None,
                sources: BTreeMap::new(),
                profile: None,
            };
        }
    };
    let mut profile = ctx
        .profile
        .clone()
        .unwrap_or_else(|| MemoryProfile::new(&obs.key.name, obs.key.spec.clone()));
    let before = profile.status.clone().unwrap_or_default();
    let after = apply_limited(&before, &obs, &OomRules::of(&ctx.policy));
    let already_recorded = after == before && before.has_run(&obs.uid, &obs.finished_at);
    profile.status = Some(after.clone());
    let mut profiles = ctx.view();
    profiles.insert(profile.clone());
    // The next pod of the Job: the same manifest (its annotations are memguard's input and are
    // never edited), admitted again under the profile that now knows this pod.
    let on_report = |w: &String| w.contains("trainer's report of");
    let (config, error, planned_on, sources) =
        match memguard_webhook::mutate(&pod, &ctx.policy, &profiles) {
            memguard_webhook::Outcome::Mutated(m) => {
                let planned_on = m.warnings.iter().find(|w| on_report(w)).cloned();
                let sources = if planned_on.is_some() {
                    m.estimate.sources.clone()
                } else {
                    BTreeMap::new()
                };
                (
                    Some(TrainingKnobs::of(&m.plan.config)),
                    m.error,
                    planned_on,
                    sources,
                )
            }
            memguard_webhook::Outcome::Skipped { error, .. } => {
                (None, Some(error), None, BTreeMap::new())
            }
            memguard_webhook::Outcome::Guarded(g) => {
                let planned_on = g.warnings.iter().find(|w| on_report(w)).cloned();
                (None, Some(g.reason), planned_on, BTreeMap::new())
            }
            memguard_webhook::Outcome::Served(s) => (None, s.error.clone(), None, BTreeMap::new()),
            memguard_webhook::Outcome::Unchanged => (None, None, None, BTreeMap::new()),
        };
    let (verdict, reason) = if let Some(v) = error.as_ref().filter(|e| e.starts_with("cannot fit"))
    {
        ("cannot fit", v.clone())
    } else if obs.oom.is_some() {
        match &after.recovery {
            Some(r) if r.rungs > 0 => ("one step down", r.reason.clone()),
            Some(r) => ("floor", r.reason.clone()),
            None => ("same", "no recovery recorded".into()),
        }
    } else if planned_on.is_some() && after.recovery.is_none() {
        (
            "same",
            "the trainer did not run out of memory: the next pod is planned on what it \
             reported at train start"
                .into(),
        )
    } else {
        (
            "same",
            match &after.recovery {
                Some(r) => format!(
                    "the trainer did not run out of memory; the profile's recovery stays: {}",
                    r.reason
                ),
                None => "the trainer did not run out of memory: the next pod is admitted as this \
                         one (a correction factor may apply after three runs)"
                    .into(),
            },
        )
    };
    NextView {
        verdict,
        reason,
        config,
        error,
        planned_on,
        sources,
        profile: Some(ProfileView {
            name: profile.metadata.name.clone().unwrap_or_default(),
            spec: profile.spec.clone(),
            already_recorded,
            status: after,
        }),
    }
}

fn trainer_status<'a>(pod: &'a Pod, trainer: &str) -> Option<&'a ContainerStatus> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|s| s.name == trainer)
}

/// The sidecar's summary (its termination message): `Ok(None)` while it runs or when there is
/// no sidecar; `Err` with the message's start when it terminated with something else.
fn sidecar_summary(pod: &Pod) -> Result<Option<Summary>, String> {
    let message = pod.status.as_ref().and_then(|status| {
        status
            .init_container_statuses
            .iter()
            .flatten()
            .chain(status.container_statuses.iter().flatten())
            .find(|s| s.name == wellknown::SIDECAR_CONTAINER)?
            .state
            .as_ref()?
            .terminated
            .as_ref()?
            .message
            .clone()
    });
    let Some(message) = message.filter(|m| !m.trim().is_empty()) else {
        return Ok(None);
    };
    match parse_summary(&message) {
        Some(summary) => Ok(Some(summary)),
        None => {
            let start: String = message.trim().chars().take(60).collect();
            Err(format!(
                "the sidecar's termination message is not a memguard summary: `{start}`{}",
                if message.trim().chars().count() > 60 {
                    "…"
                } else {
                    ""
                }
            ))
        }
    }
}

fn bytes(b: Option<u64>) -> String {
    b.map_or_else(|| "-".into(), |b| Bytes(b).to_string())
}

/// The host figure beside the GPU figure: what the trainer's `limits.memory` must hold, its
/// verdict, the rewrites and the values it rests on.
fn write_host(
    out: &mut impl Write,
    h: &memguard_api::estimate::HostAnnotation,
) -> std::io::Result<()> {
    let row = |out: &mut dyn Write, k: &str, v: &str| writeln!(out, "  {k:<22} {v}");
    writeln!(out, "host memory (per pod, {} rank(s))", h.ranks)?;
    let figure = match (h.most, h.unknown.is_empty()) {
        (_, true) => h.bytes.to_string(),
        (Some(most), false) => format!("{} to {most}", h.bytes),
        (None, false) => format!("at least {}", h.bytes),
    };
    row(out, "peak", &format!("{figure} at {}", h.phase))?;
    let parts: Vec<String> = h
        .components
        .iter()
        .map(|(name, b)| format!("{name} {b}"))
        .collect();
    row(out, "components", &parts.join(", "))?;
    row(
        out,
        "limits.memory",
        &h.limit.map_or("-".into(), |l| l.to_string()),
    )?;
    let verdict = match (h.fits, h.limit) {
        (_, None) => "no verdict: the trainer has no limits.memory".to_string(),
        (Some(true), _) => "fits".to_string(),
        (Some(false), _) => h
            .verdict
            .clone()
            .unwrap_or_else(|| "does not fit".to_string()),
        (None, _) => {
            let names: Vec<&str> = h.unknown.keys().map(String::as_str).collect();
            format!("no verdict: depends on {} (not read)", names.join(", "))
        }
    };
    row(out, "host verdict", &verdict)?;
    for (knob, c) in &h.rewritten {
        row(
            out,
            &format!("rewritten {knob}"),
            &format!("{}→{} (was {})", c.from, c.to, c.source),
        )?;
    }
    for (knob, source) in &h.sources {
        row(out, knob, source)?;
    }
    for (knob, why) in &h.unknown {
        row(out, knob, &format!("unknown: {why}"))?;
    }
    Ok(())
}

fn write_table(out: &mut impl Write, e: &Explanation) -> std::io::Result<()> {
    let row = |out: &mut dyn Write, k: &str, v: &str| writeln!(out, "  {k:<22} {v}");
    let trainer = e.trainer.as_deref().unwrap_or("-");
    match &e.workload {
        Some(workload) => writeln!(out, "pod template of {workload} (trainer {trainer})")?,
        None => writeln!(out, "pod {} (trainer {trainer})", e.pod)?,
    }
    if let Some(err) = &e.error {
        row(out, "error", err)?;
    }
    if let Some(err) = &e.estimate_error {
        row(out, "estimate unreadable", err)?;
    }
    if !e.admitted {
        row(
            out,
            "admission",
            "not admitted by memguard (no memguard.io/estimate: the webhook did not see this pod \
             or skipped it); the config below is what the pod's own spec says",
        )?;
    }
    writeln!(out, "config")?;
    for (k, v) in &e.config {
        match (e.sources.get(*k), e.read.get(*k)) {
            (Some(source), Some(was)) if was != v => {
                row(out, k, &format!("{v}  ({source}: was {was})"))?
            }
            (Some(source), _) => row(out, k, &format!("{v}  ({source})"))?,
            (None, _) => row(out, k, v)?,
        }
    }
    if !e.changed.is_empty() {
        row(out, "rewritten", &e.changed.join(", "))?;
    }
    if let Some(args) = &e.args {
        let line = |items: &[String]| {
            items
                .iter()
                .map(|i| memguard_api::launch::words::quote(i))
                .collect::<Vec<_>>()
                .join(" ")
        };
        row(out, "args before", &line(&args.before))?;
        row(out, "args after", &line(&args.after))?;
        if args.cut {
            row(out, "args", "cut to fit the annotation")?;
        }
    }
    if let Some(est) = &e.estimate {
        writeln!(out, "estimate")?;
        row(out, "total", &bytes(est.total_bytes))?;
        row(out, "uncalibrated", &bytes(est.uncalibrated_bytes))?;
        if let Some(f) = est.calibration_factor {
            row(out, "calibration factor", &format!("{f:.3}"))?;
        }
        let mut parts: Vec<_> = est.components.iter().collect();
        parts.sort_by_key(|(_, b)| std::cmp::Reverse(**b));
        for (name, b) in parts {
            row(out, name, &bytes(Some(*b)))?;
        }
        row(out, "tensor peak", &bytes(est.tensor_peak_bytes))?;
    }
    if let Some(b) = &e.budget {
        writeln!(out, "budget")?;
        row(out, "budget", &bytes(b.bytes))?;
        row(out, "source", b.source.as_deref().unwrap_or("-"))?;
        if b.gpu_memory_bytes.is_some() {
            row(out, "gpu memory", &bytes(b.gpu_memory_bytes))?;
        }
        row(out, "fits", &b.fits.map_or("-".into(), |f| f.to_string()))?;
    }
    if let Some(h) = &e.host {
        write_host(out, h)?;
    }
    let steps = if e.steps.is_empty() {
        "none".to_string()
    } else {
        e.steps.join(" → ")
    };
    row(out, "admission steps", &steps)?;
    if let Some(r) = &e.admitted_after {
        row(out, "admitted after", r)?;
    }
    writeln!(out, "run (sidecar summary)")?;
    match &e.run {
        Some(r) => {
            row(out, "measured peak", &bytes(r.peak_bytes))?;
            row(out, "gpu peak", &bytes(r.gpu_peak_bytes))?;
            row(out, "limit", &bytes(r.limit_bytes))?;
            row(out, "runtime downgrades", &r.downgrades.to_string())?;
            row(out, "max level", &r.max_level)?;
            let fin = format!(
                "batch {} × {}",
                r.final_batch_size, r.final_grad_accumulation
            );
            row(out, "final config", &fin)?;
            if let Some(s) = r.sticky_batch_size {
                row(out, "sticky downgrade", &format!("batch {s}"))?;
            }
            let kills = match r.oom_kill_phase {
                Some(phase) => format!("{} (last in phase {phase})", r.oom_kills),
                None => r.oom_kills.to_string(),
            };
            row(out, "oom kills (cgroup)", &kills)?;
            row(out, "oom records", &r.oom_records.to_string())?;
            row(out, "exit", &r.exit_reason)?;
        }
        None => match &e.summary_error {
            Some(why) => row(out, "summary", &format!("unreadable: {why}"))?,
            None => row(out, "summary", "none (sidecar running or absent)")?,
        },
    }
    writeln!(out, "ooms (restarts {})", e.restarts)?;
    if e.ooms.is_empty() {
        row(out, "-", "none")?;
    }
    for o in &e.ooms {
        let mut what = format!("{} (exit {})", o.reason, o.exit_code);
        if let Some(r) = &o.record {
            what.push_str(&format!(
                ", {} {} at step {}, batch {}",
                r.outcome,
                r.kind,
                r.step.map_or_else(|| "?".into(), |s| s.to_string()),
                r.batch_size
            ));
            if let Some(req) = r.requested_bytes {
                what.push_str(&format!(", failed request {}", Bytes(req)));
            }
        }
        row(out, o.state, &what)?;
    }
    writeln!(out, "next pod")?;
    row(out, "verdict", e.next.verdict)?;
    row(out, "reason", &e.next.reason)?;
    if let Some(k) = &e.next.config {
        row(out, "config", &k.describe())?;
    }
    if let Some(err) = &e.next.error {
        row(out, "error", err)?;
    }
    if let Some(on) = &e.next.planned_on {
        row(out, "planned on", on)?;
    }
    if !e.next.sources.is_empty() {
        let sources: std::collections::BTreeSet<&str> =
            e.next.sources.values().map(String::as_str).collect();
        row(
            out,
            "sources",
            &sources.into_iter().collect::<Vec<_>>().join(", "),
        )?;
    }
    if let Some(k) = &e.launch_key {
        writeln!(
            out,
            "launch key {} (admission cannot read the model)",
            k.name
        )?;
        for line in &k.identity {
            row(out, "-", line)?;
        }
    }
    if let Some(p) = &e.next.profile {
        let s = &p.status;
        writeln!(
            out,
            "profile {}{}",
            p.name,
            if p.already_recorded {
                " (already had this pod)"
            } else {
                " (after this pod)"
            }
        )?;
        row(out, "runs", &s.run_count.to_string())?;
        let factor = s
            .median_correction_factor
            .map_or_else(|| "-".into(), |f| format!("{f:.3}"));
        row(out, "correction factor", &factor)?;
        row(out, "oom events", &s.oom_events.len().to_string())?;
        row(out, "ooms in a row", &s.oom_recoveries.to_string())?;
        // The recovery is what the next pod gets: shown once, under "next pod", unless the
        // next pod does not take it.
        if let Some(r) = &s.recovery
            && e.next.config.as_ref() != Some(&r.config)
        {
            row(out, "recovery (pending)", &r.config.describe())?;
        }
        if let Some(v) = &s.verdict {
            row(out, "verdict", v)?;
        }
    }
    if let Some(l) = &e.learnt {
        write_learnt(out, l)?;
    }
    Ok(())
}

/// The trainer's report beside admission's values, and the kill phases.
fn write_learnt(out: &mut impl Write, l: &LearntView) -> std::io::Result<()> {
    let row = |out: &mut dyn Write, k: &str, v: &str| writeln!(out, "  {k:<22} {v}");
    match &l.reported_by {
        Some(pod) => writeln!(out, "trainer reported (pod {pod}, at train start)")?,
        None => writeln!(out, "trainer reported")?,
    }
    if l.knobs.is_empty() {
        row(out, "-", "nothing")?;
    }
    for (knob, r) in &l.knobs {
        // A flag is reported as 0 or 1: shown as admission writes it.
        let value = match (knob.as_str(), r.reported) {
            ("grad-checkpointing", v) if v == 0.0 || v == 1.0 => (v == 1.0).to_string(),
            (_, v) if v.fract() == 0.0 && v.abs() < 1e15 => format!("{}", v as i64),
            (_, v) => v.to_string(),
        };
        let mut beside: Vec<String> = Vec::new();
        if let Some(a) = &r.admitted {
            beside.push(format!("admission: {a}"));
        }
        if let Some(read) = r.read.as_ref().filter(|v| Some(*v) != r.admitted.as_ref()) {
            beside.push(format!("read {read}"));
        }
        if r.mismatch {
            beside.push("mismatch".into());
        }
        let beside = if beside.is_empty() {
            String::new()
        } else {
            format!("  ({})", beside.join("; "))
        };
        row(out, knob, &format!("{value}{beside}"))?;
    }
    let p = &l.kill_phases;
    let mut kills = format!("load {}, step {}, save {}", p.load, p.step, p.save);
    if let Some(last) = l.last_kill_phase {
        kills.push_str(&format!(" (last in {last})"));
    }
    row(out, "oom kills by phase", &kills)
}
