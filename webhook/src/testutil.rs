//! Test builders: `trainer_pod().annotate(MODEL, "llama-3-8b").gpus(2).build()`.

use k8s_openapi::api::core::v1::Pod;
use memguard_api::annotations as keys;
use serde_json::{Value, json};

#[derive(Clone)]
pub struct PodBuilder(Value);

/// A labelled pod with one container `train` and a LoRA config for llama-3-8b.
pub fn trainer_pod() -> PodBuilder {
    bare_pod()
        .annotate(keys::MODEL, "llama-3-8b")
        .annotate(keys::METHOD, "lora")
        .annotate(keys::BATCH_SIZE, "4")
}

/// A labelled pod with one container `train` and no annotations.
pub fn bare_pod() -> PodBuilder {
    PodBuilder(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "ml", "labels": {"memguard.io/enabled": "true"}},
        "spec": {"restartPolicy": "Never", "containers": [{"name": "train", "image": "trainer:1"}]}
    }))
}

impl PodBuilder {
    pub fn annotate(mut self, key: &str, value: &str) -> Self {
        let meta = &mut self.0["metadata"];
        if meta.get("annotations").is_none() {
            meta["annotations"] = json!({});
        }
        meta["annotations"][key] = json!(value);
        self
    }

    pub fn unlabelled(mut self) -> Self {
        self.0["metadata"]["labels"] = json!({});
        self
    }

    /// Adds a container (first or later in the list).
    pub fn container(mut self, name: &str) -> Self {
        let list = self.0["spec"]["containers"].as_array_mut().expect("array");
        list.push(json!({"name": name, "image": "helper:1"}));
        self
    }

    fn last(&mut self) -> &mut Value {
        let list = self.0["spec"]["containers"].as_array_mut().expect("array");
        list.last_mut().expect("a container")
    }

    /// `nvidia.com/gpu` limit on the last container.
    pub fn gpus(mut self, n: u32) -> Self {
        self.last()["resources"]["limits"]["nvidia.com/gpu"] = json!(n.to_string());
        self
    }

    /// `command` and `args` of the last container (an empty list: none).
    pub fn command_line(mut self, command: &[&str], args: &[&str]) -> Self {
        if !command.is_empty() {
            self.last()["command"] = json!(command);
        }
        if !args.is_empty() {
            self.last()["args"] = json!(args);
        }
        self
    }

    /// Any resource limit on the last container (`nvidia.com/mig-1g.10gb`, `amd.com/gpu`, …).
    pub fn limit(mut self, resource: &str, q: &str) -> Self {
        self.last()["resources"]["limits"][resource] = json!(q);
        self
    }

    /// A node-selector entry (added to those already there).
    pub fn select(mut self, label: &str, value: &str) -> Self {
        if self.0["spec"].get("nodeSelector").is_none() {
            self.0["spec"]["nodeSelector"] = json!({});
        }
        self.0["spec"]["nodeSelector"][label] = json!(value);
        self
    }

    /// `limits.memory` on the last container.
    pub fn memory_limit(mut self, q: &str) -> Self {
        self.last()["resources"]["limits"]["memory"] = json!(q);
        self
    }

    /// A literal env variable on the last container.
    pub fn env(mut self, name: &str, value: &str) -> Self {
        push(self.last(), "env", json!({"name": name, "value": value}));
        self
    }

    /// A `valueFrom` env variable on the last container.
    pub fn env_from_configmap(mut self, name: &str) -> Self {
        let var =
            json!({"name": name, "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "k"}}});
        push(self.last(), "env", var);
        self
    }

    pub fn node_selector(mut self, product: &str) -> Self {
        self.0["spec"]["nodeSelector"] = json!({"nvidia.com/gpu.product": product});
        self
    }

    /// A node selector on any label.
    pub fn node_label(mut self, label: &str, value: &str) -> Self {
        self.0["spec"]["nodeSelector"] = json!({ label: value });
        self
    }

    /// Required node affinity: one term per entry; an empty entry is a term without a product.
    pub fn affinity(mut self, terms: &[&[&str]]) -> Self {
        let terms: Vec<Value> = terms
            .iter()
            .map(|products| {
                let exprs = if products.is_empty() {
                    json!([{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}])
                } else {
                    json!([{"key": "nvidia.com/gpu.product", "operator": "In", "values": products}])
                };
                json!({"matchExpressions": exprs})
            })
            .collect();
        self.0["spec"]["affinity"] = json!({"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}});
        self
    }

    pub fn spec(mut self, key: &str, value: Value) -> Self {
        self.0["spec"][key] = value;
        self
    }

    pub fn json(&self) -> Value {
        self.0.clone()
    }

    pub fn build(self) -> Pod {
        serde_json::from_value(self.0).expect("builder makes valid pods")
    }
}

fn push(target: &mut Value, key: &str, item: Value) {
    if target.get(key).is_none() {
        target[key] = json!([]);
    }
    target[key].as_array_mut().expect("array").push(item);
}

/// An AdmissionReview v1 request for `object` (a Pod).
pub fn admission_review(object: Value, operation: &str, dry_run: bool) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "p",
            "namespace": "ml",
            "operation": operation,
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": object,
            "oldObject": null,
            "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    })
}
