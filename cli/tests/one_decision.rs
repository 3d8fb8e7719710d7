//! One decision, three commands: the same pods under the same policies through `memguard
//! mutate` (admission), `memguard estimate --policy-file` (the pod described by flags) and
//! `memguard explain` (the pod after its run, and the next one) give the same budget, the same
//! plan and the same profile key. Through the real binary.

use serde_json::{Value, json};
use std::path::Path;
use std::process::{Command, Output};

const DRA_OBJECTS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../webhook/tests/fixtures/dra/objects.yaml"
);

/// One pod and policy, and the `memguard estimate` flags describing the same pod.
struct Case {
    name: &'static str,
    policy: &'static str,
    /// `memguard.io/` annotations (without the prefix), the same as estimate flags.
    annotations: &'static [(&'static str, &'static str)],
    /// The trainer's `resources.limits`.
    limits: Value,
    /// `spec.nodeSelector`.
    node_selector: Option<Value>,
    /// `spec.resourceClaims`.
    claims: Option<Value>,
    /// The estimate flags for what the pod asks besides its annotations.
    pod_flags: &'static [&'static str],
    /// Whether the DRA objects are given (`--dra`).
    dra: bool,
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "the policy's floors keep the sequence: cannot fit",
            policy: "floors: {seqLength: 2048}\n",
            annotations: &[
                ("model", "llama-3-8b"),
                ("method", "lora"),
                ("batch-size", "4"),
                ("seq-length", "4096"),
                ("gpu-memory", "22GiB"),
            ],
            limits: json!({"nvidia.com/gpu": "1"}),
            node_selector: None,
            claims: None,
            pod_flags: &["--gpu-resource", "nvidia.com/gpu"],
            dra: false,
        },
        Case {
            name: "a pinned product from the policy's table, its batch floor",
            policy: "floors: {batchSize: 2}\nsafetyRatio: 0.85\n",
            annotations: &[
                ("model", "llama-3-8b"),
                ("method", "lora"),
                ("batch-size", "16"),
                ("seq-length", "4096"),
            ],
            limits: json!({"nvidia.com/gpu": "1"}),
            node_selector: Some(json!({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"})),
            claims: None,
            pod_flags: &[
                "--gpu-resource",
                "nvidia.com/gpu",
                "--gpu-product",
                "NVIDIA-A100-SXM4-40GB",
            ],
            dra: false,
        },
        Case {
            name: "a GPU known only through its DRA claim",
            policy: "floors: {seqLength: 1024}\n",
            annotations: &[
                ("model", "llama-3-8b"),
                ("method", "full"),
                ("batch-size", "8"),
                ("seq-length", "4096"),
            ],
            limits: json!({}),
            node_selector: None,
            claims: Some(json!([{"name": "gpu", "resourceClaimTemplateName": "single-h100"}])),
            pod_flags: &["--dra-claim", "single-h100", "--dra", DRA_OBJECTS],
            dra: true,
        },
    ]
}

impl Case {
    fn pod(&self) -> Value {
        let annotations: serde_json::Map<String, Value> = self
            .annotations
            .iter()
            .map(|(k, v)| (format!("memguard.io/{k}"), json!(v)))
            .collect();
        let mut spec = json!({"restartPolicy": "Never", "containers": [
            {"name": "trainer", "image": "x", "resources": {"limits": self.limits}}]});
        if let Some(s) = &self.node_selector {
            spec["nodeSelector"] = s.clone();
        }
        if let Some(c) = &self.claims {
            spec["resourceClaims"] = c.clone();
        }
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "job-0", "namespace": "ml",
                "labels": {"memguard.io/enabled": "true"}, "annotations": annotations},
            "spec": spec})
    }

    fn dra_flags(&self) -> Vec<&str> {
        if self.dra {
            vec!["--dra", DRA_OBJECTS]
        } else {
            Vec::new()
        }
    }
}

/// The real binary's JSON output for `args`, run in `dir`; `what` names the call in a failure.
fn memguard_json(dir: &Path, args: &[&str], what: &str) -> Value {
    let mut memguard = Command::new(env!("CARGO_BIN_EXE_memguard"));
    let out: Output = memguard
        .current_dir(dir)
        .args(args)
        .output()
        .expect("it runs");
    // `mutate` exits 2 for a skipped pod; none of these is skipped. `estimate` exits 3 for a
    // plan that does not fit.
    let stderr = String::from_utf8_lossy(&out.stderr);
    let value: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{what}: {e}: {:?}: {stderr}", out.status));
    let expected = if args[0] == "estimate" && value["fits"] == false {
        3
    } else {
        0
    };
    assert_eq!(out.status.code(), Some(expected), "{what}: {stderr}");
    value
}

/// `memguard mutate` of `pod` under the case's policy (and `profile`), as JSON.
fn mutate(dir: &Path, case: &Case, pod: &Value, profile: Option<&Value>) -> Value {
    std::fs::write(dir.join("pod.json"), pod.to_string()).expect("write");
    let mut args: Vec<&str> = "mutate -o json -f pod.json --policy-file policy.yaml"
        .split(' ')
        .collect();
    args.extend(case.dra_flags());
    if let Some(p) = profile {
        std::fs::write(dir.join("profile.json"), p.to_string()).expect("write");
        args.extend(["--profile", "profile.json"]);
    }
    memguard_json(dir, &args, "mutate")
}

/// The decision as `memguard.io/estimate` carries it: budget, fits, the planned knobs.
fn admitted(pod: &Value) -> (Value, Value, Value) {
    let text = pod["metadata"]["annotations"]["memguard.io/estimate"]
        .as_str()
        .unwrap_or_else(|| panic!("no estimate annotation: {pod}"));
    let a: Value = serde_json::from_str(text).expect("estimate json");
    (a["budget"].clone(), a["fits"].clone(), a["config"].clone())
}

/// The knobs a plan sets, as `memguard.io/estimate` names them.
const KNOBS: [&str; 6] = [
    "batch-size",
    "grad-accumulation",
    "grad-checkpointing",
    "seq-length",
    "lora-rank",
    "lora-layers",
];

/// The planned knobs of `config`, each read under `field(name)` (the annotation's own names,
/// `memguard estimate`'s snake_case, `memguard explain`'s camelCase), values as strings.
fn knobs(config: &Value, field: impl Fn(&str) -> String) -> Value {
    let value = |name: &str| match &config[field(name).as_str()] {
        Value::Null => Value::Null,
        Value::String(s) => json!(s),
        v => json!(v.to_string()),
    };
    KNOBS
        .iter()
        .map(|name| (name.to_string(), value(name)))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

fn planned(config: &Value) -> Value {
    knobs(config, str::to_string)
}

fn knobs_of_estimate(config: &Value) -> Value {
    knobs(config, |name| name.replace('-', "_"))
}

fn knobs_of_explain(config: &Value) -> Value {
    knobs(config, |name| {
        let mut parts = name.split('-');
        let mut out = parts.next().unwrap_or_default().to_string();
        for part in parts {
            let mut chars = part.chars();
            out.extend(chars.next().map(|c| c.to_ascii_uppercase()));
            out.push_str(chars.as_str());
        }
        out
    })
}

#[test]
fn mutate_estimate_and_explain_give_the_same_budget_plan_and_key() {
    for case in cases() {
        let name = case.name;
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        std::fs::write(d.join("policy.yaml"), case.policy).expect("write");

        // memguard estimate: the flags are the annotations, plus what the pod asks for.
        let mut args: Vec<String> = vec!["estimate".into()];
        for (k, v) in case.annotations {
            args.extend([format!("--{k}"), v.to_string()]);
        }
        args.extend(case.pod_flags.iter().map(|s| s.to_string()));
        args.extend(["--policy-file", "policy.yaml", "--output", "json"].map(String::from));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let estimate = memguard_json(d, &args, name);
        let key = &estimate["profile"];
        assert!(
            key["name"].is_string(),
            "{name}: no profile key: {estimate}"
        );

        // memguard mutate: the same budget, verdict and plan.
        let pod = case.pod();
        let first = mutate(d, &case, &pod, None);
        let (budget, fits, config) = admitted(&first);
        assert_eq!(budget, estimate["budget_bytes"], "{name}: budget");
        assert_eq!(fits, estimate["fits"], "{name}: fits");
        assert_eq!(
            planned(&config),
            knobs_of_estimate(&estimate["config"]),
            "{name}: plan"
        );

        // The pod is OOM-killed; memguard explain: the same budget, the config it ran, the key
        // the controller records it under.
        let mut dead = first.clone();
        dead["metadata"]["uid"] = json!("uid-0");
        dead["status"] = json!({"phase": "Failed", "containerStatuses": [{"name": "trainer",
            "image": "x", "imageID": "", "ready": false, "restartCount": 0, "state": {
            "terminated": {"exitCode": 137, "reason": "OOMKilled",
            "finishedAt": "2026-11-26T10:00:00Z"}}}]});
        std::fs::write(d.join("dead.json"), dead.to_string()).expect("write");
        let mut args: Vec<&str> = "explain -f dead.json -o json --policy-file policy.yaml"
            .split(' ')
            .collect();
        args.extend(case.dra_flags());
        let explained = memguard_json(d, &args, name);
        assert_eq!(
            explained["budget"]["bytes"], estimate["budget_bytes"],
            "{name}"
        );
        assert_eq!(
            planned(&json!(explained["config"])),
            knobs_of_estimate(&estimate["config"]),
            "{name}: the config that ran"
        );
        let profile = &explained["next"]["profile"];
        assert_eq!(profile["name"], key["name"], "{name}: key");
        assert_eq!(profile["spec"], key["spec"], "{name}: key");
        let verdict = if fits == json!(true) {
            "one step down"
        } else {
            "cannot fit"
        };
        assert_eq!(explained["next"]["verdict"], verdict, "{name}");

        // memguard mutate with that profile reads it under its key: the next pod is the one
        // explain announced, one step down.
        let manifest = json!({"apiVersion": "training.memguard.io/v1alpha1", "kind": "MemoryProfile",
            "metadata": {"name": profile["name"], "namespace": "ml"},
            "spec": profile["spec"], "status": profile["status"]});
        let next = mutate(d, &case, &pod, Some(&manifest));
        let (_, _, next_config) = admitted(&next);
        let annotation: Value = serde_json::from_str(
            next["metadata"]["annotations"]["memguard.io/estimate"]
                .as_str()
                .expect("annotation"),
        )
        .expect("json");
        assert!(annotation["recovery"].is_string(), "{name}: {annotation}");
        assert_eq!(
            planned(&next_config),
            knobs_of_explain(&explained["next"]["config"]),
            "{name}: the next pod"
        );
        if fits == json!(true) {
            assert_ne!(
                planned(&next_config),
                planned(&config),
                "{name}: one step down"
            );
        }
    }
}
