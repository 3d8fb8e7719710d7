//! `memguard mutate --profile` end to end through the real binary: what a `MemoryProfile`
//! changes at admission, without a cluster.

use serde_json::Value;
use std::path::Path;
use std::process::Command;

/// A LoRA pod on one GPU (no product pinned) at batch 16, with `gpu_memory` bytes and safety
/// ratio 1.
fn pod(gpu_memory: u64) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata:
  name: trainer-0
  namespace: ml
  labels: {{memguard.io/enabled: "true"}}
  annotations:
    memguard.io/model: llama-3-8b
    memguard.io/method: lora
    memguard.io/batch-size: "16"
    memguard.io/seq-length: "2048"
    memguard.io/gpu-memory: "{gpu_memory}B"
    memguard.io/safety-ratio: "1"
spec:
  restartPolicy: Never
  containers: [{{name: trainer, image: x, resources: {{limits: {{nvidia.com/gpu: "1"}}}}}}]
"#
    )
}

/// The profile of that pod's key, with `status` (YAML, indented under `status:`).
fn profile(status: &str) -> String {
    format!(
        r#"
apiVersion: training.memguard.io/v1alpha1
kind: MemoryProfile
metadata: {{name: llama-3-8b-lora-bf16-mixed-gpu, namespace: ml}}
spec: {{model: llama-3-8b, method: lora, precision: bf16-mixed, deviceClass: gpu, device: gpu}}
status:
{status}
"#
    )
}

fn run(dir: &Path, pod: &str, profile: Option<&str>) -> Value {
    let pod_path = dir.join("pod.yaml");
    std::fs::write(&pod_path, pod).expect("write pod");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_memguard"));
    cmd.args(["mutate", "-o", "json", "-f"]).arg(&pod_path);
    if let Some(p) = profile {
        let path = dir.join("profile.yaml");
        std::fs::write(&path, p).expect("write profile");
        cmd.arg("--profile").arg(&path);
    }
    let out = cmd.output().expect("the memguard binary runs");
    assert!(
        out.status.success(),
        "memguard mutate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON output")
}

fn estimate(doc: &Value) -> Value {
    let text = doc["metadata"]["annotations"]["memguard.io/estimate"]
        .as_str()
        .expect("estimate annotation");
    serde_json::from_str(text).expect("estimate JSON")
}

fn env(doc: &Value, name: &str) -> Option<String> {
    doc["spec"]["containers"][0]["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str())
        .map(str::to_string)
}

/// The pod's raw estimate and its upper bound at the default level: with a budget far above.
fn raw_total_and_upper(dir: &Path) -> (u64, u64) {
    let e = estimate(&run(dir, &pod(1 << 50), None));
    (
        e["total"].as_u64().expect("total"),
        e["upper"].as_u64().expect("upper"),
    )
}

/// The plan is checked against the upper bound (at 0.95, about 1.2× the estimate for this
/// class): runs measured at 1.5× the estimate replace it with the job's own, wider, bound.
#[test]
fn three_runs_at_1_5x_make_a_config_that_fit_downgrade() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (total, upper) = raw_total_and_upper(dir.path());
    assert!(upper > total);
    // A budget 10 % above the bound: fits as is, not once the runs show 1.5×.
    let gpu = upper + upper / 10;
    assert!((gpu as f64) < 1.5 * total as f64);
    let before = estimate(&run(dir.path(), &pod(gpu), None));
    assert_eq!(before["fits"], true);
    assert_eq!(before["steps"], serde_json::json!([]), "{before}");

    let runs = (0..3)
        .map(|i| {
            format!(
                "    - {{pod: p{i}, uid: u{i}, estimateBytes: 1000000000, \
                 measuredPeakBytes: 1500000000, finishedAt: \"2026-01-0{}T00:00:00Z\"}}",
                i + 1
            )
        })
        .collect::<Vec<_>>()
        .join("\n");
    let status = format!("  runCount: 3\n  runs:\n{runs}");
    let doc = run(dir.path(), &pod(gpu), Some(&profile(&status)));
    let after = estimate(&doc);
    assert_eq!(after["calibration"]["runs"], 3, "{after}");
    let factor = after["calibration"]["factor"].as_f64().expect("factor");
    assert!((factor - 1.5).abs() < 1e-9, "{factor}");
    let steps = after["steps"].as_array().expect("steps");
    assert!(!steps.is_empty(), "the calibrated plan downgrades: {after}");
    assert_eq!(after["fits"], true);
    assert!(after["upper"].as_u64().expect("upper") <= gpu);
    assert!(after["total"].as_u64().expect("total") <= gpu);
    // The trainer is told the downgraded config, with its effective batch (16) kept.
    let knob = |k: &str| env(&doc, k).and_then(|v| v.parse::<u64>().ok());
    let (batch, accumulation) = (
        knob("MEMGUARD_BATCH_SIZE").expect("batch"),
        knob("MEMGUARD_GRAD_ACCUMULATION").expect("accumulation"),
    );
    assert_eq!(batch * accumulation, 16);
    let checkpointing = env(&doc, "MEMGUARD_GRAD_CHECKPOINTING").as_deref() == Some("true");
    assert!(batch < 16 || checkpointing, "{steps:?}");
}

#[test]
fn an_oom_event_applies_the_recovery_step() {
    let dir = tempfile::tempdir().expect("tempdir");
    let gpu = 1u64 << 50;
    let before = run(dir.path(), &pod(gpu), None);
    assert_eq!(env(&before, "MEMGUARD_BATCH_SIZE").as_deref(), Some("16"));

    let reason = "pod trainer-0 OOMKilled at batch 16, seq 2048, rank 16 (limit 80.00 GiB): \
                  start with batch 16 → 8, gradient accumulation 1 → 2 (effective batch 16 kept)";
    let status = format!(
        r#"  runCount: 1
  runs:
    - {{pod: trainer-0, uid: u0, estimateBytes: 1000, finishedAt: "2026-01-01T00:00:00Z", oomKilled: true}}
  oomEvents:
    - {{pod: trainer-0, at: "2026-01-01T00:00:00Z", reason: OOMKilled, config: {{batchSize: 16, gradAccumulation: 1}}}}
  lastOomAt: "2026-01-01T00:00:00Z"
  recovery:
    rungs: 1
    config: {{batchSize: 8, gradAccumulation: 2}}
    reason: "{reason}""#
    );
    let doc = run(dir.path(), &pod(gpu), Some(&profile(&status)));
    assert_eq!(env(&doc, "MEMGUARD_BATCH_SIZE").as_deref(), Some("8"));
    assert_eq!(
        env(&doc, "MEMGUARD_GRAD_ACCUMULATION").as_deref(),
        Some("2")
    );
    assert_eq!(estimate(&doc)["recovery"], reason);
}

#[test]
fn a_garbled_profile_file_is_bad_input() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pod_path = dir.path().join("pod.yaml");
    std::fs::write(&pod_path, pod(1 << 40)).expect("write");
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "kind: MemoryProfile\nspec: 12\n").expect("write");
    let out = Command::new(env!("CARGO_BIN_EXE_memguard"))
        .args(["mutate", "-f"])
        .arg(&pod_path)
        .arg("--profile")
        .arg(&bad)
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a MemoryProfile"));
}
