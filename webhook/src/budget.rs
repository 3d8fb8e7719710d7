//! The budget stage lives in [`memguard_learn::budget`], where every caller of the decision
//! (admission, `memguard estimate`, `memguard explain`, the profile controller) reaches it; this
//! module keeps the webhook's paths and its tests.

pub use memguard_learn::budget::*;

#[cfg(test)]
mod tests;
