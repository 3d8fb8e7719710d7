//! The policy in force, kept in step with the watched cluster-scoped `MemguardPolicy`.
//!
//! Admission reads the policy through an [`ArcSwap`]: one atomic load per review, no lock, and a
//! review never sees two policies. [`PolicyWatch`] turns watch events into swaps; it takes any
//! stream of events, so tests drive it without an API server. [`spawn`] is the kube glue.

use crate::metrics::Metrics;
use crate::policy_sources::{Overrides, effective_policy};
use arc_swap::ArcSwap;
use futures::{Stream, StreamExt};
use kube::runtime::watcher::Event;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use memguard_api::crd::MemguardPolicy;
use memguard_api::{Policy, PolicySpec};
use std::sync::Arc;
use tokio::task::JoinHandle;

/// The policy admission reads, swapped whole when the `MemguardPolicy` changes.
pub type LivePolicy = Arc<ArcSwap<Policy>>;

/// What one watch event did to the policy in force.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// The resource's policy (with the flags on top) is now in force.
    Applied {
        /// Its `metadata.generation`.
        generation: i64,
    },
    /// The resource is invalid; the policy in force stays.
    Rejected {
        /// Its `metadata.generation`.
        generation: i64,
        /// Every problem found.
        problems: Vec<String>,
    },
    /// The resource is gone: the policy file (with the flags on top) is back in force.
    FellBack,
}

/// Applies `MemguardPolicy` events to the [`LivePolicy`] and the metrics.
pub struct PolicyWatch {
    name: String,
    file: Option<PolicySpec>,
    overrides: Overrides,
    /// The policy file with the flags, checked at start: what a deletion falls back to.
    fallback: Arc<Policy>,
    live: LivePolicy,
    metrics: Arc<Metrics>,
    /// Generation of the resource in force; `None` while the file policy is.
    in_force: Option<i64>,
    /// Whether the current relist (`Init` … `InitDone`) has shown the resource.
    listed: bool,
}

impl PolicyWatch {
    /// Watches the resource `name`; `live` holds the file policy (`fallback`) until it shows.
    pub fn new(
        name: impl Into<String>,
        file: Option<PolicySpec>,
        overrides: Overrides,
        fallback: Arc<Policy>,
        live: LivePolicy,
        metrics: Arc<Metrics>,
    ) -> Self {
        metrics.set_policy_generation(0);
        PolicyWatch {
            name: name.into(),
            file,
            overrides,
            fallback,
            live,
            metrics,
            in_force: None,
            listed: false,
        }
    }

    /// The watched resource's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Handles events until the stream ends. Errors are logged and the policy in force stays:
    /// the watcher retries with backoff.
    pub async fn run<S>(&mut self, events: S)
    where
        S: Stream<Item = Result<Event<MemguardPolicy>, watcher::Error>>,
    {
        let mut events = std::pin::pin!(events);
        while let Some(item) = events.next().await {
            match item {
                Ok(event) => {
                    self.handle(event);
                }
                Err(error) => tracing::warn!(
                    %error,
                    policy = %self.name,
                    "MemguardPolicy watch error; keeping the policy in force"
                ),
            }
        }
    }

    /// Applies one event; `None` when it does not concern the policy in force.
    pub fn handle(&mut self, event: Event<MemguardPolicy>) -> Option<Change> {
        let change = match event {
            Event::Init => {
                self.listed = false;
                None
            }
            Event::InitApply(resource) if self.is_ours(&resource) => {
                self.listed = true;
                Some(self.apply(&resource))
            }
            Event::Apply(resource) if self.is_ours(&resource) => Some(self.apply(&resource)),
            Event::Delete(resource) if self.is_ours(&resource) => Some(self.fall_back()),
            // A relist that no longer shows the resource: it was deleted while we were away.
            Event::InitDone if !self.listed && self.in_force.is_some() => Some(self.fall_back()),
            Event::InitApply(_) | Event::Apply(_) | Event::Delete(_) | Event::InitDone => None,
        };
        if let Some(change) = &change {
            self.log(change);
        }
        change
    }

    /// The field selector already filters by name; this keeps a stray object from ever counting.
    fn is_ours(&self, resource: &MemguardPolicy) -> bool {
        resource.metadata.name.as_deref() == Some(self.name.as_str())
    }

    fn apply(&mut self, resource: &MemguardPolicy) -> Change {
        let generation = resource.metadata.generation.unwrap_or_default();
        match effective_policy(self.file.as_ref(), Some(&resource.spec.0), &self.overrides) {
            Ok(policy) => {
                self.live.store(Arc::new(policy));
                self.in_force = Some(generation);
                self.metrics.set_policy_generation(generation);
                self.metrics.policy_reload(true);
                Change::Applied { generation }
            }
            Err(problems) => {
                self.metrics.policy_reload(false);
                Change::Rejected {
                    generation,
                    problems,
                }
            }
        }
    }

    fn fall_back(&mut self) -> Change {
        self.live.store(self.fallback.clone());
        self.in_force = None;
        self.metrics.set_policy_generation(0);
        self.metrics.policy_reload(true);
        Change::FellBack
    }

    fn log(&self, change: &Change) {
        let policy = self.name.as_str();
        match change {
            Change::Applied { generation } => {
                tracing::info!(policy, generation, "MemguardPolicy applied");
                // A model shadowing a built-in one is allowed, and said once per change.
                for note in self.live.load().models.notes() {
                    tracing::info!(policy, generation, note, "MemguardPolicy");
                }
            }
            Change::Rejected {
                generation,
                problems,
            } => tracing::warn!(
                policy,
                generation,
                problems = %problems.join("; "),
                in_force = ?self.in_force,
                "MemguardPolicy invalid; keeping the policy in force"
            ),
            Change::FellBack => {
                tracing::info!(policy, "MemguardPolicy gone; back to the policy file");
            }
        }
    }
}

/// Watches the cluster-scoped `MemguardPolicy` named like `watch` in the background.
pub fn spawn(client: Client, mut watch: PolicyWatch) -> JoinHandle<()> {
    let config = watcher::Config::default().fields(&format!("metadata.name={}", watch.name()));
    let events = watcher(Api::<MemguardPolicy>::all(client), config).default_backoff();
    tokio::spawn(async move { watch.run(events).await })
}

#[cfg(test)]
mod tests;
