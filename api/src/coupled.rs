//! Settings in the trainer's other configs that a knob change must respect (issue 27, "coupled
//! settings"). Read from the launch; the files they name through [`crate::mounted::read`].
//!
//! - **A DeepSpeed config that pins the micro-batch.** transformers fills each `"auto"` value
//!   of the DeepSpeed config from `TrainingArguments` and refuses a number that differs
//!   (`HfTrainerDeepSpeedConfig.fill_match`, "Please correct the following DeepSpeed config
//!   values that mismatch TrainingArguments values"). So a numeric
//!   `train_micro_batch_size_per_gpu` or `gradient_accumulation_steps` makes a change of
//!   `--per_device_train_batch_size` or `--gradient_accumulation_steps` break the launch.
//!   `train_batch_size` is checked against `world × batch × accumulation`, which memguard keeps
//!   exactly, so it pins nothing by itself. A config that cannot be read (in the image, a shell
//!   expansion) may pin them: batch and accumulation are then not changed either.
//! - **FSDP's own activation checkpointing** (`--fsdp_config` with `activation_checkpointing:
//!   true`, or `accelerate launch --fsdp_activation_checkpointing true`): transformers refuses it
//!   together with `--gradient_checkpointing` (transformers 5.23.0, `trainer.py`:
//!   "`fsdp_config['activation_checkpointing']` … and the `activation_checkpointing` training
//!   argument can't both be set to True"). Checkpointing then counts as on, and memguard never
//!   writes `--gradient_checkpointing`.

mod host_settings;

pub use host_settings::{HostSettings, INERT_AT_LOAD, Setting, StateDict, ram_efficient_loading};

use crate::cluster::ConfigMaps;
use crate::launch::{Flags, Launch, Launcher};
use crate::mounted;
use k8s_openapi::api::core::v1::{Container, Pod};
use memguard_estimator::Parallelism;
use serde_json::Value;

/// The DeepSpeed keys that pin one of the two factors of the effective batch.
pub const DEEPSPEED_PINNING_KEYS: [&str; 2] = [
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
];

/// What the trainer's coupled settings allow.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Coupled {
    /// Why batch and accumulation must stay as they are, in words naming the file and key
    /// (`None`: nothing pins them).
    pub batch_pinned: Option<String>,
    /// FSDP's own activation checkpointing, when it is on.
    pub fsdp_checkpointing: Option<FsdpCheckpointing>,
    /// How the launch shards the model over its devices (`--fsdp full_shard`, a DeepSpeed
    /// config's ZeRO stage, accelerate's `--use_fsdp`), with its source (`args`,
    /// `configmap:<name>/<key>`).
    pub parallelism: Option<(Parallelism, String)>,
    /// Why the launch's sharding is not known: it names a DeepSpeed config or ZeRO stage
    /// memguard cannot read (a shell expansion, a file outside the pod's ConfigMaps). A plan
    /// then claims no verdict.
    pub sharding_unknown: Option<String>,
    /// What the FSDP and DeepSpeed configs say of the pod's host memory (issue 39).
    pub host: HostSettings,
}

/// Where FSDP's own activation checkpointing is turned on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FsdpCheckpointing {
    /// In words (`activation_checkpointing in the FSDP config (--fsdp_config fsdp.json, …)`).
    pub what: String,
    /// As a knob's source: `configmap:<name>/<key>` for a file, else `args`.
    pub source: String,
}

/// A JSON config named in a launch, read.
struct JsonConfig {
    /// How it was named (`--deepspeed ds.json`).
    named: String,
    /// Where it was read (`configmap:<name>/<key>`, `inline`).
    source: String,
    value: Value,
}

/// Reads the coupled settings of a launch with HF rules.
pub fn read(
    pod: &Pod,
    trainer: &Container,
    launch: &Launch,
    flags: &Flags,
    maps: Option<&dyn ConfigMaps>,
) -> Coupled {
    let mut coupled = Coupled::default();
    // `--deepspeed` (TrainingArguments), else accelerate's own `--deepspeed_config_file`.
    let deepspeed = flag_value(launch, flags, "deepspeed").or_else(|| {
        launcher_option(launch, Launcher::Accelerate, "deepspeed_config_file")
            .map(|v| (v, "--deepspeed_config_file".to_string(), false))
    });
    if let Some((value, _, expands)) = deepspeed.clone()
        && let Some(sharding) = named_deepspeed(launch, &value, expands)
    {
        // A trainer CLI's own config by name: its file sets the batch to "auto", so nothing
        // is pinned.
        coupled.parallelism = sharding.map(|p| (p, "args".to_string()));
    } else if let Some((value, named, expands)) = deepspeed {
        let named = naming(&named, &value);
        coupled.batch_pinned = match json_config(pod, trainer, &value, named.clone(), expands, maps)
        {
            Ok(config) => {
                coupled.parallelism = zero_stage(&config);
                coupled.host.read_deepspeed(&config);
                deepspeed_pins(&config)
            }
            Err(why) => {
                coupled.sharding_unknown = Some(format!(
                    "{named}: the DeepSpeed config cannot be read ({why})"
                ));
                coupled.host.unreadable = Some(format!(
                    "{named}: the DeepSpeed config cannot be read ({why})"
                ));
                Some(format!(
                    "{named} may pin the micro-batch: the DeepSpeed config cannot be read ({why})"
                ))
            }
        };
    }
    // DeepSpeed-Chat's and OpenRLHF's `--zero_stage N`: the script builds its DeepSpeed
    // config in code from it.
    if coupled.parallelism.is_none()
        && let Some((value, named, expands)) = flag_value(launch, flags, "zero_stage")
    {
        match value.trim().parse::<u64>() {
            Ok(n) if !expands => {
                coupled.parallelism = stage(n).map(|p| (p, "args".to_string()));
            }
            _ => {
                coupled.sharding_unknown =
                    Some(format!("{named} {value}: the ZeRO stage is not read"));
            }
        }
    }
    if coupled.parallelism.is_none()
        && let Some((value, _, false)) = flag_value(launch, flags, "fsdp")
    {
        coupled.parallelism = fsdp_strategy(&value).map(|p| (p, "args".to_string()));
    }
    let fsdp_words = flag_value(launch, flags, "fsdp").map(|(value, _, _)| value);
    let fsdp_config = flag_value(launch, flags, "fsdp_config").map(|(value, named, expands)| {
        let named = naming(&named, &value);
        json_config(pod, trainer, &value, named.clone(), expands, maps)
            .map_err(|why| format!("{named}: the FSDP config cannot be read ({why})"))
    });
    // transformers' own FSDP (`--fsdp`): its config's host settings, or its defaults.
    if matches!(
        coupled.parallelism,
        Some((Parallelism::Fsdp | Parallelism::Zero2, _))
    ) && fsdp_words.is_some()
    {
        match &fsdp_config {
            None => coupled.host.read_fsdp(fsdp_words.as_deref(), None),
            Some(Ok(config)) => coupled.host.read_fsdp(fsdp_words.as_deref(), Some(config)),
            Some(Err(why)) => coupled.host.unreadable = Some(why.clone()),
        }
    }
    if let Some(config) = fsdp_config.as_ref().and_then(|c| c.as_ref().ok()) {
        let on = ["activation_checkpointing", "fsdp_activation_checkpointing"]
            .iter()
            .any(|k| is_true(config.value.get(*k)));
        if on {
            let source = if config.source.starts_with("configmap:") {
                config.source.clone()
            } else {
                "args".into()
            };
            coupled.fsdp_checkpointing = Some(FsdpCheckpointing {
                what: format!(
                    "activation_checkpointing in the FSDP config ({}, {})",
                    config.named, config.source
                ),
                source,
            });
        }
    }
    if coupled.fsdp_checkpointing.is_none()
        && let Some(v) = launcher_option(
            launch,
            Launcher::Accelerate,
            "fsdp_activation_checkpointing",
        )
        && v.eq_ignore_ascii_case("true")
    {
        coupled.fsdp_checkpointing = Some(FsdpCheckpointing {
            what: "accelerate launch --fsdp_activation_checkpointing true".into(),
            source: "args".into(),
        });
    }
    accelerate_config(pod, trainer, launch, maps, &mut coupled);
    coupled
}

/// `accelerate launch`'s own DeepSpeed and FSDP settings: its `--gradient_accumulation_steps`
/// option, and its `--config_file` (a YAML from the pod's ConfigMaps): the DeepSpeed section's
/// `gradient_accumulation_steps` (accelerate hands DeepSpeed the number, through
/// `ACCELERATE_GRADIENT_ACCUMULATION_STEPS`) or `deepspeed_config_file`, and the FSDP
/// section's `fsdp_activation_checkpointing`. A config file memguard cannot read is left alone:
/// unlike a DeepSpeed config, an accelerate config rarely pins anything.
fn accelerate_config(
    pod: &Pod,
    trainer: &Container,
    launch: &Launch,
    maps: Option<&dyn ConfigMaps>,
    coupled: &mut Coupled,
) {
    if launch.launcher != Launcher::Accelerate {
        return;
    }
    let has = |name: &str| {
        launch
            .launcher_options
            .iter()
            .any(|(k, _)| k.trim_start_matches('-').replace('-', "_") == name)
    };
    let file = launcher_option(launch, Launcher::Accelerate, "config_file").and_then(|path| {
        let file = mounted::read(pod, trainer, &path, maps).ok()?;
        let value: Value = serde_saphyr::from_str(&file.text).ok()?;
        Some((
            format!("{} (--config_file {path})", file.source),
            file.source,
            value,
        ))
    });
    let section = |key: &str| file.as_ref().and_then(|(_, _, v)| v.get(key)).cloned();
    let distributed = file
        .as_ref()
        .and_then(|(_, _, v)| v.get("distributed_type"))
        .and_then(Value::as_str)
        .map(str::to_ascii_uppercase);
    let deepspeed = has("use_deepspeed") || distributed.as_deref() == Some("DEEPSPEED");
    let fsdp = has("use_fsdp") || distributed.as_deref() == Some("FSDP");
    let count = |v: Option<&Value>| match v {
        Some(Value::Number(n)) => n.as_u64(),
        Some(Value::String(s)) => s.trim().parse().ok(),
        _ => None,
    };
    if coupled.parallelism.is_none() {
        let from_file = |section: &str, key: &str| {
            section_value(file.as_ref().map(|(_, _, v)| v), section, key)
        };
        let file_source = || file.as_ref().map(|(_, source, _)| source.clone());
        coupled.parallelism = if fsdp {
            let strategy = launcher_option(launch, Launcher::Accelerate, "fsdp_sharding_strategy")
                .map(|s| (s, "args".to_string()))
                .or_else(|| {
                    let v = from_file("fsdp_config", "fsdp_sharding_strategy")?;
                    Some((v, file_source()?))
                });
            match strategy {
                Some((s, source)) => fsdp_strategy(&s).map(|p| (p, source)),
                // accelerate's default: FULL_SHARD.
                None => Some((
                    Parallelism::Fsdp,
                    if has("use_fsdp") {
                        "args".into()
                    } else {
                        file_source().unwrap_or_default()
                    },
                )),
            }
        } else if deepspeed {
            launcher_option(launch, Launcher::Accelerate, "zero_stage")
                .map(|s| (s, "args".to_string()))
                .or_else(|| Some((from_file("deepspeed_config", "zero_stage")?, file_source()?)))
                .and_then(|(s, source)| stage(s.trim().parse().ok()?).map(|p| (p, source)))
        } else {
            None
        };
    }
    if deepspeed && coupled.batch_pinned.is_none() {
        let ds = section("deepspeed_config");
        let from_option =
            launcher_option(launch, Launcher::Accelerate, "gradient_accumulation_steps")
                .filter(|v| v.trim().parse::<u64>().is_ok());
        coupled.batch_pinned = if let Some(n) = from_option {
            Some(format!(
                "accelerate launch --gradient_accumulation_steps {n} pins the accumulation: \
                 accelerate hands DeepSpeed the number, which transformers requires the flags to \
                 match"
            ))
        } else if let (Some(n), Some((named, _, _))) = (
            count(
                ds.as_ref()
                    .and_then(|d| d.get("gradient_accumulation_steps")),
            ),
            &file,
        ) {
            Some(format!(
                "{named} pins deepspeed_config.gradient_accumulation_steps={n}: accelerate hands \
                 DeepSpeed the number, which transformers requires the flags to match"
            ))
        } else if let Some(path) = ds
            .as_ref()
            .and_then(|d| d.get("deepspeed_config_file"))
            .and_then(Value::as_str)
        {
            let named = format!("deepspeed_config_file {path}");
            match json_config(pod, trainer, path, named.clone(), false, maps) {
                Ok(config) => {
                    if let Some(p) = zero_stage(&config) {
                        coupled.parallelism = Some(p);
                    }
                    coupled.host.read_deepspeed(&config);
                    deepspeed_pins(&config)
                }
                Err(why) => Some(format!(
                    "{named} may pin the micro-batch: the DeepSpeed config cannot be read ({why})"
                )),
            }
        } else {
            None
        };
    }
    if fsdp
        && coupled.fsdp_checkpointing.is_none()
        && let Some((named, source, _)) = &file
        && is_true(
            section("fsdp_config")
                .as_ref()
                .and_then(|f| f.get("fsdp_activation_checkpointing")),
        )
    {
        coupled.fsdp_checkpointing = Some(FsdpCheckpointing {
            what: format!("fsdp_activation_checkpointing in {named}"),
            source: source.clone(),
        });
    }
}

/// A section's value as text (`fsdp_config.fsdp_sharding_strategy: FULL_SHARD`, `1`).
fn section_value(config: Option<&Value>, section: &str, key: &str) -> Option<String> {
    match config?.get(section)?.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// An FSDP sharding strategy, as transformers' `--fsdp` words (`full_shard auto_wrap`) or
/// accelerate's names (`FULL_SHARD`, `1`): full and hybrid sharding shard everything, like
/// ZeRO-3; `shard_grad_op` shards gradients and states, like ZeRO-2; `no_shard` nothing.
fn fsdp_strategy(value: &str) -> Option<Parallelism> {
    let v = value.to_ascii_lowercase();
    let has = |w: &str| v.split([' ', ',']).any(|t| t == w);
    if has("full_shard") || has("hybrid_shard") || has("1") || has("4") {
        Some(Parallelism::Fsdp)
    } else if has("shard_grad_op") || has("hybrid_shard_zero2") || has("2") || has("5") {
        Some(Parallelism::Zero2)
    } else {
        None
    }
}

/// A ZeRO stage as parallelism (stage 0 shards nothing).
fn stage(n: u64) -> Option<Parallelism> {
    match n {
        1 => Some(Parallelism::Zero1),
        2 => Some(Parallelism::Zero2),
        3 => Some(Parallelism::Zero3),
        _ => None,
    }
}

/// ms-swift's DeepSpeed configs by name (`--deepspeed zero3`: `swift/llm/ds_config/*.json`,
/// every batch setting `"auto"`), as the ZeRO stage they run.
const SWIFT_DEEPSPEED: &[(&str, u64)] = &[
    ("default-zero2", 2),
    ("default-zero3", 3),
    ("zero0", 0),
    ("zero1", 1),
    ("zero2", 2),
    ("zero2_offload", 2),
    ("zero3", 3),
    ("zero3_offload", 3),
];

/// The sharding of a DeepSpeed config named by a trainer CLI that ships it
/// ([`SWIFT_DEEPSPEED`]): `Some(None)` for ZeRO-0, which shards nothing; `None` when the value
/// is not such a name.
fn named_deepspeed(launch: &Launch, value: &str, expands: bool) -> Option<Option<Parallelism>> {
    let swift = launch.program.name() == "swift";
    SWIFT_DEEPSPEED
        .iter()
        .find(|(name, _)| swift && !expands && *name == value.trim())
        .map(|(_, n)| stage(*n))
}

/// The ZeRO stage of a DeepSpeed config (`zero_optimization.stage`), with where it was read.
fn zero_stage(config: &JsonConfig) -> Option<(Parallelism, String)> {
    let n = config
        .value
        .get("zero_optimization")?
        .get("stage")?
        .as_u64()?;
    let source = if config.source.starts_with("configmap:") {
        config.source.clone()
    } else {
        "args".into()
    };
    stage(n).map(|p| (p, source))
}

/// How a config was named, short enough for a warning: `--deepspeed ds.json`, `--deepspeed
/// (inline JSON)`.
fn naming(flag: &str, value: &str) -> String {
    if value.trim_start().starts_with('{') {
        format!("{flag} (inline JSON)")
    } else if value.chars().count() > 60 {
        format!("{flag} (a {}-character value)", value.chars().count())
    } else {
        format!("{flag} {value}")
    }
}

/// The value of an HF flag, its spelling, and whether the shell expands it.
fn flag_value(launch: &Launch, flags: &Flags, key: &str) -> Option<(String, String, bool)> {
    let flag = flags.get(key)?;
    let value = flag.value.clone()?;
    let expands = [
        Some(flag.at),
        match flag.value_at {
            crate::launch::flags::ValueAt::Next(i) => Some(i),
            _ => None,
        },
    ]
    .into_iter()
    .flatten()
    .any(|i| launch.args.get(i).is_none_or(|a| a.expands));
    let spelled = format!("--{}", flag.spelled.trim_start_matches('-'));
    Some((value, spelled, expands))
}

/// The value of `launcher`'s own option, when `launch` is started by it.
fn launcher_option(launch: &Launch, launcher: Launcher, name: &str) -> Option<String> {
    (launch.launcher == launcher)
        .then(|| crate::job_world::launcher_option(launch, name))
        .flatten()
}

/// A JSON config as transformers takes it: an inline object (`{…}`), a file (here: from the
/// pod's ConfigMaps), or a base64 string of the JSON (accelerate's `HfDeepSpeedConfig`).
fn json_config(
    pod: &Pod,
    trainer: &Container,
    value: &str,
    named: String,
    expands: bool,
    maps: Option<&dyn ConfigMaps>,
) -> Result<JsonConfig, String> {
    if expands {
        return Err("its value is a shell expansion".into());
    }
    let object = |text: &str| {
        serde_json::from_str::<Value>(text)
            .ok()
            .filter(Value::is_object)
    };
    if value.trim_start().starts_with('{') {
        return object(value)
            .map(|value| JsonConfig {
                named: named.clone(),
                source: "inline".into(),
                value,
            })
            .ok_or_else(|| "the inline JSON does not parse as an object".into());
    }
    match mounted::read(pod, trainer, value, maps) {
        Ok(file) => object(&file.text)
            .map(|value| JsonConfig {
                named: named.clone(),
                source: file.source.clone(),
                value,
            })
            .ok_or_else(|| format!("{} is not a JSON object", file.source)),
        Err(not_mounted) => base64_json(value)
            .map(|value| JsonConfig {
                named: format!(
                    "{} (base64 JSON)",
                    named.split(' ').next().unwrap_or_default()
                ),
                source: "base64".into(),
                value,
            })
            .ok_or_else(|| not_mounted.to_string()),
    }
}

/// A value that decodes (URL-safe or standard base64) to a JSON object.
fn base64_json(value: &str) -> Option<Value> {
    use base64::Engine;
    use base64::engine::general_purpose::{STANDARD, URL_SAFE};
    // A file name is not base64 (`.` is in neither alphabet).
    if value.contains('.') {
        return None;
    }
    let bytes = URL_SAFE
        .decode(value)
        .or_else(|_| STANDARD.decode(value))
        .ok()?;
    serde_json::from_slice::<Value>(&bytes)
        .ok()
        .filter(Value::is_object)
}

/// The one rule for whether a DeepSpeed config pins the micro-batch, for every trainer that
/// names one (HF's `--deepspeed`, accelerate's config, axolotl's and LLaMA-Factory's
/// `deepspeed:` key): each of [`DEEPSPEED_PINNING_KEYS`] set to a number (or a numeric string),
/// as `key=value`. `"auto"` lets the trainer fill it in. `train_batch_size` does not pin: a
/// trade of batch for accumulation keeps it.
pub fn deepspeed_pinned(config: &Value) -> Vec<String> {
    DEEPSPEED_PINNING_KEYS
        .iter()
        .filter_map(|k| {
            let v = config.get(*k)?;
            (v.is_number() || v.as_str().is_some_and(|s| s.trim().parse::<u64>().is_ok()))
                .then(|| format!("{k}={v}"))
        })
        .collect()
}

/// Why a DeepSpeed config pins batch or accumulation ([`deepspeed_pinned`]).
fn deepspeed_pins(config: &JsonConfig) -> Option<String> {
    let pinned = deepspeed_pinned(&config.value);
    let file = if config.source.starts_with("configmap:") {
        format!("{} ({})", config.source, config.named)
    } else {
        config.named.clone()
    };
    (!pinned.is_empty()).then(|| {
        format!(
            "{file} pins {}: a DeepSpeed config, whose numbers transformers requires the flags \
             to match; set them to \"auto\" to let memguard change them",
            pinned.join(", "),
        )
    })
}

/// `true`, `"true"` (any case) as transformers' dict values are.
fn is_true(v: Option<&Value>) -> bool {
    match v {
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) => s.trim().eq_ignore_ascii_case("true"),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::ConfigMapList;
    use crate::launch::HfRules;
    use memguard_estimator::Offload;

    fn pod_with(script: &[&str]) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ml"},
            "spec": {
                "containers": [{
                    "name": "t",
                    "command": script,
                    "workingDir": "/w",
                    "volumeMounts": [{"name": "cfg", "mountPath": "/w/cfg"}],
                }],
                "volumes": [{"name": "cfg", "configMap": {"name": "ds"}}],
            },
        }))
        .expect("a pod")
    }

    fn coupled(script: &[&str], file: Option<&str>) -> Coupled {
        let pod = pod_with(script);
        let trainer = &pod.spec.as_ref().expect("spec").containers[0];
        let items: Vec<String> = script.iter().map(|s| s.to_string()).collect();
        let launch = crate::launch::find(&items).expect("a launch");
        let flags = Flags::parse(&launch.texts(), &HfRules);
        let mut maps = ConfigMapList::default();
        if let Some(text) = file {
            maps.0.insert(
                ("ml".into(), "ds".into()),
                [("c.json".to_string(), text.to_string())].into(),
            );
        }
        read(&pod, trainer, &launch, &flags, Some(&maps))
    }

    #[test]
    fn numbers_pin_the_batch_and_auto_or_the_total_does_not() {
        let ds = |text| coupled(&["python", "t.py", "--deepspeed", "cfg/c.json"], Some(text));
        let pinned = ds(r#"{"train_micro_batch_size_per_gpu": 4}"#);
        let why = pinned.batch_pinned.expect("pinned");
        assert!(
            why.starts_with(
                "configmap:ds/c.json (--deepspeed cfg/c.json) pins train_micro_batch_size_per_gpu=4"
            ),
            "{why}"
        );
        assert!(
            ds(r#"{"gradient_accumulation_steps": "8"}"#)
                .batch_pinned
                .is_some()
        );
        // `train_batch_size` is world × batch × accumulation, which memguard keeps.
        let total = ds(r#"{"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto"}"#);
        assert_eq!(total.batch_pinned, None);
        assert_eq!(
            ds(r#"{"gradient_accumulation_steps": "auto"}"#).batch_pinned,
            None
        );
        // Not a JSON object: unreadable, so it may pin.
        let bad = ds("zero_optimization: 3").batch_pinned.expect("pinned");
        assert!(bad.contains("cannot be read"), "{bad}");
    }

    #[test]
    fn a_config_nothing_holds_or_the_shell_gives_may_pin_the_batch() {
        let image = coupled(&["python", "t.py", "--deepspeed", "/opt/ds.json"], None);
        let why = image.batch_pinned.expect("pinned");
        assert!(why.contains("not in a volume mount"), "{why}");
        let shell = coupled(&["bash", "-c", "python t.py --deepspeed $DS"], None);
        assert!(
            shell
                .batch_pinned
                .expect("pinned")
                .contains("shell expansion")
        );
        assert_eq!(coupled(&["python", "t.py"], None), Coupled::default());
    }

    /// accelerate's config file and options: its DeepSpeed section pins what it gives as a
    /// number, its FSDP section turns FSDP's checkpointing on.
    #[test]
    fn accelerates_own_config_is_read() {
        let launch = |opts: &[&str], file: Option<&str>| {
            let mut words = vec!["accelerate", "launch"];
            words.extend_from_slice(opts);
            words.push("t.py");
            coupled(&words, file)
        };
        let config = &["--config_file", "cfg/c.json"];
        let ds_gas = "distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_accumulation_steps: 4\n  zero_stage: 3\n";
        let why = launch(config, Some(ds_gas)).batch_pinned.expect("pinned");
        assert!(
            why.starts_with("configmap:ds/c.json (--config_file cfg/c.json) pins deepspeed_config.gradient_accumulation_steps=4"),
            "{why}"
        );
        let ds_plain = "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n";
        assert_eq!(launch(config, Some(ds_plain)).batch_pinned, None);
        let why = launch(
            &["--use_deepspeed", "--gradient_accumulation_steps", "2"],
            None,
        )
        .batch_pinned
        .expect("pinned");
        assert!(
            why.starts_with("accelerate launch --gradient_accumulation_steps 2"),
            "{why}"
        );
        // Without DeepSpeed the option pins nothing memguard writes against.
        assert_eq!(
            launch(&["--gradient_accumulation_steps", "2"], None).batch_pinned,
            None
        );
        let in_image = "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: /opt/ds.json\n";
        assert!(
            launch(config, Some(in_image))
                .batch_pinned
                .expect("pinned")
                .contains("cannot be read")
        );
        let fsdp = "distributed_type: FSDP\nfsdp_config:\n  fsdp_activation_checkpointing: true\n";
        assert_eq!(
            launch(config, Some(fsdp))
                .fsdp_checkpointing
                .map(|f| f.source),
            Some("configmap:ds/c.json".to_string())
        );
        let fsdp_off =
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_activation_checkpointing: false\n";
        assert_eq!(launch(config, Some(fsdp_off)).fsdp_checkpointing, None);
    }

    /// The launch's sharding: HF's `--fsdp`, a DeepSpeed config's ZeRO stage, accelerate's
    /// options and config file.
    #[test]
    fn the_launchs_sharding_is_read() {
        let p = |words: &[&str], file: Option<&str>| {
            coupled(words, file)
                .parallelism
                .map(|(p, source)| (p.name().to_string(), source))
        };
        let at = |p: &str, s: &str| Some((p.to_string(), s.to_string()));
        assert_eq!(
            p(&["python", "t.py", "--fsdp", "full_shard auto_wrap"], None),
            at("fsdp", "args")
        );
        assert_eq!(
            p(&["python", "t.py", "--fsdp", "shard_grad_op"], None),
            at("zero2", "args")
        );
        assert_eq!(p(&["python", "t.py", "--fsdp", "no_shard"], None), None);
        assert_eq!(
            p(
                &["python", "t.py", "--deepspeed", "cfg/c.json"],
                Some(r#"{"zero_optimization": {"stage": 3}}"#)
            ),
            at("zero3", "configmap:ds/c.json")
        );
        assert_eq!(
            p(
                &[
                    "accelerate",
                    "launch",
                    "--use_deepspeed",
                    "--zero_stage",
                    "2",
                    "t.py"
                ],
                None
            ),
            at("zero2", "args")
        );
        assert_eq!(
            p(&["accelerate", "launch", "--use_fsdp", "t.py"], None),
            at("fsdp", "args")
        );
        assert_eq!(
            p(
                &[
                    "accelerate",
                    "launch",
                    "--config_file",
                    "cfg/c.json",
                    "t.py"
                ],
                Some(
                    "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
                )
            ),
            at("zero2", "configmap:ds/c.json")
        );
        assert_eq!(p(&["torchrun", "t.py"], None), None);
    }

    #[test]
    fn fsdps_activation_checkpointing_is_read_from_each_place() {
        let file = coupled(
            &[
                "python",
                "t.py",
                "--fsdp",
                "full_shard",
                "--fsdp_config",
                "cfg/c.json",
            ],
            Some(r#"{"activation_checkpointing": true}"#),
        );
        assert_eq!(
            file.fsdp_checkpointing.map(|f| f.source),
            Some("configmap:ds/c.json".to_string())
        );
        let off = coupled(
            &["python", "t.py", "--fsdp_config", "cfg/c.json"],
            Some(r#"{"fsdp_activation_checkpointing": false}"#),
        );
        assert_eq!(off.fsdp_checkpointing, None);
        let launcher = coupled(
            &[
                "accelerate",
                "launch",
                "--use_fsdp",
                "--fsdp_activation_checkpointing",
                "true",
                "t.py",
            ],
            None,
        );
        assert_eq!(
            launcher.fsdp_checkpointing.map(|f| f.source),
            Some("args".to_string())
        );
    }

    #[test]
    fn an_fsdp_config_gives_its_host_settings_with_their_sources() {
        let inline = coupled(
            &[
                "python",
                "t.py",
                "--fsdp",
                "full_shard",
                "--fsdp_config",
                r#"{"fsdp_state_dict_type": "SHARDED_STATE_DICT", "cpu_ram_efficient_loading": "true"}"#,
            ],
            None,
        );
        let host = &inline.host;
        assert_eq!(
            host.state_dict,
            Some(Setting {
                value: StateDict::Sharded,
                source: "args".into()
            })
        );
        // Read, and known to lower nothing at load (transformers 5.23, measured).
        assert_eq!(
            host.ram_efficient_loading,
            Some(Setting {
                value: false,
                source: INERT_AT_LOAD.into()
            })
        );
        assert_eq!(
            host.offload,
            Some(Setting {
                value: Offload::None,
                source: "default:transformers".into()
            })
        );
        let file = coupled(
            &[
                "python",
                "t.py",
                "--fsdp",
                "full_shard",
                "--fsdp_config",
                "cfg/c.json",
            ],
            Some(r#"{"state_dict_type": "FULL_STATE_DICT", "cpu_offload": true}"#),
        );
        assert_eq!(
            file.host.state_dict,
            Some(Setting {
                value: StateDict::Full,
                source: "configmap:ds/c.json".into()
            })
        );
        assert_eq!(
            file.host.offload,
            Some(Setting {
                value: Offload::ParamsAndOptimizer,
                source: "configmap:ds/c.json".into()
            })
        );
        // `--fsdp` alone: transformers' defaults, said as such; its `offload` word offloads.
        let words = coupled(&["python", "t.py", "--fsdp", "full_shard offload"], None);
        assert_eq!(
            words.host.state_dict.as_ref().map(|s| s.source.as_str()),
            Some("default:transformers")
        );
        assert_eq!(
            words
                .host
                .offload
                .as_ref()
                .map(|s| (s.value, s.source.as_str())),
            Some((Offload::ParamsAndOptimizer, "args"))
        );
        // A state dict type memguard does not size is not guessed.
        let local = coupled(
            &[
                "python",
                "t.py",
                "--fsdp",
                "full_shard",
                "--fsdp_config",
                r#"{"state_dict_type": "LOCAL_STATE_DICT"}"#,
            ],
            None,
        );
        assert_eq!(local.host.state_dict, None);
    }

    #[test]
    fn an_fsdp_config_in_the_image_leaves_its_host_settings_unknown() {
        let image = coupled(
            &[
                "python",
                "t.py",
                "--fsdp",
                "full_shard",
                "--fsdp_config",
                "/app/fsdp.json",
            ],
            None,
        );
        assert_eq!(image.host.state_dict, None);
        assert_eq!(image.host.offload, None);
        let why = image.host.unreadable.expect("said");
        assert!(
            why.contains("--fsdp_config /app/fsdp.json") && why.contains("cannot be read"),
            "{why}"
        );
    }

    #[test]
    fn a_deepspeed_config_gives_its_offload_and_its_gathered_save() {
        let ds = |text| coupled(&["python", "t.py", "--deepspeed", "cfg/c.json"], Some(text));
        let offloaded = ds(r#"{"zero_optimization": {"stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": true},
            "offload_param": {"device": "nvme"},
            "stage3_gather_16bit_weights_on_model_save": true}}"#);
        assert_eq!(
            offloaded.host.offload,
            Some(Setting {
                value: Offload::ParamsAndOptimizer,
                source: "configmap:ds/c.json".into()
            })
        );
        assert_eq!(
            offloaded.host.gathered_16bit_save,
            Some(Setting {
                value: true,
                source: "configmap:ds/c.json".into()
            })
        );
        let optimizer =
            ds(r#"{"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}"#);
        assert_eq!(
            optimizer.host.offload.as_ref().map(|s| s.value),
            Some(Offload::Optimizer)
        );
        let plain =
            ds(r#"{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none"}}}"#);
        assert_eq!(
            plain.host.offload.as_ref().map(|s| s.value),
            Some(Offload::None)
        );
        assert_eq!(
            plain.host.gathered_16bit_save,
            Some(Setting {
                value: false,
                source: "default:deepspeed".into()
            })
        );
        // A device memguard does not know is not guessed.
        let odd = ds(r#"{"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}"#);
        assert_eq!(odd.host.offload, None);
        let unread = coupled(&["python", "t.py", "--deepspeed", "/app/ds.json"], None);
        assert_eq!(unread.host.offload, None);
        assert!(unread.host.unreadable.is_some());
    }
}
