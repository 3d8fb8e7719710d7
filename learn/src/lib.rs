//! Learning from runs: what finished training pods teach memguard, kept in `MemoryProfile`.
//!
//! - [`decision`]: the budget stage every caller shares (admission, `memguard estimate`,
//!   `memguard explain`): the key, the budget ([`budget`]), the placement ([`placement`]) and
//!   the plan under the policy's floors, its warnings cut to size ([`warnings`]) (pure).
//! - [`key`]: the profile key of a pod and the object name it maps to (pure).
//! - [`observe`]: a finished pod → an [`Observation`] (pure).
//! - [`update`]: an observation folded into a profile status, idempotently (pure).
//! - [`adjust`]: a profile → the [`Adjustments`] the webhook applies at admission (pure).
//! - `controller` (feature `controller`): watches finished pods and writes profiles, under a
//!   leader lease.
#![deny(missing_docs)]

pub mod adjust;
pub mod budget;
pub mod decision;
pub mod key;
pub mod observe;
pub mod placement;
pub mod update;
pub mod warnings;

#[cfg(feature = "controller")]
pub mod controller;
#[cfg(feature = "controller")]
pub mod lease;
#[cfg(feature = "controller")]
pub mod metrics;

#[cfg(all(test, feature = "controller"))]
pub(crate) mod mock_api;
#[cfg(test)]
pub(crate) mod testutil;

pub use adjust::{Adjustments, adjustments, recovery_start};
pub use decision::{Decision, decide};
pub use key::{PodKey, object_name, pod_key};
pub use observe::{NotObserved, Observation, observe, try_observe};
pub use update::apply;
