//! `memguard explain` through the real binary, on one Job's pods: admitted by `memguard mutate`,
//! dead of a CUDA OOM (the client's record as termination message, the sidecar's summary), the
//! next pod admitted one step down from the profile's recovery, and that pod succeeding.

use serde_json::{Value, json};
use std::path::Path;
use std::process::{Command, Output};

const POD: &str = r#"
apiVersion: v1
kind: Pod
metadata:
  name: finetune-0
  namespace: ml
  labels: {memguard.io/enabled: "true"}
  annotations:
    memguard.io/model: llama-3-8b
    memguard.io/method: lora
    memguard.io/batch-size: "16"
    memguard.io/seq-length: "2048"
    memguard.io/gpu-memory: "80GiB"
spec:
  restartPolicy: Never
  containers: [{name: trainer, image: x, resources: {limits: {nvidia.com/gpu: "1"}}}]
"#;

fn memguard(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memguard"))
        .current_dir(dir)
        .args(args)
        .output()
        .expect("the memguard binary runs")
}

fn ok_stdout(out: Output) -> String {
    assert!(
        out.status.success(),
        "memguard failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// `memguard mutate` of `pod` (with `profile`), as JSON.
fn admit(dir: &Path, pod: &str, profile: Option<&str>) -> Value {
    std::fs::write(dir.join("pod.yaml"), pod).expect("write");
    let mut args = vec!["mutate", "-o", "json", "-f", "pod.yaml"];
    if let Some(p) = profile {
        std::fs::write(dir.join("profile.yaml"), p).expect("write");
        args.extend(["--profile", "profile.yaml"]);
    }
    serde_json::from_str(&ok_stdout(memguard(dir, &args))).expect("json")
}

fn env_of(pod: &Value, name: &str) -> String {
    pod["spec"]["containers"][0]["env"]
        .as_array()
        .and_then(|a| a.iter().find(|e| e["name"] == name))
        .and_then(|e| e["value"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// The pod as the API server reports it after its run: trainer and native sidecar terminated.
fn finished(mut pod: Value, trainer: Value, summary: Value, phase: &str) -> Value {
    pod["status"] = json!({
        "phase": phase,
        "containerStatuses": [{"name": "trainer", "image": "x", "imageID": "", "ready": false,
            "restartCount": 0, "state": {"terminated": trainer}}],
        "initContainerStatuses": [{"name": "memguard-sidecar", "image": "x", "imageID": "",
            "ready": false, "restartCount": 0, "state": {"terminated": {"exitCode": 0,
            "reason": "Completed", "message": summary.to_string(),
            "finishedAt": "2026-11-23T22:10:05Z"}}}]
    });
    pod
}

fn explain(dir: &Path, pod: &Value, output: &str) -> String {
    std::fs::write(dir.join("status.json"), pod.to_string()).expect("write");
    ok_stdout(memguard(
        dir,
        &["explain", "-f", "status.json", "-o", output],
    ))
}

#[test]
fn one_job_through_a_cuda_oom_a_recovery_and_a_success() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();

    // 1. Admitted: annotated batch 16 fits 80 GiB with checkpointing at batch 8 × 2.
    let first = admit(d, POD, None);
    assert_eq!(env_of(&first, "MEMGUARD_BATCH_SIZE"), "8");
    assert_eq!(env_of(&first, "MEMGUARD_GRAD_ACCUMULATION"), "2");
    assert_eq!(
        first["spec"]["containers"][0]["terminationMessagePolicy"],
        "FallbackToLogsOnError"
    );

    // 2. It dies of a CUDA OOM at step 412: the client's record, exit 86; the sidecar's summary.
    let record = json!({"version": 1, "kind": "cuda_oom", "outcome": "fatal", "step": 412,
        "batch_size": 8, "grad_accumulation": 2, "grad_checkpointing": true,
        "allocated_bytes": 79_000_000_000u64, "requested_bytes": 2_147_483_648u64,
        "message": "CUDA out of memory. Tried to allocate 2.00 GiB.",
        "timestamp": "2026-11-23T22:10:00.000Z"});
    let summary = json!({"version": 1, "gpu_peak_bytes": 84_000_000_000u64, "downgrades": 1,
        "oom_events": 0, "max_level": "critical", "batch_size": 4, "grad_accumulation": 4,
        "sticky_batch_size": 4, "oom_reports": 1, "last_oom": record, "exit_reason": "trainer-exited"});
    let trainer = json!({"exitCode": 86, "reason": "Error", "message": record.to_string(),
        "finishedAt": "2026-11-23T22:10:00Z"});
    let dead = finished(first, trainer, summary, "Failed");
    let table = explain(d, &dead, "table");
    eprintln!("--- explain, pod 1 ---\n{table}");
    let e: Value = serde_json::from_str(&explain(d, &dead, "json")).expect("json");
    assert_eq!(e["ooms"][0]["reason"], "CudaOOM");
    assert_eq!(e["ooms"][0]["record"]["requested_bytes"], 2_147_483_648u64);
    assert_eq!(e["run"]["gpu_peak_bytes"], 84_000_000_000u64);
    assert_eq!(e["run"]["downgrades"], 1);
    assert_eq!(e["budget"]["bytes"].as_u64().map(|b| b > 0), Some(true));
    assert!(
        e["estimate"]["components"]
            .as_object()
            .is_some_and(|c| !c.is_empty())
    );
    assert_eq!(e["next"]["verdict"], "one step down");
    assert_eq!(e["steps"], json!(["grad-checkpointing", "halve-batch"]));
    assert_eq!(e["budget"]["source"], "annotation");
    assert_eq!(e["next"]["config"]["batchSize"], 4, "{}", e["next"]);
    assert_eq!(e["next"]["config"]["gradAccumulation"], 4, "{}", e["next"]);
    assert!(
        table.contains("CudaOOM (exit 86), fatal cuda_oom at step 412, batch 8"),
        "{table}"
    );
    assert!(table.contains("failed request 2.00 GiB"), "{table}");

    // 3. The profile controller records that recovery; the next pod is admitted from it.
    let profile = format!(
        "apiVersion: memguard.io/v1alpha1\nkind: MemoryProfile\nmetadata: {{name: llama-3-8b-lora-bf16-mixed-gpu, namespace: ml}}\nspec: {{model: llama-3-8b, method: lora, precision: bf16-mixed, deviceClass: gpu, device: gpu}}\nstatus:\n  recovery: {{rungs: 1, config: {}, reason: {}}}\n",
        e["next"]["config"], e["next"]["reason"]
    );
    let second = admit(d, &POD.replace("finetune-0", "finetune-1"), Some(&profile));
    assert_eq!(env_of(&second, "MEMGUARD_BATCH_SIZE"), "4");
    assert_eq!(
        env_of(&second, "MEMGUARD_GRAD_ACCUMULATION"),
        "4",
        "effective batch kept"
    );

    // 4. It succeeds.
    let summary = json!({"version": 1, "gpu_peak_bytes": 61_000_000_000u64, "downgrades": 0,
        "oom_events": 0, "max_level": "ok", "batch_size": 4, "grad_accumulation": 4,
        "exit_reason": "trainer-exited"});
    let trainer =
        json!({"exitCode": 0, "reason": "Completed", "finishedAt": "2026-11-23T23:00:00Z"});
    let done = finished(second, trainer, summary, "Succeeded");
    let table = explain(d, &done, "table");
    eprintln!("--- explain, pod 2 ---\n{table}");
    let e: Value = serde_json::from_str(&explain(d, &done, "json")).expect("json");
    assert_eq!(e["ooms"], json!([]));
    assert!(
        e["admitted_after"]
            .as_str()
            .is_some_and(|r| r.contains("CudaOOM")),
        "{e}"
    );
    assert_eq!(e["config"]["batch-size"], "4");
    assert_eq!(e["next"]["verdict"], "same");
}

#[test]
fn a_file_that_is_not_a_pod_is_a_usage_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("x.yaml"), "kind: [unclosed").expect("write");
    let out = memguard(dir.path(), &["explain", "-f", "x.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a pod manifest"));
}
