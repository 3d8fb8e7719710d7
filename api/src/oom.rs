//! The OOM record: what the trainer leaves behind when it runs out of memory.
//!
//! The Python client writes it (`memguard_client.oom.record`) in two places:
//!
//! * in a report to the sidecar (`POST /v1/report` with `{"oom": {…}}`), on every OOM, recovered
//!   in-process or fatal; the sidecar counts it, applies a sticky downgrade and carries it in its
//!   termination summary;
//! * when fatal, as the one-line JSON termination message of the trainer container
//!   (`/dev/termination-log`, or [`crate::env::TERMINATION_LOG`]), after which the process exits
//!   with [`EXIT_OOM`] (or [`EXIT_OOM_CANNOT_FIT`]).
//!
//! The profile controller reads it from the termination message and counts it as an OOM, exactly
//! as an `OOMKilled` reason. Readers tolerate unknown fields (additive changes keep the version).

use serde::{Deserialize, Serialize};
use std::fmt;

/// Schema version of [`OomRecord`]. Bump only on an incompatible change; readers check it.
pub const OOM_RECORD_VERSION: u32 = 1;

/// Exit code of a trainer that died of an out-of-memory error and recorded it: the next pod of
/// the Job is admitted one step smaller, so a `podFailurePolicy` may `Count` (retry) it.
pub const EXIT_OOM: i32 = 86;

/// Exit code of a trainer that died of an out-of-memory error in a pod the webhook admitted with
/// "cannot fit" ([`crate::env::CANNOT_FIT`]): retrying cannot help, so a `podFailurePolicy` should
/// `FailJob` on it.
pub const EXIT_OOM_CANNOT_FIT: i32 = 87;

/// Longest `message` kept in a record (the termination message holds at most 4096 bytes).
pub const MAX_MESSAGE_CHARS: usize = 512;

/// Text that means the accelerator's allocator ran out, as torch prints it (also in a
/// traceback that reaches the termination message through `FallbackToLogsOnError`).
pub const CUDA_OOM_TEXTS: &[&str] = &[
    "CUDA out of memory",
    "HIP out of memory",
    "CUDA error: out of memory",
    "torch.OutOfMemoryError",
    "torch.cuda.OutOfMemoryError",
    "CUBLAS_STATUS_ALLOC_FAILED",
];

/// Text that means host memory ran out: torch's CPU allocator.
pub const CPU_OOM_TEXTS: &[&str] = &["DefaultCPUAllocator: can't allocate memory"];

/// The kind of out-of-memory error a log tail or message shows, if any: the texts above, or a
/// line that starts with Python's `MemoryError` (the last line of its traceback).
pub fn classify_text(text: &str) -> Option<OomKind> {
    if CUDA_OOM_TEXTS.iter().any(|t| text.contains(t)) {
        return Some(OomKind::CudaOom);
    }
    let memory_error = text.lines().any(|l| {
        l.trim_start()
            .strip_prefix("MemoryError")
            .is_some_and(|r| r.is_empty() || r.starts_with(':'))
    });
    if memory_error || CPU_OOM_TEXTS.iter().any(|t| text.contains(t)) {
        return Some(OomKind::CpuOom);
    }
    None
}

/// Which memory ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OomKind {
    /// Accelerator memory: `torch.OutOfMemoryError` ("CUDA out of memory", also HIP).
    CudaOom,
    /// Host memory: `MemoryError`, torch's "DefaultCPUAllocator: can't allocate memory", or the
    /// kernel's OOM killer (`OOMKilled`).
    CpuOom,
}

impl OomKind {
    /// The snake_case name, as in the JSON and in metric labels.
    pub const fn name(self) -> &'static str {
        match self {
            OomKind::CudaOom => "cuda_oom",
            OomKind::CpuOom => "cpu_oom",
        }
    }
}

impl fmt::Display for OomKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What became of the trainer after the OOM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OomOutcome {
    /// The client shrank the micro-batch in-process and carried on.
    Recovered,
    /// The trainer exits with [`EXIT_OOM`].
    Fatal,
}

impl OomOutcome {
    /// The snake_case name, as in the JSON and in metric labels.
    pub const fn name(self) -> &'static str {
        match self {
            OomOutcome::Recovered => "recovered",
            OomOutcome::Fatal => "fatal",
        }
    }
}

impl fmt::Display for OomOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One out-of-memory error in the trainer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OomRecord {
    /// [`OOM_RECORD_VERSION`].
    pub version: u32,
    /// Which memory ran out.
    pub kind: OomKind,
    /// Recovered in-process, or fatal.
    pub outcome: OomOutcome,
    /// The training step that failed, when the trainer knew it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    /// Per-device batch size in force when it failed.
    pub batch_size: u64,
    /// Gradient accumulation in force when it failed.
    pub grad_accumulation: u64,
    /// Whether gradient checkpointing was on.
    pub grad_checkpointing: bool,
    /// The batch size the client recovered with (outcome `recovered`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_batch_size: Option<u64>,
    /// Bytes held by live tensors at the failure (`torch.cuda.memory_allocated`, or the
    /// figure the message gives).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocated_bytes: Option<u64>,
    /// Bytes reserved by the allocator at the failure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_bytes: Option<u64>,
    /// Peak of live tensors (`torch.cuda.max_memory_allocated`; for `cpu_oom` the peak RSS).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_bytes: Option<u64>,
    /// Size of the allocation that failed, when the message gives it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_bytes: Option<u64>,
    /// Device capacity, when the message or the framework gives it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_bytes: Option<u64>,
    /// The first line of the error message, at most [`MAX_MESSAGE_CHARS`] characters.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// When it happened, RFC 3339 UTC.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub timestamp: String,
    /// The phase the trainer was in (`load`, `step`, `save`), as it last reported it; absent
    /// when it reported none (never guessed). A fatal host OOM while saving tells the next
    /// admission what a kill in the same phase (`oom_kill_phase`) tells it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<crate::phase::TrainerPhase>,
}

impl OomRecord {
    /// The record in a termination message, or `None` when the text is not a version-1 record
    /// (a sidecar summary, a log tail, anything else).
    pub fn from_termination_message(text: &str) -> Option<OomRecord> {
        // The record is one line; a message may carry log lines after it when written by a
        // wrapper, so only the first non-empty line is read.
        let line = text.lines().map(str::trim).find(|l| !l.is_empty())?;
        let record: OomRecord = serde_json::from_str(line).ok()?;
        (record.version == OOM_RECORD_VERSION).then_some(record)
    }

    /// Batch × accumulation in force.
    pub fn effective_batch(&self) -> u64 {
        self.batch_size.saturating_mul(self.grad_accumulation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURE: &str = include_str!("../fixtures/oom-record-v1.json");

    #[test]
    fn oom_record_round_trips_through_the_fixture() {
        let record: OomRecord = serde_json::from_str(FIXTURE).expect("fixture parses");
        assert_eq!(record.version, OOM_RECORD_VERSION);
        assert_eq!(record.kind, OomKind::CudaOom);
        assert_eq!(record.outcome, OomOutcome::Fatal);
        assert_eq!(record.requested_bytes, Some(2 * 1024 * 1024 * 1024));
        assert_eq!(record.effective_batch(), 32);
        let line = serde_json::to_string(&record).expect("serializes");
        assert!(!line.contains('\n'), "one line");
        let again: OomRecord = serde_json::from_str(&line).expect("re-parses");
        assert_eq!(again, record);
        assert_eq!(
            OomRecord::from_termination_message(&format!("\n{line}\n")),
            Some(record)
        );
    }

    #[test]
    fn termination_message_that_is_not_a_v1_record_is_none() {
        let summary = r#"{"version":1,"downgrades":0,"oom_events":0,"max_level":"ok","batch_size":8,"grad_accumulation":1,"exit_reason":"sigterm"}"#;
        let v2 = FIXTURE.replace("\"version\": 1", "\"version\": 2");
        let bad_kind = FIXTURE.replace("cuda_oom", "gpu_oom");
        for text in [
            "",
            "Traceback (most recent call last):",
            summary,
            v2.as_str(),
            bad_kind.as_str(),
        ] {
            assert_eq!(OomRecord::from_termination_message(text), None, "{text}");
        }
    }

    #[test]
    fn classify_text_reads_torch_and_python_messages() {
        let table: [(&str, &str, Option<OomKind>); 8] = [
            (
                "torch ≥ 2.1",
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
                Some(OomKind::CudaOom),
            ),
            (
                "older torch",
                "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity)",
                Some(OomKind::CudaOom),
            ),
            (
                "ROCm",
                "HIP out of memory. Tried to allocate 8.00 MiB",
                Some(OomKind::CudaOom),
            ),
            (
                "CPU allocator",
                "RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes.",
                Some(OomKind::CpuOom),
            ),
            (
                "Python MemoryError",
                "Traceback (most recent call last):\n  File \"t.py\", line 1\nMemoryError\n",
                Some(OomKind::CpuOom),
            ),
            (
                "MemoryError with text",
                "MemoryError: cannot allocate array",
                Some(OomKind::CpuOom),
            ),
            (
                "a name that starts the same",
                "MemoryErrorHandler installed",
                None,
            ),
            (
                "another crash",
                "RuntimeError: mat1 and mat2 shapes cannot be multiplied",
                None,
            ),
        ];
        for (name, text, kind) in table {
            assert_eq!(classify_text(text), kind, "{name}");
        }
    }

    #[test]
    fn kinds_and_outcomes_serialize_as_their_names() {
        for kind in [OomKind::CudaOom, OomKind::CpuOom] {
            let json = serde_json::to_string(&kind).expect("ok");
            assert_eq!(json, format!("\"{}\"", kind.name()));
        }
        for outcome in [OomOutcome::Recovered, OomOutcome::Fatal] {
            let json = serde_json::to_string(&outcome).expect("ok");
            assert_eq!(json, format!("\"{outcome}\""));
        }
    }
}
