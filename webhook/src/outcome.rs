//! What the decision returns ([`Outcome`]) and what a mutation carries: the types shared by
//! the decision ([`crate::mutate`]), the servers' fit ([`crate::serving`]), the patch
//! ([`crate::patch`]) and the review. Data only.

use memguard_api::estimate::{ArgsChange, EstimateAnnotation};
use memguard_api::policy::{SidecarMode, SidecarResources};
use memguard_decide::budget::Budget;
use memguard_decide::warnings::truncate;
use memguard_estimator::DowngradePlan;

/// What memguard does with a pod.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Not for memguard (not opted in): nothing to do, no warning.
    Unchanged,
    /// The pod as memguard wants it (which may already be how it is).
    Mutated(Box<Mutation>),
    /// A Python trainer whose config admission cannot read (no model it knows, a launch it
    /// cannot read): the sidecar and the client are injected so that it is guarded at run
    /// time, and its command, args and config stay as they are ([`Guarded`]).
    Guarded(Box<Guarded>),
    /// An inference server (vLLM, SGLang) fitted to the pod's share ([`crate::serving`]).
    Served(Box<crate::serving::ServerAdmission>),
    /// Opted in but unusable (bad annotations, no container, internal error): admitted unchanged
    /// except `memguard.io/error`.
    Skipped {
        /// The full reason, for the `memguard.io/error` annotation.
        error: String,
        /// A short form (≤ [`MAX_WARNING_CHARS`](memguard_decide::warnings::MAX_WARNING_CHARS)) for the admission response.
        warning: String,
    },
}

/// The sidecar to inject, as decided (rendered into a container by [`crate::patch`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SidecarPlan {
    /// Native (`initContainers`, `restartPolicy: Always`) or classic (`containers`).
    pub mode: SidecarMode,
    /// Image.
    pub image: String,
    /// Resources.
    pub resources: SidecarResources,
    /// Literal env of the sidecar (the downward-API limit is added by the patch).
    pub env: Vec<(String, String)>,
}

/// The Python client to inject into the trainer (rendered by [`crate::patch`]): an init
/// container running `memguard client install` into an `emptyDir`, mounted in the trainer and
/// prepended to its `PYTHONPATH`.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientPlan {
    /// Image of the init container (it holds the `memguard` binary).
    pub image: String,
}

/// Everything memguard wants changed on one pod.
#[derive(Debug, Clone, PartialEq)]
pub struct Mutation {
    /// Index of the trainer in `spec.containers`.
    pub trainer_index: usize,
    /// Name of the trainer container.
    pub trainer: String,
    /// The budget, when the pod has one (a CPU pod without a memory limit has none).
    pub budget: Option<Budget>,
    /// The downgrade plan from the original config.
    pub plan: DowngradePlan,
    /// `MEMGUARD_*` variables for the trainer, in a stable order.
    pub trainer_env: Vec<(String, String)>,
    /// The user's own variables (env-map), rewritten in place.
    pub user_env: Vec<(String, String)>,
    /// The trainer's `command` and `args` rewritten in its own terms (HF flags), when the plan
    /// changed a knob read from them; `None`: left byte for byte.
    pub command_line: Option<CommandLine>,
    /// What changed, in the trainer's words (`--per_device_train_batch_size 8→2`).
    pub changed: Vec<String>,
    /// The sidecar.
    pub sidecar: SidecarPlan,
    /// The `memguard.io/estimate` annotation.
    pub estimate: EstimateAnnotation,
    /// Warnings for the admission response, each ≤ [`MAX_WARNING_CHARS`](memguard_decide::warnings::MAX_WARNING_CHARS).
    pub warnings: Vec<String>,
    /// `memguard.io/error` to keep on the mutated pod: "cannot fit: …", the profile's verdict
    /// (OOM recoveries exhausted) or the plan's (every knob at its floor and still over budget).
    pub error: Option<String>,
    /// The pod's `spec.affinity` with memguard's placement merged in, when placement added any.
    pub affinity: Option<k8s_openapi::api::core::v1::Affinity>,
    /// The Python client, when the trainer runs Python and neither the policy nor the pod opted
    /// out.
    pub client: Option<ClientPlan>,
    /// The `sizeLimit` of the memory-backed `/dev/shm` memguard mounts in the trainer for its
    /// DataLoader workers ([`memguard_api::wellknown::SHM_VOLUME`]).
    pub shm: Option<memguard_estimator::Bytes>,
}

/// A trainer guarded at run time only: what admission injects when it cannot read the
/// trainer's config (rendered by [`crate::patch`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Guarded {
    /// Index of the trainer in `spec.containers`.
    pub trainer_index: usize,
    /// The signal file and the sidecar's URL, for the client.
    pub trainer_env: Vec<(String, String)>,
    /// The sidecar, with no starting knobs and no estimate: it starts from its own floor.
    pub sidecar: SidecarPlan,
    /// The Python client.
    pub client: Option<ClientPlan>,
    /// `memguard.io/error`: why nothing was planned at admission, and that the pod is guarded.
    pub reason: String,
    /// For the admission response, each ≤ [`MAX_WARNING_CHARS`](memguard_decide::warnings::MAX_WARNING_CHARS).
    pub warnings: Vec<String>,
}

/// A container's command line as memguard writes it.
#[derive(Debug, Clone, PartialEq)]
pub struct CommandLine {
    /// `command`, when the pod has one.
    pub command: Option<Vec<String>>,
    /// `args`, when the pod has them.
    pub args: Option<Vec<String>>,
    /// The whole command line before and after, for the estimate annotation.
    pub change: ArgsChange,
}

impl Mutation {
    /// Number of downgrade steps the plan applied.
    pub fn steps(&self) -> usize {
        self.plan.steps.len()
    }
}

/// An [`Outcome::Skipped`] with the warning cut to size.
pub fn skipped(error: String) -> Outcome {
    let warning = truncate(&format!("memguard skipped this pod: {error}"));
    Outcome::Skipped { error, warning }
}
