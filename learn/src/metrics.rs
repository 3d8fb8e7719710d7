//! Prometheus metrics of the profile controller and its leader lease.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Label set: one `(name, value)` pair.
pub type Labels = Vec<(String, String)>;

/// The controller's metrics; cheap to clone (shared handles).
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// Pods looked at, by `outcome`: `recorded`, `oom`, `unchanged`, `skipped`.
    pub observations: Family<Labels, Counter>,
    /// Failures, by `error` ([`crate::controller::Error::metric_label`]).
    pub errors: Family<Labels, Counter>,
    /// Status updates refused with 409 Conflict and retried.
    pub conflicts: Counter,
    /// 1 while this replica holds the leader lease.
    pub leader: Gauge,
}

impl Metrics {
    /// Registers every metric under `profile_…` in `registry` (which carries the binary's prefix,
    /// e.g. `memguard_webhook_profile_observations_total`).
    pub fn register(&self, registry: &mut Registry) {
        let sub = registry.sub_registry_with_prefix("profile");
        sub.register(
            "observations",
            "Pods the profile controller looked at, by outcome",
            self.observations.clone(),
        );
        sub.register(
            "errors",
            "Profile controller failures, by error",
            self.errors.clone(),
        );
        sub.register(
            "conflicts",
            "MemoryProfile status updates refused with a conflict and retried",
            self.conflicts.clone(),
        );
        sub.register(
            "leader",
            "1 while this replica holds the profile controller's lease",
            self.leader.clone(),
        );
    }

    /// Counts one observation outcome.
    pub fn observed(&self, outcome: &str) {
        self.observations
            .get_or_create(&vec![("outcome".to_string(), outcome.to_string())])
            .inc();
    }

    /// Counts one error.
    pub fn error(&self, label: &str) {
        self.errors
            .get_or_create(&vec![("error".to_string(), label.to_string())])
            .inc();
    }
}
