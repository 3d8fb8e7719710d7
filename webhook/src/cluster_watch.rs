//! The webhook's watch caches of ConfigMaps (the config files trainers' launches name:
//! axolotl, LLaMA-Factory, `tune run`, DeepSpeed JSON) and of the nodes' GPU labels, behind
//! [`ConfigMaps`] and [`NodeLabels`]. Admission reads the stores, never the API.
//!
//! What is kept is bounded: a ConfigMap's `data` only (no `binaryData`, no managed fields),
//! and none of it when it is larger than [`MAX_CONFIG_MAP_BYTES`]; of a node, only its
//! accelerator labels, from a metadata-only watch. A watch that fails (no RBAC: 403) logs the
//! error and keeps retrying; until it lists, lookups answer "not known", and a pod whose file
//! is in a ConfigMap is planned without it, with a warning that says so. Never a failed
//! admission.

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Node};
use kube::api::PartialObjectMeta;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use memguard_api::cluster::{ConfigMaps, NodeLabels};
use std::collections::BTreeMap;
use tokio::task::JoinHandle;

/// The most `data` a cached ConfigMap may hold: a trainer's config is a few KiB; a larger
/// ConfigMap (a dataset, a bundle) is not kept.
pub const MAX_CONFIG_MAP_BYTES: usize = 1 << 20;

/// The label prefixes of a node kept: its GPUs (GPU Feature Discovery, AMD's labeller), the
/// cloud's accelerator label, and the instance type that names the GPU where no label does.
pub const NODE_LABEL_PREFIXES: &[&str] = &[
    "nvidia.com/",
    "amd.com/",
    "cloud.google.com/gke-accelerator",
    "k8s.amazonaws.com/accelerator",
    "kubernetes.azure.com/accelerator",
    "node.kubernetes.io/instance-type",
];

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

/// Nodes' accelerator labels from a metadata watch cache.
pub struct NodeCache {
    store: Store<PartialObjectMeta<Node>>,
}

impl NodeLabels for NodeCache {
    fn labels(&self) -> Vec<BTreeMap<String, String>> {
        self.store
            .state()
            .iter()
            .map(|n| n.metadata.labels.clone().unwrap_or_default())
            .collect()
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

/// `node` as kept: its accelerator labels only.
fn node_trimmed(node: &mut PartialObjectMeta<Node>) {
    let labels = node.metadata.labels.take().unwrap_or_default();
    let kept: BTreeMap<String, String> = labels
        .into_iter()
        .filter(|(k, _)| NODE_LABEL_PREFIXES.iter().any(|p| k.starts_with(p)))
        .collect();
    node.metadata = kube::api::ObjectMeta {
        name: node.metadata.name.take(),
        labels: Some(kept),
        ..Default::default()
    };
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
    let mut streams = Vec::new();
    for scope in scopes {
        let api: Api<ConfigMap> = match &scope {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        };
        let (reader, writer) = reflector::store::<ConfigMap>();
        let watch = reflector::reflector(
            writer,
            watcher(api, watcher::Config::default()).modify(trimmed),
        )
        .default_backoff()
        .touched_objects()
        .map(|r| r.map(|_| ()));
        streams.push(watch.boxed());
        stores.push((scope, reader));
    }
    let task = tokio::spawn(async move {
        let mut all = futures::stream::select_all(streams);
        while let Some(item) = all.next().await {
            if let Err(error) = item {
                tracing::warn!(
                    %error,
                    "ConfigMap watch error: trainers' config files are not read until it lists"
                );
            }
        }
    });
    (std::sync::Arc::new(ConfigMapCache { stores }), task)
}

/// Starts the node metadata watch.
pub fn start_nodes(client: Client) -> (std::sync::Arc<NodeCache>, JoinHandle<()>) {
    let (reader, writer) = reflector::store::<PartialObjectMeta<Node>>();
    // An `Api` of `PartialObjectMeta` asks for metadata only.
    let api: Api<PartialObjectMeta<Node>> = Api::all(client);
    let watch = reflector::reflector(
        writer,
        watcher(api, watcher::Config::default()).modify(node_trimmed),
    )
    .default_backoff()
    .touched_objects();
    let task = tokio::spawn(async move {
        let mut watch = std::pin::pin!(watch);
        while let Some(item) = watch.next().await {
            if let Err(error) = item {
                tracing::warn!(
                    %error,
                    "Node watch error: nodes' GPU labels are not read until it lists"
                );
            }
        }
    });
    (std::sync::Arc::new(NodeCache { store: reader }), task)
}

#[cfg(test)]
mod tests;
