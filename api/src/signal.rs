//! The signal from sidecar to trainer (file on the shared volume and `GET /v1/signal`), and the
//! report from trainer to sidecar (`POST /v1/report`).

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::time::SystemTime;

/// Schema version of [`Signal`]. Bump only on an incompatible change; readers check it.
pub const SIGNAL_VERSION: u32 = 1;

/// How close the trainer is to its limit.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// Comfortably within limits.
    #[default]
    Ok,
    /// Approaching the limit: nothing to do yet.
    Warn,
    /// Shrink now: apply the recommended batch and accumulation at the next step.
    Downgrade,
    /// About to die: shrink immediately, free caches.
    Critical,
}

impl Level {
    /// Lowercase name.
    pub const fn name(self) -> &'static str {
        match self {
            Level::Ok => "ok",
            Level::Warn => "warn",
            Level::Downgrade => "downgrade",
            Level::Critical => "critical",
        }
    }

    /// Numeric value for metrics (0 ok … 3 critical).
    pub const fn as_gauge(self) -> i64 {
        self as i64
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The pressure figures behind a signal. `None`: not known from this source.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Pressure {
    /// Working set / effective limit of the trainer's cgroup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_ratio: Option<f64>,
    /// Working set in bytes (usage − inactive file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_set_bytes: Option<u64>,
    /// Effective limit in bytes (memory.high if set, else memory.max / limit_in_bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_bytes: Option<u64>,
    /// PSI `some avg10` of memory, percent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub psi_some_avg10: Option<f64>,
    /// GPU memory used / total (the most loaded visible device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_ratio: Option<f64>,
    /// Seconds until the limit at the current growth rate, when a steady leak is seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds_to_limit: Option<f64>,
}

/// The signal: what the trainer should run with now, and why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Signal {
    /// [`SIGNAL_VERSION`].
    pub version: u32,
    /// Monotonic sequence number; a reader acts on a signal newer than the last it saw.
    pub seq: u64,
    /// The level.
    pub level: Level,
    /// Recommended per-device batch size (never below 1).
    pub batch_size: u64,
    /// Recommended gradient accumulation (batch × accumulation is kept).
    pub grad_accumulation: u64,
    /// Whether gradient checkpointing should be on.
    pub grad_checkpointing: bool,
    /// Why, for a person.
    pub reason: String,
    /// The figures that led to it.
    pub pressure: Pressure,
    /// When it was issued, RFC 3339 UTC.
    pub timestamp: String,
    /// The sticky downgrade after an out-of-memory error: the knobs the sidecar never relaxes
    /// above for the pod's life. Kept in the signal file so that a restarted sidecar (its
    /// container restarted in place) starts from it; absent before any OOM.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sticky: Option<StickyKnobs>,
}

/// Batch, accumulation and checkpointing of a sticky downgrade ([`Signal::sticky`]): the
/// [`RuntimeKnobs`](crate::knobs::RuntimeKnobs).
pub type StickyKnobs = crate::knobs::RuntimeKnobs;

impl Signal {
    /// The first signal of a run: level ok, the starting config.
    pub fn initial(batch_size: u64, grad_accumulation: u64, grad_checkpointing: bool) -> Signal {
        Signal {
            version: SIGNAL_VERSION,
            seq: 0,
            level: Level::Ok,
            batch_size: batch_size.max(1),
            grad_accumulation: grad_accumulation.max(1),
            grad_checkpointing,
            reason: "starting configuration".into(),
            pressure: Pressure::default(),
            timestamp: now_rfc3339(),
            sticky: None,
        }
    }

    /// Batch × accumulation: the effective batch the trainer must keep.
    pub fn effective_batch(&self) -> u64 {
        self.batch_size.saturating_mul(self.grad_accumulation)
    }
}

/// What the trainer reports about itself (`POST /v1/report`). All figures optional.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    /// `torch`, `mlx`, `jax`, … (free text, bounded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub framework: Option<String>,
    /// Bytes held by live tensors (`torch.cuda.memory_allocated`, `mx.get_active_memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated_bytes: Option<u64>,
    /// Bytes reserved by the allocator (`torch.cuda.memory_reserved`, `mx.get_cache_memory` +
    /// active).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_bytes: Option<u64>,
    /// Peak of live tensors (`torch.cuda.max_memory_allocated`, `mx.get_peak_memory`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_bytes: Option<u64>,
    /// Highest bytes the allocator reserved on the most loaded device so far
    /// (`torch.cuda.max_memory_reserved`): the measured peak the sidecar grows the micro-batch
    /// back on (issue 37, item 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_peak_bytes: Option<u64>,
    /// Device capacity as the framework sees it, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_bytes: Option<u64>,
    /// Training step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// Batch size the step ran with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u64>,
    /// An out-of-memory error the trainer just had, recovered or fatal
    /// ([`crate::oom::OomRecord`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom: Option<crate::oom::OomRecord>,
    /// Growth of the framework's live memory that the trainer's leak check saw rise at every
    /// check of its window (read at step boundaries after releasing the framework cache, e.g.
    /// `memguard_client.mlx.LeakDetector`), in bytes per second. Sent only while a leak is
    /// seen; the sidecar turns it into a time to the limit, like its own working-set rule, and
    /// the sooner of the two counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leak_bytes_per_second: Option<u64>,
    /// The trainer's config as it really runs, read by the client from the trainer's own
    /// objects at train start (issue 37): knob (one of [`TRAINER_CONFIG_KNOBS`]) → value, a
    /// bool as 0 or 1. What admission believed is compared with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<BTreeMap<String, f64>>,
    /// The trainer container's own memory cgroup as the client read it: the sidecar's sample
    /// where it cannot read that cgroup itself (issue 37, item 6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_memory: Option<crate::container_memory::ContainerMemory>,
    /// The phase the trainer is in (`load`, `step`, `save`; anything else is refused): the
    /// sidecar records the last one, and an OOM kill with it (issue 39, item 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<crate::phase::TrainerPhase>,
    /// Checkpoint saves the client put off so far under host-memory pressure (a count since
    /// the trainer started; issue 39, item 3).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saves_deferred: Option<u64>,
}

/// The knobs a trainer reports at train start ([`Report::config`]), by annotation name where
/// one exists: the micro-batch, the accumulation, the sequence it will run (the first
/// micro-batch's padded length), checkpointing, the ranks, the LoRA rank, the model's parameter
/// counts (total and trainable), and what the estimator needs to estimate the step
/// (issue 37, item 2): the model's shape from its config, the parameters' dtype and
/// quantization, the optimizer ([`OPTIMIZER_CODES`]), the loss, mixed precision, attention,
/// sharding and the device. A bool is 0 or 1; a knob not reported is unknown.
pub const TRAINER_CONFIG_KNOBS: [&str; 31] = [
    "batch-size",
    "grad-accumulation",
    "seq-length",
    "grad-checkpointing",
    "world-size",
    "lora-rank",
    // The projections LoRA wraps ([`LORA_TARGET_BITS`]) and whether its dropout is on.
    "lora-targets",
    "lora-dropout",
    "params",
    "trainable-params",
    // The model's shape (`model.config`).
    "hidden-size",
    "num-layers",
    "num-heads",
    "num-kv-heads",
    "head-dim",
    "intermediate-size",
    "vocab-size",
    "num-experts",
    "tie-embeddings",
    "gated-ffn",
    // How it trains.
    "param-bits",
    "quant-bits",
    "optimizer",
    "fused-loss",
    "bf16",
    "fp16",
    "flash-attention",
    "gpu",
    "fsdp",
    "deepspeed-stage",
    // Ranks in this container (torchrun's `LOCAL_WORLD_SIZE`): they share its memory limit.
    "local-ranks",
];

/// The optimizers a trainer reports as `optimizer` (the value is the index here), by the
/// estimator's names (`memguard_estimator::Optimizer`): a number, like every knob.
pub const OPTIMIZER_CODES: [&str; 7] = [
    "adamw",
    "adam",
    "sgd",
    "sgd-momentum",
    "adafactor",
    "adamw-8bit",
    "adamw-8bit-torchao",
];

/// The projections a trainer reports as `lora-targets`: bit `i` (value `1 << i`) set when
/// LoRA wraps the projection named here in every block, by the estimator's names
/// (`memguard_estimator::LoraTargets`; `q_proj` … `down_proj` in transformers' Llama family).
pub const LORA_TARGET_BITS: [&str; 7] = ["q", "k", "v", "o", "gate", "up", "down"];

/// `knob=value,…` ([`crate::env::SIDECAR_ADMITTED_CONFIG`]): the known knobs, the rest named
/// as refused (an unknown knob, a value that is not a non-negative number).
pub fn parse_admitted_config(text: &str) -> (BTreeMap<String, f64>, Vec<String>) {
    let mut knobs = BTreeMap::new();
    let mut refused = Vec::new();
    for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let parsed = item.split_once('=').and_then(|(k, v)| {
            let k = k.trim();
            let v: f64 = v.trim().parse().ok()?;
            (TRAINER_CONFIG_KNOBS.contains(&k) && v.is_finite() && v >= 0.0).then_some((k, v))
        });
        match parsed {
            Some((k, v)) => {
                knobs.insert(k.to_string(), v);
            }
            None => refused.push(item.to_string()),
        }
    }
    (knobs, refused)
}

impl Report {
    /// Refuses figures that cannot be: a zero device capacity, or more memory in use (allocated,
    /// reserved or peak) than the device has. Such a report would otherwise drive the GPU ratio
    /// past 1 and downgrade a healthy trainer.
    pub fn check(&self) -> Result<(), String> {
        for (k, v) in self.config.iter().flatten() {
            if !TRAINER_CONFIG_KNOBS.contains(&k.as_str()) {
                return Err(format!(
                    "config: unknown knob `{}` (known: {})",
                    k.chars().take(40).collect::<String>(),
                    TRAINER_CONFIG_KNOBS.join(", ")
                ));
            }
            if !v.is_finite() || *v < 0.0 {
                return Err(format!("config: {k} is {v}, not a non-negative number"));
            }
        }
        if let Some(c) = &self.container_memory {
            c.check()?;
        }
        let Some(total) = self.total_bytes else {
            return Ok(());
        };
        if total == 0 {
            return Err("total_bytes is 0".into());
        }
        for (name, v) in [
            ("allocated_bytes", self.allocated_bytes),
            ("reserved_bytes", self.reserved_bytes),
            ("peak_bytes", self.peak_bytes),
            ("reserved_peak_bytes", self.reserved_peak_bytes),
        ] {
            if let Some(v) = v.filter(|&v| v > total) {
                return Err(format!("{name} {v} exceeds total_bytes {total}"));
            }
        }
        Ok(())
    }
}

/// Now, as RFC 3339 UTC with milliseconds.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_round_trips_through_the_fixture() {
        let text = include_str!("../fixtures/signal-v1.json");
        let signal: Signal = serde_json::from_str(text).expect("fixture parses");
        assert_eq!(signal.version, SIGNAL_VERSION);
        assert_eq!(signal.level, Level::Downgrade);
        assert_eq!(signal.effective_batch(), 32);
        let again: Signal =
            serde_json::from_str(&serde_json::to_string(&signal).expect("serializes"))
                .expect("re-parses");
        assert_eq!(again, signal);
    }

    #[test]
    fn a_reported_config_takes_known_knobs_only() {
        let ok: Report =
            serde_json::from_str(r#"{"config": {"batch-size": 16, "seq-length": 4096}}"#)
                .expect("parses");
        assert_eq!(ok.check(), Ok(()));
        let bad: Report =
            serde_json::from_str(r#"{"config": {"batch_size": 16}}"#).expect("parses");
        assert!(
            bad.check()
                .is_err_and(|e| e.contains("unknown knob `batch_size`"))
        );
        let negative: Report =
            serde_json::from_str(r#"{"config": {"batch-size": -1}}"#).expect("parses");
        assert!(negative.check().is_err());
        let (knobs, refused) =
            parse_admitted_config("batch-size=2, seq-length=4096,x=1,lora-rank=a");
        assert_eq!(knobs.len(), 2);
        assert_eq!(refused, ["x=1", "lora-rank=a"]);
    }

    #[test]
    fn a_reported_phase_is_load_step_or_save_and_nothing_else() {
        let save: Report = serde_json::from_str(r#"{"step": 7, "phase": "save"}"#).expect("parses");
        assert_eq!(save.phase, Some(crate::phase::TrainerPhase::Save));
        let err = serde_json::from_str::<Report>(r#"{"phase": "eval"}"#)
            .expect_err("an unknown phase is refused");
        assert!(err.to_string().contains("unknown variant `eval`"), "{err}");
        assert!(serde_json::from_str::<Report>(r#"{"phase": 2}"#).is_err());
        let none: Report = serde_json::from_str(r#"{"step": 7}"#).expect("parses");
        assert_eq!(none.phase, None);
    }

    #[test]
    fn report_round_trips_through_the_fixture() {
        let text = include_str!("../fixtures/report-v1.json");
        let report: Report = serde_json::from_str(text).expect("fixture parses");
        assert_eq!(report.framework.as_deref(), Some("mlx"));
        assert_eq!(report.leak_bytes_per_second, Some(1 << 20));
        assert_eq!(report.reserved_bytes, Some(7_516_192_768));
        let again: Report =
            serde_json::from_str(&serde_json::to_string(&report).expect("serializes"))
                .expect("re-parses");
        assert_eq!(again, report);
    }

    /// Found by cargo-fuzz (signal_report): serde_json's default float parser is not exact, so a
    /// ratio written as `4.444444444444444e49` was read back one ULP off, and a restarted
    /// sidecar's signal did not read back as what it wrote. `float_roundtrip` makes it exact.
    #[test]
    fn a_signal_reads_back_bit_for_bit_what_was_written() {
        let text = include_str!("../fixtures/signal-v1.json");
        let mut signal: Signal = serde_json::from_str(text).expect("fixture parses");
        let written = r#"{"memory_ratio": 44444444444444444444444444444444444444444444444440, "working_set_bytes": 1, "limit_bytes": 1}"#;
        signal.pressure = serde_json::from_str(written).expect("pressure parses");
        for _ in 0..3 {
            let again: Signal =
                serde_json::from_str(&serde_json::to_string(&signal).expect("serializes"))
                    .expect("re-parses");
            assert_eq!(again, signal);
            signal = again;
        }
    }

    #[test]
    fn report_rejects_unknown_fields() {
        assert!(serde_json::from_str::<Report>(r#"{"allocated": 1}"#).is_err());
        let r: Report = serde_json::from_str(r#"{"allocated_bytes": 1, "step": 3}"#).expect("ok");
        assert_eq!(r.allocated_bytes, Some(1));
    }

    #[test]
    fn a_report_of_more_than_the_device_holds_is_refused() {
        let ok = Report {
            allocated_bytes: Some(10),
            reserved_bytes: Some(20),
            peak_bytes: Some(15),
            total_bytes: Some(20),
            ..Report::default()
        };
        assert_eq!(ok.check(), Ok(()));
        assert_eq!(
            Report::default().check(),
            Ok(()),
            "no capacity, nothing to compare"
        );
        let over = Report {
            reserved_bytes: Some(21),
            ..ok.clone()
        };
        assert_eq!(
            over.check(),
            Err("reserved_bytes 21 exceeds total_bytes 20".into())
        );
        let zero = Report {
            total_bytes: Some(0),
            ..Report::default()
        };
        assert!(zero.check().is_err());
    }

    #[test]
    fn levels_order_by_severity() {
        assert!(Level::Ok < Level::Warn && Level::Warn < Level::Downgrade);
        assert!(Level::Downgrade < Level::Critical);
        assert_eq!(
            serde_json::to_string(&Level::Critical).expect("ok"),
            "\"critical\""
        );
    }
}
