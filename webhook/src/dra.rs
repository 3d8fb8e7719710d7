//! DRA: the objects, the catalog and the reading live in [`memguard_api::dra`], next to the pod
//! reading that uses them; this module keeps the webhook's paths and its tests.

pub use memguard_api::dra::*;

#[cfg(test)]
mod tests;
