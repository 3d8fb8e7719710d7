//! The host knobs of a trainer's launch: what decides its pod's host memory (DataLoader
//! workers, pinning, prefetch, how checkpoints are saved, the dtype the weights are loaded in,
//! FSDP's RAM-efficient loading, offload), each read with where from, or a cited default of a
//! parser memguard knows, or unknown.
//!
//! Read where memguard reads the dialect's flags: Hugging Face argument rules
//! ([`Dialect::Hf`]); the FSDP and DeepSpeed configs' settings come from the one reading of
//! those configs ([`crate::coupled::HostSettings`]). Every other dialect leaves them unknown,
//! and says so.

use super::*;
use crate::coupled::{HostSettings, StateDict};
use crate::launch::HfRules;
use memguard_estimator::{Offload, Parallelism, SaveMode};

/// A knob of the pod's host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HostKnob {
    /// DataLoader workers per rank (`--dataloader_num_workers`).
    DataloaderWorkers,
    /// The DataLoader pins its batches (`--dataloader_pin_memory`).
    PinMemory,
    /// Batches each worker prepares ahead (`--dataloader_prefetch_factor`).
    PrefetchFactor,
    /// How checkpoints are saved (`--save_strategy`, `--save_only_model`).
    Save,
    /// The dtype `from_pretrained` loads the weights in (`--dtype`, `--torch_dtype`).
    LoadDtype,
    /// The storage dtype of the checkpoint's files.
    CheckpointDtype,
    /// Only rank 0 materialises the weights (FSDP `cpu_ram_efficient_loading`).
    RamEfficientLoading,
    /// What the sharding keeps on the host (FSDP `cpu_offload`, DeepSpeed `offload_*`).
    Offload,
}

impl HostKnob {
    /// Every host knob.
    pub const ALL: [HostKnob; 8] = [
        HostKnob::DataloaderWorkers,
        HostKnob::PinMemory,
        HostKnob::PrefetchFactor,
        HostKnob::Save,
        HostKnob::LoadDtype,
        HostKnob::CheckpointDtype,
        HostKnob::RamEfficientLoading,
        HostKnob::Offload,
    ];

    /// The name in the estimate annotation's `host` sources and in messages.
    pub const fn name(self) -> &'static str {
        match self {
            HostKnob::DataloaderWorkers => "dataloader-workers",
            HostKnob::PinMemory => "pin-memory",
            HostKnob::PrefetchFactor => "prefetch-factor",
            HostKnob::Save => "save",
            HostKnob::LoadDtype => "load-dtype",
            HostKnob::CheckpointDtype => "checkpoint-dtype",
            HostKnob::RamEfficientLoading => "ram-efficient-loading",
            HostKnob::Offload => "offload",
        }
    }
}

/// A value read, with where from: `args`, or a parser's default (`default:trl`).
#[derive(Debug, Clone, PartialEq)]
pub struct HostRead<T> {
    /// The value.
    pub value: T,
    /// Where it came from.
    pub source: String,
}

/// The host knobs of a launch; a knob that is `None` is unknown, and `unknown` says why.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HostKnobs {
    /// DataLoader workers per rank.
    pub workers: Option<HostRead<u32>>,
    /// Pinned batches.
    pub pin_memory: Option<HostRead<bool>>,
    /// Prefetched batches per worker.
    pub prefetch_factor: Option<HostRead<u32>>,
    /// How checkpoints are saved.
    pub save: Option<HostRead<SaveMode>>,
    /// Bytes per parameter the weights are loaded in; `Some(None)` inside is `auto`: the
    /// checkpoint's own dtype (transformers 5).
    pub load_bytes_per_param: Option<HostRead<Option<f64>>>,
    /// Bytes per parameter of the checkpoint's files.
    pub checkpoint_bytes_per_param: Option<HostRead<f64>>,
    /// Only rank 0 materialises the weights (FSDP `cpu_ram_efficient_loading`).
    pub ram_efficient_loading: Option<HostRead<bool>>,
    /// What the sharding keeps on the host by design.
    pub offload: Option<HostRead<Offload>>,
    /// Each knob not read, with what would say it.
    pub unknown: BTreeMap<HostKnob, String>,
    /// The host knobs whose flag the launch's parser accepts: present in the launch, or
    /// defined by `TrainingArguments` when the parser is known to be over it. Only these may
    /// be rewritten.
    pub writable: BTreeSet<HostKnob>,
}

/// The flag that sets each rewritable host knob, in `TrainingArguments`' spelling.
pub const HOST_FLAGS: &[(HostKnob, &str)] = &[
    (HostKnob::DataloaderWorkers, "dataloader_num_workers"),
    (HostKnob::PinMemory, "dataloader_pin_memory"),
    (HostKnob::Save, "save_only_model"),
];

/// `TrainingArguments`' defaults (transformers 5.23: `dataloader_num_workers=0`,
/// `dataloader_pin_memory=True`, `dataloader_prefetch_factor=None`, which leaves torch's
/// DataLoader at 2, `save_strategy="steps"`, `save_only_model=False`).
const DEFAULT_WORKERS: u32 = 0;
const DEFAULT_PIN_MEMORY: bool = true;
const TORCH_PREFETCH_FACTOR: u32 = 2;

/// TRL's `ModelConfig.dtype` default (TRL 1.16: `"float32"`): its scripts load in fp32.
const TRL_LOAD_DTYPE: f64 = 4.0;

/// The flags that name the load dtype, in the spellings TRL and the example scripts use.
const DTYPE_FLAGS: [&str; 3] = ["dtype", "torch_dtype", "model_dtype"];

/// Bytes per parameter of a dtype's spelling; `Some(None)`: `auto`; `None`: not a dtype.
fn dtype_bytes(value: &str) -> Option<Option<f64>> {
    match value.trim().to_ascii_lowercase().as_str() {
        "auto" => Some(None),
        "float32" | "fp32" | "float" => Some(Some(4.0)),
        "bfloat16" | "bf16" | "float16" | "fp16" | "half" => Some(Some(2.0)),
        _ => None,
    }
}

impl HostKnobs {
    /// The host knobs of `training`'s launch.
    pub fn read(training: &TrainingPod) -> HostKnobs {
        let mut knobs = HostKnobs::default();
        knobs.unknown.insert(
            HostKnob::CheckpointDtype,
            "the checkpoint's storage dtype (its config.json `dtype`) is not in memguard's \
             catalog"
                .into(),
        );
        let reading = training
            .args
            .as_ref()
            .filter(|r| r.dialect == Dialect::Hf && training.config_file.is_none());
        let Some(reading) = reading else {
            for knob in HostKnob::ALL {
                knobs.unknown.entry(knob).or_insert_with(|| {
                    "not read: memguard reads host knobs from Hugging Face flags only".into()
                });
            }
            return knobs;
        };
        let flags = &reading.flags;
        let parser = hf_parser(&reading.launch, flags);
        // TrainingArguments' defaults hold where the parser is one memguard knows.
        let citation = (!parser.citation.is_empty()).then_some(parser.citation);
        let trl = parser.citation == "default:trl";
        let args = || "args".to_string();
        let unknown_flag =
            |flag: &str| format!("not read (the script's own parser sets it); give --{flag}");

        knobs.workers = match flags.value("dataloader_num_workers") {
            Some(v) => match v.trim().parse() {
                Ok(n) => Some(HostRead {
                    value: n,
                    source: args(),
                }),
                Err(_) => {
                    knobs.unknown.insert(
                        HostKnob::DataloaderWorkers,
                        format!("--dataloader_num_workers `{v}` is not a count"),
                    );
                    None
                }
            },
            None => citation.map(|c| HostRead {
                value: DEFAULT_WORKERS,
                source: c.into(),
            }),
        };
        knobs.pin_memory = match flags.bool("dataloader_pin_memory", &HfRules) {
            Some(b) => Some(HostRead {
                value: b,
                source: args(),
            }),
            None if flags.get("dataloader_pin_memory").is_some() => {
                knobs.unknown.insert(
                    HostKnob::PinMemory,
                    "--dataloader_pin_memory is not a bool".into(),
                );
                None
            }
            None => citation.map(|c| HostRead {
                value: DEFAULT_PIN_MEMORY,
                source: c.into(),
            }),
        };
        knobs.prefetch_factor = match flags.value("dataloader_prefetch_factor") {
            Some(v) => v.trim().parse().ok().filter(|n| *n > 0).map(|n| HostRead {
                value: n,
                source: args(),
            }),
            None => citation.map(|_| HostRead {
                value: TORCH_PREFETCH_FACTOR,
                source: "default:torch".into(),
            }),
        };
        knobs.save = read_save(training, flags, citation, &mut knobs.unknown);
        read_sharding(training, &mut knobs);
        knobs.load_bytes_per_param = match DTYPE_FLAGS.iter().find_map(|f| flags.value(f)) {
            Some(v) => dtype_bytes(v).map(|b| HostRead {
                value: b,
                source: args(),
            }),
            None if trl => Some(HostRead {
                value: Some(TRL_LOAD_DTYPE),
                source: "default:trl".into(),
            }),
            None => None,
        };
        for (knob, known, flag) in [
            (
                HostKnob::DataloaderWorkers,
                knobs.workers.is_some(),
                "dataloader_num_workers",
            ),
            (
                HostKnob::PinMemory,
                knobs.pin_memory.is_some(),
                "dataloader_pin_memory",
            ),
            (
                HostKnob::PrefetchFactor,
                knobs.prefetch_factor.is_some(),
                "dataloader_prefetch_factor",
            ),
            (HostKnob::Save, knobs.save.is_some(), "save_only_model"),
            (
                HostKnob::LoadDtype,
                knobs.load_bytes_per_param.is_some(),
                "dtype",
            ),
        ] {
            if !known {
                knobs
                    .unknown
                    .entry(knob)
                    .or_insert_with(|| unknown_flag(flag));
            }
        }
        knobs.restore_earlier(training, flags);
        for (knob, flag) in HOST_FLAGS {
            let present = flags.get(flag).is_some();
            let known = !knobs.unknown.contains_key(knob);
            if known && (present || (reading.hf_parser && citation.is_some())) {
                knobs.writable.insert(*knob);
            }
        }
        knobs
    }

    /// A flag that holds what memguard wrote at an earlier admission is memguard's: the value
    /// read is the one the trainer had then, with its source, so a second admission reaches
    /// the same plan.
    fn restore_earlier(&mut self, training: &TrainingPod, flags: &crate::launch::Flags) {
        let Some(host) = training
            .launch
            .earlier
            .as_ref()
            .and_then(|e| e.host.as_ref())
        else {
            return;
        };
        for (knob, flag) in HOST_FLAGS {
            let Some(change) = host.rewritten.get(knob.name()) else {
                continue;
            };
            let now = match flags.get(flag) {
                Some(f) if f.value.is_none() => Some(if f.negated { "false" } else { "true" }),
                Some(f) => f.value.as_deref(),
                None => None,
            };
            if now.map(|v| v.trim().to_ascii_lowercase()) != Some(change.to.clone()) {
                continue;
            }
            let source = change.source.clone();
            let truth = |v: &str| v.trim().eq_ignore_ascii_case("true");
            match knob {
                HostKnob::DataloaderWorkers => {
                    if let Ok(n) = change.from.trim().parse() {
                        self.workers = Some(HostRead { value: n, source });
                    }
                }
                HostKnob::PinMemory => {
                    self.pin_memory = Some(HostRead {
                        value: truth(&change.from),
                        source,
                    })
                }
                HostKnob::Save => {
                    let value = if truth(&change.from) {
                        SaveMode::ModelOnlyFull
                    } else {
                        SaveMode::FullWithOptimizer
                    };
                    self.save = Some(HostRead { value, source });
                }
                _ => {}
            }
        }
    }

    /// Each known knob's source, by name.
    pub fn sources(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        let mut put = |knob: HostKnob, source: Option<&String>| {
            if let Some(s) = source {
                out.insert(knob.name().to_string(), s.clone());
            }
        };
        put(
            HostKnob::DataloaderWorkers,
            self.workers.as_ref().map(|r| &r.source),
        );
        put(
            HostKnob::PinMemory,
            self.pin_memory.as_ref().map(|r| &r.source),
        );
        put(
            HostKnob::PrefetchFactor,
            self.prefetch_factor.as_ref().map(|r| &r.source),
        );
        put(HostKnob::Save, self.save.as_ref().map(|r| &r.source));
        put(
            HostKnob::LoadDtype,
            self.load_bytes_per_param.as_ref().map(|r| &r.source),
        );
        put(
            HostKnob::CheckpointDtype,
            self.checkpoint_bytes_per_param.as_ref().map(|r| &r.source),
        );
        put(
            HostKnob::RamEfficientLoading,
            self.ram_efficient_loading.as_ref().map(|r| &r.source),
        );
        put(HostKnob::Offload, self.offload.as_ref().map(|r| &r.source));
        out
    }
}

/// How the HF Trainer saves: nothing under `--save_strategy no`; an adapter's checkpoint is
/// small; under FSDP as its config's `state_dict_type` says (a full one gathers the optimizer's
/// state too unless `--save_only_model`); under ZeRO-3 sharded, or the 16-bit weights gathered
/// (`stage3_gather_16bit_weights_on_model_save`); under ZeRO-1/2 unknown; else the model alone
/// (`--save_only_model`) or with the optimizer's state.
fn read_save(
    training: &TrainingPod,
    flags: &crate::launch::Flags,
    citation: Option<&'static str>,
    unknown: &mut BTreeMap<HostKnob, String>,
) -> Option<HostRead<SaveMode>> {
    let strategy = flags
        .value("save_strategy")
        .map(|s| s.trim().to_ascii_lowercase());
    if strategy.as_deref() == Some("no") {
        return Some(HostRead {
            value: SaveMode::None,
            source: "args".into(),
        });
    }
    if strategy.is_none() && citation.is_none() {
        unknown.insert(
            HostKnob::Save,
            "not read (the script's own parser sets --save_strategy); give --save_strategy".into(),
        );
        return None;
    }
    if training.config.is_adapter() {
        // The adapter's weights and their optimizer states: small beside the model.
        return Some(HostRead {
            value: SaveMode::None,
            source: "adapter".into(),
        });
    }
    let model_only = || match flags.bool("save_only_model", &HfRules) {
        Some(b) => Some((b, "args")),
        None if flags.get("save_only_model").is_some() => None,
        None => citation.map(|c| (false, c)),
    };
    let host = &training.coupled.host;
    match training.config.parallelism {
        Parallelism::None | Parallelism::Ddp => {}
        Parallelism::Fsdp | Parallelism::Zero2 if host.state_dict.is_some() => {
            let state_dict = host.state_dict.as_ref()?;
            return match state_dict.value {
                StateDict::Sharded => Some(HostRead {
                    value: SaveMode::Sharded,
                    source: state_dict.source.clone(),
                }),
                // The Trainer gathers the optimizer's state whole too, unless model only.
                StateDict::Full => {
                    let Some((only, _)) = model_only() else {
                        unknown.insert(HostKnob::Save, "--save_only_model is not a bool".into());
                        return None;
                    };
                    Some(HostRead {
                        value: if only {
                            SaveMode::ModelOnlyFull
                        } else {
                            SaveMode::FullWithOptimizer
                        },
                        source: state_dict.source.clone(),
                    })
                }
            };
        }
        // ZeRO-3 writes each rank's partition, and gathers the 16-bit weights on one rank
        // only when its config says so.
        Parallelism::Zero3 if host.gathered_16bit_save.is_some() => {
            let gathered = host.gathered_16bit_save.as_ref()?;
            return Some(HostRead {
                value: if gathered.value {
                    SaveMode::ModelOnlyFull
                } else {
                    SaveMode::Sharded
                },
                source: gathered.source.clone(),
            });
        }
        _ => {
            unknown.insert(
                HostKnob::Save,
                host.unreadable.clone().unwrap_or_else(|| {
                    "sharded training: how it saves is not in a config memguard reads (--fsdp \
                     with --fsdp_config, a ZeRO-3 DeepSpeed config)"
                        .into()
                }),
            );
            return None;
        }
    }
    let (only, source) = model_only()?;
    Some(HostRead {
        value: if only {
            SaveMode::ModelOnlyFull
        } else {
            SaveMode::FullWithOptimizer
        },
        source: source.into(),
    })
}

/// FSDP's RAM-efficient loading and the offload of FSDP or DeepSpeed, from their configs. A
/// launch without sharding offloads nothing by config and loads on every rank (`unsharded`); a
/// config named but not read leaves both unknown.
fn read_sharding(training: &TrainingPod, knobs: &mut HostKnobs) {
    const UNSHARDED: &str = "unsharded";
    let host: &HostSettings = &training.coupled.host;
    let sharded = !matches!(
        training.config.parallelism,
        Parallelism::None | Parallelism::Ddp
    );
    let why = || {
        host.unreadable.clone().unwrap_or_else(|| {
            "sharded training: not in a config memguard reads (--fsdp with --fsdp_config, a \
             DeepSpeed config)"
                .into()
        })
    };
    knobs.ram_efficient_loading = match &host.ram_efficient_loading {
        Some(s) => Some(HostRead {
            value: s.value,
            source: s.source.clone(),
        }),
        // Only FSDP has it; DeepSpeed and unsharded launches load on every rank.
        None if !sharded => Some(HostRead {
            value: false,
            source: UNSHARDED.into(),
        }),
        // DeepSpeed's config, read: it has no such option.
        None if host.offload.is_some() && host.unreadable.is_none() => Some(HostRead {
            value: false,
            source: "default:deepspeed".into(),
        }),
        // A config not read: whatever its key says, every rank loads under transformers 5
        // (`crate::coupled::INERT_AT_LOAD`), so nothing is unknown here.
        None => Some(HostRead {
            value: false,
            source: crate::coupled::INERT_AT_LOAD.into(),
        }),
    };
    knobs.offload = match &host.offload {
        Some(s) => Some(HostRead {
            value: s.value,
            source: s.source.clone(),
        }),
        None if !sharded => Some(HostRead {
            value: Offload::None,
            source: UNSHARDED.into(),
        }),
        None => {
            knobs.unknown.insert(HostKnob::Offload, why());
            None
        }
    };
}
