//! Environment variables memguard writes into the trainer container (and the sidecar reads).

/// Recommended per-device batch size.
pub const BATCH_SIZE: &str = "MEMGUARD_BATCH_SIZE";
/// Recommended gradient accumulation steps (batch × accumulation = the user's effective batch).
pub const GRAD_ACCUMULATION: &str = "MEMGUARD_GRAD_ACCUMULATION";
/// `true` when gradient checkpointing should be on.
pub const GRAD_CHECKPOINTING: &str = "MEMGUARD_GRAD_CHECKPOINTING";
/// Recommended sequence length.
pub const SEQ_LENGTH: &str = "MEMGUARD_SEQ_LENGTH";
/// Recommended LoRA rank (adapter methods only).
pub const LORA_RANK: &str = "MEMGUARD_LORA_RANK";
/// Recommended number of adapted layers (adapter methods only).
pub const LORA_LAYERS: &str = "MEMGUARD_LORA_LAYERS";
/// `each-batch` when the trainer should reduce-scatter gradients at every micro-batch
/// (Accelerate's `sync_each_batch`), `accumulate` otherwise; written for FSDP pods with
/// several ranks only, where it decides whether accumulated gradients stay sharded.
pub const GRAD_SYNC: &str = "MEMGUARD_GRAD_SYNC";
/// The estimated peak of the final config, in bytes.
pub const ESTIMATE_BYTES: &str = "MEMGUARD_ESTIMATE_BYTES";
/// The budget the plan aimed at, in bytes.
pub const BUDGET_BYTES: &str = "MEMGUARD_BUDGET_BYTES";
/// Path of the signal file on the shared volume.
pub const SIGNAL_FILE: &str = "MEMGUARD_SIGNAL_FILE";
/// URL of the sidecar's trainer API (e.g. `http://127.0.0.1:9091`).
pub const SIDECAR_URL: &str = "MEMGUARD_SIDECAR_URL";
/// `0`/`false` keeps the injected client from attaching itself to a `transformers.Trainer`.
pub const AUTO_ATTACH: &str = "MEMGUARD_AUTO_ATTACH";
/// Python's module search path, which the webhook prepends the client's directory to.
pub const PYTHONPATH: &str = "PYTHONPATH";
/// `pipelined` (default): the Python client's per-step rank agreement overlaps the step (applied
/// one step later, still the same step on every rank); `blocking`: applied at its own step.
pub const AGREEMENT: &str = "MEMGUARD_AGREEMENT";
/// Seconds the Python client's first training step waits for the sidecar's train-start plan
/// (default 2; on timeout it goes on unplanned).
pub const TRAIN_START_WAIT: &str = "MEMGUARD_TRAIN_START_WAIT";
/// Where the trainer writes its OOM record (default [`crate::wellknown::TERMINATION_LOG`]).
pub const TERMINATION_LOG: &str = "MEMGUARD_TERMINATION_LOG";
/// `true` when the webhook admitted the pod with "cannot fit" (retries exhausted or no plan
/// fits): a fatal OOM then exits with [`crate::oom::EXIT_OOM_CANNOT_FIT`].
pub const CANNOT_FIT: &str = "MEMGUARD_CANNOT_FIT";
/// The trainer's memory limit in bytes, passed to the sidecar through the downward API.
pub const TRAINER_MEMORY_LIMIT: &str = "MEMGUARD_TRAINER_MEMORY_LIMIT";
/// The trainer container's name, passed to the sidecar.
pub const TRAINER_CONTAINER: &str = "MEMGUARD_TRAINER_CONTAINER";

/// Sidecar: ratio of the effective limit at which the level becomes `warn` (`--warn`).
pub const SIDECAR_WARN: &str = "MEMGUARD_SIDECAR_WARN";
/// Sidecar: ratio of the effective limit at which the level becomes `downgrade` (`--downgrade`).
pub const SIDECAR_DOWNGRADE: &str = "MEMGUARD_SIDECAR_DOWNGRADE";
/// Sidecar: ratio of the effective limit at which the level becomes `critical` (`--critical`).
pub const SIDECAR_CRITICAL: &str = "MEMGUARD_SIDECAR_CRITICAL";
/// Sidecar: PSI memory `some avg10` percentage counted as `downgrade` pressure
/// (`--psi-threshold`).
pub const SIDECAR_PSI_THRESHOLD: &str = "MEMGUARD_SIDECAR_PSI_THRESHOLD";
/// Sidecar: path of the signal file it writes (`--signal-file`).
pub const SIDECAR_SIGNAL_FILE: &str = "MEMGUARD_SIDECAR_SIGNAL_FILE";
/// Sidecar: sampling interval, e.g. `100ms` (`--interval`; [`crate::duration`]).
pub const SIDECAR_INTERVAL: &str = "MEMGUARD_SIDECAR_INTERVAL";
/// Sidecar: address of the pod-local trainer API (`--listen`, default
/// [`crate::wellknown::SIDECAR_LISTEN`]).
pub const SIDECAR_LISTEN: &str = "MEMGUARD_SIDECAR_LISTEN";
/// Sidecar: address of the metrics endpoint (`--metrics-listen`, default
/// [`crate::wellknown::SIDECAR_METRICS_LISTEN`]).
pub const SIDECAR_METRICS_LISTEN: &str = "MEMGUARD_SIDECAR_METRICS_LISTEN";
/// Sidecar: the trainer's cgroup directory (`--cgroup`).
pub const SIDECAR_CGROUP: &str = "MEMGUARD_SIDECAR_CGROUP";
/// Sidecar: where cgroup hierarchies are mounted (`--cgroup-root`).
pub const SIDECAR_CGROUP_ROOT: &str = "MEMGUARD_SIDECAR_CGROUP_ROOT";
/// Sidecar: the procfs mount (`--proc-root`).
pub const SIDECAR_PROC_ROOT: &str = "MEMGUARD_SIDECAR_PROC_ROOT";
/// Sidecar: starting per-device batch (`--batch-size`; else [`BATCH_SIZE`]).
pub const SIDECAR_BATCH_SIZE: &str = "MEMGUARD_SIDECAR_BATCH_SIZE";
/// Sidecar: starting gradient accumulation (`--grad-accumulation`; else [`GRAD_ACCUMULATION`]).
pub const SIDECAR_GRAD_ACCUMULATION: &str = "MEMGUARD_SIDECAR_GRAD_ACCUMULATION";
/// Sidecar: starting gradient checkpointing (`--grad-checkpointing`; else
/// [`GRAD_CHECKPOINTING`]).
pub const SIDECAR_GRAD_CHECKPOINTING: &str = "MEMGUARD_SIDECAR_GRAD_CHECKPOINTING";
/// Sidecar: least time between two downgrades (`--cooldown`).
pub const SIDECAR_COOLDOWN: &str = "MEMGUARD_SIDECAR_COOLDOWN";
/// Sidecar: how long the figures must allow a lower level before it falls (`--relax-after`).
pub const SIDECAR_RELAX_AFTER: &str = "MEMGUARD_SIDECAR_RELAX_AFTER";
/// Sidecar: a growth reaching the limit within this time is pressure (`--leak-horizon`).
pub const SIDECAR_LEAK_HORIZON: &str = "MEMGUARD_SIDECAR_LEAK_HORIZON";
/// Sidecar: where the summary is written at exit (`--termination-log`).
pub const SIDECAR_TERMINATION_LOG: &str = "MEMGUARD_SIDECAR_TERMINATION_LOG";
/// Sidecar: `json` or `text` logs (`--log-format`).
pub const SIDECAR_LOG_FORMAT: &str = "MEMGUARD_SIDECAR_LOG_FORMAT";
/// Sidecar: exit when the watched cgroup empties (`--exit-when-empty`).
pub const SIDECAR_EXIT_WHEN_EMPTY: &str = "MEMGUARD_SIDECAR_EXIT_WHEN_EMPTY";
/// Sidecar: register kernel events (`--events`).
pub const SIDECAR_EVENTS: &str = "MEMGUARD_SIDECAR_EVENTS";
/// Sidecar: how long to wait for an OOM-killed trainer's in-place restart (`--restart-wait`).
pub const SIDECAR_RESTART_WAIT: &str = "MEMGUARD_SIDECAR_RESTART_WAIT";
/// Sidecar: the pod's `restartPolicy` (`--pod-restart-policy`), written by the webhook: after an
/// OOM death the sidecar waits for an in-place restart only when one can come (`Always`,
/// `OnFailure`), and exits at once under `Never`.
pub const SIDECAR_POD_RESTART_POLICY: &str = "MEMGUARD_SIDECAR_POD_RESTART_POLICY";
/// Sidecar: reset cgroup v1 `memory.max_usage_in_bytes` after each sample (`--reset-v1-peak`).
pub const SIDECAR_RESET_V1_PEAK: &str = "MEMGUARD_SIDECAR_RESET_V1_PEAK";
/// Sidecar: grow the micro-batch back toward the configured one on measured peaks
/// (`--grow-back`, default true).
pub const SIDECAR_GROW_BACK: &str = "MEMGUARD_SIDECAR_GROW_BACK";
/// Sidecar: steps at the current micro-batch before a growth (`--grow-steady-steps`).
pub const SIDECAR_GROW_STEADY_STEPS: &str = "MEMGUARD_SIDECAR_GROW_STEADY_STEPS";
/// Sidecar: least time measured at the current micro-batch before a growth (`--grow-window`).
pub const SIDECAR_GROW_WINDOW: &str = "MEMGUARD_SIDECAR_GROW_WINDOW";

/// Sidecar: what admission planned the trainer at (`--admitted-config`), written by the webhook
/// as `knob=value,…` over [`crate::signal::TRAINER_CONFIG_KNOBS`]: the sidecar compares the
/// config the trainer reports at train start with it (`memguard_sidecar_config_mismatch`).
pub const SIDECAR_ADMITTED_CONFIG: &str = "MEMGUARD_SIDECAR_ADMITTED_CONFIG";

/// Sidecar: what it plans the trainer's reported config against at train start
/// (`--train-start`), written by the webhook as `key=value,…`
/// ([`crate::train_start::TrainStartPolicy`]): a GPU trainer's per-device budget, the safety
/// ratio, the estimate level and the floors. Absent: no train-start plan.
pub const SIDECAR_TRAIN_START: &str = "MEMGUARD_SIDECAR_TRAIN_START";

/// Every `MEMGUARD_SIDECAR_*` variable: one per sidecar flag (a test in the sidecar checks
/// that its flags read exactly these).
pub const SIDECAR_VARS: &[&str] = &[
    SIDECAR_CGROUP,
    SIDECAR_CGROUP_ROOT,
    SIDECAR_PROC_ROOT,
    SIDECAR_SIGNAL_FILE,
    SIDECAR_LISTEN,
    SIDECAR_METRICS_LISTEN,
    SIDECAR_INTERVAL,
    SIDECAR_BATCH_SIZE,
    SIDECAR_GRAD_ACCUMULATION,
    SIDECAR_GRAD_CHECKPOINTING,
    SIDECAR_WARN,
    SIDECAR_DOWNGRADE,
    SIDECAR_CRITICAL,
    SIDECAR_PSI_THRESHOLD,
    SIDECAR_COOLDOWN,
    SIDECAR_RELAX_AFTER,
    SIDECAR_LEAK_HORIZON,
    SIDECAR_TERMINATION_LOG,
    SIDECAR_LOG_FORMAT,
    SIDECAR_EXIT_WHEN_EMPTY,
    SIDECAR_EVENTS,
    SIDECAR_RESTART_WAIT,
    SIDECAR_POD_RESTART_POLICY,
    SIDECAR_RESET_V1_PEAK,
    SIDECAR_ADMITTED_CONFIG,
    SIDECAR_TRAIN_START,
    SIDECAR_GROW_BACK,
    SIDECAR_GROW_STEADY_STEPS,
    SIDECAR_GROW_WINDOW,
];

/// Every variable the webhook may write into the trainer, for docs and checks (the knobs first:
/// a test ties them to [`Knob::ALL`](crate::Knob::ALL)).
pub const TRAINER_VARS: &[&str] = &[
    BATCH_SIZE,
    GRAD_ACCUMULATION,
    GRAD_CHECKPOINTING,
    SEQ_LENGTH,
    LORA_RANK,
    LORA_LAYERS,
    GRAD_SYNC,
    ESTIMATE_BYTES,
    BUDGET_BYTES,
    SIGNAL_FILE,
    SIDECAR_URL,
    CANNOT_FIT,
];

/// Variables the Python client reads that a person sets, not the webhook.
pub const CLIENT_VARS: &[&str] = &[TERMINATION_LOG, AUTO_ATTACH, AGREEMENT, TRAIN_START_WAIT];

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Knob;
    use std::collections::BTreeSet;

    #[test]
    fn the_knobs_come_first_in_the_trainer_vars() {
        let knobs: Vec<&str> = Knob::ALL.iter().map(|k| k.env()).collect();
        assert_eq!(&TRAINER_VARS[..knobs.len()], &knobs[..]);
    }

    /// `memguard_client.env` names exactly the variables the webhook writes into the trainer
    /// and the ones a person sets for the client, each under its own name.
    #[test]
    fn the_python_clients_names_are_the_apis() {
        let python = include_str!("../../clients/python/src/memguard_client/env.py");
        let mut named = BTreeSet::new();
        for line in python.lines() {
            let Some((name, value)) = line.split_once(" = ") else {
                continue;
            };
            let Some(var) = value.trim().strip_prefix("\"MEMGUARD_") else {
                continue;
            };
            let var = var.trim_end_matches('"');
            assert_eq!(name, var, "{line}");
            named.insert(format!("MEMGUARD_{var}"));
        }
        let api: BTreeSet<String> = TRAINER_VARS
            .iter()
            .chain(CLIENT_VARS)
            .map(|v| v.to_string())
            .collect();
        assert_eq!(named, api);
    }
}
