//! Trainers that keep their config in a file the launch names, and take overrides on the
//! command line in their own way: axolotl, LLaMA-Factory, TRL (`--config`) and LitGPT
//! (`--config`). [`find`] recognises the launch, the file's path and the overrides as written;
//! [`ConfigLaunch::read`] reads the knobs from the file's document with the overrides merged
//! the way the trainer merges them; [`ConfigLaunch::rewrite`] writes a plan back as overrides,
//! never touching the file.
//!
//! Pure: the document is given already parsed (the caller reads the file from a ConfigMap).
//! Each trainer's rules are from its source at a pinned commit (see `docs/trainer-configs.md`).

use super::flags::Edit;
use super::launcher::{Launch, Program};
use crate::annotations::Knob;
use memguard_estimator::{Method, TrainingConfig};
use serde_json::Value;

/// A trainer whose config is a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trainer {
    /// `axolotl train cfg.yml [--micro-batch-size=2 …]` (click options).
    AxolotlCli,
    /// `python -m axolotl.cli.train cfg.yml [--micro_batch_size=2 …]` (fire keyword arguments),
    /// also under `accelerate launch -m` / `torchrun -m`.
    AxolotlModule,
    /// `llamafactory-cli train cfg.yaml [key=value …]` (OmegaConf dotlist merged over the file).
    LlamaFactory,
    /// A TRL script or `trl sft` with `--config cfg.yaml` (TrlParser: the file's values are
    /// defaults, flags override them).
    Trl,
    /// `litgpt finetune_lora … --config cfg.yaml` (jsonargparse: later words override earlier).
    LitGpt,
}

impl Trainer {
    /// The trainer's name, for messages and docs.
    pub fn name(self) -> &'static str {
        match self {
            Trainer::AxolotlCli | Trainer::AxolotlModule => "axolotl",
            Trainer::LlamaFactory => "LLaMA-Factory",
            Trainer::Trl => "TRL",
            Trainer::LitGpt => "LitGPT",
        }
    }
}

/// An override on the command line, as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Override {
    /// The key it sets, canonical (`micro_batch_size`, `train.micro_batch_size`).
    pub key: String,
    /// Its value.
    pub value: String,
    /// The index (in [`Launch::args`]) of the word holding the key.
    pub at: usize,
    /// The index of a separate value word (`--k v`), if any.
    pub value_at: Option<usize>,
    /// The key as written up to `=` (`--micro-batch-size`, `cutoff_len`).
    pub spelled: String,
    /// A word of it holds a shell expansion: its value is not known.
    pub expands: bool,
}

/// A trainer launch that names a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigLaunch {
    /// Which trainer.
    pub trainer: Trainer,
    /// The file's path as the launch names it.
    pub path: String,
    /// The overrides after it, in order (the last of a key wins).
    pub overrides: Vec<Override>,
    /// LitGPT's subcommand (`finetune_lora`), for the method.
    pub subcommand: Option<String>,
    /// LitGPT's positional checkpoint directory.
    pub checkpoint: Option<String>,
    /// Words after which nothing may be appended (`--` ends axolotl's own options).
    sealed: bool,
}

/// Where a value came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The config file.
    File,
    /// An override on the command line.
    Args,
}

/// One value read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    /// The value, as the knob reads it (`8`, `true`).
    pub value: String,
    /// Where from.
    pub origin: Origin,
    /// The trainer's key (`micro_batch_size`).
    pub key: &'static str,
}

/// What a config file and its overrides say.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reading {
    /// The knobs read, each with its value and origin.
    pub knobs: Vec<(Knob, Read)>,
    /// The model (an HF id, or a path), with its key.
    pub model: Option<(String, Read)>,
    /// The method the config trains with, when it says.
    pub method: Option<Method>,
    /// The base model's storage bits when the config quantizes it (8: axolotl's
    /// `load_in_8bit`, LLaMA-Factory's `quantization_bit: 8`; QLoRA is 4 by its method).
    pub model_bits: Option<u32>,
    /// Settings the rewrite must respect (`deepspeed`, `fsdp`), as `key: value`.
    pub coupled: Vec<String>,
}

/// Recognises a trainer launch that names a config file. `None`: not one of these trainers,
/// or no config file named.
pub fn find(launch: &Launch) -> Option<ConfigLaunch> {
    let words = launch.texts();
    let expands = |i: usize| launch.args.get(i).is_some_and(|a| a.expands);
    let mut found = match &launch.program {
        Program::Command(_) => match (launch.program.name(), words.first().copied()) {
            ("axolotl", Some("train")) => {
                axolotl_cli(&words, &expands).map(|c| c.with(Trainer::AxolotlCli))
            }
            ("llamafactory-cli" | "lmf", Some("train")) => llama_factory(&words, 1, &expands),
            ("litgpt", Some(sub)) => litgpt(sub, &words, &expands),
            ("trl", Some(_)) => trl(&words, 1, &expands),
            _ => None,
        },
        Program::Module(m) if m == "axolotl.cli.train" => {
            axolotl_fire(&words, &expands).map(|c| c.with(Trainer::AxolotlModule))
        }
        // LLaMA-Factory's own entry script (`accelerate launch src/train.py CFG.yaml`, its
        // examples' multi-GPU form) reads its arguments as `llamafactory-cli train` does.
        Program::Script(path) if path == "src/train.py" || path.ends_with("/src/train.py") => {
            llama_factory(&words, 0, &expands).or_else(|| trl(&words, 0, &expands))
        }
        Program::Script(_) | Program::Module(_) => trl(&words, 0, &expands),
    }?;
    // After a bare `--` no parser reads a word as an option: nothing is appended there.
    found.sealed |= words.contains(&"--");
    Some(found)
}

impl ConfigLaunch {
    fn with(mut self, trainer: Trainer) -> Self {
        self.trainer = trainer;
        self
    }

    fn blank(trainer: Trainer, path: String) -> Self {
        ConfigLaunch {
            trainer,
            path,
            overrides: Vec::new(),
            subcommand: None,
            checkpoint: None,
            sealed: false,
        }
    }

    /// The last override of `key` whose value is known.
    fn override_of(&self, key: &str) -> Option<&Override> {
        self.overrides.iter().rev().find(|o| o.key == key)
    }

    /// `key`: the last override, else the file's value (a dotted key is a path in it).
    fn lookup(&self, doc: &Value, key: &'static str) -> Option<Read> {
        if let Some(o) = self.override_of(key) {
            if o.expands {
                return None;
            }
            return Some(Read {
                value: o.value.clone(),
                origin: Origin::Args,
                key,
            });
        }
        let mut at = doc;
        for part in key.split('.') {
            at = at.get(part)?;
        }
        scalar(at).map(|value| Read {
            value,
            origin: Origin::File,
            key,
        })
    }

    /// The knobs the trainer's overrides can set (LitGPT's accumulation follows its batch).
    pub fn knobs(&self) -> Vec<Knob> {
        let mut out: Vec<Knob> = self.keys().iter().map(|(k, _)| *k).collect();
        if self.trainer == Trainer::LitGpt {
            out.push(Knob::GradAccumulation);
        }
        out
    }

    /// Sets the last override of `key` back to `value` of `knob` (as the knob reads it): the
    /// value the user wrote before memguard replaced it.
    pub fn restore(&mut self, key: &str, knob: Knob, value: &str) {
        let raw = match (self.trainer, knob) {
            (Trainer::LlamaFactory, Knob::GradCheckpointing) => {
                checkpointing(value).map_or_else(|| value.to_string(), |on| (!on).to_string())
            }
            _ => value.to_string(),
        };
        if let Some(o) = self.overrides.iter_mut().rev().find(|o| o.key == key) {
            o.value = raw;
        }
    }

    /// The text `key` has for the trainer (the last override, else the file's scalar).
    pub fn lookup_text(&self, doc: &Value, key: &'static str) -> Option<String> {
        self.lookup(doc, key).map(|r| r.value)
    }

    /// The trainer's key for each knob it reads.
    fn keys(&self) -> &'static [(Knob, &'static str)] {
        match self.trainer {
            Trainer::AxolotlCli | Trainer::AxolotlModule => &[
                (Knob::BatchSize, "micro_batch_size"),
                (Knob::GradAccumulation, "gradient_accumulation_steps"),
                (Knob::GradCheckpointing, "gradient_checkpointing"),
                (Knob::SeqLength, "sequence_len"),
                (Knob::LoraRank, "lora_r"),
            ],
            Trainer::LlamaFactory => &[
                (Knob::BatchSize, "per_device_train_batch_size"),
                (Knob::GradAccumulation, "gradient_accumulation_steps"),
                (Knob::GradCheckpointing, "disable_gradient_checkpointing"),
                (Knob::SeqLength, "cutoff_len"),
                (Knob::LoraRank, "lora_rank"),
            ],
            Trainer::Trl => &[
                (Knob::BatchSize, "per_device_train_batch_size"),
                (Knob::GradAccumulation, "gradient_accumulation_steps"),
                (Knob::GradCheckpointing, "gradient_checkpointing"),
                (Knob::SeqLength, "max_length"),
                (Knob::LoraRank, "lora_r"),
            ],
            Trainer::LitGpt => &[
                (Knob::BatchSize, "train.micro_batch_size"),
                (Knob::SeqLength, "train.max_seq_length"),
                (Knob::LoraRank, "lora_r"),
            ],
        }
    }

    /// Reads `doc` (the config file, parsed) with the overrides merged over it.
    pub fn read(&self, doc: &Value) -> Reading {
        let mut out = Reading::default();
        for (knob, key) in self.keys() {
            let read = match (self.trainer, knob) {
                // TRL renamed `max_seq_length` to `max_length`; a file may use either.
                (Trainer::Trl, Knob::SeqLength) => self
                    .lookup(doc, "max_length")
                    .or_else(|| self.lookup(doc, "max_seq_length")),
                _ => self.lookup(doc, key),
            };
            let Some(mut read) = read else { continue };
            if *knob == Knob::GradCheckpointing {
                let Some(on) = checkpointing(&read.value) else {
                    continue;
                };
                // LLaMA-Factory's key says the opposite.
                let on = if self.trainer == Trainer::LlamaFactory {
                    !on
                } else {
                    on
                };
                read.value = on.to_string();
            }
            out.knobs.push((*knob, read));
        }
        self.trainer_rules(doc, &mut out);
        out
    }

    fn trainer_rules(&self, doc: &Value, out: &mut Reading) {
        let get = |key: &'static str| self.lookup(doc, key);
        let is = |key: &'static str, want: &str| {
            get(key).is_some_and(|r| r.value.eq_ignore_ascii_case(want))
        };
        match self.trainer {
            Trainer::AxolotlCli | Trainer::AxolotlModule => {
                // No `gradient_accumulation_steps`: axolotl derives it from `batch_size`.
                if !has(&out.knobs, Knob::GradAccumulation)
                    && let (Some(total), Some(micro)) = (
                        get("batch_size").and_then(|r| count(&r.value).map(|n| (n, r))),
                        value_of(&out.knobs, Knob::BatchSize).and_then(count),
                    )
                    && total.0 % micro == 0
                {
                    out.knobs.push((
                        Knob::GradAccumulation,
                        Read {
                            value: (total.0 / micro).to_string(),
                            ..total.1
                        },
                    ));
                }
                out.model = get("base_model").map(|r| (r.value.clone(), r));
                let adapter = get("adapter").map(|r| r.value.to_ascii_lowercase());
                out.method = Some(match adapter.as_deref() {
                    Some("qlora") => Method::Qlora,
                    Some("lora") if is("load_in_4bit", "true") => Method::Qlora,
                    Some("lora") => Method::Lora,
                    _ => Method::Full,
                });
                if is("load_in_8bit", "true") && out.method != Some(Method::Qlora) {
                    out.model_bits = Some(8);
                }
                coupled(&get, &["deepspeed", "fsdp", "fsdp_config"], out);
            }
            Trainer::LlamaFactory => {
                // LLaMA-Factory checkpoints unless told not to, cuts at 2048 tokens and trains
                // rank-8 LoRA by default: its defaults, which the file keeps by not saying.
                let defaults = [
                    (
                        Knob::GradCheckpointing,
                        "disable_gradient_checkpointing",
                        "true",
                    ),
                    (Knob::SeqLength, "cutoff_len", "2048"),
                    (Knob::LoraRank, "lora_rank", "8"),
                ];
                for (knob, key, value) in defaults {
                    if !has(&out.knobs, knob) {
                        out.knobs.push((
                            knob,
                            Read {
                                value: value.into(),
                                origin: Origin::File,
                                key,
                            },
                        ));
                    }
                }
                out.model = get("model_name_or_path").map(|r| (r.value.clone(), r));
                let kind = get("finetuning_type").map(|r| r.value.to_ascii_lowercase());
                out.method = Some(match kind.as_deref().unwrap_or("lora") {
                    "lora" if is("quantization_bit", "4") => Method::Qlora,
                    "lora" => Method::Lora,
                    // `freeze` trains some layers: planned as full, an upper bound.
                    _ => Method::Full,
                });
                if is("quantization_bit", "8") {
                    out.model_bits = Some(8);
                }
                coupled(&get, &["deepspeed"], out);
            }
            Trainer::Trl => {
                out.model = get("model_name_or_path").map(|r| (r.value.clone(), r));
                if is("use_peft", "true") || get("lora_r").is_some() {
                    out.method = Some(if is("load_in_4bit", "true") {
                        Method::Qlora
                    } else {
                        Method::Lora
                    });
                }
                coupled(&get, &["deepspeed", "fsdp"], out);
            }
            Trainer::LitGpt => {
                // Accumulation is derived: global batch / (devices × nodes) / micro batch.
                if let (Some(global), Some(micro)) = (
                    get("train.global_batch_size"),
                    value_of(&out.knobs, Knob::BatchSize).and_then(count),
                ) && let Some(per_rank) = count(&global.value)
                    .and_then(|g| g.checked_div(self.ranks(doc)))
                    .filter(|b| *b > 0 && b % micro == 0)
                {
                    out.knobs.push((
                        Knob::GradAccumulation,
                        Read {
                            value: (per_rank / micro).to_string(),
                            ..global
                        },
                    ));
                }
                out.model = match &self.checkpoint {
                    Some(dir) => Some((
                        dir.clone(),
                        Read {
                            value: dir.clone(),
                            origin: Origin::Args,
                            key: "checkpoint_dir",
                        },
                    )),
                    None => get("checkpoint_dir").map(|r| (r.value.clone(), r)),
                };
                let sub = self.subcommand.as_deref().unwrap_or("");
                let lora = matches!(sub, "finetune_lora" | "finetune");
                let nf4 = get("quantize").is_some_and(|r| r.value.starts_with("bnb.nf4"));
                out.method = Some(match (lora, nf4) {
                    (true, true) => Method::Qlora,
                    (true, false) => Method::Lora,
                    _ => Method::Full,
                });
            }
        }
    }

    /// LitGPT's data-parallel ranks: `devices` × `num_nodes` (an unknown value counts 1).
    fn ranks(&self, doc: &Value) -> u64 {
        let n = |key| {
            self.lookup(doc, key)
                .and_then(|r| count(&r.value))
                .unwrap_or(1)
        };
        n("devices").saturating_mul(n("num_nodes")).max(1)
    }

    /// The overrides that make the trainer run `planned` instead of `before`, for the knobs in
    /// `knobs` (those read from this file or its overrides), with what changed in the
    /// trainer's words. `batch × accumulation` is kept exactly or nothing is written.
    pub fn rewrite(
        &self,
        doc: &Value,
        before: &TrainingConfig,
        planned: &TrainingConfig,
        knobs: &[Knob],
    ) -> Result<(Vec<Edit>, Vec<String>), String> {
        if planned.batch_size * planned.grad_accumulation
            != before.batch_size * before.grad_accumulation
            && (knobs.contains(&Knob::BatchSize) || knobs.contains(&Knob::GradAccumulation))
        {
            return Err(format!(
                "the plan changes the effective batch ({} × {} to {} × {})",
                before.batch_size,
                before.grad_accumulation,
                planned.batch_size,
                planned.grad_accumulation
            ));
        }
        // A knob the plan moves that this trainer has no setting for is never reported applied.
        let settable = self.knobs();
        if let Some(knob) = [Knob::GradCheckpointing, Knob::SeqLength, Knob::LoraRank]
            .into_iter()
            .find(|k| !settable.contains(k) && k.value(planned) != k.value(before))
        {
            return Err(format!(
                "{} has no setting for {} that memguard can write",
                self.trainer.name(),
                knob.name()
            ));
        }
        let reading = self.read(doc);
        // Accumulation the trainer derives from a total (axolotl's `batch_size` when the file
        // gives no `gradient_accumulation_steps`, LitGPT's `global_batch_size` always) is not
        // written: the total is kept, and the new batch divides it into the planned steps.
        let derived = reading
            .knobs
            .iter()
            .find(|(k, _)| *k == Knob::GradAccumulation)
            .is_some_and(|(_, r)| matches!(r.key, "batch_size" | "train.global_batch_size"));
        let mut edits = Vec::new();
        let mut changed = Vec::new();
        for (knob, _) in self.keys() {
            if !knobs.contains(knob) || knob.value(planned) == knob.value(before) {
                continue;
            }
            if *knob == Knob::GradAccumulation && derived {
                continue;
            }
            let key = reading
                .knobs
                .iter()
                .find(|(k, _)| k == knob)
                .map(|(_, r)| r.key)
                .unwrap_or_else(|| self.key_of(*knob));
            let value = match (self.trainer, knob) {
                (Trainer::LlamaFactory, Knob::GradCheckpointing) => {
                    (!planned.grad_checkpointing).to_string()
                }
                _ => knob.value(planned),
            };
            let (edit, spelled) = self.set(doc, key, &value)?;
            changed.push(format!(
                "{spelled} {}→{}",
                knob.value(before),
                knob.value(planned)
            ));
            edits.push(edit);
        }
        if derived && planned.grad_accumulation != before.grad_accumulation {
            if !knobs.contains(&Knob::BatchSize) {
                return Err(format!(
                    "{} derives accumulation from the batch in its file, which memguard did not \
                     read",
                    self.trainer.name()
                ));
            }
            changed.push(format!(
                "accumulation {}→{} (derived)",
                before.grad_accumulation, planned.grad_accumulation
            ));
        }
        Ok((edits, changed))
    }

    /// The trainer's key for `knob` when the file does not name it.
    fn key_of(&self, knob: Knob) -> &'static str {
        self.keys()
            .iter()
            .find(|(k, _)| *k == knob)
            .map(|(_, key)| *key)
            .unwrap_or("")
    }

    /// The edit that makes the trainer read `key` as `value`, and the key as the edit spells
    /// it: the last override's value replaced in place, else a new override in the trainer's
    /// own form.
    fn set(&self, doc: &Value, key: &str, value: &str) -> Result<(Edit, String), String> {
        if let Some(o) = self.override_of(key) {
            if o.expands {
                return Err(format!(
                    "{} is set by a shell expansion, which memguard does not rewrite",
                    o.spelled
                ));
            }
            let edit = match o.value_at {
                Some(index) => Edit::Replace {
                    index,
                    text: value.to_string(),
                },
                None => Edit::Replace {
                    index: o.at,
                    text: format!("{}={value}", o.spelled),
                },
            };
            return Ok((edit, o.spelled.clone()));
        }
        if self.sealed {
            return Err(format!(
                "{key} would be appended after `--`, where {} does not read options",
                self.trainer.name()
            ));
        }
        // axolotl with `strict: true` drops overrides of keys its file does not have.
        if matches!(self.trainer, Trainer::AxolotlCli | Trainer::AxolotlModule)
            && doc.get("strict").and_then(Value::as_bool) == Some(true)
            && doc.get(key).is_none()
        {
            return Err(format!(
                "the config is `strict: true` and has no `{key}`: axolotl would ignore an override"
            ));
        }
        let spelled = match self.trainer {
            Trainer::AxolotlCli => format!("--{}", key.replace('_', "-")),
            Trainer::LlamaFactory => key.to_string(),
            Trainer::AxolotlModule | Trainer::Trl | Trainer::LitGpt => format!("--{key}"),
        };
        Ok((Edit::Append(format!("{spelled}={value}")), spelled))
    }
}

fn has(knobs: &[(Knob, Read)], knob: Knob) -> bool {
    knobs.iter().any(|(k, _)| *k == knob)
}

fn value_of(knobs: &[(Knob, Read)], knob: Knob) -> Option<&str> {
    knobs
        .iter()
        .find(|(k, _)| *k == knob)
        .map(|(_, r)| r.value.as_str())
}

fn count(s: &str) -> Option<u64> {
    s.trim().parse().ok().filter(|n| *n > 0)
}

/// Gradient checkpointing as the trainers write it: a bool, or axolotl's `offload` modes (on).
fn checkpointing(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "offload" | "offload_disk" => Some(true),
        "false" | "0" | "no" | "null" | "none" | "~" => Some(false),
        _ => None,
    }
}

fn coupled(get: &dyn Fn(&'static str) -> Option<Read>, keys: &[&'static str], out: &mut Reading) {
    for key in keys {
        if let Some(r) = get(key).filter(|r| !r.value.is_empty() && r.value != "null") {
            out.coupled.push(format!("{key}: {}", r.value));
        }
    }
}

/// A scalar of the document as text (a mapping or a list is not a value).
fn scalar(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Null => Some("null".into()),
        Value::Array(_) | Value::Object(_) => None,
    }
}

type Expands<'a> = dyn Fn(usize) -> bool + 'a;

/// `axolotl train [options] CONFIG [--key=value | --key value …] [-- launcher args]`.
fn axolotl_cli(words: &[&str], expands: &Expands) -> Option<ConfigLaunch> {
    // axolotl's own options with a value: `--launcher`, `--cloud`, `--sweep`.
    const VALUED: &[&str] = &["--launcher", "--cloud", "--sweep"];
    // The config is the first positional; an override before it (`--micro-batch-size 2
    // cfg.yml`) takes the next word as its value, so a file-like word wins over a bare value.
    let mut positionals = Vec::new();
    let mut i = 1;
    while let Some(w) = words.get(i) {
        if *w == "--" {
            break;
        }
        if VALUED.contains(w) {
            i += 2;
            continue;
        }
        if !w.starts_with("--") {
            positionals.push((i, w.to_string()));
        }
        i += 1;
    }
    let file_like =
        |p: &str| [".yml", ".yaml", ".json"].iter().any(|e| p.ends_with(e)) || p.contains('/');
    let (at, path) = positionals
        .iter()
        .find(|(_, p)| file_like(p))
        .or_else(|| positionals.first())
        .cloned()?;
    if expands(at) {
        return None;
    }
    let mut launch = ConfigLaunch::blank(Trainer::AxolotlCli, path);
    dashed_overrides(words, 1, Some(at), expands, &mut launch, true);
    Some(launch)
}

/// `python -m axolotl.cli.train CONFIG [--key=value …]` (fire: `--config=` also names it).
fn axolotl_fire(words: &[&str], expands: &Expands) -> Option<ConfigLaunch> {
    let mut launch = ConfigLaunch::blank(Trainer::AxolotlModule, String::new());
    dashed_overrides(words, 0, None, expands, &mut launch, false);
    let named = launch.override_of("config").map(|o| o.value.clone());
    let positional = (0..words.len()).find(|&i| {
        !words[i].starts_with("--") && !launch.overrides.iter().any(|o| o.value_at == Some(i))
    });
    launch.path = match (named, positional) {
        (Some(p), _) => p,
        (None, Some(i)) if !expands(i) => words[i].to_string(),
        _ => return None,
    };
    launch.overrides.retain(|o| o.key != "config");
    Some(launch)
}

/// `--key=value` / `--key value` words from `from`, keys read with dashes as underscores,
/// skipping `skip` (the config's position); `--` ends them.
fn dashed_overrides(
    words: &[&str],
    from: usize,
    skip: Option<usize>,
    expands: &Expands,
    launch: &mut ConfigLaunch,
    click: bool,
) {
    let mut i = from;
    while let Some(w) = words.get(i) {
        if Some(i) == skip {
            i += 1;
            continue;
        }
        if *w == "--" {
            launch.sealed = true;
            break;
        }
        let Some(body) = w.strip_prefix("--").filter(|b| !b.is_empty()) else {
            i += 1;
            continue;
        };
        let (spelled, inline) = match body.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (body, None),
        };
        let key = spelled.replace('-', "_");
        let (value, value_at) = match inline {
            Some(v) => (v.to_string(), None),
            None => match words.get(i + 1) {
                Some(next) if !next.starts_with("--") && Some(i + 1) != skip => {
                    (next.to_string(), Some(i + 1))
                }
                // A bare `--x` (fire: true); click's `--no-x` is false.
                _ => match key.strip_prefix("no_").filter(|_| click) {
                    Some(_) => ("false".to_string(), None),
                    None => ("true".to_string(), None),
                },
            },
        };
        let key = match key
            .strip_prefix("no_")
            .filter(|_| click && inline.is_none())
        {
            Some(k) if value_at.is_none() => k.to_string(),
            _ => key,
        };
        launch.overrides.push(Override {
            key,
            value,
            at: i,
            value_at,
            spelled: format!("--{spelled}"),
            expands: expands(i) || value_at.is_some_and(expands),
        });
        i += if value_at.is_some() { 2 } else { 1 };
    }
}

/// `llamafactory-cli train CONFIG.yaml [key=value …]` (the config at `at`): LLaMA-Factory reads
/// a file only when that word ends `.yaml`, `.yml` or `.json`, and merges the rest as an
/// OmegaConf dotlist over it.
fn llama_factory(words: &[&str], at: usize, expands: &Expands) -> Option<ConfigLaunch> {
    let path = words.get(at)?;
    let is_config = [".yaml", ".yml", ".json"]
        .iter()
        .any(|ext| path.ends_with(ext));
    if !is_config || expands(at) {
        return None;
    }
    let mut launch = ConfigLaunch::blank(Trainer::LlamaFactory, path.to_string());
    for (i, w) in words.iter().enumerate().skip(at + 1) {
        let Some((key, value)) = w.split_once('=') else {
            continue;
        };
        launch.overrides.push(Override {
            key: key.to_string(),
            value: value.to_string(),
            at: i,
            value_at: None,
            spelled: key.to_string(),
            expands: expands(i),
        });
    }
    Some(launch)
}

/// TRL (`trl sft …`, a script with TrlParser): `--config FILE`; every HF flag overrides the
/// file wherever it stands.
fn trl(words: &[&str], from: usize, expands: &Expands) -> Option<ConfigLaunch> {
    use super::flags::{Flags, HfRules, ValueAt};
    let flags = Flags::parse(&words[from.min(words.len())..], &HfRules);
    let shift = |i: usize| i + from;
    let mut launch = match flags.get("config") {
        Some(config) => {
            let path = config.value.clone()?;
            if expands(shift(config.at))
                || matches!(config.value_at, ValueAt::Next(i) if expands(shift(i)))
            {
                return None;
            }
            ConfigLaunch::blank(Trainer::Trl, path)
        }
        None => {
            // `HfArgumentParser`'s file conventions: the first positional word a `.json` or
            // `.yaml` file (transformers' examples: `script.py args.json`; the alignment
            // handbook's `script.py recipe.yaml --key=value`). Its values are the defaults the
            // flags after it override, as with TRL's `--config`. Whether the script accepts
            // more words is its own: nothing is appended (only a flag there is replaced).
            let at = *flags.positionals.first()?;
            let path = words.get(shift(at))?;
            let file = [".json", ".yaml", ".yml"].iter().any(|x| path.ends_with(x));
            if !file || expands(shift(at)) {
                return None;
            }
            let mut launch = ConfigLaunch::blank(Trainer::Trl, path.to_string());
            launch.sealed = true;
            launch
        }
    };
    for f in flags.flags.iter().filter(|f| f.key != "config") {
        let value = match (&f.value, f.negated) {
            (_, true) => "false".to_string(),
            (Some(v), false) => v.clone(),
            (None, false) => "true".to_string(),
        };
        let value_at = match f.value_at {
            ValueAt::Next(i) => Some(shift(i)),
            _ => None,
        };
        launch.overrides.push(Override {
            key: f.key.clone(),
            value,
            at: shift(f.at),
            value_at,
            spelled: f.spelled.clone(),
            expands: expands(shift(f.at)) || value_at.is_some_and(expands),
        });
    }
    Some(launch)
}

/// `litgpt finetune_lora [CHECKPOINT] --config FILE [--key value …]`: jsonargparse applies
/// words in order, so only what follows `--config` overrides the file.
fn litgpt(sub: &str, words: &[&str], expands: &Expands) -> Option<ConfigLaunch> {
    let sub = sub.to_string();
    if !matches!(
        sub.as_str(),
        "finetune" | "finetune_lora" | "finetune_full" | "pretrain"
    ) {
        return None;
    }
    let config = words
        .iter()
        .position(|w| *w == "--config" || w.starts_with("--config="))?;
    let (path, after) = match words[config].strip_prefix("--config=") {
        Some(p) => (p.to_string(), config + 1),
        None => (words.get(config + 1)?.to_string(), config + 2),
    };
    if expands(config) || expands(after - 1) {
        return None;
    }
    let mut launch = ConfigLaunch::blank(Trainer::LitGpt, path);
    launch.subcommand = Some(sub);
    // The checkpoint directory: the first positional before `--config`.
    let mut j = 1;
    while j < config {
        let w = words[j];
        if w.starts_with("--") {
            j += if w.contains('=') { 1 } else { 2 };
            continue;
        }
        if !expands(j) {
            launch.checkpoint = Some(w.to_string());
        }
        break;
    }
    let mut tail = ConfigLaunch::blank(Trainer::LitGpt, String::new());
    dashed_overrides(words, after, None, expands, &mut tail, false);
    launch.overrides = tail.overrides;
    launch.sealed = tail.sealed;
    Some(launch)
}

#[cfg(test)]
mod tests;
