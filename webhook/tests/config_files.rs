//! Trainers that keep their config in a ConfigMap-mounted file (issue 27), end to end through
//! `mutate` and `patch::build`: a pod with only the opt-in label whose trainer is a stock axolotl
//! or LLaMA-Factory launch is admitted with overrides in the trainer's own terms. The output is
//! applied, its command line re-read with the trainer's rules over the same file, checked to fit
//! and to keep batch × accumulation, validated by `kubernetes-validate --strict`, and admitted
//! again with no second patch. A pod that fits keeps its args byte for byte; a file that cannot
//! be read leaves the args alone and says why.
//!
//! The files under `tests/fixtures/config-files/` are upstream examples, verbatim:
//! axolotl-ai-cloud/axolotl@067b021c8b87a9e5e380b9173c704cf7340e30f5 `examples/llama-3/lora-8b.yml`,
//! hiyouga/LLaMA-Factory@ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30
//! `examples/train_lora/qwen3_lora_sft.yaml`.

use k8s_openapi::api::core::v1::Pod;
use memguard_api::cluster::ConfigMapList;
use memguard_api::launch::config_file::{self, Origin, Reading};
use memguard_api::{Knob, Policy};
use memguard_webhook::{ClusterView, Outcome, mutate, patch};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;

const NAMESPACE: &str = "ml";
/// Where axolotl's 8-bit Llama-3-8B LoRA at sequence 4096 fits at micro batch 1, not 2.
const AXOLOTL_GPU: &str = "NVIDIA-A100-SXM4-40GB";

fn fixture(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/config-files")
        .join(name);
    std::fs::read_to_string(path).expect("fixture")
}

/// A pod with only the opt-in label, on one A10G, running `argv`, with ConfigMap `config`
/// mounted at `mount`.
fn label_only(argv: &[&str], config: &str, mount: &str) -> Value {
    label_only_on("NVIDIA-A10G", argv, config, mount)
}

/// The same on GPU `product`.
fn label_only_on(product: &str, argv: &[&str], config: &str, mount: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "train", "namespace": NAMESPACE,
                     "labels": {"memguard.io/enabled": "true"}},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"nvidia.com/gpu.product": product},
            "containers": [{
                "name": "trainer",
                "image": "ghcr.io/example/trainer:1",
                "command": argv,
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                "volumeMounts": [{"name": "config", "mountPath": mount, "readOnly": true}]
            }],
            "volumes": [{"name": "config", "configMap": {"name": config}}]
        }
    })
}

fn view(config: &str, key: &str, text: &str) -> ClusterView {
    let data = BTreeMap::from([(key.to_string(), text.to_string())]);
    let maps = ConfigMapList(BTreeMap::from([(
        (NAMESPACE.to_string(), config.to_string()),
        data,
    )]));
    ClusterView::default().with_config_maps(Arc::new(maps))
}

struct Admitted {
    mutation: Box<memguard_webhook::Mutation>,
    applied: Value,
}

/// Admits `pod`, applies the patch, and admits the result again: no second patch.
fn admit(pod: &Value, view: &ClusterView) -> Admitted {
    let typed: Pod = serde_json::from_value(pod.clone()).expect("a Pod");
    let outcome = mutate(&typed, &Policy::default(), view);
    let patch = patch::build(&typed, &outcome);
    let Outcome::Mutated(mutation) = outcome else {
        panic!("mutated: {outcome:?}")
    };
    let mut applied = pod.clone();
    json_patch::patch(&mut applied, &patch).expect("patch applies");
    let again: Pod = serde_json::from_value(applied.clone()).expect("still a Pod");
    let second = patch::build(&again, &mutate(&again, &Policy::default(), view));
    assert!(second.0.is_empty(), "not idempotent: {second:?}");
    Admitted { mutation, applied }
}

/// The trainer's `command` followed by its `args`.
fn argv(pod: &Value) -> Vec<String> {
    let c = &pod["spec"]["containers"][0];
    ["command", "args"]
        .iter()
        .flat_map(|f| c[f].as_array().cloned().unwrap_or_default())
        .map(|v| v.as_str().expect("a string").to_string())
        .collect()
}

/// The trainer's reading of `argv` over the file `text` (its own rules, the file parsed as
/// YAML).
fn reread(argv: &[String], text: &str) -> Reading {
    let launch = memguard_api::launch::find(argv).expect("a launch");
    let config = config_file::find(&launch).expect("a config-file launch");
    let doc: Value = serde_saphyr::from_str(text).expect("YAML");
    config.read(&doc)
}

/// The trainers' own parsers on the words after the program (`trainer_args.py`: OmegaConf for
/// LLaMA-Factory, fire for axolotl's module); empty when python3 is missing outside CI.
fn trainer_parse(trainer: &str, argv: &[String], config: &str) -> Option<Value> {
    let python = memguard_e2e::find_tool("python3", "PYTHON")
        .or_else(|| memguard_e2e::missing("python3"))?;
    let has_parsers = Command::new(&python)
        .args(["-c", "import omegaconf, fire"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_parsers {
        return memguard_e2e::missing("python3's omegaconf and fire (pip install omegaconf fire)");
    }
    let launch = memguard_api::launch::find(argv).expect("a launch");
    let input = json!([{"trainer": trainer, "words": launch.texts(), "config": config}]);
    let mut child = Command::new(python)
        .arg(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/config-files/trainer_args.py"),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.to_string().as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("the parser runs");
    assert!(
        out.status.success(),
        "the trainer's parser failed on {argv:?}"
    );
    let mut parsed: Vec<Value> = serde_json::from_slice(&out.stdout).expect("parser JSON");
    parsed.pop()
}

fn value(r: &Reading, knob: Knob) -> (u64, Origin) {
    let (_, read) = r
        .knobs
        .iter()
        .find(|(k, _)| *k == knob)
        .unwrap_or_else(|| panic!("{knob:?} read: {r:?}"));
    (read.value.parse().expect("a count"), read.origin)
}

fn estimate(pod: &Value) -> Value {
    let text = pod["metadata"]["annotations"]["memguard.io/estimate"]
        .as_str()
        .expect("estimate annotation");
    serde_json::from_str(text).expect("estimate JSON")
}

/// axolotl's `lora-8b.yml` (Llama-3-8B LoRA, micro batch 2 × 4, sequence 4096) does not fit an
/// A10G as written: it is admitted with axolotl's click overrides appended, which re-read over
/// the same file give the plan, keep the effective batch of 8 and fit.
#[test]
fn a_label_only_axolotl_pod_gets_axolotl_overrides_that_fit() {
    let text = fixture("axolotl-lora-8b.yml");
    let pod = label_only_on(
        AXOLOTL_GPU,
        &["axolotl", "train", "/config/lora-8b.yml"],
        "axolotl",
        "/config",
    );
    let view = view("axolotl", "lora-8b.yml", &text);
    let Admitted {
        mutation: m,
        applied,
    } = admit(&pod, &view);
    assert!(m.error.is_none(), "{:?}", m.error);
    assert_eq!(m.plan.config.model.name.as_deref(), Some("llama-3-8b"));
    assert_eq!(m.plan.config.method, memguard_estimator::Method::Lora);
    let source = "configmap:axolotl/lora-8b.yml";
    for (what, from) in [
        ("model", source),
        ("method", source),
        ("batch-size", source),
        ("grad-accumulation", source),
        ("seq-length", source),
        ("lora-rank", source),
        ("grad-checkpointing", source),
    ] {
        assert_eq!(
            m.estimate.sources.get(what).map(String::as_str),
            Some(from),
            "{what}: {:?}",
            m.estimate.sources
        );
    }
    assert!(
        m.plan.config.batch_size < 2,
        "downgraded: {:?}",
        m.plan.steps
    );
    let out = argv(&applied);
    assert_eq!(&out[..3], ["axolotl", "train", "/config/lora-8b.yml"]);
    assert!(
        out.len() > 3
            && out[3..]
                .iter()
                .all(|w| w.starts_with("--") && w.contains('=')),
        "click overrides: {out:?}"
    );
    let r = reread(&out, &text);
    let (batch, _) = value(&r, Knob::BatchSize);
    let (accumulation, _) = value(&r, Knob::GradAccumulation);
    assert_eq!(batch * accumulation, 8, "effective batch kept: {out:?}");
    let cfg = &m.plan.config;
    assert_eq!(
        (batch, accumulation, value(&r, Knob::SeqLength).0),
        (cfg.batch_size, cfg.grad_accumulation, cfg.seq_length)
    );
    let budget = m.budget.as_ref().expect("a budget");
    assert!(m.plan.total() <= budget.bytes, "fits");
    // What changed leads the warnings, in axolotl's words.
    assert!(
        m.warnings[0].starts_with("memguard: --micro-batch-size 2→"),
        "{:?}",
        m.warnings
    );
    assert_eq!(estimate(&applied)["read"]["batch-size"], "2");
}

/// LLaMA-Factory's `qwen3_lora_sft.yaml` launched with a batch of 16 on the command line: the
/// `key=value` words are rewritten in place, and re-read (OmegaConf dotlist over the file) they
/// fit and keep 16 × 8.
#[test]
fn a_label_only_llama_factory_pod_gets_dotlist_overrides_that_fit() {
    let text = fixture("llamafactory-qwen3-lora-sft.yaml");
    // The catalog knows Qwen3-4B; the example's `-Instruct-2507` build is the same shape.
    let text = text.replace("Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-4B");
    let pod = label_only(
        &[
            "bash",
            "-c",
            "pip install -q llamafactory && FORCE_TORCHRUN=1 llamafactory-cli train \
             /etc/lf/sft.yaml per_device_train_batch_size=16 report_to=none",
        ],
        "lf",
        "/etc/lf",
    );
    let view = view("lf", "sft.yaml", &text);
    let Admitted {
        mutation: m,
        applied,
    } = admit(&pod, &view);
    assert!(m.error.is_none(), "{:?}", m.error);
    assert_eq!(m.plan.config.model.name.as_deref(), Some("qwen3-4b"));
    assert_eq!(m.plan.config.method, memguard_estimator::Method::Lora);
    for (what, from) in [
        ("model", "configmap:lf/sft.yaml"),
        ("batch-size", "args"),
        ("seq-length", "configmap:lf/sft.yaml"),
        ("grad-accumulation", "configmap:lf/sft.yaml"),
        ("lora-rank", "configmap:lf/sft.yaml"),
    ] {
        assert_eq!(
            m.estimate.sources.get(what).map(String::as_str),
            Some(from),
            "{what}: {:?}",
            m.estimate.sources
        );
    }
    let out = argv(&applied);
    let script = &out[2];
    assert!(
        script.starts_with("pip install -q llamafactory && FORCE_TORCHRUN=1 llamafactory-cli train /etc/lf/sft.yaml per_device_train_batch_size="),
        "the rest of the string byte for byte: {script}"
    );
    let r = reread(&out, &text);
    let (batch, origin) = value(&r, Knob::BatchSize);
    assert_eq!(origin, Origin::Args);
    let (accumulation, _) = value(&r, Knob::GradAccumulation);
    assert_eq!(
        batch * accumulation,
        16 * 8,
        "effective batch kept: {script}"
    );
    let cfg = &m.plan.config;
    assert_eq!(
        (batch, accumulation),
        (cfg.batch_size, cfg.grad_accumulation)
    );
    assert!(batch < 16, "downgraded: {:?}", m.plan.steps);
    let budget = m.budget.as_ref().expect("an A10G budget");
    assert!(m.plan.total() <= budget.bytes, "fits");
    // LLaMA-Factory's own merge (OmegaConf) reads the same.
    if let Some(merged) = trainer_parse("llamafactory", &out, &text) {
        assert_eq!(
            merged["per_device_train_batch_size"],
            json!(batch),
            "{merged}"
        );
        assert_eq!(
            merged["gradient_accumulation_steps"],
            json!(accumulation),
            "{merged}"
        );
        assert_eq!(merged["cutoff_len"], json!(cfg.seq_length), "{merged}");
        assert_eq!(
            merged["report_to"], "none",
            "the user's own override is kept"
        );
    }
}

/// axolotl's module form (`accelerate launch -m axolotl.cli.train`): fire keyword arguments in
/// underscore spelling, which fire itself parses back to the plan.
#[test]
fn axolotl_module_overrides_are_fire_keyword_arguments() {
    let text = fixture("axolotl-lora-8b.yml");
    let pod = label_only_on(
        AXOLOTL_GPU,
        &[
            "accelerate",
            "launch",
            "--num_processes",
            "1",
            "-m",
            "axolotl.cli.train",
            "/config/lora-8b.yml",
        ],
        "axolotl",
        "/config",
    );
    let Admitted {
        mutation: m,
        applied,
    } = admit(&pod, &view("axolotl", "lora-8b.yml", &text));
    let out = argv(&applied);
    assert_eq!(
        &out[7..],
        ["--micro_batch_size=1", "--gradient_accumulation_steps=8"],
        "{out:?}"
    );
    assert_eq!(
        (m.plan.config.batch_size, m.plan.config.grad_accumulation),
        (1, 8)
    );
    if let Some(kwargs) = trainer_parse("axolotl-fire", &out, &text) {
        assert_eq!(kwargs["config"], "/config/lora-8b.yml");
        assert_eq!(kwargs["micro_batch_size"], 1);
        assert_eq!(kwargs["gradient_accumulation_steps"], 8);
    }
}

/// A config that fits as written: the args stay byte for byte, the sources are still named.
#[test]
fn a_pod_that_fits_keeps_its_args() {
    let text = fixture("llamafactory-qwen3-lora-sft.yaml")
        .replace("Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-4B");
    let pod = label_only(
        &["llamafactory-cli", "train", "/etc/lf/sft.yaml"],
        "lf",
        "/etc/lf",
    );
    let Admitted {
        mutation: m,
        applied,
    } = admit(&pod, &view("lf", "sft.yaml", &text));
    assert!(m.plan.steps.is_empty(), "fits: {:?}", m.plan.steps);
    assert_eq!(
        applied["spec"]["containers"][0]["command"],
        pod["spec"]["containers"][0]["command"]
    );
    assert_eq!(m.estimate.sources["batch-size"], "configmap:lf/sft.yaml");
}

/// A file that cannot be read (no such ConfigMap, baked into the image, not YAML) leaves the
/// args untouched; a label-only pod is guarded at run time with the reason in
/// `memguard.io/error`.
#[test]
fn an_unreadable_config_says_why() {
    let text = fixture("axolotl-lora-8b.yml");
    let cases = [
        (
            label_only(
                &["axolotl", "train", "/config/lora-8b.yml"],
                "axolotl",
                "/config",
            ),
            ClusterView::default(),
            "ConfigMap `ml/axolotl` is not known",
        ),
        (
            label_only(
                &["axolotl", "train", "/app/lora-8b.yml"],
                "axolotl",
                "/config",
            ),
            view("axolotl", "lora-8b.yml", &text),
            "not in a volume mount (baked into the image?)",
        ),
        (
            label_only(
                &["axolotl", "train", "/config/lora-8b.yml"],
                "axolotl",
                "/config",
            ),
            view("axolotl", "lora-8b.yml", "base_model: [unclosed"),
            "is not valid YAML",
        ),
    ];
    for (pod, view, says) in cases {
        let typed: Pod = serde_json::from_value(pod.clone()).expect("a Pod");
        let outcome = mutate(&typed, &Policy::default(), &view);
        // The trainer runs Python: guarded at run time, with the reason.
        let Outcome::Guarded(g) = &outcome else {
            panic!("{says}: {outcome:?}")
        };
        let error = &g.reason;
        assert!(error.contains(says), "{says}: {error}");
        assert!(error.contains("axolotl's config"), "{error}");
        let mut applied = pod.clone();
        json_patch::patch(&mut applied, &patch::build(&typed, &outcome)).expect("applies");
        let (trainer, before) = (
            &applied["spec"]["containers"][0],
            &pod["spec"]["containers"][0],
        );
        assert_eq!(trainer["command"], before["command"], "command untouched");
        assert_eq!(trainer["args"], before["args"], "args untouched");
        assert_eq!(
            applied["metadata"]["annotations"]["memguard.io/error"],
            *error
        );
    }
    // With the model annotated, the pod is planned on its annotations and a warning says why.
    let mut annotated = label_only(&["axolotl", "train", "/app/x.yml"], "axolotl", "/config");
    annotated["metadata"]["annotations"] = json!({"memguard.io/model": "llama-3-8b"});
    let typed: Pod = serde_json::from_value(annotated).expect("a Pod");
    let Outcome::Mutated(m) = mutate(&typed, &Policy::default(), &ClusterView::default()) else {
        panic!("planned on annotations")
    };
    assert!(m.command_line.is_none());
    assert!(
        m.warnings
            .iter()
            .any(|w| w.contains("baked into the image")),
        "{:?}",
        m.warnings
    );
}

/// Every output is a valid pod for the Kubernetes schema.
#[test]
fn every_output_is_valid_kubernetes() {
    let Some(tool) = memguard_e2e::kubernetes_validate() else {
        return;
    };
    let axolotl = fixture("axolotl-lora-8b.yml");
    let lf = fixture("llamafactory-qwen3-lora-sft.yaml")
        .replace("Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-4B");
    let outputs = [
        admit(
            &label_only_on(
                AXOLOTL_GPU,
                &["axolotl", "train", "/config/lora-8b.yml"],
                "axolotl",
                "/config",
            ),
            &view("axolotl", "lora-8b.yml", &axolotl),
        ),
        admit(
            &label_only(
                &[
                    "llamafactory-cli",
                    "train",
                    "/etc/lf/sft.yaml",
                    "per_device_train_batch_size=16",
                ],
                "lf",
                "/etc/lf",
            ),
            &view("lf", "sft.yaml", &lf),
        ),
    ];
    let dir = tempfile::tempdir().expect("tempdir");
    let files: Vec<PathBuf> = outputs
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let file = dir.path().join(format!("pod-{i}.json"));
            std::fs::write(&file, a.applied.to_string()).expect("write");
            file
        })
        .collect();
    if let Err(out) = memguard_e2e::validate_manifests(&tool, &files) {
        panic!("kubernetes-validate rejected a pod:\n{out}");
    }
}

/// The config-file shapes of the launch corpus (`tests/corpus/launch/`, format in its README):
/// each resolves to its model and method, reads exactly the knobs and sources it expects, and is
/// admitted (not skipped) idempotently.
#[test]
fn corpus_config_file_shapes_read_as_expected() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/corpus/launch");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("the corpus") {
        let path = entry.expect("an entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let ours = ["axolotl-", "llamafactory-", "litgpt-", "trl-config-"];
        if !ours.iter().any(|p| name.starts_with(p)) || !name.ends_with(".yaml") {
            continue;
        }
        seen += 1;
        let text = std::fs::read_to_string(&path).expect("readable");
        let doc: Value = serde_saphyr::from_str(&text).expect("YAML");
        let mut maps = BTreeMap::new();
        for cm in doc["configMaps"].as_array().into_iter().flatten() {
            let data: BTreeMap<String, String> =
                serde_json::from_value(cm["data"].clone()).expect("data");
            let key = (
                cm["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("default")
                    .to_string(),
                cm["metadata"]["name"].as_str().expect("a name").to_string(),
            );
            maps.insert(key, data);
        }
        let view = ClusterView::default().with_config_maps(Arc::new(ConfigMapList(maps)));
        let pod: Pod = serde_json::from_value(doc["pod"].clone()).expect("a Pod");
        let policy = Policy::default();
        let t = memguard_api::TrainingPod::resolve(&pod, &policy, view.cluster())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let expect = &doc["expect"];
        let model = expect["model"].as_str().expect("a model");
        let want = policy.models.lookup(model).map(|m| m.shape.name.clone());
        assert_eq!(
            Some(t.config.model.name.clone()),
            want,
            "{name}: the model {model}"
        );
        assert_eq!(t.config.method.name(), expect["method"], "{name}");
        let read: BTreeMap<String, String> = t
            .sources
            .keys()
            .map(|k| (k.name().to_string(), k.value(&t.config)))
            .collect();
        let want: BTreeMap<String, String> =
            serde_json::from_value(expect["read"].clone()).expect("read");
        assert_eq!(read, want, "{name}: read");
        let mut sources: BTreeMap<String, String> = t
            .sources
            .iter()
            .map(|(k, s)| (k.name().to_string(), s.clone()))
            .collect();
        sources.extend(
            t.read_from_args
                .iter()
                .map(|w| (w.to_string(), "args".into())),
        );
        sources.extend(
            t.read_from_file
                .iter()
                .map(|(w, s)| (w.to_string(), s.clone())),
        );
        let want: BTreeMap<String, String> =
            serde_json::from_value(expect["sources"].clone()).expect("sources");
        assert_eq!(sources, want, "{name}: sources");
        let outcome = mutate(&pod, &policy, &view);
        assert!(
            matches!(outcome, Outcome::Mutated(_)),
            "{name}: {outcome:?}"
        );
        admit(&doc["pod"], &view);
    }
    assert_eq!(seen, 7, "the config-file shapes");
}

/// A DeepSpeed config the file names (`deepspeed: …`): read from the ConfigMap when it is there;
/// one that pins the micro-batch refuses the batch change with the reason, `"auto"` lets it
/// through, one that cannot be read lets it through with a warning that says so.
#[test]
fn a_deepspeed_config_that_pins_the_micro_batch_refuses_the_rewrite() {
    let with_ds = |ds_path: &str| {
        fixture("axolotl-lora-8b.yml").replace(
            "load_in_8bit: true",
            &format!("load_in_8bit: true\ndeepspeed: {ds_path}"),
        )
    };
    let pod = label_only_on(
        AXOLOTL_GPU,
        &["axolotl", "train", "/config/lora-8b.yml"],
        "axolotl",
        "/config",
    );
    let typed: Pod = serde_json::from_value(pod.clone()).expect("a Pod");
    let maps = |ds: &str, config: &str| {
        let data = BTreeMap::from([
            ("lora-8b.yml".to_string(), config.to_string()),
            ("ds.json".to_string(), ds.to_string()),
        ]);
        ClusterView::default().with_config_maps(Arc::new(ConfigMapList(BTreeMap::from([(
            (NAMESPACE.to_string(), "axolotl".to_string()),
            data,
        )]))))
    };
    let pinned = maps(
        r#"{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto"}"#,
        &with_ds("/config/ds.json"),
    );
    match mutate(&typed, &Policy::default(), &pinned) {
        Outcome::Skipped { error, .. } => {
            assert!(
                error.contains("`/config/ds.json`")
                    && error.contains("train_micro_batch_size_per_gpu=2"),
                "{error}"
            );
        }
        other => panic!("{other:?}"),
    }
    let auto = maps(
        r#"{"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}"#,
        &with_ds("/config/ds.json"),
    );
    let Admitted { mutation: m, .. } = admit(&pod, &auto);
    assert!(m.command_line.is_some(), "rewritten under \"auto\"");
    let unread = maps("{}", &with_ds("deepspeed_configs/zero2.json"));
    let Admitted { mutation: m, .. } = admit(&pod, &unread);
    assert!(m.command_line.is_some());
    assert!(
        m.warnings
            .iter()
            .any(|w| w.contains("DeepSpeed config `deepspeed_configs/zero2.json` was not read")),
        "{:?}",
        m.warnings
    );
}

/// TRL `--config`: the file's values are the parser's defaults and flags override them, so the
/// plan is appended as HF flags; re-read (flags over the file) it keeps the effective batch.
#[test]
fn a_trl_config_pod_gets_flags_appended() {
    let text = "model_name_or_path: Qwen/Qwen2.5-3B\nper_device_train_batch_size: 16\n\
                gradient_accumulation_steps: 2\nmax_length: 2048\ngradient_checkpointing: true\n\
                use_peft: true\nlora_r: 16\n";
    let pod = label_only(
        &[
            "trl",
            "sft",
            "--config",
            "/config/sft.yaml",
            "--output_dir",
            "/out",
        ],
        "trl",
        "/config",
    );
    let Admitted {
        mutation: m,
        applied,
    } = admit(&pod, &view("trl", "sft.yaml", text));
    assert!(m.error.is_none(), "{:?}", m.error);
    assert_eq!(m.plan.config.model.name.as_deref(), Some("qwen2.5-3b"));
    assert_eq!(m.plan.config.method, memguard_estimator::Method::Lora);
    assert_eq!(m.estimate.sources["batch-size"], "configmap:trl/sft.yaml");
    let out = argv(&applied);
    assert_eq!(
        &out[..6],
        [
            "trl",
            "sft",
            "--config",
            "/config/sft.yaml",
            "--output_dir",
            "/out"
        ]
    );
    let r = reread(&out, text);
    let (batch, origin) = value(&r, Knob::BatchSize);
    let (accumulation, _) = value(&r, Knob::GradAccumulation);
    assert_eq!(origin, Origin::Args, "{out:?}");
    assert_eq!(batch * accumulation, 32, "{out:?}");
    assert_eq!(
        (batch, accumulation),
        (m.plan.config.batch_size, m.plan.config.grad_accumulation)
    );
    assert!(batch < 16);
}

/// LitGPT has no gradient-checkpointing setting: a plan that needs it is not reported as
/// applied; the pod is admitted unchanged and `memguard.io/error` says why.
#[test]
fn a_litgpt_plan_that_needs_checkpointing_is_refused_with_the_reason() {
    let text = "checkpoint_dir: checkpoints/meta-llama/Meta-Llama-3.1-8B\nlora_r: 32\n\
                devices: 1\ntrain:\n  global_batch_size: 16\n  micro_batch_size: 4\n  \
                max_seq_length: 2048\n";
    let pod = label_only(
        &["litgpt", "finetune_lora", "--config", "/config/lora.yaml"],
        "litgpt",
        "/config",
    );
    let typed: Pod = serde_json::from_value(pod.clone()).expect("a Pod");
    let outcome = mutate(
        &typed,
        &Policy::default(),
        &view("litgpt", "lora.yaml", text),
    );
    let Outcome::Skipped { error, .. } = &outcome else {
        panic!("{outcome:?}")
    };
    assert!(
        error.contains("LitGPT has no setting for grad-checkpointing"),
        "{error}"
    );
    let mut applied = pod.clone();
    json_patch::patch(&mut applied, &patch::build(&typed, &outcome)).expect("applies");
    assert_eq!(applied["spec"], pod["spec"]);
}
