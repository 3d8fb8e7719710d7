//! Coupled settings (issue 27): a DeepSpeed config that pins the micro-batch, and FSDP's own
//! activation checkpointing, end to end through the webhook's review (AdmissionReview in, JSON
//! patch out), with the ConfigMaps the pod mounts. The rewritten args are re-read with HF rules.

use base64::Engine;
use memguard_api::cluster::ConfigMapList;
use memguard_api::launch::{Flags, HfRules, find};
use memguard_api::{Policy, PolicySpec};
use memguard_webhook::mutate::ClusterView;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;

/// gemma-2b LoRA at batch 8 × accumulation 2, seq 2048 on an A10G: a plan that lowers the
/// batch (and turns checkpointing on) when nothing pins them.
// Not TRL (no `--use_peft`, no `trl` script): checkpointing is off until memguard turns it on
// (TRL's configs default it to on).
const SFT: &str = "accelerate launch --num_processes 1 sft.py \
                   --model_name_or_path google/gemma-2b --lora_r 16 \
                   --per_device_train_batch_size 8 --gradient_accumulation_steps 2 \
                   --max_seq_length 2048 --bf16 --output_dir /out";

fn pod(script: &str, config_map: Option<&str>) -> Value {
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "sft", "namespace": "ml",
                     "labels": {"memguard.io/enabled": "true"}},
        "spec": {
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A10G"},
            "containers": [{
                "name": "trainer",
                "image": "ghcr.io/example/trl:latest",
                "command": ["bash", "-c"],
                "args": [script],
                "workingDir": "/work",
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            }],
        },
    });
    if let Some(name) = config_map {
        pod["spec"]["containers"][0]["volumeMounts"] =
            json!([{"name": "cfg", "mountPath": "/work/cfg"}]);
        pod["spec"]["volumes"] = json!([{"name": "cfg", "configMap": {"name": name}}]);
    }
    pod
}

fn maps(name: &str, key: &str, text: &str) -> ClusterView {
    let mut list = ConfigMapList::default();
    list.0.insert(
        ("ml".into(), name.into()),
        BTreeMap::from([(key.to_string(), text.to_string())]),
    );
    ClusterView::default().with_config_maps(Arc::new(list))
}

/// What the webhook answered: the patched pod, the warnings, the pod's annotations.
struct Admitted {
    pod: Value,
    warnings: Vec<String>,
}

impl Admitted {
    fn flags(&self) -> Flags {
        let script = self.pod["spec"]["containers"][0]["args"][0]
            .as_str()
            .expect("the script");
        let items = vec!["bash".to_string(), "-c".into(), script.to_string()];
        let launch = find(&items).expect("still a launch");
        Flags::parse(&launch.texts(), &HfRules)
    }

    fn count(&self, key: &str) -> u64 {
        self.flags()
            .value(key)
            .and_then(|v| v.parse().ok())
            .unwrap_or(1)
    }

    fn estimate(&self) -> Value {
        let text = self.pod["metadata"]["annotations"]["memguard.io/estimate"]
            .as_str()
            .expect("an estimate annotation");
        serde_json::from_str(text).expect("JSON")
    }
}

fn admit(pod: &Value, view: &ClusterView) -> Admitted {
    let policy: Policy = serde_json::from_value::<PolicySpec>(json!({}))
        .expect("policy")
        .resolved()
        .expect("valid");
    let (pod, warnings) = super::admitted(pod, &policy, view);
    Admitted { pod, warnings }
}

const DS_PINNED: &str = r#"{"zero_optimization": {"stage": 2},
    "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}"#;
const DS_AUTO: &str = r#"{"zero_optimization": {"stage": 2},
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto"}"#;

fn kept(a: &Admitted) {
    assert_eq!(
        (
            a.count("per_device_train_batch_size"),
            a.count("gradient_accumulation_steps")
        ),
        (8, 2),
        "batch and accumulation as written: {:?}",
        a.warnings
    );
}

/// The control: with `"auto"` values the DeepSpeed config pins nothing, and the batch is traded
/// for accumulation as without it.
#[test]
fn a_deepspeed_config_with_auto_values_lets_the_batch_change() {
    let script = format!("{SFT} --deepspeed cfg/ds.json");
    let a = admit(&pod(&script, Some("ds")), &maps("ds", "ds.json", DS_AUTO));
    let (batch, accumulation) = (
        a.count("per_device_train_batch_size"),
        a.count("gradient_accumulation_steps"),
    );
    assert!(batch < 8, "downgraded: {:?}", a.warnings);
    assert_eq!(batch * accumulation, 16);
}

/// A DeepSpeed config from the pod's ConfigMap with numeric micro-batch and accumulation: the
/// batch is not changed, and the warning names the file and the keys.
#[test]
fn a_deepspeed_config_that_pins_the_micro_batch_keeps_the_batch_and_says_why() {
    let script = format!("{SFT} --deepspeed cfg/ds.json");
    let a = admit(&pod(&script, Some("ds")), &maps("ds", "ds.json", DS_PINNED));
    kept(&a);
    let said = a.warnings.join("\n");
    assert!(
        said.contains(
            "batch and accumulation kept: configmap:ds/ds.json (--deepspeed cfg/ds.json) pins"
        ),
        "{said}"
    );
    // The full reason is in the estimate's error when the plan cannot fit, else in the warning:
    // the key is named in one of them.
    let error = a.pod["metadata"]["annotations"]["memguard.io/error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        said.contains("train_micro_batch_size_per_gpu=8")
            || error.contains("train_micro_batch_size_per_gpu=8"),
        "{said}\n{error}"
    );
    // Other knobs still move: checkpointing is turned on in the trainer's flags.
    assert_eq!(
        a.flags().bool("gradient_checkpointing", &HfRules),
        Some(true),
        "{said}"
    );
    // A second admission changes nothing.
    let again = admit(&a.pod, &maps("ds", "ds.json", DS_PINNED));
    assert_eq!(again.pod, a.pod);
}

/// A DeepSpeed config in the image (no ConfigMap holds it) may pin the micro-batch: the batch
/// is not changed, and the warning says the file could not be read.
#[test]
fn an_unreadable_deepspeed_config_keeps_the_batch_and_says_why() {
    let script = format!("{SFT} --deepspeed ds_z3.json");
    let a = admit(&pod(&script, None), &ClusterView::default());
    kept(&a);
    let said = a.warnings.join("\n");
    assert!(
        said.contains("batch and accumulation kept: ") && said.contains("--deepspeed ds_z3.json"),
        "{said}"
    );
}

/// Inline JSON and base64, as transformers and accelerate take them, are read too.
#[test]
fn an_inline_or_base64_deepspeed_config_is_read() {
    let inline = r#"{"train_micro_batch_size_per_gpu":8,"gradient_accumulation_steps":"auto"}"#;
    let encoded = base64::engine::general_purpose::URL_SAFE.encode(inline);
    for (value, named) in [
        (format!("'{inline}'"), "--deepspeed (inline JSON)"),
        (encoded, "--deepspeed (base64 JSON)"),
    ] {
        let a = admit(
            &pod(&format!("{SFT} --deepspeed {value}"), None),
            &ClusterView::default(),
        );
        kept(&a);
        let said = a.warnings.join("\n");
        assert!(
            said.contains(&format!(
                "kept: {named} pins train_micro_batch_size_per_gpu=8"
            )),
            "{said}"
        );
    }
    let auto = r#"{"train_micro_batch_size_per_gpu":"auto"}"#;
    let a = admit(
        &pod(&format!("{SFT} --deepspeed '{auto}'"), None),
        &ClusterView::default(),
    );
    assert!(
        a.count("per_device_train_batch_size") < 8,
        "{:?}",
        a.warnings
    );
}

/// accelerate's own `--deepspeed_config_file` pins the same way.
#[test]
fn accelerates_deepspeed_config_file_is_read() {
    let script = SFT.replace(
        "accelerate launch",
        "accelerate launch --use_deepspeed --deepspeed_config_file /work/cfg/ds.json",
    );
    let a = admit(&pod(&script, Some("ds")), &maps("ds", "ds.json", DS_PINNED));
    kept(&a);
    assert!(
        a.warnings.join("\n").contains("--deepspeed_config_file"),
        "{:?}",
        a.warnings
    );
}

/// FSDP's own activation checkpointing (in an `--fsdp_config` file from a ConfigMap, inline, or
/// accelerate's option): checkpointing counts as on, with that source, and memguard never adds
/// `--gradient_checkpointing`, which transformers refuses with it.
#[test]
fn fsdp_activation_checkpointing_is_checkpointing_and_never_doubled() {
    // The control: without FSDP the plan turns checkpointing on in the trainer's flags.
    let plain = admit(&pod(SFT, None), &ClusterView::default());
    assert_eq!(
        plain.flags().bool("gradient_checkpointing", &HfRules),
        Some(true),
        "{:?}",
        plain.warnings
    );
    let fsdp_json = r#"{"fsdp_activation_checkpointing": true, "fsdp_version": 2}"#;
    let cases = [
        (
            format!("{SFT} --fsdp full_shard --fsdp_config cfg/fsdp.json"),
            Some("fsdp"),
            "configmap:fsdp/fsdp.json",
        ),
        (
            format!(
                r#"{SFT} --fsdp full_shard --fsdp_config '{{"activation_checkpointing": "true"}}'"#
            ),
            None,
            "args",
        ),
        (
            SFT.replace(
                "accelerate launch",
                "accelerate launch --use_fsdp --fsdp_activation_checkpointing true",
            ),
            None,
            "args",
        ),
    ];
    for (script, config_map, source) in cases {
        let a = admit(
            &pod(&script, config_map),
            &maps("fsdp", "fsdp.json", fsdp_json),
        );
        assert_eq!(
            a.flags().get("gradient_checkpointing"),
            None,
            "{script}: {:?}",
            a.warnings
        );
        let estimate = a.estimate();
        assert_eq!(
            estimate["sources"]["grad-checkpointing"], source,
            "{script}"
        );
        assert_eq!(estimate["config"]["grad-checkpointing"], "true", "{script}");
        // The batch still moves, with the effective batch kept.
        let batch = a.count("per_device_train_batch_size");
        assert_eq!(
            batch * a.count("gradient_accumulation_steps"),
            16,
            "{script}"
        );
    }
}

/// One DeepSpeed rule (issue 36): the same DeepSpeed JSON pins the micro-batch for axolotl's
/// `deepspeed:` key exactly when it does for HF's `--deepspeed` flag. Before, numeric strings
/// pinned only the HF launch and `train_batch_size` only axolotl's.
#[test]
fn axolotls_deepspeed_key_and_hfs_deepspeed_flag_agree() {
    const AXOLOTL: &str = "base_model: google/gemma-2b\nadapter: lora\nlora_r: 16\n\
                           micro_batch_size: 8\ngradient_accumulation_steps: 2\n\
                           sequence_len: 2048\nbf16: true\ndeepspeed: cfg/ds.json\n";
    let configs = [
        (DS_PINNED, true),
        (DS_AUTO, false),
        (
            r#"{"train_micro_batch_size_per_gpu": "8", "gradient_accumulation_steps": "auto"}"#,
            true,
        ),
        (
            r#"{"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto"}"#,
            false,
        ),
    ];
    for (ds, pins) in configs {
        let mut list = ConfigMapList::default();
        list.0.insert(
            ("ml".into(), "cfg".into()),
            BTreeMap::from([
                ("ds.json".to_string(), ds.to_string()),
                ("axolotl.yml".to_string(), AXOLOTL.to_string()),
            ]),
        );
        let view = ClusterView::default().with_config_maps(Arc::new(list));
        let hf = admit(
            &pod(&format!("{SFT} --deepspeed cfg/ds.json"), Some("cfg")),
            &view,
        );
        let axolotl = admit(
            &pod(
                "accelerate launch -m axolotl.cli.train cfg/axolotl.yml",
                Some("cfg"),
            ),
            &view,
        );
        let batch_moved = |a: &Admitted| {
            let e = a.pod["metadata"]["annotations"]["memguard.io/estimate"]
                .as_str()
                .map(|t| serde_json::from_str::<Value>(t).expect("JSON"));
            e.is_some_and(|e| e["config"]["batch-size"] != "8")
        };
        assert_eq!(
            batch_moved(&hf),
            !pins,
            "HF --deepspeed with {ds}: {:?}",
            hf.warnings
        );
        assert_eq!(
            batch_moved(&axolotl),
            !pins,
            "axolotl deepspeed: with {ds}: {:?}",
            axolotl.warnings
        );
    }
}
