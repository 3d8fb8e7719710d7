//! The webhook's link to the cluster: a watch cache of `MemoryProfile`s that admission reads
//! (never the API itself), and the leader-elected profile controller that writes them.

use crate::mutate::{ProfileSource, Profiles};
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use memguard_api::crd::MemoryProfile;
use memguard_learn::lease::LeaseLock;
use memguard_learn::metrics::Metrics;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;

/// Name of the controller's Lease.
pub const LEASE_NAME: &str = "memguard-profile-controller";

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

/// Starts the profile reflector, the lease holder and the controller. Returns the profiles
/// admission reads and the background tasks (aborted at shutdown).
pub fn start(
    client: Client,
    metrics: Metrics,
    options: ControllerOptions,
) -> (Profiles, Vec<JoinHandle<()>>) {
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
    let lease_task = tokio::spawn(lock.hold(leader_tx, metrics.clone()));
    let controller_task = tokio::spawn(memguard_learn::controller::run(client, metrics, leader_rx));
    (
        Profiles::from_source(Arc::new(StoreSource(reader))),
        vec![reflector_task, lease_task, controller_task],
    )
}
