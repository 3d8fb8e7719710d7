//! What admission reads of the cluster, all from watch caches (kube reflector stores filled in
//! the background), never from the API during a review:
//!
//! - [`view`]: [`ClusterView`], the read-only view the decision takes: the caches below, or
//!   objects read from files (`memguard mutate`). Always built.
//! - [`cluster`] (feature `server`): ConfigMaps (the config files trainers' launches name) and
//!   the nodes' GPU labels and taints, each trimmed to what is read as it arrives.
//! - [`dra`] (feature `server`): the DRA objects (ResourceClaim, ResourceClaimTemplate,
//!   DeviceClass, ResourceSlice) behind the DRA catalog.
//! - [`policy`] (feature `server`): the `MemguardPolicy`, swapped whole into the policy in
//!   force.
//!
//! The `MemoryProfile` cache starts with the profile controller that writes the profiles
//! ([`crate::profiles`]). Every cache but the DRA one (dynamic objects, readiness tracked) is
//! set up and driven the same way (`reflect`).

#[cfg(feature = "server")]
pub mod cluster;
#[cfg(feature = "server")]
pub mod dra;
#[cfg(feature = "server")]
pub mod policy;
#[cfg(feature = "server")]
mod reflect;
pub mod view;

#[cfg(feature = "server")]
pub(crate) use reflect::{drive, reflected};
pub use view::ClusterView;
