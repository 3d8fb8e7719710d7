//! Against a mocked API server (tower-test): the kube-apiserver cannot run in these tests.
use super::*;
use crate::mock_kube::{answer, client, eventually};
use hyper::StatusCode;
use serde_json::{Value, json};

fn status_error(code: u16, reason: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": reason, "reason": reason, "code": code})
}

#[tokio::test]
async fn a_cluster_without_the_api_is_said_once_and_asked_nothing_more() {
    let (client, mut handle) = client();
    let (catalog, task) = start(client);
    let (request, send) = handle.next_request().await.expect("discovery");
    assert_eq!(request.uri().path(), "/apis/resource.k8s.io/v1");
    send.send_response(answer(
        StatusCode::NOT_FOUND,
        &status_error(404, "NotFound"),
    ));
    task.await.expect("the task ends");
    assert_eq!(
        catalog.unavailable().as_deref(),
        Some("resource.k8s.io/v1 not served by this cluster")
    );
    assert!(catalog.claim_template("ml", "x").is_none());
    assert!(catalog.slices("gpu.nvidia.com").is_empty());
}

/// Lists each kind from the fixture objects; watches are left pending.
#[tokio::test]
async fn synced_caches_answer_from_the_listed_objects() {
    let objects: Vec<Value> =
        serde_saphyr::from_multiple(include_str!("../../../tests/fixtures/dra/objects.yaml"))
            .expect("fixture");
    let (client, mut handle) = client();
    let (catalog, task) = start(client);
    let server = tokio::spawn(async move {
        let mut pending = Vec::new();
        while let Some((request, send)) = handle.next_request().await {
            let path = request.uri().path().to_string();
            let query = request.uri().query().unwrap_or_default().to_string();
            if path == "/apis/resource.k8s.io/v1" {
                send.send_response(answer(
                    StatusCode::OK,
                    &json!({
                    "kind": "APIResourceList", "apiVersion": "v1",
                    "groupVersion": "resource.k8s.io/v1", "resources": []}),
                ));
            } else if query.contains("watch=true") {
                pending.push(send);
            } else {
                let plural = path.rsplit('/').next().unwrap_or_default();
                let (kind, _) = KINDS
                    .iter()
                    .find(|(_, p)| *p == plural)
                    .expect("a DRA kind");
                let items: Vec<&Value> = objects.iter().filter(|o| o["kind"] == *kind).collect();
                send.send_response(answer(
                    StatusCode::OK,
                    &json!({
                    "kind": format!("{kind}List"), "apiVersion": "resource.k8s.io/v1",
                    "metadata": {"resourceVersion": "1"}, "items": items}),
                ));
            }
        }
    });
    assert!(
        eventually(|| catalog.unavailable().is_none()).await,
        "{:?}",
        catalog.unavailable()
    );
    let template = catalog
        .claim_template("ml", "single-h100")
        .expect("template");
    assert_eq!(template.metadata.name, "single-h100");
    assert!(catalog.claim_template("other", "single-h100").is_none());
    assert!(catalog.device_class("gpu.nvidia.com").is_some());
    assert!(catalog.claim("ml", "shared-h200").is_some());
    assert_eq!(catalog.slices("gpu.nvidia.com").len(), 2);
    assert!(catalog.slices("gpu.amd.com").is_empty());
    task.abort();
    server.abort();
}

#[tokio::test]
async fn a_forbidden_watch_keeps_the_catalog_unsynced_and_names_the_error() {
    let (client, mut handle) = client();
    let (catalog, task) = start(client);
    let server = tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            if request.uri().path() == "/apis/resource.k8s.io/v1" {
                send.send_response(answer(
                    StatusCode::OK,
                    &json!({
                    "kind": "APIResourceList", "apiVersion": "v1",
                    "groupVersion": "resource.k8s.io/v1", "resources": []}),
                ));
            } else {
                send.send_response(answer(
                    StatusCode::FORBIDDEN,
                    &status_error(403, "Forbidden"),
                ));
            }
        }
    });
    assert!(
        eventually(|| catalog
            .unavailable()
            .is_some_and(|w| w.starts_with("DRA watch caches not synced: ")))
        .await,
        "{:?}",
        catalog.unavailable()
    );
    task.abort();
    server.abort();
}
