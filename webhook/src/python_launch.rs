//! Whether a trainer runs Python: the one question the client injection asks of a command line.
//!
//! The command line is read by the shared launch reader ([`memguard_api::launch::runs_python`]:
//! the launchers, wrappers and `sh -c` scripts it knows). What is specific to the injection: a
//! container whose command it cannot see (the image's entrypoint) is not Python to it, and the
//! webhook then injects nothing, which costs the pod nothing.

use k8s_openapi::api::core::v1::Container;

/// Whether `container`'s `command` + `args` start a Python trainer.
pub fn runs_python(container: &Container) -> bool {
    let items: Vec<String> = container
        .command
        .iter()
        .flatten()
        .chain(container.args.iter().flatten())
        .cloned()
        .collect();
    memguard_api::launch::runs_python(&items)
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
