//! What the decision reads of the cluster, never calling the API: the `MemoryProfile`s, the DRA
//! objects, the ConfigMaps and the nodes' labels, from the webhook's watch caches or from files.

use crate::dra::DraCatalog;
use memguard_api::Cluster;
use memguard_api::cluster::{ConfigMaps, NodeLabels};
use memguard_api::crd::MemoryProfile;
use memguard_decide::{Adjustments, PodKey, adjustments};
use std::sync::Arc;

/// A read-only view of `MemoryProfile`s: the webhook's watch cache (a kube reflector store) or
/// profiles read from files. Lookups never call the API.
pub trait ProfileSource: Send + Sync {
    /// The profile `name` in `namespace`, if cached.
    fn get(&self, namespace: &str, name: &str) -> Option<MemoryProfile>;
}

/// What the decision reads of the cluster: the `MemoryProfile`s (what memguard learnt from past
/// runs) and the DRA objects. The webhook fills it from its watch caches
/// ([`ClusterView::from_source`], [`ClusterView::with_dra`]); `memguard mutate --profile --dra`
/// from files ([`ClusterView::insert`]); tests and a webhook without a cluster pass
/// [`ClusterView::default`].
#[derive(Clone, Default)]
pub struct ClusterView {
    /// ClusterView given directly, matched by key (spec), whatever their name or namespace.
    listed: Vec<MemoryProfile>,
    source: Option<Arc<dyn ProfileSource>>,
    /// The DRA objects (claims, templates, classes, slices) the pod's resolution reads.
    dra: Option<Arc<dyn DraCatalog>>,
    /// The ConfigMaps a trainer's config file may be mounted from.
    config_maps: Option<Arc<dyn ConfigMaps>>,
    /// The nodes' labels (their GPUs).
    nodes: Option<Arc<dyn NodeLabels>>,
}

impl std::fmt::Debug for ClusterView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterView")
            .field("listed", &self.listed.len())
            .field("source", &self.source.is_some())
            .field("dra", &self.dra.is_some())
            .field("config_maps", &self.config_maps.is_some())
            .field("nodes", &self.nodes.is_some())
            .finish()
    }
}

impl ClusterView {
    /// ClusterView looked up in `source` by namespace and object name.
    pub fn from_source(source: Arc<dyn ProfileSource>) -> Self {
        ClusterView {
            listed: Vec::new(),
            source: Some(source),
            ..ClusterView::default()
        }
    }

    /// The same, reading DRA objects from `catalog` (the webhook's watch caches, or
    /// `memguard mutate --dra`).
    pub fn with_dra(mut self, catalog: Arc<dyn DraCatalog>) -> Self {
        self.dra = Some(catalog);
        self
    }

    /// The same, reading ConfigMaps from `maps`.
    pub fn with_config_maps(mut self, maps: Arc<dyn ConfigMaps>) -> Self {
        self.config_maps = Some(maps);
        self
    }

    /// The same, reading the nodes' labels from `nodes`.
    pub fn with_nodes(mut self, nodes: Arc<dyn NodeLabels>) -> Self {
        self.nodes = Some(nodes);
        self
    }

    /// The DRA catalog, when there is one.
    pub fn dra(&self) -> Option<&dyn DraCatalog> {
        self.dra.as_deref()
    }

    /// Everything a pod's reading looks up, borrowed from this view.
    pub fn cluster(&self) -> Cluster<'_> {
        Cluster {
            dra: self.dra.as_deref(),
            config_maps: self.config_maps.as_deref(),
            nodes: self.nodes.as_deref(),
        }
    }

    /// Adds a profile; it applies to every pod with its key (`spec`).
    pub fn insert(&mut self, profile: MemoryProfile) {
        self.listed.push(profile);
    }

    /// The adjustments for a pod with `key` in `namespace`: from the first listed profile with
    /// that key, else from the source's profile named after the key (when its spec matches:
    /// a profile edited into another key adjusts nothing).
    pub fn adjustments(&self, namespace: Option<&str>, key: &PodKey) -> Option<Adjustments> {
        self.adjustments_of(namespace, &key.spec, &key.name)
    }

    /// [`adjustments`](Self::adjustments) of the profile with key `spec`, named `name` (a
    /// Guarded pod's launch key has no config: [`memguard_decide::key::LaunchKey`]).
    pub fn adjustments_of(
        &self,
        namespace: Option<&str>,
        spec: &memguard_api::crd::MemoryProfileSpec,
        name: &str,
    ) -> Option<Adjustments> {
        let status = |p: &MemoryProfile| adjustments(&p.status.clone().unwrap_or_default());
        if let Some(p) = self.listed.iter().find(|p| &p.spec == spec) {
            return Some(status(p));
        }
        let found = self.source.as_ref()?.get(namespace?, name)?;
        (&found.spec == spec).then(|| status(&found))
    }
}
