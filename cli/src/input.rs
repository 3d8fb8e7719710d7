//! What `memguard mutate` and `memguard explain` read from `-f`: one reader for both. A file
//! (or stdin) of YAML or JSON documents, `---`-separated, where a `kind: List` (what
//! `kubectl get … -o yaml` prints) counts as its items. The documents are sorted: ConfigMaps
//! (the files trainers' launches name) and Nodes (their GPU labels) are what the webhook reads
//! from its watch caches, and go to the decision's view of the cluster; everything else is
//! what is mutated or explained. Every document is also kept as read, in order
//! ([`Input::originals`]), so that `mutate` prints the whole input back with only its
//! workloads changed.

use memguard_api::cluster::{ConfigMapList, NodeInfo, NodeList};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// The documents of `-f`, sorted.
#[derive(Debug, Default)]
pub struct Input {
    /// Where they came from (`stdin` or the path), for messages.
    pub source: String,
    /// Every document of the input as read, in order, a List as one document: ConfigMaps,
    /// Nodes and everything else.
    pub originals: Vec<Value>,
    /// The documents to mutate or explain (all but the ConfigMaps and Nodes), in order.
    pub documents: Vec<Document>,
    /// The ConfigMaps given, by namespace (`default` when unset) and name.
    pub config_maps: ConfigMapList,
    /// The Nodes given: their names, labels and taints.
    pub nodes: NodeList,
}

/// One object to mutate or explain: a document, or one item of a List.
#[derive(Debug)]
pub struct Document {
    /// Where it is in the input, for messages: `document 2`, `document 1 item 3`.
    pub place: String,
    /// The object.
    pub value: Value,
    /// Its index in [`Input::originals`].
    pub document: usize,
    /// Its index in that List's `items`, when it is a List's item.
    pub item: Option<usize>,
}

impl Input {
    /// The view of the cluster these objects make, on top of `view`.
    pub fn cluster_view(
        &self,
        view: memguard_webhook::ClusterView,
    ) -> memguard_webhook::ClusterView {
        let mut view = view;
        if !self.config_maps.0.is_empty() {
            view = view.with_config_maps(std::sync::Arc::new(self.config_maps.clone()));
        }
        if !self.nodes.0.is_empty() {
            view = view.with_nodes(std::sync::Arc::new(self.nodes.clone()));
        }
        view
    }
}

/// Whether `object` is a List (`kind: List`, or `PodList` and the like, with `items`): read
/// as its items.
pub fn is_list(object: &serde_json::Map<String, Value>) -> bool {
    let kind = object
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or_default();
    (kind == "List" || kind.ends_with("List")) && object.get("items").is_some_and(Value::is_array)
}

/// Reads `path` (`-`: stdin) into an [`Input`]; `Err` says what is wrong, naming the source.
pub fn read(path: &Path) -> Result<Input, String> {
    let (source, text) = if path.as_os_str() == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| format!("reading stdin: {e}"))?;
        ("stdin".to_string(), text)
    } else {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        (path.display().to_string(), text)
    };
    from_text(source, &text)
}

/// [`read`] of `text` already read from `source`.
pub fn from_text(source: String, text: &str) -> Result<Input, String> {
    let parsed: Vec<Value> = serde_saphyr::from_multiple(text).map_err(|e| {
        let first = e.to_string();
        let first = first
            .split("\n -->")
            .next()
            .unwrap_or_default()
            .trim()
            .to_string();
        format!("{source}: not valid YAML or JSON: {first}")
    })?;
    let mut input = Input {
        source: source.clone(),
        ..Input::default()
    };
    let mut place = 0;
    for doc in parsed.into_iter().filter(|d| !d.is_null()) {
        place += 1;
        input.originals.push(doc.clone());
        let (items, listed) = match (doc.as_object(), doc.get("items")) {
            (Some(object), Some(Value::Array(items))) if is_list(object) => (items.clone(), true),
            _ => (vec![doc], false),
        };
        for (index, item) in items.into_iter().enumerate() {
            let at = if listed {
                format!("document {place} item {}", index + 1)
            } else {
                format!("document {place}")
            };
            match item.get("kind").and_then(Value::as_str) {
                Some("ConfigMap") => {
                    let meta = &item["metadata"];
                    let name = meta["name"].as_str().ok_or_else(|| {
                        format!("{source}: document {place}: a ConfigMap without metadata.name")
                    })?;
                    let namespace = meta["namespace"].as_str().unwrap_or("default");
                    let data: BTreeMap<String, String> =
                        serde_json::from_value(item.get("data").cloned().unwrap_or_default())
                            .unwrap_or_default();
                    input
                        .config_maps
                        .0
                        .insert((namespace.to_string(), name.to_string()), data);
                }
                Some("Node") => {
                    let node: k8s_openapi::api::core::v1::Node = serde_json::from_value(item)
                        .map_err(|e| format!("{source}: {at}: a Node: {e}"))?;
                    input.nodes.0.push(NodeInfo::of(&node));
                }
                _ => input.documents.push(Document {
                    place: at,
                    value: item,
                    document: place - 1,
                    item: listed.then_some(index),
                }),
            }
        }
    }
    Ok(input)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_are_their_items_and_config_maps_and_nodes_are_the_cluster() {
        let text = r#"
apiVersion: v1
kind: List
items:
  - {apiVersion: v1, kind: Pod, metadata: {name: a}}
  - {apiVersion: v1, kind: Pod, metadata: {name: b}}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: axolotl, namespace: ml}
data: {lora.yml: "micro_batch_size: 2"}
---
{"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n", "labels": {"nvidia.com/gpu.memory": "24576"}}}
"#;
        let input = from_text("f.yaml".into(), text).expect("reads");
        let names: Vec<&str> = input
            .documents
            .iter()
            .map(|d| d.value["metadata"]["name"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(
            input.documents[1].place, "document 1 item 2",
            "the List's place"
        );
        assert_eq!(
            (input.documents[1].document, input.documents[1].item),
            (0, Some(1))
        );
        let kinds: Vec<&str> = input
            .originals
            .iter()
            .map(|d| d["kind"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(
            kinds,
            ["List", "ConfigMap", "Node"],
            "every document, in order"
        );
        assert!(
            input
                .config_maps
                .0
                .contains_key(&("ml".into(), "axolotl".into()))
        );
        assert_eq!(input.nodes.0[0].labels["nvidia.com/gpu.memory"], "24576");
        let err = from_text("f.yaml".into(), "a: [1\n").expect_err("bad YAML");
        assert!(err.starts_with("f.yaml: not valid YAML or JSON"), "{err}");
        assert!(!err.contains("<input>"), "{err}");
    }
}
