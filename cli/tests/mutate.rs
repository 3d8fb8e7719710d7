//! `memguard mutate` end to end, through the real binary, on the webhook's fixture pods.

use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../webhook/tests/fixtures")
        .join(name)
}

fn memguard(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_memguard"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the memguard binary runs");
    let mut input = child.stdin.take().expect("stdin");
    // The binary may reject its flags and exit before reading stdin; that is not a failure here.
    match input.write_all(stdin.unwrap_or_default().as_bytes()) {
        Err(err) if err.kind() != std::io::ErrorKind::BrokenPipe => panic!("write stdin: {err}"),
        _ => {}
    }
    drop(input);
    child.wait_with_output().expect("output")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

const WORKLOADS: &str = r#"
apiVersion: batch/v1
kind: Job
metadata: {name: lora}
spec:
  template:
    metadata:
      labels: {memguard.io/enabled: "true"}
      annotations: {memguard.io/model: llama-3-8b, memguard.io/method: qlora}
    spec:
      restartPolicy: Never
      containers: [{name: t, image: x, resources: {limits: {nvidia.com/gpu: "1"}}}]
---
apiVersion: v1
kind: Service
metadata: {name: s}
spec: {ports: [{port: 80}]}
---
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata: {name: ddp}
spec:
  pytorchReplicaSpecs:
    Master:
      replicas: 1
      template:
        metadata:
          labels: {memguard.io/enabled: "true"}
          annotations: {memguard.io/model: llama-3-8b, memguard.io/method: lora, memguard.io/parallelism: ddp}
        spec:
          containers: [{name: pytorch, image: x, resources: {limits: {nvidia.com/gpu: "2"}}}]
"#;

#[test]
fn mutates_a_pod_file_into_yaml() {
    let pod = fixture("pods/single-gpu-lora.yaml");
    let policy = fixture("policy.yaml");
    let out = memguard(
        &[
            "mutate",
            "-f",
            pod.to_str().expect("utf-8"),
            "--policy-file",
            policy.to_str().expect("utf-8"),
        ],
        None,
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let mutated: Value = serde_saphyr::from_str(&stdout(&out)).expect("YAML out");
    // The client's init container first (the trainer runs Python), then the native sidecar.
    let init = &mutated["spec"]["initContainers"];
    assert_eq!(init[0]["name"], "memguard-client");
    let sidecar = &init[1];
    assert_eq!(sidecar["name"], "memguard-sidecar");
    assert_eq!(sidecar["restartPolicy"], "Always");
    let estimate = mutated["metadata"]["annotations"]["memguard.io/estimate"]
        .as_str()
        .expect("estimate annotation");
    let estimate: Value = serde_json::from_str(estimate).expect("JSON");
    assert_eq!(estimate["budgetSource"]["detail"], "NVIDIA-A10G");
    assert!(stderr(&out).contains("valueFrom"), "warnings go to stderr");
}

#[test]
fn mutates_workload_templates_from_stdin_and_leaves_other_documents() {
    let out = memguard(&["mutate", "-f", "-", "-o", "json"], Some(WORKLOADS));
    assert!(out.status.success(), "{}", stderr(&out));
    let list: Value = serde_json::from_str(&stdout(&out)).expect("one JSON value");
    assert_eq!(list["kind"], "List", "several documents: a List of them");
    assert_eq!(list["apiVersion"], "v1");
    let docs = list["items"].as_array().expect("items");
    assert_eq!(docs.len(), 3);
    assert_eq!(
        docs[0]["spec"]["template"]["spec"]["shareProcessNamespace"],
        true
    );
    assert_eq!(
        docs[1]["spec"],
        serde_json::json!({"ports": [{"port": 80}]})
    );
    let master = &docs[2]["spec"]["pytorchReplicaSpecs"]["Master"]["template"];
    assert_eq!(
        master["spec"]["initContainers"][0]["restartPolicy"],
        "Always"
    );
    let estimate: Value = serde_json::from_str(
        master["metadata"]["annotations"]["memguard.io/estimate"]
            .as_str()
            .expect("estimate"),
    )
    .expect("JSON");
    assert_eq!(
        estimate["config"]["world-size"], "2",
        "DDP over the pod's 2 GPUs"
    );
}

#[test]
fn prints_patches_rebased_onto_each_document_and_is_idempotent() {
    let out = memguard(&["mutate", "-f", "-", "-o", "patch"], Some(WORKLOADS));
    assert!(out.status.success(), "{}", stderr(&out));
    let patches: Vec<Value> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one patch per line"))
        .collect();
    assert_eq!(patches.len(), 3);
    for op in patches[0].as_array().expect("ops") {
        assert!(
            op["path"]
                .as_str()
                .is_some_and(|p| p.starts_with("/spec/template/")),
            "{op}"
        );
    }
    assert_eq!(
        patches[1],
        serde_json::json!([]),
        "a Service is not patched"
    );

    // The mutated output, mutated again, needs no patch.
    let yaml = memguard(&["mutate", "-f", "-"], Some(WORKLOADS));
    let again = memguard(&["mutate", "-f", "-", "-o", "patch"], Some(&stdout(&yaml)));
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(
        stdout(&again).lines().all(|l| l == "[]"),
        "{}",
        stdout(&again)
    );
}

#[test]
fn bad_annotations_still_print_the_pod_but_exit_2() {
    let pod = fixture("pods/bad-annotations.yaml");
    let out = memguard(&["mutate", "-f", pod.to_str().expect("utf-8")], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("did you mean `optimizer`"),
        "{}",
        stderr(&out)
    );
    let mutated: Value = serde_saphyr::from_str(&stdout(&out)).expect("YAML out");
    assert!(mutated["metadata"]["annotations"]["memguard.io/error"].is_string());
}

#[test]
fn bad_input_is_a_clear_error_and_exit_2() {
    let cases: [(&[&str], Option<&str>, &str); 5] = [
        (
            &["mutate", "-f", "-"],
            Some("kind: [unclosed"),
            "not valid YAML",
        ),
        (
            &["mutate", "-f", "/nonexistent/pod.yaml"],
            None,
            "reading /nonexistent/pod.yaml",
        ),
        (&["mutate", "-f", "-"], Some(""), "no documents"),
        (
            &["mutate", "-f", "-"],
            Some("- just\n- a list\n"),
            "not a Kubernetes object",
        ),
        (
            &["mutate", "-f", "-"],
            Some("kind: Pod\nmetadata: {name: x}\nspec: {containers: 3}\n"),
            "not a valid pod",
        ),
    ];
    for (args, stdin, message) in cases {
        let out = memguard(args, stdin);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(message), "{args:?}: {}", stderr(&out));
    }
    let bad_policy = memguard(
        &["mutate", "-f", "-", "--safety-ratio", "1.5"],
        Some(WORKLOADS),
    );
    assert_eq!(bad_policy.status.code(), Some(2));
    assert!(
        stderr(&bad_policy).contains("safetyRatio"),
        "{}",
        stderr(&bad_policy)
    );
}

#[test]
fn a_memguard_policy_manifest_works_as_the_policy_file() {
    let spec = std::fs::read_to_string(fixture("policy.yaml")).expect("fixture policy");
    // The fixture as `kubectl apply` takes it: the spec indented under a MemguardPolicy.
    let spec_lines: String = spec.lines().map(|l| format!("  {l}\n")).collect();
    let manifest = format!(
        "apiVersion: training.memguard.io/v1alpha1\nkind: MemguardPolicy\nmetadata:\n  name: default\n\
         spec:\n{spec_lines}"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("memguardpolicy.yaml");
    std::fs::write(&path, &manifest).expect("write");
    let pod = fixture("pods/single-gpu-lora.yaml");
    let run = |policy: &Path| {
        memguard(
            &[
                "mutate",
                "-f",
                pod.to_str().expect("utf-8"),
                "-o",
                "patch",
                "--policy-file",
                policy.to_str().expect("utf-8"),
                "--sidecar-image",
                "flag:1",
            ],
            None,
        )
    };
    let from_spec = run(&fixture("policy.yaml"));
    let from_manifest = run(&path);
    assert_eq!(
        from_manifest.status.code(),
        Some(0),
        "{}",
        stderr(&from_manifest)
    );
    assert_eq!(stdout(&from_manifest), stdout(&from_spec));
    assert!(stdout(&from_manifest).contains("flag:1"), "flags still win");
    // The fixture's A10G entry (24Gi × 0.9), not the built-in table's (the fixture does not
    // fit it without a quality cut: the error annotation names the budget).
    assert!(
        stdout(&from_manifest).contains("of budget 21.60 GiB"),
        "the manifest's spec is the policy: {}",
        stdout(&from_manifest)
    );

    // Another kind, or another version of ours, is named in a clear error.
    for (text, message) in [
        (
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: memguard-policy}\n".to_string(),
            "`kind: ConfigMap` is not a policy",
        ),
        (
            manifest.replace("training.memguard.io/v1alpha1", "training.memguard.io/v1"),
            "apiVersion `training.memguard.io/v1`",
        ),
        (
            manifest.replace("safetyRatio: 0.9", "safetyRatio: 9"),
            "safetyRatio",
        ),
    ] {
        std::fs::write(&path, &text).expect("write");
        let out = run(&path);
        assert_eq!(out.status.code(), Some(2), "{text}: {}", stderr(&out));
        assert!(stderr(&out).contains(message), "{text}: {}", stderr(&out));
        assert!(
            stdout(&out).is_empty(),
            "nothing mutated under a bad policy"
        );
    }
}

/// Every accelerator fixture through the binary: the same device, budget source and memory as
/// through the webhook (the expectations are one table, `fixtures/accelerators.yaml`).
#[test]
fn accelerator_fixtures_get_their_device_budget_and_source() {
    let policy = fixture("policy.yaml");
    let table: serde_json::Map<String, Value> = serde_saphyr::from_str(
        &std::fs::read_to_string(fixture("accelerators.yaml")).expect("table"),
    )
    .expect("YAML");
    assert!(table.len() >= 9);
    for (file, want) in table {
        let pod = fixture(&format!("pods/{file}"));
        let out = memguard(
            &[
                "mutate",
                "-f",
                pod.to_str().expect("utf-8"),
                "--policy-file",
                policy.to_str().expect("utf-8"),
            ],
            None,
        );
        assert!(out.status.success(), "{file}: {}", stderr(&out));
        let mutated: Value = serde_saphyr::from_str(&stdout(&out)).expect("YAML out");
        let estimate: Value = serde_json::from_str(
            mutated["metadata"]["annotations"]["memguard.io/estimate"]
                .as_str()
                .expect("estimate annotation"),
        )
        .expect("JSON");
        assert_eq!(estimate["device"], want["device"], "{file}");
        if want["source"] == "none" {
            for key in ["budget", "fits", "budgetSource"] {
                assert!(estimate[key].is_null(), "{file}: {key} in {estimate}");
            }
            let w = want["warning"].as_str().expect("a warning");
            assert!(stderr(&out).contains(w), "{file}: {}", stderr(&out));
            continue;
        }
        assert_eq!(estimate["budgetSource"]["kind"], want["source"], "{file}");
        let memory = want["deviceMemory"].as_u64().expect("bytes");
        if want["source"] != "memory-limit" {
            assert_eq!(estimate["gpuMemory"].as_u64(), Some(memory), "{file}");
        }
        let budget = estimate["budget"].as_u64().expect("budget");
        assert!(budget.abs_diff(memory * 9 / 10) <= 1, "{file}: {budget}");
        if let Some(w) = want["warning"].as_str() {
            assert!(stderr(&out).contains(w), "{file}: {}", stderr(&out));
        }
    }
}

#[test]
fn a_pod_that_cannot_fit_at_the_floor_is_admitted_with_the_verdict() {
    let pod = r#"
apiVersion: v1
kind: Pod
metadata:
  name: too-big
  labels: {memguard.io/enabled: "true"}
  annotations: {memguard.io/model: llama-3-70b, memguard.io/method: full, memguard.io/gpu-memory: 16Gi}
spec:
  restartPolicy: Never
  containers: [{name: t, image: x, resources: {limits: {nvidia.com/gpu: "1"}}}]
"#;
    let out = memguard(&["mutate", "-f", "-", "-o", "json"], Some(pod));
    assert!(out.status.success(), "admitted: {}", stderr(&out));
    assert!(
        stderr(&out).contains("warning: memguard: cannot fit; smallest config tried: batch 1 × "),
        "{}",
        stderr(&out)
    );
    let doc: Value = serde_json::from_str(&stdout(&out)).expect("json");
    let error = doc["metadata"]["annotations"]["memguard.io/error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        error.contains("of budget 14.40 GiB with every knob at its floor")
            && error.contains("smallest config tried: batch 1 × "),
        "{error}"
    );
    let env = doc["spec"]["containers"][0]["env"].to_string();
    assert!(
        env.contains(r#"{"name":"MEMGUARD_CANNOT_FIT","value":"true"}"#),
        "{env}"
    );
}

/// A pod naming a model only the policy knows: mutated under `--policy-file`, skipped (with the
/// error naming where memguard looked) without it.
#[test]
fn a_model_the_policy_adds_is_known_to_mutate_under_its_policy_file() {
    let pod = std::fs::read_to_string(fixture("pods/single-gpu-lora.yaml"))
        .expect("fixture")
        .replace(
            "memguard.io/model: llama-3-8b",
            "memguard.io/model: Qwen/Qwen2.5-Coder-7B-Instruct",
        )
        // A sequence that fits the A10G without a quality cut.
        .replace(
            "memguard.io/seq-length: \"4096\"",
            "memguard.io/seq-length: \"256\"",
        );
    let policy = fixture("policy-models.yaml");
    let out = memguard(
        &[
            "mutate",
            "-f",
            "-",
            "--policy-file",
            policy.to_str().expect("utf-8"),
        ],
        Some(&pod),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let mutated: Value = serde_saphyr::from_str(&stdout(&out)).expect("YAML out");
    let annotations = &mutated["metadata"]["annotations"];
    assert!(annotations["memguard.io/estimate"].is_string(), "{mutated}");
    assert!(annotations.get("memguard.io/error").is_none(), "{mutated}");
    let init = mutated["spec"]["initContainers"].as_array().expect("init");
    assert!(
        init.iter().any(|c| c["name"] == "memguard-sidecar"),
        "{mutated}"
    );

    let out = memguard(&["mutate", "-f", "-"], Some(&pod));
    assert_eq!(out.status.code(), Some(2), "skipped: {}", stderr(&out));
    let skipped: Value = serde_saphyr::from_str(&stdout(&out)).expect("YAML out");
    let error = skipped["metadata"]["annotations"]["memguard.io/error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        error.contains("unknown model `Qwen/Qwen2.5-Coder-7B-Instruct`: not in the built-in catalog, and the policy adds no models"),
        "{error}"
    );
}

/// The DRA fixtures with `--dra objects.yaml`: the same device, source, memory and warning as
/// through the webhook's catalog (one table, `fixtures/dra.yaml`).
#[test]
fn dra_fixtures_read_their_device_from_the_objects_given() {
    let policy = fixture("policy.yaml");
    let objects = fixture("dra/objects.yaml");
    let table: serde_json::Map<String, Value> =
        serde_saphyr::from_str(&std::fs::read_to_string(fixture("dra.yaml")).expect("table"))
            .expect("YAML");
    assert_eq!(table.len(), 6);
    for (file, want) in table {
        let pod = fixture(&format!("dra/{file}"));
        let out = memguard(
            &[
                "mutate",
                "-f",
                pod.to_str().expect("utf-8"),
                "--policy-file",
                policy.to_str().expect("utf-8"),
                "--dra",
                objects.to_str().expect("utf-8"),
            ],
            None,
        );
        assert!(out.status.success(), "{file}: {}", stderr(&out));
        let mutated: Value = serde_saphyr::from_str(&stdout(&out)).expect("YAML out");
        let estimate: Value = serde_json::from_str(
            mutated["metadata"]["annotations"]["memguard.io/estimate"]
                .as_str()
                .expect("estimate annotation"),
        )
        .expect("JSON");
        assert_eq!(estimate["device"], want["device"], "{file}");
        assert_eq!(estimate["budgetSource"]["kind"], want["source"], "{file}");
        if want["source"] == "dra" {
            assert_eq!(estimate["gpuMemory"], want["deviceMemory"], "{file}");
        }
        if let Some(w) = want["warning"].as_str() {
            assert!(stderr(&out).contains(w), "{file}: {}", stderr(&out));
        }
    }
    // A file that is not DRA objects is refused by name, exit 2.
    let out = memguard(
        &[
            "mutate",
            "-f",
            fixture("dra/dra-template.yaml").to_str().expect("utf-8"),
            "--dra",
            fixture("policy.yaml").to_str().expect("utf-8"),
        ],
        None,
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("apiVersion"), "{}", stderr(&out));
}

/// Issue 27: a pod with only the opt-in label whose trainer is a stock HF/TRL launch is planned
/// on the model its args name (a full fine-tune of Llama-3.1-8B cannot fit an A10G: admitted
/// with the verdict), and the LoRA variant's args are rewritten with the effective batch kept.
#[test]
fn a_label_only_stock_launch_is_read_from_its_args() {
    let pod = |extra: &str| {
        format!(
            r#"
apiVersion: v1
kind: Pod
metadata:
  name: sft
  labels: {{memguard.io/enabled: "true"}}
spec:
  restartPolicy: Never
  nodeSelector: {{nvidia.com/gpu.product: NVIDIA-A10G}}
  containers:
  - name: t
    image: x
    resources: {{limits: {{nvidia.com/gpu: "1"}}}}
    command: [bash, -c]
    args: ["pip install -q trl && accelerate launch --num_processes 1 sft.py --model_name_or_path {extra} --per_device_train_batch_size 8 --gradient_accumulation_steps 2 --max_seq_length 4096 --bf16 --output_dir /out"]
"#
        )
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let run = |text: String| {
        let path = dir.path().join("pod.yaml");
        std::fs::write(&path, text).expect("write");
        let out = memguard(
            &["mutate", "-f", path.to_str().expect("utf-8"), "-o", "json"],
            None,
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let doc: Value = serde_json::from_str(&stdout(&out)).expect("json");
        let estimate = doc["metadata"]["annotations"]["memguard.io/estimate"]
            .as_str()
            .map(|e| serde_json::from_str::<Value>(e).expect("JSON"))
            .expect("planned: an estimate annotation");
        (doc, estimate)
    };
    let (_, full) = run(pod("meta-llama/Llama-3.1-8B"));
    assert_eq!(full["sources"]["model"], "args", "{full}");
    assert_eq!(full["sources"]["method"], "args", "{full}");
    assert_eq!(full["sources"]["batch-size"], "args", "{full}");

    let (doc, lora) = run(pod("google/gemma-2b --use_peft --lora_r 16"));
    assert_eq!(lora["sources"]["model"], "args", "{lora}");
    let script = doc["spec"]["containers"][0]["args"][0]
        .as_str()
        .expect("the script");
    let flag = |name: &str| -> u64 {
        let after = script
            .split(&format!("--{name} "))
            .nth(1)
            .unwrap_or_else(|| panic!("--{name} in {script}"));
        after
            .split(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .expect("a count")
    };
    let (batch, accumulation) = (
        flag("per_device_train_batch_size"),
        flag("gradient_accumulation_steps"),
    );
    assert!(batch < 8, "downgraded: {script}");
    assert_eq!(batch * accumulation, 16, "effective batch kept: {script}");
}

/// One reader for `-f`: a `kind: List` (what `kubectl get pods -o yaml` prints) is its items;
/// ConfigMaps and Nodes in the input are the cluster the decision reads (a stock axolotl pod's
/// config file, an unpinned pod's nodes); a pod memguard leaves alone says why.
#[test]
fn lists_config_maps_and_nodes_in_the_input_reach_the_decision() {
    let axolotl = std::fs::read_to_string(fixture("config-files/axolotl-lora-8b.yml"))
        .expect("the upstream axolotl config");
    let config_map = serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "axolotl", "namespace": "ml"},
        "data": {"lora-8b.yml": axolotl},
    });
    let trainer = |name: &str, labels: Value, extra: Value| {
        let mut pod = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml", "labels": labels},
            "spec": {"containers": [{"name": "trainer", "image": "axolotl:latest",
                "command": ["axolotl", "train", "/config/lora-8b.yml"],
                "volumeMounts": [{"name": "cfg", "mountPath": "/config"}],
                "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                "volumes": [{"name": "cfg", "configMap": {"name": "axolotl"}}]},
        });
        if let Some(obj) = extra.as_object() {
            for (k, v) in obj {
                pod["spec"][k] = v.clone();
            }
        }
        pod
    };
    let on = serde_json::json!({"memguard.io/enabled": "true"});
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": [
        trainer("unpinned", on.clone(), Value::Null),
        trainer("title-case", serde_json::json!({"memguard.io/enabled": "True"}), Value::Null),
        trainer("unlabelled", serde_json::json!({}), Value::Null),
    ]});
    let node = |product: &str, mib: &str| {
        serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": product,
            "labels": {"nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": mib}}})
    };
    let input = [
        list,
        config_map,
        node("NVIDIA-A30", "24576"),
        node("NVIDIA-A100-SXM4-80GB", "81920"),
    ]
    .iter()
    .map(|d| serde_json::to_string(d).expect("json"))
    .collect::<Vec<_>>()
    .join("\n---\n");
    let out = memguard(&["mutate", "-f", "-", "-o", "json"], Some(&input));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let list: Value = serde_json::from_str(&stdout(&out)).expect("one JSON value");
    let items = list["items"].as_array().expect("a List");
    let kinds: Vec<&str> = items.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert_eq!(
        kinds,
        ["Pod", "Pod", "Pod", "ConfigMap", "Node", "Node"],
        "the List's items, then the ConfigMap and the Nodes, as given"
    );
    let pods = &items[..3];
    let estimate: Value = serde_json::from_str(
        pods[0]["metadata"]["annotations"]["memguard.io/estimate"]
            .as_str()
            .expect("the unpinned pod is admitted"),
    )
    .expect("estimate JSON");
    // The file came from the ConfigMap in the input; the budget from the smallest node's labels.
    assert_eq!(
        estimate["sources"]["batch-size"], "configmap:axolotl/lora-8b.yml",
        "{estimate}"
    );
    assert_eq!(estimate["budgetSource"]["kind"], "nodes", "{estimate}");
    assert!(estimate["gpuMemory"].as_u64().expect("gpu memory") < 24 * (1 << 30));
    let said = stderr(&out);
    assert!(
        said.contains(
            "document 1 item 2: not mutated: label memguard.io/enabled is \"True\", \
             not \"true\": the webhook's selector matches exactly \"true\""
        ),
        "{said}"
    );
    assert!(
        said.contains("document 1 item 3: not mutated: no label memguard.io/enabled=\"true\""),
        "{said}"
    );
    for pod in &pods[1..] {
        assert!(
            pod["metadata"].get("annotations").is_none(),
            "left alone: {pod}"
        );
    }
}

/// A Job in `namespace` whose trainer (axolotl) reads its config file from ConfigMap `axolotl`
/// in `ml`, with that ConfigMap, two GPU nodes, a Service and a `kind: List` around a second
/// (unlabelled) Job: a whole input as `kubectl get job,configmap,node,svc -o yaml` gives it.
fn axolotl_workloads(namespace: &str) -> String {
    let axolotl = std::fs::read_to_string(fixture("config-files/axolotl-lora-8b.yml"))
        .expect("the upstream axolotl config");
    let job = |name: &str, labels: Value| {
        serde_json::json!({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"template": {
                "metadata": {"labels": labels},
                "spec": {"restartPolicy": "Never", "containers": [{"name": "trainer",
                    "image": "axolotl:latest",
                    "command": ["axolotl", "train", "/config/lora-8b.yml"],
                    "volumeMounts": [{"name": "cfg", "mountPath": "/config"}],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                    "volumes": [{"name": "cfg", "configMap": {"name": "axolotl"}}]}}},
        })
    };
    let node = |product: &str, mib: &str| {
        serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": product,
            "labels": {"nvidia.com/gpu.product": product, "nvidia.com/gpu.memory": mib}}})
    };
    let docs = [
        job("sft", serde_json::json!({"memguard.io/enabled": "true"})),
        serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "axolotl", "namespace": "ml"},
            "data": {"lora-8b.yml": axolotl}}),
        node("NVIDIA-A30", "24576"),
        serde_json::json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "tb", "namespace": "ml"}, "spec": {"ports": [{"port": 6006}]}}),
        serde_json::json!({"apiVersion": "v1", "kind": "List",
            "items": [job("other", serde_json::json!({})), node("NVIDIA-A100-SXM4-80GB", "81920")]}),
    ];
    docs.iter()
        .map(|d| serde_json::to_string(d).expect("json"))
        .collect::<Vec<_>>()
        .join("\n---\n")
}

/// The `memguard.io/estimate` of the first Job's pod template in `doc`.
fn template_estimate(doc: &Value) -> Value {
    let text = doc["spec"]["template"]["metadata"]["annotations"]["memguard.io/estimate"]
        .as_str()
        .unwrap_or_else(|| panic!("the Job's template is admitted: {doc}"));
    serde_json::from_str(text).expect("estimate JSON")
}

/// Issue 36: a Job's pod template had no namespace, so the ConfigMap its trainer's config file
/// is mounted from was looked up in `default`, not in the Job's `ml`.
#[test]
fn a_jobs_pod_reads_its_config_map_in_the_jobs_namespace() {
    let out = memguard(
        &["mutate", "-f", "-", "-o", "json"],
        Some(&axolotl_workloads("ml")),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let list: Value = serde_json::from_str(&stdout(&out)).expect("one JSON value");
    let job = &list["items"][0];
    assert_eq!(job["kind"], "Job");
    let estimate = template_estimate(job);
    assert_eq!(
        estimate["sources"]["batch-size"], "configmap:axolotl/lora-8b.yml",
        "planned from the ConfigMap in the Job's namespace: {estimate}"
    );
    assert_eq!(estimate["budgetSource"]["kind"], "nodes", "{estimate}");
    assert!(
        job["spec"]["template"]["metadata"]
            .get("namespace")
            .is_none(),
        "the template is not given a namespace: {job}"
    );
    // In another namespace, `ml`'s ConfigMap is not the Job's.
    let out = memguard(
        &["mutate", "-f", "-", "-o", "json"],
        Some(&axolotl_workloads("team-b")),
    );
    let list: Value = serde_json::from_str(&stdout(&out)).expect("one JSON value");
    let annotations = &list["items"][0]["spec"]["template"]["metadata"]["annotations"];
    assert!(
        !annotations.to_string().contains("configmap:axolotl"),
        "{annotations}"
    );
}

/// Issue 36: `mutate` dropped the input's ConfigMaps and Nodes (and Lists' other items) from
/// its output, so `kubectl apply` lost them and a second `mutate` decided differently. Every
/// document comes back, in order, and mutating the output again changes nothing.
#[test]
fn mutate_prints_every_document_in_order_and_mutating_twice_changes_nothing() {
    let input = axolotl_workloads("ml");
    for format in ["yaml", "json"] {
        let once = memguard(&["mutate", "-f", "-", "-o", format], Some(&input));
        assert_eq!(once.status.code(), Some(0), "{format}: {}", stderr(&once));
        let first = stdout(&once);
        let twice = memguard(&["mutate", "-f", "-", "-o", format], Some(&first));
        assert_eq!(twice.status.code(), Some(0), "{format}: {}", stderr(&twice));
        assert_eq!(stdout(&twice), first, "{format}: the same output again");
        let patch = memguard(&["mutate", "-f", "-", "-o", "patch"], Some(&first));
        let lines: Vec<String> = stdout(&patch).lines().map(str::to_string).collect();
        assert!(
            !lines.is_empty() && lines.iter().all(|l| l == "[]"),
            "{format}: the second run patches nothing: {lines:?}"
        );
    }

    // YAML: the documents as given, a List as a List.
    let yaml = stdout(&memguard(&["mutate", "-f", "-"], Some(&input)));
    let docs: Vec<Value> = documents(&yaml);
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    assert_eq!(kinds, ["Job", "ConfigMap", "Node", "Service", "List"]);
    assert_eq!(docs[1]["data"]["lora-8b.yml"].as_str().map(str::len), {
        let cm: Vec<Value> = documents(&input);
        cm[1]["data"]["lora-8b.yml"].as_str().map(str::len)
    });
    assert_eq!(
        docs[2]["metadata"]["labels"]["nvidia.com/gpu.memory"],
        "24576"
    );
    assert_eq!(docs[4]["items"][1]["kind"], "Node");
    assert_eq!(docs[4]["items"][0]["metadata"]["name"], "other");
    template_estimate(&docs[0]);

    // JSON: one List of every object, a List's items in its place.
    let json: Value = serde_json::from_str(&stdout(&memguard(
        &["mutate", "-f", "-", "-o", "json"],
        Some(&input),
    )))
    .expect("json");
    let kinds: Vec<&str> = json["items"]
        .as_array()
        .expect("items")
        .iter()
        .filter_map(|d| d["kind"].as_str())
        .collect();
    assert_eq!(
        kinds,
        ["Job", "ConfigMap", "Node", "Service", "Job", "Node"]
    );

    // Patch: one line per document, a List's under `/items/N`.
    let patch = stdout(&memguard(
        &["mutate", "-f", "-", "-o", "patch"],
        Some(&input),
    ));
    let lines: Vec<Value> = patch
        .lines()
        .map(|l| serde_json::from_str(l).expect("a patch"))
        .collect();
    assert_eq!(lines.len(), 5, "{patch}");
    assert!(lines[0].as_array().is_some_and(|ops| !ops.is_empty()));
    assert!(
        lines[1..].iter().all(|p| p == &serde_json::json!([])),
        "{patch}"
    );
}

/// The documents of a YAML stream, as JSON values.
fn documents(text: &str) -> Vec<Value> {
    serde_saphyr::from_multiple(text).expect("YAML documents")
}

/// Issue 38, item 4: `memguard mutate` reads Nodes' taints and GKE's accelerator label from its
/// input, as the webhook's Node watch keeps them: a node tainted against the pod is not one it
/// can use (on the old code the budget was the tainted L4's).
#[test]
fn nodes_in_the_input_are_read_with_their_taints_and_cloud_labels() {
    let input = r#"
apiVersion: v1
kind: Pod
metadata:
  name: t
  labels: {memguard.io/enabled: "true"}
  annotations: {memguard.io/model: llama-3-8b, memguard.io/method: lora}
spec:
  containers:
    - name: trainer
      image: trainer
      resources: {limits: {nvidia.com/gpu: "1", vpc.amazonaws.com/efa: "1"}}
---
apiVersion: v1
kind: Node
metadata:
  name: l4
  labels: {nvidia.com/gpu.product: NVIDIA-L4, nvidia.com/gpu.memory: "23034"}
spec:
  taints: [{key: dedicated, value: inference, effect: NoSchedule}]
---
apiVersion: v1
kind: Node
metadata:
  name: a100
  labels: {cloud.google.com/gke-accelerator: nvidia-a100-80gb}
"#;
    let out = memguard(&["mutate", "-f", "-", "--output", "json"], Some(input));
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // Several documents print as one List, the Nodes kept beside the pod.
    let doc: Value = serde_json::from_str(&stdout(&out)).expect("json");
    let pod = doc["items"]
        .as_array()
        .and_then(|items| items.iter().find(|i| i["kind"] == "Pod"))
        .expect("the pod");
    let estimate: Value = serde_json::from_str(
        pod["metadata"]["annotations"]["memguard.io/estimate"]
            .as_str()
            .expect("estimate"),
    )
    .expect("estimate JSON");
    assert_eq!(
        estimate["budgetSource"]["detail"], "smallest of 1 GPU node: NVIDIA-A100-SXM4-80GB",
        "{estimate}"
    );
    assert!(
        !stderr(&out).contains("unknown accelerator"),
        "{}",
        stderr(&out)
    );
}
