//! Prometheus metrics of the webhook (prefix `memguard_webhook`), served on their own port.

use crate::review::Disposition;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicI64;
use std::time::Duration;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

/// The webhook's metrics and their registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<OutcomeLabel, Counter>,
    duration: Histogram,
    downgrade_steps: Counter,
    cert_expiry: Gauge<i64, AtomicI64>,
    cert_reloads: Family<ResultLabel, Counter>,
    policy_reloads: Family<ResultLabel, Counter>,
    policy_generation: Gauge<i64, AtomicI64>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Adds the profile controller's metrics (`memguard_webhook_profile_*`).
    pub fn with_profile_metrics(mut self, profile: &memguard_learn::metrics::Metrics) -> Self {
        profile.register(&mut self.registry);
        self
    }

    /// Registers every metric under `memguard_webhook`.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("memguard_webhook");
        let requests = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "admission_requests",
            "AdmissionReviews answered, by outcome (mutated|unchanged|skipped|error)",
            requests.clone(),
        );
        // 50 µs … ~1.6 s.
        let duration = Histogram::new(exponential_buckets(0.00005, 2.0, 16));
        registry.register(
            "admission_duration_seconds",
            "Time to answer one AdmissionReview (parse, estimate, plan, patch)",
            duration.clone(),
        );
        let downgrade_steps = Counter::default();
        registry.register(
            "downgrade_steps",
            "Downgrade steps written into mutated pods",
            downgrade_steps.clone(),
        );
        let cert_expiry = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "certificate_expiry_timestamp_seconds",
            "notAfter of the serving certificate, as a Unix timestamp",
            cert_expiry.clone(),
        );
        let cert_reloads = Family::<ResultLabel, Counter>::default();
        registry.register(
            "certificate_reloads",
            "Certificate reloads after the files changed, by result (ok|error)",
            cert_reloads.clone(),
        );
        let policy_reloads = Family::<ResultLabel, Counter>::default();
        registry.register(
            "policy_reloads",
            "Changes of the policy in force from the watched MemguardPolicy (applied, or deleted: \
             back to the policy file), by result (ok|error: invalid, the policy in force kept)",
            policy_reloads.clone(),
        );
        let policy_generation = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "policy_generation",
            "metadata.generation of the MemguardPolicy in force; 0 when the policy file is",
            policy_generation.clone(),
        );
        Metrics {
            registry,
            requests,
            duration,
            downgrade_steps,
            cert_expiry,
            cert_reloads,
            policy_reloads,
            policy_generation,
        }
    }

    /// Records one answered review.
    pub fn observe(&self, disposition: Disposition, steps: usize, elapsed: Duration) {
        self.requests
            .get_or_create(&OutcomeLabel {
                outcome: disposition.label(),
            })
            .inc();
        self.duration.observe(elapsed.as_secs_f64());
        if steps > 0 {
            self.downgrade_steps.inc_by(steps as u64);
        }
    }

    /// Records the serving certificate's expiry.
    pub fn set_cert_expiry(&self, unix_seconds: i64) {
        self.cert_expiry.set(unix_seconds);
    }

    /// Records a certificate reload attempt.
    pub fn cert_reload(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.cert_reloads
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    /// Records a change of the policy in force from the `MemguardPolicy`, or a rejected one.
    pub fn policy_reload(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.policy_reloads
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    /// Records the generation of the `MemguardPolicy` in force (0: the policy file).
    pub fn set_policy_generation(&self, generation: i64) {
        self.policy_generation.set(generation);
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_outcomes_steps_and_expiry() {
        let m = Metrics::new();
        m.observe(Disposition::Mutated, 2, Duration::from_micros(300));
        m.observe(Disposition::Skipped, 0, Duration::from_micros(100));
        m.set_cert_expiry(1_900_000_000);
        m.cert_reload(false);
        m.policy_reload(true);
        m.policy_reload(false);
        m.policy_reload(true);
        m.set_policy_generation(7);
        let text = m.encode();
        for line in [
            "memguard_webhook_admission_requests_total{outcome=\"mutated\"} 1",
            "memguard_webhook_admission_requests_total{outcome=\"skipped\"} 1",
            "memguard_webhook_downgrade_steps_total 2",
            "memguard_webhook_admission_duration_seconds_count 2",
            "memguard_webhook_certificate_expiry_timestamp_seconds 1900000000",
            "memguard_webhook_certificate_reloads_total{result=\"error\"} 1",
            "memguard_webhook_policy_reloads_total{result=\"ok\"} 2",
            "memguard_webhook_policy_reloads_total{result=\"error\"} 1",
            "memguard_webhook_policy_generation 7",
        ] {
            assert!(text.contains(line), "missing `{line}` in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
    }
}
