//! Placement lives in [`memguard_learn::placement`], a step of the shared budget stage
//! ([`memguard_learn::decision`]); this module keeps the webhook's paths and its tests.

pub use memguard_learn::placement::*;

#[cfg(test)]
mod tests;
