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
use memguard_api::annotations::PlanOptions;
use memguard_api::estimate::ArgsChange;
use memguard_api::pod::{Dialect, HostKnobs, ResolveError, TrainingPod};
use memguard_api::{Knob, Policy, env, wellknown};
use memguard_decide::decision;
pub use memguard_decide::decision::{
    ALLOC_CONF, EXPANDABLE_SEGMENTS, expandable_segments, user_alloc_conf,
};
use memguard_decide::guarded::{self, Planned};
use memguard_decide::host::HostRewrite;
use memguard_decide::{PodKey, reported};
use memguard_estimator::TrainingConfig;

pub use memguard_decide::warnings::{MAX_WARNING_CHARS, cannot_fit_warning, truncate};

pub use crate::outcome::{
    ClientPlan, CommandLine, Guarded, Mutation, Outcome, SidecarPlan, skipped,
};
use crate::render::{client_plan, render, sidecar_base_env, train_start_env};
pub use crate::watch::view::{ClusterView, ProfileSource};

pub use memguard_decide::budget::{Budget, BudgetSource};

/// Decides what to do with `pod` under `policy`. Never panics, never fails.
pub fn mutate(pod: &Pod, policy: &Policy, profiles: &ClusterView) -> Outcome {
    if !memguard_api::pod::opted_in(pod) {
        return Outcome::Unchanged;
    }
    // The pod's command line is searched once: a server, or the trainer's launch.
    let launched = match crate::serving::admit_launched(pod, policy, profiles) {
        crate::serving::Launched::Server(served) => return served,
        crate::serving::Launched::Trainer(launched) => *launched,
    };
    let python = launched.as_ref().is_some_and(|(_, l)| l.runs_python());
    // Kept for a pod planned on its trainer's report: its launch is searched once.
    let found_launch = launched.clone();
    let training = match TrainingPod::resolve_launched(pod, launched, policy, profiles.cluster()) {
        Ok(training) => training,
        Err(e @ (ResolveError::NoTrainingInput(_) | ResolveError::LaunchModel(_))) => {
            let guarded = GuardedPod {
                python,
                why: e.to_string(),
                launched: found_launch,
            };
            return on_launch_report(pod, policy, profiles, guarded);
        }
        Err(e) => return skipped(e.to_string()),
    };
    match decide(&training, policy, profiles) {
        Ok(mutation) => Outcome::Mutated(Box::new(mutation)),
        Err(error) => skipped(error),
    }
}

/// What admission knows of a pod whose config it cannot read.
struct GuardedPod {
    /// Its trainer runs Python (the client can be injected).
    python: bool,
    /// Why its config cannot be read.
    why: String,
    /// Its launch, as found once.
    launched: Option<(usize, memguard_api::pod::TrainerLaunch)>,
}

/// A pod opted in whose config admission cannot read, planned on what its trainer reported in
/// a past run of the same job (the profile under its launch key,
/// [`memguard_decide::key::launch_key`]) when that report gives everything the estimate needs;
/// else [`guard`]ed, and when a report lacks a value, the reason says which. Its launch is not
/// rewritten (it could not be read): the plan reaches the trainer as `MEMGUARD_*` env, which
/// the injected client applies (re-chunking each batch, the effective batch kept).
fn on_launch_report(
    pod: &Pod,
    policy: &Policy,
    profiles: &ClusterView,
    GuardedPod {
        python,
        why,
        launched,
    }: GuardedPod,
) -> Outcome {
    let Ok(key) = memguard_decide::key::launch_key(pod, policy) else {
        return guard(pod, policy, python, why);
    };
    let found = profiles.adjustments_of(pod.metadata.namespace.as_deref(), &key.spec, &key.name);
    let report = found.as_ref().and_then(|a| a.trainer_report.as_ref());
    match guarded::on_profile_report(pod, policy, profiles.cluster(), &key, report, launched) {
        Planned::NoReport => guard(pod, policy, python, why),
        Planned::Incomplete {
            pod: by,
            why: lacks,
        } => {
            let mut outcome = guard(
                pod,
                policy,
                python,
                format!(
                    "{why}; the trainer's report of {by} (profile {}) cannot be planned on: \
                     {lacks}",
                    key.name
                ),
            );
            if let Outcome::Guarded(g) = &mut outcome {
                g.warnings.push(truncate(&format!(
                    "memguard: not planned on the trainer's report of {by}: {lacks}"
                )));
            }
            outcome
        }
        Planned::OnReport(on, report) => {
            // Nothing but the client applies `MEMGUARD_*` env in a launch memguard cannot read.
            if !python {
                return guard(pod, policy, python, why);
            }
            match decide_on(&on.training, policy, found.clone()) {
                // The sidecar's admitted config is the launch as configured (every knob is the
                // report's: [`memguard_decide::reported::as_configured`]), not the env plan.
                Ok(mut mutation) if mutation.client.is_some() => {
                    mutation.warnings.insert(
                        0,
                        truncate(&format!(
                            "memguard: planned on the trainer's report of {}, launch not read \
                             (profile {})",
                            report.pod, key.name
                        )),
                    );
                    Outcome::Mutated(Box::new(mutation))
                }
                Ok(_) => guard(pod, policy, python, why),
                Err(e) => guard(
                    pod,
                    policy,
                    python,
                    format!(
                        "{why}; the trainer's report of {} could not be planned on: {e}",
                        report.pod
                    ),
                ),
            }
        }
    }
}

/// A pod opted in whose config admission cannot read: a Python trainer is guarded at run time
/// (the sidecar watches its memory, the client follows the signal and recovers from an OOM in
/// process), unless the policy or the pod keeps the client out; anything else is skipped.
fn guard(pod: &Pod, policy: &Policy, python: bool, why: String) -> Outcome {
    let Ok((trainer_index, trainer)) = memguard_api::pod::pod_trainer(pod) else {
        return skipped(why);
    };
    let mut warnings = Vec::new();
    let Some(client) = client_plan(pod, trainer, policy, python, &mut warnings) else {
        return skipped(why);
    };
    let reason = format!(
        "not planned at admission, guarded at run time (the sidecar and the client): {why}"
    );
    warnings.insert(0, truncate(&format!("memguard: {reason}")));
    // The pod's own options apply at train start as they would at admission; one that does
    // not parse is said, and the policy's stands in for it.
    let given = pod.metadata.annotations.clone().unwrap_or_default();
    let options = PlanOptions::parse(&given).unwrap_or_else(|errors| {
        for e in errors {
            warnings.push(truncate(&format!(
                "memguard: memguard.io/{e}; the policy's value is used at train start"
            )));
        }
        PlanOptions::default()
    });
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
            // No per-device budget: admission could not resolve the trainer's device. A CPU
            // trainer is planned against its cgroup limit; a GPU one says it has no budget.
            env: sidecar_base_env(policy, &trainer.name)
                .into_iter()
                .chain([train_start_env(
                    policy,
                    decision::pod_safety_ratio(options.safety_ratio, policy),
                    options.allow_quality,
                    None,
                )])
                .collect(),
        },
        client: Some(client),
        reason,
        warnings,
    }))
}

/// The decision: [`resolve`](TrainingPod::resolve) the pod (its DRA claims read from the
/// profiles' catalog), run the budget stage every caller shares ([`decision::decide`]: key,
/// budget, what past runs taught, placement, plan), [`render`] the result.
fn decide(read: &TrainingPod, policy: &Policy, profiles: &ClusterView) -> Result<Mutation, String> {
    // The profile is looked up once: the key depends on the model, method, precision and
    // device, none of which the trainer's report changes.
    let found = profiles.adjustments(read.pod.metadata.namespace.as_deref(), &PodKey::of(read));
    decide_on(read, policy, found)
}

/// [`decide`] with the pod's profile already found (`None`: no profile).
fn decide_on(
    read: &TrainingPod,
    policy: &Policy,
    found: Option<memguard_decide::Adjustments>,
) -> Result<Mutation, String> {
    let adjustments = |_: &PodKey| found.clone();
    // What the trainer of a past run of this profile reported at train start: the pod is
    // planned on it where admission could not read a knob or read another value
    // ([`memguard_decide::reported`]); the launch is rewritten and rendered as read.
    let on_report = found
        .as_ref()
        .and_then(|a| a.trainer_report.clone())
        .map(|r| reported::on_report(read, &r))
        .filter(reported::OnReport::changes_anything);
    let (planning, training) = match &on_report {
        Some(on) => (&on.planning, &on.admitted),
        None => (read, read),
    };
    // The plan moves only the knobs something applies ([`pinned_floors`]).
    let mut policy_in_play = policy.clone();
    let kept;
    (policy_in_play.floors, kept) = pinned_floors(planning, policy);
    let mut decided = decision::decide(planning, &policy_in_play, adjustments)?;
    // A coupled setting (a DeepSpeed config) pins batch and accumulation: a plan that would
    // change them is made again with them where they are, and says why.
    if let Some(why) = &planning.coupled.batch_pinned
        && changes_batch(&planning.config, &decided.plan.config)
    {
        policy_in_play.floors.batch_size = planning.config.batch_size;
        decided = decision::decide(planning, &policy_in_play, adjustments)?;
        // A start below the config (a pending OOM recovery) still moves them: then nothing
        // is changed.
        if changes_batch(&planning.config, &decided.plan.config) {
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
    // The host plan, on the batch the GPU plan leaves: a guessed launch is left as it is, so
    // its host knobs are not rewritten either.
    let host_knobs = HostKnobs::read(training);
    let guessed = !training.guessed().is_empty();
    let host = {
        let mut knobs = host_knobs.clone();
        if guessed {
            knobs.writable.clear();
        }
        let planned = if guessed {
            &training.config
        } else {
            &decided.plan.config
        };
        memguard_decide::host::plan_host_after(
            training,
            planned,
            &knobs,
            decided.adjust.last_kill_phase,
        )
    };
    let host_rewrites = host.as_ref().map_or(&[][..], |h| h.rewrites.as_slice());
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
        // A knob the trainer ran otherwise than its launch says is rewritten only where the
        // plan moved it from what runs.
        let target = match &on_report {
            Some(on) => on.rewrite_target(&decided.plan.config),
            None => decided.plan.config.clone(),
        };
        keeps_effective_batch(training, policy, &target)?;
        rewrite_launch(training, &target, host_rewrites, &mut file_warnings)?
    };
    let quality_allowed =
        decision::floors(training.annotations.allow_quality, policy).allow_quality;
    let mut mutation = render(training, policy, decided);
    mutation.warnings.extend(file_warnings);
    if let Some(on) = &on_report {
        mutation.warnings.extend(on.warnings.iter().cloned());
    }
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
    if let Some(note) = host.as_ref().and_then(|h| h.after_kill.as_ref()) {
        mutation.warnings.push(truncate(note));
    }
    if let Some(host) = &host {
        // A pod without a limit is warned when its launch gave host knobs: one planned on
        // annotations alone has its figure in the annotation and `explain`, not a warning on
        // every admission.
        // Rewrites are said with the launch's other changes.
        if let Some(warning) = &host.warning
            && host.rewrites.is_empty()
            && (host.limit.is_some() || !host.sources.is_empty())
        {
            mutation.warnings.push(truncate(warning));
        }
        if let Some(verdict) = &host.verdict {
            mutation.error = Some(match mutation.error.take() {
                Some(gpu) => format!("{gpu}; {verdict}"),
                None => verdict.clone(),
            });
            mutation
                .warnings
                .insert(0, truncate(&format!("memguard: {verdict}")));
        }
        let mut annotation = host.annotation(&host_knobs);
        annotation.shm = shm_mount(training, host, &mut mutation.warnings);
        mutation.shm = annotation.shm;
        mutation.estimate.host = Some(annotation);
    }
    mutation.estimate.args = command_line.as_ref().map(|line| line.change.clone());
    mutation.command_line = command_line;
    mutation.estimate.changed = changed.clone();
    mutation.changed = changed;
    Ok(mutation)
}

/// The memory-backed `/dev/shm` a trainer with DataLoader workers gets: its workers hand their
/// batches over through shared memory, and a container's own `/dev/shm` is 64 MiB. Not where the
/// trainer mounts something there itself; skipped, and said, where it would not fit the
/// trainer's `limits.memory` (it is charged there).
fn shm_mount(
    training: &TrainingPod,
    host: &memguard_decide::host::HostPlan,
    warnings: &mut Vec<String>,
) -> Option<memguard_estimator::Bytes> {
    let own = training.trainer.volume_mounts.iter().flatten().any(|m| {
        m.mount_path.trim_end_matches('/') == wellknown::SHM_DIR && m.name != wellknown::SHM_VOLUME
    });
    if own {
        return None;
    }
    let size = host.shm_size()?;
    if let Some(limit) = host.limit
        && size > limit
    {
        warnings.push(truncate(&format!(
            "memguard: /dev/shm not mounted: the workers' batches ({size}) exceed limits.memory              {limit}"
        )));
        return None;
    }
    Some(size)
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
    training.launch.found.is_ok()
}

/// The plan written into the trainer's launch, in the dialect it was read with
/// ([`Dialect`], chosen once by [`memguard_api::pod::TrainerLaunch::dialect`]): the config
/// file's overrides when the launch names one memguard read, else the command line's own words.
fn rewrite_launch(
    training: &TrainingPod,
    planned: &TrainingConfig,
    host: &[HostRewrite],
    warnings: &mut Vec<String>,
) -> Result<(Option<CommandLine>, Vec<String>), String> {
    if let Some(file) = &training.config_file {
        return rewrite_config_file(training, file, planned, warnings);
    }
    let Some(reading) = &training.args else {
        return Ok((None, Vec::new()));
    };
    match (reading.dialect, &reading.tune, &reading.flag_map) {
        (Dialect::Tune, Some(tune), _) => Ok(rewrite_tune(training, reading, tune, planned)),
        (Dialect::Mapped | Dialect::Swift, _, Some(map)) => {
            rewrite_mapped(training, reading, map, planned)
        }
        _ => rewrite_hf(training, reading, planned, host),
    }
}

/// The trainer's command line with the plan's changes to the knobs read from it, in its own
/// flags: a present flag's value replaced in place, `--k=v` appended only where the parser is
/// known to define `k`. Batch and accumulation are written together, so their product holds.
fn rewrite_hf(
    training: &TrainingPod,
    reading: &memguard_api::pod::ArgsReading,
    planned: &TrainingConfig,
    host: &[HostRewrite],
) -> Result<(Option<CommandLine>, Vec<String>), String> {
    use memguard_api::launch::{FlagRules, HfRules};
    let before = &training.config;
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
    // The host plan's rewrites: only knobs it read and whose flag the parser accepts.
    for rewrite in host {
        let edit = reading
            .flags
            .set(rewrite.flag, &rewrite.to, &HfRules)
            .map_err(|e| format!("the host plan cannot be written in the trainer's flags: {e}"))?;
        let spelled = reading
            .flags
            .get(rewrite.flag)
            .map(|f| f.spelled.clone())
            .unwrap_or_else(|| format!("--{}", rewrite.flag));
        changed.push(format!("{spelled} {}→{}", rewrite.from, rewrite.to));
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
        .launch
        .earlier
        .as_ref()
        .and_then(|e| e.args.clone());
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

#[cfg(test)]
mod tests;

#[cfg(test)]
#[path = "mutate/nodes_tests.rs"]
mod nodes_tests;

#[cfg(test)]
#[path = "mutate/budget_tests.rs"]
mod budget_tests;

#[cfg(test)]
#[path = "mutate/placement_tests.rs"]
mod placement_tests;
