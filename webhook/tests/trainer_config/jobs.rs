//! Every pod of a job gets the same rewrite (issue 27): a PyTorchJob's master and workers, a
//! JobSet's pods and an indexed Job's pods are built from fixture manifests as their
//! controllers build them, each is admitted through the webhook's review, and the trainer's
//! rewritten command line, env (rank-specific variables aside) and estimate are the same in
//! every pod, with the job's world size.
//!
//! The controllers, read at a pinned commit:
//! - Kubeflow training-operator v1.9.0 (6f74c7f6b2ed6c27aabd82d0a316b23f0646059c):
//!   `pkg/controller.v1/common/pod.go` `createNewPod` (name `<job>-<type>-<index>`, labels),
//!   `pkg/controller.v1/pytorch/envvar.go` `setPodEnv` (PYTHONUNBUFFERED, MASTER_*, PET_*,
//!   WORLD_SIZE, RANK), `master.go`, `initcontainer.go` (workers wait for the master).
//! - JobSet (kubernetes-sigs/jobset 08dfbdfd682714a9ab929633eca8dc95315187e7):
//!   `pkg/controllers/jobset_controller.go` `constructJob` / `labelAndAnnotateObject`.
//! - The Kubernetes Job controller, `pkg/controller/job/indexed_job_utils.go`: the completion
//!   index as annotation and label, `JOB_COMPLETION_INDEX` from it, hostname `<job>-<index>`.

use memguard_api::{Policy, PolicySpec};
use memguard_webhook::mutate::ClusterView;
use serde_json::{Value, json};
use std::path::Path;

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/jobs")
        .join(name);
    let text = std::fs::read_to_string(path).expect("fixture");
    serde_saphyr::from_str(&text).expect("fixture YAML")
}

fn pod_of(template: &Value, name: &str, namespace: &str) -> Value {
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": template["metadata"].clone(),
        "spec": template["spec"].clone(),
    });
    if pod["metadata"].is_null() {
        pod["metadata"] = json!({});
    }
    pod["metadata"]["name"] = json!(name);
    pod["metadata"]["namespace"] = json!(namespace);
    pod
}

fn label(pod: &mut Value, key: &str, value: &str) {
    if pod["metadata"]["labels"].is_null() {
        pod["metadata"]["labels"] = json!({});
    }
    pod["metadata"]["labels"][key] = json!(value);
}

fn annotate(pod: &mut Value, key: &str, value: &str) {
    if pod["metadata"]["annotations"].is_null() {
        pod["metadata"]["annotations"] = json!({});
    }
    pod["metadata"]["annotations"][key] = json!(value);
}

fn add_env(containers: &mut Value, env: &[Value]) {
    for c in containers.as_array_mut().into_iter().flatten() {
        if c["env"].is_null() {
            c["env"] = json!([]);
        }
        let list = c["env"].as_array_mut().expect("env");
        list.extend(env.iter().cloned());
    }
}

/// The pods of a PyTorchJob, as training-operator v1.9.0 creates them.
fn pytorchjob_pods(job: &Value) -> Vec<Value> {
    let name = job["metadata"]["name"].as_str().expect("name");
    let ns = job["metadata"]["namespace"].as_str().expect("namespace");
    let specs = &job["spec"]["pytorchReplicaSpecs"];
    let nproc = job["spec"]["nprocPerNode"].as_str();
    let replicas = |t: &str| specs[t]["replicas"].as_u64().unwrap_or(0);
    let total = replicas("Master") + replicas("Worker");
    let world = total * nproc.and_then(|n| n.parse().ok()).unwrap_or(1);
    let master = format!("{name}-master-0");
    let port = specs["Master"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
        .as_u64()
        .expect("the master's port");
    let mut pods = Vec::new();
    for rtype in ["Master", "Worker"] {
        let lower = rtype.to_lowercase();
        for index in 0..replicas(rtype) {
            let mut pod = pod_of(
                &specs[rtype]["template"],
                &format!("{name}-{lower}-{index}"),
                ns,
            );
            label(
                &mut pod,
                "training.kubeflow.org/operator-name",
                "pytorchjob-controller",
            );
            label(&mut pod, "training.kubeflow.org/job-name", name);
            label(&mut pod, "training.kubeflow.org/replica-type", &lower);
            label(
                &mut pod,
                "training.kubeflow.org/replica-index",
                &index.to_string(),
            );
            if rtype == "Master" {
                label(&mut pod, "training.kubeflow.org/job-role", "master");
            }
            let rank = if rtype == "Worker" { index + 1 } else { index };
            let mut env = vec![
                json!({"name": "PYTHONUNBUFFERED", "value": "1"}),
                json!({"name": "MASTER_PORT", "value": port.to_string()}),
                json!({"name": "PET_MASTER_PORT", "value": port.to_string()}),
                json!({"name": "MASTER_ADDR", "value": master}),
                json!({"name": "PET_MASTER_ADDR", "value": master}),
                json!({"name": "WORLD_SIZE", "value": world.to_string()}),
                json!({"name": "RANK", "value": rank.to_string()}),
                json!({"name": "PET_NODE_RANK", "value": rank.to_string()}),
            ];
            if let Some(n) = nproc {
                env.push(json!({"name": "PET_NPROC_PER_NODE", "value": n}));
            }
            env.push(json!({"name": "PET_NNODES", "value": total.to_string()}));
            add_env(&mut pod["spec"]["containers"], &env);
            if rtype == "Worker" {
                pod["spec"]["initContainers"] = json!([{
                    "name": "init-pytorch",
                    "image": "alpine:3.10",
                    "imagePullPolicy": "IfNotPresent",
                    "resources": {"limits": {"cpu": "100m", "memory": "20Mi"},
                                  "requests": {"cpu": "50m", "memory": "10Mi"}},
                    "command": ["sh", "-c", format!(
                        "err=1;for i in $(seq 100); do if nslookup {master}; then err=0 && break; \
                         fi;echo waiting for master; sleep 2; done; exit $err")],
                }]);
            }
            pod["spec"]["restartPolicy"] = specs[rtype]["restartPolicy"].clone();
            pods.push(pod);
        }
    }
    pods
}

/// The pods of an indexed Job, as the Job controller creates them.
fn indexed_job_pods(job_name: &str, ns: &str, job_spec: &Value) -> Vec<Value> {
    let completions = job_spec["completions"].as_u64().expect("completions");
    let key = "batch.kubernetes.io/job-completion-index";
    (0..completions)
        .map(|index| {
            let mut pod = pod_of(
                &job_spec["template"],
                &format!("{job_name}-{index}-x7k2p"),
                ns,
            );
            annotate(&mut pod, key, &index.to_string());
            label(&mut pod, key, &index.to_string());
            for k in ["batch.kubernetes.io/job-name", "job-name"] {
                label(&mut pod, k, job_name);
            }
            for k in ["batch.kubernetes.io/controller-uid", "controller-uid"] {
                label(&mut pod, k, "5d6f0d3e-9c1a-4f3e-8f7a-2b1c0d9e8f7a");
            }
            for list in ["initContainers", "containers"] {
                add_env(
                    &mut pod["spec"][list],
                    &[
                        json!({"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
                        "fieldPath": format!("metadata.labels['{key}']")}}}),
                    ],
                );
            }
            if pod["spec"]["subdomain"].is_string() {
                pod["spec"]["hostname"] = json!(format!("{job_name}-{index}"));
            }
            pod
        })
        .collect()
}

/// The pods of a JobSet: each replicated Job's Jobs (labelled and annotated by JobSet), then
/// their indexed pods.
fn jobset_pods(jobset: &Value) -> Vec<Value> {
    let name = jobset["metadata"]["name"].as_str().expect("name");
    let ns = jobset["metadata"]["namespace"].as_str().expect("namespace");
    let mut pods = Vec::new();
    for rjob in jobset["spec"]["replicatedJobs"].as_array().expect("jobs") {
        let rname = rjob["name"].as_str().expect("name");
        let replicas = rjob["replicas"].as_u64().unwrap_or(1);
        for job_index in 0..replicas {
            let job_name = format!("{name}-{rname}-{job_index}");
            let mut spec = rjob["template"]["spec"].clone();
            let mut template = json!({"metadata": spec["template"]["metadata"].clone(),
                                      "spec": spec["template"]["spec"].clone()});
            for (k, v) in [
                ("jobset.sigs.k8s.io/jobset-name", name.to_string()),
                (
                    "jobset.sigs.k8s.io/jobset-uid",
                    "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0".into(),
                ),
                ("jobset.sigs.k8s.io/replicatedjob-name", rname.to_string()),
                ("jobset.sigs.k8s.io/restart-attempt", "0".into()),
                (
                    "jobset.sigs.k8s.io/replicatedjob-replicas",
                    replicas.to_string(),
                ),
                ("jobset.sigs.k8s.io/global-replicas", replicas.to_string()),
                ("jobset.sigs.k8s.io/job-index", job_index.to_string()),
                (
                    "jobset.sigs.k8s.io/job-key",
                    format!("{:040x}", job_index + 0xabc),
                ),
                ("jobset.sigs.k8s.io/job-global-index", job_index.to_string()),
                ("jobset.sigs.k8s.io/group-name", "default".into()),
                ("jobset.sigs.k8s.io/group-replicas", replicas.to_string()),
                ("jobset.sigs.k8s.io/job-group-index", job_index.to_string()),
            ] {
                label(&mut template, k, &v);
                annotate(&mut template, k, &v);
            }
            // enableDNSHostnames (the default): the JobSet's name is the pods' subdomain.
            template["spec"]["subdomain"] = json!(name);
            spec["template"] = template;
            pods.extend(indexed_job_pods(&job_name, ns, &spec));
        }
    }
    pods
}

/// What the webhook makes of one pod: the pod after its patch.
fn admit(pod: &Value) -> Value {
    let policy: Policy = serde_json::from_value::<PolicySpec>(json!({}))
        .expect("policy")
        .resolved()
        .expect("valid");
    let (out, warnings) = super::admitted(pod, &policy, &ClusterView::default());
    eprintln!("{}: {warnings:?}", pod["metadata"]["name"]);
    out
}

/// The variables that differ between a job's pods by design.
const RANK_SPECIFIC: &[&str] = &["RANK", "PET_NODE_RANK", "JOB_COMPLETION_INDEX"];

/// The trainer as the webhook left it, rank-specific variables removed.
fn trainer_of(pod: &Value, name: &str) -> Value {
    let mut trainer = pod["spec"]["containers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .cloned()
        .expect("the trainer");
    if let Some(env) = trainer["env"].as_array_mut() {
        env.retain(|e| !RANK_SPECIFIC.contains(&e["name"].as_str().unwrap_or_default()));
    }
    trainer
}

fn estimate(pod: &Value) -> Value {
    let text = pod["metadata"]["annotations"]["memguard.io/estimate"]
        .as_str()
        .expect("an estimate");
    serde_json::from_str(text).expect("JSON")
}

/// Every pod gets the same trainer and the same estimate, its args are rewritten (the job does
/// not fit as written), and the world size is the job's, read from where `source` says.
fn same_rewrite(pods: &[Value], trainer: &str, world_size: u64, source: &str) {
    assert!(pods.len() >= 2, "a multi-pod job");
    let admitted: Vec<Value> = pods.iter().map(admit).collect();
    let first = &admitted[0];
    let before = trainer_of(&pods[0], trainer);
    let after = trainer_of(first, trainer);
    assert_ne!(
        (&before["command"], &before["args"]),
        (&after["command"], &after["args"]),
        "the job does not fit as written: its command line is rewritten"
    );
    let e = estimate(first);
    assert_eq!(e["config"]["world-size"], world_size.to_string(), "{e}");
    assert_eq!(e["sources"]["world-size"], source, "{e}");
    // Sharded as the launch says (`--fsdp full_shard`, `accelerate launch --use_fsdp`), with
    // only the opt-in label.
    assert_eq!(e["sources"]["parallelism"], "args", "{e}");
    assert_eq!(e["fits"], true, "planned into the GPU: {e}");
    for (pod, out) in pods.iter().zip(&admitted).skip(1) {
        let name = &pod["metadata"]["name"];
        assert_eq!(
            trainer_of(out, trainer),
            after,
            "{name}: the trainer differs"
        );
        assert_eq!(estimate(out), e, "{name}: the estimate differs");
        // Rank-specific variables are kept as the controller set them.
        assert_eq!(
            out["spec"]["containers"].as_array().map(|cs| cs
                .iter()
                .filter(|c| c["name"] == trainer)
                .flat_map(|c| c["env"].as_array().cloned().unwrap_or_default())
                .filter(|e| RANK_SPECIFIC.contains(&e["name"].as_str().unwrap_or_default()))
                .collect::<Vec<_>>()),
            pod["spec"]["containers"].as_array().map(|cs| cs
                .iter()
                .filter(|c| c["name"] == trainer)
                .flat_map(|c| c["env"].as_array().cloned().unwrap_or_default())
                .filter(|e| RANK_SPECIFIC.contains(&e["name"].as_str().unwrap_or_default()))
                .collect::<Vec<_>>()),
            "{name}"
        );
    }
    // A second admission of each pod changes nothing.
    for out in &admitted {
        assert_eq!(&admit(out), out, "idempotent");
    }
}

#[test]
fn a_pytorchjobs_master_and_workers_get_the_same_rewrite_at_the_jobs_world_size() {
    let pods = pytorchjob_pods(&fixture("pytorchjob.yaml"));
    assert_eq!(pods.len(), 3);
    // 3 nodes × 8 processes, from the operator's PET_NNODES and PET_NPROC_PER_NODE.
    same_rewrite(&pods, "pytorch", 24, "env:PET_NNODES");
}

#[test]
fn a_jobsets_pods_get_the_same_rewrite_at_the_jobs_world_size() {
    let pods = jobset_pods(&fixture("jobset.yaml"));
    assert_eq!(pods.len(), 2);
    // torchrun --nnodes=2 --nproc_per_node=8.
    same_rewrite(&pods, "pytorch", 16, "args");
}

#[test]
fn an_indexed_jobs_pods_get_the_same_rewrite_at_the_jobs_world_size() {
    let job = fixture("indexed-job.yaml");
    let pods = indexed_job_pods(
        job["metadata"]["name"].as_str().expect("name"),
        "ml",
        &job["spec"],
    );
    // accelerate launch --num_processes 16 (across --num_machines 2).
    same_rewrite(&pods, "trainer", 16, "args");
}
