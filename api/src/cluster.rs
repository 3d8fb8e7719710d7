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
/// and memory as labels), and their taints.
pub trait NodeLabels: Send + Sync {
    /// The labels of every known node.
    fn labels(&self) -> Vec<BTreeMap<String, String>>;

    /// Every known node with what decides whether a pod may run there: its name, labels and
    /// scheduling taints. The default knows labels only (no taints, no name).
    fn nodes(&self) -> Vec<NodeInfo> {
        self.labels()
            .into_iter()
            .map(|labels| NodeInfo {
                labels,
                ..NodeInfo::default()
            })
            .collect()
    }
}

/// A node as admission reads it: what a pod's `nodeName`, `nodeSelector`, required node
/// affinity and tolerations are matched against.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// `metadata.name` (empty when not known): `nodeName` and `matchFields` read it.
    pub name: String,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `spec.taints` whose effect keeps a pod that does not tolerate them off the node
    /// (`NoSchedule`, `NoExecute`); `PreferNoSchedule` only steers, so it is not kept.
    pub taints: Vec<NodeTaint>,
}

/// One taint of a node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeTaint {
    /// The taint's key.
    pub key: String,
    /// Its value (empty when none).
    pub value: String,
    /// `NoSchedule` or `NoExecute`.
    pub effect: String,
}

/// The most taints kept per node. A node carrying more keeps its first ones: a taint dropped
/// can only make the node look usable, which makes the budget smaller (its GPU counts), never
/// larger than the pod's real choice.
pub const MAX_NODE_TAINTS: usize = 32;

impl NodeInfo {
    /// The node of a Kubernetes `Node` object: its name, labels and blocking taints (at most
    /// [`MAX_NODE_TAINTS`]).
    pub fn of(node: &k8s_openapi::api::core::v1::Node) -> NodeInfo {
        let taints = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.as_ref())
            .into_iter()
            .flatten()
            .filter(|t| blocks(&t.effect))
            .take(MAX_NODE_TAINTS)
            .map(|t| NodeTaint {
                key: t.key.clone(),
                value: t.value.clone().unwrap_or_default(),
                effect: t.effect.clone(),
            })
            .collect();
        NodeInfo {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            taints,
        }
    }
}

/// Whether a taint with `effect` keeps pods that do not tolerate it off the node.
pub fn blocks(effect: &str) -> bool {
    matches!(effect, "NoSchedule" | "NoExecute")
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

/// Nodes held in memory with their taints (`memguard mutate`'s and `explain`'s input).
#[derive(Debug, Clone, Default)]
pub struct NodeList(pub Vec<NodeInfo>);

impl NodeLabels for NodeList {
    fn labels(&self) -> Vec<BTreeMap<String, String>> {
        self.0.iter().map(|n| n.labels.clone()).collect()
    }

    fn nodes(&self) -> Vec<NodeInfo> {
        self.0.clone()
    }
}
