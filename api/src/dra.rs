//! DRA (`spec.resourceClaims`, `resource.k8s.io/v1`, GA in Kubernetes 1.34): the memory of
//! the device a claim gets, read from a [`DraCatalog`] (the webhook's watch caches, or objects
//! given to `memguard mutate --dra`). Pure: the catalog is an input, lookups never call the
//! API; whatever is missing is a warning that names it, never an error.
//!
//! Three parts: [`objects`] (the narrow types), [`catalog`] (where they come from) and
//! [`reading`] (a pod's claims → the device and its memory).

pub mod catalog;
pub mod objects;
pub mod reading;

pub use catalog::{DraCatalog, StaticCatalog};
pub use objects::*;
pub use reading::{DraMemory, DraReading, class_driver, driver_device, read};

/// The API group and version read.
pub const API_VERSION: &str = "resource.k8s.io/v1";
/// NVIDIA's DRA driver (k8s-dra-driver-gpu): whole GPUs and MIG devices.
pub const NVIDIA_DRIVER: &str = "gpu.nvidia.com";
/// AMD's DRA driver (k8s-gpu-dra-driver).
pub const AMD_DRIVER: &str = "gpu.amd.com";
/// The capacity both GPU drivers publish per device, in bytes (a quantity).
pub const MEMORY_CAPACITY: &str = "memory";
/// The attribute NVIDIA's driver publishes with the NVML product name (`NVIDIA H100 80GB HBM3`).
pub const PRODUCT_ATTRIBUTE: &str = "productName";
