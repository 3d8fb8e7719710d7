//! Reading a trainer's own launch: its command line with each dialect's rules (HF flags,
//! flag maps, `tune run`, ms-swift), the config file it names, what the launch leaves to its
//! parser (cited defaults, or unknown), and what to say when no model is read.

use super::*;
/// The knobs a launch's own parser may set without memguard seeing it. Of them, the batch and
/// the sequence decide the verdict ([`TrainingPod::guessed`]); an unknown accumulation pins
/// the batch (the product could not be kept); an unknown checkpointing is planned off, the
/// larger figure, and turning it on is safe whatever it was.
pub const PARSER_KNOBS: [Knob; 4] = [
    Knob::BatchSize,
    Knob::GradAccumulation,
    Knob::GradCheckpointing,
    Knob::SeqLength,
];

/// The [`PARSER_KNOBS`] that decide the verdict: while one is unknown, no verdict is claimed.
pub const VERDICT_KNOBS: [Knob; 2] = [Knob::BatchSize, Knob::SeqLength];

/// The [`PARSER_KNOBS`] of a launch read with HF rules that are neither given by an
/// annotation or a mapped variable, nor read, nor a known default of its parser: each with the
/// flag or annotation that would say it. Launches read otherwise (a flag map, `tune run`, a
/// config-file trainer) have every knob at a known default.
pub(crate) fn unknown_knobs(
    args: Option<&ArgsReading>,
    given: &BTreeSet<Knob>,
    sources: &BTreeMap<Knob, String>,
) -> BTreeMap<Knob, String> {
    let Some(args) = args.filter(|a| a.tune.is_none()) else {
        return BTreeMap::new();
    };
    // A flag map (the policy's, or ms-swift's) names the flag that says each knob.
    let mapped = |k: Knob| {
        args.flag_map
            .as_ref()
            .and_then(|m| m.iter().find(|(knob, _)| *knob == k))
            .map(|(_, f)| f.clone())
    };
    PARSER_KNOBS
        .into_iter()
        .filter(|k| {
            !given.contains(k) && !sources.contains_key(k) && !args.defaults.contains_key(k)
        })
        .map(|k| {
            let flag = HF_FLAGS
                .iter()
                .find(|(knob, _)| *knob == k)
                .map_or("", |(_, f)| *f);
            let add = match mapped(k) {
                Some(f) => f,
                None if args.flag_map.is_some() => "a flag for it to the policy's flag map".into(),
                None if k == Knob::SeqLength => {
                    "its sequence flag (--max_length, --model_max_length, …)".to_string()
                }
                None => format!("--{flag}"),
            };
            (k, format!("add {add} or annotate memguard.io/{}", k.name()))
        })
        .collect()
}

/// A trainer's config file read from the ConfigMap its launch names, with the overrides on its
/// command line.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigFileReading {
    /// The container's `command` followed by its `args`.
    pub items: Vec<String>,
    /// How many of `items` are `command`.
    pub command_len: usize,
    /// The launch in them.
    pub launch: crate::launch::Launch,
    /// The trainer, the file and the overrides as written (memguard's own included).
    pub config: crate::launch::config_file::ConfigLaunch,
    /// The file, parsed.
    pub doc: serde_json::Value,
    /// Where it came from, `configmap:<name>/<key>`.
    pub source: String,
    /// What the trainer reads: the file under the overrides the user wrote (an override
    /// memguard wrote at an earlier admission is read as the value it replaced).
    pub reading: crate::launch::config_file::Reading,
    /// The DeepSpeed config the file names (`deepspeed: ds.json`), with its path: parsed when it
    /// is in a ConfigMap too, else why not. A pinned micro-batch there conflicts with a rewrite.
    pub deepspeed: Option<(String, Result<serde_json::Value, String>)>,
}

/// What memguard wrote at an earlier admission (reinvocation, a pod recreated from its own
/// output), from its estimate annotation.
pub(crate) fn earlier_estimate(pod: &Pod) -> Option<crate::estimate::EstimateAnnotation> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(annotations::ESTIMATE))
        .and_then(|text| crate::estimate::EstimateAnnotation::parse(text).ok())
}

/// The trainer's own value of `knob`, given the value found now: a value equal to what memguard
/// wrote earlier is memguard's, and the value read then is the trainer's (`None`: memguard
/// added it, the trainer set nothing).
pub(crate) fn as_read<'a>(
    earlier: Option<&'a crate::estimate::EstimateAnnotation>,
    knob: Knob,
    found: &'a str,
) -> Option<&'a str> {
    match earlier.filter(|e| e.config.get(knob.name()).map(String::as_str) == Some(found)) {
        Some(e) => e.read.get(knob.name()).map(String::as_str),
        None => Some(found),
    }
}

/// A trainer's command line read with Hugging Face argument rules (HF Trainer, TRL scripts).
#[derive(Debug, Clone, PartialEq)]
pub struct ArgsReading {
    /// The container's `command` followed by its `args`.
    pub items: Vec<String>,
    /// How many of `items` are `command`.
    pub command_len: usize,
    /// The launch in them.
    pub launch: crate::launch::Launch,
    /// The dialect it was read with, and is rewritten with.
    pub dialect: Dialect,
    /// Its flags.
    pub flags: crate::launch::Flags,
    /// Whether its parser is known to be `HfArgumentParser` over `TrainingArguments` (a flag
    /// only that defines, or a TRL launch): then the flags it defines may be appended.
    pub hf_parser: bool,
    /// The knobs the launch leaves out that run at its parser's known default, with the
    /// citation (`default:trl`): a knob neither read nor here is unknown.
    pub defaults: BTreeMap<Knob, &'static str>,
    /// Flags that look like a sequence length and that memguard does not read as one.
    pub unread_sequence_flags: Vec<String>,
    /// The policy's flag map for the trainer's image (knob → flag as written), when one
    /// matches: the launch was read, and is rewritten, with [`crate::launch::MappedRules`].
    pub flag_map: Option<Vec<(Knob, String)>>,
    /// A `tune run` launch (its `flags` are then empty: torchtune takes `key=value` overrides).
    pub tune: Option<TuneReading>,
}

/// A `tune run` launch as read.
#[derive(Debug, Clone, PartialEq)]
pub struct TuneReading {
    /// The recipe, config and overrides.
    pub run: crate::launch::tune::TuneRun,
    /// The method its model component trains (`lora`, `qlora`, `full`), when known: LoRA
    /// overrides are written only to a LoRA model.
    pub method: Option<&'static str>,
}

/// The torchtune config key of each knob.
pub const TUNE_KEYS: &[(Knob, &str)] = &[
    (Knob::BatchSize, crate::launch::tune::BATCH_SIZE),
    (
        Knob::GradAccumulation,
        crate::launch::tune::GRAD_ACCUMULATION,
    ),
    (
        Knob::GradCheckpointing,
        crate::launch::tune::ACTIVATION_CHECKPOINTING,
    ),
    (Knob::SeqLength, crate::launch::tune::MAX_SEQ_LEN),
    (Knob::LoraRank, crate::launch::tune::LORA_RANK),
];

/// What a `tune run`'s config says: its knobs' values, its model component, and the source
/// to name (`config:<name>` for a built-in config, `configmap:<name>/<key>` for a file).
pub(crate) struct TuneConfig {
    pub(crate) values: Vec<(&'static str, String)>,
    pub(crate) component: Option<String>,
    pub(crate) source: String,
}

/// The config of `run`: a built-in one's defaults, or its file read from the ConfigMap the
/// trainer mounts it from. `Err`: the file cannot be read, and why.
pub(crate) fn tune_config(
    pod: &Pod,
    trainer: &Container,
    run: &crate::launch::tune::TuneRun,
    cluster: Cluster<'_>,
) -> Result<TuneConfig, String> {
    use crate::launch::tune::{self, ConfigRef};
    match &run.config {
        ConfigRef::Builtin(b) => Ok(TuneConfig {
            values: b.values.iter().map(|(k, v)| (*k, v.to_string())).collect(),
            component: Some(b.component.to_string()),
            source: format!("config:{}", b.name),
        }),
        ConfigRef::File(path) => {
            let file = crate::mounted::read(pod, trainer, path, cluster.config_maps)
                .map_err(|e| format!("tune run --config {path}: {e}"))?;
            let y = tune::yaml_values(&file.text)
                .map_err(|e| format!("tune run --config {path} ({}): {e}", file.source))?;
            Ok(TuneConfig {
                values: y.values,
                component: y.component,
                source: file.source,
            })
        }
    }
}

/// The HF flag that carries each knob, in its canonical spelling.
pub const HF_FLAGS: &[(Knob, &str)] = &[
    (Knob::BatchSize, "per_device_train_batch_size"),
    (Knob::GradAccumulation, "gradient_accumulation_steps"),
    (Knob::GradCheckpointing, "gradient_checkpointing"),
    (Knob::SeqLength, "max_length"),
    (Knob::LoraRank, "lora_r"),
];

/// The trainer's `command` followed by its `args` (what a launch is found in), and how many of
/// them are `command` (a rewrite splits them back there).
pub(crate) fn command_items(trainer: &Container) -> (Vec<String>, usize) {
    let command = trainer.command.clone().unwrap_or_default();
    let command_len = command.len();
    let items = command
        .into_iter()
        .chain(trainer.args.clone().unwrap_or_default())
        .collect();
    (items, command_len)
}

/// ms-swift's `swift sft|pt|rlhf`: `HfArgumentParser` over its own arguments (ms-swift 3.x,
/// `swift/llm/argument/train_args.py`), `--model`, `--train_type`, `--lora_rank`.
pub(crate) fn is_swift(launch: &crate::launch::Launch) -> bool {
    launch.program.name() == "swift"
        && launch
            .texts()
            .first()
            .is_some_and(|sub| matches!(*sub, "sft" | "pt" | "rlhf"))
}

/// ms-swift's flag for each knob, read and rewritten as a flag map with its own names.
pub(crate) fn swift_flags() -> crate::policy::FlagMap {
    crate::policy::FlagMap {
        image: String::new(),
        flags: [
            (Knob::BatchSize, "--per_device_train_batch_size"),
            (Knob::GradAccumulation, "--gradient_accumulation_steps"),
            (Knob::GradCheckpointing, "--gradient_checkpointing"),
            (Knob::SeqLength, "--max_length"),
            (Knob::LoraRank, "--lora_rank"),
        ]
        .into_iter()
        .map(|(k, f)| (k, f.to_string()))
        .collect(),
    }
}

/// The method of a `swift` launch: `--tuner_type` or `--train_type` (ms-swift's default `lora`; `full` is full
/// fine-tuning), QLoRA with `--quant_bits 4`, an 8-bit base with `--quant_bits 8`.
pub(crate) fn swift_method(
    flags: &crate::launch::Flags,
) -> (Option<memguard_estimator::Method>, Option<(u32, String)>) {
    use memguard_estimator::Method;
    // ms-swift 3.x renamed `--train_type` to `--tuner_type`, keeping the old name.
    let tuner = flags
        .value("tuner_type")
        .or_else(|| flags.value("train_type"));
    let adapters = tuner.unwrap_or("lora") != "full";
    match flags.value("quant_bits") {
        Some("4") if adapters => (Some(Method::Qlora), None),
        Some("8") if adapters => (Some(Method::Lora), Some((8, "args".to_string()))),
        _ => (adapters.then_some(Method::Lora), None),
    }
}

/// Whether `flag` and its value are written out in `launch`, not words the shell or the kubelet
/// expands (`$MODEL`): only then is the value read the one that runs.
fn literal(launch: &crate::launch::Launch, flag: &crate::launch::flags::Flag) -> bool {
    let value_at = match flag.value_at {
        crate::launch::flags::ValueAt::Next(i) => Some(i),
        _ => None,
    };
    [Some(flag.at), value_at]
        .into_iter()
        .flatten()
        .all(|i| launch.args.get(i).is_some_and(|a| !a.expands))
}

/// The flags that name the model in a launch with HF rules: HF scripts, then TRL's `trl sft`.
/// `--model_id` and `--model_name` last: ms-swift's `--model_name` names the model being
/// taught its own name, and `--model` comes first there.
pub(crate) const HF_MODEL_FLAGS: &[&str] =
    &["model_name_or_path", "model", "model_id", "model_name"];

/// What a launch says about the model: its HF id and whether it trains LoRA adapters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LaunchModel {
    /// The flag as written and its value, for messages.
    pub(crate) flag: String,
    pub(crate) value: String,
    /// The HF id (`org/name`; a cache path `…/models--org--name/snapshots/…` read as one).
    pub(crate) id: String,
    /// The method it trains with: `--use_peft` or `--lora_r` (TRL) is LoRA; a config file
    /// says (`adapter`, `finetuning_type`, …); `None`: full.
    pub(crate) method: Option<memguard_estimator::Method>,
    /// Where the model was read: `None` the command line, else the config file's source.
    pub(crate) source: Option<String>,
    /// Where the method was read, likewise.
    pub(crate) method_source: Option<String>,
    /// The base model's storage bits the config file sets (8-bit LoRA), with its source.
    pub(crate) model_bits: Option<(u32, String)>,
    /// Other annotations the launch implies, with the name the estimate's sources give them
    /// and their source (`tune run`'s `*_distributed` recipes shard with FSDP over
    /// `nproc_per_node × nnodes`: `args`; its config's `dtype`: the config).
    pub(crate) implied: Vec<(&'static str, &'static str, String, String)>,
}

/// The model a launch names (`Ok(None)`: no HF launch, or no model flag, or a value that is
/// shell-expanded); `Err`: the launch cannot be read, and why.
pub(crate) fn launch_model(
    pod: &Pod,
    trainer: &Container,
    launch: &TrainerLaunch,
    cluster: Cluster<'_>,
) -> Result<Option<LaunchModel>, String> {
    use crate::launch::HfRules;
    // Without the policy's flag map: the model is read with the launch's own rules.
    let dialect = launch.dialect(false)?;
    if let Some((_, run)) = launch.tune_run().filter(|_| dialect == Some(Dialect::Tune)) {
        let config = tune_config(pod, trainer, run, cluster)?;
        let Some(component) = config.component else {
            return Ok(None);
        };
        let Some((id, method)) = crate::launch::tune::component_model(&component) else {
            return Err(format!(
                "tune run's model component {component} ({}) is not one memguard knows",
                config.source
            ));
        };
        let mut implied = Vec::new();
        // torchtune trains in its config's dtype throughout (no fp32 master weights): the
        // estimator's pure-bf16 (or fp32) regime, not mixed precision.
        let dtype = config
            .values
            .iter()
            .find(|(k, _)| *k == crate::launch::tune::DTYPE)
            .map(|(_, v)| v.as_str());
        let (dtype, dtype_source) = match run.value(crate::launch::tune::DTYPE, dtype) {
            Some((v, crate::launch::tune::Origin::Args)) => (v, "args".to_string()),
            Some((v, _)) => (v, config.source.clone()),
            // Every built-in config of the pinned commit sets `dtype: bf16`.
            None => ("bf16".to_string(), config.source.clone()),
        };
        let precision = match dtype.as_str() {
            "fp32" | "float32" => "fp32",
            "fp16" | "float16" => "fp16",
            _ => "bf16",
        };
        implied.push((
            annotations::PRECISION,
            "precision",
            precision.to_string(),
            dtype_source,
        ));
        if run.recipe.ends_with("_distributed") {
            // torchtune's distributed recipes shard parameters, gradients and optimizer state
            // with FSDP over every rank.
            let args = || "args".to_string();
            implied.push((
                annotations::PARALLELISM,
                "parallelism",
                "fsdp".to_string(),
                args(),
            ));
            let count = |v: &Option<String>| v.as_deref().and_then(|n| n.parse::<u64>().ok());
            if let (Some(nproc), Some(nnodes)) = (count(&run.nproc_per_node), count(&run.nnodes))
                && nnodes > 1
            {
                let world = (nproc * nnodes).to_string();
                implied.push((annotations::WORLD_SIZE, "world-size", world, args()));
            }
        }
        let method = match method {
            "qlora" => Some(memguard_estimator::Method::Qlora),
            "lora" => Some(memguard_estimator::Method::Lora),
            _ => None,
        };
        return Ok(Some(LaunchModel {
            flag: "--config".into(),
            value: component,
            id: id.to_string(),
            method,
            // The model component is the config's: a built-in one or a mounted file.
            source: Some(config.source.clone()),
            method_source: Some(config.source),
            model_bits: None,
            implied,
        }));
    }
    let Some((found, flags)) = launch.hf() else {
        return Ok(None);
    };
    let Some(flag) = HF_MODEL_FLAGS.iter().find_map(|k| flags.get(k)) else {
        return Ok(None);
    };
    // A value the shell expands (`$MODEL`) is not the model.
    let Some(value) = flag.value.clone().filter(|_| literal(found, flag)) else {
        return Ok(None);
    };
    let on = |key| flags.bool(key, &HfRules) == Some(true);
    // TRL's `--use_peft`, PEFT's examples' `--use_peft_lora`, the Qwen and FastChat scripts'
    // `--use_lora` / `--lora_enable`, or a rank given (`--lora_r`, `--lora_rank`).
    let lora = ["use_peft", "use_peft_lora", "use_lora", "lora_enable"]
        .iter()
        .any(|k| on(k))
        || ["lora_r", "lora_rank"]
            .iter()
            .any(|k| flags.get(k).is_some());
    // TRL's `get_quantization_config`: 4 bits first, then 8 (`--use_bnb_nested_quant` only
    // refines the 4-bit one). TRL trains a quantized base only through adapters: a 4-bit base
    // is QLoRA, an 8-bit one LoRA on an 8-bit base.
    let (method, model_bits) = if is_swift(found) {
        swift_method(flags)
    } else if on("load_in_4bit") || on("q_lora") {
        // `--q_lora` (FastChat, Qwen): LoRA on a 4-bit bitsandbytes base.
        (Some(memguard_estimator::Method::Qlora), None)
    } else if on("load_in_8bit") {
        (
            Some(memguard_estimator::Method::Lora),
            Some((8, "args".to_string())),
        )
    } else {
        (lora.then_some(memguard_estimator::Method::Lora), None)
    };
    let mut implied = Vec::new();
    let args = || "args".to_string();
    // `--use_bnb_nested_quant` with 4 bits: the quantization constants quantized again.
    if on("load_in_4bit") && on("use_bnb_nested_quant") {
        implied.push((
            annotations::DOUBLE_QUANT,
            "double-quant",
            "true".into(),
            args(),
        ));
    }
    // Liger's kernels (`TrainingArguments.use_liger_kernel`, ms-swift's and TRL's too) fuse the
    // LM head with the cross-entropy: the estimator's fused loss.
    if on("use_liger_kernel") || on("use_liger") {
        implied.push((annotations::LOSS, "loss", "fused".into(), args()));
    }
    let adapters = method.is_some_and(|m| m != memguard_estimator::Method::Full);
    if let Some(targets) = hf_lora_targets(flags).filter(|_| adapters) {
        implied.push((annotations::LORA_TARGETS, "lora-targets", targets, args()));
    }
    // Dropout on the adapters' input keeps a mask per adapted projection.
    if let Some(dropout) = flags.value("lora_dropout").filter(|_| adapters)
        && let Ok(p) = dropout.trim().parse::<f64>()
    {
        let on = if p > 0.0 { "true" } else { "false" };
        implied.push((annotations::LORA_DROPOUT, "lora-dropout", on.into(), args()));
    }
    Ok(Some(LaunchModel {
        flag: format!("--{}", flag.spelled.trim_start_matches('-')),
        id: hf_model_id(&value),
        value,
        method,
        source: None,
        method_source: None,
        model_bits,
        implied,
    }))
}

/// What memguard saw of a trainer whose launch names no model it reads: the program it
/// recognised (or why none), the part not read and why, and what to add. For the skip message
/// of a pod opted in with the label alone.
pub(crate) fn unread_launch(trainer: Option<(&Container, &TrainerLaunch)>) -> String {
    use crate::launch::{HfRules, LaunchError, Program};
    let Some((trainer, trainer_launch)) = trainer else {
        return "no trainer container was found".into();
    };
    let add = format!("annotate {} (and the knobs it runs at)", annotations::MODEL);
    let launch = match &trainer_launch.found {
        Ok(launch) => launch,
        Err(LaunchError::Empty) => {
            return format!(
                "the trainer `{}` has no command or args: its image's entrypoint runs, which \
                 memguard cannot read; {add}",
                trainer.name
            );
        }
        Err(e) => {
            let mut shown = trainer_launch.items.join(" ");
            if shown.chars().count() > 80 {
                shown = format!("{}…", shown.chars().take(80).collect::<String>());
            }
            return format!("`{shown}` is not a launch memguard reads ({e}); {add}");
        }
    };
    let program = match &launch.program {
        Program::Module(m) => format!("python -m {m}"),
        p => p.name().to_string(),
    };
    let flags = crate::launch::Flags::parse(&launch.texts(), &HfRules);
    let model_flag = HF_MODEL_FLAGS.iter().find_map(|k| flags.get(k));
    let why = match model_flag {
        Some(f) => format!(
            "its {} is `{}`, a value the shell or the kubelet gives that memguard could not \
             resolve",
            f.spelled,
            f.value.as_deref().unwrap_or_default()
        ),
        None if flags.flags.is_empty() && !launch.args.is_empty() => format!(
            "its arguments (`{}`) are not flags memguard reads: a config file or script \
             arguments in {program}'s own format",
            launch
                .args
                .iter()
                .take(3)
                .map(|a| a.text.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        ),
        None => format!(
            "it names no model with a flag memguard reads (--{})",
            HF_MODEL_FLAGS.join(", --")
        ),
    };
    format!("memguard recognised {program}, but {why}; {add}")
}

/// The LoRA target modules a launch names (`--lora_target_modules`, ms-swift's
/// `--target_modules`, LLaMA-Factory's `--lora_target`), as the estimator's list: `all-linear`
/// (or `all`), or projection names (`q_proj,v_proj`, `[q_proj,v_proj]`). A value it cannot
/// map (another architecture's module names) is not read.
pub(crate) fn hf_lora_targets(flags: &crate::launch::Flags) -> Option<String> {
    let value = ["lora_target_modules", "target_modules", "lora_target"]
        .iter()
        .find_map(|k| flags.value(k))?;
    let cleaned: String = value
        .chars()
        .filter(|c| !matches!(c, '[' | ']' | '"' | '\'' | ' '))
        .collect();
    cleaned
        .parse::<memguard_estimator::LoraTargets>()
        .ok()
        .map(|t| t.to_list())
}

/// `…/hub/models--meta-llama--Llama-3.1-8B/snapshots/<sha>` → `meta-llama/Llama-3.1-8B` (the
/// HF cache layout); anything else as it is.
pub(crate) fn hf_model_id(value: &str) -> String {
    value
        .split('/')
        .find_map(|part| part.strip_prefix("models--"))
        .map(|repo| repo.replace("--", "/"))
        .unwrap_or_else(|| value.to_string())
}

/// The model the trainer's launch names in its flags ([`launch_model`]), else in the config
/// file it names; the method from the flags (LoRA), else from the file. `Err`: neither could be
/// read, and why.
pub(crate) fn launch_or_file_model(
    pod: &Pod,
    trainer: &Container,
    launch: &TrainerLaunch,
    cluster: Cluster<'_>,
    file: &Result<Option<ConfigFileReading>, String>,
) -> Result<Option<LaunchModel>, String> {
    use crate::launch::config_file::{Origin, Trainer};
    let flags = launch_model(pod, trainer, launch, cluster);
    let file = match file {
        Ok(file) => file,
        Err(_) if matches!(flags, Ok(Some(_))) => &None,
        Err(why) => return flags.and(Err(why.clone())),
    };
    let Some(file) = file else {
        return flags;
    };
    let method = file.reading.method;
    let method_source = Some(file.source.clone());
    if let Some(mut m) = flags? {
        if m.method.is_none() && method.is_some_and(|m| m != memguard_estimator::Method::Full) {
            m.method = method;
            m.method_source = method_source;
        }
        return Ok(Some(m));
    }
    let Some((value, read)) = &file.reading.model else {
        return Ok(None);
    };
    let id = match file.config.trainer {
        // LitGPT's checkpoint directory ends `<org>/<name>` (`checkpoints/meta-llama/…`).
        Trainer::LitGpt => {
            let parts: Vec<&str> = value.trim_end_matches('/').rsplit('/').take(2).collect();
            match parts.as_slice() {
                [name, org] => format!("{org}/{name}"),
                _ => value.clone(),
            }
        }
        _ => hf_model_id(value),
    };
    let source = match read.origin {
        Origin::Args => None,
        Origin::File => Some(file.source.clone()),
    };
    Ok(Some(LaunchModel {
        flag: match &source {
            Some(s) => format!("`{}` in {s}", read.key),
            None => read.key.to_string(),
        },
        value: value.clone(),
        id,
        method,
        source,
        method_source,
        model_bits: file.reading.model_bits.map(|b| (b, file.source.clone())),
        implied: Vec::new(),
    }))
}

/// The config file the trainer's launch names ([`crate::launch::config_file`]), read from the
/// pod's ConfigMaps. `Ok(None)`: the launch names none; `Err`: it names one that cannot be
/// read, and why.
pub(crate) fn read_config_file(
    pod: &Pod,
    trainer: &Container,
    launch: &TrainerLaunch,
    cluster: Cluster<'_>,
) -> Result<Option<ConfigFileReading>, String> {
    use crate::launch::config_file;
    let Ok(found) = &launch.found else {
        return Ok(None);
    };
    let Some(config) = config_file::find(found) else {
        return Ok(None);
    };
    let name = config.trainer.name();
    let file = crate::mounted::read(pod, trainer, &config.path, cluster.config_maps)
        .map_err(|e| format!("{name}'s config `{}` was not read: {e}", config.path))?;
    let doc: serde_json::Value = if config.path.ends_with(".json") {
        serde_json::from_str(&file.text)
            .map_err(|e| format!("{name}'s config {} is not valid JSON: {e}", file.source))?
    } else {
        serde_saphyr::from_str(&file.text)
            .map_err(|e| format!("{name}'s config {} is not valid YAML: {e}", file.source))?
    };
    if !doc.is_object() {
        return Err(format!("{name}'s config {} is not a mapping", file.source));
    }
    // An override memguard wrote at an earlier admission (it holds the value planned then, and
    // that differs from the value read then) is not the trainer's: the value read then counts
    // when it came from the command line (memguard replaced the user's word), the file's
    // otherwise (memguard appended the word).
    let earlier = &launch.earlier;
    let mut own = config.clone();
    for (knob, read) in config.read(&doc).knobs {
        let Some(e) = earlier.as_ref().filter(|e| {
            read.origin == config_file::Origin::Args
                && e.config.get(knob.name()) == Some(&read.value)
                && e.read.get(knob.name()) != Some(&read.value)
        }) else {
            continue;
        };
        let users = e.sources.get(knob.name()).is_some_and(|s| s == "args");
        match e.read.get(knob.name()).filter(|_| users) {
            Some(value) => own.restore(read.key, knob, value),
            None => own.overrides.retain(|o| o.key != read.key),
        }
    }
    let reading = own.read(&doc);
    let deepspeed = own
        .lookup_text(&doc, "deepspeed")
        .filter(|p| !p.is_empty() && p != "null")
        .map(|path| {
            let parsed = crate::mounted::read(pod, trainer, &path, cluster.config_maps)
                .map_err(|e| e.to_string())
                .and_then(|f| {
                    serde_json::from_str(&f.text)
                        .map_err(|e| format!("{} is not valid JSON: {e}", f.source))
                });
            (path, parsed)
        });
    Ok(Some(ConfigFileReading {
        items: launch.items.clone(),
        command_len: launch.command_len,
        launch: found.clone(),
        config,
        doc,
        source: file.source,
        reading,
        deepspeed,
    }))
}

/// Reads a bespoke script's command line with the policy's flag map for its image: the
/// knobs it maps, from the flags as written (`--bs 16`, `--bs=16`; the last wins), for the
/// knobs no annotation gives, each recorded as `args`. Any program: the map says the script
/// defines these flags.
pub(crate) fn read_mapped_flags(
    launch: &TrainerLaunch,
    dialect: Dialect,
    parsed: &TrainingAnnotations,
    config: &mut TrainingConfig,
    sources: &mut BTreeMap<Knob, String>,
    map: &crate::policy::FlagMap,
) -> Result<Option<ArgsReading>, String> {
    use crate::launch::{Flags, LaunchError, MappedRules};
    let found = match &launch.found {
        Ok(found) => found,
        Err(LaunchError::Empty | LaunchError::NoProgram) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let bools = map
        .flags
        .iter()
        .filter(|(k, _)| **k == Knob::GradCheckpointing)
        .map(|(_, f)| f.as_str());
    let rules = MappedRules::new(map.flags.values().map(String::as_str), bools);
    let flags = Flags::parse(&found.texts(), &rules);
    let earlier = &launch.earlier;
    for (knob, flag) in &map.flags {
        if parsed.knobs_given.contains(knob) {
            continue;
        }
        let key = MappedRules::key_of(flag);
        let Some(f) = flags.get(&key) else { continue };
        let known = literal(found, f);
        let value = if *knob == Knob::GradCheckpointing {
            flags.bool(&key, &rules).map(|b| b.to_string())
        } else {
            f.value.clone()
        };
        if known
            && let Some(value) = value
            && let Some(value) = as_read(earlier.as_ref(), *knob, &value)
            && knob.set(config, value)
        {
            sources.insert(*knob, "args".into());
        }
    }
    Ok(Some(ArgsReading {
        items: launch.items.clone(),
        command_len: launch.command_len,
        launch: found.clone(),
        dialect,
        flags,
        hf_parser: false,
        defaults: BTreeMap::new(),
        unread_sequence_flags: Vec::new(),
        flag_map: Some(map.flags.iter().map(|(k, f)| (*k, f.clone())).collect()),
        tune: None,
    }))
}

/// Reads the trainer's command line with HF rules into `config`, for the knobs no annotation
/// gives; each knob read is recorded in `sources` as `args`. `Ok(None)`: no launch, or not one
/// with HF rules; `Err`: a launch that cannot be read, and why.
#[allow(clippy::too_many_arguments)]
pub(crate) fn read_args(
    pod: &Pod,
    trainer: &Container,
    trainer_launch: &TrainerLaunch,
    parsed: &TrainingAnnotations,
    config: &mut TrainingConfig,
    sources: &mut BTreeMap<Knob, String>,
    cluster: Cluster<'_>,
    policy: &Policy,
) -> Result<Option<ArgsReading>, String> {
    use crate::launch::{self, HfRules};
    let image = trainer.image.as_deref().unwrap_or_default();
    let map = policy.flag_map_for(image);
    let dialect = trainer_launch.dialect(map.is_some())?;
    if let (Some(Dialect::Mapped), Some(map)) = (dialect, map) {
        return read_mapped_flags(
            trainer_launch,
            Dialect::Mapped,
            parsed,
            config,
            sources,
            map,
        );
    }
    if dialect == Some(Dialect::Swift) {
        let mut reading = read_mapped_flags(
            trainer_launch,
            Dialect::Swift,
            parsed,
            config,
            sources,
            &swift_flags(),
        )?;
        // ms-swift's own `TrainingArguments` (`swift/trainers/arguments.py`): 1 per device,
        // checkpointing on. Its accumulation is derived at run time (16 / batch / world size)
        // and its sequence from the model's config: both unknown when left out.
        for (knob, value) in [(Knob::BatchSize, "1"), (Knob::GradCheckpointing, "true")] {
            if !parsed.knobs_given.contains(&knob) && !sources.contains_key(&knob) {
                knob.set(config, value);
                if let Some(r) = reading.as_mut() {
                    r.defaults.insert(knob, "default:ms-swift");
                }
            }
        }
        return Ok(reading);
    }
    if let Some((found, run)) = trainer_launch
        .tune_run()
        .filter(|_| dialect == Some(Dialect::Tune))
    {
        let tc = tune_config(pod, trainer, run, cluster)?;
        let earlier = &trainer_launch.earlier;
        for (knob, key) in TUNE_KEYS {
            if parsed.knobs_given.contains(knob) {
                continue;
            }
            let base = tc
                .values
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str());
            let Some((value, origin)) = run.value(key, base) else {
                continue;
            };
            let found = match *knob {
                // YAML's and OmegaConf's `True`.
                Knob::GradCheckpointing => match launch::tune::parse_bool(&value) {
                    Some(b) => b.to_string(),
                    None => continue,
                },
                _ => value,
            };
            if let Some(value) = as_read(earlier.as_ref(), *knob, &found)
                && knob.set(config, value)
            {
                // An override memguard appended earlier stands for what the trainer had, from
                // where it had it: a second admission says the same.
                let earlier_source = earlier
                    .as_ref()
                    .filter(|e| e.config.get(knob.name()) == Some(&found))
                    .and_then(|e| e.sources.get(knob.name()).cloned());
                let source = match (earlier_source, origin) {
                    (Some(source), _) => source,
                    (None, launch::tune::Origin::Args) => "args".to_string(),
                    (None, launch::tune::Origin::Config) => tc.source.clone(),
                };
                sources.insert(*knob, source);
            }
        }
        let method = tc
            .component
            .as_deref()
            .and_then(launch::tune::component_model)
            .map(|(_, method)| method);
        return Ok(Some(ArgsReading {
            items: trainer_launch.items.clone(),
            command_len: trainer_launch.command_len,
            launch: found.clone(),
            dialect: Dialect::Tune,
            flags: launch::Flags::default(),
            hf_parser: false,
            defaults: BTreeMap::new(),
            unread_sequence_flags: Vec::new(),
            flag_map: None,
            tune: Some(TuneReading {
                run: run.clone(),
                method,
            }),
        }));
    }
    let Some((found, flags)) = trainer_launch.hf().filter(|_| dialect == Some(Dialect::Hf)) else {
        return Ok(None);
    };
    for (knob, key) in HF_FLAGS {
        if parsed.knobs_given.contains(knob) {
            continue;
        }
        let Some(flag) = flags.get(key) else { continue };
        if !literal(found, flag) {
            continue;
        }
        let value = if *knob == Knob::GradCheckpointing {
            flags.bool(key, &HfRules).map(|b| b.to_string())
        } else {
            flag.value.clone()
        };
        let earlier = &trainer_launch.earlier;
        if let Some(value) = value
            && let Some(read) = as_read(earlier.as_ref(), *knob, &value)
            && knob.set(config, read)
        {
            // memguard's own flag (appended over a config file's value) keeps the source
            // the value was read from then.
            let source = earlier
                .as_ref()
                .filter(|e| e.config.get(knob.name()) == Some(&value))
                .and_then(|e| e.sources.get(knob.name()))
                .cloned()
                .unwrap_or_else(|| "args".into());
            sources.insert(*knob, source);
        }
    }
    // A knob the launch leaves out runs at its parser's default where memguard knows the
    // parser (TRL, transformers' example scripts); in a bespoke script it is unknown.
    let parser = hf_parser(found, flags);
    let mut defaults = BTreeMap::new();
    for (knob, value) in &parser.defaults {
        if !parsed.knobs_given.contains(knob) && !sources.contains_key(knob) {
            knob.set(config, value);
            defaults.insert(*knob, parser.citation);
        }
    }
    let unread_sequence_flags = crate::launch::flags::unread_sequence_flags(flags);
    Ok(Some(ArgsReading {
        items: trainer_launch.items.clone(),
        command_len: trainer_launch.command_len,
        launch: found.clone(),
        dialect: Dialect::Hf,
        flags: flags.clone(),
        hf_parser: parser.accepts_training_arguments,
        defaults,
        unread_sequence_flags,
        flag_map: None,
        tune: None,
    }))
}

/// What memguard knows of the parser of a launch with HF rules.
pub(crate) struct HfParser {
    /// The parser is `HfArgumentParser` over `TrainingArguments` (or a TRL config, its
    /// subclass): it accepts the flags `TrainingArguments` defines, so they may be appended
    /// where their current value is known.
    pub(crate) accepts_training_arguments: bool,
    /// The values the knobs the launch leaves out run at, where the script's parser and its
    /// defaults are fixed and known; empty for a bespoke script, whose own dataclasses or
    /// `TrainingArguments` subclass may set any default.
    pub(crate) defaults: Vec<(Knob, &'static str)>,
    /// Where `defaults` come from, as the estimate's sources name it.
    pub(crate) citation: &'static str,
}

/// transformers' example scripts (`examples/pytorch/*/run_*.py`): `HfArgumentParser` over
/// stock `TrainingArguments` (8 per device, accumulation 1, no checkpointing), and for the
/// language-modeling ones the sequence they cut to when `--block_size` / `--max_seq_length` is
/// left out: `min(1024, tokenizer.model_max_length)`, 1024 for every catalog model.
pub(crate) const TRANSFORMERS_EXAMPLES: &[(&str, Option<&str>)] = &[
    ("run_clm.py", Some("1024")),
    ("run_mlm.py", Some("1024")),
    ("run_plm.py", None),
    ("run_glue.py", None),
    ("run_ner.py", None),
    ("run_qa.py", None),
    ("run_summarization.py", None),
    ("run_translation.py", None),
    ("run_swag.py", None),
];

/// The parser of a launch with HF rules ([`HfParser`]): TRL's (the `trl` command, `trl/scripts/…`
/// or TRL's `examples/scripts/…`, or TRL's `--use_peft`), whose base config turns checkpointing
/// on and whose SFT, DPO, reward, KTO, CPO, ORPO and PRM configs cut sequences at `max_length`
/// 1024 (any other TRL trainer's sequence is unknown);
/// transformers' example scripts ([`TRANSFORMERS_EXAMPLES`]); else a bespoke script, which
/// accepts `TrainingArguments`' flags when it is given one only that defines, and whose
/// defaults memguard does not know.
pub(crate) fn hf_parser(launch: &crate::launch::Launch, flags: &crate::launch::Flags) -> HfParser {
    use crate::launch::Program;
    let program = &launch.program;
    let trl = match program {
        Program::Command(_) => program.name() == "trl",
        // TRL's own layout: its package's scripts, and the repository's examples (its docs
        // launch them as `python examples/scripts/orpo.py …`).
        Program::Script(path) => {
            path.contains("trl/scripts/") || path.contains("examples/scripts/")
        }
        Program::Module(m) => m.starts_with("trl."),
    } || flags.get("use_peft").is_some();
    let training_arguments = [
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "output_dir",
    ]
    .iter()
    .any(|k| flags.get(k).is_some());
    let stock = [
        (Knob::BatchSize, "8"),
        (Knob::GradAccumulation, "1"),
        (Knob::GradCheckpointing, "false"),
    ];
    if trl {
        let mut defaults = stock.to_vec();
        defaults[2].1 = "true";
        // The trainer: `trl sft`'s subcommand, else the script's name (`…/dpo.py`).
        let trainer = match program {
            Program::Command(_) => launch.args.first().map_or("", |a| a.text.as_str()),
            _ => program.name().trim_end_matches(".py"),
        };
        if ["sft", "dpo", "reward", "kto", "cpo", "orpo", "prm"].contains(&trainer) {
            defaults.push((Knob::SeqLength, "1024"));
        }
        return HfParser {
            accepts_training_arguments: true,
            defaults,
            citation: "default:trl",
        };
    }
    let example = match program {
        Program::Script(_) => TRANSFORMERS_EXAMPLES
            .iter()
            .find(|(name, _)| program.name() == *name),
        _ => None,
    };
    if let Some((_, seq)) = example {
        let mut defaults = stock.to_vec();
        defaults.extend(seq.map(|s| (Knob::SeqLength, s)));
        return HfParser {
            accepts_training_arguments: true,
            defaults,
            citation: "default:transformers-example",
        };
    }
    HfParser {
        accepts_training_arguments: training_arguments,
        defaults: Vec::new(),
        citation: "",
    }
}
