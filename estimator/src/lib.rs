//! The memory model of memguard: how many bytes one training step (forward, backward and
//! optimizer step) needs on one device, which downgrades make it fit a budget, and how past
//! runs correct the estimate.
//!
//! Pure: no I/O, no async, no Kubernetes. Every other part of memguard builds on this crate.
//!
//! ```
//! use memguard_estimator::{catalog, estimate, plan, Bytes, Calibration, Method, TrainingConfig};
//!
//! let mut cfg = TrainingConfig::new(catalog::lookup("llama-3-8b").unwrap());
//! cfg.method = Method::Lora;
//! let est = estimate(&cfg).unwrap();
//! assert!(est.total > Bytes::gib(15));
//! let p = plan(&cfg, Bytes::gib(24), &Calibration::none()).unwrap();
//! assert!(p.fits);
//! ```
#![deny(missing_docs)]

pub mod bound;
pub mod calibration;
pub mod catalog;
pub mod config;
pub mod estimate;
pub mod host;
pub mod inference;
pub mod params;
pub mod plan;
pub mod serving_fit;
pub mod suggest;
pub mod units;

pub use bound::Bound;
pub use calibration::Calibration;
pub use config::{
    ConfigError, Device, GradSync, LoraTargets, Loss, Method, Mla, ModelShape, Norms, Optimizer,
    Parallelism, Precision, TrainingConfig,
};
pub use estimate::{Component, Estimate, Fitted, estimate, estimate_with};
pub use host::{HostConfig, HostEstimate, Offload, Phase, SaveMode, host_estimate};
pub use inference::{ServingConfig, estimate_serving};
pub use plan::{
    BestStep, Cost, DowngradePlan, Floors, LADDER, QUALITY_MIN_SAVING, Rung, Step, best_step, plan,
    plan_against, plan_with_floors,
};
pub use suggest::{Suggestion, suggest};
pub use units::{Bytes, ParseError, parse_count};
