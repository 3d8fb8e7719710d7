//! What reading a pod may look up in the cluster besides the pod itself: DRA objects, the
//! ConfigMaps a trainer's config file comes from, and the GPU nodes' labels. Lookups never call
//! the API: the webhook answers them from its watch caches, the CLI from the objects in its
//! input, tests from memory. Each part is optional; a missing one reads as "not known".

use crate::dra::DraCatalog;
use std::collections::BTreeMap;

/// ConfigMaps' data, looked up by namespace and name.
pub trait ConfigMaps: Send + Sync {
    /// The `data` of ConfigMap `name` in `namespace`, if known (`binaryData` is not a config).
    fn data(&self, namespace: &str, name: &str) -> Option<BTreeMap<String, String>>;
}

/// The labels of the cluster's nodes (GPU Feature Discovery publishes each node's GPU product
/// and memory as labels).
pub trait NodeLabels: Send + Sync {
    /// The labels of every known node.
    fn labels(&self) -> Vec<BTreeMap<String, String>>;
}

/// Everything a pod's reading may look up; [`Cluster::default`] knows nothing.
#[derive(Clone, Copy, Default)]
pub struct Cluster<'a> {
    /// DRA claims, templates, classes and slices.
    pub dra: Option<&'a dyn DraCatalog>,
    /// ConfigMaps (the trainer's config files mounted from them).
    pub config_maps: Option<&'a dyn ConfigMaps>,
    /// The nodes' labels.
    pub nodes: Option<&'a dyn NodeLabels>,
}

impl<'a> Cluster<'a> {
    /// Knows only the DRA objects in `dra`.
    pub fn with_dra(dra: Option<&'a dyn DraCatalog>) -> Self {
        Cluster {
            dra,
            ..Cluster::default()
        }
    }
}

impl std::fmt::Debug for Cluster<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("dra", &self.dra.is_some())
            .field("config_maps", &self.config_maps.is_some())
            .field("nodes", &self.nodes.is_some())
            .finish()
    }
}

/// ConfigMaps held in memory (the CLI's input, tests), keyed by namespace and name.
#[derive(Debug, Clone, Default)]
pub struct ConfigMapList(pub BTreeMap<(String, String), BTreeMap<String, String>>);

impl ConfigMaps for ConfigMapList {
    fn data(&self, namespace: &str, name: &str) -> Option<BTreeMap<String, String>> {
        self.0
            .get(&(namespace.to_string(), name.to_string()))
            .cloned()
    }
}

/// Node labels held in memory (the CLI's input, tests).
#[derive(Debug, Clone, Default)]
pub struct NodeLabelList(pub Vec<BTreeMap<String, String>>);

impl NodeLabels for NodeLabelList {
    fn labels(&self) -> Vec<BTreeMap<String, String>> {
        self.0.clone()
    }
}
