//! `memguard.io/estimate`: what the webhook decided for a pod, as compact versioned JSON. The
//! webhook writes it ([`EstimateAnnotation::to_json`]); the profile controller reads it back
//! ([`EstimateAnnotation::parse`]) to learn from the estimate before calibration. One type on
//! both sides; a shape this version does not know is an error, never a guess.

use memguard_estimator::{Bytes, Calibration};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The version this crate writes and reads (`"v"`).
pub const ESTIMATE_VERSION: u32 = 1;

/// Where the per-device memory figure of the budget came from (`budgetSource`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind", content = "detail")]
pub enum BudgetSource {
    /// `memguard.io/gpu-memory`.
    Annotation,
    /// The policy's table, for the smallest of the products the pod may land on.
    GpuProduct(String),
    /// The policy's default GPU memory (no product known, or none in the table).
    PolicyDefault,
    /// The trainer's `limits.memory`.
    MemoryLimit,
    /// A MIG slice: the `<product>-MIG-<profile>` entry, or the profile alone when the product
    /// is not known (`1g.10gb: smallest in table`, `1g.10gb: nominal`).
    Mig(String),
    /// HAMi's `nvidia.com/gpumem` or `nvidia.com/gpumem-percentage`.
    Hami(String),
    /// KAI Scheduler's (Run:ai's) `gpu-memory` or `gpu-fraction` annotation.
    Kai(String),
    /// NVIDIA MPS: `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` in the trainer's env.
    Mps(String),
    /// A required node affinity on `nvidia.com/gpu.memory` (memguard's `required` placement,
    /// or the user's): the bound, less the largest driver reservation.
    Placement(String),
    /// The smallest GPU among the nodes an unpinned pod could land on, from their GPU Feature
    /// Discovery labels (`smallest of 2 GPU nodes: NVIDIA-A30`).
    Nodes(String),
    /// A DRA claim (`spec.resourceClaims`): the device's `memory` capacity in its
    /// ResourceSlice, or the policy's usable figure for its product when smaller
    /// (`gpu.nvidia.com/gpu-0 on node-a`, `class gpu.nvidia.com: smallest of 4 devices`).
    Dra(String),
}

/// The annotation, version [`ESTIMATE_VERSION`] (fixture: `api/fixtures/estimate-v1.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EstimateAnnotation {
    /// The schema version, [`ESTIMATE_VERSION`].
    pub v: u32,
    /// The estimated peak of the final config, calibrated (the point estimate).
    pub total: Bytes,
    /// The upper bound on the final config's peak at `upperLevel`: what the plan compared with
    /// the budget (absent when the plan was made against `total`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upper: Option<Bytes>,
    /// The level of `upper`: the share of unseen configurations whose peak it covers (the
    /// policy's `estimateLevel`); the job's own runs replace the population's spread once it
    /// has 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upper_level: Option<f64>,
    /// The tensor peak within `total`, calibrated.
    pub tensor_peak: Bytes,
    /// The budget the plan aimed at; `null` when the pod has none (a CPU pod without a limit).
    pub budget: Option<Bytes>,
    /// Whether the final config fits the budget; `null` without a budget.
    pub fits: Option<bool>,
    /// The downgrade rungs applied, in order (e.g. `grad-checkpointing`, `batch-size`).
    pub steps: Vec<String>,
    /// `cuda`, `rocm`, `cpu` or `metal`.
    pub device: String,
    /// Memory of one GPU the budget rests on (GPU pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory: Option<Bytes>,
    /// Where the device memory came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_source: Option<BudgetSource>,
    /// The final config's knobs (`batch-size`, …, `world-size`), as env values.
    pub config: BTreeMap<String, String>,
    /// `total` before calibration: what the profile controller learns from (measured against
    /// the calibrated figure, each calibration would be measured against itself).
    pub uncalibrated: Bytes,
    /// The calibration applied, when one was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<Calibration>,
    /// The reason of the profile's pending recovery after an OOM kill, when one applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery: Option<String>,
    /// Where each knob of the original config came from (`annotation`, `env:<NAME>`,
    /// `default`), written when any was read from the trainer's own config.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sources: BTreeMap<String, String>,
    /// The knobs that decide the verdict and that memguard did not read (a bespoke script's
    /// own defaults), each with what to add: while any is here `fits` is `null` and the
    /// trainer's launch is left as it is.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub unknown: BTreeMap<String, String>,
    /// The values read from the trainer's own config, as they were before memguard rewrote
    /// them: a second admission reads these, not its own rewrite, so it reaches the same plan.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub read: BTreeMap<String, String>,
    /// The trainer's flags memguard rewrote, in its words (`--per_device_train_batch_size 8→4`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changed: Vec<String>,
    /// The trainer's `command` + `args` before and after the rewrite, when memguard rewrote
    /// them ([`ArgsChange::new`] bounds their size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<ArgsChange>,
    /// The pod's host memory, planned against the trainer's `limits.memory` (GPU pods).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostAnnotation>,
}

/// The host memory of a GPU pod: what its trainer's memory cgroup (`limits.memory`) must hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HostAnnotation {
    /// The peak of the planned config, every unknown value at its smallest: at least this
    /// (exactly this when every value was read).
    pub bytes: Bytes,
    /// The peak with every unknown value at its largest, when each has a bound and any is
    /// unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub most: Option<Bytes>,
    /// The phase of the peak: `load`, `step` or `save`.
    pub phase: String,
    /// Each component at the peak's values: `load`, `input`, `save`, `offload`, `runtime`.
    pub components: BTreeMap<String, Bytes>,
    /// The trainer's `limits.memory`; `null` when it has none.
    pub limit: Option<Bytes>,
    /// Whether the peak fits the limit; `null` without a limit, or while an unknown value
    /// could change the answer.
    pub fits: Option<bool>,
    /// Ranks in the pod.
    pub ranks: u32,
    /// Where each host knob came from (`args`, `default:trl`, …).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sources: BTreeMap<String, String>,
    /// The host knobs not read, each with what would say it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub unknown: BTreeMap<String, String>,
    /// The host knobs memguard rewrote in the trainer's flags: a second admission reads the
    /// value the trainer had (`from`, with its source), not memguard's own.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rewritten: BTreeMap<String, HostChange>,
    /// The `sizeLimit` of the memory-backed `/dev/shm` memguard mounts in the trainer for its
    /// DataLoader workers' batches (already counted in `input`: they are the same pages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm: Option<Bytes>,
    /// The verdict when nothing fits (`host memory cannot fit: …`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdict: Option<String>,
}

/// One host knob memguard rewrote.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HostChange {
    /// The value the trainer had, as its flag spells it.
    pub from: String,
    /// Where that value came from (`args`, `default:trl`).
    pub source: String,
    /// The value memguard wrote.
    pub to: String,
}

/// Most characters of the command lines an [`ArgsChange`] keeps, both together: a launch line
/// of a few hundred characters is kept whole; a long `bash -c` script is cut, far inside the
/// API server's 256 KiB limit on all of a pod's annotations together.
pub const MAX_ARGS_CHARS: usize = 8 * 1024;

/// A trainer's command line before and after memguard rewrote it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ArgsChange {
    /// `command` + `args` as the pod had them.
    pub before: Vec<String>,
    /// `command` + `args` as memguard wrote them.
    pub after: Vec<String>,
    /// Either was cut to fit [`MAX_ARGS_CHARS`] (a cut item ends in `…`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cut: bool,
}

impl ArgsChange {
    /// Both command lines, each cut to half of [`MAX_ARGS_CHARS`].
    pub fn new(before: &[String], after: &[String]) -> ArgsChange {
        let (before, cut_before) = bounded(before, MAX_ARGS_CHARS / 2);
        let (after, cut_after) = bounded(after, MAX_ARGS_CHARS / 2);
        ArgsChange {
            before,
            after,
            cut: cut_before || cut_after,
        }
    }
}

/// `items` while they fit `budget` characters; the item that does not fit is cut and ends in
/// `…`, and the rest are left out. Returns whether anything was cut.
fn bounded(items: &[String], budget: usize) -> (Vec<String>, bool) {
    let mut left = budget;
    let mut out = Vec::new();
    for item in items {
        let n = item.chars().count();
        if n <= left {
            out.push(item.clone());
            left -= n;
        } else {
            let kept: String = item.chars().take(left.saturating_sub(1)).collect();
            out.push(format!("{kept}…"));
            return (out, true);
        }
    }
    (out, false)
}

/// Why an annotation cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EstimateError {
    /// Not JSON, or not an object with a numeric `"v"`.
    #[error("memguard.io/estimate is not a versioned estimate: {0}")]
    Unversioned(String),
    /// Written by a memguard that speaks another version.
    #[error(
        "memguard.io/estimate has version {found}; this memguard reads version {ESTIMATE_VERSION}"
    )]
    Version {
        /// The version found.
        found: u64,
    },
    /// The right version, the wrong shape.
    #[error("memguard.io/estimate (version {ESTIMATE_VERSION}): {0}")]
    Shape(String),
}

impl EstimateAnnotation {
    /// Reads an annotation value: the version first, then the shape of that version.
    pub fn parse(text: &str) -> Result<Self, EstimateError> {
        #[derive(Deserialize)]
        struct Versioned {
            v: u64,
        }
        let versioned: Versioned =
            serde_json::from_str(text).map_err(|e| EstimateError::Unversioned(e.to_string()))?;
        if versioned.v != u64::from(ESTIMATE_VERSION) {
            return Err(EstimateError::Version { found: versioned.v });
        }
        serde_json::from_str(text).map_err(|e| EstimateError::Shape(e.to_string()))
    }

    /// The annotation value: compact JSON.
    pub fn to_json(&self) -> String {
        // Integers, strings, booleans and finite floats: serializing cannot fail.
        serde_json::to_string(self).unwrap_or_else(|_| "{}".into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXTURE: &str = include_str!("../fixtures/estimate-v1.json");

    /// A launch line is kept whole; a long script is cut to the bound, marked, and the
    /// annotation stays far below the API server's 256 KiB.
    #[test]
    fn args_change_is_kept_whole_or_cut_to_its_bound() {
        let words = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let short = ArgsChange::new(
            &words(&["torchrun", "sft.py", "--per_device_train_batch_size", "8"]),
            &words(&["torchrun", "sft.py", "--per_device_train_batch_size", "2"]),
        );
        assert!(!short.cut);
        assert_eq!(short.after[3], "2");
        let script = format!("pip install x && {}", "echo padding; ".repeat(2000));
        let long = ArgsChange::new(
            &words(&["bash", "-c", &script]),
            &words(&["bash", "-c", &script]),
        );
        assert!(long.cut);
        let chars = |v: &[String]| v.iter().map(|s| s.chars().count()).sum::<usize>();
        assert!(chars(&long.before) + chars(&long.after) <= MAX_ARGS_CHARS);
        assert!(long.before[2].ends_with('…'));
        assert_eq!(long.before[..2], words(&["bash", "-c"]));
    }

    #[test]
    fn the_fixture_round_trips() {
        let a = EstimateAnnotation::parse(FIXTURE).expect("fixture parses");
        assert_eq!(a.v, ESTIMATE_VERSION);
        assert_eq!(a.uncalibrated, Bytes(16_106_127_360));
        assert_eq!(
            a.budget_source,
            Some(BudgetSource::GpuProduct("NVIDIA-A10G".into()))
        );
        assert_eq!(a.calibration.map(|c| c.runs), Some(4));
        let written = a.to_json();
        assert_eq!(EstimateAnnotation::parse(&written), Ok(a));
        let fixture: serde_json::Value = serde_json::from_str(FIXTURE).expect("JSON");
        let again: serde_json::Value = serde_json::from_str(&written).expect("JSON");
        assert_eq!(again, fixture, "every field of the fixture is written back");
    }

    /// (name, annotation, what the error must be)
    type Case<'a> = (&'a str, &'a str, fn(&EstimateError) -> bool);

    #[test]
    fn other_versions_and_shapes_are_errors_not_guesses() {
        // (name, annotation, expected error)
        let v2 = FIXTURE.replacen("\"v\": 1", "\"v\": 2", 1);
        let old = r#"{"v":1,"total":1200,"calibration":{"factor":1.2,"runs":3}}"#;
        let table: [Case; 5] = [
            ("not JSON", "{not json", |e| {
                matches!(e, EstimateError::Unversioned(_))
            }),
            ("no version", r#"{"total":1000}"#, |e| {
                matches!(e, EstimateError::Unversioned(_))
            }),
            ("a later version", &v2, |e| {
                *e == EstimateError::Version { found: 2 }
            }),
            (
                "an older shape without uncalibrated",
                old,
                |e| matches!(e, EstimateError::Shape(m) if m.contains("tensorPeak") || m.contains("uncalibrated")),
            ),
            ("an unknown field", r#"{"v":1,"totl":1}"#, |e| {
                matches!(e, EstimateError::Shape(_))
            }),
        ];
        for (name, text, expected) in table {
            let e = EstimateAnnotation::parse(text).expect_err(name);
            assert!(expected(&e), "{name}: {e}");
            assert!(
                e.to_string().starts_with("memguard.io/estimate"),
                "{name}: {e}"
            );
        }
    }
}
