//! Whether a trainer runs Python: the one question the client injection asks of a command line.
//!
//! Deliberately small and self-contained: it reads `command` + `args` as words, looks through
//! the usual wrappers (`env`, `exec`, `nohup`, `VAR=value` prefixes) and into `sh`/`bash -c`
//! scripts (split on `&&`, `||`, `;`, `|` and newlines), and recognises the Python launchers ML
//! jobs use. A container whose command it cannot see (the image's entrypoint) is not Python to
//! it: the webhook then injects nothing, which costs the pod nothing.

use k8s_openapi::api::core::v1::Container;

/// Programs that always start a Python interpreter.
const PYTHON_LAUNCHERS: &[&str] = &[
    "torchrun",
    "deepspeed",
    "trl",
    "axolotl",
    "llamafactory-cli",
    "tune",
    "swift",
    "litgpt",
    "accelerate-launch",
];

/// Wrappers that run the rest of the line as a command.
const WRAPPERS: &[&str] = &["env", "exec", "nohup", "time", "nice", "stdbuf"];

/// Shells whose `-c` script is read too.
const SHELLS: &[&str] = &["sh", "bash", "dash", "zsh", "ash"];

/// How deep `bash -c "bash -c '…'"` is followed.
const MAX_DEPTH: usize = 4;

/// Whether `container`'s `command` + `args` start a Python trainer.
pub fn runs_python(container: &Container) -> bool {
    let words: Vec<&str> = container
        .command
        .iter()
        .flatten()
        .chain(container.args.iter().flatten())
        .map(String::as_str)
        .collect();
    words_run_python(&words, 0)
}

fn words_run_python(words: &[&str], depth: usize) -> bool {
    let mut rest = words;
    // Leading `VAR=value` assignments and wrappers (with their own flags) are not the program.
    loop {
        match rest.first() {
            Some(w) if is_assignment(w) => rest = &rest[1..],
            Some(w) if WRAPPERS.contains(&program(w)) => {
                rest = &rest[1..];
                while let Some(flag) = rest.first().filter(|w| w.starts_with('-')) {
                    // `env -u NAME`, `env -C DIR`, `nice -n 5`: the flag's value is not the program.
                    let takes_value = ["-u", "-C", "-n", "--unset", "--chdir"].contains(flag);
                    rest = &rest[(if takes_value { 2 } else { 1 }).min(rest.len())..];
                }
            }
            _ => break,
        }
    }
    let Some(first) = rest.first() else {
        return false;
    };
    let name = program(first);
    if is_python(name) || PYTHON_LAUNCHERS.contains(&name) {
        return true;
    }
    if name == "accelerate" {
        return rest[1..]
            .iter()
            .find(|w| !w.starts_with('-'))
            .is_some_and(|w| *w == "launch");
    }
    if SHELLS.contains(&name) && depth < MAX_DEPTH {
        // The words after `-c`, joined: one word when Kubernetes passes the script, several when
        // it was split out of an outer script (`bash -c 'torchrun …'` inside `sh -c`).
        return shell_script(&rest[1..])
            .is_some_and(|script| script_runs_python(&script.join(" "), depth));
    }
    false
}

/// The words from the script of `sh -c SCRIPT` on (also `-ec`, `-lc`, `-xc`, …).
fn shell_script<'a, 'b>(args: &'b [&'a str]) -> Option<&'b [&'a str]> {
    for (i, w) in args.iter().enumerate() {
        if w.starts_with('-') && !w.starts_with("--") && w.contains('c') {
            return args.get(i + 1..).filter(|s| !s.is_empty());
        }
        if !w.starts_with('-') {
            return None; // `bash train.sh`: a script file, not read here
        }
    }
    None
}

fn script_runs_python(script: &str, depth: usize) -> bool {
    script
        .split(['\n', ';', '|', '&', '(', ')'])
        .any(|command| {
            let words: Vec<&str> = command
                .split_whitespace()
                .map(|w| w.trim_matches(|c| c == '"' || c == '\''))
                .filter(|w| !w.is_empty())
                .collect();
            words_run_python(&words, depth + 1)
        })
}

/// The program's name without its directory (`/usr/bin/python3` → `python3`).
fn program(word: &str) -> &str {
    word.rsplit('/').next().unwrap_or(word)
}

/// `python`, `python3`, `python3.11`.
fn is_python(name: &str) -> bool {
    name.strip_prefix("python")
        .is_some_and(|v| v.chars().all(|c| c.is_ascii_digit() || c == '.'))
}

fn is_assignment(word: &str) -> bool {
    word.split_once('=').is_some_and(|(name, _)| {
        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(command: &[&str], args: &[&str]) -> bool {
        let c = Container {
            command: (!command.is_empty()).then(|| command.iter().map(|s| s.to_string()).collect()),
            args: (!args.is_empty()).then(|| args.iter().map(|s| s.to_string()).collect()),
            ..Container::default()
        };
        runs_python(&c)
    }

    #[test]
    fn recognises_the_python_launchers() {
        for cmd in [
            &["python", "train.py"][..],
            &["python3", "-m", "trainer"],
            &["/usr/local/bin/python3.11", "train.py"],
            &["torchrun", "--nproc-per-node=2", "train.py"],
            &["accelerate", "launch", "train.py"],
            &["accelerate", "--debug", "launch", "train.py"],
            &["deepspeed", "train.py"],
            &["trl", "sft", "--model_name_or_path", "x"],
            &["axolotl", "train", "cfg.yaml"],
            &["llamafactory-cli", "train", "cfg.yaml"],
            &["tune", "run", "lora_finetune_single_device"],
            &["swift", "sft"],
            &["litgpt", "finetune"],
            &["env", "-u", "X", "FOO=1", "python", "t.py"],
        ] {
            assert!(runs(cmd, &[]), "{cmd:?}");
        }
        // The program in `command`, its arguments in `args`.
        assert!(runs(&["python"], &["train.py", "--lr", "1e-4"]));
    }

    #[test]
    fn looks_inside_shell_scripts() {
        assert!(runs(
            &["bash", "-c"],
            &["pip install x && torchrun train.py"]
        ));
        assert!(runs(
            &[
                "/bin/sh",
                "-ec",
                "cd /w; export A=1\nNCCL_DEBUG=INFO python3 t.py"
            ],
            &[]
        ));
        assert!(runs(
            &["bash", "-lc", "bash -c 'accelerate launch t.py'"],
            &[]
        ));
        assert!(!runs(&["bash", "-c", "echo python; sleep 10"], &[]));
        assert!(!runs(&["bash", "train.sh"], &[]));
    }

    #[test]
    fn other_programs_and_unknown_commands_are_not_python() {
        assert!(!runs(&[], &[]), "the image's entrypoint is not visible");
        assert!(!runs(&[], &["train.py"]));
        assert!(!runs(&["./trainer", "--python"], &[]));
        assert!(!runs(&["accelerate", "config"], &[]));
        assert!(!runs(&["pythonista"], &[]));
        assert!(!runs(&["sleep", "infinity"], &[]));
        assert!(!runs(&["bash", "-c"], &[]), "no script");
    }
}
