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
    memguard.io/grad-checkpointing: "true"
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

/// `memguard explain` of `pod` with `extra` flags, as JSON.
fn explain_json(dir: &Path, pod: &Value, extra: &[&str]) -> Value {
    std::fs::write(dir.join("status.json"), pod.to_string()).expect("write");
    let mut args = vec!["explain", "-f", "status.json", "-o", "json"];
    args.extend(extra);
    serde_json::from_str(&ok_stdout(memguard(dir, &args))).expect("json")
}

/// The `MemoryProfile` manifest the controller leaves after the pod `explain` described (its
/// `next.profile`), as `kubectl get memoryprofile -o yaml` would give it.
fn profile_after(e: &Value) -> String {
    let p = &e["next"]["profile"];
    json!({
        "apiVersion": "training.memguard.io/v1alpha1",
        "kind": "MemoryProfile",
        "metadata": {"name": p["name"], "namespace": "ml"},
        "spec": p["spec"],
        "status": p["status"],
    })
    .to_string()
}

/// One step of the walkthrough, for a person: the pod's memguard annotations and knobs, and the
/// profile status after it (`cargo test -p memguard --test explain -- --nocapture`).
fn show(step: &str, pod: &Value, e: Option<&Value>) {
    let annotations = &pod["metadata"]["annotations"];
    eprintln!("=== {step}");
    for key in ["memguard.io/estimate", "memguard.io/error"] {
        if let Some(v) = annotations[key].as_str() {
            eprintln!("  {key}: {v}");
        }
    }
    let knobs: Vec<String> = [
        "MEMGUARD_BATCH_SIZE",
        "MEMGUARD_GRAD_ACCUMULATION",
        "MEMGUARD_GRAD_CHECKPOINTING",
        "MEMGUARD_CANNOT_FIT",
    ]
    .iter()
    .filter(|k| !env_of(pod, k).is_empty())
    .map(|k| format!("{k}={}", env_of(pod, k)))
    .collect();
    eprintln!("  trainer env: {}", knobs.join(" "));
    if let Some(e) = e {
        eprintln!(
            "  next pod: {} — {}",
            e["next"]["verdict"], e["next"]["reason"]
        );
        eprintln!("  MemoryProfile status: {}", e["next"]["profile"]["status"]);
    }
}

#[test]
fn one_job_through_a_cuda_oom_a_recovery_and_a_success() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();

    // 1. Admitted: annotated batch 16 with checkpointing fits 80 GiB at batch 8 × 2.
    let first = admit(d, POD, None);
    show("1. pod finetune-0 admitted (no profile yet)", &first, None);
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
    eprintln!("--- memguard explain, pod finetune-0 ---\n{table}");
    let e = explain_json(d, &dead, &[]);
    show(
        "2. finetune-0 died of a CUDA OOM (exit 86)",
        &dead,
        Some(&e),
    );
    // Every item of the explanation: breakdown, budget and source, steps, measured peak,
    // run-time downgrades, the OOM and its kind, the next pod.
    assert!(
        e["estimate"]["components"]
            .as_object()
            .is_some_and(|c| !c.is_empty())
    );
    assert_eq!(e["budget"]["bytes"].as_u64().map(|b| b > 0), Some(true));
    assert_eq!(e["budget"]["source"], "annotation");
    assert_eq!(e["steps"], json!(["halve-batch"]));
    assert_eq!(e["run"]["gpu_peak_bytes"], 84_000_000_000u64);
    assert_eq!(e["run"]["downgrades"], 1);
    assert_eq!(e["ooms"][0]["reason"], "CudaOOM");
    assert_eq!(e["ooms"][0]["record"]["kind"], "cuda_oom");
    assert_eq!(e["ooms"][0]["record"]["requested_bytes"], 2_147_483_648u64);
    assert_eq!(e["next"]["verdict"], "one step down");
    assert_eq!(e["next"]["config"]["batchSize"], 4, "{}", e["next"]);
    assert_eq!(e["next"]["config"]["gradAccumulation"], 4, "{}", e["next"]);
    assert_eq!(e["next"]["profile"]["status"]["oomRecoveries"], 1);
    for needle in [
        "CudaOOM (exit 86), fatal cuda_oom at step 412, batch 8",
        "failed request 2.00 GiB",
        "admission steps",
        "runtime downgrades",
        &format!("{:<22} 1", "ooms in a row"),
    ] {
        assert!(table.contains(needle), "`{needle}` in\n{table}");
    }

    // 3. The controller records it; the next pod is admitted from that profile, one step down.
    let profile = profile_after(&e);
    let second = admit(d, &POD.replace("finetune-0", "finetune-1"), Some(&profile));
    show("3. pod finetune-1 admitted from the profile", &second, None);
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
    std::fs::write(d.join("profile.yaml"), &profile).expect("write");
    let e = explain_json(d, &done, &["--profile", "profile.yaml"]);
    let table = ok_stdout(memguard(
        d,
        &["explain", "-f", "status.json", "--profile", "profile.yaml"],
    ));
    show("4. finetune-1 succeeded", &done, Some(&e));
    eprintln!("--- memguard explain --profile, pod finetune-1 ---\n{table}");
    assert_eq!(e["ooms"], json!([]));
    assert!(
        e["admitted_after"]
            .as_str()
            .is_some_and(|r| r.contains("CudaOOM")),
        "{e}"
    );
    assert_eq!(e["config"]["batch-size"], "4");
    assert_eq!(e["next"]["verdict"], "same");
    assert_eq!(e["next"]["config"]["batchSize"], 4, "the recovery stays");
    assert!(
        table.contains("pod finetune-1") && table.contains("(after this pod)"),
        "{table}"
    );
    let status = &e["next"]["profile"]["status"];
    assert_eq!(status["runCount"], 2);
    assert!(
        status.get("oomRecoveries").is_none(),
        "a success resets it: {status}"
    );
    assert!(status.get("verdict").is_none(), "{status}");
}

#[test]
fn repeated_ooms_reach_the_policy_limit_and_the_next_pod_is_told_it_cannot_fit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(d.join("policy.yaml"), "maxOomRecoveries: 1\n").expect("write");
    let mut profile: Option<String> = None;
    let mut batches = Vec::new();
    for (i, finished_at) in ["2026-11-23T22:00:00Z", "2026-11-23T22:30:00Z"]
        .iter()
        .enumerate()
    {
        let name = format!("finetune-{i}");
        let pod = admit(d, &POD.replace("finetune-0", &name), profile.as_deref());
        let batch: u64 = env_of(&pod, "MEMGUARD_BATCH_SIZE").parse().expect("batch");
        batches.push(batch);
        let trainer = json!({"exitCode": 1, "reason": "Error", "finishedAt": finished_at,
            "message": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB."});
        let summary = json!({"version": 1, "downgrades": 0, "oom_events": 0, "max_level": "ok",
            "batch_size": batch, "grad_accumulation": 1, "exit_reason": "trainer-exited"});
        let dead = finished(pod, trainer, summary, "Failed");
        let mut extra = vec!["--policy-file", "policy.yaml"];
        if profile.is_some() {
            extra.extend(["--profile", "profile.yaml"]);
        }
        let e = explain_json(d, &dead, &extra);
        assert_eq!(e["ooms"][0]["reason"], "CudaOOM", "a traceback is an OOM");
        profile = Some(profile_after(&e));
        std::fs::write(
            d.join("profile.yaml"),
            profile.as_deref().unwrap_or_default(),
        )
        .expect("write");
        if i == 1 {
            assert_eq!(e["next"]["verdict"], "cannot fit", "{}", e["next"]);
            let error = e["next"]["error"].as_str().unwrap_or_default();
            assert!(
                error.starts_with(
                    "cannot fit: 2 OOMs in a row (limit 1); smallest config tried: batch 4 × "
                ),
                "{error}"
            );
        }
    }
    assert_eq!(batches, [8, 4], "one step down after the first OOM");
    // The third pod: no further step down, the verdict as its error, MEMGUARD_CANNOT_FIT.
    let third = admit(
        d,
        &POD.replace("finetune-0", "finetune-2"),
        profile.as_deref(),
    );
    assert_eq!(env_of(&third, "MEMGUARD_BATCH_SIZE"), "4");
    assert_eq!(env_of(&third, "MEMGUARD_CANNOT_FIT"), "true");
    let error = third["metadata"]["annotations"]["memguard.io/error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        error.starts_with("cannot fit: 2 OOMs in a row (limit 1)"),
        "{error}"
    );
}

#[test]
fn a_bad_profile_or_policy_is_a_usage_error_that_names_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(d.join("pod.yaml"), POD).expect("write");
    let other_key = "apiVersion: training.memguard.io/v1alpha1\nkind: MemoryProfile\nmetadata: {name: x}\nspec: {model: llama-3-70b, method: lora, precision: bf16-mixed, deviceClass: gpu, device: gpu}\n";
    // (file name, contents, flag, expected in stderr)
    let table = [
        (
            "garbage.yaml",
            "status: [unclosed",
            "--profile",
            "garbage.yaml: not valid YAML",
        ),
        (
            "pod-as-profile.yaml",
            POD,
            "--profile",
            "pod-as-profile.yaml: not a MemoryProfile",
        ),
        ("other.yaml", other_key, "--profile", "but the pod's key is"),
        ("missing.yaml", "", "--profile", "reading missing.yaml"),
        (
            "policy.yaml",
            "maxOomRecoveries: 99\n",
            "--policy-file",
            "maxOomRecoveries: 99 is more than 20",
        ),
    ];
    for (file, contents, flag, want) in table {
        if file != "missing.yaml" {
            std::fs::write(d.join(file), contents).expect("write");
        }
        let out = memguard(d, &["explain", "-f", "pod.yaml", flag, file]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{file}: {stderr}");
        assert!(stderr.contains(want), "{file}: `{want}` in {stderr}");
    }
}

#[test]
fn a_file_that_is_not_a_pod_is_a_usage_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("x.yaml"), "kind: [unclosed").expect("write");
    let out = memguard(dir.path(), &["explain", "-f", "x.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("x.yaml: not valid YAML or JSON"),
        "{stderr}"
    );
    // Nothing explain takes: no YAML library's hint, but what explain reads.
    let service = "apiVersion: v1\nkind: Service\nmetadata: {name: s}\n---\n\
                   apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n";
    std::fs::write(dir.path().join("svc.yaml"), service).expect("write");
    let out = memguard(dir.path(), &["explain", "-f", "svc.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no Pod and no workload with a pod template in the input"),
        "{stderr}"
    );
    assert!(!stderr.contains("from_str_multiple"), "{stderr}");
    // Several pods: each explained in turn, headed by where it is; JSON: an array.
    let two = format!("{POD}---\n{POD}");
    std::fs::write(dir.path().join("two.yaml"), two).expect("write");
    let text = ok_stdout(memguard(dir.path(), &["explain", "-f", "two.yaml"]));
    assert!(text.starts_with("== document 1\npod finetune-0"), "{text}");
    assert!(text.contains("\n\n== document 2\npod finetune-0"), "{text}");
    let json: Value = serde_json::from_str(&ok_stdout(memguard(
        dir.path(),
        &["explain", "-f", "two.yaml", "-o", "json"],
    )))
    .expect("json");
    assert_eq!(json.as_array().map(Vec::len), Some(2), "{json}");
}

/// A model only the policy knows: `explain --policy-file` keys the pod on it and learns from its
/// OOM as the controller would; without the policy file the pod has no key.
#[test]
fn a_model_the_policy_adds_is_keyed_and_learned_under_its_policy_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let fixture =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../webhook/tests/fixtures/policy-models.yaml");
    std::fs::copy(fixture, d.join("policy.yaml")).expect("copy");
    std::fs::write(
        d.join("pod.yaml"),
        POD.replace("llama-3-8b", "acme-coder-7b"),
    )
    .expect("write");
    let pod: Value = serde_json::from_str(&ok_stdout(memguard(
        d,
        &[
            "mutate",
            "-o",
            "json",
            "-f",
            "pod.yaml",
            "--policy-file",
            "policy.yaml",
        ],
    )))
    .expect("json");
    let batch: u64 = env_of(&pod, "MEMGUARD_BATCH_SIZE").parse().expect("batch");
    let trainer = json!({"exitCode": 1, "reason": "Error", "finishedAt": "2026-11-23T22:00:00Z",
        "message": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB."});
    let summary = json!({"version": 1, "downgrades": 0, "oom_events": 0, "max_level": "ok",
        "batch_size": batch, "grad_accumulation": 1, "exit_reason": "trainer-exited"});
    let dead = finished(pod, trainer, summary, "Failed");
    let e = explain_json(d, &dead, &["--policy-file", "policy.yaml"]);
    assert_eq!(
        e["next"]["profile"]["spec"]["model"], "acme-coder-7b",
        "{e}"
    );
    assert_eq!(e["ooms"][0]["reason"], "CudaOOM", "{e}");
    assert_eq!(e["next"]["profile"]["status"]["oomRecoveries"], 1, "{e}");
    let without = explain_json(d, &dead, &[]).to_string();
    assert!(
        without.contains("unknown model `acme-coder-7b`"),
        "{without}"
    );
}

/// A stock launch (issue 27): `memguard mutate` rewrites the trainer's own flags, and
/// `memguard explain` says where each knob came from, what the trainer had, and which flags
/// were rewritten.
#[test]
fn explain_names_each_knobs_source_and_the_flags_rewritten() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pod = r#"
apiVersion: v1
kind: Pod
metadata:
  name: sft-0
  namespace: ml
  labels: {memguard.io/enabled: "true"}
  annotations:
    memguard.io/model: llama-3-8b
    memguard.io/method: lora
    memguard.io/gpu-memory: "24GiB"
spec:
  restartPolicy: Never
  containers:
    - name: trainer
      image: x
      command: [accelerate, launch, sft.py]
      args: [--per_device_train_batch_size, "8", --gradient_accumulation_steps, "1", --max_seq_length, "4096", --output_dir, /out]
      resources: {limits: {nvidia.com/gpu: "1"}}
"#;
    let admitted = admit(dir.path(), pod, None);
    let args = &admitted["spec"]["containers"][0]["args"];
    assert_ne!(args[1], "8", "the batch flag is rewritten: {args}");
    let text = explain(dir.path(), &admitted, "table");
    assert!(text.contains("(args: was 8)"), "{text}");
    assert!(text.contains("rewritten"), "{text}");
    assert!(text.contains("--per_device_train_batch_size 8→"), "{text}");
    // The whole command line before and after the rewrite.
    let new_batch = args[1].as_str().expect("a count");
    assert!(
        text.contains(
            "accelerate launch sft.py --per_device_train_batch_size 8 \
             --gradient_accumulation_steps 1 --max_seq_length 4096"
        ),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "accelerate launch sft.py --per_device_train_batch_size {new_batch} "
        )),
        "{text}"
    );
    // A second admission of the rewritten pod keeps the command line as it was first.
    let again = admit(
        dir.path(),
        &serde_json::to_string(&admitted).expect("json"),
        None,
    );
    assert_eq!(again, admitted, "idempotent");
}

#[test]
fn explain_says_what_it_could_not_read_and_shows_the_next_config_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    // A pod the webhook never saw: said so, not a bare `total -`.
    let raw: Value = serde_saphyr::from_str(POD).expect("pod");
    let table = explain(d, &raw, "table");
    assert!(table.contains("not admitted by memguard"), "{table}");
    let admitted = admit(d, POD, None);
    assert!(!explain(d, &admitted, "table").contains("not admitted"));

    // A sidecar message that is not a summary: unreadable, with its start, not "none".
    let trainer = json!({"exitCode": 0, "reason": "Completed",
        "finishedAt": "2026-11-23T22:10:00Z"});
    let garbled = finished(
        admitted.clone(),
        trainer.clone(),
        json!("panic: oh no"),
        "Succeeded",
    );
    let table = explain(d, &garbled, "table");
    assert!(
        table.contains("unreadable: the sidecar's termination message is not a memguard summary"),
        "{table}"
    );
    assert!(
        !table.contains("none (sidecar running or absent)"),
        "{table}"
    );

    // After an OOM the next pod's config is shown once, under "next pod" (the profile's
    // recovery is the same config).
    let oom = json!({"exitCode": 137, "reason": "OOMKilled", "finishedAt": "2026-11-23T22:10:00Z"});
    let summary = json!({"version": 1, "downgrades": 0, "oom_events": 1, "max_level": "critical",
        "batch_size": 8, "grad_accumulation": 2, "exit_reason": "trainer-exited",
        "oom_kill_phase": "save"});
    let dead = finished(admitted, oom, summary, "Failed");
    let table = explain(d, &dead, "table");
    let e = explain_json(d, &dead, &[]);
    // The phase of the kill (issue 39, item 3): what the next admission plans for.
    assert!(
        table.contains("oom kills (cgroup)") && table.contains("1 (last in phase save)"),
        "{table}"
    );
    assert_eq!(e["run"]["oom_kill_phase"], "save", "{e}");
    assert!(e["next"]["config"].is_object(), "{}", e["next"]);
    assert_eq!(table.matches("recovery").count(), 0, "{table}");
}

/// Issue 36: `explain` took only Pods. It takes what `mutate` takes (a Job, a PyTorchJob, a
/// `kind: List`), with the ConfigMaps and Nodes the decision reads: `mutate`'s output, piped
/// to `explain`, shows each pod template's admission, read from the ConfigMap in the Job's
/// namespace and budgeted on the Node given.
#[test]
fn explain_takes_the_workloads_mutate_takes_with_their_config_maps_and_nodes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let axolotl = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../webhook/tests/fixtures/config-files/axolotl-lora-8b.yml"),
    )
    .expect("the upstream axolotl config");
    let input = [
        json!({"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": "sft", "namespace": "ml"},
            "spec": {"template": {
                "metadata": {"labels": {"memguard.io/enabled": "true"}},
                "spec": {"restartPolicy": "Never", "containers": [{"name": "trainer",
                    "image": "axolotl:latest",
                    "command": ["axolotl", "train", "/config/lora-8b.yml"],
                    "volumeMounts": [{"name": "cfg", "mountPath": "/config"}],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                    "volumes": [{"name": "cfg", "configMap": {"name": "axolotl"}}]}}}}),
        json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "axolotl", "namespace": "ml"},
            "data": {"lora-8b.yml": axolotl}}),
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "a100",
            "labels": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
                "nvidia.com/gpu.memory": "81920"}}}),
    ]
    .iter()
    .map(Value::to_string)
    .collect::<Vec<_>>()
    .join("\n---\n");
    std::fs::write(dir.path().join("job.yaml"), input).expect("write");
    let mutated = ok_stdout(memguard(dir.path(), &["mutate", "-f", "job.yaml"]));
    std::fs::write(dir.path().join("mutated.yaml"), mutated).expect("write");

    let e: Value = serde_json::from_str(&ok_stdout(memguard(
        dir.path(),
        &["explain", "-f", "mutated.yaml", "-o", "json"],
    )))
    .expect("one explanation");
    assert_eq!(e["workload"], "Job ml/sft /spec/template", "{e}");
    assert_eq!(e["trainer"], "trainer", "{e}");
    assert_eq!(e["admitted"], true, "{e}");
    assert_eq!(
        e["sources"]["batch-size"], "configmap:axolotl/lora-8b.yml",
        "{e}"
    );
    assert!(
        e["budget"]["source"]
            .as_str()
            .is_some_and(|s| s.starts_with("nodes")),
        "{e}"
    );
    let table = ok_stdout(memguard(dir.path(), &["explain", "-f", "mutated.yaml"]));
    assert!(
        table.starts_with("pod template of Job ml/sft /spec/template (trainer trainer)\n"),
        "{table}"
    );
    // The Job as written, before admission: its config is read from the same ConfigMap.
    let e: Value = serde_json::from_str(&ok_stdout(memguard(
        dir.path(),
        &["explain", "-f", "job.yaml", "-o", "json"],
    )))
    .expect("one explanation");
    assert_eq!(e["admitted"], false, "{e}");
    assert_eq!(
        e["config"]["seq-length"], "4096",
        "read from the ConfigMap: {e}"
    );

    // A PyTorchJob in a List: each replica's template, in turn.
    let template = |replicas: u32| {
        json!({"replicas": replicas, "template": {
            "metadata": {"labels": {"memguard.io/enabled": "true"},
                "annotations": {"memguard.io/model": "llama-3-8b", "memguard.io/method": "lora",
                    "memguard.io/parallelism": "ddp", "memguard.io/gpu-memory": "80GiB"}},
            "spec": {"containers": [{"name": "pytorch", "image": "x",
                "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}})
    };
    let list = json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "ddp"},
         "spec": {"pytorchReplicaSpecs": {"Master": template(1), "Worker": template(3)}}}]});
    std::fs::write(dir.path().join("ddp.json"), list.to_string()).expect("write");
    let mutated = ok_stdout(memguard(
        dir.path(),
        &["mutate", "-f", "ddp.json", "-o", "json"],
    ));
    std::fs::write(dir.path().join("ddp-mutated.json"), mutated).expect("write");
    let all: Value = serde_json::from_str(&ok_stdout(memguard(
        dir.path(),
        &["explain", "-f", "ddp-mutated.json", "-o", "json"],
    )))
    .expect("explanations");
    let all = all.as_array().expect("several pods: an array");
    let workloads: Vec<&str> = all.iter().filter_map(|e| e["workload"].as_str()).collect();
    assert_eq!(
        workloads,
        [
            "PyTorchJob ddp /spec/pytorchReplicaSpecs/Master/template",
            "PyTorchJob ddp /spec/pytorchReplicaSpecs/Worker/template"
        ]
    );
    assert!(all.iter().all(|e| e["admitted"] == true), "{all:?}");
    let table = ok_stdout(memguard(dir.path(), &["explain", "-f", "ddp-mutated.json"]));
    assert!(
        table.starts_with(
            "== document 1 item 1 PyTorchJob ddp /spec/pytorchReplicaSpecs/Master/template\n"
        ),
        "{table}"
    );
}

/// Issue 37 item 4 and issue 39: `explain` shows the config the trainer reported at train start
/// beside what admission gave it, the knobs that differed, and the phases of the kills; the
/// next pod is planned on the report.
#[test]
fn explain_shows_the_trainers_report_beside_admission_and_the_kill_phases() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let admitted = admit(d, POD, None);
    let oom = json!({"exitCode": 137, "reason": "OOMKilled", "finishedAt": "2026-11-23T22:10:00Z"});
    let summary = json!({"version": 1, "downgrades": 0, "oom_events": 1, "max_level": "critical",
        "batch_size": 8, "grad_accumulation": 2, "exit_reason": "trainer-exited",
        "oom_kill_phase": "save",
        "trainer_config": {"batch-size": 8.0, "seq-length": 4096.0, "grad-checkpointing": 1.0,
                           "params": 8.03e9},
        "config_mismatch": ["seq-length"]});
    let dead = finished(admitted, oom, summary, "Failed");
    let e = explain_json(d, &dead, &[]);
    let learnt = &e["learnt"];
    assert_eq!(learnt["reported_by"], "finetune-0", "{e}");
    assert_eq!(learnt["knobs"]["seq-length"]["reported"], 4096.0);
    assert_eq!(learnt["knobs"]["seq-length"]["admitted"], "2048");
    assert_eq!(learnt["knobs"]["seq-length"]["mismatch"], true);
    assert_eq!(learnt["knobs"]["batch-size"]["mismatch"], false);
    assert!(learnt["knobs"]["params"]["admitted"].is_null());
    assert_eq!(learnt["kill_phases"]["save"], 1);
    assert_eq!(learnt["last_kill_phase"], "save");
    // The profile after this pod holds it, as the controller writes it.
    let status = &e["next"]["profile"]["status"];
    assert_eq!(status["trainerReport"]["mismatch"], json!(["seq-length"]));
    assert_eq!(status["oomKillPhases"]["save"], 1);
    // The next pod of the Job is planned on what the trainer ran, not on what it was told.
    assert_eq!(e["next"]["config"]["seqLength"], 4096, "{}", e["next"]);

    let table = explain(d, &dead, "table");
    // For a person: `cargo test -p memguard --test explain trainers_report -- --nocapture`.
    eprintln!("{table}");
    assert!(
        table.contains("trainer reported (pod finetune-0, at train start)"),
        "{table}"
    );
    assert!(
        table.contains("seq-length") && table.contains("4096  (admission: 2048; mismatch)"),
        "{table}"
    );
    assert!(table.contains("true  (admission: true)"), "{table}");
    assert!(
        table.contains("load 0, step 0, save 1 (last in save)"),
        "{table}"
    );
}

/// A stock HF script whose only argument is a JSON file in a ConfigMap: admission cannot read
/// its model, so it is Guarded; its trainer's report at train start is learnt under its launch
/// key, and `explain` shows the key, the report and the next admission's plan on it.
#[test]
fn explain_shows_a_guarded_pods_launch_key_report_and_the_plan_on_it() {
    const GUARDED: &str = r#"
apiVersion: v1
kind: Pod
metadata:
  name: tiny-1
  namespace: ml
  labels: {memguard.io/enabled: "true"}
spec:
  restartPolicy: Never
  containers:
  - name: trainer
    image: memguard-trainer:1
    command: [python, /job/train_json.py, /config/train.json]
    resources: {limits: {memory: 2Gi}}
    volumeMounts: [{name: config, mountPath: /config}]
  volumes: [{name: config, configMap: {name: tiny-llama-json}}]
"#;
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    let admitted = admit(d, GUARDED, None);
    let error = &admitted["metadata"]["annotations"]["memguard.io/error"];
    assert!(
        error
            .as_str()
            .unwrap_or_default()
            .contains("guarded at run time"),
        "{error}"
    );
    assert_eq!(env_of(&admitted, "MEMGUARD_BATCH_SIZE"), "", "not planned");
    let report = json!({"batch-size": 16.0, "grad-accumulation": 1.0, "seq-length": 512.0,
        "grad-checkpointing": 0.0, "world-size": 1.0, "params": 4300000.0,
        "trainable-params": 4300000.0, "hidden-size": 64.0, "num-layers": 2.0,
        "num-heads": 4.0, "num-kv-heads": 4.0, "head-dim": 16.0, "intermediate-size": 256.0,
        "vocab-size": 32000.0, "num-experts": 1.0, "tie-embeddings": 0.0, "gated-ffn": 1.0,
        "param-bits": 32.0, "quant-bits": 0.0, "optimizer": 0.0, "fused-loss": 0.0,
        "bf16": 0.0, "fp16": 0.0, "flash-attention": 1.0, "gpu": 0.0, "local-ranks": 1.0});
    let summary = json!({"version": 1, "downgrades": 0, "oom_events": 0, "max_level": "ok",
        "batch_size": 16, "grad_accumulation": 1, "exit_reason": "trainer-exited",
        "peak_bytes": 400_000_000u64, "trainer_config": report});
    let done = json!({"exitCode": 0, "reason": "Completed", "finishedAt": "2026-11-23T22:10:00Z"});
    let ran = finished(admitted, done, summary, "Succeeded");
    let e = explain_json(d, &ran, &[]);
    let key = e["launch_key"]["name"].as_str().expect("a launch key");
    assert!(key.starts_with("launch-"), "{e}");
    assert_eq!(e["next"]["profile"]["name"], key, "learnt under it");
    assert!(
        e["launch_key"]["identity"]
            .as_array()
            .expect("identity")
            .contains(&json!("configmap=tiny-llama-json")),
        "{e}"
    );
    assert_eq!(e["trainer"], "trainer");
    assert_eq!(e["learnt"]["reported_by"], "tiny-1");
    assert_eq!(e["learnt"]["knobs"]["hidden-size"]["reported"], 64.0);
    let next = &e["next"];
    assert!(
        next["planned_on"]
            .as_str()
            .unwrap_or_default()
            .contains("planned on the trainer's report of tiny-1"),
        "{next}"
    );
    let batch = next["config"]["batchSize"].as_u64().expect("a batch");
    let accumulation = next["config"]["gradAccumulation"]
        .as_u64()
        .expect("an accumulation");
    assert!(batch < 16, "2Gi does not hold 16 rows: {next}");
    assert_eq!(next["verdict"], "same", "{next}");
    assert_eq!(batch * accumulation, 16, "{next}");
    for (knob, source) in next["sources"].as_object().expect("sources") {
        assert_eq!(source, "profile:trainer-report", "{knob}");
    }

    let table = explain(d, &ran, "table");
    eprintln!("{table}");
    assert!(table.contains(&format!("launch key {key}")), "{table}");
    assert!(table.contains("profile:trainer-report"), "{table}");
    assert!(table.contains("trainer reported (pod tiny-1"), "{table}");
}
