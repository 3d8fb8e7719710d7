//! Inference servers' launches: `vllm serve MODEL`, `python -m
//! vllm.entrypoints.openai.api_server --model M` and `python -m sglang.launch_server
//! --model-path M`, found by [`find_by`] (also inside `bash -c`, after `exec`, `env`,
//! `NAME=value` or other commands), their memory flags read with each engine's argparse rules
//! ([`ServerRules`]) and rewritten through the launch's own edits, every other byte kept.
//!
//! The rules are those of vLLM v0.10 (`EngineArgs.add_cli_args`, `FlexibleArgumentParser`) and
//! SGLang v0.4.9 (`ServerArgs.add_cli_args`): `--k v` or `--k=v`, the last occurrence wins,
//! switches take no value (`--enforce-eager`, `--no-enforce-eager`), vLLM also reads `_` for
//! `-` in a key and `k`/`K`-style integers.

use super::flags::{FlagRules, Flags, SetError};
use super::launcher::{Argv, ArgvEdit, Launch, Launcher, Program, find_by};
use memguard_estimator::serving_fit::{Engine, ServerSettings};
use memguard_estimator::{Bytes, ModelShape};
use std::borrow::Cow;

/// The flags that decide a server's memory, by their canonical key (written `--key`).
#[derive(Debug, Clone, Copy)]
pub struct MemoryFlags {
    /// Maximum sequence length.
    pub max_length: &'static str,
    /// Memory fraction.
    pub fraction: &'static str,
    /// Tensor-parallel size.
    pub tensor_parallel: &'static str,
    /// Cache element type.
    pub kv_cache_dtype: &'static str,
    /// Running sequences at most.
    pub max_sequences: &'static str,
    /// Tokens of one prefill forward.
    pub batched_tokens: &'static str,
    /// Weight quantization.
    pub quantization: &'static str,
    /// Weight and activation type.
    pub dtype: &'static str,
}

/// vLLM's (v0.10 `EngineArgs.add_cli_args`).
pub const VLLM_FLAGS: MemoryFlags = MemoryFlags {
    max_length: "max-model-len",
    fraction: "gpu-memory-utilization",
    tensor_parallel: "tensor-parallel-size",
    kv_cache_dtype: "kv-cache-dtype",
    max_sequences: "max-num-seqs",
    batched_tokens: "max-num-batched-tokens",
    quantization: "quantization",
    dtype: "dtype",
};

/// SGLang's (v0.4.9 `ServerArgs.add_cli_args`).
pub const SGLANG_FLAGS: MemoryFlags = MemoryFlags {
    max_length: "context-length",
    fraction: "mem-fraction-static",
    tensor_parallel: "tp-size",
    kv_cache_dtype: "kv-cache-dtype",
    max_sequences: "max-running-requests",
    batched_tokens: "chunked-prefill-size",
    quantization: "quantization",
    dtype: "dtype",
};

/// An engine's argparse rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerRules(pub Engine);

/// Other spellings of a key: (spelled, canonical). vLLM's short options, SGLang's aliases.
const VLLM_ALIASES: &[(&str, &str)] = &[("tp", "tensor-parallel-size"), ("q", "quantization")];
const SGLANG_ALIASES: &[(&str, &str)] = &[
    ("tensor-parallel-size", "tp-size"),
    // argparse takes a unique prefix: `--model` is `--model-path`.
    ("model", "model-path"),
];
/// Single-dash options (vLLM's `-tp 2`, `-q awq`).
const VLLM_SHORT: &[&str] = &["tp", "q"];

/// Switches (`store_true` / `BooleanOptionalAction`): they never take the next word.
const VLLM_SWITCHES: &[&str] = &[
    "enforce-eager",
    "trust-remote-code",
    "enable-prefix-caching",
    "enable-chunked-prefill",
    "enable-lora",
    "enable-auto-tool-choice",
    "disable-log-requests",
    "disable-log-stats",
    "disable-custom-all-reduce",
];
const SGLANG_SWITCHES: &[&str] = &[
    "trust-remote-code",
    "enable-torch-compile",
    "enable-dp-attention",
    "enable-metrics",
    "disable-radix-cache",
    "disable-cuda-graph",
    "skip-tokenizer-init",
];

impl ServerRules {
    /// The engine's memory flags.
    pub fn memory_flags(self) -> MemoryFlags {
        match self.0 {
            Engine::Vllm => VLLM_FLAGS,
            Engine::Sglang => SGLANG_FLAGS,
        }
    }

    fn aliases(self) -> &'static [(&'static str, &'static str)] {
        match self.0 {
            Engine::Vllm => VLLM_ALIASES,
            Engine::Sglang => SGLANG_ALIASES,
        }
    }
}

impl FlagRules for ServerRules {
    fn key<'a>(&self, spelled: &'a str) -> (Cow<'a, str>, bool) {
        // vLLM's FlexibleArgumentParser reads `--max_model_len` as `--max-model-len`.
        let key: Cow<'a, str> = match self.0 {
            Engine::Vllm if spelled.contains('_') => Cow::Owned(spelled.replace('_', "-")),
            _ => Cow::Borrowed(spelled),
        };
        let key = match self.aliases().iter().find(|(alias, _)| *alias == key) {
            Some((_, canonical)) => Cow::Borrowed(*canonical),
            None => key,
        };
        if let Some(rest) = key.strip_prefix("no-")
            && self.is_bool(rest)
        {
            return (Cow::Owned(rest.to_string()), true);
        }
        (key, false)
    }

    fn is_bool(&self, key: &str) -> bool {
        match self.0 {
            Engine::Vllm => VLLM_SWITCHES.contains(&key),
            Engine::Sglang => SGLANG_SWITCHES.contains(&key),
        }
    }

    fn defines(&self, key: &str) -> bool {
        let f = self.memory_flags();
        [
            f.max_length,
            f.fraction,
            f.tensor_parallel,
            f.kv_cache_dtype,
            f.max_sequences,
            f.batched_tokens,
            f.quantization,
            f.dtype,
        ]
        .contains(&key)
    }

    fn option_body<'a>(&self, word: &'a str) -> Option<&'a str> {
        if let Some(body) = word.strip_prefix("--") {
            return Some(body).filter(|b| !b.is_empty());
        }
        let body = word.strip_prefix('-')?;
        let name = body.split_once('=').map_or(body, |(k, _)| k);
        (self.0 == Engine::Vllm && VLLM_SHORT.contains(&name)).then_some(body)
    }

    fn appended(&self, key: &str, value: &str) -> Vec<String> {
        vec![format!("--{key}"), value.to_string()]
    }

    fn bool_literal(&self, _word: &str) -> Option<bool> {
        // A switch never takes a value.
        None
    }
}

/// Weight quantization methods that store 4-bit weights, and those that store 8-bit ones.
const FOUR_BIT: &[&str] = &[
    "awq",
    "awq_marlin",
    "gptq",
    "gptq_marlin",
    "marlin",
    "bitsandbytes",
    "gguf",
    "moe_wna16",
];
const EIGHT_BIT: &[&str] = &[
    "fp8",
    "fbgemm_fp8",
    "w8a8_fp8",
    "w8a8_int8",
    "modelopt",
    "qqq",
];

/// vLLM's OpenAI server module.
pub const VLLM_MODULE: &str = "vllm.entrypoints.openai.api_server";
/// SGLang's server module.
pub const SGLANG_MODULE: &str = "sglang.launch_server";
/// The model vLLM serves when `--model` is absent (`ModelConfig`'s default).
pub const VLLM_DEFAULT_MODEL: &str = "facebook/opt-125m";

/// A recognised server launch.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerLaunch {
    /// The engine.
    pub engine: Engine,
    /// The model as the command line names it (a Hugging Face id or a path).
    pub model: String,
    argv: Argv,
    launch: Launch,
    flags: Flags,
}

/// Whether `launch` starts a server memguard fits (vLLM or SGLang).
pub fn starts_server(launch: &Launch) -> bool {
    recognise(launch).is_some()
}

/// The engine and model of a launch, when it starts a server.
fn recognise(launch: &Launch) -> Option<(Engine, String)> {
    let texts = launch.texts();
    match (&launch.launcher, &launch.program) {
        (Launcher::Direct, Program::Command(_))
            if launch.program.name() == "vllm" && texts.first() == Some(&"serve") =>
        {
            let model = match texts.get(1) {
                Some(m) if !m.starts_with('-') => m.to_string(),
                _ => Flags::parse(&texts, &ServerRules(Engine::Vllm))
                    .value("model")
                    .unwrap_or(VLLM_DEFAULT_MODEL)
                    .to_string(),
            };
            Some((Engine::Vllm, model))
        }
        (Launcher::Python, Program::Module(m)) if m == VLLM_MODULE => {
            let model = Flags::parse(&texts, &ServerRules(Engine::Vllm))
                .value("model")
                .unwrap_or(VLLM_DEFAULT_MODEL)
                .to_string();
            Some((Engine::Vllm, model))
        }
        (Launcher::Python, Program::Module(m)) if m == SGLANG_MODULE => {
            let model = Flags::parse(&texts, &ServerRules(Engine::Sglang))
                .value("model-path")?
                .to_string();
            Some((Engine::Sglang, model))
        }
        _ => None,
    }
}

impl ServerLaunch {
    /// The server launched by a container's `command` and `args`, if any (`has_args`: the spec
    /// has an `args` field, even empty).
    pub fn find(command: &[String], args: &[String], has_args: bool) -> Option<ServerLaunch> {
        let argv = Argv::new(Some(command), has_args.then_some(args));
        let launch = find_by(&argv.items, &starts_server).ok()?;
        ServerLaunch::of(argv, launch)
    }

    /// The server `launch` starts, found in `argv` (a pod's one search of its command line,
    /// [`crate::pod::TrainerLaunch`]); `None` when it starts none.
    pub fn of(argv: Argv, launch: Launch) -> Option<ServerLaunch> {
        let (engine, model) = recognise(&launch)?;
        let flags = Flags::parse(&launch.texts(), &ServerRules(engine));
        Some(ServerLaunch {
            engine,
            model,
            argv,
            launch,
            flags,
        })
    }

    /// The engine's rules.
    pub fn rules(&self) -> ServerRules {
        ServerRules(self.engine)
    }

    /// The engine's memory flags.
    pub fn flags(&self) -> MemoryFlags {
        self.rules().memory_flags()
    }

    /// Whether the launch is inside a shell script.
    pub fn in_script(&self) -> bool {
        matches!(
            self.launch.args.first().map(|a| &a.place),
            Some(super::launcher::Place::Shell { .. })
        )
    }

    /// The value of flag `key` (its last occurrence, under any spelling).
    pub fn flag(&self, key: &str) -> Option<&str> {
        self.flags.value(key)
    }

    /// Whether switch `key` is on: present, and not turned off by a later `--no-…`.
    pub fn switch(&self, key: &str) -> bool {
        self.flags.bool(key, &self.rules()) == Some(true)
    }

    /// The server's memory settings for `model` (`model_bits`: the storage a policy model
    /// names), from its flags. Every unreadable value is an error naming its flag.
    pub fn settings(
        &self,
        model: ModelShape,
        model_bits: Option<u32>,
    ) -> Result<ServerSettings, Vec<String>> {
        let f = self.flags();
        let mut errors = Vec::new();
        let mut s = ServerSettings::new(self.engine, model);
        // `auto` (KAITO, newer vLLM) and `-1` leave the length to the engine.
        if let Some(v) = self.flag(f.max_length)
            && v != "auto"
            && v != "-1"
            && let Some(n) = self.count(&mut errors, f.max_length)
        {
            s.serving.max_seq_length = n;
            s.max_length_given = true;
        }
        s.tensor_parallel = self.count(&mut errors, f.tensor_parallel).unwrap_or(1);
        s.max_sequences = self.count(&mut errors, f.max_sequences);
        s.batched_tokens = self.count(&mut errors, f.batched_tokens);
        if let Some(v) = self.flag(f.fraction) {
            match v.parse::<f64>() {
                Ok(x) if x > 0.0 && x <= 1.0 => s.fraction = Some(x),
                _ => errors.push(format!("--{} {v:?} is not in (0, 1]", f.fraction)),
            }
        }
        let float32 = self
            .flag(f.dtype)
            .is_some_and(|d| matches!(d, "float32" | "float"));
        s.serving.model_bits = match self.flag(f.quantization) {
            Some(q) if FOUR_BIT.contains(&q) => 4,
            Some(q) if EIGHT_BIT.contains(&q) => 8,
            _ => model_bits.unwrap_or(if float32 { 32 } else { 16 }),
        };
        s.serving.kv_cache_bits = match self.flag(f.kv_cache_dtype) {
            Some(d) if d.starts_with("fp8") => 8,
            Some("auto") | None => {
                if float32 {
                    32
                } else {
                    16
                }
            }
            Some(other) => {
                errors.push(format!("--{} {other:?} is not known", f.kv_cache_dtype));
                16
            }
        };
        if self.engine == Engine::Vllm {
            s.enforce_eager = self.switch("enforce-eager");
            if let Some(v) = self.flag("kv-cache-memory-bytes") {
                match human_int(v) {
                    Some(n) if n > 0 => s.kv_cache_memory = Some(Bytes(n)),
                    _ => errors.push(format!("--kv-cache-memory-bytes {v:?} is not a size")),
                }
            }
        }
        if errors.is_empty() {
            Ok(s)
        } else {
            Err(errors)
        }
    }

    fn count(&self, errors: &mut Vec<String>, key: &str) -> Option<u64> {
        let v = self.flag(key)?;
        match human_int(v) {
            Some(n) if n > 0 => Some(n),
            _ => {
                errors.push(format!("--{key} {v:?} is not a positive integer"));
                None
            }
        }
    }

    /// The argv edits that set each `(key, value)`: the last occurrence's value replaced as
    /// written, or `--key value` appended to the launch. `Err`: a flag that cannot be written
    /// (absent after a `--`), and why.
    pub fn rewrite(&self, set: &[(&str, String)]) -> Result<Vec<ArgvEdit>, SetError> {
        let rules = self.rules();
        let mut edits = Vec::new();
        for (key, value) in set {
            edits.extend(self.flags.edits(key, value, &rules)?);
        }
        Ok(self.argv.edits(&self.launch, &edits))
    }
}

/// vLLM's human-readable integers (`human_readable_int`): `25600`, `1k` = 1000, `1K` = 1024,
/// `m`/`M`, `g`/`G` likewise.
pub fn human_int(v: &str) -> Option<u64> {
    let v = v.trim();
    let (digits, mult) = match v.char_indices().last()? {
        (i, 'k') => (&v[..i], 1_000),
        (i, 'K') => (&v[..i], 1 << 10),
        (i, 'm') => (&v[..i], 1_000_000),
        (i, 'M') => (&v[..i], 1 << 20),
        (i, 'g') => (&v[..i], 1_000_000_000),
        (i, 'G') => (&v[..i], 1 << 30),
        _ => (v, 1),
    };
    if mult == 1 {
        return digits.parse().ok();
    }
    let x: f64 = digits.parse().ok()?;
    (x.is_finite() && x >= 0.0).then_some((x * mult as f64) as u64)
}

#[cfg(test)]
mod tests;
