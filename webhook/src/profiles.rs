//! The webhook's link to the cluster: a watch cache of `MemoryProfile`s that admission reads
//! (never the API itself), and the leader-elected profile controller that writes them.

use crate::mutate::{ProfileSource, Profiles};
use crate::policy_watch::LivePolicy;
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use memguard_api::crd::MemoryProfile;
use memguard_learn::lease::LeaseLock;
use memguard_learn::metrics::Metrics;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Name of the controller's Lease.
pub const LEASE_NAME: &str = "memguard-profile-controller";

/// How long shutdown waits for the lease release (one GET and one PUT).
pub const RELEASE_DEADLINE: Duration = Duration::from_secs(2);

/// Where the lease lives and who we are.
#[derive(Debug, Clone)]
pub struct ControllerOptions {
    /// Namespace of the Lease (the webhook's own).
    pub lease_namespace: String,
    /// This replica's identity (its pod name).
    pub identity: String,
    /// How long a lease lasts without renewal.
    pub lease_duration: Duration,
}

/// A reflector store as a [`ProfileSource`].
struct StoreSource(Store<MemoryProfile>);

impl ProfileSource for StoreSource {
    fn get(&self, namespace: &str, name: &str) -> Option<MemoryProfile> {
        self.0
            .get(&ObjectRef::new(name).within(namespace))
            .map(|p| (*p).clone())
    }
}

/// The background tasks of the cluster link; empty without a cluster.
#[derive(Debug, Default)]
pub struct KubeTasks {
    /// Tells the lease holder to step down and release the lease.
    stop: Option<oneshot::Sender<()>>,
    lease: Option<JoinHandle<()>>,
    /// The watches and the controller: nothing to hand over, aborted.
    others: Vec<JoinHandle<()>>,
}

impl KubeTasks {
    /// Adds a task with nothing to hand over (a watch): aborted at shutdown.
    pub fn with(mut self, task: JoinHandle<()>) -> Self {
        self.others.push(task);
        self
    }

    /// Stops the lease holder and waits up to `deadline` for it to release the lease, so the
    /// other replica takes over at its next attempt rather than after the lease expires; then
    /// aborts the rest.
    pub async fn shutdown(self, deadline: Duration) {
        if let Some(stop) = self.stop {
            // An error means the holder already returned; awaiting it below is then immediate.
            let _ = stop.send(());
        }
        if let Some(lease) = self.lease {
            let abort = lease.abort_handle();
            match tokio::time::timeout(deadline, lease).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%error, "lease task failed"),
                Err(_) => {
                    tracing::warn!(
                        deadline_ms = deadline.as_millis(),
                        "lease not released in time; it will expire"
                    );
                    abort.abort();
                }
            }
        }
        self.others.iter().for_each(JoinHandle::abort);
    }
}

/// Starts the profile reflector, the lease holder and the controller. Returns the profiles
/// admission reads and the background tasks ([`KubeTasks::shutdown`] at shutdown).
pub fn start(
    client: Client,
    metrics: Metrics,
    options: ControllerOptions,
    policy: LivePolicy,
    dra: Option<Arc<dyn memguard_api::dra::DraCatalog>>,
) -> (Profiles, KubeTasks) {
    let (reader, writer) = reflector::store::<MemoryProfile>();
    let stream = reflector::reflector(
        writer,
        watcher(
            Api::<MemoryProfile>::all(client.clone()),
            watcher::Config::default(),
        ),
    )
    .default_backoff()
    .touched_objects();
    let reflector_task = tokio::spawn(async move {
        use futures::StreamExt;
        let mut stream = std::pin::pin!(stream);
        while let Some(item) = stream.next().await {
            if let Err(error) = item {
                tracing::warn!(%error, "MemoryProfile watch error");
            }
        }
    });

    let (leader_tx, leader_rx) = tokio::sync::watch::channel(false);
    let lock = LeaseLock::new(
        Api::<Lease>::namespaced(client.clone(), &options.lease_namespace),
        LEASE_NAME,
        &options.identity,
        options.lease_duration,
    );
    let (stop_tx, stop_rx) = oneshot::channel();
    let lease_task = tokio::spawn(lock.hold(leader_tx, metrics.clone(), async {
        // Sent or dropped: either way, stop.
        let _ = stop_rx.await;
    }));
    // The controller reads the policy in force at each pod: a changed model list or OOM limit
    // applies at once, and a pod's model resolves as it did at admission.
    let live: memguard_learn::controller::LivePolicy = Arc::new(move || policy.load_full());
    let controller_task = tokio::spawn(memguard_learn::controller::run(
        client, metrics, leader_rx, live, dra,
    ));
    (
        Profiles::from_source(Arc::new(StoreSource(reader))),
        KubeTasks {
            stop: Some(stop_tx),
            lease: Some(lease_task),
            others: vec![reflector_task, controller_task],
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task that never ends; the receiver errs once it is aborted (its sender dropped).
    fn endless() -> (JoinHandle<()>, oneshot::Receiver<()>) {
        let (alive, gone) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _alive = alive;
            std::future::pending::<()>().await;
        });
        (task, gone)
    }

    async fn aborted(gone: oneshot::Receiver<()>) -> bool {
        tokio::time::timeout(Duration::from_secs(5), gone)
            .await
            .is_ok_and(|r| r.is_err())
    }

    #[tokio::test]
    async fn no_tasks_shut_down_at_once() {
        KubeTasks::default().shutdown(RELEASE_DEADLINE).await;
    }

    #[tokio::test]
    async fn shutdown_stops_the_lease_task_waits_for_it_then_aborts_the_rest() {
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let (released_tx, mut released_rx) = oneshot::channel();
        let lease = tokio::spawn(async move {
            let _ = stop_rx.await;
            tokio::task::yield_now().await;
            let _ = released_tx.send(());
        });
        let (other, other_gone) = endless();
        let tasks = KubeTasks {
            stop: Some(stop_tx),
            lease: Some(lease),
            others: vec![other],
        };
        tasks.shutdown(Duration::from_secs(10)).await;
        assert_eq!(released_rx.try_recv(), Ok(()), "waited for the release");
        assert!(aborted(other_gone).await, "the others are aborted");
    }

    #[tokio::test]
    async fn a_stuck_lease_task_is_aborted_at_the_deadline() {
        let (stop_tx, _stop_rx) = oneshot::channel::<()>();
        let (lease, lease_gone) = endless();
        let tasks = KubeTasks {
            stop: Some(stop_tx),
            lease: Some(lease),
            others: Vec::new(),
        };
        tasks.shutdown(Duration::from_millis(50)).await;
        assert!(aborted(lease_gone).await, "aborted");
    }
}
