//! Against a mocked API server (tower-test): the kube-apiserver cannot run in these tests.
use super::*;
use crate::mock_kube::{answer, client, eventually};
use hyper::StatusCode;
use serde_json::json;

#[tokio::test]
async fn config_maps_are_listed_trimmed_and_a_large_one_keeps_no_data() {
    let (client, mut handle) = client();
    let (cache, task) = start_config_maps(client, &[]);
    let server = tokio::spawn(async move {
        let mut pending = Vec::new();
        while let Some((request, send)) = handle.next_request().await {
            let path = request.uri().path().to_string();
            let query = request.uri().query().unwrap_or_default().to_string();
            assert_eq!(path, "/api/v1/configmaps", "every namespace: {path}");
            if query.contains("watch=true") {
                pending.push(send);
                continue;
            }
            let big = "x".repeat(MAX_CONFIG_MAP_BYTES + 1);
            send.send_response(answer(
                StatusCode::OK,
                &json!({"kind": "ConfigMapList", "apiVersion": "v1",
                "metadata": {"resourceVersion": "1"},
                "items": [
                    {"metadata": {"name": "axolotl", "namespace": "ml"},
                     "data": {"lora.yml": "micro_batch_size: 2\n"},
                     "binaryData": {"blob": "AAAA"}},
                    {"metadata": {"name": "dataset", "namespace": "ml"},
                     "data": {"train.jsonl": big}},
                ]}),
            ));
        }
    });
    assert!(
        eventually(|| cache.data("ml", "axolotl").is_some()).await,
        "the listed ConfigMap is answered"
    );
    let data = cache.data("ml", "axolotl").expect("cached");
    assert_eq!(
        data.get("lora.yml").map(String::as_str),
        Some("micro_batch_size: 2\n")
    );
    assert_eq!(
        cache.data("ml", "dataset"),
        None,
        "over the bound: no data kept"
    );
    assert_eq!(cache.data("other", "axolotl"), None, "namespaced lookups");
    task.abort();
    server.abort();
}

#[tokio::test]
async fn a_forbidden_watch_answers_nothing_and_admission_goes_on() {
    let (client, mut handle) = client();
    let (cache, task) = start_config_maps(client, &["ml".to_string()]);
    let (request, send) = handle.next_request().await.expect("a list");
    assert_eq!(request.uri().path(), "/api/v1/namespaces/ml/configmaps");
    send.send_response(answer(
        StatusCode::FORBIDDEN,
        &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": "configmaps is forbidden", "reason": "Forbidden", "code": 403}),
    ));
    // The lookup answers "not known" (the pod is planned without its file), and never blocks.
    assert_eq!(cache.data("ml", "axolotl"), None);
    // The decision with this cache: the file is "not known", the pod is still admitted.
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "ax", "namespace": "ml",
                     "labels": {"memguard.io/enabled": "true"},
                     "annotations": {"memguard.io/model": "llama-3-8b", "memguard.io/method": "lora"}},
        "spec": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
            "containers": [{"name": "trainer", "image": "axolotl:latest",
                "command": ["axolotl", "train", "/config/lora.yml"],
                "volumeMounts": [{"name": "cfg", "mountPath": "/config"}],
                "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            "volumes": [{"name": "cfg", "configMap": {"name": "axolotl"}}]}
    }))
    .expect("pod");
    let view = crate::ClusterView::default().with_config_maps(cache.clone());
    match crate::mutate(&pod, &memguard_api::Policy::default(), &view) {
        crate::Outcome::Mutated(m) => assert!(
            m.warnings.iter().any(|w| w.contains("not known")),
            "{:?}",
            m.warnings
        ),
        other => panic!("not admitted: {other:?}"),
    }
    task.abort();
}

#[tokio::test]
async fn nodes_keep_their_labels_and_blocking_taints_bounded() {
    let (client, mut handle) = client();
    let (cache, task) = start_nodes(client);
    let server = tokio::spawn(async move {
        let mut pending = Vec::new();
        while let Some((request, send)) = handle.next_request().await {
            assert_eq!(request.uri().path(), "/api/v1/nodes");
            if request
                .uri()
                .query()
                .unwrap_or_default()
                .contains("watch=true")
            {
                pending.push(send);
                continue;
            }
            let taints: Vec<_> = (0..40)
                .map(|i| json!({"key": format!("t{i}"), "effect": "NoSchedule"}))
                .chain([json!({"key": "soft", "effect": "PreferNoSchedule"})])
                .collect();
            send.send_response(answer(
                StatusCode::OK,
                &json!({"kind": "NodeList", "apiVersion": "v1",
                    "metadata": {"resourceVersion": "1"},
                    "items": [{"metadata": {"name": "gpu-1",
                        "annotations": {"big": "x".repeat(4096)},
                        "labels": {
                        "nvidia.com/gpu.product": "NVIDIA-A30", "nvidia.com/gpu.memory": "24576",
                        "kubernetes.io/hostname": "gpu-1", "team": "ml"}},
                        "spec": {"taints": [{"key": "pool", "value": "inference", "effect": "NoSchedule"},
                                            {"key": "soft", "effect": "PreferNoSchedule"}],
                                 "podCIDR": "10.0.0.0/24"},
                        "status": {"images": [{"names": ["x"], "sizeBytes": 1}]}},
                        {"metadata": {"name": "gpu-2", "labels": {"nvidia.com/gpu.memory": "81920"}},
                         "spec": {"taints": taints}}]}),
            ));
        }
    });
    assert!(eventually(|| cache.nodes().len() == 2).await, "listed");
    let nodes = cache.nodes();
    let one = nodes.iter().find(|n| n.name == "gpu-1").expect("gpu-1");
    assert_eq!(
        one.labels.get("nvidia.com/gpu.memory").map(String::as_str),
        Some("24576")
    );
    // Every label: a pod's nodeSelector or affinity may name any of them.
    assert_eq!(one.labels.get("team").map(String::as_str), Some("ml"));
    // The blocking taints only; a PreferNoSchedule one only steers.
    assert_eq!(
        one.taints,
        vec![memguard_api::cluster::NodeTaint {
            key: "pool".into(),
            value: "inference".into(),
            effect: "NoSchedule".into()
        }]
    );
    // Bounded.
    let two = nodes.iter().find(|n| n.name == "gpu-2").expect("gpu-2");
    assert_eq!(two.taints.len(), MAX_NODE_TAINTS);
    task.abort();
    server.abort();
}
