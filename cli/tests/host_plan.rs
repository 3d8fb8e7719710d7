//! The host plan end to end, through the real binary: `memguard mutate` rewrites a multi-rank
//! TRL launch whose save would not fit its trainer's `limits.memory`, writes the host figure
//! into the estimate annotation, admits its own output unchanged, and `memguard explain` shows
//! the host figure and verdict beside the GPU figure.

use serde_json::Value;
use std::process::{Command, Output};

fn memguard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memguard"))
        .args(args)
        .output()
        .expect("the memguard binary runs")
}

fn pod(limit: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata:
  name: sft
  labels: {{memguard.io/enabled: "true"}}
  annotations: {{memguard.io/gpu-memory: 100Ti}}
spec:
  restartPolicy: Never
  containers:
  - name: t
    image: x
    resources: {{limits: {{nvidia.com/gpu: "4", memory: {limit}}}}}
    command: [torchrun, --nproc_per_node, "4", -m, trl.scripts.sft]
    args: [--model_name_or_path, meta-llama/Llama-3.1-8B, --per_device_train_batch_size, "16",
           --max_length, "8192", --dataloader_num_workers, "16", --dtype, bfloat16,
           --output_dir, /out]
"#
    )
}

fn mutate(dir: &std::path::Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write");
    let out = memguard(&["mutate", "-f", path.to_str().expect("utf-8"), "-o", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

fn host_of(doc: &Value) -> Value {
    let text = doc["metadata"]["annotations"]["memguard.io/estimate"]
        .as_str()
        .expect("an estimate annotation");
    serde_json::from_str::<Value>(text).expect("JSON")["host"].clone()
}

#[test]
fn mutate_and_explain_plan_the_host_memory_of_a_multi_rank_pod() {
    let dir = tempfile::tempdir().expect("tempdir");
    let first = mutate(dir.path(), "pod.yaml", &pod("80Gi"));
    let doc: Value = serde_json::from_str(&first).expect("json");
    let host = host_of(&doc);
    assert_eq!(host["ranks"], 4, "{host}");
    assert!(host["rewritten"]["save"].is_object(), "{host}");
    let args: Vec<&str> = doc["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(args.contains(&"--save_only_model"), "{args:?}");
    // The save had to move; the input pipeline's few MiB did not need to.
    assert!(!args.iter().any(|a| a.contains("pin_memory")), "{args:?}");
    assert!(
        args.windows(2)
            .any(|w| w == ["--dataloader_num_workers", "16"]),
        "{args:?}"
    );
    let batch = args
        .iter()
        .position(|a| *a == "--per_device_train_batch_size")
        .map(|i| args[i + 1]);
    assert_eq!(batch, Some("16"), "the batch is the GPU plan's: {args:?}");

    // memguard's own output, admitted again: nothing changes.
    let second = mutate(dir.path(), "mutated.json", &first);
    assert_eq!(
        serde_json::from_str::<Value>(&second).expect("json"),
        doc,
        "a second admission changes nothing"
    );

    let out = memguard(&[
        "explain",
        "-f",
        dir.path().join("mutated.json").to_str().expect("utf-8"),
    ]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{table}");
    assert!(
        table.contains("host memory (per pod, 4 rank(s))"),
        "{table}"
    );
    assert!(table.contains("rewritten save"), "{table}");
    assert!(
        table.contains("host verdict") && table.contains("checkpoint-dtype"),
        "{table}"
    );
    // The GPU figure is still there, above it.
    assert!(table.find("budget").expect("budget") < table.find("host memory").expect("host"));

    // A limit below the load: the error names the memory to request.
    let low = mutate(dir.path(), "low.yaml", &pod("8Gi"));
    let doc: Value = serde_json::from_str(&low).expect("json");
    let error = doc["metadata"]["annotations"]["memguard.io/error"]
        .as_str()
        .expect("an error");
    assert!(error.contains("set limits.memory ≥"), "{error}");
    assert_eq!(host_of(&doc)["fits"], false);
}
