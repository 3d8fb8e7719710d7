//! Flags on a trainer's command line, read with the parser's own rules and rewritten in place.
//!
//! The rules are a value ([`FlagRules`]): Hugging Face's `HfArgumentParser` is [`HfRules`];
//! another parser (an inference server's argparse, a per-image flag map) is another value.
//! Reading keeps, for every flag, where its key and value are, so a rewrite replaces exactly
//! the value that the parser would use (the last occurrence) and nothing else.

use std::borrow::Cow;

/// How one parser reads its flags.
pub trait FlagRules {
    /// The key a spelled flag (without its leading dashes) sets, and whether this spelling
    /// negates a bool (`no_x`).
    fn key<'a>(&self, spelled: &'a str) -> (Cow<'a, str>, bool);
    /// Whether `key` is a bool: its next word is taken only when it is a bool literal.
    fn is_bool(&self, key: &str) -> bool;
    /// Whether the parser is known to define `key`, so that `--key=value` may be appended.
    fn defines(&self, key: &str) -> bool;
    /// The word's option text after its dashes (`--k=v` → `k=v`), when the parser reads the
    /// word as an option. By default only `--long` words are.
    fn option_body<'a>(&self, word: &'a str) -> Option<&'a str> {
        word.strip_prefix("--").filter(|body| !body.is_empty())
    }
    /// The words appended to set `key`, absent from the command line, to `value`.
    fn appended(&self, key: &str, value: &str) -> Vec<String> {
        vec![format!("--{key}={value}")]
    }
    /// A bool literal as the parser reads it after a bool flag (`None`: not one, so the flag
    /// does not take the word).
    fn bool_literal(&self, word: &str) -> Option<bool> {
        match word.to_ascii_lowercase().as_str() {
            "true" | "t" | "yes" | "y" | "1" => Some(true),
            "false" | "f" | "no" | "n" | "0" => Some(false),
            _ => None,
        }
    }
}

/// A bespoke argparse script's rules, from the policy's per-image flag map: only the mapped
/// flags are known (so only they are appended), each read `--k v` or `--k=v` (a single-dash
/// flag as `-k v`), the last occurrence winning; the checkpointing flag is a bool, on when bare.
#[derive(Debug, Clone, Default)]
pub struct MappedRules {
    /// Each mapped flag as written in the map (`--bs`, `-b`), with its key (`bs`, `b`).
    flags: Vec<(String, String)>,
    /// The keys of bool flags.
    bools: Vec<String>,
}

impl MappedRules {
    /// Rules for `flags` (as written in the map); `bools` among them are bools.
    pub fn new<'a>(
        flags: impl IntoIterator<Item = &'a str>,
        bools: impl IntoIterator<Item = &'a str>,
    ) -> Self {
        let key = |f: &str| f.trim_start_matches('-').to_string();
        MappedRules {
            flags: flags.into_iter().map(|f| (f.to_string(), key(f))).collect(),
            bools: bools.into_iter().map(key).collect(),
        }
    }

    /// The key a mapped flag sets (`--bs` → `bs`).
    pub fn key_of(flag: &str) -> String {
        flag.trim_start_matches('-').to_string()
    }
}

impl FlagRules for MappedRules {
    fn key<'a>(&self, spelled: &'a str) -> (Cow<'a, str>, bool) {
        (Cow::Borrowed(spelled), false)
    }
    fn is_bool(&self, key: &str) -> bool {
        self.bools.iter().any(|b| b == key)
    }
    fn defines(&self, key: &str) -> bool {
        self.flags.iter().any(|(_, k)| k == key)
    }
    fn option_body<'a>(&self, word: &'a str) -> Option<&'a str> {
        if let Some(body) = word.strip_prefix("--") {
            return (!body.is_empty()).then_some(body);
        }
        // A single-dash word is an option only when the map names it.
        let body = word.strip_prefix('-')?;
        let key = body.split('=').next().unwrap_or_default();
        self.flags
            .iter()
            .any(|(flag, k)| k == key && !flag.starts_with("--"))
            .then_some(body)
    }
    fn appended(&self, key: &str, value: &str) -> Vec<String> {
        let flag = self
            .flags
            .iter()
            .find(|(_, k)| k == key)
            .map_or_else(|| format!("--{key}"), |(f, _)| f.clone());
        if self.is_bool(key) && self.bool_literal(value) == Some(true) {
            vec![flag]
        } else {
            vec![format!("{flag}={value}")]
        }
    }
}

/// `HfArgumentParser`'s rules (transformers' `TrainingArguments`, TRL's configs, the dataclass
/// arguments of the example scripts): `--k v` and `--k=v`, `--a-b` is `--a_b`, a bool is set
/// by `--x`, `--x true|false` or `--no_x`, the last occurrence wins, and renamed keys are read
/// under their current name.
#[derive(Debug, Clone, Copy, Default)]
pub struct HfRules;

/// A key → the key it is read under: TRL 0.20 renamed `max_seq_length` to `max_length`;
/// transformers 5 named `gradient_checkpointing` `activation_checkpointing` (keeping the old
/// name as an alias), and memguard writes the name both 4.x and 5.x take.
///
/// The other sequence flags are the same knob in other dialects, each the length the script
/// cuts or pads its training sequences to: `model_max_length` (the Alpaca, FastChat/Vicuna and
/// Qwen fine-tuning scripts' `TrainingArguments` subclasses), `cutoff_len` (alpaca-lora,
/// LLaMA-Factory), `block_size` (transformers' `run_clm.py`), and `max_seq_len`, which argparse
/// reads as `max_seq_length` (a unique prefix of a long option). A rewrite keeps the spelling.
const HF_RENAMES: &[(&str, &str)] = &[
    ("max_seq_length", "max_length"),
    ("max_seq_len", "max_length"),
    ("model_max_length", "max_length"),
    ("cutoff_len", "max_length"),
    ("block_size", "max_length"),
    ("activation_checkpointing", "gradient_checkpointing"),
];

/// Flags that look like a sequence length but are not the training sequence memguard plans
/// (a part of it, or generation's): read, never warned about.
const NOT_THE_SEQUENCE: &[&str] = &[
    "max_prompt_length",
    "max_completion_length",
    "max_target_length",
    "max_new_tokens",
    "max_eval_samples",
    "max_train_samples",
    "max_steps",
    "per_device_eval_batch_size",
];

/// The keys in `flags` that look like a sequence length (`…len…`, `…seq…`, `…context…`) and
/// that memguard does not read as one: a launch names them so that a user sees what was not
/// read.
pub fn unread_sequence_flags(flags: &Flags) -> Vec<String> {
    let mut out: Vec<String> = flags
        .flags
        .iter()
        .filter(|f| {
            let k = f.key.as_str();
            let looks = k.contains("len") || k.contains("seq") || k.contains("context");
            looks && k != "max_length" && !NOT_THE_SEQUENCE.contains(&k)
        })
        .map(|f| f.spelled.clone())
        .collect();
    out.dedup();
    out
}

/// Bools of `TrainingArguments` and TRL's configs that the planner reads or writes, or that
/// often stand bare before another flag.
const HF_BOOLS: &[&str] = &[
    "gradient_checkpointing",
    "bf16",
    "fp16",
    "tf32",
    "do_train",
    "do_eval",
    "do_predict",
    "use_peft",
    "use_peft_lora",
    "use_lora",
    "lora_enable",
    "q_lora",
    "load_in_4bit",
    "load_in_8bit",
    "packing",
    "overwrite_output_dir",
    "push_to_hub",
    "report_to_none",
    "trust_remote_code",
    "use_liger_kernel",
    "use_liger",
    "remove_unused_columns",
    "group_by_length",
    "streaming",
    "auto_find_batch_size",
    "torch_compile",
    "use_flash_attn",
    "assistant_only_loss",
    "completion_only_loss",
    "dataloader_pin_memory",
    "save_only_model",
];

/// Keys every `HfArgumentParser` over `TrainingArguments` defines.
const HF_DEFINED: &[&str] = &[
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "gradient_checkpointing",
    "bf16",
    "fp16",
    "optim",
    "dataloader_num_workers",
    "dataloader_pin_memory",
    "save_only_model",
];

impl FlagRules for HfRules {
    fn key<'a>(&self, spelled: &'a str) -> (Cow<'a, str>, bool) {
        let key: Cow<'a, str> = if spelled.contains('-') {
            Cow::Owned(spelled.replace('-', "_"))
        } else {
            Cow::Borrowed(spelled)
        };
        let key = match HF_RENAMES.iter().find(|(old, _)| *old == key) {
            Some((_, new)) => Cow::Borrowed(*new),
            None => key,
        };
        // `--no_x` sets a bool `x` false (HfArgumentParser adds it for bools whose default is
        // true); an unknown `no_…` key stays itself.
        if let Some(rest) = key.strip_prefix("no_")
            && self.is_bool(rest)
        {
            return (Cow::Owned(rest.to_string()), true);
        }
        (key, false)
    }

    fn is_bool(&self, key: &str) -> bool {
        HF_BOOLS.contains(&key)
    }

    fn defines(&self, key: &str) -> bool {
        HF_DEFINED.contains(&key)
    }
}

/// Where a flag's value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueAt {
    /// In the key's own word: `--k=v`.
    Inline,
    /// The next word, at this index.
    Next(usize),
    /// Nowhere: a bare bool (`--x`) or a negation (`--no_x`).
    Bare,
}

/// One flag as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flag {
    /// The key it sets, in the parser's canonical spelling.
    pub key: String,
    /// The key word as written, up to `=`: `--per-device-train-batch-size`, `-tp`.
    pub spelled: String,
    /// The index of the key's word.
    pub at: usize,
    /// Where its value is.
    pub value_at: ValueAt,
    /// The value's text (`None` when bare).
    pub value: Option<String>,
    /// Written as a negation (`--no_x`).
    pub negated: bool,
}

/// The flags of a command line, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Flags {
    /// Every flag, in order (a key may repeat; the last one counts).
    pub flags: Vec<Flag>,
    /// The indices of the words that are not flags or their values.
    pub positionals: Vec<usize>,
    /// The index of `--`, after which every word is positional.
    pub options_end: Option<usize>,
}

/// One change to a command line's words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Edit {
    /// The word at `index` becomes `text`.
    Replace {
        /// The word's index.
        index: usize,
        /// Its new text.
        text: String,
    },
    /// A word added after the last one.
    Append(String),
}

/// Why a flag could not be set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SetError {
    /// Absent, and the parser is not known to define it: appending could break the launch.
    #[error("--{0} is not on the command line and the script's parser is not known to define it")]
    NotDefined(String),
    /// Absent, and the command line ends its options with `--`: an appended flag would be read
    /// as a positional.
    #[error("--{0} is not on the command line, which ends its options with `--`")]
    OptionsEnded(String),
}

impl Flags {
    /// Reads `args` (the words after the program) with `rules`.
    pub fn parse<S: AsRef<str>>(args: &[S], rules: &dyn FlagRules) -> Flags {
        let mut out = Flags::default();
        let mut i = 0;
        let mut options_ended = false;
        while i < args.len() {
            let word = args[i].as_ref();
            let body = rules.option_body(word).filter(|_| !options_ended);
            let Some(body) = body else {
                if word == "--" && !options_ended {
                    options_ended = true;
                    out.options_end = Some(i);
                } else {
                    out.positionals.push(i);
                }
                i += 1;
                continue;
            };
            let dashes = &word[..word.len() - body.len()];
            let (spelled_key, inline) = match body.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (body, None),
            };
            let (key, negated) = rules.key(spelled_key);
            let key = key.into_owned();
            let spelled = format!("{dashes}{spelled_key}");
            let (value_at, value) = if let Some(v) = inline {
                (ValueAt::Inline, Some(v.to_string()))
            } else if negated {
                (ValueAt::Bare, None)
            } else {
                match args.get(i + 1).map(AsRef::as_ref) {
                    Some(next) if rules.is_bool(&key) => {
                        if rules.bool_literal(next).is_some() {
                            (ValueAt::Next(i + 1), Some(next.to_string()))
                        } else {
                            (ValueAt::Bare, None)
                        }
                    }
                    Some(next) if rules.option_body(next).is_none() && next != "--" => {
                        (ValueAt::Next(i + 1), Some(next.to_string()))
                    }
                    _ => (ValueAt::Bare, None),
                }
            };
            out.flags.push(Flag {
                key,
                spelled,
                at: i,
                value_at,
                value,
                negated,
            });
            i += if matches!(value_at, ValueAt::Next(_)) {
                2
            } else {
                1
            };
        }
        out
    }

    /// The flag that sets `key` (its last occurrence: the one the parser keeps).
    pub fn get(&self, key: &str) -> Option<&Flag> {
        self.flags.iter().rev().find(|f| f.key == key)
    }

    /// The text `key` is set to (`None`: absent, or a bare bool).
    pub fn value(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(|f| f.value.as_deref())
    }

    /// A bool `key` as the parser reads it (`--x` is true, `--no_x` false).
    pub fn bool(&self, key: &str, rules: &dyn FlagRules) -> Option<bool> {
        let flag = self.get(key)?;
        if flag.negated {
            return Some(false);
        }
        match &flag.value {
            None => Some(true),
            Some(v) => rules.bool_literal(v),
        }
    }

    /// The edits that make the parser read `key` as `value`: as [`Flags::set`], but an absent
    /// key is appended in the rules' own form ([`FlagRules::appended`]: argparse servers take
    /// `--key value`, two words).
    pub fn edits(
        &self,
        key: &str,
        value: &str,
        rules: &dyn FlagRules,
    ) -> Result<Vec<Edit>, SetError> {
        if self.get(key).is_none() && rules.defines(key) && self.options_end.is_none() {
            return Ok(rules
                .appended(key, value)
                .into_iter()
                .map(Edit::Append)
                .collect());
        }
        self.set(key, value, rules).map(|edit| vec![edit])
    }

    /// The edit that makes the parser read `key` as `value`: the last occurrence's value is
    /// replaced (keeping how it was written), or `--key=value` is appended when the parser is
    /// known to define `key` (a bool turned on as the bare `--key`, which argparse's
    /// `store_true` takes too: scripts that look like HF ones often use it).
    pub fn set(&self, key: &str, value: &str, rules: &dyn FlagRules) -> Result<Edit, SetError> {
        let Some(flag) = self.get(key) else {
            return if self.options_end.is_some() {
                Err(SetError::OptionsEnded(key.to_string()))
            } else if rules.defines(key) {
                let on = rules.is_bool(key) && rules.bool_literal(value) == Some(true);
                Ok(Edit::Append(if on {
                    format!("--{key}")
                } else {
                    format!("--{key}={value}")
                }))
            } else {
                Err(SetError::NotDefined(key.to_string()))
            };
        };
        Ok(match flag.value_at {
            ValueAt::Next(index) => Edit::Replace {
                index,
                text: value.to_string(),
            },
            ValueAt::Inline => Edit::Replace {
                index: flag.at,
                text: format!("{}={value}", flag.spelled),
            },
            ValueAt::Bare if flag.negated => Edit::Replace {
                index: flag.at,
                text: format!("--{key}={value}"),
            },
            // Already on, as a bare `--key`: left as written.
            ValueAt::Bare if rules.bool_literal(value) == Some(true) => Edit::Replace {
                index: flag.at,
                text: flag.spelled.clone(),
            },
            ValueAt::Bare => Edit::Replace {
                index: flag.at,
                text: format!("{}={value}", flag.spelled),
            },
        })
    }
}

/// `words` with `edits` applied (replacements in place, appends at the end in order).
pub fn apply<S: AsRef<str>>(words: &[S], edits: &[Edit]) -> Vec<String> {
    let mut out: Vec<String> = words.iter().map(|w| w.as_ref().to_string()).collect();
    for edit in edits {
        match edit {
            Edit::Replace { index, text } => {
                if let Some(w) = out.get_mut(*index) {
                    *w = text.clone();
                }
            }
            Edit::Append(text) => out.push(text.clone()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> (Vec<String>, Flags) {
        let words: Vec<String> = s.split_whitespace().map(str::to_string).collect();
        let flags = Flags::parse(&words, &HfRules);
        (words, flags)
    }

    #[test]
    fn both_forms_both_spellings_last_wins() {
        let (_, f) = parse(
            "--per_device_train_batch_size 8 --gradient-accumulation-steps=2 \
             --per-device-train-batch-size 4 --output_dir out",
        );
        assert_eq!(f.value("per_device_train_batch_size"), Some("4"));
        assert_eq!(f.value("gradient_accumulation_steps"), Some("2"));
        assert_eq!(f.value("output_dir"), Some("out"));
    }

    #[test]
    fn bool_forms() {
        let (_, f) = parse("--gradient_checkpointing --bf16 false --packing --no_fp16 --lr 1");
        assert_eq!(f.bool("gradient_checkpointing", &HfRules), Some(true));
        assert_eq!(f.bool("bf16", &HfRules), Some(false));
        assert_eq!(f.bool("packing", &HfRules), Some(true));
        assert_eq!(f.bool("fp16", &HfRules), Some(false));
        assert_eq!(f.value("lr"), Some("1"));
        // A bare bool before a positional does not swallow it.
        let (_, f) = parse("--gradient_checkpointing config.yaml");
        assert_eq!(f.positionals, [1]);
    }

    #[test]
    fn renamed_keys_read_under_the_new_name() {
        let (_, f) = parse("--max_seq_length 4096");
        assert_eq!(f.value("max_length"), Some("4096"));
        // transformers 5's name; a rewrite keeps the spelling it found.
        let (w, f) = parse("--activation_checkpointing false --bf16");
        assert_eq!(f.bool("gradient_checkpointing", &HfRules), Some(false));
        let e = f
            .set("gradient_checkpointing", "true", &HfRules)
            .expect("test input");
        assert_eq!(
            apply(&w, &[e]),
            ["--activation_checkpointing", "true", "--bf16"]
        );
    }

    #[test]
    fn set_replaces_the_last_value_as_written() {
        let (w, f) = parse("--per-device-train-batch-size=8 --per_device_train_batch_size 4 --x 1");
        let e = f
            .set("per_device_train_batch_size", "2", &HfRules)
            .expect("test input");
        assert_eq!(
            apply(&w, &[e]).join(" "),
            "--per-device-train-batch-size=8 --per_device_train_batch_size 2 --x 1"
        );
        let (w, f) = parse("--per-device-train-batch-size=8");
        let e = f
            .set("per_device_train_batch_size", "2", &HfRules)
            .expect("test input");
        assert_eq!(apply(&w, &[e]), ["--per-device-train-batch-size=2"]);
    }

    #[test]
    fn set_bools_and_appends_only_defined_keys() {
        let (w, f) = parse("--bf16");
        let on = f
            .set("gradient_checkpointing", "true", &HfRules)
            .expect("test input");
        let out = apply(&w, &[on]);
        assert_eq!(out, ["--bf16", "--gradient_checkpointing"]);
        // Set again, the bare flag stays as it is.
        let again = Flags::parse(&out, &HfRules)
            .set("gradient_checkpointing", "true", &HfRules)
            .expect("test input");
        assert_eq!(apply(&out, &[again]), out);
        let (w, f) = parse("--no_gradient_checkpointing --bf16");
        let a = f
            .set("gradient_checkpointing", "true", &HfRules)
            .expect("test input");
        let b = f
            .set("gradient_accumulation_steps", "8", &HfRules)
            .expect("test input");
        let out = apply(&w, &[a, b]);
        assert_eq!(
            out,
            [
                "--gradient_checkpointing=true",
                "--bf16",
                "--gradient_accumulation_steps=8"
            ]
        );
        let again = Flags::parse(&out, &HfRules);
        assert_eq!(again.bool("gradient_checkpointing", &HfRules), Some(true));
        assert_eq!(again.value("gradient_accumulation_steps"), Some("8"));
        assert_eq!(
            f.set("lora_r", "8", &HfRules),
            Err(SetError::NotDefined("lora_r".into()))
        );
    }

    #[test]
    fn double_dash_ends_options() {
        let (_, f) = parse("--a 1 -- --b 2");
        assert!(f.get("b").is_none());
        assert_eq!(f.positionals, [3, 4]);
        // A flag appended after `--` would be a positional.
        assert_eq!(
            f.set("gradient_accumulation_steps", "2", &HfRules),
            Err(SetError::OptionsEnded("gradient_accumulation_steps".into()))
        );
    }
}
