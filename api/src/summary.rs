//! The sidecar's one-line summary, written to its termination-message path at exit and read by
//! the profile controller.

use serde::{Deserialize, Serialize};

/// Kubernetes keeps at most 4096 bytes of a termination message; the summary stays well below.
pub const MAX_SUMMARY_BYTES: usize = 4096;

/// What a run taught: measured peak against the estimate, and what happened on the way.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Schema version (1).
    pub version: u32,
    /// Highest working set (or cgroup peak) seen, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_bytes: Option<u64>,
    /// Highest GPU memory used (NVML or trainer report), bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_peak_bytes: Option<u64>,
    /// Effective limit, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_bytes: Option<u64>,
    /// The webhook's estimate (`MEMGUARD_ESTIMATE_BYTES`), bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimate_bytes: Option<u64>,
    /// Downgrades signalled.
    pub downgrades: u64,
    /// Times the micro-batch was grown back toward the configured one on measured peaks.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub growths: u64,
    /// OOM kills counted in the cgroup during the run.
    pub oom_events: u64,
    /// The phase the trainer last reported before the last OOM kill (`load`, `step`, `save`);
    /// absent when it reported none, never guessed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom_kill_phase: Option<crate::phase::TrainerPhase>,
    /// Highest level reached.
    pub max_level: crate::Level,
    /// Final recommended batch size.
    pub batch_size: u64,
    /// Final recommended gradient accumulation.
    pub grad_accumulation: u64,
    /// OOM records the trainer reported (recovered and fatal).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub oom_reports: u64,
    /// The last OOM record the trainer reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_oom: Option<crate::oom::OomRecord>,
    /// The batch of the sticky downgrade in force at exit (set after an OOM kill or an OOM
    /// record; the trainer, restarted in place or not, never ran above it afterwards).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticky_batch_size: Option<u64>,
    /// The config the trainer reported at train start ([`crate::signal::Report::config`]).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub trainer_config: std::collections::BTreeMap<String, f64>,
    /// The knobs where admission believed otherwise than the trainer reported.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub config_mismatch: Vec<String>,
    /// The plan made at train start on the trainer's reported config, or why none was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_start: Option<crate::train_start::TrainStartPlan>,
    /// Where the memory figures came from at the end: `<kind> via <view>` of
    /// `memguard_sidecar_source_info` (`cgroup-v1 via client-report`: the trainer's client read
    /// its own cgroup for a sidecar that could not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_source: Option<String>,
    /// Why the sidecar stopped (`sigterm`, `trainer-exited`, …).
    pub exit_reason: String,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}
