//! Well-known names every part must agree on: the opt-in label, container and volume names,
//! file paths, listen addresses and ports, the CRD group and NVIDIA's resource and label names.
//! (Annotation keys live in [`crate::annotations`], environment variables in [`crate::env`].)

/// The opt-in label the webhook's objectSelector matches.
pub const ENABLED_LABEL: &str = "memguard.io/enabled";
/// The value of [`ENABLED_LABEL`] that opts a pod in.
pub const ENABLED_VALUE: &str = "true";
/// Name of the injected sidecar container.
pub const SIDECAR_CONTAINER: &str = "memguard-sidecar";
/// Name of the shared `emptyDir` volume holding the signal file.
pub const SIGNAL_VOLUME: &str = "memguard-signal";
/// Where the shared volume is mounted in the trainer and the sidecar.
pub const SIGNAL_DIR: &str = "/var/run/memguard";
/// The signal file on the shared volume.
pub const SIGNAL_FILE: &str = "/var/run/memguard/signal.json";
/// Name of the memory-backed `emptyDir` memguard mounts at [`SHM_DIR`] in a trainer whose
/// DataLoader workers pass batches through shared memory.
pub const SHM_VOLUME: &str = "memguard-shm";
/// Where shared memory is mounted.
pub const SHM_DIR: &str = "/dev/shm";
/// Name of the init container that copies the Python client, and of its `emptyDir` volume.
pub const CLIENT_CONTAINER: &str = "memguard-client";
/// Where the client's volume is mounted (init container and trainer); prepended to `PYTHONPATH`.
pub const CLIENT_DIR: &str = "/var/run/memguard-client";
/// The binary in the memguard image that writes the client it embeds (`memguard client install`).
pub const CLI_BINARY: &str = "memguard";
/// Default pod-local trainer API address of the sidecar.
pub const SIDECAR_LISTEN: &str = "127.0.0.1:9091";
/// Default sidecar metrics address (serves only `/metrics` and `/healthz`).
pub const SIDECAR_METRICS_LISTEN: &str = "0.0.0.0:9092";
/// Name of the sidecar's metrics port.
pub const SIDECAR_METRICS_PORT_NAME: &str = "mg-metrics";
/// Path the webhook serves admission reviews on.
pub const WEBHOOK_PATH: &str = "/mutate";
/// Default HTTPS port of the webhook.
pub const WEBHOOK_PORT: u16 = 8443;
/// Default plain-HTTP metrics port of the webhook.
pub const WEBHOOK_METRICS_PORT: u16 = 9090;
/// Default termination-message path (Kubernetes' own default).
pub const TERMINATION_LOG: &str = "/dev/termination-log";
/// The API group of memguard's CRDs.
pub const GROUP: &str = "training.memguard.io";
/// The container toolkit's per-container GPU memory request, in bytes (driver r615 or later,
/// kernel 6.14 or later; written only under the policy's `enforceGpuMemory`).
pub const NVIDIA_GPU_MEMORY_REQUEST_ENV: &str = "NVIDIA_GPU_MEMORY_REQUEST";
/// The container toolkit's per-container GPU memory limit, in bytes (as above).
pub const NVIDIA_GPU_MEMORY_LIMIT_ENV: &str = "NVIDIA_GPU_MEMORY_LIMIT";
/// Extended resource name of NVIDIA GPUs.
pub const NVIDIA_GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Node label naming the GPU product (GPU feature discovery).
pub const NVIDIA_GPU_PRODUCT_LABEL: &str = "nvidia.com/gpu.product";
