//! Command-line flags and environment: every flag is also `MEMGUARD_SIDECAR_<FLAG>` (the names
//! are [`memguard_api::env`]'s, which the webhook writes); the starting batch, accumulation and
//! checkpointing default from the trainer's own `MEMGUARD_*` variables.

use clap::{CommandFactory, FromArgMatches, Parser};
pub use memguard_api::duration::parse_duration;
use memguard_api::env;
use memguard_api::policy::Thresholds;
use memguard_api::wellknown;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// Largest starting batch accepted (the downgrade searches divisors below it).
pub const MAX_BATCH: u64 = 1 << 20;

/// Log output format (shared with the webhook).
pub use memguard_runtime::LogFormat;

/// A pod's `restartPolicy`, spelt as Kubernetes spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PodRestartPolicy {
    /// Every container is restarted whenever it ends (Kubernetes' default).
    #[value(name = "Always")]
    Always,
    /// A container is restarted when it fails (an OOM kill is a failure).
    #[value(name = "OnFailure")]
    OnFailure,
    /// No container is ever restarted.
    #[value(name = "Never")]
    Never,
}

impl PodRestartPolicy {
    /// Whether a container that died of an OOM kill (a failure) is restarted in place.
    pub fn restarts_after_failure(self) -> bool {
        self != PodRestartPolicy::Never
    }
}

/// The flags of `memguard-sidecar`.
#[derive(Debug, Clone, Parser)]
#[command(name = "memguard-sidecar", version, about = "memguard per-pod sidecar")]
pub struct Args {
    /// The trainer's cgroup directory (a cgroup v1 memory dir or a v2 dir). Default: the trainer
    /// found through the shared process namespace, else this process's own cgroup.
    #[arg(long, env = env::SIDECAR_CGROUP)]
    pub cgroup: Option<PathBuf>,
    /// Where cgroup hierarchies are mounted (used when --cgroup is not given).
    #[arg(
        long,
        env = env::SIDECAR_CGROUP_ROOT,
        default_value = "/sys/fs/cgroup"
    )]
    pub cgroup_root: PathBuf,
    /// procfs mount (trainer discovery and the RSS fallback).
    #[arg(long, env = env::SIDECAR_PROC_ROOT, default_value = "/proc")]
    pub proc_root: PathBuf,
    /// The signal file, replaced atomically.
    #[arg(long, env = env::SIDECAR_SIGNAL_FILE, default_value = wellknown::SIGNAL_FILE)]
    pub signal_file: PathBuf,
    /// Trainer API address (pod-local).
    #[arg(long, env = env::SIDECAR_LISTEN, default_value = wellknown::SIDECAR_LISTEN)]
    pub listen: SocketAddr,
    /// Metrics address (serves only /metrics and /healthz).
    #[arg(long, env = env::SIDECAR_METRICS_LISTEN, default_value = wellknown::SIDECAR_METRICS_LISTEN)]
    pub metrics_listen: SocketAddr,
    /// Sampling interval (`100ms`, `1s`).
    #[arg(long, env = env::SIDECAR_INTERVAL, default_value = "100ms", value_parser = parse_duration)]
    pub interval: Duration,
    /// Starting per-device batch size (default: MEMGUARD_BATCH_SIZE, else 1).
    #[arg(long, env = env::SIDECAR_BATCH_SIZE)]
    pub batch_size: Option<u64>,
    /// Starting gradient accumulation (default: MEMGUARD_GRAD_ACCUMULATION, else 1).
    #[arg(long, env = env::SIDECAR_GRAD_ACCUMULATION)]
    pub grad_accumulation: Option<u64>,
    /// Starting gradient checkpointing (default: MEMGUARD_GRAD_CHECKPOINTING, else false).
    #[arg(long, env = env::SIDECAR_GRAD_CHECKPOINTING, value_parser = parse_bool)]
    pub grad_checkpointing: Option<bool>,
    /// What admission planned the trainer at, `knob=value,…` (the webhook writes it): compared
    /// with the config the trainer reports at train start.
    #[arg(long, env = env::SIDECAR_ADMITTED_CONFIG, default_value = "")]
    pub admitted_config: String,
    /// What the trainer's reported config is planned against at train start, `key=value,…`
    /// (the webhook writes it: a GPU trainer's per-device budget, the safety ratio, the
    /// estimate level, the floors). Absent: no train-start plan, and the summary says why.
    #[arg(long, env = env::SIDECAR_TRAIN_START, value_parser = parse_train_start)]
    pub train_start: Option<memguard_api::train_start::TrainStartPolicy>,
    /// Grow the micro-batch back toward the trainer's configured one when the peaks measured at
    /// the current one show room (never above the configured one; see docs/sidecar.md).
    #[arg(long, env = env::SIDECAR_GROW_BACK, default_value = "true", value_parser = parse_bool, action = clap::ArgAction::Set)]
    pub grow_back: bool,
    /// Steps the trainer must report at the current micro-batch, at level ok, before a growth.
    #[arg(long, env = env::SIDECAR_GROW_STEADY_STEPS, default_value = "4")]
    pub grow_steady_steps: u64,
    /// Least time measured at the current micro-batch before a growth (`2s`).
    #[arg(long, env = env::SIDECAR_GROW_WINDOW, default_value = "2s", value_parser = parse_duration)]
    pub grow_window: Duration,
    /// Warn at this ratio of the effective limit.
    #[arg(long, env = env::SIDECAR_WARN)]
    pub warn: Option<f64>,
    /// Downgrade at this ratio of the effective limit.
    #[arg(long, env = env::SIDECAR_DOWNGRADE)]
    pub downgrade: Option<f64>,
    /// Critical at this ratio of the effective limit.
    #[arg(long, env = env::SIDECAR_CRITICAL)]
    pub critical: Option<f64>,
    /// PSI memory `some avg10` percentage that counts as downgrade pressure.
    #[arg(long, env = env::SIDECAR_PSI_THRESHOLD)]
    pub psi_threshold: Option<f64>,
    /// Least time between two downgrades (entering critical skips it once).
    #[arg(long, env = env::SIDECAR_COOLDOWN, default_value = "30s", value_parser = parse_duration)]
    pub cooldown: Duration,
    /// How long the figures must allow a lower level before the level falls (no flapping).
    #[arg(long, env = env::SIDECAR_RELAX_AFTER, default_value = "5s", value_parser = parse_duration)]
    pub relax_after: Duration,
    /// A steady growth that reaches the limit within this time counts as downgrade pressure.
    #[arg(long, env = env::SIDECAR_LEAK_HORIZON, default_value = "60s", value_parser = parse_duration)]
    pub leak_horizon: Duration,
    /// Where the one-line JSON summary is written at exit.
    #[arg(long, env = env::SIDECAR_TERMINATION_LOG, default_value = wellknown::TERMINATION_LOG)]
    pub termination_log: PathBuf,
    /// Log format.
    #[arg(
        long,
        env = env::SIDECAR_LOG_FORMAT,
        value_enum,
        default_value = "json"
    )]
    pub log_format: LogFormat,
    /// Exit (writing the summary) when the watched cgroup empties after having held a process;
    /// after an OOM death, only once no restarted trainer appeared within `--restart-wait`.
    #[arg(long, env = env::SIDECAR_EXIT_WHEN_EMPTY, default_value = "true", value_parser = parse_bool, action = clap::ArgAction::Set)]
    pub exit_when_empty: bool,
    /// Register kernel events (cgroup v1 thresholds, PSI triggers, inotify); the poll always runs.
    #[arg(long, env = env::SIDECAR_EVENTS, default_value = "true", value_parser = parse_bool, action = clap::ArgAction::Set)]
    pub events: bool,
    /// After the trainer died of an OOM (a kill counted, or a fatal OOM it reported), how long
    /// to wait for its in-place restart (`restartPolicy: OnFailure`/`Always`) before exiting.
    /// The kubelet's restart back-off is at most 5 minutes.
    #[arg(long, env = env::SIDECAR_RESTART_WAIT, default_value = "330s", value_parser = parse_duration)]
    pub restart_wait: Duration,
    /// The pod's `restartPolicy`, which the webhook writes: under `Never` no in-place restart
    /// can come, so the sidecar exits at once after an OOM death instead of waiting
    /// `--restart-wait`. Left out: `Always`, Kubernetes' own default.
    #[arg(long, env = env::SIDECAR_POD_RESTART_POLICY, value_enum, default_value = "Always")]
    pub pod_restart_policy: PodRestartPolicy,
    /// cgroup v1: reset `memory.max_usage_in_bytes` after each sample, for the exact peak
    /// between samples. Off by default: the counter is global (cAdvisor exports it as
    /// `container_memory_max_usage_bytes`), and resetting it rewrites everyone's peak.
    #[arg(long, env = env::SIDECAR_RESET_V1_PEAK, default_value = "false", value_parser = parse_bool, action = clap::ArgAction::Set)]
    pub reset_v1_peak: bool,
}

impl Args {
    /// The flags from `argv` (program name first), each one not given there taken from its
    /// `MEMGUARD_SIDECAR_*` variable read through `lookup`, else its default. `main` passes the
    /// process's environment; tests pass a map, so they see exactly what a pod would.
    pub fn from_env<I, T>(
        argv: I,
        lookup: &impl Fn(&str) -> Option<String>,
    ) -> Result<Args, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString>,
    {
        let mut argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
        if argv.is_empty() {
            argv.push("memguard-sidecar".into());
        }
        let command = Args::command();
        // Variables first, the command line after: with `args_override_self` the later
        // occurrence of a flag wins, so a flag beats its variable, as clap's own `env` does.
        let from_env = command.get_arguments().filter_map(|arg| {
            let value = lookup(arg.get_env()?.to_str()?)?;
            Some(OsString::from(format!("--{}={value}", arg.get_long()?)))
        });
        let full: Vec<OsString> = argv[..1]
            .iter()
            .cloned()
            .chain(from_env)
            .chain(argv[1..].iter().cloned())
            .collect();
        let matches = command
            .clone()
            .args_override_self(true)
            .mut_args(|arg| arg.env(None::<&str>))
            .try_get_matches_from(full)
            .map_err(|e| match e.kind() {
                // Help and version from the command as declared: the help lists the variables.
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion => {
                    command.try_get_matches_from(&argv).err().unwrap_or(e)
                }
                _ => e,
            })?;
        Args::from_arg_matches(&matches)
    }
}

/// The resolved configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The flags as given.
    pub args: Args,
    /// Starting batch size (≥ 1).
    pub batch_size: u64,
    /// Starting gradient accumulation (≥ 1).
    pub grad_accumulation: u64,
    /// Starting gradient checkpointing.
    pub grad_checkpointing: bool,
    /// Thresholds (validated).
    pub thresholds: Thresholds,
    /// The webhook's estimate (`MEMGUARD_ESTIMATE_BYTES`).
    pub estimate_bytes: Option<u64>,
    /// The trainer's limit from the downward API (`MEMGUARD_TRAINER_MEMORY_LIMIT`).
    pub trainer_memory_limit: Option<u64>,
    /// `NVIDIA_VISIBLE_DEVICES`: the pod's GPUs.
    pub nvidia_visible_devices: Option<String>,
}

/// A configuration problem (exit code 64).
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    /// A variable holds something that does not parse.
    #[error("{name}: {value:?} is not {expected}")]
    Invalid {
        /// Variable or flag.
        name: String,
        /// What it held.
        value: String,
        /// What was expected.
        expected: &'static str,
    },
    /// Thresholds out of order.
    #[error("thresholds: {0}")]
    Thresholds(String),
}

impl Config {
    /// Resolves flags against the trainer's `MEMGUARD_*` variables, read through `lookup` (tests
    /// pass a map; `main` passes `std::env::var`).
    pub fn resolve(
        args: Args,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let num = |name: &str| -> Result<Option<u64>, ConfigError> {
            match lookup(name) {
                None => Ok(None),
                Some(v) if v.trim().is_empty() => Ok(None),
                Some(v) => v
                    .trim()
                    .parse::<u64>()
                    .map(Some)
                    .map_err(|_| ConfigError::Invalid {
                        name: name.into(),
                        value: v,
                        expected: "a whole number",
                    }),
            }
        };
        let positive = |name: &str, v: Option<u64>| -> Result<u64, ConfigError> {
            match v {
                None => Ok(1),
                Some(n) if (1..=MAX_BATCH).contains(&n) => Ok(n),
                Some(n) => Err(ConfigError::Invalid {
                    name: name.into(),
                    value: n.to_string(),
                    expected: "between 1 and 1048576",
                }),
            }
        };
        let batch_size = positive("--batch-size", args.batch_size.or(num(env::BATCH_SIZE)?))?;
        let grad_accumulation = positive(
            "--grad-accumulation",
            args.grad_accumulation.or(num(env::GRAD_ACCUMULATION)?),
        )?;
        let grad_checkpointing = match args.grad_checkpointing {
            Some(b) => b,
            None => match lookup(env::GRAD_CHECKPOINTING) {
                None => false,
                Some(v) if v.trim().is_empty() => false,
                Some(v) => parse_bool(&v).map_err(|_| ConfigError::Invalid {
                    name: env::GRAD_CHECKPOINTING.into(),
                    value: v,
                    expected: "true or false",
                })?,
            },
        };
        let d = Thresholds::default();
        let thresholds = Thresholds {
            warn: args.warn.unwrap_or(d.warn),
            downgrade: args.downgrade.unwrap_or(d.downgrade),
            critical: args.critical.unwrap_or(d.critical),
            psi_some_avg10: args.psi_threshold.unwrap_or(d.psi_some_avg10),
        };
        thresholds.validate().map_err(ConfigError::Thresholds)?;
        let estimate_bytes = num(env::ESTIMATE_BYTES)?;
        let trainer_memory_limit = num(env::TRAINER_MEMORY_LIMIT)?.filter(|&n| n > 0);
        if args.interval.is_zero() {
            return Err(ConfigError::Invalid {
                name: "--interval".into(),
                value: "0".into(),
                expected: "more than 0",
            });
        }
        Ok(Config {
            args,
            batch_size,
            grad_accumulation,
            grad_checkpointing,
            thresholds,
            estimate_bytes,
            trainer_memory_limit,
            nvidia_visible_devices: lookup(crate::sample::gpu::NVIDIA_VISIBLE_DEVICES),
        })
    }
}

/// `--train-start`: [`memguard_api::train_start::TrainStartPolicy::parse`].
fn parse_train_start(s: &str) -> Result<memguard_api::train_start::TrainStartPolicy, String> {
    memguard_api::train_start::TrainStartPolicy::parse(s)
}

/// `true|false|1|0|yes|no|on|off`, any case.
pub fn parse_bool(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        other => Err(format!("{other:?} is not true or false")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn args(extra: &[&str]) -> Args {
        let mut v = vec!["memguard-sidecar"];
        v.extend_from_slice(extra);
        Args::try_parse_from(v).expect("flags parse")
    }

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn defaults_match_the_contract() {
        let c = Config::resolve(args(&[]), env_of(&[])).expect("valid");
        assert_eq!(c.args.signal_file, PathBuf::from(wellknown::SIGNAL_FILE));
        assert_eq!(c.args.listen.to_string(), wellknown::SIDECAR_LISTEN);
        assert_eq!(
            c.args.metrics_listen.to_string(),
            wellknown::SIDECAR_METRICS_LISTEN
        );
        assert_eq!(c.args.interval, Duration::from_millis(100));
        assert_eq!(
            c.args.termination_log,
            PathBuf::from(wellknown::TERMINATION_LOG)
        );
        assert_eq!(
            (c.batch_size, c.grad_accumulation, c.grad_checkpointing),
            (1, 1, false)
        );
        assert_eq!(c.thresholds, Thresholds::default());
    }

    #[test]
    fn starting_values_come_from_the_trainer_env_unless_flags_say_otherwise() {
        let env = [
            (env::BATCH_SIZE, "8"),
            (env::GRAD_ACCUMULATION, "4"),
            (env::GRAD_CHECKPOINTING, "true"),
            (env::ESTIMATE_BYTES, "1000"),
        ];
        let c = Config::resolve(args(&[]), env_of(&env)).expect("valid");
        assert_eq!(
            (c.batch_size, c.grad_accumulation, c.grad_checkpointing),
            (8, 4, true)
        );
        assert_eq!(c.estimate_bytes, Some(1000));
        let c = Config::resolve(
            args(&["--batch-size", "16", "--grad-checkpointing", "false"]),
            env_of(&env),
        )
        .expect("valid");
        assert_eq!(
            (c.batch_size, c.grad_accumulation, c.grad_checkpointing),
            (16, 4, false)
        );
    }

    #[test]
    fn bad_values_are_named() {
        let e = Config::resolve(args(&[]), env_of(&[(env::BATCH_SIZE, "eight")]))
            .expect_err("not a number");
        assert!(e.to_string().contains(env::BATCH_SIZE), "{e}");
        assert!(Config::resolve(args(&["--batch-size", "0"]), env_of(&[])).is_err());
        let e = Config::resolve(args(&["--warn", "0.9", "--downgrade", "0.8"]), env_of(&[]))
            .expect_err("out of order");
        assert!(matches!(e, ConfigError::Thresholds(_)));
        assert!(Args::try_parse_from(["x", "--interval", "soon"]).is_err());
        let a = args(&["--events", "false", "--exit-when-empty", "no"]);
        assert!(!a.events && !a.exit_when_empty);
        let a = args(&[]);
        assert!(a.events && a.exit_when_empty);
    }

    #[test]
    fn every_flag_reads_its_variable_from_the_contract() {
        let mut read: Vec<String> = Args::command()
            .get_arguments()
            .filter_map(|a| a.get_env().map(|e| e.to_string_lossy().into_owned()))
            .collect();
        read.sort();
        let mut contract: Vec<String> = env::SIDECAR_VARS.iter().map(|v| v.to_string()).collect();
        contract.sort();
        assert_eq!(read, contract);
        let flags = Args::command()
            .get_arguments()
            .filter(|a| a.get_long().is_some())
            .count();
        assert_eq!(flags, contract.len(), "every flag has a variable");
    }

    #[test]
    fn variables_come_through_the_lookup_and_flags_beat_them() {
        let vars = env_of(&[
            (env::SIDECAR_INTERVAL, "250ms"),
            (env::SIDECAR_WARN, "0.6"),
            (env::SIDECAR_EVENTS, "false"),
            (env::SIDECAR_LISTEN, "127.0.0.1:7001"),
        ]);
        let a = Args::from_env(["memguard-sidecar"], &vars).expect("valid");
        assert_eq!(a.interval, Duration::from_millis(250));
        assert_eq!(a.warn, Some(0.6));
        assert!(!a.events);
        assert_eq!(a.listen.to_string(), "127.0.0.1:7001");
        assert_eq!(a.cooldown, Duration::from_secs(30), "unset: the default");
        let a = Args::from_env(
            ["memguard-sidecar", "--interval", "1s", "--events=true"],
            &vars,
        )
        .expect("valid");
        assert_eq!((a.interval, a.events), (Duration::from_secs(1), true));
        let typo = env_of(&[(env::SIDECAR_INTERVAL, "10 parsecs")]);
        let e = Args::from_env(["memguard-sidecar"], &typo).expect_err("not a duration");
        assert!(e.to_string().contains("--interval"), "{e}");
    }

    #[test]
    fn the_pod_restart_policy_decides_whether_a_restart_can_come() {
        assert_eq!(args(&[]).pod_restart_policy, PodRestartPolicy::Always);
        let of = |v: &str| {
            Args::from_env(
                ["memguard-sidecar"],
                &env_of(&[(env::SIDECAR_POD_RESTART_POLICY, v)]),
            )
            .map(|a| a.pod_restart_policy.restarts_after_failure())
        };
        assert_eq!(of("Always").ok(), Some(true));
        assert_eq!(of("OnFailure").ok(), Some(true));
        assert_eq!(of("Never").ok(), Some(false));
        let e = of("Sometimes").expect_err("not a restart policy");
        assert!(e.to_string().contains("--pod-restart-policy"), "{e}");
    }

    #[test]
    fn durations_and_booleans_parse() {
        assert_eq!(parse_duration("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert!(parse_duration("fast").is_err());
        assert_eq!(parse_bool("TRUE"), Ok(true));
        assert_eq!(parse_bool("0"), Ok(false));
        assert!(parse_bool("maybe").is_err());
    }
}
