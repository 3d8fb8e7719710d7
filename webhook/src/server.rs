//! The HTTPS admission server and the plain-HTTP metrics server. Handlers only parse, log and
//! wrap: the work is [`crate::review::review`].

use crate::args::{Args, LogFormat};
use crate::metrics::Metrics;
use crate::mutate::ClusterView;
use crate::review::{self, Disposition};
use crate::tls::{self, CertFiles};
use crate::watch::policy::{LivePolicy, PolicyWatch};
use anyhow::Context;
use arc_swap::ArcSwap;
use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum_server::Handle;
use axum_server::tls_rustls::RustlsConfig;
use bytes::Bytes;
use memguard_api::{Policy, wellknown};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tower_http::timeout::TimeoutLayer;

/// Kubernetes caps request bodies at 3 MiB; an AdmissionReview is never larger.
pub const MAX_BODY_BYTES: usize = 3 * 1024 * 1024;

/// How long a connection may take to send a request's headers (the first, or the next on a
/// kept-alive connection) before it is closed.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The `reason` of the Kubernetes Event the webhook posts on its own Pod when its policy is
/// invalid at start (`kubectl describe pod` shows it).
pub const INVALID_POLICY_REASON: &str = "InvalidPolicy";

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    /// The policy in force; the `MemguardPolicy` watch swaps it, handlers only load it.
    pub policy: LivePolicy,
    /// Calibrations from `MemoryProfile`s.
    pub profiles: Arc<ClusterView>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Why the webhook is not ready, when it is not: its policy was invalid at start. `/readyz`
    /// answers 503 with it, and admission admits pods unchanged.
    pub not_ready: Option<Arc<str>>,
}

/// `POST /mutate`, `GET /healthz`, `GET /readyz`, with the body cap and the request timeout.
pub fn router(state: AppState, timeout: Duration) -> Router {
    Router::new()
        .route(wellknown::WEBHOOK_PATH, post(mutate))
        .route("/healthz", get(ok))
        .route("/readyz", get(ready))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            timeout,
        ))
        .with_state(state)
}

/// `GET /metrics` (OpenMetrics text).
pub fn metrics_router(metrics: Arc<Metrics>) -> Router {
    Router::new().route(
        "/metrics",
        get(move || {
            let metrics = metrics.clone();
            async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    metrics.encode(),
                )
            }
        }),
    )
}

async fn ok() -> &'static str {
    "ok"
}

/// 200 once serving with a valid policy; 503 with the reason otherwise, so that the Service
/// sends no reviews here and a rollout with a bad policy stops at this pod.
async fn ready(State(state): State<AppState>) -> Response {
    match &state.not_ready {
        None => "ok".into_response(),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
            .into_response(),
    }
}

async fn mutate(State(state): State<AppState>, body: Bytes) -> Response {
    let start = Instant::now();
    if state.not_ready.is_some() {
        return match review::admit_unchanged(&body, review::NOT_READY) {
            Ok(r) => {
                state.metrics.observe(r.disposition, 0, start.elapsed());
                tracing::warn!(pod = %r.pod, "admitted unchanged: not ready (invalid policy)");
                match serde_json::to_vec(&r.review) {
                    Ok(json) => {
                        ([(header::CONTENT_TYPE, "application/json")], json).into_response()
                    }
                    Err(error) => {
                        tracing::error!(%error, "could not encode the AdmissionReview");
                        StatusCode::INTERNAL_SERVER_ERROR.into_response()
                    }
                }
            }
            Err(error) => {
                state
                    .metrics
                    .observe(Disposition::Error, 0, start.elapsed());
                (StatusCode::BAD_REQUEST, error.to_string()).into_response()
            }
        };
    }
    // One lock-free load per review: the whole review sees one policy, even across a swap.
    let policy = state.policy.load();
    match review::review(&body, &policy, &state.profiles) {
        Ok(r) => {
            state
                .metrics
                .observe(r.disposition, r.steps, start.elapsed());
            match r.disposition {
                Disposition::Mutated
                | Disposition::Guarded
                | Disposition::Skipped
                | Disposition::Error => {
                    tracing::info!(
                        pod = %r.pod,
                        outcome = r.disposition.label(),
                        steps = r.steps,
                        warnings = ?r.warnings,
                        "admission reviewed"
                    );
                }
                Disposition::Unchanged => {
                    tracing::debug!(pod = %r.pod, outcome = "unchanged", "admission reviewed");
                }
            }
            match serde_json::to_vec(&r.review) {
                Ok(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
                Err(error) => {
                    tracing::error!(%error, "could not encode the AdmissionReview");
                    StatusCode::INTERNAL_SERVER_ERROR.into_response()
                }
            }
        }
        Err(error) => {
            state
                .metrics
                .observe(Disposition::Error, 0, start.elapsed());
            tracing::warn!(%error, "bad request");
            (StatusCode::BAD_REQUEST, error.to_string()).into_response()
        }
    }
}

/// Initializes logging once, on standard output: JSON (default) or text, levels from
/// `RUST_LOG` (default `info`). The setup the sidecar shares ([`memguard_runtime`]).
pub fn init_tracing(format: LogFormat) {
    memguard_runtime::init_tracing(format, memguard_runtime::LogStream::Stdout);
}

/// Runs the webhook until SIGTERM or ctrl-c, then drains for at most the grace period.
pub async fn run(args: Args) -> anyhow::Result<()> {
    init_tracing(args.log_format);
    let policy_text = match &args.policy_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading policy file {}", path.display()))?,
        ),
        None => None,
    };
    // A bad policy at start leaves nothing valid in force: the webhook serves, but not ready
    // (so a rollout stops here and the replicas with the last good policy keep serving), says
    // why on /readyz, in its log and in an Event on its Pod, and guards nothing. A bad resource
    // later never does this: the policy in force stays (policy_watch).
    let source = args
        .policy_file
        .as_ref()
        .map(|p| format!(" in {}", p.display()))
        .unwrap_or_default();
    let overrides = args.overrides();
    let loaded = crate::policy_sources::spec_from_str(policy_text.as_deref()).and_then(|file| {
        crate::policy_sources::effective_policy(file.as_ref(), None, &overrides)
            .map(|policy| (file, policy))
    });

    let profile_metrics = memguard_learn::metrics::Metrics::default();
    let metrics = Arc::new(Metrics::new().with_profile_metrics(&profile_metrics));
    let (policy, profiles, kube_tasks, not_ready) = match loaded {
        Ok((file, file_policy)) => {
            let file_policy = Arc::new(file_policy);
            for note in file_policy.models.notes() {
                tracing::info!(note, "policy file");
            }
            let policy: LivePolicy = Arc::new(ArcSwap::new(file_policy.clone()));
            let policy_watch = PolicyWatch::new(
                args.policy_name.clone(),
                file,
                overrides,
                file_policy,
                policy.clone(),
                metrics.clone(),
            );
            let (profiles, kube_tasks) =
                connect(&args, profile_metrics, policy_watch, policy.clone()).await;
            (policy, profiles, kube_tasks, None)
        }
        Err(problems) => {
            let why: Arc<str> = format!("invalid policy{source}: {}", problems.join("; ")).into();
            metrics.policy_reload(false);
            tracing::error!(
                reason = INVALID_POLICY_REASON,
                problems = %why,
                "NOT READY: the policy is invalid; no pod is guarded until it is fixed (with \
                 failurePolicy: Ignore, pods are admitted unchanged)"
            );
            if !args.no_kube {
                tokio::spawn(crate::not_ready::publish_event(why.clone()));
            }
            // Never used: admission answers before reading it, and nothing learns.
            let placeholder: LivePolicy = Arc::new(ArcSwap::from_pointee(Policy::default()));
            (
                placeholder,
                ClusterView::default(),
                crate::profiles::KubeTasks::default(),
                Some(why),
            )
        }
    };
    let files = CertFiles {
        cert: args.tls_cert_file.clone(),
        key: args.tls_key_file.clone(),
    };
    let pem = files.read().await?;
    let loaded = tls::load(&pem.0, &pem.1).context("loading the serving certificate")?;
    if let Some(t) = loaded.not_after {
        metrics.set_cert_expiry(t);
    }
    let served = RustlsConfig::from_config(loaded.config);
    let watcher = tokio::spawn(tls::watch(
        files,
        served.clone(),
        metrics.clone(),
        Duration::from_millis(args.tls_reload_interval_ms.max(10)),
        pem,
    ));

    let not_ready_at_start = not_ready.clone();
    let state = AppState {
        policy,
        profiles: Arc::new(profiles),
        metrics: metrics.clone(),
        not_ready,
    };
    let handle: Handle<SocketAddr> = Handle::new();
    // Bound here, not inside the server task, so that a port in use stops the start with its
    // cause instead of a listener that silently never starts.
    let listener = std::net::TcpListener::bind(args.listen)
        .with_context(|| format!("binding the HTTPS listener {}", args.listen))?;
    listener.set_nonblocking(true)?;
    let mut https = axum_server::from_tcp_rustls(listener, served)
        .with_context(|| format!("serving HTTPS on {}", args.listen))?
        .handle(handle.clone());
    // axum-server turns hyper's header read timeout off: a client that opens a connection and
    // trickles its headers, or never sends them (slowloris), would hold it open forever. The TLS
    // handshake has its own 10 s limit (axum-server's default).
    https
        .http_builder()
        .http1()
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let https = https.serve(router(state, args.request_timeout()).into_make_service());
    let https = tokio::spawn(https);

    let metrics_listener = tokio::net::TcpListener::bind(args.metrics_listen)
        .await
        .with_context(|| format!("binding the metrics listener {}", args.metrics_listen))?;
    let metrics_addr = metrics_listener.local_addr()?;
    let metrics_server =
        tokio::spawn(async move { axum::serve(metrics_listener, metrics_router(metrics)).await });

    let https_addr = handle
        .listening()
        .await
        .context("the HTTPS listener did not start")?;
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        https = %https_addr,
        metrics = %metrics_addr,
        ready = not_ready_at_start.is_none(),
        "memguard-webhook serving"
    );

    let signal = memguard_runtime::shutdown_signal().await;
    let grace = Duration::from_secs(args.shutdown_grace_seconds);
    tracing::info!(
        signal,
        grace_seconds = grace.as_secs(),
        "shutting down: draining connections"
    );
    handle.graceful_shutdown(Some(grace));
    // The lease is handed over while connections drain: the other replica need not wait for
    // our drain, and admission here keeps reading the (now frozen) profile cache.
    let (drained, ()) = tokio::join!(
        tokio::time::timeout(grace + Duration::from_secs(1), https),
        kube_tasks.shutdown(crate::profiles::RELEASE_DEADLINE),
    );
    watcher.abort();
    metrics_server.abort();
    match drained {
        Ok(Ok(Ok(()))) => {
            tracing::info!("stopped");
            Ok(())
        }
        Ok(Ok(Err(e))) => Err(e).context("HTTPS server"),
        Ok(Err(e)) => Err(e).context("HTTPS server task"),
        Err(_) => {
            tracing::warn!("drain deadline passed; exiting");
            Ok(())
        }
    }
}

/// The MemguardPolicy watch, the profile watch cache and the controller when a cluster is
/// configured; nothing (logged once) with `--no-kube` or without a Kubernetes config. Never
/// fails: the policy file stays in force, and profiles are an improvement, not a requirement.
async fn connect(
    args: &Args,
    metrics: memguard_learn::metrics::Metrics,
    policy_watch: PolicyWatch,
    policy: LivePolicy,
) -> (ClusterView, crate::profiles::KubeTasks) {
    if args.no_kube {
        tracing::info!(
            "--no-kube: policy file only (no MemguardPolicy watch), no MemoryProfile cache, \
             no profile controller"
        );
        return (
            ClusterView::default(),
            crate::profiles::KubeTasks::default(),
        );
    }
    let client = match kube::Client::try_default().await {
        Ok(client) => client,
        Err(error) => {
            tracing::info!(
                %error,
                "no Kubernetes config: running with the policy file, without MemoryProfiles"
            );
            return (
                ClusterView::default(),
                crate::profiles::KubeTasks::default(),
            );
        }
    };
    tracing::info!(policy = policy_watch.name(), "watching the MemguardPolicy");
    let policy_task = crate::watch::policy::spawn(client.clone(), policy_watch);
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let lease_namespace = args
        .lease_namespace
        .clone()
        .or_else(|| env("POD_NAMESPACE"))
        .unwrap_or_else(|| client.default_namespace().to_string());
    let identity = args
        .lease_identity
        .clone()
        .or_else(|| env("POD_NAME"))
        .or_else(|| env("HOSTNAME"))
        .unwrap_or_else(|| format!("memguard-webhook-{}", std::process::id()));
    tracing::info!(identity, lease_namespace, "profile controller enabled");
    let dra = (!args.no_dra).then(|| crate::watch::dra::start(client.clone()));
    let config_maps = if args.no_config_maps {
        tracing::info!("--no-config-maps: trainers' config files in ConfigMaps are not read");
        None
    } else {
        Some(crate::watch::cluster::start_config_maps(
            client.clone(),
            &args.config_map_namespaces,
        ))
    };
    let nodes = if args.no_nodes {
        tracing::info!("--no-nodes: unpinned GPU pods are planned against defaultGpuMemory");
        None
    } else {
        Some(crate::watch::cluster::start_nodes(client.clone()))
    };
    // The controller keys pods on the same cluster objects admission reads (DRA, ConfigMaps,
    // nodes): a pod whose config comes from a ConfigMap gets one key on both sides.
    let objects = memguard_learn::controller::ClusterObjects {
        dra: dra
            .as_ref()
            .map(|(c, _)| c.clone() as Arc<dyn crate::dra::DraCatalog>),
        config_maps: config_maps
            .as_ref()
            .map(|(c, _)| c.clone() as Arc<dyn memguard_api::cluster::ConfigMaps>),
        nodes: nodes
            .as_ref()
            .map(|(c, _)| c.clone() as Arc<dyn memguard_api::cluster::NodeLabels>),
    };
    let (profiles, tasks) = crate::profiles::start(
        client.clone(),
        metrics,
        crate::profiles::ControllerOptions {
            lease_namespace,
            identity,
            lease_duration: Duration::from_secs(args.lease_seconds.max(3)),
        },
        policy,
        objects,
    );
    let (mut profiles, mut tasks) = match dra {
        Some((catalog, task)) => (
            profiles.with_dra(catalog),
            tasks.with(policy_task).with(task),
        ),
        None => {
            tracing::info!("--no-dra: DRA claims are admitted with a warning");
            (profiles, tasks.with(policy_task))
        }
    };
    if let Some((maps, task)) = config_maps {
        profiles = profiles.with_config_maps(maps);
        tasks = tasks.with(task);
    }
    if let Some((nodes, task)) = nodes {
        profiles = profiles.with_nodes(nodes);
        tasks = tasks.with(task);
    }
    (profiles, tasks)
}

#[cfg(test)]
mod tests;
