//! Learning from runs: what finished training pods teach memguard, kept in `MemoryProfile`.
//!
//! - [`observe`]: a finished pod → an [`Observation`] (pure).
//! - [`update`]: an observation folded into a profile status, idempotently (pure).
//! - `controller` (feature `controller`): watches finished pods and writes profiles, under a
//!   leader lease.
//!
//! The profile key a run is learned under and what a profile teaches admission are the decision
//! stage's (`memguard-decide`: `key`, `adjust`).
#![deny(missing_docs)]

pub mod observe;
pub mod update;

#[cfg(feature = "controller")]
pub mod controller;
#[cfg(feature = "controller")]
pub mod lease;
#[cfg(feature = "controller")]
pub mod metrics;

#[cfg(all(test, feature = "controller"))]
pub(crate) mod mock_api;

pub use observe::{NotObserved, Observation, observe, try_observe};
pub use update::apply;
