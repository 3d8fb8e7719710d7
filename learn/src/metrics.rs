//! Prometheus metrics of the profile controller and its leader lease.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::fmt::Write;

/// What became of one pod the controller looked at: the `outcome` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// A run recorded.
    Recorded,
    /// A run recorded with an OOM.
    Oom,
    /// The profile already had the run.
    Unchanged,
    /// Not an observation (yet).
    Skipped,
}

impl Outcome {
    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Recorded => "recorded",
            Outcome::Oom => "oom",
            Outcome::Unchanged => "unchanged",
            Outcome::Skipped => "skipped",
        }
    }
}

/// What failed: the `error` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Reading a profile.
    GetProfile,
    /// Creating a profile.
    CreateProfile,
    /// Patching a profile's status.
    PatchStatus,
    /// Reading or writing the leader lease ([`crate::lease::LeaseError`]).
    Lease,
    /// Another Kubernetes call.
    Kube,
    /// A profile holds another key.
    KeyCollision,
    /// Every status update met a conflict.
    Conflicts,
    /// A pod without a namespace.
    NoNamespace,
    /// The pod watch.
    Watch,
}

impl ErrorKind {
    /// The label value.
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorKind::GetProfile => "get_profile",
            ErrorKind::CreateProfile => "create_profile",
            ErrorKind::PatchStatus => "patch_status",
            ErrorKind::Lease => "lease",
            ErrorKind::Kube => "kube",
            ErrorKind::KeyCollision => "key_collision",
            ErrorKind::Conflicts => "conflicts",
            ErrorKind::NoNamespace => "no_namespace",
            ErrorKind::Watch => "watch",
        }
    }
}

impl EncodeLabelValue for Outcome {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.as_str())
    }
}

impl EncodeLabelValue for ErrorKind {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.as_str())
    }
}

/// The labels of `…_profile_observations_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// What became of the pod.
    pub outcome: Outcome,
}

/// The labels of `…_profile_errors_total`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ErrorLabels {
    /// What failed.
    pub error: ErrorKind,
}

/// The controller's metrics; cheap to clone (shared handles).
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    /// Pods looked at, by `outcome`: `recorded`, `oom`, `unchanged`, `skipped`.
    pub observations: Family<OutcomeLabels, Counter>,
    /// Failures, by `error` ([`crate::controller::Error::metric_label`],
    /// [`crate::lease::LeaseError::metric_label`]).
    pub errors: Family<ErrorLabels, Counter>,
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
    pub fn observed(&self, outcome: Outcome) {
        self.observations
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// Counts one error.
    pub fn error(&self, error: ErrorKind) {
        self.errors.get_or_create(&ErrorLabels { error }).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The enum labels publish the label values dashboards and alerts read.
    #[test]
    fn labels_are_published_as_their_names() {
        let metrics = Metrics::default();
        let mut registry = Registry::with_prefix("memguard_webhook");
        metrics.register(&mut registry);
        metrics.observed(Outcome::Oom);
        metrics.error(ErrorKind::Lease);
        metrics.error(ErrorKind::KeyCollision);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encodes");
        for line in [
            "memguard_webhook_profile_observations_total{outcome=\"oom\"} 1",
            "memguard_webhook_profile_errors_total{error=\"lease\"} 1",
            "memguard_webhook_profile_errors_total{error=\"key_collision\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }
}
