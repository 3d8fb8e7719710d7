//! Flags of `memguard-webhook`; each is also settable through a `MEMGUARD_WEBHOOK_*` variable.

use crate::policy_sources::Overrides;
use memguard_api::policy::SidecarMode;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// memguard's mutating admission webhook: estimates training pods, rewrites their knobs to fit
/// and injects the sidecar. Serves AdmissionReviews over HTTPS and metrics over plain HTTP.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "memguard-webhook", version, about)]
pub struct Args {
    /// HTTPS address for `POST /mutate`, `/healthz` and `/readyz`.
    #[arg(long, env = "MEMGUARD_WEBHOOK_LISTEN", default_value = "0.0.0.0:8443")]
    pub listen: SocketAddr,

    /// Plain-HTTP address for `GET /metrics`.
    #[arg(
        long,
        env = "MEMGUARD_WEBHOOK_METRICS_LISTEN",
        default_value = "0.0.0.0:9090"
    )]
    pub metrics_listen: SocketAddr,

    /// PEM certificate chain (`tls.crt` of a `kubernetes.io/tls` Secret); reloaded on change.
    #[arg(long, env = "MEMGUARD_WEBHOOK_TLS_CERT_FILE")]
    pub tls_cert_file: PathBuf,

    /// PEM private key (`tls.key`); reloaded on change.
    #[arg(long, env = "MEMGUARD_WEBHOOK_TLS_KEY_FILE")]
    pub tls_key_file: PathBuf,

    /// Policy document (YAML or JSON `PolicySpec`, or a whole `MemguardPolicy` manifest): the
    /// policy until the watched `MemguardPolicy` shows, and again after it is deleted.
    #[arg(long, env = "MEMGUARD_WEBHOOK_POLICY_FILE")]
    pub policy_file: Option<PathBuf>,

    /// The cluster-scoped `MemguardPolicy` to watch; once present and valid it replaces the
    /// policy file (the flags below still win).
    #[arg(
        long,
        env = "MEMGUARD_WEBHOOK_POLICY_NAME",
        default_value = memguard_api::crd::DEFAULT_POLICY_NAME,
        value_parser = parse_policy_name
    )]
    pub policy_name: String,

    /// Fraction of device memory a plan may use, in (0, 1]; overrides the policy.
    #[arg(long, env = "MEMGUARD_WEBHOOK_SAFETY_RATIO")]
    pub safety_ratio: Option<f64>,

    /// GPU memory when no product is known, a number and a unit (e.g. `80Gi`); overrides the
    /// policy.
    #[arg(long, env = "MEMGUARD_WEBHOOK_DEFAULT_GPU_MEMORY")]
    pub default_gpu_memory: Option<String>,

    /// Sidecar image; overrides the policy.
    #[arg(long, env = "MEMGUARD_WEBHOOK_SIDECAR_IMAGE")]
    pub sidecar_image: Option<String>,

    /// `native` (initContainers, restartPolicy Always) or `classic`; overrides the policy.
    #[arg(long, env = "MEMGUARD_WEBHOOK_SIDECAR_MODE", value_parser = parse_mode)]
    pub sidecar_mode: Option<SidecarMode>,

    /// Answer within this many milliseconds (keep below the webhook's `timeoutSeconds`).
    #[arg(
        long,
        env = "MEMGUARD_WEBHOOK_REQUEST_TIMEOUT_MS",
        default_value_t = 4000
    )]
    pub request_timeout_ms: u64,

    /// How often the certificate files are checked for a change, in milliseconds.
    #[arg(
        long,
        env = "MEMGUARD_WEBHOOK_TLS_RELOAD_INTERVAL_MS",
        default_value_t = 1000
    )]
    pub tls_reload_interval_ms: u64,

    /// Longest wait for in-flight requests after SIGTERM, in seconds.
    #[arg(
        long,
        env = "MEMGUARD_WEBHOOK_SHUTDOWN_GRACE_SECONDS",
        default_value_t = 15
    )]
    pub shutdown_grace_seconds: u64,

    /// Run without a cluster: no MemguardPolicy watch, no MemoryProfile watch cache, no profile
    /// controller. Without the flag they start when a Kubernetes config is found (in-cluster or
    /// kubeconfig); when none is, the webhook logs it once and runs with its flags and policy
    /// file only.
    #[arg(long, env = "MEMGUARD_WEBHOOK_NO_KUBE")]
    pub no_kube: bool,

    /// Do not watch DRA objects (ResourceClaim, ResourceClaimTemplate, DeviceClass,
    /// ResourceSlice): pods with DRA claims are admitted with a warning. The chart sets it
    /// when `dra.enabled` is false (and grants no RBAC on `resource.k8s.io`).
    #[arg(long, env = "MEMGUARD_WEBHOOK_NO_DRA")]
    pub no_dra: bool,

    /// Do not read ConfigMaps: a trainer whose config is a file in a ConfigMap (axolotl,
    /// LLaMA-Factory, `tune run --config`, a DeepSpeed JSON) is planned without it, with a
    /// warning. The chart sets it when `configMaps.read` is false (and grants no RBAC on them).
    #[arg(long, env = "MEMGUARD_WEBHOOK_NO_CONFIG_MAPS")]
    pub no_config_maps: bool,

    /// Read ConfigMaps in these namespaces only (comma-separated object names; the chart
    /// grants a Role in each); default: every namespace.
    #[arg(
        long,
        env = "MEMGUARD_WEBHOOK_CONFIG_MAP_NAMESPACES",
        value_delimiter = ',',
        value_parser = parse_policy_name
    )]
    pub config_map_namespaces: Vec<String>,

    /// Do not watch Nodes (their labels and taints): an unpinned GPU pod is planned against
    /// `defaultGpuMemory`, with a warning.
    #[arg(long, env = "MEMGUARD_WEBHOOK_NO_NODES")]
    pub no_nodes: bool,

    /// Namespace of the profile controller's leader Lease; default: `$POD_NAMESPACE` (the
    /// chart sets it from the downward API), else the client's default namespace.
    #[arg(long, env = "MEMGUARD_WEBHOOK_LEASE_NAMESPACE")]
    pub lease_namespace: Option<String>,

    /// This replica's identity in the Lease; default: `$POD_NAME` (the chart sets it), else
    /// `$HOSTNAME`.
    #[arg(long, env = "MEMGUARD_WEBHOOK_LEASE_IDENTITY")]
    pub lease_identity: Option<String>,

    /// Seconds a Lease lasts without renewal; renewed every third of it.
    #[arg(long, env = "MEMGUARD_WEBHOOK_LEASE_SECONDS", default_value_t = 15)]
    pub lease_seconds: u64,

    /// Log format: `json` (default) or `text`. Levels come from `RUST_LOG` (default `info`).
    #[arg(long, env = "MEMGUARD_WEBHOOK_LOG_FORMAT", default_value = "json")]
    pub log_format: LogFormat,
}

/// Log output format (shared with the sidecar).
pub use memguard_runtime::LogFormat;

impl Args {
    /// The flag overrides of the policy.
    pub fn overrides(&self) -> Overrides {
        Overrides {
            safety_ratio: self.safety_ratio,
            default_gpu_memory: self.default_gpu_memory.clone(),
            sidecar_image: self.sidecar_image.clone(),
            sidecar_mode: self.sidecar_mode,
        }
    }

    /// `--request-timeout-ms` as a duration.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms.max(1))
    }
}

/// A Kubernetes object name (DNS subdomain), so it is safe inside a field selector.
pub fn parse_policy_name(s: &str) -> Result<String, String> {
    let valid = !s.is_empty()
        && s.len() <= 253
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
        && s.starts_with(|c: char| c.is_ascii_alphanumeric())
        && s.ends_with(|c: char| c.is_ascii_alphanumeric());
    if valid {
        Ok(s.to_string())
    } else {
        Err(format!("`{s}` is not a Kubernetes object name"))
    }
}

/// `native|classic`.
pub fn parse_mode(s: &str) -> Result<SidecarMode, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "native" => Ok(SidecarMode::Native),
        "classic" => Ok(SidecarMode::Classic),
        other => Err(format!("`{other}` is not `native` or `classic`")),
    }
}
