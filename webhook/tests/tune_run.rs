//! torchtune's `tune run`, label-only, through `mutate`: the model, method and knobs come from
//! the built-in config's defaults (torchtune at `TORCHTUNE_COMMIT`) or from a config file in a
//! ConfigMap, the `key=value` overrides win, and the plan is written back as trailing overrides
//! that the real OmegaConf (`fixtures/tune/omegaconf_merge.py`, torchtune's merge) reads as
//! planned.

use memguard_api::Policy;
use memguard_api::cluster::ConfigMapList;
use memguard_api::launch::tune::{BuiltinConfig, builtin};
use memguard_estimator::TrainingConfig;
use memguard_webhook::{ClusterView, Outcome, mutate};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;

fn pod(args: &[&str], volumes: Value, mounts: Value) -> k8s_openapi::api::core::v1::Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "tune",
            "namespace": "ml",
            "labels": {"memguard.io/enabled": "true"},
            "annotations": {"memguard.io/gpu-memory": "24Gi"},
        },
        "spec": {
            "containers": [{
                "name": "trainer",
                "image": "pytorch/torchtune:latest",
                "command": args,
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                "volumeMounts": mounts,
            }],
            "volumes": volumes,
        },
    }))
    .expect("a pod")
}

/// A config as nested JSON, from dotted keys and YAML scalars.
fn nested(values: &[(&str, String)]) -> Value {
    let mut out = json!({});
    for (key, value) in values {
        let parsed: Value =
            serde_json::from_str(&value.to_ascii_lowercase()).unwrap_or_else(|_| json!(value));
        let mut node = &mut out;
        let parts: Vec<&str> = key.split('.').collect();
        for p in &parts[..parts.len() - 1] {
            node = node
                .as_object_mut()
                .expect("table")
                .entry(p.to_string())
                .or_insert_with(|| json!({}));
        }
        node[parts[parts.len() - 1]] = parsed;
    }
    out
}

/// The config torchtune runs with: `config` merged with the overrides after the recipe's
/// `--config NAME`, by the real OmegaConf.
fn omegaconf(config: &Value, command: &[String]) -> Value {
    let at = command
        .iter()
        .position(|w| w == "--config")
        .expect("--config");
    let request = json!({"config": config, "args": command[at + 2..]});
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tune/omegaconf_merge.py"
    );
    let mut child = Command::new("python3")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(request.to_string().as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("omegaconf");
    assert!(out.status.success(), "omegaconf_merge.py failed");
    serde_json::from_slice(&out.stdout).expect("JSON")
}

fn assert_planned(merged: &Value, cfg: &TrainingConfig) {
    assert_eq!(merged["batch_size"], json!(cfg.batch_size));
    assert_eq!(
        merged["gradient_accumulation_steps"],
        json!(cfg.grad_accumulation)
    );
    assert_eq!(
        merged["enable_activation_checkpointing"],
        json!(cfg.grad_checkpointing)
    );
    assert_eq!(merged["model"]["lora_rank"], json!(cfg.lora_rank));
}

#[test]
fn a_builtin_config_is_planned_on_its_defaults_and_the_overrides() {
    let args = [
        "tune",
        "run",
        "lora_finetune_single_device",
        "--config",
        "llama3_1/8B_lora_single_device",
        "batch_size=8",
        "tokenizer.max_seq_len=4096",
    ];
    let p = pod(&args, json!([]), json!([]));
    let Outcome::Mutated(m) = mutate(&p, &Policy::default(), &ClusterView::default()) else {
        panic!("mutated")
    };
    let builtin: &BuiltinConfig = builtin("llama3_1/8B_lora_single_device").expect("built in");
    let source = "config:llama3_1/8B_lora_single_device";
    assert_eq!(m.plan.config.model.name.as_deref(), Some("llama-3.1-8b"));
    assert_eq!(m.estimate.read["batch-size"], "8");
    assert_eq!(m.estimate.sources["batch-size"], "args");
    assert_eq!(m.estimate.read["seq-length"], "4096");
    assert_eq!(m.estimate.sources["seq-length"], "args");
    assert_eq!(m.estimate.read["grad-accumulation"], "8");
    assert_eq!(m.estimate.sources["grad-accumulation"], source);
    assert_eq!(m.estimate.sources["grad-checkpointing"], source);
    assert_eq!(m.estimate.sources["lora-rank"], source);
    let cfg = &m.plan.config;
    assert!(cfg.batch_size < 8, "downgraded: {:?}", m.plan.steps);
    assert_eq!(
        cfg.batch_size * cfg.grad_accumulation,
        64,
        "batch × accumulation kept"
    );
    let line = m.command_line.as_ref().expect("rewritten");
    // The container's argv: appended overrides go to `args` when the pod has none.
    let command: Vec<String> = line
        .command
        .iter()
        .chain(&line.args)
        .flatten()
        .cloned()
        .collect();
    // The launch before the overrides is kept; the overrides follow.
    assert_eq!(command[..5], args[..5]);
    let base: Vec<(&str, String)> = builtin
        .values
        .iter()
        .map(|(k, v)| (*k, v.to_string()))
        .collect();
    let merged = omegaconf(&nested(&base), &command);
    assert_planned(&merged, cfg);
    assert_eq!(merged["tokenizer"]["max_seq_len"], json!(cfg.seq_length));

    // Admitted again as written: the same plan, read from the same sources; nothing to change.
    let mut again = pod(&[], json!([]), json!([]));
    again.spec.as_mut().expect("spec").containers[0].command = line.command.clone();
    again.spec.as_mut().expect("spec").containers[0].args = line.args.clone();
    let estimate = m.estimate.to_json();
    again
        .metadata
        .annotations
        .get_or_insert_default()
        .insert("memguard.io/estimate".into(), estimate.clone());
    let Outcome::Mutated(m2) = mutate(&again, &Policy::default(), &ClusterView::default()) else {
        panic!("mutated")
    };
    // (The plan is the same, so its command line is the one the pod has: the patch step
    // writes nothing.)
    let line2 = m2.command_line.as_ref().expect("the plan's command line");
    assert_eq!((&line2.command, &line2.args), (&line.command, &line.args));
    assert_eq!(m2.estimate.to_json(), estimate);
}

#[test]
fn a_config_file_in_a_configmap_is_read_and_never_edited() {
    let yaml = "model:\n  _component_: torchtune.models.llama3_2.lora_llama3_2_1b\n  \
                lora_rank: 64\ntokenizer:\n  _component_: torchtune.models.llama3.llama3_tokenizer\n  \
                max_seq_len: 8192\nbatch_size: 32\ngradient_accumulation_steps: 2\n\
                enable_activation_checkpointing: False\n";
    let args = [
        "tune",
        "run",
        "--nproc_per_node",
        "1",
        "lora_finetune_single_device",
        "--config",
        "/cfg/lora.yaml",
        "~model.lora_rank",
        "model.lora_rank=128",
    ];
    let p = pod(
        &args,
        json!([{"name": "cfg", "configMap": {"name": "tune-cfg"}}]),
        json!([{"name": "cfg", "mountPath": "/cfg"}]),
    );
    let maps = ConfigMapList(BTreeMap::from([(
        ("ml".to_string(), "tune-cfg".to_string()),
        BTreeMap::from([("lora.yaml".to_string(), yaml.to_string())]),
    )]));
    let view = ClusterView::default().with_config_maps(Arc::new(maps));
    let Outcome::Mutated(m) = mutate(&p, &Policy::default(), &view) else {
        panic!("mutated")
    };
    let source = "configmap:tune-cfg/lora.yaml";
    assert_eq!(m.plan.config.model.name.as_deref(), Some("llama-3.2-1b"));
    assert_eq!(m.estimate.read["batch-size"], "32");
    assert_eq!(m.estimate.sources["batch-size"], source);
    assert_eq!(m.estimate.read["seq-length"], "8192");
    assert_eq!(m.estimate.sources["seq-length"], source);
    assert_eq!(m.estimate.read["lora-rank"], "128");
    assert_eq!(m.estimate.sources["lora-rank"], "args");
    let cfg = &m.plan.config;
    assert_eq!(cfg.batch_size * cfg.grad_accumulation, 64);
    assert!(cfg.batch_size < 32, "downgraded: {:?}", m.plan.steps);
    let line = m.command_line.as_ref().expect("rewritten");
    // The container's argv: appended overrides go to `args` when the pod has none.
    let command: Vec<String> = line
        .command
        .iter()
        .chain(&line.args)
        .flatten()
        .cloned()
        .collect();
    let config = nested(&[
        ("batch_size", "32".into()),
        ("gradient_accumulation_steps", "2".into()),
        ("enable_activation_checkpointing", "False".into()),
        ("tokenizer.max_seq_len", "8192".into()),
        ("model.lora_rank", "64".into()),
    ]);
    let merged = omegaconf(&config, &command);
    assert_planned(&merged, cfg);
}

#[test]
fn a_config_file_that_is_not_mounted_is_said() {
    let mut p = pod(
        &[
            "tune",
            "run",
            "full_finetune_single_device",
            "--config",
            "/nowhere/x.yaml",
        ],
        json!([]),
        json!([]),
    );
    // Pinned by its node's GPU, so the launch is all that names the model.
    p.metadata.annotations = None;
    if let Some(spec) = p.spec.as_mut() {
        spec.node_selector = Some(BTreeMap::from([(
            "nvidia.com/gpu.product".to_string(),
            "NVIDIA-A10G".to_string(),
        )]));
    }
    match mutate(&p, &Policy::default(), &ClusterView::default()) {
        Outcome::Guarded(g) => {
            assert!(g.reason.contains("/nowhere/x.yaml"), "{}", g.reason);
        }
        other => panic!("{other:?}"),
    }
}

/// The `tune run` shapes of the launch corpus (`tests/corpus/launch/torchtune-*.yaml`, from
/// torchtune's README with provenance) read as they expect: the model, each knob's value and
/// its source.
#[test]
fn the_corpus_tune_run_shapes_read_as_expected() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/corpus/launch");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).expect("the corpus") {
        let path = entry.expect("entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if !name.starts_with("torchtune-") {
            continue;
        }
        seen += 1;
        let text = std::fs::read_to_string(&path).expect("read");
        let doc: Value = serde_saphyr::from_str(&text).expect("YAML");
        let p: k8s_openapi::api::core::v1::Pod =
            serde_json::from_value(doc["pod"].clone()).expect("a pod");
        let mut maps = ConfigMapList::default();
        for cm in doc["configMaps"].as_array().into_iter().flatten() {
            let data: BTreeMap<String, String> =
                serde_json::from_value(cm["data"].clone()).expect("data");
            let key = (
                cm["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("default")
                    .to_string(),
                cm["metadata"]["name"].as_str().expect("name").to_string(),
            );
            maps.0.insert(key, data);
        }
        let view = ClusterView::default().with_config_maps(Arc::new(maps));
        let m = match mutate(&p, &Policy::default(), &view) {
            Outcome::Mutated(m) => m,
            other => panic!("{name}: {other:?}"),
        };
        let expect = &doc["expect"];
        assert_eq!(
            m.plan.config.model.name.as_deref(),
            expect["model"].as_str(),
            "{name}"
        );
        for (knob, value) in expect["read"].as_object().expect("read") {
            assert_eq!(
                m.estimate.read.get(knob).map(String::as_str),
                value.as_str(),
                "{name}: {knob}"
            );
        }
        for (knob, source) in expect["sources"].as_object().expect("sources") {
            assert_eq!(
                m.estimate.sources.get(knob).map(String::as_str),
                source.as_str(),
                "{name}: {knob}"
            );
        }
    }
    assert!(seen >= 3, "{seen} torchtune shapes");
}

/// A `*_distributed` recipe shards with FSDP over every rank: over the pod's GPUs, or over
/// `nproc_per_node × nnodes` when the launch names more than one node (the pod cannot see its
/// peers).
#[test]
fn distributed_recipes_shard_over_every_rank() {
    let args = [
        "tune",
        "run",
        "--nnodes",
        "2",
        "--nproc_per_node",
        "8",
        "full_finetune_distributed",
        "--config",
        "llama3_1/8B_full",
    ];
    let mut p = pod(&args, json!([]), json!([]));
    if let Some(spec) = p.spec.as_mut() {
        spec.containers[0].resources =
            serde_json::from_value(json!({"limits": {"nvidia.com/gpu": "8"}})).expect("resources");
    }
    let Outcome::Mutated(m) = mutate(&p, &Policy::default(), &ClusterView::default()) else {
        panic!("mutated")
    };
    let cfg = &m.plan.config;
    assert_eq!(cfg.parallelism, memguard_estimator::Parallelism::Fsdp);
    assert_eq!(cfg.world_size, 16);
    assert_eq!(cfg.method, memguard_estimator::Method::Full);
}
