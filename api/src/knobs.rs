//! The knob vocabulary: the training knobs a plan may change, with their names (annotation keys,
//! `env-map`), their `MEMGUARD_*` variables, their values in a config, which of them mean
//! something for a config, and which the sidecar changes at run time. Every list of knobs derives
//! from here: the CRD's `TrainingKnobs`, the sidecar's pressure knobs ([`RuntimeKnobs`]), the
//! profile controller's observation, the env the webhook writes for the trainer and the sidecar,
//! and `memguard explain`'s table.

use memguard_estimator::{GradSync, Parallelism, TrainingConfig};
use serde::{Deserialize, Serialize};

/// A training knob the plan can change, and the user may map to their own env variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Knob {
    /// Per-device batch size.
    BatchSize,
    /// Gradient accumulation steps.
    GradAccumulation,
    /// Gradient checkpointing on/off.
    GradCheckpointing,
    /// Sequence length.
    SeqLength,
    /// LoRA rank.
    LoraRank,
    /// Adapted layers.
    LoraLayers,
    /// Gradient synchronisation while accumulating (`accumulate|each-batch`).
    GradSync,
}

impl Knob {
    /// Every knob.
    pub const ALL: [Knob; 7] = [
        Knob::BatchSize,
        Knob::GradAccumulation,
        Knob::GradCheckpointing,
        Knob::SeqLength,
        Knob::LoraRank,
        Knob::LoraLayers,
        Knob::GradSync,
    ];

    /// The name used in `env-map` (the annotation key without prefix).
    pub const fn name(self) -> &'static str {
        match self {
            Knob::BatchSize => "batch-size",
            Knob::GradAccumulation => "grad-accumulation",
            Knob::GradCheckpointing => "grad-checkpointing",
            Knob::SeqLength => "seq-length",
            Knob::LoraRank => "lora-rank",
            Knob::LoraLayers => "lora-layers",
            Knob::GradSync => "grad-sync",
        }
    }

    /// The `MEMGUARD_*` variable carrying this knob.
    pub const fn env(self) -> &'static str {
        match self {
            Knob::BatchSize => crate::env::BATCH_SIZE,
            Knob::GradAccumulation => crate::env::GRAD_ACCUMULATION,
            Knob::GradCheckpointing => crate::env::GRAD_CHECKPOINTING,
            Knob::SeqLength => crate::env::SEQ_LENGTH,
            Knob::LoraRank => crate::env::LORA_RANK,
            Knob::LoraLayers => crate::env::LORA_LAYERS,
            Knob::GradSync => crate::env::GRAD_SYNC,
        }
    }

    /// The knobs the sidecar changes at run time (its pressure state, the sticky downgrade),
    /// in the order the webhook writes them into the sidecar's env.
    pub const RUNTIME: [Knob; 3] = [
        Knob::BatchSize,
        Knob::GradAccumulation,
        Knob::GradCheckpointing,
    ];

    /// Whether the knob means something for `cfg`: the LoRA knobs for adapter methods only, the
    /// gradient sync for FSDP across ranks only (where it decides whether gradients stay
    /// sharded).
    pub fn applies_to(self, cfg: &TrainingConfig) -> bool {
        match self {
            Knob::LoraRank | Knob::LoraLayers => cfg.is_adapter(),
            Knob::GradSync => cfg.parallelism == Parallelism::Fsdp && cfg.world_size > 1,
            _ => true,
        }
    }

    /// The knobs that mean something for `cfg` ([`applies_to`](Self::applies_to)), in
    /// [`ALL`](Self::ALL)'s order: what the webhook writes, the profile records and `memguard
    /// explain` shows.
    pub fn of(cfg: &TrainingConfig) -> Vec<Knob> {
        Knob::ALL
            .into_iter()
            .filter(|k| k.applies_to(cfg))
            .collect()
    }

    /// `value` read as this knob's, as [`value`](Self::value) writes it; `None` when it is not
    /// one (a count must be at least 1).
    fn read(self, value: &str) -> Option<Setting> {
        match self {
            Knob::GradCheckpointing => value.trim().parse().ok().map(Setting::Flag),
            Knob::GradSync => value.parse().ok().map(Setting::Sync),
            _ => value
                .trim()
                .parse()
                .ok()
                .filter(|v| *v > 0)
                .map(Setting::Count),
        }
    }

    /// Sets the knob in `cfg` from `value` as [`value`](Self::value) writes it; `false`, and
    /// `cfg` unchanged, when `value` is not one.
    pub fn set(self, cfg: &mut TrainingConfig, value: &str) -> bool {
        match (self, self.read(value)) {
            (Knob::BatchSize, Some(Setting::Count(v))) => cfg.batch_size = v,
            (Knob::GradAccumulation, Some(Setting::Count(v))) => cfg.grad_accumulation = v,
            (Knob::GradCheckpointing, Some(Setting::Flag(v))) => cfg.grad_checkpointing = v,
            (Knob::SeqLength, Some(Setting::Count(v))) => cfg.seq_length = v,
            (Knob::LoraRank, Some(Setting::Count(v))) => cfg.lora_rank = v,
            (Knob::LoraLayers, Some(Setting::Count(v))) => cfg.lora_layers = Some(v),
            (Knob::GradSync, Some(Setting::Sync(v))) => cfg.grad_sync = v,
            _ => return false,
        }
        true
    }

    /// The knob's value in `cfg`, as an env value.
    pub fn value(self, cfg: &TrainingConfig) -> String {
        match self {
            Knob::BatchSize => cfg.batch_size.to_string(),
            Knob::GradAccumulation => cfg.grad_accumulation.to_string(),
            Knob::GradCheckpointing => cfg.grad_checkpointing.to_string(),
            Knob::SeqLength => cfg.seq_length.to_string(),
            Knob::LoraRank => cfg.lora_rank.to_string(),
            Knob::LoraLayers => cfg.adapted_layers().to_string(),
            Knob::GradSync => cfg.grad_sync.name().to_string(),
        }
    }

    /// The knob named `s` ([`name`](Self::name)).
    pub fn parse(s: &str) -> Option<Knob> {
        Knob::ALL.into_iter().find(|k| k.name() == s)
    }
}

/// A knob's value, read once ([`Knob::read`]) for a config and for `TrainingKnobs` alike.
enum Setting {
    Count(u64),
    Flag(bool),
    Sync(GradSync),
}

/// Batch, accumulation and checkpointing: the [`Knob::RUNTIME`] knobs, as the sidecar holds them
/// (its pressure state) and carries a sticky downgrade over a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeKnobs {
    /// Per-device batch size.
    pub batch_size: u64,
    /// Gradient accumulation steps.
    pub grad_accumulation: u64,
    /// Gradient checkpointing.
    pub grad_checkpointing: bool,
}

#[cfg(feature = "crd")]
mod training_knobs {
    use super::{Knob, Setting};
    use crate::crd::TrainingKnobs;
    use memguard_estimator::{GradSync, TrainingConfig};
    use std::collections::BTreeMap;

    impl TrainingKnobs {
        /// The knob's value, as [`Knob::value`] writes it; `None` when not set.
        pub fn get(&self, knob: Knob) -> Option<String> {
            match knob {
                Knob::BatchSize => self.batch_size.map(|v| v.to_string()),
                Knob::GradAccumulation => self.grad_accumulation.map(|v| v.to_string()),
                Knob::GradCheckpointing => self.grad_checkpointing.map(|v| v.to_string()),
                Knob::SeqLength => self.seq_length.map(|v| v.to_string()),
                Knob::LoraRank => self.lora_rank.map(|v| v.to_string()),
                Knob::LoraLayers => self.lora_layers.map(|v| v.to_string()),
                Knob::GradSync => self.grad_sync.clone(),
            }
        }

        /// The knobs of `cfg` that mean something for it ([`Knob::of`]).
        pub fn of(cfg: &TrainingConfig) -> TrainingKnobs {
            let mut out = TrainingKnobs::default();
            for knob in Knob::of(cfg) {
                out.set(knob, &knob.value(cfg));
            }
            out
        }

        /// The knobs the webhook wrote into the trainer (`MEMGUARD_BATCH_SIZE`, …, the
        /// trainer's literal env); absent or garbled values are `None`.
        pub fn from_env(vars: &BTreeMap<String, String>) -> TrainingKnobs {
            let mut out = TrainingKnobs::default();
            for knob in Knob::ALL {
                if let Some(value) = vars.get(knob.env()) {
                    out.set(knob, value);
                }
            }
            out
        }

        /// Sets `knob` from `value` as [`Knob::value`] writes it; `false`, and nothing changed,
        /// when `value` is not one.
        pub fn set(&mut self, knob: Knob, value: &str) -> bool {
            match (knob, knob.read(value)) {
                (Knob::BatchSize, Some(Setting::Count(v))) => self.batch_size = Some(v),
                (Knob::GradAccumulation, Some(Setting::Count(v))) => {
                    self.grad_accumulation = Some(v);
                }
                (Knob::GradCheckpointing, Some(Setting::Flag(v))) => {
                    self.grad_checkpointing = Some(v);
                }
                (Knob::SeqLength, Some(Setting::Count(v))) => self.seq_length = Some(v),
                (Knob::LoraRank, Some(Setting::Count(v))) => self.lora_rank = Some(v),
                (Knob::LoraLayers, Some(Setting::Count(v))) => self.lora_layers = Some(v),
                (Knob::GradSync, Some(Setting::Sync(v))) => {
                    self.grad_sync = Some(v.name().to_string());
                }
                _ => return false,
            }
            true
        }

        /// `cfg` with every knob that is set here.
        pub fn apply_to(&self, cfg: &TrainingConfig) -> TrainingConfig {
            let mut out = cfg.clone();
            for knob in Knob::ALL {
                if let Some(value) = self.get(knob) {
                    knob.set(&mut out, &value);
                }
            }
            out
        }

        /// `batch 4 × 4, checkpointing, seq 2048, rank 16` from the knobs that are set: what a
        /// person recognizes of a config (profile status, verdicts, `memguard explain`).
        pub fn describe(&self) -> String {
            let mut parts = Vec::new();
            if let Some(b) = self.batch_size {
                parts.push(format!(
                    "batch {b} × {}",
                    self.grad_accumulation.unwrap_or(1)
                ));
            }
            if self.grad_checkpointing == Some(true) {
                parts.push("checkpointing".into());
            }
            if let Some(s) = self.seq_length {
                parts.push(format!("seq {s}"));
            }
            if let Some(r) = self.lora_rank {
                parts.push(format!("rank {r}"));
            }
            if let Some(l) = self.lora_layers {
                parts.push(format!("{l} layers"));
            }
            if self.grad_sync.as_deref() == Some(GradSync::EachBatch.name()) {
                parts.push("gradients synced each batch".into());
            }
            parts.join(", ")
        }
    }
}

#[cfg(all(test, feature = "crd"))]
mod tests {
    use super::*;
    use crate::annotations::TrainingAnnotations;
    use crate::crd::TrainingKnobs;
    use std::collections::BTreeMap;

    fn config(keys: &[(&str, &str)]) -> TrainingConfig {
        let keys: BTreeMap<String, String> = keys
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        TrainingAnnotations::parse_keys(&keys, &Default::default())
            .expect("valid")
            .config
    }

    fn fsdp_lora() -> TrainingConfig {
        config(&[
            ("model", "llama-3-8b"),
            ("method", "lora"),
            ("parallelism", "fsdp"),
            ("world-size", "2"),
            ("batch-size", "6"),
            ("lora-layers", "12"),
            ("grad-sync", "each-batch"),
        ])
    }

    #[test]
    fn which_knobs_mean_something_for_a_config() {
        let full = config(&[("model", "llama-3-8b"), ("method", "full")]);
        assert_eq!(
            Knob::of(&full),
            [
                Knob::BatchSize,
                Knob::GradAccumulation,
                Knob::GradCheckpointing,
                Knob::SeqLength
            ]
        );
        assert_eq!(Knob::of(&fsdp_lora()), Knob::ALL);
        assert!(Knob::RUNTIME.iter().all(|k| k.applies_to(&full)));
    }

    #[test]
    fn every_value_written_reads_back_and_garbage_is_refused() {
        let cfg = fsdp_lora();
        let base = config(&[("model", "llama-3-8b")]);
        for knob in Knob::ALL {
            let mut read = base.clone();
            assert!(knob.set(&mut read, &knob.value(&cfg)), "{knob:?}");
            assert_eq!(knob.value(&read), knob.value(&cfg), "{knob:?}");
            for garbage in ["", "0", "-1", "many"] {
                let mut untouched = base.clone();
                assert!(!knob.set(&mut untouched, garbage), "{knob:?} {garbage:?}");
                assert_eq!(untouched, base, "{knob:?} {garbage:?}");
            }
        }
    }

    /// The CRD's knobs, the env written for the trainer and the config are one vocabulary: the
    /// knobs of a config, written as env and read back, apply to the config they came from.
    #[test]
    fn the_crd_knobs_the_env_and_the_config_agree() {
        let cfg = fsdp_lora();
        let knobs = TrainingKnobs::of(&cfg);
        for knob in Knob::ALL {
            assert_eq!(knobs.get(knob), Some(knob.value(&cfg)), "{knob:?}");
        }
        let env: BTreeMap<String, String> = Knob::of(&cfg)
            .into_iter()
            .map(|k| (k.env().to_string(), k.value(&cfg)))
            .collect();
        assert_eq!(TrainingKnobs::from_env(&env), knobs);
        let base = config(&[("model", "llama-3-8b"), ("method", "lora")]);
        let applied = knobs.apply_to(&base);
        for knob in Knob::ALL {
            assert_eq!(knob.value(&applied), knob.value(&cfg), "{knob:?}");
        }
        // The CRD's fields are the knobs' names, camel-cased.
        let json = serde_json::to_value(&knobs).expect("json");
        let fields: Vec<&String> = json.as_object().expect("object").keys().collect();
        let mut names: Vec<String> = Knob::ALL
            .iter()
            .map(|k| {
                let mut parts = k.name().split('-');
                let first = parts.next().unwrap_or_default().to_string();
                parts.fold(first, |mut out, p| {
                    let mut c = p.chars();
                    out.extend(c.next().map(|c| c.to_ascii_uppercase()));
                    out.push_str(c.as_str());
                    out
                })
            })
            .collect();
        names.sort();
        assert_eq!(fields, names.iter().collect::<Vec<_>>());
    }
}
