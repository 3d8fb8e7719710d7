//! The memguard contract, shared by every part: annotation keys and their parsing, the
//! environment variables written into the trainer, the signal schema between sidecar and
//! trainer, the trainer's OOM record, the termination summary, and (feature `crd`) the CRD types.
//!
//! Every shared string is a named constant here, once. Keep these names stable.
#![deny(missing_docs)]

pub mod annotations;
pub mod container_memory;
pub mod duration;
pub mod env;
pub mod estimate;
pub mod hf_config;
pub mod knobs;
pub mod launch;
pub mod models;
pub mod oom;
pub mod phase;
pub mod policy;
pub mod quantity;
pub mod signal;
pub mod summary;
pub mod train_start;
pub mod wellknown;

#[cfg(feature = "crd")]
pub mod cluster;
#[cfg(feature = "crd")]
pub mod coupled;
#[cfg(feature = "crd")]
pub mod crd;
#[cfg(feature = "crd")]
pub mod dra;
#[cfg(feature = "crd")]
pub mod job_world;
#[cfg(feature = "crd")]
pub mod mounted;
#[cfg(feature = "crd")]
pub mod pod;
#[cfg(feature = "crd")]
pub use cluster::Cluster;
#[cfg(feature = "crd")]
pub use pod::{ResolveError, TrainingPod};

pub use annotations::{AnnotationError, EnvMap, Knob, TrainingAnnotations};
pub use estimate::{BudgetSource, EstimateAnnotation, EstimateError};
pub use models::ModelCatalog;
pub use oom::{OomKind, OomOutcome, OomRecord};
pub use phase::TrainerPhase;
pub use policy::{Policy, PolicySpec};
pub use quantity::{Size, SizeError};
pub use signal::{Level, Pressure, Report, Signal, StickyKnobs};
pub use summary::Summary;
