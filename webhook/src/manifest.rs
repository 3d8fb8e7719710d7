//! The mutation applied to manifests on disk (`memguard mutate`): a Pod, or any workload whose
//! pod templates (`…/template` objects with `spec.containers`) carry the opt-in label: a
//! Deployment, Job, StatefulSet, CronJob, or a PyTorchJob's `spec.pytorchReplicaSpecs.*.template`.
//!
//! Each pod (template) goes through exactly the server's [`mutate`](crate::mutate::mutate) and
//! [`patch::build`](crate::patch::build); the patch paths are then rebased onto the document.
//! A template is decided as the pod its controller creates, in the workload's namespace
//! ([`pods`]; `memguard explain` reads workloads through it too).

use crate::mutate::{self, ClusterView, Outcome};
use crate::patch;
use json_patch::jsonptr::PointerBuf;
use json_patch::{Patch, PatchOperation};
use k8s_openapi::api::core::v1::Pod;
use memguard_api::Policy;
use serde_json::{Value, json};

/// A document that cannot be mutated.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// The document is not a mapping.
    #[error("not a Kubernetes object (a mapping with `kind`)")]
    NotAnObject,
    /// A pod or pod template that does not deserialize as one.
    #[error("{path}: not a valid pod: {source}")]
    InvalidPod {
        /// JSON pointer of the pod in the document (empty for a Pod).
        path: String,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// The patch did not apply (a bug: patches are built against the same document).
    #[error("{path}: patch did not apply: {message}")]
    Apply {
        /// JSON pointer of the pod in the document.
        path: String,
        /// Why.
        message: String,
    },
}

/// What happened to one pod (template) of a document.
#[derive(Debug, Clone, PartialEq)]
pub struct PodResult {
    /// JSON pointer of the pod in the document (`""` for a Pod, `/spec/template` for a Job).
    pub path: String,
    /// The decision.
    pub outcome: Outcome,
}

/// One mutated document.
#[derive(Debug, Clone)]
pub struct Mutated {
    /// The document after the patch.
    pub document: Value,
    /// The patch, with paths relative to the document.
    pub patch: Patch,
    /// One entry per pod (template) found.
    pub pods: Vec<PodResult>,
}

/// Every pod of `document`, with its JSON pointer (`""` for a Pod, `/spec/template` for a
/// Job): the Pod itself, or each pod template of a workload as the Pod its controller creates.
/// A template's pod takes the workload's namespace (the controller creates its pods there), so
/// what the decision looks up by namespace (the ConfigMaps a trainer's config file is mounted
/// from) is found where the workload lives. The namespace is only on the pod handed to the
/// decision: the document's template is not given one.
pub fn pods(document: &Value) -> Result<Vec<(String, Pod)>, ManifestError> {
    Ok(pods_at(document)?
        .into_iter()
        .map(|(at, pod)| (at.to_string(), pod))
        .collect())
}

/// [`pods`], with each pod's pointer as a [`PointerBuf`].
fn pods_at(document: &Value) -> Result<Vec<(PointerBuf, Pod)>, ManifestError> {
    if !document.is_object() {
        return Err(ManifestError::NotAnObject);
    }
    if document.get("kind").and_then(Value::as_str) == Some("Pod") {
        let pod = serde_json::from_value(document.clone()).map_err(|source| {
            ManifestError::InvalidPod {
                path: String::new(),
                source,
            }
        })?;
        return Ok(vec![(PointerBuf::new(), pod)]);
    }
    let mut paths = Vec::new();
    find_templates(document, &mut PointerBuf::new(), &mut paths);
    let namespace = document
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .filter(|ns| !ns.is_empty());
    let mut pods = Vec::with_capacity(paths.len());
    for path in paths {
        let at = path.to_string();
        let Some(sub) = document.pointer(&at) else {
            continue;
        };
        let mut metadata = sub.get("metadata").cloned().unwrap_or_else(|| json!({}));
        if let (Some(ns), Some(meta)) = (namespace, metadata.as_object_mut()) {
            meta.insert("namespace".into(), json!(ns));
        }
        let pod_value = json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": metadata,
            "spec": sub.get("spec").cloned().unwrap_or(Value::Null),
        });
        let pod =
            serde_json::from_value(pod_value).map_err(|source| ManifestError::InvalidPod {
                path: at.clone(),
                source,
            })?;
        pods.push((path, pod));
    }
    Ok(pods)
}

/// Mutates every pod (template) of `document` ([`pods`]). Documents with no pod inside come
/// back as is.
pub fn mutate_document(
    document: &Value,
    policy: &Policy,
    profiles: &ClusterView,
) -> Result<Mutated, ManifestError> {
    let mut out = document.clone();
    let mut ops: Vec<PatchOperation> = Vec::new();
    let mut results = Vec::new();
    for (path, pod) in pods_at(document)? {
        let at = path.to_string();
        let outcome = mutate::mutate(&pod, policy, profiles);
        let pod_patch = patch::build(&pod, &outcome);
        if let Some(target) = out.pointer_mut(&at) {
            json_patch::patch(target, &pod_patch).map_err(|e| ManifestError::Apply {
                path: at.clone(),
                message: e.to_string(),
            })?;
        }
        ops.extend(pod_patch.0.into_iter().map(|op| rebase(op, &path)));
        results.push(PodResult { path: at, outcome });
    }
    Ok(Mutated {
        document: out,
        patch: Patch(ops),
        pods: results,
    })
}

/// Pod templates: objects under a `template` key whose `spec` has a `containers` array.
fn find_templates(value: &Value, at: &mut PointerBuf, found: &mut Vec<PointerBuf>) {
    match value {
        Value::Object(map) => {
            for (key, child) in map {
                at.push_back(key.as_str());
                let is_template = key == "template"
                    && child
                        .get("spec")
                        .and_then(|s| s.get("containers"))
                        .is_some_and(Value::is_array);
                if is_template {
                    found.push(at.clone());
                } else {
                    find_templates(child, at, found);
                }
                at.pop_back();
            }
        }
        Value::Array(items) => {
            for (i, child) in items.iter().enumerate() {
                at.push_back(i);
                find_templates(child, at, found);
                at.pop_back();
            }
        }
        _ => {}
    }
}

fn rebase(op: PatchOperation, prefix: &PointerBuf) -> PatchOperation {
    let join = |p: &PointerBuf| prefix.concat(p);
    match op {
        PatchOperation::Add(mut o) => {
            o.path = join(&o.path);
            PatchOperation::Add(o)
        }
        PatchOperation::Remove(mut o) => {
            o.path = join(&o.path);
            PatchOperation::Remove(o)
        }
        PatchOperation::Replace(mut o) => {
            o.path = join(&o.path);
            PatchOperation::Replace(o)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memguard_api::annotations as keys;

    fn template(labelled: bool) -> Value {
        let labels = if labelled {
            json!({"memguard.io/enabled": "true"})
        } else {
            json!({})
        };
        json!({
            "metadata": {"labels": labels, "annotations": {
                keys::MODEL: "llama-3-8b", keys::METHOD: "lora", keys::BATCH_SIZE: "4"}},
            "spec": {"restartPolicy": "Never", "containers": [{"name": "train", "image": "t",
                "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}
        })
    }

    #[test]
    fn mutates_a_job_template_and_rebases_the_patch() {
        let job = json!({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
            "spec": {"template": template(true)}});
        let m = mutate_document(&job, &Policy::default(), &ClusterView::default()).expect("valid");
        assert_eq!(m.pods.len(), 1);
        assert_eq!(m.pods[0].path, "/spec/template");
        assert!(!m.patch.0.is_empty());
        for op in &m.patch.0 {
            assert!(
                op.path().to_string().starts_with("/spec/template/"),
                "{op:?}"
            );
        }
        let mut applied = job.clone();
        json_patch::patch(&mut applied, &m.patch).expect("rebased patch applies to the document");
        assert_eq!(applied, m.document);
        let init = &m.document["spec"]["template"]["spec"]["initContainers"][0];
        assert_eq!(init["restartPolicy"], "Always");
    }

    #[test]
    fn finds_every_replica_template_of_a_pytorchjob() {
        let job = json!({"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "spec": {"pytorchReplicaSpecs": {
                "Master": {"replicas": 1, "template": template(true)},
                "Worker": {"replicas": 3, "template": template(true)}}}});
        let m = mutate_document(&job, &Policy::default(), &ClusterView::default()).expect("valid");
        let paths: Vec<&str> = m.pods.iter().map(|p| p.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/spec/pytorchReplicaSpecs/Master/template",
                "/spec/pytorchReplicaSpecs/Worker/template"
            ]
        );
        assert!(
            m.pods
                .iter()
                .all(|p| matches!(p.outcome, Outcome::Mutated(_)))
        );
    }

    #[test]
    fn leaves_unlabelled_templates_and_other_objects_alone() {
        let deploy = json!({"kind": "Deployment", "spec": {"template": template(false)}});
        let m = mutate_document(&deploy, &Policy::default(), &ClusterView::default()).expect("ok");
        assert_eq!(m.pods[0].outcome, Outcome::Unchanged);
        assert!(m.patch.0.is_empty());
        let svc = json!({"kind": "Service", "spec": {"ports": [{"port": 80}]}});
        let m = mutate_document(&svc, &Policy::default(), &ClusterView::default()).expect("ok");
        assert!(m.pods.is_empty());
        assert_eq!(m.document, svc);
    }

    /// A Job in `ml` whose trainer reads its config file from a ConfigMap in `ml`: the
    /// template's pod is decided in the Job's namespace, so the file is found and read (it was
    /// looked up in `default`, and the pod skipped as unread).
    #[test]
    fn a_workloads_pods_take_its_namespace_so_its_config_maps_are_found() {
        use memguard_api::cluster::ConfigMapList;
        let axolotl = include_str!("../tests/fixtures/config-files/axolotl-lora-8b.yml");
        let mut maps = ConfigMapList::default();
        maps.0.insert(
            ("ml".into(), "axolotl".into()),
            [("lora-8b.yml".to_string(), axolotl.to_string())].into(),
        );
        let view = ClusterView::default().with_config_maps(std::sync::Arc::new(maps));
        let job = json!({"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "sft", "namespace": "ml"},
            "spec": {"template": {
                "metadata": {"labels": {"memguard.io/enabled": "true"}},
                "spec": {"restartPolicy": "Never", "containers": [{"name": "trainer",
                    "image": "axolotl", "command": ["axolotl", "train", "/config/lora-8b.yml"],
                    "volumeMounts": [{"name": "cfg", "mountPath": "/config"}],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                    "volumes": [{"name": "cfg", "configMap": {"name": "axolotl"}}]}}}});
        let pods = pods(&job).expect("a job");
        assert_eq!(pods[0].1.metadata.namespace.as_deref(), Some("ml"));
        let m = mutate_document(&job, &Policy::default(), &view).expect("valid");
        assert!(
            matches!(m.pods[0].outcome, Outcome::Mutated(_)),
            "{:?}",
            m.pods[0].outcome
        );
        let template = &m.document["spec"]["template"];
        let estimate: Value = serde_json::from_str(
            template["metadata"]["annotations"][keys::ESTIMATE]
                .as_str()
                .expect("admitted"),
        )
        .expect("estimate JSON");
        assert_eq!(
            estimate["sources"]["batch-size"], "configmap:axolotl/lora-8b.yml",
            "{estimate}"
        );
        assert!(
            template["metadata"].get("namespace").is_none(),
            "the template itself is not given a namespace"
        );
        // The same Job in another namespace does not see `ml`'s ConfigMap.
        let mut elsewhere = job.clone();
        elsewhere["metadata"]["namespace"] = json!("other");
        let m = mutate_document(&elsewhere, &Policy::default(), &view).expect("valid");
        let annotations = &m.document["spec"]["template"]["metadata"]["annotations"];
        let read_from_map = annotations[keys::ESTIMATE]
            .as_str()
            .is_some_and(|e| e.contains("configmap:axolotl"));
        assert!(!read_from_map, "{annotations}");
    }

    #[test]
    fn rejects_what_is_not_an_object_or_not_a_pod() {
        assert!(matches!(
            mutate_document(&json!([1, 2]), &Policy::default(), &ClusterView::default()),
            Err(ManifestError::NotAnObject)
        ));
        let bad = json!({"kind": "Pod", "spec": {"containers": "nope"}});
        let err = mutate_document(&bad, &Policy::default(), &ClusterView::default())
            .expect_err("containers must be a list");
        assert!(matches!(err, ManifestError::InvalidPod { .. }), "{err}");
    }
}
