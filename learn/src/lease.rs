//! Leader election on a `coordination.k8s.io/v1` Lease, so two webhook replicas do not both
//! write profiles. Small on purpose: get, then create or replace with the resourceVersion read
//! (optimistic concurrency: a 409 means another replica won this round).

use crate::metrics::ErrorKind;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use kube::api::PostParams;
use std::time::Duration;
use tokio::sync::watch;

/// A lease call that failed (a conflict is no error: another replica won the round).
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// Reading the lease failed.
    #[error("get lease: {0}")]
    Get(#[source] Box<kube::Error>),
    /// Creating or replacing the lease failed.
    #[error("write lease: {0}")]
    Write(#[source] Box<kube::Error>),
}

impl LeaseError {
    fn get(e: kube::Error) -> Self {
        LeaseError::Get(Box::new(e))
    }

    fn write(e: kube::Error) -> Self {
        LeaseError::Write(Box::new(e))
    }

    /// The `error` label of the `…_profile_errors_total` metric.
    pub fn metric_label(&self) -> ErrorKind {
        ErrorKind::Lease
    }
}

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
    pub async fn try_acquire_or_renew(&self, now: Timestamp) -> Result<bool, LeaseError> {
        let current = self
            .api
            .get_opt(&self.name)
            .await
            .map_err(LeaseError::get)?;
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
            Err(e) => Err(LeaseError::write(e)),
        }
    }

    /// Gives the lease up if we hold it, as client-go's `ReleaseOnCancel` does: holder cleared,
    /// a 1 s duration, renewed `now`, so another replica takes over at its next attempt instead
    /// of waiting for the lease to expire. `Ok(true)` when released; `Ok(false)` when there was
    /// nothing of ours to release (no lease, another holder, or a concurrent write).
    pub async fn release(&self, now: Timestamp) -> Result<bool, LeaseError> {
        let Some(mut lease) = self
            .api
            .get_opt(&self.name)
            .await
            .map_err(LeaseError::get)?
        else {
            return Ok(false);
        };
        let Some(spec) = lease
            .spec
            .as_mut()
            .filter(|s| s.holder_identity.as_deref() == Some(self.identity.as_str()))
        else {
            return Ok(false);
        };
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(now));
        // The resourceVersion read stays in `metadata`: if another replica took the lease since,
        // the replace fails with 409 and its lease is left alone.
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(s)) if s.is_conflict() || s.is_not_found() => Ok(false),
            Err(e) => Err(LeaseError::write(e)),
        }
    }

    /// Acquires and renews every `duration / 3`, publishing leadership on `leader` until the
    /// receivers are gone or `stop` completes. After an API error a leader keeps leading until
    /// its last renewal would expire (minus one renew period), then steps down. On `stop` it
    /// publishes `false`, then releases the lease if it was leading.
    pub async fn hold(
        self,
        leader: watch::Sender<bool>,
        metrics: crate::metrics::Metrics,
        stop: impl Future<Output = ()>,
    ) {
        let period = self.duration / 3;
        let mut renewed_at: Option<tokio::time::Instant> = None;
        let mut stop = std::pin::pin!(stop);
        let was_leading = loop {
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
            tokio::select! {
                () = &mut stop => break leading,
                () = tokio::time::sleep(period) => {}
            }
        };
        // Step down before releasing, so the controller stops writing before another replica
        // can start.
        metrics.leader.set(0);
        leader.send_replace(false);
        if !was_leading {
            return;
        }
        tracing::info!(leading = false, identity = %self.identity, "profile controller leadership");
        match self.release(Timestamp::now()).await {
            Ok(true) => tracing::info!(lease = %self.name, "lease released"),
            Ok(false) => {}
            Err(error) => {
                metrics.error(error.metric_label());
                tracing::warn!(%error, lease = %self.name, "lease release failed");
            }
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
                "released: empty holder",
                Some(held(Some(""), Some(99), Some(1))),
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

    // The lock against a mocked apiserver: method, path and body of every request.
    mod api {
        use super::*;
        use crate::metrics::Metrics;
        use crate::mock_api::{Step, client, status_error, step, verify};
        use http::{Method, StatusCode};
        use serde_json::{Value, json};
        use tokio::sync::oneshot;

        const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/memguard/leases";
        const NAME: &str = "profiles";
        const ME: &str = "a";

        fn item() -> String {
            format!("{LEASES}/{NAME}")
        }

        fn time(seconds: i64) -> Value {
            serde_json::to_value(MicroTime(at(seconds))).expect("json")
        }

        /// A lease as the apiserver returns it.
        fn lease(rv: &str, holder: &str, renewed: i64, transitions: i32) -> Value {
            json!({
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": NAME, "namespace": "memguard", "resourceVersion": rv},
                "spec": {
                    "holderIdentity": holder,
                    "leaseDurationSeconds": 15,
                    "acquireTime": time(0),
                    "renewTime": time(renewed),
                    "leaseTransitions": transitions,
                },
            })
        }

        fn lock(client: kube::Client) -> LeaseLock {
            LeaseLock::new(
                Api::namespaced(client, "memguard"),
                NAME,
                ME,
                Duration::from_secs(15),
            )
        }

        /// `call` on a lock whose API answers `steps` (each checked), at time 100.
        async fn scenario<F>(steps: Vec<Step>, call: impl FnOnce(LeaseLock) -> F) -> F::Output
        where
            F: Future,
        {
            let (client, handle) = client();
            let verifier = tokio::spawn(verify(handle, steps));
            let out = call(lock(client)).await;
            verifier.await.expect("scenario verified");
            out
        }

        async fn acquire(steps: Vec<Step>) -> Result<bool, LeaseError> {
            scenario(
                steps,
                |l| async move { l.try_acquire_or_renew(at(100)).await },
            )
            .await
        }

        async fn release(steps: Vec<Step>) -> Result<bool, LeaseError> {
            scenario(steps, |l| async move { l.release(at(100)).await }).await
        }

        /// The GET that reads the lease, answered with `lease`.
        fn read(lease: Value) -> Step {
            step(Method::GET, &item(), StatusCode::OK, lease)
        }

        fn not_found() -> Step {
            step(
                Method::GET,
                &item(),
                StatusCode::NOT_FOUND,
                status_error(404, "NotFound"),
            )
        }

        /// The POST that creates the lease, held by us.
        fn created() -> Step {
            let ours = lease("1", ME, 100, 0);
            step(Method::POST, LEASES, StatusCode::CREATED, ours)
        }

        #[tokio::test]
        async fn no_lease_creates_it_held_by_us() {
            let steps = vec![
                not_found(),
                created().body(|body| {
                    assert_eq!(body["metadata"]["name"], NAME);
                    let spec = &body["spec"];
                    assert_eq!(spec["holderIdentity"], ME);
                    assert_eq!(spec["leaseDurationSeconds"], 15);
                    assert_eq!(spec["acquireTime"], time(100));
                    assert_eq!(spec["renewTime"], time(100));
                    assert_eq!(spec["leaseTransitions"], 0);
                }),
            ];
            assert!(acquire(steps).await.expect("created"));
        }

        /// The PUT that holds the lease for us, keeping the resourceVersion `rv` read: renewed at
        /// 100, acquired at `acquired`, after `transitions` transitions.
        fn held_put(rv: &'static str, acquired: i64, transitions: i32) -> Step {
            let answer = lease("8", ME, 100, transitions);
            step(Method::PUT, &item(), StatusCode::OK, answer).body(move |body| {
                assert_eq!(body["metadata"]["resourceVersion"], rv);
                let spec = &body["spec"];
                assert_eq!(spec["holderIdentity"], ME);
                assert_eq!(spec["renewTime"], time(100));
                assert_eq!(spec["acquireTime"], time(acquired));
                assert_eq!(spec["leaseTransitions"], transitions);
            })
        }

        /// (what, the calls `try_acquire_or_renew` makes, whether it leads after them)
        #[tokio::test]
        async fn an_existing_lease_is_renewed_taken_over_or_followed() {
            let conflict = || {
                step(
                    Method::PUT,
                    &item(),
                    StatusCode::CONFLICT,
                    status_error(409, "Conflict"),
                )
            };
            let cases: Vec<(&str, Vec<Step>, bool)> = vec![
                (
                    "ours: renewed with the resourceVersion read, not re-acquired",
                    vec![read(lease("7", ME, 95, 2)), held_put("7", 0, 2)],
                    true,
                ),
                (
                    "another replica's fresh lease: only read",
                    vec![read(lease("7", "b", 95, 2))],
                    false,
                ),
                (
                    "another replica's expired lease: taken over",
                    vec![read(lease("3", "b", 50, 2)), held_put("3", 100, 3)],
                    true,
                ),
                (
                    "a conflict on the take-over: another replica won",
                    vec![read(lease("3", "b", 50, 2)), conflict()],
                    false,
                ),
            ];
            for (what, steps, leads) in cases {
                assert_eq!(acquire(steps).await.expect(what), leads, "{what}");
            }
        }

        /// The PUT that gives the lease up, keeping the resourceVersion `rv` read.
        fn release_put(rv: &'static str, status: StatusCode, answer: Value) -> Step {
            step(Method::PUT, &item(), status, answer).body(move |body| {
                assert_eq!(body["metadata"]["resourceVersion"], rv);
                let spec = &body["spec"];
                assert!(spec["holderIdentity"].is_null(), "holder cleared: {body}");
                assert_eq!(spec["leaseDurationSeconds"], 1);
                assert_eq!(spec["renewTime"], time(100));
                assert_eq!(spec["leaseTransitions"], 2);
            })
        }

        /// (what, the calls `release` makes, whether it released)
        #[tokio::test]
        async fn only_our_lease_is_released() {
            let cases: Vec<(&str, Vec<Step>, bool)> = vec![
                (
                    "ours: released",
                    vec![
                        read(lease("7", ME, 95, 2)),
                        release_put("7", StatusCode::OK, lease("8", "", 100, 2)),
                    ],
                    true,
                ),
                (
                    "another replica's: left alone",
                    vec![read(lease("7", "b", 95, 2))],
                    false,
                ),
                ("none: nothing to release", vec![not_found()], false),
                (
                    "a conflict on the release: someone else wrote it, left alone",
                    vec![
                        read(lease("7", ME, 95, 2)),
                        release_put("7", StatusCode::CONFLICT, status_error(409, "Conflict")),
                    ],
                    false,
                ),
            ];
            for (what, steps, released) in cases {
                assert_eq!(release(steps).await.expect(what), released, "{what}");
            }
        }

        // Paused time: the renew period's sleep only ends if the test lets the runtime idle,
        // and it never does before `stop`, so exactly one acquire happens.
        #[tokio::test(start_paused = true)]
        async fn hold_leads_then_steps_down_and_releases_on_stop() {
            let (client, handle) = client();
            let (leader_tx, mut leader_rx) = watch::channel(false);
            let during_release = leader_rx.clone();
            let steps = vec![
                not_found(),
                created(),
                read(lease("1", ME, 100, 0)),
                step(Method::PUT, &item(), StatusCode::OK, lease("2", "", 100, 0)).body(
                    move |body| {
                        assert!(!*during_release.borrow(), "stepped down before releasing");
                        assert_eq!(body["metadata"]["resourceVersion"], "1");
                        assert!(body["spec"]["holderIdentity"].is_null(), "{body}");
                        assert_eq!(body["spec"]["leaseDurationSeconds"], 1);
                    },
                ),
            ];
            let verifier = tokio::spawn(verify(handle, steps));
            let (stop_tx, stop_rx) = oneshot::channel::<()>();
            let metrics = Metrics::default();
            let holder = tokio::spawn(lock(client).hold(leader_tx, metrics.clone(), async {
                let _ = stop_rx.await;
            }));

            leader_rx.changed().await.expect("published");
            assert!(*leader_rx.borrow_and_update(), "leads after acquiring");
            assert_eq!(metrics.leader.get(), 1);

            stop_tx.send(()).expect("holder listening");
            leader_rx.changed().await.expect("published");
            assert!(!*leader_rx.borrow_and_update(), "steps down on stop");
            holder.await.expect("hold returns after the release");
            verifier.await.expect("scenario verified");
            assert_eq!(metrics.leader.get(), 0);
        }
    }
}
