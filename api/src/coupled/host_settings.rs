//! What the FSDP and DeepSpeed configs a launch names say of its pod's host memory (issue 39),
//! each with where it was read. Read from the configs [`super::read`] has already parsed, never
//! a second time.
//!
//! - FSDP (`--fsdp`, `--fsdp_config`, transformers 5.23 `TrainingArguments._process_fsdp_args`,
//!   which drops a key's `fsdp_` prefix): `state_dict_type` (default `FULL_STATE_DICT`),
//!   `cpu_ram_efficient_loading` (default false; true lowers nothing at load, [`INERT_AT_LOAD`]),
//!   `cpu_offload` (default false; also the
//!   `offload` word of `--fsdp`; accelerate spells it `offload_params`).
//! - DeepSpeed: `zero_optimization.offload_optimizer.device` and `offload_param.device` (`cpu`,
//!   `nvme`: offloaded through host buffers; `none`; the parameters offloaded count as the
//!   optimizer too, as ZeRO-Infinity runs them), and
//!   `stage3_gather_16bit_weights_on_model_save` (DeepSpeed's default false).

use super::JsonConfig;
use memguard_estimator::Offload;
use serde_json::Value;

/// How a sharded trainer's checkpoint holds the model's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateDict {
    /// Gathered whole on one rank's host and written by it (FSDP `FULL_STATE_DICT`).
    Full,
    /// Each rank writes its own shard (FSDP `SHARDED_STATE_DICT`).
    Sharded,
}

/// A setting read, with where from (`args`, `configmap:<name>/<key>`, `default:transformers`,
/// `default:deepspeed`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting<T> {
    /// The value.
    pub value: T,
    /// Where it came from.
    pub source: String,
}

/// The host settings of a launch's sharding configs; `None` where not said or not read, and
/// `unreadable` says why a config that would say them was not read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostSettings {
    /// FSDP's state dict type.
    pub state_dict: Option<Setting<StateDict>>,
    /// FSDP's `cpu_ram_efficient_loading`: only rank 0 materialises the weights.
    pub ram_efficient_loading: Option<Setting<bool>>,
    /// What FSDP or DeepSpeed keeps on the host.
    pub offload: Option<Setting<Offload>>,
    /// ZeRO-3 gathers the 16-bit weights on one rank to save them
    /// (`stage3_gather_16bit_weights_on_model_save`).
    pub gathered_16bit_save: Option<Setting<bool>>,
    /// Why a named config was not read (in the image, a shell expansion): its settings are
    /// unknown.
    pub unreadable: Option<String>,
}

/// transformers' defaults for an FSDP config's keys (5.23, `TrainingArguments`' docstring and
/// `_process_fsdp_args`).
const FSDP_DEFAULTS: &str = "default:transformers";
/// The source of a `cpu_ram_efficient_loading: true`, which lowers no host memory at load
/// under transformers 5.23: `from_pretrained` reads the files on every rank whatever the key
/// says (it only skips initialising missing keys on ranks other than 0), and under `torchrun`
/// the key does not even switch that on (`is_fsdp_enabled()` needs `ACCELERATE_USE_FSDP`,
/// which only `accelerate launch --use_fsdp` sets). Measured (`bench/host/ram_efficient_load.py`):
/// 2 ranks loading a bf16 checkpoint as fp32 peak the same with the key on or off, under
/// `accelerate launch --use_fsdp` and under `torchrun`. So every rank is counted as loading.
pub const INERT_AT_LOAD: &str = "inert:transformers-5";
/// FSDP's `cpu_ram_efficient_loading` as memguard counts it when a launch (read at `source`)
/// or `memguard estimate --ram-efficient-loading` says `key`: never in effect, for under
/// transformers 5.23 every rank loads whatever the key says; a `true` is said so, with the
/// source [`INERT_AT_LOAD`]. The one rule admission and the CLI share.
pub fn ram_efficient_loading(key: bool, source: &str) -> Setting<bool> {
    Setting {
        value: false,
        source: if key {
            INERT_AT_LOAD.into()
        } else {
            source.into()
        },
    }
}

/// DeepSpeed's default for a key its config leaves out.
const DEEPSPEED_DEFAULTS: &str = "default:deepspeed";

/// A config's source as a knob's: its ConfigMap key, else `args` (inline, base64).
fn source_of(config: &JsonConfig) -> String {
    if config.source.starts_with("configmap:") {
        config.source.clone()
    } else {
        "args".into()
    }
}

/// A bool as transformers' and DeepSpeed's dict values are: `true`, `"true"`, `"false"`.
fn boolean(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::String(s) => match s.trim().to_ascii_lowercase().as_str() {
            "true" => Some(true),
            "false" => Some(false),
            _ => None,
        },
        _ => None,
    }
}

impl HostSettings {
    /// The FSDP settings: the `--fsdp` words (`offload`) and the FSDP config, when one is
    /// named (`None`: `--fsdp` alone, whose config is transformers' defaults).
    pub(super) fn read_fsdp(&mut self, fsdp_words: Option<&str>, config: Option<&JsonConfig>) {
        let empty = Value::Object(Default::default());
        let (value, source) = match config {
            Some(c) => (&c.value, source_of(c)),
            None => (&empty, "args".to_string()),
        };
        // transformers drops the `fsdp_` prefix of every key.
        let get = |key: &str| value.get(key).or_else(|| value.get(format!("fsdp_{key}")));
        self.state_dict = match get("state_dict_type") {
            None => Some(Setting {
                value: StateDict::Full,
                source: FSDP_DEFAULTS.into(),
            }),
            Some(v) => match v.as_str().map(|s| s.trim().to_ascii_uppercase()).as_deref() {
                Some("FULL_STATE_DICT") => Some(Setting {
                    value: StateDict::Full,
                    source: source.clone(),
                }),
                Some("SHARDED_STATE_DICT") => Some(Setting {
                    value: StateDict::Sharded,
                    source: source.clone(),
                }),
                // LOCAL_STATE_DICT and anything else: not a save memguard sizes.
                _ => None,
            },
        };
        self.ram_efficient_loading = match get("cpu_ram_efficient_loading") {
            None => Some(Setting {
                value: false,
                source: FSDP_DEFAULTS.into(),
            }),
            Some(v) => boolean(v).map(|b| ram_efficient_loading(b, &source)),
        };
        let word = fsdp_words.is_some_and(|w| {
            w.to_ascii_lowercase()
                .split([' ', ','])
                .any(|t| t == "offload")
        });
        let key = get("cpu_offload").or_else(|| get("offload_params"));
        self.offload = if word {
            Some(Setting {
                value: Offload::ParamsAndOptimizer,
                source: "args".into(),
            })
        } else {
            match key {
                None => Some(Setting {
                    value: Offload::None,
                    source: FSDP_DEFAULTS.into(),
                }),
                Some(v) => boolean(v).map(|on| Setting {
                    value: if on {
                        Offload::ParamsAndOptimizer
                    } else {
                        Offload::None
                    },
                    source: source.clone(),
                }),
            }
        };
    }

    /// The DeepSpeed settings of a config read.
    pub(super) fn read_deepspeed(&mut self, config: &JsonConfig) {
        let source = source_of(config);
        let zero = config.value.get("zero_optimization");
        let device = |section: &str| -> Option<Option<bool>> {
            match zero.and_then(|z| z.get(section)) {
                None => Some(Some(false)),
                Some(s) => match s.get("device").and_then(Value::as_str) {
                    Some(d) => match d.trim().to_ascii_lowercase().as_str() {
                        "cpu" | "nvme" => Some(Some(true)),
                        "none" => Some(Some(false)),
                        _ => None,
                    },
                    // A section without a device: DeepSpeed's default, none.
                    None => Some(Some(false)),
                },
            }
        };
        let optimizer = device("offload_optimizer").flatten();
        let params = device("offload_param").flatten();
        self.offload = match (optimizer, params) {
            (Some(o), Some(p)) => {
                let said = |section: &str| zero.and_then(|z| z.get(section)).is_some();
                Some(Setting {
                    value: if p {
                        Offload::ParamsAndOptimizer
                    } else if o {
                        Offload::Optimizer
                    } else {
                        Offload::None
                    },
                    source: if said("offload_optimizer") || said("offload_param") {
                        source.clone()
                    } else {
                        DEEPSPEED_DEFAULTS.into()
                    },
                })
            }
            _ => None,
        };
        let gather = zero.and_then(|z| {
            z.get("stage3_gather_16bit_weights_on_model_save")
                .or_else(|| z.get("stage3_gather_fp16_weights_on_model_save"))
        });
        self.gathered_16bit_save = match gather {
            None => Some(Setting {
                value: false,
                source: DEEPSPEED_DEFAULTS.into(),
            }),
            Some(v) => boolean(v).map(|b| Setting {
                value: b,
                source: source.clone(),
            }),
        };
    }
}
