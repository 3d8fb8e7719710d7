//! memguard-sidecar: watches the trainer's memory (cgroup v1/v2), pressure (PSI) and GPU (NVML or
//! the trainer's own reports), and tells it to shrink, through a file and HTTP, before it dies.
//!
//! Layout: `sample` (parsers and sources), `pressure` (the level state machine, pure), `growth`
//! (the micro-batch grown back on measured peaks, pure), `train_start` (the plan on the
//! trainer's reported config, pure), `engine` (one step), `signal` (the
//! file), `server` (HTTP), `metrics`, `trace`, `summary`, `events` (kernel wakeups), `run`.
#![deny(missing_docs)]

pub mod config;
pub mod engine;
pub mod events;
pub mod growth;
pub mod metrics;
pub mod pressure;
pub mod run;
pub mod sample;
pub mod server;
pub mod signal;
pub mod state;
pub mod summary;
pub mod trace;
pub mod train_start;

pub use config::{Args, Config};
pub use run::{init_tracing, run};
