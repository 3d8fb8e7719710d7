//! torchtune's `tune run`: `tune run [torchrun options] <recipe> --config <name or path>
//! [key=value | ~key ...]`. The recipe and config are read, the `key=value` overrides follow
//! OmegaConf's dotlist rules (`OmegaConf.from_dotlist`, merged over the config: the later
//! one wins, and torchtune's `~key` removes a key), and the knobs come from the overrides,
//! else from the config: a built-in one's defaults ([`BUILTIN_CONFIGS`], taken from torchtune
//! at [`TORCHTUNE_COMMIT`]) or a YAML file the caller reads.
//!
//! A rewrite only ever appends or replaces a trailing `key=value` override: the config
//! itself (a file in a ConfigMap) is never edited.

use super::flags::Edit;
use super::launcher::{Launch, Program};

/// The torchtune commit the built-in configs' defaults were read from
/// (`recipes/configs/<name>.yaml`, 2026-04-23).
pub const TORCHTUNE_COMMIT: &str = "bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1";

/// The config keys of the knobs memguard reads and writes.
pub const BATCH_SIZE: &str = "batch_size";
/// Accumulation steps.
pub const GRAD_ACCUMULATION: &str = "gradient_accumulation_steps";
/// Activation checkpointing.
pub const ACTIVATION_CHECKPOINTING: &str = "enable_activation_checkpointing";
/// The tokenizer's truncation length (`null`: none).
pub const MAX_SEQ_LEN: &str = "tokenizer.max_seq_len";
/// The LoRA rank of a LoRA model component.
pub const LORA_RANK: &str = "model.lora_rank";
/// The training dtype: torchtune keeps parameters, gradients and optimizer states in it, with
/// no fp32 master copy (`training.get_dtype(cfg.dtype)`). Every config of the pinned commit sets
/// `bf16`, the value taken when a config does not say.
pub const DTYPE: &str = "dtype";

/// A built-in config's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuiltinConfig {
    /// Its name (`llama3_1/8B_lora_single_device`).
    pub name: &'static str,
    /// Its `model._component_`.
    pub component: &'static str,
    /// The catalog model that component builds.
    pub model: &'static str,
    /// `lora`, `qlora` or `full`.
    pub method: &'static str,
    /// Its values of the knobs' keys, as the YAML writes them (`null` is absent).
    pub values: &'static [(&'static str, &'static str)],
}

/// The built-in configs of the recipes people run, at [`TORCHTUNE_COMMIT`].
pub const BUILTIN_CONFIGS: &[BuiltinConfig] = &[
    BuiltinConfig {
        name: "llama3_1/8B_lora_single_device",
        component: "torchtune.models.llama3_1.lora_llama3_1_8b",
        model: "llama-3.1-8b",
        method: "lora",
        values: &[
            (BATCH_SIZE, "2"),
            (GRAD_ACCUMULATION, "8"),
            (ACTIVATION_CHECKPOINTING, "True"),
            (LORA_RANK, "8"),
        ],
    },
    BuiltinConfig {
        name: "llama3_1/8B_lora",
        component: "torchtune.models.llama3_1.lora_llama3_1_8b",
        model: "llama-3.1-8b",
        method: "lora",
        values: &[
            (BATCH_SIZE, "2"),
            (GRAD_ACCUMULATION, "8"),
            (ACTIVATION_CHECKPOINTING, "False"),
            (LORA_RANK, "8"),
        ],
    },
    BuiltinConfig {
        name: "llama3_1/8B_qlora_single_device",
        component: "torchtune.models.llama3_1.qlora_llama3_1_8b",
        model: "llama-3.1-8b",
        method: "qlora",
        values: &[
            (BATCH_SIZE, "2"),
            (GRAD_ACCUMULATION, "8"),
            (ACTIVATION_CHECKPOINTING, "True"),
            (LORA_RANK, "8"),
        ],
    },
    BuiltinConfig {
        name: "llama3_1/8B_full",
        component: "torchtune.models.llama3_1.llama3_1_8b",
        model: "llama-3.1-8b",
        method: "full",
        values: &[
            (BATCH_SIZE, "2"),
            (GRAD_ACCUMULATION, "1"),
            (ACTIVATION_CHECKPOINTING, "True"),
        ],
    },
    BuiltinConfig {
        name: "llama3_1/8B_full_single_device",
        component: "torchtune.models.llama3_1.llama3_1_8b",
        model: "llama-3.1-8b",
        method: "full",
        values: &[
            (BATCH_SIZE, "2"),
            (GRAD_ACCUMULATION, "1"),
            (ACTIVATION_CHECKPOINTING, "True"),
        ],
    },
    BuiltinConfig {
        name: "llama3_2/1B_lora_single_device",
        component: "torchtune.models.llama3_2.lora_llama3_2_1b",
        model: "llama-3.2-1b",
        method: "lora",
        values: &[
            (BATCH_SIZE, "4"),
            (GRAD_ACCUMULATION, "8"),
            (ACTIVATION_CHECKPOINTING, "False"),
            (LORA_RANK, "64"),
        ],
    },
    BuiltinConfig {
        name: "llama3_2/1B_full_single_device",
        component: "torchtune.models.llama3_2.llama3_2_1b",
        model: "llama-3.2-1b",
        method: "full",
        values: &[
            (BATCH_SIZE, "4"),
            (GRAD_ACCUMULATION, "1"),
            (ACTIVATION_CHECKPOINTING, "False"),
        ],
    },
    BuiltinConfig {
        name: "qwen2_5/7B_lora_single_device",
        component: "torchtune.models.qwen2_5.lora_qwen2_5_7b_instruct",
        model: "qwen2.5-7b",
        method: "lora",
        values: &[
            (BATCH_SIZE, "2"),
            (GRAD_ACCUMULATION, "8"),
            (ACTIVATION_CHECKPOINTING, "True"),
            (LORA_RANK, "8"),
        ],
    },
    BuiltinConfig {
        name: "qwen2_5/7B_lora",
        component: "torchtune.models.qwen2_5.lora_qwen2_5_7b_instruct",
        model: "qwen2.5-7b",
        method: "lora",
        values: &[
            (BATCH_SIZE, "2"),
            (GRAD_ACCUMULATION, "8"),
            (ACTIVATION_CHECKPOINTING, "False"),
            (LORA_RANK, "8"),
        ],
    },
];

/// The built-in config named `name` (a `.yaml` suffix allowed, as `tune run` allows it).
pub fn builtin(name: &str) -> Option<&'static BuiltinConfig> {
    let name = name.strip_suffix(".yaml").unwrap_or(name);
    BUILTIN_CONFIGS.iter().find(|c| c.name == name)
}

/// The model a `_component_` builds (torchtune's builder names), when the catalog has it.
pub fn component_model(component: &str) -> Option<(&'static str, &'static str)> {
    let builder = component.rsplit('.').next().unwrap_or(component);
    let (method, base) = if let Some(b) = builder.strip_prefix("qlora_") {
        ("qlora", b)
    } else if let Some(b) = builder.strip_prefix("lora_") {
        ("lora", b)
    } else {
        ("full", builder)
    };
    let model = match base.trim_end_matches("_instruct").trim_end_matches("_base") {
        "llama3_1_8b" => "llama-3.1-8b",
        "llama3_1_70b" => "llama-3.1-70b",
        "llama3_2_1b" => "llama-3.2-1b",
        "llama3_2_3b" => "llama-3.2-3b",
        "llama3_8b" => "llama-3-8b",
        "qwen2_5_7b" => "qwen2.5-7b",
        "qwen2_5_0_5b" => "qwen2.5-0.5b",
        "qwen2_5_1_5b" => "qwen2.5-1.5b",
        "qwen2_5_3b" => "qwen2.5-3b",
        "qwen2_5_14b" => "qwen2.5-14b",
        "mistral_7b" => "mistral-7b",
        "gemma_2b" => "gemma-2b",
        "gemma_7b" => "gemma-7b",
        "phi3_mini" => "phi-3-mini",
        _ => return None,
    };
    Some((model, method))
}

/// The config `--config` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigRef {
    /// A built-in config.
    Builtin(&'static BuiltinConfig),
    /// A file (a path, or a name torchtune does not ship).
    File(String),
}

/// One `key=value` or `~key` word after the recipe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Override {
    /// The dotted key.
    pub key: String,
    /// The value (`None`: `~key`, removed).
    pub value: Option<String>,
    /// The word's index in [`Launch::args`].
    pub at: usize,
}

/// A `tune run` launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TuneRun {
    /// The recipe (`lora_finetune_single_device`, or a recipe file).
    pub recipe: String,
    /// The config.
    pub config: ConfigRef,
    /// The overrides, in order.
    pub overrides: Vec<Override>,
    /// `--nproc_per_node`, `--nnodes` as given.
    pub nproc_per_node: Option<String>,
    /// `--nnodes` as given.
    pub nnodes: Option<String>,
}

/// Why a `tune run` line cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TuneError {
    /// No recipe after `tune run`'s options.
    #[error("`tune run` names no recipe")]
    NoRecipe,
    /// No `--config`.
    #[error("`tune run {0}` has no --config")]
    NoConfig(String),
    /// A word after the config that is not `key=value` or `~key`.
    #[error("`{0}` after --config is not a key=value override")]
    NotAnOverride(String),
    /// A word the shell expands.
    #[error("`{0}` is a shell expansion")]
    Expands(String),
}

/// `tune run`'s torchrun options that take no value.
const TORCHRUN_BOOLS: &[&str] = &["standalone", "no_python", "module", "run_path", "m"];

/// Where a knob's value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// An override on the command line.
    Args,
    /// The config.
    Config,
}

impl TuneRun {
    /// The `tune run` in `launch`, if it is one (`Ok(None)`: another program).
    pub fn read(launch: &Launch) -> Result<Option<TuneRun>, TuneError> {
        if !matches!(&launch.program, Program::Command(_)) || launch.program.name() != "tune" {
            return Ok(None);
        }
        let args = &launch.args;
        if args.first().map(|a| a.text.as_str()) != Some("run") {
            return Ok(None);
        }
        let mut i = 1;
        let (mut nproc_per_node, mut nnodes) = (None, None);
        // torchrun's options, up to the recipe.
        while let Some(a) = args.get(i) {
            let Some(body) = a.text.strip_prefix("--") else {
                break;
            };
            let (key, inline) = match body.split_once('=') {
                Some((k, v)) => (k.replace('-', "_"), Some(v.to_string())),
                None => (body.replace('-', "_"), None),
            };
            let value = if inline.is_some() || TORCHRUN_BOOLS.contains(&key.as_str()) {
                i += 1;
                inline
            } else {
                i += 2;
                args.get(i - 1).map(|a| a.text.clone())
            };
            match key.as_str() {
                "nproc_per_node" => nproc_per_node = value,
                "nnodes" => nnodes = value,
                _ => {}
            }
        }
        let recipe = args.get(i).ok_or(TuneError::NoRecipe)?;
        if recipe.expands {
            return Err(TuneError::Expands(recipe.text.clone()));
        }
        let recipe = recipe.text.clone();
        i += 1;
        let mut config = None;
        let mut overrides = Vec::new();
        while let Some(a) = args.get(i) {
            let t = a.text.as_str();
            if t == "--config" {
                let name = args.get(i + 1).ok_or(TuneError::NoConfig(recipe.clone()))?;
                if name.expands {
                    return Err(TuneError::Expands(name.text.clone()));
                }
                config = Some(name.text.clone());
                i += 2;
                continue;
            }
            if let Some(name) = t.strip_prefix("--config=") {
                config = Some(name.to_string());
            } else if let Some(key) = t.strip_prefix('~') {
                overrides.push(Override {
                    key: key.to_string(),
                    value: None,
                    at: i,
                });
            } else if let Some((key, value)) = t.split_once('=')
                && !key.is_empty()
                && !key.starts_with('-')
            {
                if a.expands {
                    return Err(TuneError::Expands(t.to_string()));
                }
                overrides.push(Override {
                    key: key.to_string(),
                    value: Some(value.to_string()),
                    at: i,
                });
            } else {
                return Err(TuneError::NotAnOverride(t.to_string()));
            }
            i += 1;
        }
        let config = config.ok_or(TuneError::NoConfig(recipe.clone()))?;
        let config = match builtin(&config) {
            Some(b) => ConfigRef::Builtin(b),
            None => ConfigRef::File(config),
        };
        Ok(Some(TuneRun {
            recipe,
            config,
            overrides,
            nproc_per_node,
            nnodes,
        }))
    }

    /// The value of `key` after the overrides over `base` (the config's value; `None`: absent
    /// or `null`), and where it came from. `None`: absent, removed or `null`.
    pub fn value(&self, key: &str, base: Option<&str>) -> Option<(String, Origin)> {
        // The last override that sets or removes `key` (or a table above it) wins.
        let last = self.overrides.iter().rev().find(|o| {
            o.key == key
                || (o.value.is_none()
                    && key
                        .strip_prefix(o.key.as_str())
                        .is_some_and(|r| r.starts_with('.')))
        });
        let (value, from) = match last {
            Some(o) => (o.value.clone()?, Origin::Args),
            None => (base?.to_string(), Origin::Config),
        };
        (!is_null(&value)).then_some((value, from))
    }

    /// The edit that makes `key` read as `value`: the last `key=…` override's word replaced,
    /// or `key=value` appended (after a `~key`, too: the later one wins).
    pub fn set(&self, key: &str, value: &str) -> Edit {
        let text = format!("{key}={value}");
        match self.overrides.last_matching(key) {
            Some(o) => Edit::Replace { index: o.at, text },
            None => Edit::Append(text),
        }
    }
}

trait LastMatching {
    fn last_matching(&self, key: &str) -> Option<&Override>;
}

impl LastMatching for Vec<Override> {
    /// The last override of `key` when nothing after it removes `key`.
    fn last_matching(&self, key: &str) -> Option<&Override> {
        match self.iter().rev().find(|o| o.key == key) {
            Some(o) if o.value.is_some() => Some(o),
            _ => None,
        }
    }
}

/// YAML's and OmegaConf's null.
fn is_null(v: &str) -> bool {
    matches!(v, "null" | "~" | "None" | "Null" | "NULL" | "")
}

/// A boolean as YAML 1.1 / OmegaConf reads it (`True`, `true`, `false`, ...).
pub fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "yes" | "on" => Some(true),
        "false" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// The knobs' values in a config file's YAML (`key: value` mappings, nested), as text:
/// `tokenizer.max_seq_len` is `tokenizer:` → `max_seq_len:`. Also the model component.
#[cfg(feature = "crd")]
pub fn yaml_values(text: &str) -> Result<YamlConfig, String> {
    let doc: serde_json::Value = serde_saphyr::from_str(text).map_err(|e| e.to_string())?;
    let get = |path: &str| -> Option<String> {
        let mut v = &doc;
        for part in path.split('.') {
            v = v.get(part)?;
        }
        match v {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Number(n) => Some(n.to_string()),
            serde_json::Value::Bool(b) => Some(b.to_string()),
            _ => None,
        }
    };
    Ok(YamlConfig {
        values: [
            BATCH_SIZE,
            GRAD_ACCUMULATION,
            ACTIVATION_CHECKPOINTING,
            MAX_SEQ_LEN,
            LORA_RANK,
            DTYPE,
        ]
        .iter()
        .filter_map(|k| get(k).map(|v| (*k, v)))
        .collect(),
        component: get("model._component_"),
    })
}

/// What a config file says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct YamlConfig {
    /// The knobs' keys it sets, with their values.
    pub values: Vec<(&'static str, String)>,
    /// Its `model._component_`.
    pub component: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::find;

    fn items(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn reads_recipe_config_and_overrides() {
        let cmd = items(&[
            "tune",
            "run",
            "--nproc_per_node",
            "2",
            "lora_finetune_distributed",
            "--config",
            "llama3_1/8B_lora",
            "batch_size=4",
            "~model.lora_rank",
            "batch_size=8",
        ]);
        let launch = find(&cmd).expect("launch");
        let run = TuneRun::read(&launch).expect("readable").expect("tune run");
        assert_eq!(run.recipe, "lora_finetune_distributed");
        assert_eq!(run.nproc_per_node.as_deref(), Some("2"));
        let ConfigRef::Builtin(b) = run.config else {
            panic!("{:?}", run.config)
        };
        let base = |k: &str| b.values.iter().find(|(x, _)| *x == k).map(|(_, v)| *v);
        assert_eq!(
            run.value(BATCH_SIZE, base(BATCH_SIZE)),
            Some(("8".into(), Origin::Args))
        );
        assert_eq!(
            run.value(GRAD_ACCUMULATION, base(GRAD_ACCUMULATION)),
            Some(("8".into(), Origin::Config))
        );
        // `~model.lora_rank` removed it; `~model` would too.
        assert_eq!(run.value(LORA_RANK, base(LORA_RANK)), None);
        assert_eq!(run.value(MAX_SEQ_LEN, None), None);
        // The last `batch_size=` is replaced, an absent key appended.
        let edits = [
            run.set(BATCH_SIZE, "2"),
            run.set(GRAD_ACCUMULATION, "32"),
            run.set(LORA_RANK, "4"),
        ];
        assert_eq!(
            launch.apply(&cmd, &edits)[5..],
            items(&[
                "--config",
                "llama3_1/8B_lora",
                "batch_size=4",
                "~model.lora_rank",
                "batch_size=2",
                "gradient_accumulation_steps=32",
                "model.lora_rank=4"
            ])
        );
    }

    #[test]
    fn files_and_bad_lines() {
        let l = find(&items(&[
            "tune",
            "run",
            "full_finetune_single_device",
            "--config=/cfg/my.yaml",
        ]))
        .expect("launch");
        let run = TuneRun::read(&l).expect("readable").expect("tune run");
        assert_eq!(run.config, ConfigRef::File("/cfg/my.yaml".into()));
        let l = find(&items(&["tune", "run", "r", "--config", "c", "--oops"])).expect("launch");
        assert_eq!(
            TuneRun::read(&l),
            Err(TuneError::NotAnOverride("--oops".into()))
        );
        let l = find(&items(&["tune", "run", "r"])).expect("launch");
        assert_eq!(TuneRun::read(&l), Err(TuneError::NoConfig("r".into())));
        let l = find(&items(&["tune", "download", "x"])).expect("launch");
        assert_eq!(TuneRun::read(&l), Ok(None));
    }

    #[test]
    fn components_name_catalog_models() {
        assert_eq!(
            component_model("torchtune.models.llama3_1.qlora_llama3_1_8b"),
            Some(("llama-3.1-8b", "qlora"))
        );
        assert_eq!(
            component_model("torchtune.models.qwen2_5.lora_qwen2_5_7b_instruct"),
            Some(("qwen2.5-7b", "lora"))
        );
        for b in BUILTIN_CONFIGS {
            assert_eq!(
                component_model(b.component),
                Some((b.model, b.method)),
                "{}",
                b.name
            );
            assert!(
                memguard_estimator::catalog::lookup(b.model).is_some(),
                "{}",
                b.model
            );
        }
    }

    #[cfg(feature = "crd")]
    #[test]
    fn yaml_file_values() {
        let y = yaml_values(
            "model:\n  _component_: torchtune.models.llama3_2.lora_llama3_2_1b\n  lora_rank: 16\n\
             tokenizer:\n  max_seq_len: 2048\nbatch_size: 4\nenable_activation_checkpointing: True\n",
        )
        .expect("yaml");
        assert_eq!(
            y.component.as_deref(),
            Some("torchtune.models.llama3_2.lora_llama3_2_1b")
        );
        assert!(y.values.contains(&(MAX_SEQ_LEN, "2048".into())));
        assert!(y.values.contains(&(LORA_RANK, "16".into())));
        assert!(
            y.values
                .contains(&(ACTIVATION_CHECKPOINTING, "true".into()))
        );
    }
}
