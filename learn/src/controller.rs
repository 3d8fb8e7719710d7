//! The profile controller: watches opted-in pods and records each finished one in the
//! `MemoryProfile` of its key, in the pod's namespace.
//!
//! State lives in the CRD only: after a restart the watcher lists every pod again and
//! [`crate::update::apply`] makes replays no-ops. Writes are a JSON merge patch of the `status`
//! subresource carrying the `resourceVersion` that was read, so a concurrent writer makes the
//! API answer 409 and the update is recomputed from a fresh read (at most
//! [`Recorder::max_attempts`] times).

use crate::metrics::{ErrorKind, Metrics, Outcome};
use crate::observe::{NotObserved, try_observe};
use crate::update::{OomRules, apply_limited};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use memguard_api::cluster::{ConfigMaps, NodeLabels};
use memguard_api::crd::MemoryProfile;
use memguard_api::dra::DraCatalog;
use memguard_api::wellknown;
use memguard_api::{Cluster, Policy};
use serde_json::{Map, Value, json};
use std::collections::HashSet;
use std::sync::Arc;
use tokio::sync::watch;

/// Reads the policy in force now: its models (a pod's model is looked up in them, as at
/// admission) and its OOM rules (`maxOomRecoveries` and the floors). The webhook passes its live
/// policy, so a changed `MemguardPolicy` applies from the next pod recorded.
pub type LivePolicy = Arc<dyn Fn() -> Arc<Policy> + Send + Sync>;

/// Label on the profiles the controller creates.
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "memguard");
/// Field manager name of the controller's writes.
pub const FIELD_MANAGER: &str = "memguard-profile-controller";
/// How many `(uid, finishedAt)` pairs are remembered to skip re-reading profiles on relists.
const SEEN_CAP: usize = 10_000;

/// A failure of the controller or its lease.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("{action}: {source}")]
    Kube {
        /// What was attempted (`get profile`, `patch status`, …).
        action: &'static str,
        /// The client's error.
        #[source]
        source: Box<kube::Error>,
    },
    /// A profile with the pod's object name exists with another key (two keys sanitized
    /// alike and their hashes collided, or someone edited the spec).
    #[error("profile {name} holds key {found}, the pod has key {wanted}")]
    KeyCollision {
        /// Object name.
        name: String,
        /// The spec found, as JSON.
        found: String,
        /// The pod's key, as JSON.
        wanted: String,
    },
    /// Every attempt to update the status met a conflict.
    #[error("profile {name}: gave up after {attempts} conflicting updates")]
    Conflicts {
        /// Object name.
        name: String,
        /// Attempts made.
        attempts: u32,
    },
    /// The pod has no namespace.
    #[error("pod {0} has no namespace")]
    NoNamespace(String),
    /// The pod watch failed (it retries with backoff).
    #[error("pod watch: {0}")]
    Watch(String),
}

impl Error {
    /// A closure wrapping a `kube::Error` with what was attempted: `.map_err(Error::kube("get"))`.
    pub fn kube(action: &'static str) -> impl Fn(kube::Error) -> Error {
        move |source| Error::Kube {
            action,
            source: Box::new(source),
        }
    }

    /// The `error` label of the `…_profile_errors_total` metric.
    pub fn metric_label(&self) -> ErrorKind {
        match self {
            Error::Kube { action, .. } => match *action {
                "get profile" => ErrorKind::GetProfile,
                "create profile" => ErrorKind::CreateProfile,
                "patch status" => ErrorKind::PatchStatus,
                _ => ErrorKind::Kube,
            },
            Error::KeyCollision { .. } => ErrorKind::KeyCollision,
            Error::Conflicts { .. } => ErrorKind::Conflicts,
            Error::NoNamespace(_) => ErrorKind::NoNamespace,
            Error::Watch(_) => ErrorKind::Watch,
        }
    }
}

/// What recording one pod did.
#[derive(Debug, Clone, PartialEq)]
pub enum Recorded {
    /// The run was added to the profile (`oom`: with an OOM event and recovery).
    Updated {
        /// Profile name.
        profile: String,
        /// Whether it was an OOM kill.
        oom: bool,
    },
    /// The profile already had this run.
    Unchanged,
    /// The pod is not an observation (yet).
    Skipped(NotObserved),
}

/// The cluster objects a pod's reading looks up, the same admission reads (the webhook's watch
/// caches): a pod whose model or config comes from a ConfigMap-mounted file, or whose device
/// comes from its DRA claims, is keyed by the controller as admission keyed it.
#[derive(Clone, Default)]
pub struct ClusterObjects {
    /// DRA claims, templates, classes and slices.
    pub dra: Option<Arc<dyn DraCatalog>>,
    /// The ConfigMaps trainers' config files are mounted from.
    pub config_maps: Option<Arc<dyn ConfigMaps>>,
    /// The nodes' labels.
    pub nodes: Option<Arc<dyn NodeLabels>>,
}

impl ClusterObjects {
    /// Everything a pod's reading looks up, borrowed.
    pub fn cluster(&self) -> Cluster<'_> {
        Cluster {
            dra: self.dra.as_deref(),
            config_maps: self.config_maps.as_deref(),
            nodes: self.nodes.as_deref(),
        }
    }
}

/// Records finished pods into profiles.
#[derive(Clone)]
pub struct Recorder {
    client: Client,
    metrics: Metrics,
    /// Reads and writes tried before giving up on conflicts.
    pub max_attempts: u32,
    /// The policy in force: models, and OOM recoveries in a row before "cannot fit".
    policy: LivePolicy,
    /// The cluster objects admission reads (DRA, ConfigMaps, nodes): a pod is keyed as
    /// admission keyed it.
    cluster: ClusterObjects,
}

impl Recorder {
    /// A recorder using `client`, counting into `metrics`, under the default policy (the
    /// built-in models, the default `maxOomRecoveries`).
    pub fn new(client: Client, metrics: Metrics) -> Self {
        let default = Arc::new(Policy::default());
        Recorder {
            client,
            metrics,
            max_attempts: 5,
            policy: Arc::new(move || default.clone()),
            cluster: ClusterObjects::default(),
        }
    }

    /// The recorder reading DRA claims from `catalog` (the webhook's watch caches), as admission
    /// does.
    pub fn with_dra(mut self, catalog: Option<Arc<dyn DraCatalog>>) -> Self {
        self.cluster.dra = catalog;
        self
    }

    /// The recorder reading every cluster object admission reads from `objects`.
    pub fn with_cluster(mut self, objects: ClusterObjects) -> Self {
        self.cluster = objects;
        self
    }

    /// The recorder with `policy` read at each pod instead of the default policy.
    pub fn with_policy(mut self, policy: LivePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Records `pod` if it is a finished, opted-in pod: get-or-create its profile, fold the
    /// observation into the status, patch the status (retrying on conflicts).
    pub async fn record(&self, pod: &Pod) -> Result<Recorded, Error> {
        let policy = (self.policy)();
        let obs = match try_observe(pod, &policy, self.cluster.cluster()) {
            Ok(obs) => obs,
            Err(why) => return Ok(Recorded::Skipped(why)),
        };
        if let Some(why) = &obs.estimate_problem {
            tracing::warn!(
                pod = obs.pod,
                why,
                "no usable estimate: the run is recorded, but does not calibrate"
            );
        }
        let namespace = pod
            .metadata
            .namespace
            .as_deref()
            .ok_or_else(|| Error::NoNamespace(obs.pod.clone()))?;
        let api: Api<MemoryProfile> = Api::namespaced(self.client.clone(), namespace);
        let name = obs.key.name.as_str();
        for _ in 0..self.max_attempts {
            let profile = match api
                .get_opt(name)
                .await
                .map_err(Error::kube("get profile"))?
            {
                Some(p) => p,
                None => {
                    let mut fresh = MemoryProfile::new(name, obs.key.spec.clone());
                    fresh.metadata.labels = Some(
                        [(MANAGED_BY.0.to_string(), MANAGED_BY.1.to_string())]
                            .into_iter()
                            .collect(),
                    );
                    let pp = PostParams {
                        field_manager: Some(FIELD_MANAGER.into()),
                        ..PostParams::default()
                    };
                    match api.create(&pp, &fresh).await {
                        Ok(p) => p,
                        // Another writer created it first: read theirs.
                        Err(kube::Error::Api(s)) if s.is_already_exists() => continue,
                        Err(e) => return Err(Error::kube("create profile")(e)),
                    }
                }
            };
            if profile.spec != obs.key.spec {
                let json = |v| serde_json::to_string(v).unwrap_or_default();
                return Err(Error::KeyCollision {
                    name: name.to_string(),
                    found: json(&profile.spec),
                    wanted: json(&obs.key.spec),
                });
            }
            let old = profile.status.clone().unwrap_or_default();
            let new = apply_limited(&old, &obs, &OomRules::of(&policy));
            if new == old {
                return Ok(Recorded::Unchanged);
            }
            let patch = status_patch(
                profile.metadata.resource_version.as_deref(),
                &serde_json::to_value(&old).unwrap_or(Value::Null),
                &serde_json::to_value(&new).unwrap_or(Value::Null),
            );
            let pp = PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..PatchParams::default()
            };
            match api.patch_status(name, &pp, &Patch::Merge(&patch)).await {
                Ok(_) => {
                    return Ok(Recorded::Updated {
                        profile: name.to_string(),
                        oom: obs.oom.is_some(),
                    });
                }
                Err(kube::Error::Api(s)) if s.is_conflict() => {
                    self.metrics.conflicts.inc();
                    tracing::debug!(profile = name, "status conflict, retrying");
                }
                Err(e) => return Err(Error::kube("patch status")(e)),
            }
        }
        Err(Error::Conflicts {
            name: name.to_string(),
            attempts: self.max_attempts,
        })
    }

    /// [`Self::record`], logged and counted. Never fails: one bad pod must not stop the loop.
    pub async fn handle(&self, pod: &Pod) {
        let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
        match self.record(pod).await {
            Ok(Recorded::Updated { profile, oom }) => {
                self.metrics
                    .observed(if oom { Outcome::Oom } else { Outcome::Recorded });
                tracing::info!(pod = pod_name, profile, oom, "run recorded");
            }
            Ok(Recorded::Unchanged) => self.metrics.observed(Outcome::Unchanged),
            Ok(Recorded::Skipped(NotObserved::NoKey(why))) => {
                self.metrics.observed(Outcome::Skipped);
                tracing::debug!(pod = pod_name, why, "no profile key");
            }
            Ok(Recorded::Skipped(_)) => {}
            Err(error) => {
                self.metrics.error(error.metric_label());
                tracing::warn!(%error, pod = pod_name, "recording the run failed");
            }
        }
    }
}

/// A JSON merge patch that sets `status` to `new`, with `null` for every top-level field of
/// `old` that `new` no longer has (a merge patch leaves absent fields alone), and the
/// `resourceVersion` read, which turns a concurrent write into a 409.
pub fn status_patch(resource_version: Option<&str>, old: &Value, new: &Value) -> Value {
    let mut status = new.as_object().cloned().unwrap_or_default();
    if let Some(old) = old.as_object() {
        for key in old.keys() {
            status.entry(key.clone()).or_insert(Value::Null);
        }
    }
    let mut patch = Map::new();
    if let Some(rv) = resource_version {
        patch.insert("metadata".into(), json!({ "resourceVersion": rv }));
    }
    patch.insert("status".into(), Value::Object(status));
    Value::Object(patch)
}

/// Runs the controller while `leader` is true: watches opted-in pods in every namespace and
/// records the finished ones, under the `policy` in force at each pod (its models and OOM rules)
/// and with the `cluster` objects admission reads. Returns when `leader`'s sender is dropped.
pub async fn run(
    client: Client,
    metrics: Metrics,
    mut leader: watch::Receiver<bool>,
    policy: LivePolicy,
    cluster: ClusterObjects,
) {
    let recorder = Recorder::new(client.clone(), metrics.clone())
        .with_policy(policy.clone())
        .with_cluster(cluster.clone());
    let pods: Api<Pod> = Api::all(client);
    let selector = format!("{}={}", wellknown::ENABLED_LABEL, wellknown::ENABLED_VALUE);
    let mut seen: HashSet<(String, String)> = HashSet::new();
    loop {
        while !*leader.borrow_and_update() {
            if leader.changed().await.is_err() {
                return;
            }
        }
        tracing::info!("profile controller started");
        let stream = watcher(pods.clone(), watcher::Config::default().labels(&selector))
            .default_backoff()
            .applied_objects()
            .map_err(|e| Error::Watch(e.to_string()));
        let mut stream = std::pin::pin!(stream);
        loop {
            tokio::select! {
                changed = leader.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    if !*leader.borrow() {
                        tracing::info!("profile controller paused: not the leader");
                        break;
                    }
                }
                item = stream.next() => match item {
                    Some(Ok(pod)) => {
                        let id = finished_id(&pod, &policy(), cluster.cluster());
                        if id.as_ref().is_some_and(|id| seen.contains(id)) {
                            continue;
                        }
                        recorder.handle(&pod).await;
                        if let Some(id) = id {
                            if seen.len() >= SEEN_CAP {
                                seen.clear();
                            }
                            seen.insert(id);
                        }
                    }
                    Some(Err(error)) => {
                        metrics.error(error.metric_label());
                        tracing::warn!(%error, "pod watch error");
                    }
                    None => return,
                },
            }
        }
    }
}

/// `(uid, finishedAt)` of a pod whose run is fully recorded once handled (trainer and sidecar
/// terminated, or the pod in a final phase); `None` for pods that may still change.
fn finished_id(pod: &Pod, policy: &Policy, cluster: Cluster<'_>) -> Option<(String, String)> {
    let obs = try_observe(pod, policy, cluster).ok()?;
    let final_phase = matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    );
    (final_phase || obs.summary.is_some()).then(|| (obs.uid, obs.finished_at.0.to_string()))
}

#[cfg(test)]
mod tests;
