//! The decision: what memguard wants a training pod to look like. Pure: no I/O, no async.
//!
//! [`mutate`] reads the pod's annotations and resources, derives the memory budget the pod will
//! really have, runs the estimator's downgrade plan and returns an [`Outcome`]. It never fails:
//! anything wrong becomes [`Outcome::Skipped`] with a short warning, and the pod is admitted
//! unchanged. Turning a [`Mutation`] into a JSON patch is [`crate::patch`]'s job.
//!
//! Idempotency rests on one fact: memguard never edits its *input* annotations. A second call
//! (`reinvocationPolicy: IfNeeded`) parses the same original config, reaches the same plan, and
//! the patch, computed as a difference against the pod, comes out empty.

use k8s_openapi::api::core::v1::Pod;
use memguard_api::estimate::{ArgsChange, ESTIMATE_VERSION, EstimateAnnotation};
use memguard_api::pod::{ResolveError, TrainingPod};
use memguard_api::policy::{SidecarMode, SidecarResources};
use memguard_api::{Knob, Policy, env, wellknown};
use memguard_estimator::{Device, DowngradePlan, TrainingConfig};
use memguard_learn::Adjustments;
use memguard_learn::decision::{self, Decision};
pub use memguard_learn::decision::{
    ALLOC_CONF, EXPANDABLE_SEGMENTS, expandable_segments, user_alloc_conf,
};

pub use memguard_learn::warnings::{MAX_WARNING_CHARS, cannot_fit_warning, truncate};

pub use crate::cluster_view::{ClusterView, ProfileSource};
use crate::python_launch::runs_python;

/// What memguard does with a pod.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Not for memguard (not opted in): nothing to do, no warning.
    Unchanged,
    /// The pod as memguard wants it (which may already be how it is).
    Mutated(Box<Mutation>),
    /// A Python trainer whose config admission cannot read (no model it knows, a launch it
    /// cannot read): the sidecar and the client are injected so that it is guarded at run
    /// time, and its command, args and config stay as they are ([`Guarded`]).
    Guarded(Box<Guarded>),
    /// An inference server (vLLM, SGLang) fitted to the pod's share ([`crate::serving`]).
    Served(Box<crate::serving::ServerAdmission>),
    /// Opted in but unusable (bad annotations, no container, internal error): admitted unchanged
    /// except `memguard.io/error`.
    Skipped {
        /// The full reason, for the `memguard.io/error` annotation.
        error: String,
        /// A short form (≤ [`MAX_WARNING_CHARS`]) for the admission response.
        warning: String,
    },
}

pub use crate::budget::{Budget, BudgetSource};

/// The sidecar to inject, as decided (rendered into a container by [`crate::patch`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SidecarPlan {
    /// Native (`initContainers`, `restartPolicy: Always`) or classic (`containers`).
    pub mode: SidecarMode,
    /// Image.
    pub image: String,
    /// Resources.
    pub resources: SidecarResources,
    /// Literal env of the sidecar (the downward-API limit is added by the patch).
    pub env: Vec<(String, String)>,
}

/// The Python client to inject into the trainer (rendered by [`crate::patch`]): an init
/// container running `memguard client install` into an `emptyDir`, mounted in the trainer and
/// prepended to its `PYTHONPATH`.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientPlan {
    /// Image of the init container (it holds the `memguard` binary).
    pub image: String,
}

/// Everything memguard wants changed on one pod.
#[derive(Debug, Clone, PartialEq)]
pub struct Mutation {
    /// Index of the trainer in `spec.containers`.
    pub trainer_index: usize,
    /// Name of the trainer container.
    pub trainer: String,
    /// The budget, when the pod has one (a CPU pod without a memory limit has none).
    pub budget: Option<Budget>,
    /// The downgrade plan from the original config.
    pub plan: DowngradePlan,
    /// `MEMGUARD_*` variables for the trainer, in a stable order.
    pub trainer_env: Vec<(String, String)>,
    /// The user's own variables (env-map), rewritten in place.
    pub user_env: Vec<(String, String)>,
    /// The trainer's `command` and `args` rewritten in its own terms (HF flags), when the plan
    /// changed a knob read from them; `None`: left byte for byte.
    pub command_line: Option<CommandLine>,
    /// What changed, in the trainer's words (`--per_device_train_batch_size 8→2`).
    pub changed: Vec<String>,
    /// The sidecar.
    pub sidecar: SidecarPlan,
    /// The `memguard.io/estimate` annotation.
    pub estimate: EstimateAnnotation,
    /// Warnings for the admission response, each ≤ [`MAX_WARNING_CHARS`].
    pub warnings: Vec<String>,
    /// `memguard.io/error` to keep on the mutated pod: "cannot fit: …", the profile's verdict
    /// (OOM recoveries exhausted) or the plan's (every knob at its floor and still over budget).
    pub error: Option<String>,
    /// The pod's `spec.affinity` with memguard's placement merged in, when placement added any.
    pub affinity: Option<k8s_openapi::api::core::v1::Affinity>,
    /// The Python client, when the trainer runs Python and neither the policy nor the pod opted
    /// out.
    pub client: Option<ClientPlan>,
}

/// A trainer guarded at run time only: what admission injects when it cannot read the
/// trainer's config (rendered by [`crate::patch`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Guarded {
    /// Index of the trainer in `spec.containers`.
    pub trainer_index: usize,
    /// The signal file and the sidecar's URL, for the client.
    pub trainer_env: Vec<(String, String)>,
    /// The sidecar, with no starting knobs and no estimate: it starts from its own floor.
    pub sidecar: SidecarPlan,
    /// The Python client.
    pub client: Option<ClientPlan>,
    /// `memguard.io/error`: why nothing was planned at admission, and that the pod is guarded.
    pub reason: String,
    /// For the admission response, each ≤ [`MAX_WARNING_CHARS`].
    pub warnings: Vec<String>,
}

/// A container's command line as memguard writes it.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandLine {
    /// `command`, when the pod has one.
    pub command: Option<Vec<String>>,
    /// `args`, when the pod has them.
    pub args: Option<Vec<String>>,
    /// The whole command line before and after, for the estimate annotation.
    pub change: ArgsChange,
}

impl Mutation {
    /// Number of downgrade steps the plan applied.
    pub fn steps(&self) -> usize {
        self.plan.steps.len()
    }
}

/// Decides what to do with `pod` under `policy`. Never panics, never fails.
pub fn mutate(pod: &Pod, policy: &Policy, profiles: &ClusterView) -> Outcome {
    if !memguard_api::pod::opted_in(pod) {
        return Outcome::Unchanged;
    }
    if let Some(served) = crate::serving::admit(pod, policy, profiles) {
        return served;
    }
    let training = match TrainingPod::resolve(pod, policy, profiles.cluster()) {
        Ok(training) => training,
        Err(e @ (ResolveError::NoTrainingInput(_) | ResolveError::LaunchModel(_))) => {
            return guard(pod, policy, e.to_string());
        }
        Err(e) => return skipped(e.to_string()),
    };
    match decide(&training, policy, profiles) {
        Ok(mutation) => Outcome::Mutated(Box::new(mutation)),
        Err(error) => skipped(error),
    }
}

/// A pod opted in whose config admission cannot read: a Python trainer is guarded at run time
/// (the sidecar watches its memory, the client follows the signal and recovers from an OOM in
/// process), unless the policy or the pod keeps the client out; anything else is skipped.
fn guard(pod: &Pod, policy: &Policy, why: String) -> Outcome {
    let Ok((trainer_index, trainer)) = memguard_api::pod::pod_trainer(pod) else {
        return skipped(why);
    };
    let mut warnings = Vec::new();
    let Some(client) = client_plan(pod, trainer, policy, &mut warnings) else {
        return skipped(why);
    };
    let reason = format!(
        "not planned at admission, guarded at run time (the sidecar and the client): {why}"
    );
    warnings.insert(0, truncate(&format!("memguard: {reason}")));
    Outcome::Guarded(Box::new(Guarded {
        trainer_index,
        trainer_env: vec![
            (env::SIGNAL_FILE.into(), wellknown::SIGNAL_FILE.into()),
            (
                env::SIDECAR_URL.into(),
                format!("http://{}", wellknown::SIDECAR_LISTEN),
            ),
        ],
        sidecar: SidecarPlan {
            mode: policy.sidecar_mode,
            image: policy.sidecar_image.clone(),
            resources: policy.sidecar_resources.clone(),
            env: sidecar_base_env(policy, &trainer.name),
        },
        client: Some(client),
        reason,
        warnings,
    }))
}

/// An [`Outcome::Skipped`] with the warning cut to size.
pub fn skipped(error: String) -> Outcome {
    let warning = truncate(&format!("memguard skipped this pod: {error}"));
    Outcome::Skipped { error, warning }
}

/// The decision: [`resolve`](TrainingPod::resolve) the pod (its DRA claims read from the
/// profiles' catalog), run the budget stage every caller shares ([`decision::decide`]: key,
/// budget, what past runs taught, placement, plan), [`render`] the result.
fn decide(
    training: &TrainingPod,
    policy: &Policy,
    profiles: &ClusterView,
) -> Result<Mutation, String> {
    let pod = training.pod;
    // The plan moves only the knobs something applies ([`pinned_floors`]).
    let mut policy_in_play = policy.clone();
    let kept;
    (policy_in_play.floors, kept) = pinned_floors(training, policy);
    let adjustments = |key: &_| profiles.adjustments(pod.metadata.namespace.as_deref(), key);
    let mut decided = decision::decide(training, &policy_in_play, adjustments)?;
    // A coupled setting (a DeepSpeed config) pins batch and accumulation: a plan that would
    // change them is made again with them where they are, and says why.
    if let Some(why) = &training.coupled.batch_pinned
        && changes_batch(&training.config, &decided.plan.config)
    {
        policy_in_play.floors.batch_size = training.config.batch_size;
        decided = decision::decide(training, &policy_in_play, adjustments)?;
        // A start below the config (a pending OOM recovery) still moves them: then nothing
        // is changed.
        if changes_batch(&training.config, &decided.plan.config) {
            return Err(format!(
                "batch and accumulation cannot be changed, and the plan needs them changed: {why}"
            ));
        }
        let kept = format!("batch and accumulation kept: {why}");
        decided
            .warnings
            .push(truncate(&format!("memguard: {kept}")));
        if let Some(verdict) = &mut decided.verdict {
            verdict.push_str(&format!("; {kept}"));
        }
    }
    let mut file_warnings = Vec::new();
    // A plan on a value nobody read is a guess: nothing of it is applied, the launch stays as
    // it is, the estimate is the config as it runs, and the warning says what was not read
    // ([`TrainingPod::unknown`]).
    let (command_line, changed) = if !training.guessed().is_empty() {
        let plan = &mut decided.plan;
        let expandable = plan.config.expandable_segments;
        plan.steps.clear();
        plan.config = training.config.clone();
        plan.config.expandable_segments = expandable;
        plan.estimate = plan.initial.clone();
        (None, Vec::new())
    } else {
        keeps_effective_batch(training, policy, &decided.plan.config)?;
        match &training.config_file {
            Some(file) => {
                rewrite_config_file(training, file, &decided.plan.config, &mut file_warnings)?
            }
            None => rewrite_args(training, &decided.plan.config)?,
        }
    };
    let quality_allowed =
        decision::floors(training.annotations.allow_quality, policy).allow_quality;
    let mut mutation = render(training, policy, decided);
    mutation.warnings.extend(file_warnings);
    if quality_allowed && !kept.is_empty() {
        let names: Vec<&str> = kept.iter().map(|k| k.name()).collect();
        mutation.warnings.push(truncate(&format!(
            "memguard: {} kept: nothing in the trainer's launch applies them (no flag, key or \
             mapped variable)",
            names.join(", ")
        )));
    }
    if !training.guessed().is_empty() {
        mutation.warnings.insert(0, unknown_warning(training));
    }
    if let Some(flags) = training
        .args
        .as_ref()
        .map(|a| &a.unread_sequence_flags)
        .filter(|f| !f.is_empty())
    {
        mutation.warnings.push(truncate(&format!(
            "memguard: {} not read as the training sequence (memguard reads --max_length, \
             --max_seq_length, --model_max_length, --cutoff_len, --block_size); annotate \
             memguard.io/seq-length if it is one",
            flags.join(", ")
        )));
    }
    if let Some(why) = &training.args_unreadable {
        mutation.warnings.push(truncate(&format!(
            "memguard: the trainer's command line was not read ({why}); planned on annotations"
        )));
    }
    if let Some(why) = &training.config_unreadable {
        mutation.warnings.push(truncate(&format!(
            "memguard: {why}; planned without it, its args left as they were"
        )));
    }
    if !changed.is_empty() {
        // What changed, in the trainer's words, leads: a cut at 120 characters loses the tail.
        mutation
            .warnings
            .insert(0, truncate(&format!("memguard: {}", changed.join(", "))));
    }
    mutation.estimate.args = command_line.as_ref().map(|line| line.change.clone());
    mutation.command_line = command_line;
    mutation.estimate.changed = changed.clone();
    mutation.changed = changed;
    Ok(mutation)
}

/// The warning for a launch planned on values nobody read: which, why, and what says them.
fn unknown_warning(training: &TrainingPod) -> String {
    let program = training
        .args
        .as_ref()
        .map(|a| a.launch.program.name().to_string())
        .unwrap_or_default();
    let knobs: Vec<&str> = training
        .guessed()
        .into_iter()
        .filter(|n| *n != "parallelism")
        .collect();
    let mut parts = Vec::new();
    if !knobs.is_empty() {
        parts.push(format!(
            "{} not read (the script's own parser sets it)",
            knobs.join(", ")
        ));
    }
    if let Some(why) = &training.coupled.sharding_unknown
        && training.guessed().contains(&"parallelism")
    {
        parts.push(format!("sharding not read ({why})"));
    }
    truncate(&format!(
        "memguard: {program}: {}: no verdict, the launch is left as it is; give each as a flag \
         or annotate memguard.io/<knob>",
        parts.join("; ")
    ))
}

/// The knobs that only a reader can apply (sequence length, LoRA rank and layers: the Python
/// client does not change them) stay where the trainer's config has them unless something reads
/// them: a mapped variable, or the trainer's own config (a flag memguard rewrites, a file).
/// Their floor is raised to the current value, so the plan never counts on a change nothing
/// applies. Returns the floors and the knobs kept so (when quality cuts were allowed, a
/// warning names them).
///
/// Applied where memguard recognises the trainer's launch (an HF script, `axolotl`, `tune`,
/// `llamafactory-cli`, …: a trainer with its own config, which reads no `MEMGUARD_*`
/// variable); a pod with no recognised launch keeps the plan over every knob, as written for
/// memguard (its script reads `MEMGUARD_SEQ_LENGTH` and the like).
pub fn pinned_floors(
    training: &TrainingPod,
    policy: &Policy,
) -> (memguard_estimator::Floors, Vec<Knob>) {
    let mut floors = policy.floors;
    if training.args.is_none() && training.config_file.is_none() && !recognised_launch(training) {
        return (floors, Vec::new());
    }
    let map = training.env_map(policy);
    let cfg = &training.config;
    let in_play = |knob: Knob| {
        map.contains_key(&knob)
            || training.sources.contains_key(&knob)
            || config_file_knobs(training).contains(&knob)
    };
    let mut kept = Vec::new();
    let adapters = cfg.is_adapter();
    for (knob, floor, now) in [
        (Knob::SeqLength, &mut floors.seq_length, cfg.seq_length),
        (Knob::LoraRank, &mut floors.lora_rank, cfg.lora_rank),
        (
            Knob::LoraLayers,
            &mut floors.lora_layers,
            cfg.adapted_layers(),
        ),
    ] {
        if in_play(knob) {
            continue;
        }
        if now > *floor && (knob == Knob::SeqLength || adapters) {
            kept.push(knob);
        }
        *floor = (*floor).max(now);
    }
    (floors, kept)
}

/// The trainer's command line is a launch memguard recognises (a launcher, a Python script or
/// module, or a trainer command), whether or not it reads its flags.
fn recognised_launch(training: &TrainingPod) -> bool {
    memguard_api::pod::find_launch(training.trainer).is_ok()
}

/// The trainer's command line with the plan's changes to the knobs read from it, in its own
/// flags: a present flag's value replaced in place, `--k=v` appended only where the parser is
/// known to define `k`. Batch and accumulation are written together, so their product holds.
fn rewrite_args(
    training: &TrainingPod,
    planned: &TrainingConfig,
) -> Result<(Option<CommandLine>, Vec<String>), String> {
    use memguard_api::launch::{FlagRules, HfRules};
    let Some(reading) = &training.args else {
        return Ok((None, Vec::new()));
    };
    let before = &training.config;
    if let Some(tune) = &reading.tune {
        return Ok(rewrite_tune(training, reading, tune, planned));
    }
    if let Some(map) = &reading.flag_map {
        return rewrite_mapped(training, reading, map, planned);
    }
    let from_args = |k: &Knob| training.sources.get(k).is_some_and(|s| s == "args");
    // A flag only TrainingArguments defines, or a TRL launch, says the parser is
    // HfArgumentParser: then the flags it defines may be appended (a bespoke argparse script
    // would reject them).
    let hf_trainer = reading.hf_parser;
    // A flag is appended only where its current value is known: an annotation says it, or the
    // parser's default is known. A bespoke script's `TrainingArguments` subclass may default
    // to anything.
    // Checkpointing is the exception: an unknown one is planned off, and turning it on is
    // right whatever it was.
    let known = |k: &Knob| {
        training.annotations.knobs_given.contains(k)
            || reading.defaults.contains_key(k)
            || *k == Knob::GradCheckpointing
    };
    let writable = |knob: &Knob, key: &str| {
        from_args(knob) || (hf_trainer && HfRules.defines(key) && known(knob))
    };
    let flag_of = |k: Knob| {
        memguard_api::pod::HF_FLAGS
            .iter()
            .find(|(knob, _)| *knob == k)
            .map_or("", |(_, f)| *f)
    };
    // Batch and accumulation move together: when the launch carries one of them, it must
    // carry (or be able to take) the other, or the product changes.
    let batch_pair = [Knob::BatchSize, Knob::GradAccumulation].map(|k| writable(&k, flag_of(k)));
    if changes_batch(before, planned) && batch_pair[0] != batch_pair[1] {
        return Err(format!(
            "the effective batch cannot be kept: the plan takes batch {} × accumulation {} to \
             {} × {}, but the launch does not say both (its script's own parser sets the \
             other); give --{} and --{} or annotate memguard.io/batch-size and \
             memguard.io/grad-accumulation",
            before.batch_size,
            before.grad_accumulation,
            planned.batch_size,
            planned.grad_accumulation,
            flag_of(Knob::BatchSize),
            flag_of(Knob::GradAccumulation)
        ));
    }
    let mut edits = Vec::new();
    let mut changed = Vec::new();
    for (knob, key) in memguard_api::pod::HF_FLAGS {
        let writable = writable(knob, key);
        if !writable || knob.value(planned) == knob.value(before) {
            continue;
        }
        let edit = reading
            .flags
            .set(key, &knob.value(planned), &HfRules)
            .map_err(|e| format!("the plan cannot be written in the trainer's flags: {e}"))?;
        let spelled = reading
            .flags
            .get(key)
            .map(|f| f.spelled.clone())
            .unwrap_or_else(|| format!("--{key}"));
        changed.push(format!(
            "{spelled} {}→{}",
            knob.value(before),
            knob.value(planned)
        ));
        edits.push(edit);
    }
    if edits.is_empty() {
        return Ok((None, changed));
    }
    Ok((Some(command_line(training, reading, &edits)), changed))
}

/// The plan in a bespoke script's own flags, named by the policy's flag map for its image: a
/// flag there has its value replaced, an absent one is appended (the map says the script
/// defines it). Batch and accumulation move together or not at all: a map that names only one
/// of them cannot keep the effective batch, and the pod is left unchanged with the reason.
fn rewrite_mapped(
    training: &TrainingPod,
    reading: &memguard_api::pod::ArgsReading,
    map: &[(Knob, String)],
    planned: &TrainingConfig,
) -> Result<(Option<CommandLine>, Vec<String>), String> {
    use memguard_api::launch::MappedRules;
    let before = &training.config;
    let mapped = |k: Knob| map.iter().any(|(m, _)| *m == k);
    let batch_moves = before.batch_size != planned.batch_size
        || before.grad_accumulation != planned.grad_accumulation;
    if batch_moves && !(mapped(Knob::BatchSize) && mapped(Knob::GradAccumulation)) {
        return Err(format!(
            "the effective batch cannot be kept: the plan takes batch {} × accumulation {} to \
             {} × {}, but the policy's flag map for image {} names only one of batch-size and \
             grad-accumulation",
            before.batch_size,
            before.grad_accumulation,
            planned.batch_size,
            planned.grad_accumulation,
            training.trainer.image.as_deref().unwrap_or_default()
        ));
    }
    let bools = map
        .iter()
        .filter(|(k, _)| *k == Knob::GradCheckpointing)
        .map(|(_, f)| f.as_str());
    let rules = MappedRules::new(map.iter().map(|(_, f)| f.as_str()), bools);
    let mut edits = Vec::new();
    let mut changed = Vec::new();
    for (knob, flag) in map {
        if knob.value(planned) == knob.value(before) {
            continue;
        }
        let key = MappedRules::key_of(flag);
        let more = reading
            .flags
            .edits(&key, &knob.value(planned), &rules)
            .map_err(|e| format!("the plan cannot be written in the trainer's flags: {e}"))?;
        changed.push(format!(
            "{flag} {}→{}",
            knob.value(before),
            knob.value(planned)
        ));
        edits.extend(more);
    }
    if edits.is_empty() {
        return Ok((None, changed));
    }
    Ok((Some(command_line(training, reading, &edits)), changed))
}

/// The trainer's `command` and `args` with `edits` to its launch.
fn command_line(
    training: &TrainingPod,
    reading: &memguard_api::pod::ArgsReading,
    edits: &[memguard_api::launch::Edit],
) -> CommandLine {
    let items = reading.launch.apply(&reading.items, edits);
    let change = args_change(training, &reading.items, &items);
    let (command, args) = items.split_at(reading.command_len.min(items.len()));
    let trainer = training.trainer;
    CommandLine {
        command: trainer.command.as_ref().map(|_| command.to_vec()),
        args: trainer
            .args
            .as_ref()
            .map(|_| args.to_vec())
            .or_else(|| (!args.is_empty()).then(|| args.to_vec())),
        change,
    }
}

/// A `tune run`'s plan as trailing `key=value` overrides (the last one of a key replaced in
/// place): OmegaConf takes the later value, and the config itself (a built-in one, or a file
/// in a ConfigMap) is never edited. The LoRA rank is written only to a LoRA model.
fn rewrite_tune(
    training: &TrainingPod,
    reading: &memguard_api::pod::ArgsReading,
    tune: &memguard_api::pod::TuneReading,
    planned: &TrainingConfig,
) -> (Option<CommandLine>, Vec<String>) {
    let before = &training.config;
    let mut edits = Vec::new();
    let mut changed = Vec::new();
    for (knob, key) in memguard_api::pod::TUNE_KEYS {
        let lora_model = matches!(tune.method, Some("lora" | "qlora"));
        if (*knob == Knob::LoraRank && !lora_model) || knob.value(planned) == knob.value(before) {
            continue;
        }
        edits.push(tune.run.set(key, &knob.value(planned)));
        changed.push(format!(
            "{key} {}→{}",
            knob.value(before),
            knob.value(planned)
        ));
    }
    if edits.is_empty() {
        return (None, changed);
    }
    (Some(command_line(training, reading, &edits)), changed)
}

/// The command line before and after the rewrite, for the estimate. A pod that already carries
/// memguard's rewrite (a second admission) keeps the `before` its estimate recorded.
fn args_change(training: &TrainingPod, items: &[String], rewritten: &[String]) -> ArgsChange {
    let now = ArgsChange::new(items, rewritten);
    let earlier = training
        .pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(memguard_api::annotations::ESTIMATE))
        .and_then(|text| EstimateAnnotation::parse(text).ok())
        .and_then(|e| e.args);
    match earlier {
        Some(e) if e.after == now.before => ArgsChange {
            before: e.before,
            cut: e.cut || now.cut,
            ..now
        },
        _ => now,
    }
}

/// Whether `planned` changes the batch or the accumulation of `before`.
fn changes_batch(before: &TrainingConfig, planned: &TrainingConfig) -> bool {
    planned.batch_size != before.batch_size || planned.grad_accumulation != before.grad_accumulation
}

/// The knobs a config-file trainer's overrides set: every knob its file has a key for, unless
/// an annotation or a mapped variable gives it.
fn config_file_knobs(training: &TrainingPod) -> Vec<Knob> {
    let Some(file) = &training.config_file else {
        return Vec::new();
    };
    file.config
        .knobs()
        .into_iter()
        .filter(|k| {
            !training.annotations.knobs_given.contains(k)
                && training
                    .sources
                    .get(k)
                    .is_none_or(|s| s == "args" || *s == file.source)
        })
        .collect()
}

/// The plan written as the config-file trainer's own overrides (axolotl's options,
/// LLaMA-Factory's `key=value`, TRL's flags, LitGPT's `--train.…`), the file never edited.
fn rewrite_config_file(
    training: &TrainingPod,
    file: &memguard_api::pod::ConfigFileReading,
    planned: &TrainingConfig,
    warnings: &mut Vec<String>,
) -> Result<(Option<CommandLine>, Vec<String>), String> {
    let knobs = config_file_knobs(training);
    let before = &training.config;
    if planned.batch_size != before.batch_size
        && let Some((path, deepspeed)) = &file.deepspeed
    {
        match deepspeed {
            Ok(ds) => {
                let pinned = memguard_api::coupled::deepspeed_pinned(ds);
                if !pinned.is_empty() {
                    let pinned = pinned.join(", ");
                    return Err(format!(
                        "the batch cannot be changed: the DeepSpeed config `{path}` that {}'s \
                         config names pins {pinned}; set it to \"auto\" or annotate \
                         memguard.io/batch-size",
                        file.config.trainer.name()
                    ));
                }
            }
            Err(why) => warnings.push(truncate(&format!(
                "memguard: the DeepSpeed config `{path}` was not read ({why}); if it pins the \
                 micro-batch, the batch change conflicts with it"
            ))),
        }
    }
    let (edits, changed) = file
        .config
        .rewrite(&file.doc, &training.config, planned, &knobs)
        .map_err(|e| {
            format!(
                "the plan cannot be written as {}'s overrides: {e}",
                file.config.trainer.name()
            )
        })?;
    if edits.is_empty() {
        return Ok((None, changed));
    }
    let items = file.launch.apply(&file.items, &edits);
    let change = args_change(training, &file.items, &items);
    let (command, args) = items.split_at(file.command_len.min(items.len()));
    let trainer = training.trainer;
    Ok((
        Some(CommandLine {
            command: trainer.command.as_ref().map(|_| command.to_vec()),
            args: trainer
                .args
                .as_ref()
                .map(|_| args.to_vec())
                .or_else(|| (!args.is_empty()).then(|| args.to_vec())),
            change,
        }),
        changed,
    ))
}

/// `batch × accumulation` is kept exactly by the trainer's own variables, or the pod is not
/// changed: when the trainer sets a mapped batch or accumulation variable, both must be mapped
/// and readable (a literal, or an annotation that says the value).
fn keeps_effective_batch(
    training: &TrainingPod,
    policy: &Policy,
    planned: &TrainingConfig,
) -> Result<(), String> {
    let before = &training.config;
    if planned.batch_size == before.batch_size
        && planned.grad_accumulation == before.grad_accumulation
    {
        return Ok(());
    }
    let map = training.env_map(policy);
    let batch = map.get(&Knob::BatchSize);
    let accumulation = map.get(&Knob::GradAccumulation);
    // The trainer's own variables are in play when it sets one (memguard's own writes aside).
    let in_play = [Knob::BatchSize, Knob::GradAccumulation]
        .iter()
        .any(|k| training.set_by_trainer.contains(k));
    if !in_play {
        return Ok(());
    }
    let change = format!(
        "the plan takes batch {} × accumulation {} to {} × {}",
        before.batch_size, before.grad_accumulation, planned.batch_size, planned.grad_accumulation
    );
    match (batch, accumulation) {
        (Some(var), None) | (None, Some(var)) => Err(format!(
            "the effective batch cannot be kept: {change}, but the trainer's variables name only \
             {var}; add the other of batch-size and grad-accumulation to memguard.io/env-map"
        )),
        _ => match training
            .unreadable
            .get(&Knob::GradAccumulation)
            .map(|v| (v, Knob::GradAccumulation))
            .or_else(|| {
                training
                    .unreadable
                    .get(&Knob::BatchSize)
                    .map(|v| (v, Knob::BatchSize))
            }) {
            Some((var, knob)) => Err(format!(
                "the effective batch cannot be kept: {change}, but {var} is set by valueFrom, \
                 which memguard does not read; annotate memguard.io/{} with its value",
                knob.name()
            )),
            None => Ok(()),
        },
    }
}

/// The plan as the pod will carry it: the trainer's `MEMGUARD_*` env, its own variables
/// (env-map), the sidecar, the estimate annotation.
fn render(
    training: &TrainingPod,
    policy: &Policy,
    Decision {
        plan,
        adjust,
        budget,
        affinity,
        verdict,
        mut warnings,
        ..
    }: Decision,
) -> Mutation {
    let trainer = training.trainer;
    // A plan on unread knobs is a guess: none of its values is written, and no verdict is
    // claimed ([`TrainingPod::unknown`]).
    let guessed = !training.guessed().is_empty();
    let verdict = verdict.filter(|_| !guessed);
    let knobs: Vec<Knob> = Knob::of(&plan.config)
        .into_iter()
        .filter(|k| !guessed && !training.unknown.contains_key(k))
        .collect();
    let mut trainer_env: Vec<(String, String)> = knobs
        .iter()
        .map(|k| (k.env().to_string(), k.value(&plan.config)))
        .collect();
    trainer_env.push((env::ESTIMATE_BYTES.into(), plan.total().0.to_string()));
    if let Some(b) = &budget {
        trainer_env.push((env::BUDGET_BYTES.into(), b.bytes.0.to_string()));
    }
    if let Some(verdict) = &verdict {
        // Admitted anyway, at the smallest config tried: a fatal OOM then exits 87, which a
        // Job's podFailurePolicy can turn into FailJob.
        warnings.push(cannot_fit_warning(verdict));
        trainer_env.push((env::CANNOT_FIT.into(), "true".into()));
    }
    if plan.config.device == Device::Cuda && user_alloc_conf(trainer).is_none() {
        trainer_env.push((ALLOC_CONF.into(), EXPANDABLE_SEGMENTS.into()));
    }
    trainer_env.push((env::SIGNAL_FILE.into(), wellknown::SIGNAL_FILE.into()));
    trainer_env.push((
        env::SIDECAR_URL.into(),
        format!("http://{}", wellknown::SIDECAR_LISTEN),
    ));

    // The pod's own env-map, else the policy's: both checked when they were parsed.
    let env_map = training.env_map(policy);
    let user_env: Vec<(String, String)> = env_map
        .iter()
        .filter(|(knob, _)| knobs.contains(knob))
        .map(|(knob, var)| (var.clone(), knob.value(&plan.config)))
        .collect();
    for (var, _) in &user_env {
        let from_ref = trainer
            .env
            .iter()
            .flatten()
            .any(|e| &e.name == var && e.value_from.is_some());
        if from_ref {
            warnings.push(truncate(&format!(
                "memguard: {var} in {} used valueFrom; replaced by a literal value",
                trainer.name
            )));
        }
    }

    let sidecar = sidecar_plan(policy, training, &plan, budget.as_ref(), guessed);
    let client = client_plan(training.pod, training.trainer, policy, &mut warnings);
    let mut estimate = estimate_annotation(&plan, budget.as_ref(), &training.config, &adjust);
    estimate.sources = knob_sources(training);
    estimate.unknown = training
        .unknown
        .iter()
        .map(|(k, why)| (k.name().to_string(), why.clone()))
        .collect();
    if guessed {
        estimate.fits = None;
    }
    estimate.read = training
        .sources
        .keys()
        .map(|k| (k.name().to_string(), k.value(&training.config)))
        .collect();
    Mutation {
        trainer_index: training.trainer_index,
        trainer: trainer.name.clone(),
        budget,
        plan,
        trainer_env,
        user_env,
        command_line: None,
        changed: Vec::new(),
        sidecar,
        estimate,
        warnings,
        error: verdict,
        affinity,
        client,
    }
}

/// The client goes into a trainer that runs Python ([`runs_python`]) unless the policy or the
/// pod (`memguard.io/inject-client: "false"`) opted out. A `PYTHONPATH` from `valueFrom` cannot
/// be prepended to without losing it: then nothing is injected, and a warning says why.
fn client_plan(
    pod: &Pod,
    trainer: &k8s_openapi::api::core::v1::Container,
    policy: &Policy,
    warnings: &mut Vec<String>,
) -> Option<ClientPlan> {
    let opted_out = pod
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(memguard_api::annotations::INJECT_CLIENT))
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("false"));
    if !policy.client_inject || opted_out || !runs_python(trainer) {
        return None;
    }
    let from_ref = trainer
        .env
        .iter()
        .flatten()
        .any(|e| e.name == env::PYTHONPATH && e.value_from.is_some());
    if from_ref {
        warnings.push(truncate(&format!(
            "memguard: {} in {} uses valueFrom; the Python client was not injected",
            env::PYTHONPATH,
            trainer.name
        )));
        return None;
    }
    Some(ClientPlan {
        image: policy.client_image.clone(),
    })
}

fn sidecar_plan(
    policy: &Policy,
    training: &TrainingPod,
    plan: &DowngradePlan,
    budget: Option<&Budget>,
    guessed: bool,
) -> SidecarPlan {
    let cfg = &plan.config;
    let mut env = sidecar_base_env(policy, &training.trainer.name);
    // The knobs the sidecar changes at run time, starting where the plan put them (none
    // when the plan is a guess: the sidecar then starts from its own floor).
    env.extend(
        Knob::RUNTIME
            .into_iter()
            .filter(|k| !guessed && !training.unknown.contains_key(k))
            .map(|k| (k.env().to_string(), k.value(cfg))),
    );
    env.push((env::ESTIMATE_BYTES.into(), plan.total().0.to_string()));
    if let Some(b) = budget {
        env.push((env::BUDGET_BYTES.into(), b.bytes.0.to_string()));
    }
    if !guessed {
        env.push((
            env::SIDECAR_ADMITTED_CONFIG.into(),
            admitted_config(training, cfg),
        ));
    }
    SidecarPlan {
        mode: policy.sidecar_mode,
        image: policy.sidecar_image.clone(),
        resources: policy.sidecar_resources.clone(),
        env,
    }
}

/// What admission planned the trainer at, for the sidecar to compare with what the trainer
/// reports at train start: `knob=value,…` over the knobs it knows (an unknown one is left out).
fn admitted_config(training: &TrainingPod, cfg: &TrainingConfig) -> String {
    let mut knobs = vec![
        (Knob::BatchSize, cfg.batch_size.to_string()),
        (Knob::GradAccumulation, cfg.grad_accumulation.to_string()),
        (Knob::SeqLength, cfg.seq_length.to_string()),
        (
            Knob::GradCheckpointing,
            u8::from(cfg.grad_checkpointing).to_string(),
        ),
    ];
    if cfg.is_adapter() {
        knobs.push((Knob::LoraRank, cfg.lora_rank.to_string()));
    }
    knobs
        .into_iter()
        .filter(|(k, _)| !training.unknown.contains_key(k))
        .map(|(k, v)| format!("{}={v}", k.name()))
        .chain([format!("world-size={}", cfg.world_size.max(1))])
        .collect::<Vec<_>>()
        .join(",")
}

/// The sidecar's env that does not depend on a plan: which container it watches, where it
/// signals and serves, and the policy's thresholds.
fn sidecar_base_env(policy: &Policy, trainer: &str) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = vec![
        (env::TRAINER_CONTAINER.into(), trainer.into()),
        (
            env::SIDECAR_SIGNAL_FILE.into(),
            wellknown::SIGNAL_FILE.into(),
        ),
        (env::SIDECAR_LISTEN.into(), wellknown::SIDECAR_LISTEN.into()),
        (
            env::SIDECAR_METRICS_LISTEN.into(),
            wellknown::SIDECAR_METRICS_LISTEN.into(),
        ),
    ];
    env.extend(
        policy
            .sidecar_env()
            .into_iter()
            .map(|(name, value)| (name.to_string(), value)),
    );
    env
}

/// Each knob's source, when any was read from the trainer's own config, or its launch named the
/// model (else empty: the annotation stays as it was for pods written for memguard).
fn knob_sources(training: &TrainingPod) -> std::collections::BTreeMap<String, String> {
    let setup = training
        .setup_sources
        .iter()
        .map(|(what, source)| (what.to_string(), source.clone()));
    if training.sources.is_empty()
        && training.read_from_args.is_empty()
        && training.read_from_file.is_empty()
    {
        return setup.collect();
    }
    Knob::of(&training.config)
        .into_iter()
        .map(|k| {
            let cited = training.args.as_ref().and_then(|a| a.defaults.get(&k));
            let source = match training.sources.get(&k) {
                Some(read) => read.clone(),
                None if training.annotations.knobs_given.contains(&k) => "annotation".into(),
                None if training.unknown.contains_key(&k) => "unknown".into(),
                None => cited.map_or("default", |c| *c).into(),
            };
            (k.name().to_string(), source)
        })
        .chain(
            training
                .read_from_args
                .iter()
                .map(|what| (what.to_string(), "args".to_string())),
        )
        .chain(
            training
                .read_from_file
                .iter()
                .map(|(what, source)| (what.to_string(), source.clone())),
        )
        .chain(setup)
        .collect()
}

fn estimate_annotation(
    plan: &DowngradePlan,
    budget: Option<&Budget>,
    config: &TrainingConfig,
    adjust: &Adjustments,
) -> EstimateAnnotation {
    let cfg = &plan.config;
    EstimateAnnotation {
        v: ESTIMATE_VERSION,
        total: plan.total(),
        upper: plan.bound.level.map(|_| plan.upper()),
        upper_level: plan.bound.level,
        tensor_peak: plan.calibration.apply(plan.estimate.tensor_peak),
        budget: budget.map(|b| b.bytes),
        fits: budget.map(|_| plan.fits),
        steps: plan
            .steps
            .iter()
            .map(|s| s.rung.name().to_string())
            .collect(),
        device: config.device.name().to_string(),
        gpu_memory: budget
            .filter(|b| b.source != BudgetSource::MemoryLimit)
            .map(|b| b.device_memory),
        budget_source: budget.map(|b| b.source.clone()),
        config: Knob::of(cfg)
            .into_iter()
            .map(|k| (k.name().to_string(), k.value(cfg)))
            .chain([("world-size".to_string(), config.world_size.to_string())])
            .collect(),
        uncalibrated: plan.estimate.total,
        calibration: adjust.calibration.is_active().then_some(adjust.calibration),
        recovery: adjust.recovery.as_ref().map(|r| r.reason.clone()),
        sources: Default::default(),
        unknown: Default::default(),
        read: Default::default(),
        changed: Vec::new(),
        args: None,
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
#[path = "mutate/nodes_tests.rs"]
mod nodes_tests;
