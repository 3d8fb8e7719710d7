//! The phase a trainer is in, as its client reports it (`POST /v1/report` `phase`): what the
//! host memory of a GPU job is doing differs by phase (loading weights, stepping, writing a
//! checkpoint), so an OOM kill is recorded with the phase it came in (issue 39, item 3).

use serde::{Deserialize, Serialize};
use std::fmt;

/// Where the trainer is in its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "crd", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum TrainerPhase {
    /// From the client's attach until training begins: model and data loading.
    Load,
    /// Training steps.
    Step,
    /// From the step the trainer decided to save at until the checkpoint is written.
    Save,
}

impl TrainerPhase {
    /// Every phase, in run order.
    pub const ALL: [TrainerPhase; 3] = [TrainerPhase::Load, TrainerPhase::Step, TrainerPhase::Save];

    /// Lowercase name, as on the wire.
    pub const fn name(self) -> &'static str {
        match self {
            TrainerPhase::Load => "load",
            TrainerPhase::Step => "step",
            TrainerPhase::Save => "save",
        }
    }
}

impl fmt::Display for TrainerPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_phase_reads_from_its_name_and_nothing_else() {
        for phase in TrainerPhase::ALL {
            let text = format!("\"{phase}\"");
            assert_eq!(
                serde_json::from_str::<TrainerPhase>(&text).ok(),
                Some(phase)
            );
        }
        for bad in ["\"Save\"", "\"eval\"", "\"\"", "1"] {
            assert!(serde_json::from_str::<TrainerPhase>(bad).is_err(), "{bad}");
        }
    }
}
