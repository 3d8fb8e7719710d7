//! A bespoke training script read and rewritten with the policy's per-image flag map.

use memguard_api::launch::{MappedRules, find};
use memguard_api::{Policy, PolicySpec};
use memguard_webhook::mutate::ClusterView;
use serde_json::{Value, json};

fn policy() -> Policy {
    serde_json::from_value::<PolicySpec>(json!({"flagMaps": [{
        "image": "registry.example.com/team/trainer*",
        "flags": {"batch-size": "--bs", "grad-accumulation": "--accum",
                  "grad-checkpointing": "--ckpt", "seq-length": "--seq"}}]}))
    .expect("policy")
    .resolved()
    .expect("valid")
}

fn pod(image: &str, args: &[&str]) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "t", "namespace": "ml", "labels": {"memguard.io/enabled": "true"},
            "annotations": {"memguard.io/model": "llama-3-8b", "memguard.io/method": "lora"}},
        "spec": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A10G"},
            "containers": [{"name": "trainer", "image": image,
                "command": ["python", "train.py"], "args": args,
                "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
    })
}

/// The pod after admission, and the estimate annotation.
fn admit(pod: &Value, policy: &Policy) -> (Value, Value) {
    let (out, _) = super::admitted(pod, policy, &ClusterView::default());
    let estimate = super::estimate_of(&out);
    (out, estimate)
}

/// The mapped flags' values in the admitted pod, read back with the map's rules.
fn read_back(pod: &Value, key: &str) -> Option<String> {
    let c = &pod["spec"]["containers"][0];
    let items: Vec<String> = c["command"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(c["args"].as_array().into_iter().flatten())
        .filter_map(|v| v.as_str().map(str::to_string))
        .collect();
    let launch = find(&items).expect("a launch");
    let rules = MappedRules::new(["--bs", "--accum", "--ckpt", "--seq"], ["--ckpt"]);
    memguard_api::launch::Flags::parse(&launch.texts(), &rules)
        .value(key)
        .map(str::to_string)
}

#[test]
fn a_bespoke_script_is_read_and_rewritten_in_its_own_flags() {
    let policy = policy();
    let args = ["--bs", "16", "--accum=1", "--seq", "4096", "--out", "/o"];
    let p = pod("registry.example.com/team/trainer:1.2", &args);
    let (out, estimate) = admit(&p, &policy);
    // Read from the script's flags, with their source.
    for knob in ["batch-size", "grad-accumulation", "seq-length"] {
        assert_eq!(estimate["sources"][knob], "args", "{knob}: {estimate}");
    }
    assert_eq!(estimate["read"]["batch-size"], "16");
    assert_eq!(estimate["read"]["seq-length"], "4096");
    // Rewritten in them: batch down, accumulation up, their product kept; the sequence (a
    // quality knob) untouched.
    let batch: u64 = read_back(&out, "bs").expect("--bs").parse().expect("n");
    let accum: u64 = read_back(&out, "accum")
        .expect("--accum")
        .parse()
        .expect("n");
    assert!(batch < 16, "{batch}");
    assert_eq!(batch * accum, 16);
    assert_eq!(read_back(&out, "seq").as_deref(), Some("4096"));
    assert_eq!(estimate["config"]["batch-size"], batch.to_string());
    assert!(
        estimate["changed"].to_string().contains("--bs 16→"),
        "{estimate}"
    );
    // Idempotent: a second admission changes nothing.
    let (again, _) = admit(&out, &policy);
    assert_eq!(again["spec"], out["spec"]);

    // An image the map does not name keeps its args: its flags mean nothing to memguard.
    let other = pod("registry.example.com/other:1", &args);
    let (kept, _) = admit(&other, &policy);
    assert_eq!(
        kept["spec"]["containers"][0]["args"],
        other["spec"]["containers"][0]["args"]
    );
}

#[test]
fn a_map_without_accumulation_never_breaks_the_effective_batch() {
    let policy: Policy = serde_json::from_value::<PolicySpec>(json!({"flagMaps": [{
        "image": "registry.example.com/team/trainer*", "flags": {"batch-size": "--bs"}}]}))
    .expect("policy")
    .resolved()
    .expect("valid");
    let p = pod(
        "registry.example.com/team/trainer:1",
        &["--bs", "16", "--seq", "4096"],
    );
    let (out, _) = admit(&p, &policy);
    assert_eq!(
        out["spec"]["containers"][0]["args"], p["spec"]["containers"][0]["args"],
        "unchanged"
    );
    let error = out["metadata"]["annotations"]["memguard.io/error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        error.contains("the effective batch cannot be kept"),
        "{error}"
    );
}

/// ms-swift's `swift sft`, label-only: its own flag names (`--lora_rank`, `--train_type`) are
/// read, and the plan written in them.
#[test]
fn a_label_only_swift_sft_launch_is_read_and_rewritten() {
    let policy = Policy::default();
    let mut p = pod(
        "modelscope/ms-swift:3",
        &[
            "sft",
            "--model",
            "Qwen/Qwen2.5-7B-Instruct",
            "--train_type",
            "lora",
            "--lora_rank",
            "8",
            "--per_device_train_batch_size",
            "8",
            "--gradient_accumulation_steps",
            "2",
            "--max_length",
            "2048",
            "--output_dir",
            "/out",
        ],
    );
    p["metadata"]["annotations"] = json!({});
    p["spec"]["containers"][0]["command"] = json!(["swift"]);
    let (out, estimate) = admit(&p, &policy);
    assert_eq!(estimate["sources"]["model"], "args", "{estimate}");
    assert_eq!(estimate["sources"]["method"], "args", "{estimate}");
    assert_eq!(estimate["sources"]["lora-rank"], "args", "{estimate}");
    assert_eq!(estimate["read"]["batch-size"], "8", "{estimate}");
    let args = out["spec"]["containers"][0]["args"].clone();
    let at = |flag: &str| -> u64 {
        let a = args.as_array().expect("args");
        let i = a.iter().position(|w| w == flag).expect(flag);
        a[i + 1].as_str().expect("value").parse().expect("number")
    };
    let (batch, accum) = (
        at("--per_device_train_batch_size"),
        at("--gradient_accumulation_steps"),
    );
    assert!(batch < 8, "{args}");
    assert_eq!(batch * accum, 16);
    let (again, _) = admit(&out, &policy);
    assert_eq!(again["spec"], out["spec"]);
}
