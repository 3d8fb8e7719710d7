//! The trainer's launch in a container's `command` + `args`: the launcher (`python`,
//! `python -m`, `torchrun`, `accelerate launch`, `deepspeed`) is found and its own options are
//! skipped, to the program and the words it receives. A `bash -c` / `sh -c` string is split as
//! the shell splits it, and the launch may follow other commands (`pip install … && torchrun …`).
//! Edits to the program's words go back into the same place: an array item, or a byte span of
//! the shell string, the rest of which is kept byte for byte.

use super::flags::Edit;
use super::words::{self, SplitError};
use std::ops::Range;

/// What started the program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `python script.py` / `python -m module`.
    Python,
    /// `torchrun` or `python -m torch.distributed.run|launch`.
    Torchrun,
    /// `accelerate launch`.
    Accelerate,
    /// `deepspeed`.
    Deepspeed,
    /// The program itself (`trl sft …`, `axolotl train …`, `./train.py`).
    Direct,
}

/// The program a launcher runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Program {
    /// A Python file.
    Script(String),
    /// A Python module (`-m`).
    Module(String),
    /// An executable by name (`trl`, `axolotl`, `llamafactory-cli`, `tune`).
    Command(String),
}

impl Program {
    /// The program's last path component or module name, for matching.
    pub fn name(&self) -> &str {
        match self {
            Program::Script(p) | Program::Command(p) => p.rsplit('/').next().unwrap_or(p),
            Program::Module(m) => m,
        }
    }
}

/// Where one of the program's words is in the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// An item of `command` + `args`.
    Item(usize),
    /// A byte span of the shell string in that item.
    Shell {
        /// The item that holds the string.
        item: usize,
        /// The word's bytes, quotes included.
        span: Range<usize>,
    },
}

/// One word the program receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arg {
    /// Its text as the program sees it.
    pub text: String,
    /// Where it is.
    pub place: Place,
    /// It holds a shell expansion: its value is not known here.
    pub expands: bool,
}

/// A trainer's launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// What started it.
    pub launcher: Launcher,
    /// What runs.
    pub program: Program,
    /// The words after the program (a subcommand such as `trl sft`'s `sft` is the first: each
    /// trainer's reader knows its own).
    pub args: Vec<Arg>,
    /// The launcher's own options, as `(name, value)` (`--config_file`, `--deepspeed_config_file`).
    pub launcher_options: Vec<(String, Option<String>)>,
    /// The `VAR=value` words before the command (`NPROC_PER_NODE=4 swift sft …`), as
    /// `(name, value)`; `None` where the value is a shell expansion.
    pub env: Vec<(String, Option<String>)>,
    /// Where a word appended after the last one goes.
    end: Place,
}

/// Why no launch was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    /// The pod has no command or args.
    #[error("the container has no command or args")]
    Empty,
    /// The shell string could not be split.
    #[error("the shell string cannot be split: {0}")]
    Shell(#[from] SplitError),
    /// `python -c`: the program is inline code.
    #[error("the trainer is inline code (python -c), which memguard does not read")]
    InlineCode,
    /// A launcher with no program after it, or no command that launches anything.
    #[error("no trainer program found in the command line")]
    NoProgram,
    /// The program's name is a shell expansion.
    #[error("the program is named by a shell expansion ({0})")]
    Expands(String),
    /// A Python launcher runs a script or module named by a shell expansion.
    #[error("the Python program is named by a shell expansion ({0})")]
    ScriptExpands(String),
    /// The launch is in a shell run by a shell script (`bash -c "bash -c '…'"`): its words
    /// cannot be rewritten in place. The inner shell's words, to read it.
    #[error("the launch is in a shell started by a shell script, which memguard does not rewrite")]
    NestedShell(Vec<String>),
}

impl Launch {
    /// The program's words as text.
    pub fn texts(&self) -> Vec<&str> {
        self.args.iter().map(|a| a.text.as_str()).collect()
    }

    /// The container's `command` + `args` items with `edits` to the program's words (indices
    /// into [`Launch::args`]) applied. A shell string keeps every byte outside the edited words.
    pub fn apply(&self, items: &[String], edits: &[Edit]) -> Vec<String> {
        let mut out: Vec<String> = items.to_vec();
        // Shell edits, per item: (span, text).
        let mut shell: Vec<(usize, Range<usize>, String)> = Vec::new();
        let mut appended: Vec<String> = Vec::new();
        for edit in edits {
            match edit {
                Edit::Replace { index, text } => match self.args.get(*index).map(|a| &a.place) {
                    Some(Place::Item(i)) => {
                        if let Some(item) = out.get_mut(*i) {
                            *item = kubelet_literal(text);
                        }
                    }
                    Some(Place::Shell { item, span }) => {
                        let raw = items.get(*item).and_then(|s| s.get(span.clone()));
                        shell.push((*item, span.clone(), requote(raw, text)))
                    }
                    None => {}
                },
                Edit::Append(text) => appended.push(text.clone()),
            }
        }
        match &self.end {
            Place::Item(last) => {
                let at = (*last + 1).min(out.len());
                for (k, text) in appended.into_iter().enumerate() {
                    out.insert(at + k, kubelet_literal(&text));
                }
            }
            Place::Shell { item, span } => {
                if !appended.is_empty() {
                    let text: String = appended
                        .iter()
                        .map(|t| format!(" {}", words::quote(t)))
                        .collect();
                    shell.push((*item, span.end..span.end, text));
                }
            }
        }
        for (i, item) in out.iter_mut().enumerate() {
            let here: Vec<(Range<usize>, String)> = shell
                .iter()
                .filter(|(at, _, _)| *at == i)
                .map(|(_, r, t)| (r.clone(), t.clone()))
                .collect();
            if !here.is_empty() {
                *item = words::replace_spans(item, &here);
            }
        }
        out
    }
}

/// `text` written in place of the shell word `raw`: a word quoted whole around its `=`
/// (`"--k=v"`) keeps that quoting when `text` is the same `--k=`, anything else is
/// [`words::quote`]d.
fn requote(raw: Option<&str>, text: &str) -> String {
    let quoted_whole = raw.and_then(|raw| {
        let q = raw.chars().next().filter(|c| matches!(c, '"' | '\''))?;
        let inner = raw.strip_prefix(q)?.strip_suffix(q)?;
        let (key, _) = inner.split_once('=')?;
        let forbidden: &[char] = if q == '"' {
            &['"', '\\', '$', '`']
        } else {
            &['\'']
        };
        let same_key = text.split_once('=').is_some_and(|(k, _)| k == key);
        (same_key && !inner.contains(forbidden) && !text.contains(forbidden)).then_some(q)
    });
    match quoted_whole {
        Some(q) => format!("{q}{text}{q}"),
        None => words::quote(text),
    }
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

/// One change to a container's argv, element by element, in the order they apply (a JSON patch
/// names each element, so a pod's other elements are never rewritten).
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// A container's `command` followed by its `args`, as [`find`] reads them, with what it takes
/// to write edits back into the two fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Argv {
    /// `command` + `args`.
    pub items: Vec<String>,
    /// How many of `items` are `command`.
    pub command_len: usize,
    /// `args` is present in the spec (even empty): appended words go there.
    pub has_args: bool,
}

impl Argv {
    /// A container's `command` and `args`.
    pub fn new(command: Option<&[String]>, args: Option<&[String]>) -> Argv {
        let command = command.unwrap_or_default();
        Argv {
            items: command
                .iter()
                .chain(args.unwrap_or_default())
                .cloned()
                .collect(),
            command_len: command.len(),
            has_args: args.is_some(),
        }
    }

    /// `edits` to `launch`'s words as edits to the container's fields: each changed element
    /// replaced (in the edits' order; a shell string once, whole), then the appended words.
    pub fn edits(&self, launch: &Launch, edits: &[Edit]) -> Vec<ArgvEdit> {
        let after = launch.apply(&self.items, edits);
        let mut out = Vec::new();
        let mut replaced = Vec::new();
        let changed: Vec<usize> = edits
            .iter()
            .filter_map(|e| match e {
                Edit::Replace { index, .. } => launch.args.get(*index).map(|a| match a.place {
                    Place::Item(i) | Place::Shell { item: i, .. } => i,
                }),
                Edit::Append(_) => match launch.end {
                    Place::Shell { item, .. } => Some(item),
                    Place::Item(_) => None,
                },
            })
            .collect();
        for i in changed {
            if replaced.contains(&i) || after.get(i) == self.items.get(i) {
                continue;
            }
            replaced.push(i);
            let (field, index) = self.locate(i);
            out.push(ArgvEdit::Replace {
                field,
                index,
                value: after[i].clone(),
            });
        }
        let field = if self.has_args || self.command_len == 0 {
            Field::Args
        } else {
            Field::Command
        };
        out.extend(
            after
                .iter()
                .skip(self.items.len())
                .map(|value| ArgvEdit::Append {
                    field,
                    value: value.clone(),
                }),
        );
        out
    }

    fn locate(&self, item: usize) -> (Field, usize) {
        if item < self.command_len {
            (Field::Command, item)
        } else {
            (Field::Args, item - self.command_len)
        }
    }
}

fn basename(word: &str) -> &str {
    word.rsplit('/').next().unwrap_or(word)
}

fn is_shell(word: &str) -> bool {
    matches!(basename(word), "bash" | "sh" | "dash" | "zsh" | "ash")
}

fn is_python(word: &str) -> bool {
    let name = basename(word);
    name == "python"
        || name == "python3"
        || name
            .strip_prefix("python3.")
            .is_some_and(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
}

/// Finds the trainer's launch in a container's `command` followed by its `args`.
pub fn find(items: &[String]) -> Result<Launch, LaunchError> {
    find_by(items, &|_| true)
}

/// [`find`], with the container's literal env: a shell script's `$NAME` words resolve from
/// it and from the script's own earlier assignments ([`words::resolve`]), and an argv item's
/// `$(NAME)` as the kubelet expands it.
pub fn find_in_env(
    items: &[String],
    env: &std::collections::BTreeMap<String, String>,
) -> Result<Launch, LaunchError> {
    find_by_in_env(items, env, &|_| true)
}

/// Finds the first launch in a container's `command` followed by its `args` that `accept`s
/// (an inference server, say: a script may run a download before it).
pub fn find_by(items: &[String], accept: &dyn Fn(&Launch) -> bool) -> Result<Launch, LaunchError> {
    find_by_in_env(items, &std::collections::BTreeMap::new(), accept)
}

#[cfg(any(test, feature = "search-count"))]
thread_local! {
    /// How many command lines this thread has searched for a launch: a test counts what one
    /// reading of a pod, or one admission, costs.
    pub static SEARCHES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// [`find_by`] with the container's literal env ([`find_in_env`]).
pub fn find_by_in_env(
    items: &[String],
    env: &std::collections::BTreeMap<String, String>,
    accept: &dyn Fn(&Launch) -> bool,
) -> Result<Launch, LaunchError> {
    let found = find_both_in_env(items, env, accept);
    found.accepted.ok_or(found.why_none)
}

/// What one search of a command line found ([`find_both_in_env`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Search {
    /// The first launch, as [`find_in_env`] finds it; or why there is none.
    pub first: Result<Launch, LaunchError>,
    /// The first launch that `accept`ed, as [`find_by_in_env`] finds it.
    pub accepted: Option<Launch>,
    /// Why none was accepted ([`find_by_in_env`]'s error).
    why_none: LaunchError,
}

/// [`find_in_env`] and [`find_by_in_env`] in one pass over the command line: its first launch
/// (a pod's trainer) and its first launch that `accept`s (a server that follows a download).
pub fn find_both_in_env(
    items: &[String],
    env: &std::collections::BTreeMap<String, String>,
    accept: &dyn Fn(&Launch) -> bool,
) -> Search {
    #[cfg(any(test, feature = "search-count"))]
    SEARCHES.with(|n| n.set(n.get() + 1));
    let Some(first) = items.first() else {
        return Search::none(LaunchError::Empty);
    };
    if is_shell(first) {
        // `bash -c STRING`, `bash -lc STRING`, `sh -ec STRING`, `bash --login -c STRING`: the
        // string is the script.
        let mut i = 1;
        while let Some(opt) = items.get(i) {
            if opt.starts_with("--") && opt.len() > 2 {
                i += 1;
            } else if opt.starts_with('-') && opt.len() > 1 {
                i += 1;
                if opt.contains('c') {
                    let Some(script) = items.get(i) else {
                        return Search::none(LaunchError::NoProgram);
                    };
                    return find_in_shell(i, script, env, accept);
                }
            } else {
                break;
            }
        }
        // `bash run.sh`: a script memguard cannot see.
        return Search::none(LaunchError::NoProgram);
    }
    let args: Vec<Arg> = items
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let (text, expands) = kubelet_expand(text, env);
            Arg {
                text,
                place: Place::Item(i),
                expands,
            }
        })
        .collect();
    let end = Place::Item(items.len() - 1);
    let first = launch_in(args, end);
    let accepted = first.as_ref().ok().filter(|l| accept(l)).cloned();
    let why_none = match &first {
        Err(e) => e.clone(),
        Ok(_) => LaunchError::NoProgram,
    };
    Search {
        first,
        accepted,
        why_none,
    }
}

impl Search {
    fn none(why: LaunchError) -> Search {
        Search {
            first: Err(why.clone()),
            accepted: None,
            why_none: why,
        }
    }
}

/// `text` as an argv item the kubelet passes as `text`: every `$` written `$$`. A word is read
/// after the kubelet's expansion (`$$` is one `$`), so a rewritten word written as read would
/// lose one `$` of each pair.
fn kubelet_literal(text: &str) -> String {
    text.replace('$', "$$")
}

/// An argv item as the kubelet passes it: `$(NAME)` replaced by the container's variable
/// (`$$` is a literal `$`); a reference to a variable the env does not give literally is left
/// as written by the kubelet, and marked unknown here.
fn kubelet_expand(text: &str, env: &std::collections::BTreeMap<String, String>) -> (String, bool) {
    if !text.contains('$') {
        return (text.to_string(), false);
    }
    let mut out = String::new();
    let mut unknown = false;
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(close) = inner.find(')')
        {
            match env.get(&inner[..close]) {
                Some(value) => out.push_str(value),
                None => {
                    unknown = true;
                    out.push_str(&rest[at..at + close + 3]);
                }
            }
            rest = &inner[close + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    (out, unknown)
}

fn find_in_shell(
    item: usize,
    script: &str,
    env: &std::collections::BTreeMap<String, String>,
    accept: &dyn Fn(&Launch) -> bool,
) -> Search {
    let tokens = match words::split(script) {
        Ok(tokens) => tokens,
        Err(e) => return Search::none(e.into()),
    };
    let mut error = LaunchError::NoProgram;
    let mut first = None;
    let mut commands = words::commands(&tokens);
    words::resolve(&mut commands, env);
    for command in commands {
        let Some(last) = command.last() else { continue };
        let end = Place::Shell {
            item,
            span: last.span.clone(),
        };
        let args: Vec<Arg> = command
            .iter()
            .map(|w| Arg {
                text: w.text.clone(),
                place: Place::Shell {
                    item,
                    span: w.span.clone(),
                },
                expands: w.expands,
            })
            .collect();
        match launch_in(args, end) {
            Ok(launch) => {
                if accept(&launch) {
                    return Search {
                        first: first.unwrap_or_else(|| Ok(launch.clone())),
                        accepted: Some(launch),
                        why_none: error,
                    };
                }
                first.get_or_insert(Ok(launch));
            }
            // Remember the most telling reason: inline code over "nothing here".
            Err(
                e @ (LaunchError::InlineCode
                | LaunchError::Expands(_)
                | LaunchError::ScriptExpands(_)
                | LaunchError::NestedShell(_)),
            ) => error = e,
            Err(_) => {}
        }
    }
    Search {
        first: first.unwrap_or_else(|| Err(error.clone())),
        accepted: None,
        why_none: error,
    }
}

/// Whether the launch found in a container's `command` + `args` ([`find_in_env`]'s answer,
/// not a search of its own) starts a Python program: a launch (every launcher and trainer or
/// server command is one, but not a file run by its shebang), inline code (`python -c`), a
/// Python launcher whose script is a shell expansion, or a shell started by a shell script.
/// That inner shell is not searched again: the answer is yes, because the client injected into a
/// process that is not Python is inert (a `PYTHONPATH` nothing reads, an `emptyDir`), while a
/// Python trainer left without it loses its run-time guard.
pub fn runs_python(found: &Result<Launch, LaunchError>) -> bool {
    match found {
        Ok(launch) => !matches!(
            (launch.launcher, &launch.program),
            (Launcher::Direct, Program::Script(_))
        ),
        Err(
            LaunchError::InlineCode | LaunchError::ScriptExpands(_) | LaunchError::NestedShell(_),
        ) => true,
        Err(_) => false,
    }
}

/// Commands that are Python programs themselves, trainers and servers (their words are read by
/// their own reader).
const COMMANDS: &[&str] = &[
    "vllm",
    "trl",
    "axolotl",
    "llamafactory-cli",
    "lmf",
    "tune",
    "litgpt",
    "swift",
];

/// Words that run the rest of the command: skipped before the launcher.
const WRAPPERS: &[&str] = &["exec", "env", "nohup", "time", "nice", "stdbuf"];
/// Options of the wrappers that take the next word (`env -u NAME`, `nice -n 5`).
const WRAPPER_VALUED: &[&str] = &["-u", "-C", "-n", "-S", "--unset", "--chdir"];
/// Environment managers whose `run` subcommand runs the rest (`uv run python …`, `conda run
/// -n env python …`), skipped with their options.
const RUNNERS: &[&str] = &[
    "uv",
    "conda",
    "mamba",
    "micromamba",
    "poetry",
    "pipenv",
    "pdm",
];
/// Options of the runners that take the next word (`conda run -n env`, `uv run --with x`).
const RUNNER_VALUED: &[&str] = &[
    "-n",
    "--name",
    "-p",
    "--prefix",
    "--with",
    "--python",
    "--project",
    "--directory",
    "--env-file",
    "--group",
    "--extra",
    "--package",
    "--cwd",
];

fn launch_in(mut args: Vec<Arg>, end: Place) -> Result<Launch, LaunchError> {
    // Leading `VAR=value` assignments and wrappers.
    let mut i = 0;
    let mut env = Vec::new();
    while let Some(a) = args.get(i) {
        let assignment = a.text.split_once('=').filter(|(k, _)| {
            !k.is_empty()
                && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
                && !k.as_bytes()[0].is_ascii_digit()
        });
        if let Some((name, value)) = assignment {
            env.push((name.to_string(), (!a.expands).then(|| value.to_string())));
            i += 1;
        } else if RUNNERS.contains(&basename(&a.text))
            && args.get(i + 1).is_some_and(|w| w.text == "run")
        {
            i += 2;
            while let Some(opt) = args.get(i).filter(|o| o.text.starts_with('-')) {
                let valued = RUNNER_VALUED.contains(&opt.text.as_str());
                i += if valued { 2 } else { 1 };
            }
        } else if WRAPPERS.contains(&basename(&a.text)) {
            i += 1;
            // The wrapper's own options are not the program.
            while let Some(opt) = args.get(i).filter(|o| o.text.starts_with('-')) {
                i += if WRAPPER_VALUED.contains(&opt.text.as_str()) {
                    2
                } else {
                    1
                };
            }
        } else {
            break;
        }
    }
    let head = args.get(i).ok_or(LaunchError::NoProgram)?;
    if head.expands {
        return Err(LaunchError::Expands(head.text.clone()));
    }
    let name = basename(&head.text).to_string();
    let mut options = Vec::new();
    let (launcher, program, rest) = if is_python(&name) {
        python(&args, i + 1, &mut options)?
    } else if name == "torchrun" {
        let (program, rest) = after_options(&args, i + 1, TORCHRUN_BOOLS, &mut options)?;
        (Launcher::Torchrun, program, rest)
    } else if name == "accelerate" {
        // `accelerate [--debug] launch …`; `accelerate config`, `env`, … launch nothing.
        let sub = (i + 1..args.len()).find(|&j| !args[j].text.starts_with('-'));
        let Some(sub) = sub.filter(|&j| args[j].text == "launch") else {
            return Err(LaunchError::NoProgram);
        };
        let (program, rest) = after_options(&args, sub + 1, ACCELERATE_BOOLS, &mut options)?;
        (Launcher::Accelerate, program, rest)
    } else if name == "accelerate-launch" {
        let (program, rest) = after_options(&args, i + 1, ACCELERATE_BOOLS, &mut options)?;
        (Launcher::Accelerate, program, rest)
    } else if name == "deepspeed" {
        let (program, rest) = after_options(&args, i + 1, DEEPSPEED_BOOLS, &mut options)?;
        (Launcher::Deepspeed, program, rest)
    } else if COMMANDS.contains(&name.as_str()) {
        (Launcher::Direct, Program::Command(head.text.clone()), i + 1)
    } else if name.ends_with(".py") {
        (Launcher::Direct, Program::Script(head.text.clone()), i + 1)
    } else if is_shell(&name) {
        let inner = args[i..].iter().map(|a| a.text.clone()).collect();
        return Err(LaunchError::NestedShell(inner));
    } else {
        return Err(LaunchError::NoProgram);
    };
    let args = args.split_off(rest.min(args.len()));
    Ok(Launch {
        launcher,
        program,
        args,
        launcher_options: options,
        env,
        end,
    })
}

type Found = (Launcher, Program, usize);

fn python(
    args: &[Arg],
    mut i: usize,
    options: &mut Vec<(String, Option<String>)>,
) -> Result<Found, LaunchError> {
    while let Some(a) = args.get(i) {
        let t = a.text.as_str();
        match t {
            "-c" => return Err(LaunchError::InlineCode),
            "-m" => {
                let module = args.get(i + 1).ok_or(LaunchError::NoProgram)?;
                return Ok(match module.text.as_str() {
                    "torch.distributed.run" | "torch.distributed.launch" => {
                        let (p, rest) = after_options(args, i + 2, TORCHRUN_BOOLS, options)?;
                        (Launcher::Torchrun, p, rest)
                    }
                    "accelerate.commands.launch" => {
                        let (p, rest) = after_options(args, i + 2, ACCELERATE_BOOLS, options)?;
                        (Launcher::Accelerate, p, rest)
                    }
                    m => (Launcher::Python, Program::Module(m.to_string()), i + 2),
                });
            }
            "-X" | "-W" => i += 2,
            _ if t.starts_with("-c") => return Err(LaunchError::InlineCode),
            _ if t.starts_with('-') && t.len() > 1 => i += 1,
            _ => {
                if a.expands {
                    return Err(LaunchError::ScriptExpands(a.text.clone()));
                }
                return Ok((Launcher::Python, Program::Script(a.text.clone()), i + 1));
            }
        }
    }
    Err(LaunchError::NoProgram)
}

/// torchrun's options that take no value.
const TORCHRUN_BOOLS: &[&str] = &[
    "standalone",
    "no_python",
    "module",
    "run_path",
    "use_env",
    "m",
];
/// `accelerate launch`'s options that take no value.
const ACCELERATE_BOOLS: &[&str] = &[
    "cpu",
    "multi_gpu",
    "tpu",
    "use_deepspeed",
    "use_fsdp",
    "use_megatron_lm",
    "use_xpu",
    "module",
    "m",
    "no_python",
    "debug",
    "quiet",
    "q",
    "enable_cpu_affinity",
    "dynamo_use_fullgraph",
    "dynamo_use_dynamic",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "downcast_bf16",
    "same_network",
];
/// deepspeed's launcher options that take no value.
const DEEPSPEED_BOOLS: &[&str] = &[
    "no_python",
    "module",
    "no_local_rank",
    "no_ssh_check",
    "no_ssh",
    "force_multi",
    "save_pid",
    "bind_cores_to_rank",
    "elastic_training",
    "enable_each_rank_log",
];

/// Skips a launcher's options to its program: the first word that is not an option or an
/// option's value. `-m`/`--module` makes it a module, `--no_python` a command.
fn after_options(
    args: &[Arg],
    mut i: usize,
    bools: &[&str],
    options: &mut Vec<(String, Option<String>)>,
) -> Result<(Program, usize), LaunchError> {
    let mut module = false;
    let mut no_python = false;
    while let Some(a) = args.get(i) {
        let t = a.text.as_str();
        let Some(body) = t
            .strip_prefix("--")
            .or_else(|| t.strip_prefix('-').filter(|b| !b.is_empty()))
        else {
            if a.expands {
                return Err(LaunchError::ScriptExpands(a.text.clone()));
            }
            let program = if module {
                Program::Module(t.to_string())
            } else if no_python {
                Program::Command(t.to_string())
            } else {
                Program::Script(t.to_string())
            };
            return Ok((program, i + 1));
        };
        let (key, inline) = match body.split_once('=') {
            Some((k, v)) => (k.replace('-', "_"), Some(v.to_string())),
            None => (body.replace('-', "_"), None),
        };
        module |= key == "m" || key == "module";
        no_python |= key == "no_python";
        if inline.is_some() || bools.contains(&key.as_str()) {
            options.push((key, inline));
            i += 1;
        } else {
            options.push((key, args.get(i + 1).map(|a| a.text.clone())));
            i += 2;
        }
    }
    Err(LaunchError::NoProgram)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::flags::{Flags, HfRules};

    fn items(s: &[&str]) -> Vec<String> {
        s.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn a_rewritten_item_keeps_the_kubelets_dollar_escapes() {
        // `$$` is a literal `$` to the kubelet: read as one, written back as two.
        let env = std::collections::BTreeMap::new();
        let cmd = items(&["python", "train.py", "--grad$$_steps=2", "--tag", "$$x"]);
        let found = find_in_env(&cmd, &env).expect("a launch");
        let flags = Flags::parse(&found.texts(), &HfRules);
        assert_eq!(flags.value("grad$_steps"), Some("2"));
        let edit = flags.set("grad$_steps", "7", &HfRules).expect("set");
        let appended = crate::launch::flags::Edit::Append("--note=a$b".into());
        let out = found.apply(&cmd, &[edit, appended]);
        assert_eq!(
            out,
            items(&[
                "python",
                "train.py",
                "--grad$$_steps=7",
                "--tag",
                "$$x",
                "--note=a$$b"
            ])
        );
        let again = find_in_env(&out, &env).expect("found again");
        let reread = Flags::parse(&again.texts(), &HfRules);
        assert_eq!(reread.value("grad$_steps"), Some("7"));
        assert_eq!(reread.value("note"), Some("a$b"));
        assert_eq!(
            reread.value("tag"),
            Some("$x"),
            "untouched items stay as written"
        );
    }

    #[test]
    fn launchers_and_their_options_are_skipped() {
        let cases: &[(&[&str], Launcher, Program, &str)] = &[
            (
                &["python", "-u", "train.py", "--a", "1"],
                Launcher::Python,
                Program::Script("train.py".into()),
                "--a",
            ),
            (
                &["python3", "-m", "trl.scripts.sft", "--a"],
                Launcher::Python,
                Program::Module("trl.scripts.sft".into()),
                "--a",
            ),
            (
                &[
                    "torchrun",
                    "--nproc_per_node",
                    "8",
                    "--standalone",
                    "run.py",
                    "--a",
                ],
                Launcher::Torchrun,
                Program::Script("run.py".into()),
                "--a",
            ),
            (
                &[
                    "python",
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node=2",
                    "run.py",
                    "--a",
                ],
                Launcher::Torchrun,
                Program::Script("run.py".into()),
                "--a",
            ),
            (
                &[
                    "accelerate",
                    "launch",
                    "--config_file",
                    "c.yaml",
                    "--multi_gpu",
                    "-m",
                    "axolotl.cli.train",
                    "cfg.yml",
                ],
                Launcher::Accelerate,
                Program::Module("axolotl.cli.train".into()),
                "cfg.yml",
            ),
            (
                &[
                    "deepspeed",
                    "--num_gpus",
                    "8",
                    "train.py",
                    "--deepspeed",
                    "ds.json",
                ],
                Launcher::Deepspeed,
                Program::Script("train.py".into()),
                "--deepspeed",
            ),
            (
                &["/usr/local/bin/trl", "sft", "--a"],
                Launcher::Direct,
                Program::Command("/usr/local/bin/trl".into()),
                "sft",
            ),
        ];
        for (cmd, launcher, program, first) in cases {
            let l = find(&items(cmd)).expect("test input");
            assert_eq!((&l.launcher, &l.program), (launcher, program), "{cmd:?}");
            assert_eq!(l.args[0].text, *first, "{cmd:?}");
        }
        assert_eq!(
            find(&items(&["python", "-c", "import x"])),
            Err(LaunchError::InlineCode)
        );
        assert_eq!(
            find(&items(&["bash", "run.sh"])),
            Err(LaunchError::NoProgram)
        );
        assert_eq!(find(&[]), Err(LaunchError::Empty));
    }

    #[test]
    fn shell_string_after_other_commands() {
        let script = "pip install -q trl && cd /app; NCCL_DEBUG=INFO torchrun --nproc_per_node=8 sft.py \\\n  --per_device_train_batch_size 8 --gradient_accumulation_steps=2 | tee log";
        let cmd = items(&["/bin/bash", "-lc", script]);
        let l = find(&cmd).expect("test input");
        assert_eq!(l.program, Program::Script("sft.py".into()));
        let flags = Flags::parse(&l.texts(), &HfRules);
        assert_eq!(flags.value("per_device_train_batch_size"), Some("8"));
        let edits = [
            flags
                .set("per_device_train_batch_size", "2", &HfRules)
                .expect("test input"),
            flags
                .set("gradient_accumulation_steps", "8", &HfRules)
                .expect("test input"),
            flags
                .set("gradient_checkpointing", "true", &HfRules)
                .expect("test input"),
        ];
        let out = l.apply(&cmd, &edits);
        assert_eq!(
            out[2],
            "pip install -q trl && cd /app; NCCL_DEBUG=INFO torchrun --nproc_per_node=8 sft.py \\\n  --per_device_train_batch_size 2 --gradient_accumulation_steps=8 --gradient_checkpointing | tee log"
        );
        let again = find(&out).expect("test input");
        let flags = Flags::parse(&again.texts(), &HfRules);
        assert_eq!(flags.value("gradient_accumulation_steps"), Some("8"));
        assert_eq!(flags.bool("gradient_checkpointing", &HfRules), Some(true));
    }

    #[test]
    fn array_appends_go_after_the_last_word() {
        let cmd = items(&[
            "accelerate",
            "launch",
            "sft.py",
            "--per_device_train_batch_size",
            "8",
        ]);
        let l = find(&cmd).expect("test input");
        let flags = Flags::parse(&l.texts(), &HfRules);
        let edits = [
            flags
                .set("per_device_train_batch_size", "2", &HfRules)
                .expect("test input"),
            flags
                .set("gradient_accumulation_steps", "4", &HfRules)
                .expect("test input"),
        ];
        assert_eq!(
            l.apply(&cmd, &edits),
            items(&[
                "accelerate",
                "launch",
                "sft.py",
                "--per_device_train_batch_size",
                "2",
                "--gradient_accumulation_steps=4"
            ])
        );
    }

    #[test]
    fn wrappers_nested_shells_and_python_programs() {
        let l = find(&items(&[
            "env", "-u", "X", "nice", "-n", "5", "python", "t.py",
        ]))
        .expect("test input");
        assert_eq!(l.program, Program::Script("t.py".into()));
        let l = find(&items(&["accelerate", "--debug", "launch", "t.py"])).expect("test input");
        assert_eq!(l.launcher, Launcher::Accelerate);
        let nested = items(&["bash", "-lc", "cd /w && bash -c 'accelerate launch t.py'"]);
        assert_eq!(
            find(&nested),
            Err(LaunchError::NestedShell(items(&[
                "bash",
                "-c",
                "accelerate launch t.py"
            ])))
        );
        let python = |words: &[&str]| runs_python(&find(&items(words)));
        assert!(runs_python(&find(&nested)));
        assert!(python(&["sh", "-c", "python -c 'import x'"]));
        assert!(python(&["sh", "-c", "torchrun --nproc_per_node 2 $S"]));
        assert!(!python(&["sh", "-c", "$PY t.py"]));
        // A file run by its shebang may be anything.
        assert!(!python(&["./train.py"]));
        assert!(!python(&["accelerate", "config"]));
        // A shell started by a shell script is not searched again: whatever it runs, the
        // client goes in (inert where nothing runs Python).
        assert!(python(&["bash", "-c", "bash -c './run.sh'"]));
    }

    /// One pass finds both the first launch and the first accepted one, each as the separate
    /// searches did.
    #[test]
    fn one_search_finds_the_first_launch_and_the_first_accepted() {
        let env = std::collections::BTreeMap::from([("M".to_string(), "m1".to_string())]);
        let is_vllm = |l: &Launch| l.program.name() == "vllm";
        let cmd = items(&["sh", "-c", "python -c 'x' ; python get.py && vllm serve $M"]);
        let both = find_both_in_env(&cmd, &env, &is_vllm);
        assert_eq!(both.first, find_in_env(&cmd, &env));
        assert_eq!(
            both.first.expect("a launch").program,
            Program::Script("get.py".into())
        );
        let server = both.accepted.expect("the server");
        assert_eq!(server.texts(), ["serve", "m1"]);
        assert_eq!(Ok(server), find_by_in_env(&cmd, &env, &is_vllm));
        // No launch accepted: the most telling reason, as before.
        let cmd = items(&["sh", "-c", "python -c 'x'; echo done"]);
        let both = find_both_in_env(&cmd, &env, &is_vllm);
        assert_eq!(both.first, Err(LaunchError::InlineCode));
        assert_eq!(both.accepted, None);
        assert_eq!(
            find_by_in_env(&cmd, &env, &is_vllm),
            Err(LaunchError::InlineCode)
        );
    }

    #[test]
    fn expanded_program_is_not_trusted() {
        let cmd = items(&["sh", "-c", "python $SCRIPT --a 1"]);
        assert!(matches!(find(&cmd), Err(LaunchError::ScriptExpands(_))));
        let cmd = items(&["sh", "-c", "$PY train.py --a 1"]);
        assert!(matches!(find(&cmd), Err(LaunchError::Expands(_))));
    }
}
