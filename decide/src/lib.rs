//! The decision stage, once for every caller: the webhook's admission, `memguard estimate`,
//! `memguard explain`, the profile controller's key and, at train start, the sidecar. Pure: no
//! I/O, no Kubernetes client, no async runtime.
//!
//! - [`decision`]: a resolved pod under a policy → a [`Decision`]: the key, the budget
//!   ([`budget`]), what past runs teach ([`adjust`]), the placement ([`placement`]) and the plan
//!   under the policy's floors, its warnings cut to size ([`warnings`]).
//! - [`host`]: the pod's host memory planned against the trainer's `limits.memory`.
//! - [`key`]: the profile key of a pod and the object name it maps to; the controller learns
//!   under it and admission reads it.
//! - [`adjust`]: a profile → the [`Adjustments`] admission applies.
//! - [`reported`]: the pod as admission plans it on what its trainer reported in a past run.
//! - [`trainer_config`]: the trainer's reported knobs as the estimator's config (admission's
//!   plan on a report and the sidecar's at train start share it).
//! - [`guarded`]: a pod whose model admission cannot read, keyed by its launch and planned on
//!   its trainer's report.
//! - `testutil` (feature `testutil`): pod builders for tests, here and in `memguard-learn`.
#![deny(missing_docs)]

pub mod adjust;
pub mod budget;
pub mod decision;
pub mod guarded;
pub mod host;
pub mod key;
pub mod placement;
pub mod reported;
pub mod trainer_config;
pub mod warnings;

#[cfg(any(test, feature = "testutil"))]
pub mod testutil;

pub use adjust::{Adjustments, adjustments, recovery_start};
pub use decision::{Decision, decide};
pub use key::{PodKey, object_name, pod_key};
