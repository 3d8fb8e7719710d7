//! Leader election on a `coordination.k8s.io/v1` Lease, so two webhook replicas do not both
//! write profiles. Small on purpose: get, then create or replace with the resourceVersion read
//! (optimistic concurrency: a 409 means another replica won this round).

use crate::controller::Error;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use kube::api::PostParams;
use std::time::Duration;
use tokio::sync::watch;

/// What to do with the lease as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseDecision {
    /// No lease yet: create it, held by us.
    Create,
    /// We hold it: renew.
    Renew,
    /// Nobody holds it, or the holder stopped renewing: take it over.
    TakeOver,
    /// Someone else holds it: wait.
    Follow {
        /// The holder.
        holder: String,
    },
}

/// Decides from the lease's spec (`None`: no lease) whether `me` may lead at `now`. A lease
/// without a duration uses `default_duration`.
pub fn decide(
    spec: Option<&LeaseSpec>,
    me: &str,
    now: Timestamp,
    default_duration: Duration,
) -> LeaseDecision {
    let Some(spec) = spec else {
        return LeaseDecision::Create;
    };
    let holder = spec.holder_identity.as_deref().unwrap_or_default();
    if holder == me {
        return LeaseDecision::Renew;
    }
    if holder.is_empty() {
        return LeaseDecision::TakeOver;
    }
    let duration = spec
        .lease_duration_seconds
        .filter(|s| *s > 0)
        .map_or(default_duration, |s| {
            Duration::from_secs(s.unsigned_abs().into())
        });
    let expired = match &spec.renew_time {
        Some(MicroTime(renewed)) => {
            let ends = renewed
                .checked_add(SignedDuration::try_from(duration).unwrap_or(SignedDuration::MAX))
                .unwrap_or(Timestamp::MAX);
            ends < now
        }
        None => true,
    };
    if expired {
        LeaseDecision::TakeOver
    } else {
        LeaseDecision::Follow {
            holder: holder.to_string(),
        }
    }
}

/// One replica's handle on the lease.
#[derive(Clone)]
pub struct LeaseLock {
    api: Api<Lease>,
    name: String,
    identity: String,
    duration: Duration,
}

impl LeaseLock {
    /// The lease `name` in the namespace of `api`, held as `identity` (the pod name) for
    /// `duration` per renewal.
    pub fn new(api: Api<Lease>, name: &str, identity: &str, duration: Duration) -> Self {
        LeaseLock {
            api,
            name: name.to_string(),
            identity: identity.to_string(),
            duration,
        }
    }

    /// Tries once to acquire or renew; `Ok(true)` while we lead.
    pub async fn try_acquire_or_renew(&self, now: Timestamp) -> Result<bool, Error> {
        let current = self
            .api
            .get_opt(&self.name)
            .await
            .map_err(Error::kube("get lease"))?;
        let decision = decide(
            current.as_ref().and_then(|l| l.spec.as_ref()),
            &self.identity,
            now,
            self.duration,
        );
        let seconds = i32::try_from(self.duration.as_secs()).unwrap_or(i32::MAX);
        let result = match decision {
            LeaseDecision::Follow { .. } => return Ok(false),
            LeaseDecision::Create => {
                let lease = Lease {
                    metadata: ObjectMeta {
                        name: Some(self.name.clone()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(LeaseSpec {
                        holder_identity: Some(self.identity.clone()),
                        lease_duration_seconds: Some(seconds),
                        acquire_time: Some(MicroTime(now)),
                        renew_time: Some(MicroTime(now)),
                        lease_transitions: Some(0),
                        ..LeaseSpec::default()
                    }),
                };
                self.api.create(&PostParams::default(), &lease).await
            }
            LeaseDecision::Renew | LeaseDecision::TakeOver => {
                // `current` is Some here: decide() returns Create for None.
                let mut lease = current.unwrap_or_default();
                let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
                if decision == LeaseDecision::TakeOver {
                    spec.holder_identity = Some(self.identity.clone());
                    spec.acquire_time = Some(MicroTime(now));
                    spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
                }
                spec.lease_duration_seconds = Some(seconds);
                spec.renew_time = Some(MicroTime(now));
                // The resourceVersion read stays in `metadata`: a concurrent writer makes
                // this replace fail with 409 instead of both believing they lead.
                self.api
                    .replace(&self.name, &PostParams::default(), &lease)
                    .await
            }
        };
        match result {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.is_conflict() || s.is_already_exists() => Ok(false),
            Err(e) => Err(Error::kube("write lease")(e)),
        }
    }

    /// Acquires and renews every `duration / 3`, publishing leadership on `leader` until the
    /// receivers are gone. After an API error a leader keeps leading until its last renewal
    /// would expire (minus one renew period), then steps down.
    pub async fn hold(self, leader: watch::Sender<bool>, metrics: crate::metrics::Metrics) {
        let period = self.duration / 3;
        let mut renewed_at: Option<tokio::time::Instant> = None;
        loop {
            let leading = match self.try_acquire_or_renew(Timestamp::now()).await {
                Ok(true) => {
                    renewed_at = Some(tokio::time::Instant::now());
                    true
                }
                Ok(false) => false,
                Err(error) => {
                    metrics.error(error.metric_label());
                    tracing::warn!(%error, lease = %self.name, "lease renewal failed");
                    renewed_at.is_some_and(|t| t.elapsed() + period < self.duration)
                }
            };
            if !leading {
                renewed_at = None;
            }
            if *leader.borrow() != leading {
                tracing::info!(leading, identity = %self.identity, "profile controller leadership");
            }
            metrics.leader.set(i64::from(leading));
            if leader.send(leading).is_err() {
                return;
            }
            tokio::time::sleep(period).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(seconds).expect("in range")
    }

    fn held(holder: Option<&str>, renewed: Option<i64>, duration: Option<i32>) -> LeaseSpec {
        LeaseSpec {
            holder_identity: holder.map(Into::into),
            renew_time: renewed.map(|s| MicroTime(at(s))),
            lease_duration_seconds: duration,
            ..LeaseSpec::default()
        }
    }

    #[test]
    fn lease_decisions() {
        let d = Duration::from_secs(15);
        let other = || LeaseDecision::Follow { holder: "b".into() };
        // (name, lease, now, expected)
        let table = [
            ("no lease", None, 100, LeaseDecision::Create),
            (
                "ours",
                Some(held(Some("a"), Some(0), Some(15))),
                100,
                LeaseDecision::Renew,
            ),
            (
                "nobody's",
                Some(held(None, Some(99), Some(15))),
                100,
                LeaseDecision::TakeOver,
            ),
            (
                "another's, fresh",
                Some(held(Some("b"), Some(90), Some(15))),
                100,
                other(),
            ),
            (
                "another's, at the edge",
                Some(held(Some("b"), Some(85), Some(15))),
                100,
                other(),
            ),
            (
                "another's, expired",
                Some(held(Some("b"), Some(84), Some(15))),
                100,
                LeaseDecision::TakeOver,
            ),
            (
                "another's, never renewed",
                Some(held(Some("b"), None, Some(15))),
                100,
                LeaseDecision::TakeOver,
            ),
            (
                "no duration: ours is used",
                Some(held(Some("b"), Some(86), None)),
                100,
                other(),
            ),
            (
                "longer duration honoured",
                Some(held(Some("b"), Some(50), Some(60))),
                100,
                other(),
            ),
        ];
        for (name, spec, now, want) in table {
            assert_eq!(decide(spec.as_ref(), "a", at(now), d), want, "{name}");
        }
    }
}
