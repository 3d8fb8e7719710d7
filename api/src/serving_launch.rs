//! Inference-server launch lines: recognising `vllm serve MODEL`, `python -m
//! vllm.entrypoints.openai.api_server --model M` and `python -m sglang.launch_server --model-path
//! M` in a container's command and args (also inside `bash -c`), reading their memory flags
//! (argparse rules: `--k v` or `--k=v`, last wins; vLLM also takes `_` for `-`) and rewriting
//! them in place, every other byte kept.
//!
//! To be folded into `api/src/launch` (the shared command-line reader of the trainer-config
//! issue: shell words with byte spans, launcher detection, a flag reader per rule set): this is
//! the minimal reading the serving rules need, kept in one place until then.

use memguard_estimator::serving_fit::{Engine, ServerSettings};
use memguard_estimator::{Bytes, ModelShape};
use std::ops::Range;

/// The flags that decide a server's memory, each with its aliases (first: the one written).
#[derive(Debug, Clone, Copy)]
pub struct MemoryFlags {
    /// Maximum sequence length.
    pub max_length: &'static [&'static str],
    /// Memory fraction.
    pub fraction: &'static [&'static str],
    /// Tensor-parallel size.
    pub tensor_parallel: &'static [&'static str],
    /// Cache element type.
    pub kv_cache_dtype: &'static [&'static str],
    /// Running sequences at most.
    pub max_sequences: &'static [&'static str],
    /// Tokens of one prefill forward.
    pub batched_tokens: &'static [&'static str],
    /// Weight quantization.
    pub quantization: &'static [&'static str],
    /// Weight and activation type.
    pub dtype: &'static [&'static str],
}

/// vLLM's (v0.10 `EngineArgs.add_cli_args`).
pub const VLLM_FLAGS: MemoryFlags = MemoryFlags {
    max_length: &["--max-model-len"],
    fraction: &["--gpu-memory-utilization"],
    tensor_parallel: &["--tensor-parallel-size", "-tp"],
    kv_cache_dtype: &["--kv-cache-dtype"],
    max_sequences: &["--max-num-seqs"],
    batched_tokens: &["--max-num-batched-tokens"],
    quantization: &["--quantization", "-q"],
    dtype: &["--dtype"],
};

/// SGLang's (v0.4.9 `ServerArgs.add_cli_args`).
pub const SGLANG_FLAGS: MemoryFlags = MemoryFlags {
    max_length: &["--context-length"],
    fraction: &["--mem-fraction-static"],
    tensor_parallel: &["--tp-size", "--tensor-parallel-size"],
    kv_cache_dtype: &["--kv-cache-dtype"],
    max_sequences: &["--max-running-requests"],
    batched_tokens: &["--chunked-prefill-size"],
    quantization: &["--quantization"],
    dtype: &["--dtype"],
};

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

/// One shell word: its text (quotes removed) and its bytes in the source.
#[derive(Debug, Clone, PartialEq)]
pub struct Word {
    /// The word as the program receives it.
    pub text: String,
    /// Where it is in its source (an argv element, or the script of `bash -c`).
    pub span: Range<usize>,
    /// The argv element it is (for a script, the script's element).
    pub element: usize,
    /// A command separator (`;`, `&&`, `|`, newline…), not a word.
    pub separator: bool,
}

/// A container field that holds argv.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// `command`.
    Command,
    /// `args`.
    Args,
}

impl Field {
    /// The field's name in the pod spec.
    pub fn name(self) -> &'static str {
        match self {
            Field::Command => "command",
            Field::Args => "args",
        }
    }
}

/// One change to a container's argv, in the order they apply.
#[derive(Debug, Clone, PartialEq)]
pub enum ArgvEdit {
    /// Element `index` of `field` becomes `value`.
    Replace {
        /// The field.
        field: Field,
        /// Its element.
        index: usize,
        /// The new value.
        value: String,
    },
    /// `value` is appended to `field` (created when absent).
    Append {
        /// The field.
        field: Field,
        /// The new element.
        value: String,
    },
}

/// A recognised server launch.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerLaunch {
    /// The engine.
    pub engine: Engine,
    /// The model as the command line names it (a Hugging Face id or a path).
    pub model: String,
    /// The launch's words, from the program to the end of its simple command.
    words: Vec<Word>,
    /// Index in `words` where the flags start.
    flags_from: usize,
    /// Where the words live.
    site: Site,
    /// How many argv elements are in `command` (the rest are in `args`).
    command_len: usize,
    /// `args` is present in the spec.
    has_args: bool,
}

#[derive(Debug, Clone, PartialEq)]
enum Site {
    /// Word `i` is argv element `i`.
    Argv,
    /// The words are in this script, argv element `element` (`bash -c SCRIPT`).
    Script { element: usize, script: String },
}

/// vLLM's OpenAI server module.
pub const VLLM_MODULE: &str = "vllm.entrypoints.openai.api_server";
/// SGLang's server module.
pub const SGLANG_MODULE: &str = "sglang.launch_server";
/// The model vLLM serves when `--model` is absent (`ModelConfig`'s default).
pub const VLLM_DEFAULT_MODEL: &str = "facebook/opt-125m";

impl ServerLaunch {
    /// The server launched by a container's `command` and `args`, if any.
    pub fn find(command: &[String], args: &[String], has_args: bool) -> Option<ServerLaunch> {
        let argv: Vec<&String> = command.iter().chain(args).collect();
        let command_len = command.len();
        let words: Vec<Word> = argv
            .iter()
            .enumerate()
            .map(|(i, a)| Word {
                text: a.to_string(),
                span: 0..a.len(),
                element: i,
                separator: false,
            })
            .collect();
        // A shell running a script: the launch is inside it.
        if let Some(first) = words.first()
            && matches!(basename(&first.text), "bash" | "sh" | "dash" | "zsh")
        {
            let mut i = 1;
            let mut script_next = false;
            while let Some(w) = words.get(i) {
                if !w.text.starts_with('-') {
                    break;
                }
                if w.text.len() > 1 && !w.text.starts_with("--") && w.text.contains('c') {
                    script_next = true;
                }
                i += 1;
            }
            let element = i;
            let script = argv.get(element)?;
            if !script_next {
                return None;
            }
            let script_words = shell_words(script, element);
            return simple_commands(&script_words).into_iter().find_map(|cmd| {
                recognise(cmd).map(|(engine, model, flags_from)| ServerLaunch {
                    engine,
                    model,
                    words: cmd.to_vec(),
                    flags_from,
                    site: Site::Script {
                        element,
                        script: script.to_string(),
                    },
                    command_len,
                    has_args,
                })
            });
        }
        let cmd = strip_prefix_words(&words);
        let (engine, model, flags_from) = recognise(cmd)?;
        Some(ServerLaunch {
            engine,
            model,
            words: cmd.to_vec(),
            flags_from,
            site: Site::Argv,
            command_len,
            has_args,
        })
    }

    /// The engine's memory flags.
    pub fn flags(&self) -> MemoryFlags {
        match self.engine {
            Engine::Vllm => VLLM_FLAGS,
            Engine::Sglang => SGLANG_FLAGS,
        }
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
                _ => errors.push(format!("{} {v:?} is not in (0, 1]", f.fraction[0])),
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
                errors.push(format!("{} {other:?} is not known", f.kv_cache_dtype[0]));
                16
            }
        };
        if self.engine == Engine::Vllm {
            s.enforce_eager = self.switch("--enforce-eager");
            if let Some(v) = self.flag(&["--kv-cache-memory-bytes"]) {
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

    fn count(&self, errors: &mut Vec<String>, names: &[&str]) -> Option<u64> {
        let v = self.flag(names)?;
        match human_int(v) {
            Some(n) if n > 0 => Some(n),
            _ => {
                errors.push(format!("{} {v:?} is not a positive integer", names[0]));
                None
            }
        }
    }

    /// Whether the launch is inside a shell script.
    pub fn in_script(&self) -> bool {
        matches!(self.site, Site::Script { .. })
    }

    /// The last value of flag `name` or of one of its `aliases` (`--k v` or `--k=v`).
    pub fn flag(&self, names: &[&str]) -> Option<&str> {
        self.find_flag(names).map(|(_, v)| v.value(&self.words))
    }

    /// Whether switch `name` is on: present, and not turned off by a later `--no-…`.
    pub fn switch(&self, name: &str) -> bool {
        let off = format!("--no-{}", name.trim_start_matches("--"));
        let mut on = false;
        for w in &self.words[self.flags_from..] {
            let t = self.normalized(&w.text);
            if t == name {
                on = true;
            } else if t == off {
                on = false;
            }
        }
        on
    }

    fn normalized(&self, word: &str) -> String {
        // vLLM's FlexibleArgumentParser reads `--max_model_len` as `--max-model-len`.
        match (self.engine, word.strip_prefix("--")) {
            (Engine::Vllm, Some(rest)) => {
                let (key, value) = match rest.split_once('=') {
                    Some((k, v)) => (k, Some(v)),
                    None => (rest, None),
                };
                let key = key.replace('_', "-");
                match value {
                    Some(v) => format!("--{key}={v}"),
                    None => format!("--{key}"),
                }
            }
            _ => word.to_string(),
        }
    }

    fn find_flag(&self, names: &[&str]) -> Option<(usize, FlagValue)> {
        let mut found = None;
        let mut i = self.flags_from;
        while i < self.words.len() {
            let t = self.normalized(&self.words[i].text);
            for name in names {
                if t == *name && i + 1 < self.words.len() {
                    found = Some((i, FlagValue::Next(i + 1)));
                } else if let Some(v) = t.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
                    found = Some((i, FlagValue::Inline(i, name.len() + 1, v.len())));
                }
            }
            i += 1;
        }
        found
    }

    /// The argv edits that set each `(flag, value)` (its first name is written when absent):
    /// the last occurrence's value replaced, or the flag appended to the launch.
    pub fn rewrite(&self, set: &[(&[&str], String)]) -> Vec<ArgvEdit> {
        // Text edits on the words' sources: (element, span, new text).
        let mut edits: Vec<(usize, Range<usize>, String)> = Vec::new();
        let mut appended: Vec<String> = Vec::new();
        for (names, value) in set {
            match self.find_flag(names) {
                Some((_, FlagValue::Next(j))) => {
                    let w = &self.words[j];
                    edits.push((w.element, w.span.clone(), self.quote(value)));
                }
                Some((_, FlagValue::Inline(j, key_len, _))) => {
                    let w = &self.words[j];
                    let start = self.value_start(w, key_len);
                    edits.push((w.element, start..self.value_end(w), self.quote(value)));
                }
                None => {
                    appended.push(names[0].to_string());
                    appended.push(value.clone());
                }
            }
        }
        match &self.site {
            Site::Argv => {
                let mut out: Vec<ArgvEdit> = edits
                    .into_iter()
                    .filter(|(element, span, text)| {
                        self.words_element_text(*element).get(span.clone()) != Some(text.as_str())
                    })
                    .map(|(element, span, text)| {
                        let (field, index) = self.locate(element);
                        let mut value = self.words_element_text(element);
                        value.replace_range(span, &text);
                        ArgvEdit::Replace {
                            field,
                            index,
                            value,
                        }
                    })
                    .collect();
                let field = if self.has_args || self.command_len == 0 {
                    Field::Args
                } else {
                    Field::Command
                };
                out.extend(
                    appended
                        .into_iter()
                        .map(|value| ArgvEdit::Append { field, value }),
                );
                out
            }
            Site::Script { element, script } => {
                if !appended.is_empty() {
                    let end = self.words.last().map_or(script.len(), |w| w.span.end);
                    let text: Vec<String> = appended.iter().map(|a| self.quote(a)).collect();
                    edits.push((*element, end..end, format!(" {}", text.join(" "))));
                }
                // Right to left, so earlier spans stay valid.
                edits.sort_by_key(|(_, span, _)| std::cmp::Reverse(span.start));
                let mut value = script.clone();
                for (_, span, text) in edits {
                    value.replace_range(span, &text);
                }
                if value == *script {
                    return Vec::new();
                }
                let (field, index) = self.locate(*element);
                vec![ArgvEdit::Replace {
                    field,
                    index,
                    value,
                }]
            }
        }
    }

    /// Where an inline value starts in its word's source: after `--key=`, whatever quoting the
    /// key had (a script word `"--k=v"` starts with its quote).
    fn value_start(&self, w: &Word, key_len: usize) -> usize {
        match &self.site {
            Site::Argv => w.span.start + key_len,
            Site::Script { script, .. } => {
                let raw = &script[w.span.clone()];
                raw.find('=').map_or(w.span.end, |i| w.span.start + i + 1)
            }
        }
    }

    /// Where an inline value ends in its word's source: before a closing quote opened before
    /// the `=` (`"--k=v"`).
    fn value_end(&self, w: &Word) -> usize {
        match &self.site {
            Site::Argv => w.span.end,
            Site::Script { script, .. } => {
                let raw = &script[w.span.clone()];
                let quoted = raw.find('=').is_some_and(|eq| {
                    raw[..eq].contains(['"', '\'']) && raw.ends_with(['"', '\''])
                });
                if quoted { w.span.end - 1 } else { w.span.end }
            }
        }
    }

    fn words_element_text(&self, element: usize) -> String {
        self.words
            .iter()
            .find(|w| w.element == element)
            .map(|w| w.text.clone())
            .unwrap_or_default()
    }

    fn quote(&self, value: &str) -> String {
        let plain = value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.=/:".contains(c));
        if self.in_script() && !plain {
            format!("'{}'", value.replace('\'', r"'\''"))
        } else {
            value.to_string()
        }
    }

    fn locate(&self, element: usize) -> (Field, usize) {
        if element < self.command_len {
            (Field::Command, element)
        } else {
            (Field::Args, element - self.command_len)
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum FlagValue {
    /// The next word.
    Next(usize),
    /// Inside word `.0`, after `.1` bytes (`--key=`), `.2` bytes long.
    Inline(usize, usize, usize),
}

impl FlagValue {
    fn value(self, words: &[Word]) -> &str {
        match self {
            FlagValue::Next(j) => &words[j].text,
            FlagValue::Inline(j, _, len) => {
                let t = &words[j].text;
                &t[t.len().saturating_sub(len)..]
            }
        }
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

fn basename(program: &str) -> &str {
    program.rsplit('/').next().unwrap_or(program)
}

fn is_python(program: &str) -> bool {
    let b = basename(program);
    b == "python"
        || b.strip_prefix("python3")
            .is_some_and(|v| v.is_empty() || v.starts_with('.'))
}

/// `exec`, `env`, and `NAME=value` assignments before the program.
fn strip_prefix_words(words: &[Word]) -> &[Word] {
    let mut i = 0;
    while let Some(w) = words.get(i) {
        let t = w.text.as_str();
        if w.separator {
            break;
        }
        let assignment = t.split_once('=').is_some_and(|(k, _)| {
            !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
        if t == "exec" || t == "env" || assignment {
            i += 1;
        } else {
            break;
        }
    }
    &words[i..]
}

/// The engine, the model and where the flags start, when `cmd` launches a server.
fn recognise(cmd: &[Word]) -> Option<(Engine, String, usize)> {
    let program = cmd.first()?.text.as_str();
    let text = |i: usize| cmd.get(i).map(|w| w.text.as_str());
    let flag = |names: &[&str], from: usize| -> Option<String> {
        let mut found = None;
        for (i, w) in cmd.iter().enumerate().skip(from) {
            let t = w.text.as_str();
            for name in names {
                if t == *name {
                    found = text(i + 1).map(str::to_string);
                } else if let Some(v) = t.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
                    found = Some(v.to_string());
                }
            }
        }
        found
    };
    if basename(program) == "vllm" && text(1) == Some("serve") {
        return match text(2) {
            Some(m) if !m.starts_with('-') => Some((Engine::Vllm, m.to_string(), 3)),
            _ => Some((
                Engine::Vllm,
                flag(&["--model"], 2).unwrap_or_else(|| VLLM_DEFAULT_MODEL.to_string()),
                2,
            )),
        };
    }
    if is_python(program) && text(1) == Some("-m") {
        return match text(2)? {
            VLLM_MODULE => Some((
                Engine::Vllm,
                flag(&["--model"], 3).unwrap_or_else(|| VLLM_DEFAULT_MODEL.to_string()),
                3,
            )),
            SGLANG_MODULE => Some((Engine::Sglang, flag(&["--model-path", "--model"], 3)?, 3)),
            _ => None,
        };
    }
    None
}

/// Splits `words` at command separators and
/// strips each command's `exec`/`env`/assignments.
fn simple_commands(words: &[Word]) -> Vec<&[Word]> {
    words
        .split(|w| w.separator)
        .map(strip_prefix_words)
        .filter(|c| !c.is_empty())
        .collect()
}

/// The words of a POSIX shell script with their byte spans: blanks separate, `'…'` is literal,
/// `"…"` keeps `\"`, `\\`, `\$` and `` \` `` escapes, `\` outside quotes escapes one character,
/// `#` at a word's start comments to the end of the line. A command separator (`;`, `&`, `|`,
/// `&&`, `||`, newline, `(`, `)`) is returned as a [`Word::separator`].
/// Expansions (`$VAR`) are kept as written.
pub fn shell_words(script: &str, element: usize) -> Vec<Word> {
    let bytes: Vec<(usize, char)> = script.char_indices().collect();
    let mut words = Vec::new();
    let mut i = 0;
    let end_of = |i: usize| bytes.get(i).map_or(script.len(), |(b, _)| *b);
    while i < bytes.len() {
        let (start, c) = bytes[i];
        if c == ' ' || c == '\t' {
            i += 1;
            continue;
        }
        if c == '\\' && bytes.get(i + 1).map(|(_, c)| *c) == Some('\n') {
            i += 2;
            continue;
        }
        if matches!(c, ';' | '&' | '|' | '\n' | '(' | ')') {
            let mut j = i + 1;
            while j < bytes.len() && matches!(bytes[j].1, '&' | '|' | ';') && c != '\n' {
                j += 1;
            }
            words.push(Word {
                text: String::new(),
                span: start..end_of(j),
                element,
                separator: true,
            });
            i = j;
            continue;
        }
        if c == '#' {
            while i < bytes.len() && bytes[i].1 != '\n' {
                i += 1;
            }
            continue;
        }
        let mut text = String::new();
        while i < bytes.len() {
            let c = bytes[i].1;
            match c {
                ' ' | '\t' | '\n' | ';' | '&' | '|' | '(' | ')' => break,
                '\'' => {
                    i += 1;
                    while i < bytes.len() && bytes[i].1 != '\'' {
                        text.push(bytes[i].1);
                        i += 1;
                    }
                    i += 1;
                }
                '"' => {
                    i += 1;
                    while i < bytes.len() && bytes[i].1 != '"' {
                        if bytes[i].1 == '\\'
                            && bytes
                                .get(i + 1)
                                .is_some_and(|(_, n)| matches!(n, '"' | '\\' | '$' | '`'))
                        {
                            i += 1;
                        }
                        text.push(bytes[i].1);
                        i += 1;
                    }
                    i += 1;
                }
                '\\' => {
                    if let Some((_, n)) = bytes.get(i + 1) {
                        if *n != '\n' {
                            text.push(*n);
                        }
                        i += 2;
                    } else {
                        i += 1;
                    }
                }
                _ => {
                    text.push(c);
                    i += 1;
                }
            }
        }
        let end = end_of(i.min(bytes.len()));
        words.push(Word {
            text,
            span: start..end,
            element,
            separator: false,
        });
    }
    words
}

#[cfg(test)]
mod tests;
