//! Wiring: sources, listeners, kernel events, the sampling loop, and the summary at exit.

use crate::config::{Config, LogFormat};
use crate::engine::{Engine, PsiPaths, Tick, starting_signal};
use crate::events;
use crate::growth::GrowthConfig;
use crate::pressure::PressureConfig;
use crate::sample::discover::{DirSource, TrainerSource};
use crate::sample::gpu;
use crate::sample::reported::WithClientReport;
use crate::sample::{MemorySource, SourceInfo};
use crate::server;
use crate::signal::SignalWriter;
use crate::state::Shared;
use crate::summary;
use axum::Router;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;

/// How long listeners get to finish in-flight requests at exit.
const DRAIN: Duration = Duration::from_secs(1);
/// PSI trigger: wake when tasks stall this long within the window.
const PSI_STALL: Duration = Duration::from_millis(100);
/// PSI trigger window (rounded up to 2 s where the kernel demands it).
const PSI_WINDOW: Duration = Duration::from_secs(1);

/// Installs the global subscriber once, on standard error (`RUST_LOG`, default `info`): the
/// setup the webhook shares ([`memguard_runtime`]).
pub fn init_tracing(format: LogFormat) {
    memguard_runtime::init_tracing(format, memguard_runtime::LogStream::Stderr);
}

fn open_source(config: &Config) -> (Box<dyn MemorySource>, Option<PathBuf>) {
    let a = &config.args;
    match &a.cgroup {
        Some(dir) => {
            let src = DirSource::new(dir.clone(), a.reset_v1_peak);
            if src.detected().is_none() {
                tracing::warn!(cgroup = %dir.display(), "not a memory cgroup (yet); watching for it");
            }
            (Box::new(src), Some(dir.clone()))
        }
        None => (
            Box::new(
                TrainerSource::new(
                    a.proc_root.clone(),
                    std::process::id(),
                    config.trainer_memory_limit,
                    10,
                )
                .with_v1_reset(a.reset_v1_peak),
            ),
            None,
        ),
    }
}

/// The cgroup's own PSI file: `memory.pressure` in a v2 directory; for a v1 directory under
/// `<root>/memory/<path>` on a hybrid host, `<root>/unified/<path>/memory.pressure` when it exists.
pub fn cgroup_psi_path(root: &Path, dir: &Path) -> PathBuf {
    let own = dir.join("memory.pressure");
    if own.exists() {
        return own;
    }
    match dir.strip_prefix(root.join("memory")) {
        Ok(rel) => {
            let hybrid = root.join("unified").join(rel).join("memory.pressure");
            if hybrid.exists() { hybrid } else { own }
        }
        Err(_) => own,
    }
}

async fn serve(
    addr: SocketAddr,
    router: Router,
    what: &'static str,
    mut stop: watch::Receiver<bool>,
) -> Option<JoinHandle<()>> {
    match TcpListener::bind(addr).await {
        Ok(listener) => {
            let local = listener
                .local_addr()
                .map(|a| a.to_string())
                .unwrap_or_default();
            tracing::info!(addr = %local, what, "listening");
            Some(tokio::spawn(async move {
                let shutdown = async move {
                    let _ = stop.wait_for(|s| *s).await;
                };
                if let Err(error) = axum::serve(listener, router)
                    .with_graceful_shutdown(shutdown)
                    .await
                {
                    tracing::error!(%error, what, "listener failed");
                }
            }))
        }
        Err(error) => {
            tracing::error!(%error, %addr, what, "cannot listen; carrying on without it");
            None
        }
    }
}

/// Kernel event sources, set up as the cgroup becomes known and re-armed when the limit moves.
struct Watchers {
    notify: Arc<Notify>,
    dir: Option<PathBuf>,
    ratios: [f64; 3],
    v1: Option<(u64, JoinHandle<()>)>,
    v1_failed: bool,
    v2_done: bool,
    tasks: Vec<JoinHandle<()>>,
    /// The trainer's exit (a pidfd), while it lives.
    exit: Option<JoinHandle<()>>,
    /// Whether `dir` was discovered (and is forgotten when the trainer leaves).
    discovered: bool,
}

impl Watchers {
    /// The trainer left: a discovered cgroup's watchers go with it.
    fn trainer_left(&mut self) {
        if let Some(t) = self.exit.take() {
            t.abort();
        }
        if self.discovered {
            self.dir = None;
            self.v2_done = false;
            self.v1_failed = false;
            if let Some((_, t)) = self.v1.take() {
                t.abort();
            }
        }
    }

    fn psi(&mut self, path: &Path) {
        match events::spawn_psi_trigger(path, PSI_STALL, PSI_WINDOW, self.notify.clone()) {
            Ok((window, task)) => {
                tracing::info!(path = %path.display(), ?window, "PSI trigger armed");
                self.tasks.push(task);
            }
            Err(why) => tracing::info!(%why, "no PSI trigger; plain reads only"),
        }
    }

    fn update(&mut self, limit: Option<u64>) {
        let Some(dir) = self.dir.clone() else {
            return;
        };
        if !self.v2_done && dir.join("memory.events").exists() {
            self.v2_done = true;
            match events::spawn_inotify(&dir.join("memory.events"), self.notify.clone()) {
                Ok(t) => self.tasks.push(t),
                Err(why) => tracing::info!(%why, "no inotify on memory.events"),
            }
            if dir.join("memory.pressure").exists() {
                self.psi(&dir.join("memory.pressure"));
            }
        }
        let v1 = dir.join("cgroup.event_control").exists();
        let Some(limit) = limit.filter(|_| v1 && !self.v1_failed) else {
            return;
        };
        if self.v1.as_ref().is_some_and(|(l, _)| *l == limit) {
            return;
        }
        if let Some((_, old)) = self.v1.take() {
            old.abort();
        }
        let thresholds = events::threshold_bytes(limit, &self.ratios);
        let armed = events::V1Events::register(&dir, &thresholds)
            .map_err(|e| e.to_string())
            .and_then(|ev| ev.spawn(self.notify.clone()).map_err(|e| e.to_string()));
        match armed {
            Ok(task) => {
                tracing::info!(?thresholds, "cgroup v1 usage thresholds armed");
                self.v1 = Some((limit, task));
            }
            Err(why) => {
                tracing::info!(%why, "no cgroup v1 thresholds; polling only");
                self.v1_failed = true;
            }
        }
    }
}

impl Drop for Watchers {
    fn drop(&mut self) {
        for t in self.tasks.drain(..) {
            t.abort();
        }
        if let Some((_, t)) = self.v1.take() {
            t.abort();
        }
        if let Some(t) = self.exit.take() {
            t.abort();
        }
    }
}

/// Runs the sidecar until SIGTERM/ctrl-c or the trainer is gone; writes the summary at exit.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let a = config.args.clone();
    let existing = std::fs::read_to_string(&a.signal_file).ok();
    let start = starting_signal(
        existing.as_deref(),
        config.batch_size,
        config.grad_accumulation,
        config.grad_checkpointing,
    );
    let shared = Arc::new(Shared::new(start));
    // What admission planned, to compare with what the trainer reports at train start.
    let (admitted, refused) = memguard_api::signal::parse_admitted_config(&a.admitted_config);
    if !refused.is_empty() {
        tracing::warn!(?refused, "admitted config: entries not read");
    }
    shared.status().admitted_config = admitted;
    let (source, dir) = open_source(&config);
    // Where the sidecar cannot read the trainer's cgroup, the trainer's client reports it.
    let source: Box<dyn MemorySource> = Box::new(WithClientReport::new(source, shared.clone()));
    let visible = gpu::parse_visible(config.nvidia_visible_devices.as_deref());
    let gpu = gpu::open(&visible);
    tracing::info!(gpu = %gpu.describe(), "GPU source");
    let psi_cgroup = dir.as_deref().map(|d| cgroup_psi_path(&a.cgroup_root, d));
    let host = a.proc_root.join("pressure/memory");
    let mut pressure =
        PressureConfig::with_cooldown(config.thresholds, a.cooldown.as_millis() as u64);
    pressure.relax_after_ms = a.relax_after.as_millis() as u64;
    pressure.leak_horizon_s = a.leak_horizon.as_secs_f64();
    let mut engine = Engine::new(
        source,
        gpu,
        PsiPaths {
            cgroup: psi_cgroup,
            host: host.exists().then(|| host.clone()),
        },
        pressure,
        SignalWriter::new(a.signal_file.clone()),
        shared.clone(),
    )
    .with_growth(GrowthConfig {
        enabled: a.grow_back,
        steady_steps: a.grow_steady_steps,
        min_window_ms: a.grow_window.as_millis() as u64,
        watermark: config.thresholds.warn,
    })
    .with_train_start(a.train_start.clone());
    engine.flush();
    let (source, info) = {
        let st = shared.status();
        (
            st.source.clone(),
            st.source_info.unwrap_or(SourceInfo::NONE),
        )
    };
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        %source,
        source_kind = info.kind,
        source_view = info.view,
        signal_file = %a.signal_file.display(),
        interval = ?a.interval,
        batch_size = config.batch_size,
        grad_accumulation = config.grad_accumulation,
        "memguard-sidecar starting"
    );
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut servers = Vec::new();
    let api = server::trainer_router(shared.clone());
    servers.extend(serve(a.listen, api, "trainer-api", stop_rx.clone()).await);
    let metrics = server::metrics_router(shared.clone());
    servers.extend(serve(a.metrics_listen, metrics, "metrics", stop_rx).await);

    let notify = Arc::new(Notify::new());
    let t = config.thresholds;
    let mut watchers = Watchers {
        notify: notify.clone(),
        dir: dir.filter(|_| a.events),
        ratios: [t.warn, t.downgrade, t.critical],
        v1: None,
        v1_failed: false,
        v2_done: false,
        tasks: Vec::new(),
        exit: None,
        discovered: false,
    };
    if a.events && host.exists() {
        watchers.psi(&host);
    }
    let mut interval = tokio::time::interval(a.interval);
    interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let started = Instant::now();
    let mut awaiting_restart: Option<Instant> = None;
    let shutdown = memguard_runtime::shutdown_signal();
    tokio::pin!(shutdown);
    let exit_reason = loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = notify.notified() => shared.status().wakeups_total += 1,
            // A config reported: plan at once, not at the next tick.
            _ = shared.wake.notified() => {}
            reason = &mut shutdown => break reason,
        }
        let now_ms = started.elapsed().as_millis() as u64;
        match engine.tick(now_ms) {
            Tick::TrainerGone => {
                let oom = engine.trainer_died_of_oom();
                let restart_can_come = oom && a.pod_restart_policy.restarts_after_failure();
                if a.exit_when_empty && !restart_can_come {
                    if oom {
                        tracing::info!(pod_restart_policy = ?a.pod_restart_policy, "the trainer died of an OOM and will not be restarted");
                    }
                    break "trainer-exited";
                }
                // A trainer killed by an OOM is restarted in place (`restartPolicy: OnFailure`
                // or `Always`), in a new cgroup: stay, and find it again. A classic sidecar that
                // left here would leave the restarted trainer unguarded.
                engine.trainer_left();
                watchers.trainer_left();
                if a.exit_when_empty {
                    tracing::info!(restart_wait = ?a.restart_wait, "the trainer died of an OOM; waiting for its restart in place");
                    awaiting_restart = Some(Instant::now());
                } else {
                    tracing::info!("the trainer left; looking for it again");
                }
            }
            Tick::Running if engine.has_trainer() => {
                if awaiting_restart.take().is_some() {
                    tracing::info!(source = %shared.status().source, "found the restarted trainer");
                }
            }
            Tick::Running => {}
        }
        if awaiting_restart.is_some_and(|t| t.elapsed() >= a.restart_wait) {
            break "trainer-exited";
        }
        if let Some(pidfd) = engine.take_exit_watch() {
            match events::spawn_exit_watch(pidfd, notify.clone()) {
                Ok(task) => watchers.exit = Some(task),
                Err(why) => tracing::info!(%why, "no exit watch on the trainer; polling only"),
            }
        }
        if watchers.dir.is_none()
            && a.events
            && let Some(found) = engine.cgroup_dir()
        {
            // A discovered trainer cgroup: its own PSI (v2) and kernel events from now on.
            if found.join("memory.pressure").exists() {
                engine.set_cgroup_psi(found.join("memory.pressure"));
            }
            watchers.dir = Some(found);
            watchers.discovered = true;
        }
        watchers.update(engine.limit());
    };
    drop(watchers);
    let signal = shared.signal.borrow().clone();
    let s = summary::build(
        &shared.status(),
        &signal,
        config.estimate_bytes,
        exit_reason,
    );
    match summary::write(&a.termination_log, &s) {
        Ok(()) => {
            tracing::info!(path = %a.termination_log.display(), summary = %summary::to_line(&s).trim(), "summary written")
        }
        Err(error) => {
            tracing::warn!(%error, path = %a.termination_log.display(), summary = %summary::to_line(&s).trim(), "summary not written")
        }
    }
    let _ = stop_tx.send(true);
    for s in servers {
        let _ = tokio::time::timeout(DRAIN, s).await;
    }
    tracing::info!(exit_reason, "memguard-sidecar stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_v1_cgroup_on_a_hybrid_host_takes_its_psi_from_the_unified_tree() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path();
        let v1 = root.join("memory/kubepods/pod1");
        let v2 = root.join("unified/kubepods/pod1");
        std::fs::create_dir_all(&v1).expect("mkdir");
        assert_eq!(
            cgroup_psi_path(root, &v1),
            v1.join("memory.pressure"),
            "not known: absent"
        );
        std::fs::create_dir_all(&v2).expect("mkdir");
        std::fs::write(
            v2.join("memory.pressure"),
            "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        )
        .expect("w");
        assert_eq!(cgroup_psi_path(root, &v1), v2.join("memory.pressure"));
        let own = root.join("elsewhere");
        assert_eq!(cgroup_psi_path(root, &own), own.join("memory.pressure"));
    }
}
