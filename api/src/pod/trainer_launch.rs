//! The trainer's launch, found once per pod in its `command` + `args` and classified once: every
//! reader of it (the model, the knobs and their cited defaults, the config file, the job's world
//! size, the skip message, whether it runs Python) and the webhook's rewrite start from this one
//! value, and the order in which the dialects are tried is written here only
//! ([`TrainerLaunch::dialect`]). The same search finds the inference server the container starts,
//! if any ([`TrainerLaunch::server`]): the webhook admits that pod as a server instead.

use super::*;
use crate::estimate::EstimateAnnotation;
use crate::launch::server::starts_server;
use crate::launch::tune::TuneRun;
use crate::launch::{Argv, Flags, HfRules, Launch, LaunchError, Program, ServerLaunch};

/// How a trainer's command line is read, and so rewritten.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// A bespoke script's flags named by the policy's flag map for its image
    /// ([`crate::launch::MappedRules`]).
    Mapped,
    /// ms-swift's `swift sft|pt|rlhf`: HF rules, its own flag names, read and rewritten as a
    /// flag map ([`swift_flags`]), with ms-swift's own defaults.
    Swift,
    /// torchtune's `tune run`: `key=value` overrides over the recipe's config.
    Tune,
    /// Hugging Face argument rules (Python scripts and modules, `trl`), with the defaults of
    /// the parsers memguard knows ([`hf_parser`]).
    Hf,
}

/// The trainer's launch, found once ([`TrainerLaunch::of`]).
#[derive(Debug, Clone, PartialEq)]
pub struct TrainerLaunch {
    /// The container's `command` followed by its `args`.
    pub items: Vec<String>,
    /// How many of `items` are `command` (a rewrite splits them back there).
    pub command_len: usize,
    /// The launch in `items`, the shell's and the kubelet's variables resolved from the
    /// trainer's literal env; or why there is none.
    pub found: Result<Launch, LaunchError>,
    /// Its flags under HF rules, when it is a launch with HF rules; `Err`: a launch that
    /// cannot be read, and why.
    hf: Result<Option<Flags>, String>,
    /// Its `tune run`, when it runs one; `Err`: a `tune run` that cannot be read, and why.
    tune: Result<Option<TuneRun>, String>,
    /// The inference server the command line starts (the first launch that is one: a script may
    /// run a download before it), its variables resolved as the trainer's are.
    server: Option<ServerLaunch>,
    /// What memguard wrote into the pod at an earlier admission (reinvocation, a pod recreated
    /// from its own output): its estimate annotation, parsed once. A value read now that equals
    /// what memguard wrote is memguard's, and the value read then is the trainer's.
    pub earlier: Option<EstimateAnnotation>,
}

impl TrainerLaunch {
    /// Finds and classifies the launch of `pod`'s `trainer`: the one parse of its command line
    /// (and of memguard's earlier estimate).
    pub fn of(pod: &Pod, trainer: &Container) -> TrainerLaunch {
        let (items, command_len) = command_items(trainer);
        // The one search: the first launch (a trainer's) and the first server launch.
        let both = crate::launch::find_both_in_env(&items, &literal_env(trainer), &starts_server);
        let found = both.first;
        let server = both.accepted.and_then(|launch| {
            let argv = Argv::new(trainer.command.as_deref(), trainer.args.as_deref());
            ServerLaunch::of(argv, launch)
        });
        let hf = match &found {
            Ok(launch) => Ok(has_hf_rules(launch).then(|| Flags::parse(&launch.texts(), &HfRules))),
            Err(LaunchError::Empty | LaunchError::NoProgram | LaunchError::NestedShell(_)) => {
                Ok(None)
            }
            Err(e) => Err(e.to_string()),
        };
        let tune = match &found {
            Ok(launch) => TuneRun::read(launch).map_err(|e| e.to_string()),
            Err(_) => Ok(None),
        };
        TrainerLaunch {
            items,
            command_len,
            found,
            hf,
            tune,
            server,
            earlier: earlier_estimate(pod),
        }
    }

    /// The launch of `pod`'s trainer ([`pod_trainer`]), with its index: the pod's one search of
    /// its command line. `None`: no container is the trainer.
    pub fn of_pod(pod: &Pod) -> Option<(usize, TrainerLaunch)> {
        let (index, trainer) = pod_trainer(pod).ok()?;
        Some((index, TrainerLaunch::of(pod, trainer)))
    }

    /// The launch, when one was found.
    pub fn launch(&self) -> Option<&Launch> {
        self.found.as_ref().ok()
    }

    /// The dialect its command line is read and rewritten with, in memguard's order: the
    /// policy's flag map for the trainer's image (`mapped`), then ms-swift, `tune run`, HF
    /// rules. `Ok(None)`: none applies; `Err`: a launch that cannot be read, and why.
    pub fn dialect(&self, mapped: bool) -> Result<Option<Dialect>, String> {
        if mapped {
            return Ok(Some(Dialect::Mapped));
        }
        let hf = self.hf.clone()?;
        if hf.is_some() && self.launch().is_some_and(is_swift) {
            return Ok(Some(Dialect::Swift));
        }
        if self.tune.clone()?.is_some() {
            return Ok(Some(Dialect::Tune));
        }
        Ok(hf.map(|_| Dialect::Hf))
    }

    /// The inference server the container starts, when it starts one: the pod is a server's,
    /// fitted by the webhook's serving admission, not planned as a trainer.
    pub fn server(&self) -> Option<&ServerLaunch> {
        self.server.as_ref()
    }

    /// Whether the container starts a Python program, which the webhook's client injection asks
    /// ([`crate::launch::runs_python`], from this one search).
    pub fn runs_python(&self) -> bool {
        crate::launch::runs_python(&self.found)
    }

    /// The launch and its `tune run`, when it is one ([`Dialect::Tune`]).
    pub(crate) fn tune_run(&self) -> Option<(&Launch, &TuneRun)> {
        let run = self.tune.as_ref().ok()?.as_ref()?;
        Some((self.launch()?, run))
    }

    /// The launch and its flags under HF rules ([`Dialect::Hf`] or [`Dialect::Swift`]).
    pub(crate) fn hf(&self) -> Option<(&Launch, &Flags)> {
        let flags = self.hf.as_ref().ok()?.as_ref()?;
        Some((self.launch()?, flags))
    }
}

/// Whether `launch` takes HF argument rules: a Python script or module (not axolotl's, whose
/// fire keyword arguments its config-file reader reads), `trl`, or ms-swift.
fn has_hf_rules(launch: &Launch) -> bool {
    match &launch.program {
        Program::Module(m) => m != "axolotl.cli.train",
        Program::Script(_) => true,
        Program::Command(_) => launch.program.name() == "trl" || is_swift(launch),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::EnvVar;

    fn container(command: &[&str], args: &[&str]) -> Container {
        Container {
            command: (!command.is_empty()).then(|| command.iter().map(|s| s.to_string()).collect()),
            args: (!args.is_empty()).then(|| args.iter().map(|s| s.to_string()).collect()),
            ..Container::default()
        }
    }

    /// Whether the client injection takes the container for Python.
    fn runs(command: &[&str], args: &[&str]) -> bool {
        TrainerLaunch::of(&Pod::default(), &container(command, args)).runs_python()
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

    /// A shell started by a shell script is not searched a second time: it is taken for Python
    /// whatever it runs, because the client is inert in a process that is not Python and a
    /// Python trainer without it loses its run-time guard (docs/webhook.md).
    #[test]
    fn a_shell_started_by_a_script_is_taken_for_python() {
        assert!(runs(&["bash", "-c", "cd /w && bash -c 'python t.py'"], &[]));
        // Before the one classification these two were not Python (the inner shell was
        // searched, and runs no Python): the client now goes in, and does nothing there.
        assert!(runs(&["bash", "-c", "bash -c 'echo hi'"], &[]));
        assert!(runs(&["sh", "-c", "sh -c ./train.py"], &[]));
    }

    /// The answer reads the launch as the trainer's readers do, with the container's env.
    #[test]
    fn the_program_named_by_a_variable_is_read_from_the_env() {
        let mut c = container(&["$(PY)", "train.py"], &[]);
        assert!(!TrainerLaunch::of(&Pod::default(), &c).runs_python());
        c.env = Some(vec![EnvVar {
            name: "PY".into(),
            value: Some("python3".into()),
            ..EnvVar::default()
        }]);
        assert!(TrainerLaunch::of(&Pod::default(), &c).runs_python());
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
