//! The webhook's watch caches of ConfigMaps (the config files trainers' launches name:
//! axolotl, LLaMA-Factory, `tune run`, DeepSpeed JSON) and of the nodes' GPU labels, behind
//! [`ConfigMaps`] and [`NodeLabels`]. Admission reads the stores, never the API.
//!
//! What is kept is bounded: a ConfigMap's `data` only (no `binaryData`, no managed fields),
//! and none of it when it is larger than [`MAX_CONFIG_MAP_BYTES`]; of a node, its name, its
//! labels (a pod's `nodeSelector` and affinity may name any of them) and at most
//! [`MAX_NODE_TAINTS`] of its `NoSchedule` / `NoExecute` taints; its status, annotations and
//! the rest of its spec are dropped as each event arrives. A watch that fails (no RBAC: 403) logs the
//! error and keeps retrying; until it lists, lookups answer "not known", and a pod whose file
//! is in a ConfigMap is planned without it, with a warning that says so. Never a failed
//! admission.

use super::{drive, reflected};
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client};
use memguard_api::cluster::{ConfigMaps, MAX_NODE_TAINTS, NodeInfo, NodeLabels, blocks};
use std::collections::BTreeMap;
use tokio::task::JoinHandle;

/// The most `data` a cached ConfigMap may hold: a trainer's config is a few KiB; a larger
/// ConfigMap (a dataset, a bundle) is not kept.
pub const MAX_CONFIG_MAP_BYTES: usize = 1 << 20;

/// ConfigMaps from watch caches: one store for the whole cluster, or one per namespace named.
pub struct ConfigMapCache {
    stores: Vec<(Option<String>, Store<ConfigMap>)>,
}

impl ConfigMaps for ConfigMapCache {
    fn data(&self, namespace: &str, name: &str) -> Option<BTreeMap<String, String>> {
        let (_, store) = self
            .stores
            .iter()
            .find(|(ns, _)| ns.as_deref().is_none_or(|ns| ns == namespace))?;
        store
            .get(&ObjectRef::new(name).within(namespace))
            .and_then(|cm| cm.data.clone())
    }
}

/// Nodes' names, labels and blocking taints from a watch cache.
pub struct NodeCache {
    store: Store<Node>,
}

impl NodeLabels for NodeCache {
    fn labels(&self) -> Vec<BTreeMap<String, String>> {
        self.store
            .state()
            .iter()
            .map(|n| n.metadata.labels.clone().unwrap_or_default())
            .collect()
    }

    fn nodes(&self) -> Vec<NodeInfo> {
        self.store.state().iter().map(|n| NodeInfo::of(n)).collect()
    }
}

/// `cm` as kept: its `data` (none when over [`MAX_CONFIG_MAP_BYTES`]), no binary data, no
/// managed fields.
fn trimmed(cm: &mut ConfigMap) {
    cm.binary_data = None;
    cm.metadata.managed_fields = None;
    cm.metadata.annotations = None;
    let size: usize = cm
        .data
        .iter()
        .flatten()
        .map(|(k, v)| k.len() + v.len())
        .sum();
    if size > MAX_CONFIG_MAP_BYTES {
        cm.data = None;
    }
}

/// `node` as kept: its name, labels and at most [`MAX_NODE_TAINTS`] blocking taints; nothing
/// else (a Node's status, with its image list, is most of its size).
fn node_trimmed(node: &mut Node) {
    let taints: Vec<_> = node
        .spec
        .take()
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .filter(|t| blocks(&t.effect))
        .take(MAX_NODE_TAINTS)
        .collect();
    node.status = None;
    node.metadata = kube::api::ObjectMeta {
        name: node.metadata.name.take(),
        labels: node.metadata.labels.take(),
        resource_version: node.metadata.resource_version.take(),
        ..Default::default()
    };
    node.spec = Some(k8s_openapi::api::core::v1::NodeSpec {
        taints: (!taints.is_empty()).then_some(taints),
        ..Default::default()
    });
}

/// Starts the ConfigMap watches: every namespace (`namespaces` empty), or each one named.
pub fn start_config_maps(
    client: Client,
    namespaces: &[String],
) -> (std::sync::Arc<ConfigMapCache>, JoinHandle<()>) {
    let scopes: Vec<Option<String>> = if namespaces.is_empty() {
        vec![None]
    } else {
        namespaces.iter().cloned().map(Some).collect()
    };
    let mut stores = Vec::new();
    let mut watches = Vec::new();
    for scope in scopes {
        let api: Api<ConfigMap> = match &scope {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        };
        let (reader, watch) = reflected(api, trimmed);
        watches.push(watch);
        stores.push((scope, reader));
    }
    let task = drive(
        watches,
        "ConfigMap watch error: trainers' config files are not read until it lists",
    );
    (std::sync::Arc::new(ConfigMapCache { stores }), task)
}

/// Starts the node watch. Taints are in a Node's spec, so this watches whole Nodes (not
/// metadata only) and trims each as it arrives.
pub fn start_nodes(client: Client) -> (std::sync::Arc<NodeCache>, JoinHandle<()>) {
    let (reader, watch) = reflected(Api::<Node>::all(client), node_trimmed);
    let task = drive(
        vec![watch],
        "Node watch error: nodes' GPU labels and taints are not read until it lists",
    );
    (std::sync::Arc::new(NodeCache { store: reader }), task)
}

#[cfg(test)]
mod tests;
