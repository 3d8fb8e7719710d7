//! The controller's API traffic against a mocked apiserver ([`crate::mock_api`]): each expected
//! request is checked for method, path and body, and answered in turn.

use super::*;
use crate::mock_api::{Step, client, status_error, step, verify};
use crate::update::apply;
use http::{Method, StatusCode};
use memguard_api::crd::{MemoryProfileSpec, MemoryProfileStatus};
use memguard_api::env;
use memguard_decide::testutil::{PodBuilder, summary};

/// Observes under the default policy (the built-in catalog only), without DRA objects.
fn try_observe(
    pod: &k8s_openapi::api::core::v1::Pod,
) -> Result<crate::observe::Observation, crate::observe::NotObserved> {
    crate::observe::try_observe(
        pod,
        &memguard_api::Policy::default(),
        memguard_api::Cluster::default(),
    )
}

const GIB: u64 = 1 << 30;
const PROFILES: &str = "/apis/training.memguard.io/v1alpha1/namespaces/ml/memoryprofiles";

fn pod() -> PodBuilder {
    PodBuilder::trainer()
        .annotate("model", "llama-3-8b")
        .annotate("method", "lora")
        .estimated(12 * GIB, Some(16 * GIB))
        .gpus(1)
        .env(env::BATCH_SIZE, "16")
        .env(env::GRAD_ACCUMULATION, "1")
        .env(env::GRAD_CHECKPOINTING, "true")
}

fn profile_name() -> String {
    memguard_decide::pod_key(
        &pod().build(),
        &memguard_api::Policy::default(),
        memguard_api::Cluster::default(),
    )
    .expect("key")
    .name
}

fn key() -> MemoryProfileSpec {
    memguard_decide::pod_key(
        &pod().build(),
        &memguard_api::Policy::default(),
        memguard_api::Cluster::default(),
    )
    .expect("key")
    .spec
}

fn profile(rv: &str, status: Option<&MemoryProfileStatus>) -> Value {
    let mut p = MemoryProfile::new(&profile_name(), key());
    p.metadata.namespace = Some("ml".into());
    p.metadata.resource_version = Some(rv.into());
    p.status = status.cloned();
    serde_json::to_value(&p).expect("json")
}

fn finished_pod() -> Pod {
    pod()
        .trainer_terminated("Completed", 0, 100)
        .native_sidecar_done(&summary(None, Some(13 * GIB), Some(16 * GIB)))
        .build()
}

fn oom_pod() -> Pod {
    pod()
        .trainer_terminated("OOMKilled", 137, 100)
        .phase("Failed")
        .build()
}

async fn record(pod: Pod, steps: Vec<Step>) -> Result<Recorded, Error> {
    let (client, handle) = client();
    let verifier = tokio::spawn(verify(handle, steps));
    let recorder = Recorder::new(client, Metrics::default());
    let out = recorder.record(&pod).await;
    verifier.await.expect("scenario verified");
    out
}

#[tokio::test]
async fn a_finished_pod_creates_its_profile_and_patches_the_run_into_the_status() {
    let name = profile_name();
    let item = format!("{PROFILES}/{name}");
    let want_key = serde_json::to_value(key()).expect("json");
    let steps = vec![
        step(
            Method::GET,
            &item,
            StatusCode::NOT_FOUND,
            status_error(404, "NotFound"),
        ),
        step(
            Method::POST,
            PROFILES,
            StatusCode::CREATED,
            profile("1", None),
        )
        .body(move |body| {
            assert_eq!(body["metadata"]["name"], json!(profile_name()));
            assert_eq!(body["spec"], want_key);
            assert_eq!(body["metadata"]["labels"][MANAGED_BY.0], MANAGED_BY.1);
            assert!(body.get("status").is_none_or(Value::is_null));
        }),
        step(
            Method::PATCH,
            &format!("{item}/status"),
            StatusCode::OK,
            profile("2", None),
        )
        .body(|body| {
            assert_eq!(body["metadata"]["resourceVersion"], "1");
            let runs = &body["status"]["runs"];
            assert_eq!(runs.as_array().map(Vec::len), Some(1), "{body}");
            assert_eq!(runs[0]["pod"], "trainer-0");
            assert_eq!(runs[0]["uid"], "uid-0");
            assert_eq!(runs[0]["estimateBytes"], 12 * GIB);
            assert_eq!(runs[0]["measuredPeakBytes"], 13 * GIB);
            assert_eq!(body["status"]["runCount"], 1);
            assert!(body["status"].get("recovery").is_none());
        }),
    ];
    let out = record(finished_pod(), steps).await.expect("recorded");
    assert_eq!(
        out,
        Recorded::Updated {
            profile: name,
            oom: false
        }
    );
}

#[tokio::test]
async fn an_oom_killed_pod_patches_the_event_and_the_recovery() {
    let item = format!("{PROFILES}/{}", profile_name());
    let steps = vec![
        step(Method::GET, &item, StatusCode::OK, profile("7", None)),
        step(
            Method::PATCH,
            &format!("{item}/status"),
            StatusCode::OK,
            profile("8", None),
        )
        .body(|body| {
            let status = &body["status"];
            assert_eq!(status["oomEvents"][0]["pod"], "trainer-0");
            assert_eq!(status["oomEvents"][0]["reason"], "OOMKilled");
            assert_eq!(status["oomEvents"][0]["config"]["batchSize"], 16);
            assert_eq!(status["runs"][0]["oomKilled"], true);
            assert_eq!(status["recovery"]["rungs"], 1);
            assert_eq!(status["recovery"]["config"]["batchSize"], 8);
            let reason = status["recovery"]["reason"].as_str().unwrap_or_default();
            assert!(
                reason.starts_with("pod trainer-0 OOMKilled at batch 16"),
                "{reason}"
            );
            assert!(status["lastOomAt"].is_string());
        }),
    ];
    let out = record(oom_pod(), steps).await.expect("recorded");
    assert!(matches!(out, Recorded::Updated { oom: true, .. }));
}

#[tokio::test]
async fn the_oom_limit_is_read_from_the_policy_at_each_oom() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let item = format!("{PROFILES}/{}", profile_name());
    let limit = Arc::new(AtomicU32::new(3));
    let read = limit.clone();
    let (client, handle) = client();
    let recorder = Recorder::new(client, Metrics::default()).with_policy(Arc::new(move || {
        Arc::new(Policy {
            max_oom_recoveries: read.load(Ordering::SeqCst),
            ..Policy::default()
        })
    }));
    // The policy changed to "never retry smaller" before this OOM.
    limit.store(0, Ordering::SeqCst);
    let steps = vec![
        step(Method::GET, &item, StatusCode::OK, profile("7", None)),
        step(
            Method::PATCH,
            &format!("{item}/status"),
            StatusCode::OK,
            profile("8", None),
        )
        .body(|body| {
            let status = &body["status"];
            assert_eq!(status["oomRecoveries"], 1);
            assert!(status.get("recovery").is_none(), "{status}");
            let verdict = status["verdict"].as_str().unwrap_or_default();
            assert!(
                verdict.starts_with(
                    "cannot fit: 1 OOM in a row (limit 0); smallest config tried: batch 16"
                ),
                "{verdict}"
            );
        }),
    ];
    let verifier = tokio::spawn(verify(handle, steps));
    let out = recorder.record(&oom_pod()).await.expect("recorded");
    verifier.await.expect("scenario verified");
    assert!(matches!(out, Recorded::Updated { oom: true, .. }));
}

#[tokio::test]
async fn a_conflict_is_retried_from_a_fresh_read() {
    let item = format!("{PROFILES}/{}", profile_name());
    let status_path = format!("{item}/status");
    let steps = vec![
        step(Method::GET, &item, StatusCode::OK, profile("1", None)),
        step(
            Method::PATCH,
            &status_path,
            StatusCode::CONFLICT,
            status_error(409, "Conflict"),
        ),
        step(Method::GET, &item, StatusCode::OK, profile("2", None)),
        step(
            Method::PATCH,
            &status_path,
            StatusCode::OK,
            profile("3", None),
        )
        .body(|body| assert_eq!(body["metadata"]["resourceVersion"], "2")),
    ];
    let out = record(finished_pod(), steps).await.expect("recorded");
    assert!(matches!(out, Recorded::Updated { oom: false, .. }));
}

#[tokio::test]
async fn endless_conflicts_give_up_with_an_error() {
    let item = format!("{PROFILES}/{}", profile_name());
    let (client, handle) = client();
    let mut recorder = Recorder::new(client, Metrics::default());
    recorder.max_attempts = 2;
    let steps = (0..2)
        .flat_map(|i| {
            [
                step(
                    Method::GET,
                    &item,
                    StatusCode::OK,
                    profile(&i.to_string(), None),
                ),
                step(
                    Method::PATCH,
                    &format!("{item}/status"),
                    StatusCode::CONFLICT,
                    status_error(409, "Conflict"),
                ),
            ]
        })
        .collect();
    let verifier = tokio::spawn(verify(handle, steps));
    let err = recorder
        .record(&finished_pod())
        .await
        .expect_err("gives up");
    verifier.await.expect("scenario verified");
    assert_eq!(err.metric_label().as_str(), "conflicts");
}

#[tokio::test]
async fn a_run_already_recorded_is_not_written_again() {
    let obs = try_observe(&finished_pod()).expect("observed");
    let status = apply(&MemoryProfileStatus::default(), &obs);
    let item = format!("{PROFILES}/{}", profile_name());
    let steps = vec![step(
        Method::GET,
        &item,
        StatusCode::OK,
        profile("5", Some(&status)),
    )];
    let out = record(finished_pod(), steps).await.expect("no write");
    assert_eq!(out, Recorded::Unchanged);
}

#[tokio::test]
async fn a_profile_with_another_key_is_an_error_not_an_overwrite() {
    let item = format!("{PROFILES}/{}", profile_name());
    let mut other = profile("1", None);
    other["spec"]["method"] = json!("full");
    let steps = vec![step(Method::GET, &item, StatusCode::OK, other)];
    let err = record(finished_pod(), steps).await.expect_err("collision");
    assert_eq!(err.metric_label().as_str(), "key_collision");
}

#[tokio::test]
async fn a_running_pod_makes_no_api_call() {
    let pod = pod().trainer_running().native_sidecar_running().build();
    let out = record(pod, vec![]).await.expect("skipped");
    assert_eq!(out, Recorded::Skipped(NotObserved::Running));
}

#[test]
fn the_status_patch_nulls_fields_that_went_away() {
    let old = json!({"runs": [], "runCount": 3, "medianCorrectionFactor": 1.2});
    let new = json!({"runs": [1], "runCount": 4});
    let patch = status_patch(Some("9"), &old, &new);
    assert_eq!(
        patch,
        json!({"metadata": {"resourceVersion": "9"},
               "status": {"runs": [1], "runCount": 4, "medianCorrectionFactor": null}})
    );
}

/// An axolotl trainer with only the opt-in label: its model, method and knobs are in a file
/// mounted from ConfigMap `axolotl` (the key comes from the ConfigMap, issue 37 item 4).
fn config_map_pod(summary: &memguard_api::Summary) -> Pod {
    let message = serde_json::to_string(summary).expect("summary");
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "train", "namespace": "ml", "uid": "uid-train",
                     "labels": {"memguard.io/enabled": "true"}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "trainer",
                "image": "ghcr.io/example/trainer:1",
                "command": ["axolotl", "train", "/config/lora-8b.yml"],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                "volumeMounts": [{"name": "config", "mountPath": "/config"}]
            }],
            "volumes": [{"name": "config", "configMap": {"name": "axolotl"}}]
        },
        "status": {
            "phase": "Failed",
            "containerStatuses": [{"name": "trainer", "image": "", "imageID": "", "ready": false,
                "restartCount": 0, "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                "finishedAt": "2026-01-01T00:01:40Z"}}}],
            "initContainerStatuses": [{"name": memguard_api::wellknown::SIDECAR_CONTAINER,
                "image": "", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                "finishedAt": "2026-01-01T00:01:41Z", "message": message}}}]
        }
    }))
    .expect("a Pod")
}

fn axolotl_config_maps() -> Arc<dyn memguard_api::cluster::ConfigMaps> {
    let text = "base_model: NousResearch/Meta-Llama-3-8B\nadapter: lora\nlora_r: 32\n\
                sequence_len: 4096\nmicro_batch_size: 2\ngradient_accumulation_steps: 4\n";
    Arc::new(memguard_api::cluster::ConfigMapList(
        [(
            ("ml".to_string(), "axolotl".to_string()),
            [("lora-8b.yml".to_string(), text.to_string())].into(),
        )]
        .into(),
    ))
}

/// The controller resolves a pod with the cluster view admission has, ConfigMaps included:
/// a pod whose model is in a ConfigMap-mounted file gets the key admission gave it, and its
/// run (the trainer's report, its mismatch, the phase of its kill) lands in that profile.
#[tokio::test]
async fn a_pod_configured_from_a_config_map_is_recorded_under_admissions_key() {
    use memguard_api::phase::TrainerPhase;
    let mut s = summary(None, Some(15 * GIB), Some(16 * GIB));
    s.trainer_config = [("batch-size".into(), 2.0), ("seq-length".into(), 2048.0)].into();
    s.config_mismatch = vec!["seq-length".into()];
    s.oom_events = 1;
    s.oom_kill_phase = Some(TrainerPhase::Save);
    let pod = config_map_pod(&s);
    let objects = ClusterObjects {
        config_maps: Some(axolotl_config_maps()),
        ..ClusterObjects::default()
    };
    // Admission's key: the same reading with the same objects.
    let admitted =
        memguard_decide::pod_key(&pod, &Policy::default(), objects.cluster()).expect("key");
    assert_eq!(admitted.spec.model, "llama-3-8b");
    assert_eq!(admitted.spec.method, "lora");
    // Without the ConfigMaps the controller would have no key for it at all.
    assert!(matches!(
        crate::observe::try_observe(&pod, &Policy::default(), Cluster::default()),
        Err(NotObserved::NoKey(_))
    ));

    let name = admitted.name.clone();
    let item = format!("{PROFILES}/{name}");
    let mut existing = MemoryProfile::new(&name, admitted.spec.clone());
    existing.metadata.namespace = Some("ml".into());
    existing.metadata.resource_version = Some("3".into());
    let steps = vec![
        step(
            Method::GET,
            &item,
            StatusCode::OK,
            serde_json::to_value(&existing).expect("json"),
        ),
        step(
            Method::PATCH,
            &format!("{item}/status"),
            StatusCode::OK,
            serde_json::to_value(&existing).expect("json"),
        )
        .body(|body| {
            let status = &body["status"];
            assert_eq!(status["trainerReport"]["pod"], "train");
            assert_eq!(status["trainerReport"]["config"]["seq-length"], 2048.0);
            assert_eq!(status["trainerReport"]["mismatch"], json!(["seq-length"]));
            assert_eq!(status["oomKillPhases"]["save"], 1);
            assert_eq!(status["oomEvents"][0]["phase"], "save");
        }),
    ];
    let (client, handle) = client();
    let verifier = tokio::spawn(verify(handle, steps));
    let recorder = Recorder::new(client, Metrics::default()).with_cluster(objects);
    let out = recorder.record(&pod).await.expect("recorded");
    verifier.await.expect("scenario verified");
    assert_eq!(
        out,
        Recorded::Updated {
            profile: name,
            oom: true
        }
    );
}

/// A Guarded pod (its model not read at admission: a script whose only argument is a JSON
/// file), its trainer's report in the sidecar's summary: the controller creates the profile
/// under its launch key and patches the report in, over the API.
#[tokio::test]
async fn a_guarded_pods_report_is_recorded_under_its_launch_key() {
    let mut s = summary(Some(2 * GIB), None, Some(4 * GIB));
    s.trainer_config = memguard_decide::testutil::tiny_llama_report();
    let mut pod = PodBuilder::trainer()
        .memory_limit("4Gi")
        .trainer_terminated("Completed", 0, 100)
        .native_sidecar_done(&s)
        .build();
    let trainer = &mut pod.spec.as_mut().expect("spec").containers[0];
    trainer.image = Some("trainer:1".into());
    trainer.command = Some(vec![
        "python".into(),
        "train.py".into(),
        "/config/train.json".into(),
    ]);
    let launch = memguard_decide::key::launch_key(&pod, &memguard_api::Policy::default())
        .expect("a launch key");
    let name = launch.name.clone();
    let item = format!("{PROFILES}/{name}");
    let mut created = MemoryProfile::new(&name, launch.spec.clone());
    created.metadata.namespace = Some("ml".into());
    created.metadata.resource_version = Some("1".into());
    let created = serde_json::to_value(&created).expect("json");
    let want_key = serde_json::to_value(&launch.spec).expect("json");
    let steps = vec![
        step(
            Method::GET,
            &item,
            StatusCode::NOT_FOUND,
            status_error(404, "NotFound"),
        ),
        step(Method::POST, PROFILES, StatusCode::CREATED, created.clone()).body(move |body| {
            assert_eq!(body["spec"], want_key);
            assert_eq!(body["spec"]["method"], "unread");
        }),
        step(
            Method::PATCH,
            &format!("{item}/status"),
            StatusCode::OK,
            created,
        )
        .body(|body| {
            let status = &body["status"];
            assert_eq!(status["trainerReport"]["pod"], "trainer-0");
            assert_eq!(status["trainerReport"]["config"]["hidden-size"], 64.0);
            assert_eq!(status["trainerReport"]["config"]["vocab-size"], 32000.0);
            assert_eq!(status["runs"][0]["measuredPeakBytes"], 2 * GIB);
        }),
    ];
    let out = record(pod, steps).await.expect("recorded");
    assert_eq!(
        out,
        Recorded::Updated {
            profile: name,
            oom: false
        }
    );
}
