//! The trainer's launch, found once per pod in its `command` + `args` and classified once: every
//! reader of it (the model, the knobs and their cited defaults, the config file, the job's world
//! size, the skip message) and the webhook's rewrite start from this one value, and the order
//! in which the dialects are tried is written here only ([`TrainerLaunch::dialect`]).

use super::*;
use crate::estimate::EstimateAnnotation;
use crate::launch::tune::TuneRun;
use crate::launch::{Flags, HfRules, Launch, LaunchError, Program};

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
        let found = crate::launch::find_in_env(&items, &literal_env(trainer));
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
            earlier: earlier_estimate(pod),
        }
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
