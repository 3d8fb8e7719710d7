//! What the sidecar needs from admission to plan at train start (issue 37, item 3): the
//! per-device budget admission computed for a GPU trainer, and the policy's safety ratio,
//! estimate level and floors. The webhook writes it as `key=value,…`
//! ([`crate::env::SIDECAR_TRAIN_START`]); the sidecar parses it here, bounded and validated.
//! A key that is absent is unknown: never defaulted by the sidecar.

use memguard_estimator::plan::Floors;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Longest value accepted (a dozen numbers; anything longer is not ours).
pub const MAX_LEN: usize = 1024;

/// The keys, in the order the webhook writes them.
pub const KEYS: [&str; 8] = [
    "budget-bytes",
    "safety-ratio",
    "estimate-level",
    "allow-quality",
    "floor-batch-size",
    "floor-seq-length",
    "floor-lora-rank",
    "floor-lora-layers",
];

/// The train-start settings admission passed: `None` where it passed nothing.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainStartPolicy {
    /// A GPU trainer's per-device budget in bytes, the safety ratio applied (admission's
    /// `Budget::bytes`): absent for a CPU trainer and where admission computed none.
    pub budget_bytes: Option<u64>,
    /// The safety ratio, in (0, 1]: a CPU trainer's budget is its cgroup limit times it.
    pub safety_ratio: Option<f64>,
    /// The level of the upper bound plans are checked against, in (0, 1).
    pub estimate_level: Option<f64>,
    /// The floors the plan may reach, quality rungs allowed or not.
    pub floors: Option<Floors>,
}

impl TrainStartPolicy {
    /// Parses `key=value,…`. An unknown key, a value out of range, a partial set of floors or
    /// a text longer than [`MAX_LEN`] is an error naming it.
    pub fn parse(text: &str) -> Result<TrainStartPolicy, String> {
        if text.len() > MAX_LEN {
            return Err(format!("longer than {MAX_LEN} bytes"));
        }
        let mut values: BTreeMap<&str, f64> = BTreeMap::new();
        for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| format!("`{item}` is not key=value"))?;
            let key = key.trim();
            if !KEYS.contains(&key) {
                return Err(format!("unknown key `{key}` (known: {})", KEYS.join(", ")));
            }
            let v: f64 = value
                .trim()
                .parse()
                .ok()
                .filter(|v: &f64| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| format!("{key}: `{}` is not a non-negative number", value.trim()))?;
            values.insert(key, v);
        }
        let whole = |key: &str| -> Result<Option<u64>, String> {
            match values.get(key) {
                None => Ok(None),
                Some(v) if v.fract() == 0.0 && *v >= 1.0 && *v < 2f64.powi(63) => {
                    Ok(Some(*v as u64))
                }
                Some(v) => Err(format!("{key}: {v} is not a whole number ≥ 1")),
            }
        };
        let budget_bytes = whole("budget-bytes")?;
        let safety_ratio = match values.get("safety-ratio") {
            Some(r) if *r > 0.0 && *r <= 1.0 => Some(*r),
            Some(r) => return Err(format!("safety-ratio: {r} is not in (0, 1]")),
            None => None,
        };
        let estimate_level = match values.get("estimate-level") {
            Some(l) if *l > 0.0 && *l < 1.0 => Some(*l),
            Some(l) => return Err(format!("estimate-level: {l} is not in (0, 1)")),
            None => None,
        };
        let floor_keys = [
            "allow-quality",
            "floor-batch-size",
            "floor-seq-length",
            "floor-lora-rank",
            "floor-lora-layers",
        ];
        let given = floor_keys
            .iter()
            .filter(|k| values.contains_key(*k))
            .count();
        let floors = match given {
            0 => None,
            n if n == floor_keys.len() => {
                let allow = values["allow-quality"];
                if allow != 0.0 && allow != 1.0 {
                    return Err(format!("allow-quality: {allow} is not 0 or 1"));
                }
                Some(Floors {
                    batch_size: whole("floor-batch-size")?.unwrap_or(1),
                    seq_length: whole("floor-seq-length")?.unwrap_or(1),
                    lora_rank: whole("floor-lora-rank")?.unwrap_or(1),
                    lora_layers: whole("floor-lora-layers")?.unwrap_or(1),
                    allow_quality: allow == 1.0,
                })
            }
            _ => {
                return Err(format!(
                    "the floors come together ({}): some are missing",
                    floor_keys.join(", ")
                ));
            }
        };
        Ok(TrainStartPolicy {
            budget_bytes,
            safety_ratio,
            estimate_level,
            floors,
        })
    }

    /// `key=value,…`, what [`parse`](Self::parse) reads back; absent values are left out.
    pub fn render(&self) -> String {
        let mut out: Vec<String> = Vec::new();
        if let Some(b) = self.budget_bytes {
            out.push(format!("budget-bytes={b}"));
        }
        if let Some(r) = self.safety_ratio {
            out.push(format!("safety-ratio={r}"));
        }
        if let Some(l) = self.estimate_level {
            out.push(format!("estimate-level={l}"));
        }
        if let Some(f) = &self.floors {
            out.push(format!("allow-quality={}", u8::from(f.allow_quality)));
            out.push(format!("floor-batch-size={}", f.batch_size));
            out.push(format!("floor-seq-length={}", f.seq_length));
            out.push(format!("floor-lora-rank={}", f.lora_rank));
            out.push(format!("floor-lora-layers={}", f.lora_layers));
        }
        out.join(",")
    }
}

/// The sidecar's decision at train start, on the config the trainer reported: in its reply to
/// that report, in the summary and on `/metrics`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainStartPlan {
    /// Whether a plan was made (false: a value it depends on is unknown, `reason` says which).
    pub planned: bool,
    /// Why, for a person: the plan's steps, or what was missing.
    pub reason: String,
    /// The planned micro-batch (never above the trainer's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u64>,
    /// The planned accumulation: micro-batch × accumulation is the trainer's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_accumulation: Option<u64>,
    /// Whether the plan runs with gradient checkpointing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_checkpointing: Option<bool>,
    /// Whether the planned config's upper bound fits the budget (false: every knob at its
    /// floor and still over; it runs at the smallest config tried).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fits: Option<bool>,
    /// The upper bound of the planned config's step, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upper_bytes: Option<u64>,
    /// The budget planned against, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_bytes: Option<u64>,
}

/// The sidecar's answer to the report that carried the trainer's config: its decision and the
/// signal in force after it (the trainer applies it before its first step).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainStartReply {
    /// The decision.
    pub train_start: TrainStartPlan,
    /// The signal after it.
    pub signal: crate::signal::Signal,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_webhook_writes_reads_back() {
        let policy = TrainStartPolicy {
            budget_bytes: Some(72_000_000_000),
            safety_ratio: Some(0.9),
            estimate_level: Some(0.95),
            floors: Some(Floors::default()),
        };
        assert_eq!(TrainStartPolicy::parse(&policy.render()), Ok(policy));
        assert_eq!(TrainStartPolicy::parse(""), Ok(TrainStartPolicy::default()));
    }

    #[test]
    fn bad_values_are_refused_with_their_key() {
        for (text, says) in [
            ("budget=1", "unknown key `budget`"),
            ("safety-ratio=1.5", "safety-ratio"),
            ("safety-ratio=0", "safety-ratio"),
            ("estimate-level=1", "estimate-level"),
            ("budget-bytes=-3", "budget-bytes"),
            ("budget-bytes=1.5", "budget-bytes"),
            ("budget-bytes=lots", "budget-bytes"),
            ("allow-quality=1", "floors come together"),
            ("safety-ratio", "not key=value"),
        ] {
            let err = TrainStartPolicy::parse(text).expect_err(text);
            assert!(err.contains(says), "{text}: {err}");
        }
        assert!(TrainStartPolicy::parse(&"x".repeat(MAX_LEN + 1)).is_err());
    }
}
