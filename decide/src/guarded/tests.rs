use super::*;
use crate::key::{CPU, KeyError, LAUNCH_PREFIX, MAX_NAME_LEN, NOT_READ, launch_key};
use crate::testutil::{at, tiny_llama_report};
use memguard_api::crd::DeviceClass;

/// The transformers examples' convention: a stock HF script whose only argument is a JSON file
/// shipped in a ConfigMap (admission cannot read the model from it), as a pod of job `job`.
fn json_pod(pod_name: &str, image: &str, config_map: &str, env: &[(&str, &str)]) -> Pod {
    let env: Vec<serde_json::Value> = env
        .iter()
        .map(|(n, v)| serde_json::json!({"name": n, "value": v}))
        .collect();
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod_name, "namespace": "ml", "uid": format!("uid-{pod_name}"),
                     "labels": {"memguard.io/enabled": "true"}},
        "spec": {
            "containers": [{
                "name": "trainer", "image": image,
                "command": ["python", "/job/train.py", "/config/train.json"],
                "env": env,
                "resources": {"limits": {"memory": "4Gi"}},
                "volumeMounts": [{"name": "cfg", "mountPath": "/config"}]
            }],
            "volumes": [{"name": "cfg", "configMap": {"name": config_map}}]
        }
    }))
    .expect("a pod")
}

fn report(config: BTreeMap<String, f64>) -> TrainerReport {
    TrainerReport {
        pod: "job-a-1".into(),
        uid: "uid-job-a-1".into(),
        finished_at: at(10),
        config,
        mismatch: Vec::new(),
    }
}

#[test]
fn two_pods_of_one_job_share_a_launch_key_and_other_launches_do_not() {
    let policy = Policy::default();
    let key = |pod: &Pod| launch_key(pod, &policy).expect("a key");
    let a = key(&json_pod("job-a-1", "trainer:1", "job-a", &[("SEED", "1")]));
    // Another pod of the same job: another name and UID, and what memguard writes into a
    // planned trainer (its `MEMGUARD_*` env, PYTHONPATH, the allocator setting).
    let again = key(&json_pod(
        "job-a-2",
        "trainer:1",
        "job-a",
        &[
            ("SEED", "1"),
            ("MEMGUARD_BATCH_SIZE", "4"),
            ("PYTHONPATH", "/memguard/client"),
            ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
        ],
    ));
    assert_eq!(a, again);
    assert!(a.spec.model.starts_with(LAUNCH_PREFIX), "{}", a.spec.model);
    assert_eq!(a.spec.model.len(), LAUNCH_PREFIX.len() + 16);
    assert_eq!(
        (a.spec.method.as_str(), a.spec.precision.as_str()),
        (NOT_READ, NOT_READ)
    );
    assert_eq!(
        (a.spec.device_class, a.spec.device.as_str()),
        (DeviceClass::Cpu, CPU)
    );
    assert_eq!(a.name, crate::object_name(&a.spec));
    assert!(a.name.len() <= MAX_NAME_LEN, "{}", a.name);
    assert!(
        a.identity.contains(&"configmap=job-a".to_string()),
        "{:?}",
        a.identity
    );
    // Another config, image or literal env is another job.
    for other in [
        json_pod("job-b-1", "trainer:1", "job-b", &[("SEED", "1")]),
        json_pod("job-a-1", "trainer:2", "job-a", &[("SEED", "1")]),
        json_pod("job-a-1", "trainer:1", "job-a", &[("SEED", "2")]),
    ] {
        let k = key(&other);
        assert_ne!(k.spec.model, a.spec.model, "{:?}", k.identity);
        assert_ne!(k.name, a.name);
    }
    // Another script is another job too.
    let mut script = json_pod("job-a-1", "trainer:1", "job-a", &[("SEED", "1")]);
    script.spec.as_mut().expect("spec").containers[0].command = Some(vec![
        "python".into(),
        "/job/other.py".into(),
        "/config/train.json".into(),
    ]);
    assert_ne!(key(&script).spec.model, a.spec.model);
}

#[test]
fn a_pod_without_a_trainer_has_no_launch_key() {
    let mut pod = json_pod("job-a-1", "trainer:1", "job-a", &[]);
    pod.spec.as_mut().expect("spec").containers.clear();
    assert!(matches!(
        launch_key(&pod, &Policy::default()),
        Err(KeyError::Trainer(_))
    ));
}

#[test]
fn a_guarded_pod_resolves_on_its_report_every_knob_from_the_report() {
    let pod = json_pod("job-a-2", "trainer:1", "job-a", &[("SEED", "1")]);
    let policy = Policy::default();
    let key = launch_key(&pod, &policy).expect("a key");
    let on = resolve_on_report(
        &pod,
        &policy,
        Cluster::default(),
        &key,
        &tiny_llama_report(),
        None,
    )
    .expect("planned on the report");
    // The one mapping the sidecar plans with at train start.
    let mapped = training_config(&tiny_llama_report()).expect("a config");
    assert_eq!(on.training.config, mapped);
    assert_eq!(on.key.config, mapped);
    assert_eq!(
        (on.key.spec.clone(), on.key.name.clone()),
        (key.spec, key.name)
    );
    assert!(on.training.unknown.is_empty() && on.training.guessed().is_empty());
    assert!(on.training.args.is_none() && on.training.config_file.is_none());
    let knobs = Knob::of(&on.training.config);
    assert!(!knobs.is_empty());
    for knob in knobs {
        assert_eq!(
            on.training.reported.get(&knob).map(String::as_str),
            Some(PROVENANCE),
            "{knob:?}"
        );
    }
    assert_eq!(
        on.training.memory_limit.map(|b| b.0),
        Some(4 << 30),
        "the pod's own limit, for the budget"
    );
}

#[test]
fn a_report_missing_a_shape_value_is_not_planned_and_says_which() {
    let pod = json_pod("job-a-2", "trainer:1", "job-a", &[]);
    let policy = Policy::default();
    let key = launch_key(&pod, &policy).expect("a key");
    let mut knobs = tiny_llama_report();
    knobs.remove("num-kv-heads");
    let planned = on_profile_report(
        &pod,
        &policy,
        Cluster::default(),
        &key,
        Some(&report(knobs)),
        None,
    );
    let Planned::Incomplete { pod: by, why } = planned else {
        panic!("planned on an incomplete report: {planned:?}");
    };
    assert!(why.contains("not reported: num-kv-heads"), "{why}");
    assert_eq!(by, "job-a-1");
    assert_eq!(
        on_profile_report(&pod, &policy, Cluster::default(), &key, None, None),
        Planned::NoReport
    );
    let full = on_profile_report(
        &pod,
        &policy,
        Cluster::default(),
        &key,
        Some(&report(tiny_llama_report())),
        None,
    );
    assert!(matches!(full, Planned::OnReport(..)), "{full:?}");
}
