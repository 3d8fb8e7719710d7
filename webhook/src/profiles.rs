//! The webhook's link to the cluster: a watch cache of `MemoryProfile`s that admission reads
//! (never the API itself), and the leader-elected profile controller that writes them; their
//! tasks are handed to [`KubeTasks`].

use crate::mutate::{ClusterView, ProfileSource};
use crate::watch::policy::LivePolicy;
use crate::watch::{drive, reflected};
use k8s_openapi::api::coordination::v1::Lease;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client};
use memguard_api::crd::MemoryProfile;
use memguard_learn::lease::LeaseLock;
use memguard_learn::metrics::Metrics;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

pub use crate::tasks::{KubeTasks, RELEASE_DEADLINE};

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
/// admission reads and the background tasks ([`KubeTasks::shutdown`] at shutdown).
pub fn start(
    client: Client,
    metrics: Metrics,
    options: ControllerOptions,
    policy: LivePolicy,
    cluster: memguard_learn::controller::ClusterObjects,
) -> (ClusterView, KubeTasks) {
    let (reader, watch) = reflected(Api::<MemoryProfile>::all(client.clone()), |_| {});
    let reflector_task = drive(vec![watch], "MemoryProfile watch error");

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
        client, metrics, leader_rx, live, cluster,
    ));
    (
        ClusterView::from_source(Arc::new(StoreSource(reader))),
        KubeTasks {
            stop: Some(stop_tx),
            lease: Some(lease_task),
            others: vec![reflector_task, controller_task],
        },
    )
}
