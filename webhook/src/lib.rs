//! memguard's mutating admission webhook: estimate a training pod's peak memory, rewrite its
//! training knobs to fit the budget it will really have, and inject the sidecar.
//!
//! The decision ([`mutate::mutate`]) and its expression as a JSON patch ([`patch::build`]) are
//! pure and always built; [`review`] wraps them for an AdmissionReview and [`manifest`] for
//! workloads on disk (`memguard mutate`). The HTTPS server sits behind the default `server`
//! feature, so the CLI reuses the very same code path without axum or tokio.
#![forbid(unsafe_code)]

#[cfg(feature = "server")]
pub mod args;
pub mod dra;
pub mod gpu_enforce;
pub mod manifest;
#[cfg(feature = "server")]
pub mod metrics;
pub mod mutate;
#[cfg(feature = "server")]
pub mod not_ready;
pub mod outcome;
pub mod patch;
pub mod policy_sources;
#[cfg(feature = "server")]
pub mod profiles;
mod render;
pub mod review;
#[cfg(feature = "server")]
pub mod server;
pub mod serving;
#[cfg(feature = "server")]
pub mod tasks;
#[cfg(feature = "server")]
pub mod tls;
pub mod watch;

#[cfg(all(test, feature = "server"))]
mod mock_kube;
#[cfg(test)]
mod testutil;

pub use mutate::{Mutation, Outcome, mutate};
pub use watch::ClusterView;
