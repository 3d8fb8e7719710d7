use super::*;
use crate::launch::{find as find_launch, flags::apply};
use serde_json::json;

fn items(s: &[&str]) -> Vec<String> {
    s.iter().map(|x| x.to_string()).collect()
}

fn config_launch(cmd: &[&str]) -> (Launch, ConfigLaunch) {
    let launch = find_launch(&items(cmd)).expect("a launch");
    let config = find(&launch).expect("a config-file launch");
    (launch, config)
}

fn knob(r: &Reading, k: Knob) -> Option<(&str, Origin)> {
    r.knobs
        .iter()
        .find(|(x, _)| *x == k)
        .map(|(_, r)| (r.value.as_str(), r.origin))
}

fn config(batch: u64, accumulation: u64) -> TrainingConfig {
    let mut c = TrainingConfig::new(memguard_estimator::ModelShape::default());
    c.batch_size = batch;
    c.grad_accumulation = accumulation;
    c
}

/// axolotl: the file, its click overrides (dash spelling, `--k v` and `--k=v`, last wins), the
/// model and the method from `adapter` + `load_in_4bit`.
#[test]
fn axolotl_cli_reads_the_file_under_its_overrides() {
    let (_, c) = config_launch(&[
        "axolotl",
        "train",
        "--launcher",
        "torchrun",
        "/config/qlora.yml",
        "--micro-batch-size",
        "4",
        "--sequence-len=1024",
        "--micro-batch-size=2",
    ]);
    assert_eq!(
        (c.trainer, c.path.as_str()),
        (Trainer::AxolotlCli, "/config/qlora.yml")
    );
    // An override before the config takes its value from the next word.
    let (_, before) = config_launch(&["axolotl", "train", "--micro-batch-size", "2", "c.yml"]);
    assert_eq!(before.path, "c.yml");
    assert_eq!(before.overrides[0].value, "2");
    let doc = json!({"base_model": "NousResearch/Llama-3.2-1B", "adapter": "lora",
        "load_in_4bit": true, "lora_r": 32, "micro_batch_size": 8,
        "gradient_accumulation_steps": 4, "gradient_checkpointing": "offload",
        "sequence_len": 4096, "deepspeed": "deepspeed_configs/zero2.json"});
    let r = c.read(&doc);
    assert_eq!(knob(&r, Knob::BatchSize), Some(("2", Origin::Args)));
    assert_eq!(knob(&r, Knob::SeqLength), Some(("1024", Origin::Args)));
    assert_eq!(knob(&r, Knob::GradAccumulation), Some(("4", Origin::File)));
    assert_eq!(
        knob(&r, Knob::GradCheckpointing),
        Some(("true", Origin::File))
    );
    assert_eq!(knob(&r, Knob::LoraRank), Some(("32", Origin::File)));
    assert_eq!(
        r.model.as_ref().map(|m| m.0.as_str()),
        Some("NousResearch/Llama-3.2-1B")
    );
    assert_eq!(r.method, Some(Method::Qlora));
    assert_eq!(r.coupled, ["deepspeed: deepspeed_configs/zero2.json"]);
}

/// The rewrite replaces an override that is there and appends the others in click's spelling;
/// re-read, the launch gives the plan and keeps batch × accumulation.
#[test]
fn axolotl_rewrite_round_trips() {
    let cmd = [
        "axolotl",
        "train",
        "/config/lora.yml",
        "--micro-batch-size=8",
    ];
    let (launch, c) = config_launch(&cmd);
    let doc = json!({"base_model": "x", "micro_batch_size": 1, "gradient_accumulation_steps": 2});
    let before = config(8, 2);
    let mut planned = config(2, 8);
    planned.grad_checkpointing = true;
    let knobs = [
        Knob::BatchSize,
        Knob::GradAccumulation,
        Knob::GradCheckpointing,
    ];
    let (edits, changed) = c
        .rewrite(&doc, &before, &planned, &knobs)
        .expect("writable");
    assert_eq!(
        changed,
        [
            "--micro-batch-size 8→2",
            "--gradient-accumulation-steps 2→8",
            "--gradient-checkpointing false→true"
        ]
    );
    let out = launch.apply(&items(&cmd), &edits);
    assert_eq!(
        out,
        items(&[
            "axolotl",
            "train",
            "/config/lora.yml",
            "--micro-batch-size=2",
            "--gradient-accumulation-steps=8",
            "--gradient-checkpointing=true"
        ])
    );
    let (_, again) = config_launch(&out.iter().map(String::as_str).collect::<Vec<_>>());
    let r = again.read(&doc);
    assert_eq!(knob(&r, Knob::BatchSize), Some(("2", Origin::Args)));
    assert_eq!(knob(&r, Knob::GradAccumulation), Some(("8", Origin::Args)));
    assert_eq!(
        knob(&r, Knob::GradCheckpointing),
        Some(("true", Origin::Args))
    );
}

/// axolotl derives accumulation from `batch_size` when the file has no
/// `gradient_accumulation_steps`: only the micro batch is written, never both (its
/// `check_gas_bsz` rejects both); `strict: true` drops overrides of absent keys, so none is
/// appended; after `--` words go to the launcher.
#[test]
fn axolotl_derived_accumulation_strict_and_launcher_words() {
    let cmd = ["python", "-m", "axolotl.cli.train", "cfg.yml"];
    let (launch, c) = config_launch(&cmd);
    assert_eq!(c.trainer, Trainer::AxolotlModule);
    let doc = json!({"micro_batch_size": 4, "batch_size": 32});
    let r = c.read(&doc);
    assert_eq!(knob(&r, Knob::GradAccumulation), Some(("8", Origin::File)));
    let (edits, changed) = c
        .rewrite(
            &doc,
            &config(4, 8),
            &config(1, 32),
            &[Knob::BatchSize, Knob::GradAccumulation],
        )
        .expect("writable");
    assert_eq!(
        launch
            .apply(&items(&cmd), &edits)
            .last()
            .map(String::as_str),
        Some("--micro_batch_size=1")
    );
    assert_eq!(
        changed,
        ["--micro_batch_size 4→1", "accumulation 8→32 (derived)"]
    );
    // Batch × accumulation not kept: nothing is written.
    assert!(
        c.rewrite(&doc, &config(4, 8), &config(2, 8), &[Knob::BatchSize])
            .is_err()
    );
    let strict = json!({"strict": true, "micro_batch_size": 4, "gradient_accumulation_steps": 1});
    let mut planned = config(4, 1);
    planned.grad_checkpointing = true;
    let why = c
        .rewrite(&strict, &config(4, 1), &planned, &[Knob::GradCheckpointing])
        .expect_err("strict");
    assert!(why.contains("strict: true"), "{why}");
    let (_, sealed) = config_launch(&["axolotl", "train", "c.yml", "--", "--num_processes", "2"]);
    let why = sealed
        .rewrite(
            &json!({}),
            &config(4, 1),
            &planned,
            &[Knob::GradCheckpointing],
        )
        .expect_err("sealed");
    assert!(why.contains("after `--`"), "{why}");
}

/// LLaMA-Factory: `key=value` words merged over the file; its defaults (checkpointing on,
/// cutoff 2048, rank 8, LoRA) when the file does not say; rewritten as trailing `key=value`.
#[test]
fn llama_factory_dotlist_over_the_file() {
    let cmd = [
        "llamafactory-cli",
        "train",
        "/etc/lf/qwen3_lora_sft.yaml",
        "per_device_train_batch_size=4",
    ];
    let (launch, c) = config_launch(&cmd);
    assert_eq!(c.trainer, Trainer::LlamaFactory);
    let doc = json!({"model_name_or_path": "Qwen/Qwen2.5-7B", "finetuning_type": "lora",
        "quantization_bit": 4, "per_device_train_batch_size": 1, "gradient_accumulation_steps": 8});
    let r = c.read(&doc);
    assert_eq!(knob(&r, Knob::BatchSize), Some(("4", Origin::Args)));
    assert_eq!(knob(&r, Knob::GradAccumulation), Some(("8", Origin::File)));
    assert_eq!(
        knob(&r, Knob::GradCheckpointing),
        Some(("true", Origin::File))
    );
    assert_eq!(knob(&r, Knob::SeqLength), Some(("2048", Origin::File)));
    assert_eq!(knob(&r, Knob::LoraRank), Some(("8", Origin::File)));
    assert_eq!(r.method, Some(Method::Qlora));
    let off = c.read(&json!({"disable_gradient_checkpointing": true, "finetuning_type": "full"}));
    assert_eq!(
        knob(&off, Knob::GradCheckpointing),
        Some(("false", Origin::File))
    );
    assert_eq!(off.method, Some(Method::Full));

    let mut before = config(4, 8);
    before.grad_checkpointing = false;
    let mut planned = config(1, 32);
    planned.grad_checkpointing = true;
    let knobs = [
        Knob::BatchSize,
        Knob::GradAccumulation,
        Knob::GradCheckpointing,
    ];
    let (edits, changed) = c
        .rewrite(&doc, &before, &planned, &knobs)
        .expect("writable");
    assert_eq!(
        changed,
        [
            "per_device_train_batch_size 4→1",
            "gradient_accumulation_steps 8→32",
            "disable_gradient_checkpointing false→true"
        ]
    );
    let out = launch.apply(&items(&cmd), &edits);
    assert_eq!(
        &out[3..],
        [
            "per_device_train_batch_size=1",
            "gradient_accumulation_steps=32",
            "disable_gradient_checkpointing=false"
        ]
    );
    // Its entry script, as its examples launch it on several GPUs.
    let (_, script) = config_launch(&[
        "accelerate",
        "launch",
        "--config_file",
        "examples/accelerate/fsdp_config.yaml",
        "src/train.py",
        "examples/extras/fsdp_qlora/llama3_lora_sft.yaml",
        "cutoff_len=1024",
    ]);
    assert_eq!(script.trainer, Trainer::LlamaFactory);
    assert_eq!(
        script.path,
        "examples/extras/fsdp_qlora/llama3_lora_sft.yaml"
    );
    assert_eq!(script.overrides[0].key, "cutoff_len");
    // Not a config file: LLaMA-Factory reads plain flags then, not this reader's business.
    let plain =
        find_launch(&items(&["llamafactory-cli", "train", "--stage", "sft"])).expect("a launch");
    assert_eq!(find(&plain), None);
}

/// TRL `--config`: file values are defaults, any flag overrides them; new values are appended
/// as HF flags; the old `max_seq_length` is read as `max_length`.
#[test]
fn trl_config_with_flag_overrides() {
    let cmd = [
        "bash",
        "-c",
        "pip install -q trl && trl sft --config /cfg/sft.yaml --gradient_accumulation_steps 2",
    ];
    let (launch, c) = config_launch(&cmd);
    assert_eq!(
        (c.trainer, c.path.as_str()),
        (Trainer::Trl, "/cfg/sft.yaml")
    );
    let doc = json!({"model_name_or_path": "Qwen/Qwen2-0.5B", "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 16, "max_seq_length": 2048, "use_peft": true, "lora_r": 16});
    let r = c.read(&doc);
    assert_eq!(knob(&r, Knob::BatchSize), Some(("8", Origin::File)));
    assert_eq!(knob(&r, Knob::GradAccumulation), Some(("2", Origin::Args)));
    assert_eq!(knob(&r, Knob::SeqLength), Some(("2048", Origin::File)));
    assert_eq!(r.method, Some(Method::Lora));
    let (edits, _) = c
        .rewrite(
            &doc,
            &config(8, 2),
            &config(2, 8),
            &[Knob::BatchSize, Knob::GradAccumulation],
        )
        .expect("writable");
    let out = launch.apply(&items(&cmd), &edits);
    assert_eq!(
        out[2],
        "pip install -q trl && trl sft --config /cfg/sft.yaml --gradient_accumulation_steps 8 --per_device_train_batch_size=2"
    );
    // No `--config`: not this reader's.
    let plain = find_launch(&items(&["trl", "sft", "--model", "gpt2"])).expect("a launch");
    assert_eq!(find(&plain), None);
}

/// LitGPT: micro batch from the file, accumulation derived from the global batch over
/// devices × nodes; only words after `--config` override it; only the micro batch is written.
#[test]
fn litgpt_derives_accumulation_from_the_global_batch() {
    let cmd = [
        "litgpt",
        "finetune_lora",
        "checkpoints/meta-llama/Meta-Llama-3.1-8B",
        "--train.micro_batch_size",
        "16",
        "--config",
        "/cfg/lora.yaml",
        "--devices",
        "2",
    ];
    let (launch, c) = config_launch(&cmd);
    let doc = json!({"quantize": "bnb.nf4", "lora_r": 32,
        "train": {"global_batch_size": 16, "micro_batch_size": 2, "max_seq_length": 512}});
    let r = c.read(&doc);
    assert_eq!(
        knob(&r, Knob::BatchSize),
        Some(("2", Origin::File)),
        "before --config: overridden"
    );
    assert_eq!(knob(&r, Knob::GradAccumulation), Some(("4", Origin::File)));
    assert_eq!(knob(&r, Knob::SeqLength), Some(("512", Origin::File)));
    assert_eq!(r.method, Some(Method::Qlora));
    assert_eq!(
        r.model.as_ref().map(|m| m.0.as_str()),
        Some("checkpoints/meta-llama/Meta-Llama-3.1-8B")
    );
    let (edits, changed) = c
        .rewrite(
            &doc,
            &config(2, 4),
            &config(1, 8),
            &[Knob::BatchSize, Knob::GradAccumulation],
        )
        .expect("writable");
    assert_eq!(
        changed,
        ["--train.micro_batch_size 2→1", "accumulation 4→8 (derived)"]
    );
    let out = launch.apply(&items(&cmd), &edits);
    assert_eq!(
        out.last().map(String::as_str),
        Some("--train.micro_batch_size=1")
    );
    let (_, again) = config_launch(&out.iter().map(String::as_str).collect::<Vec<_>>());
    let r = again.read(&doc);
    assert_eq!(knob(&r, Knob::BatchSize), Some(("1", Origin::Args)));
    assert_eq!(knob(&r, Knob::GradAccumulation), Some(("8", Origin::File)));
}

/// A value the shell expands is not read, and not rewritten.
#[test]
fn expanded_words_are_not_trusted() {
    let cmd = [
        "sh",
        "-c",
        "llamafactory-cli train /c/x.yaml per_device_train_batch_size=$BS",
    ];
    let (_, c) = config_launch(&cmd);
    let doc = json!({"per_device_train_batch_size": 8});
    assert_eq!(knob(&c.read(&doc), Knob::BatchSize), None);
    assert!(
        c.rewrite(
            &doc,
            &config(8, 1),
            &config(2, 4),
            &[Knob::BatchSize, Knob::GradAccumulation]
        )
        .is_err()
    );
    let expanded = find_launch(&items(&["sh", "-c", "axolotl train $CFG"])).expect("a launch");
    assert_eq!(find(&expanded), None);
    let _ = apply::<&str>(&[], &[]);
}
