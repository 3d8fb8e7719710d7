//! Knowing what was read (issue 36): a bespoke script's absent flags are unknown, never
//! `TrainingArguments`' defaults; an unknown value is never written; no verdict rests on one;
//! every dialect's sequence flag is read, and one not understood is named.

use memguard_api::Policy;
use memguard_webhook::mutate::ClusterView;
use serde_json::{Value, json};

/// A pod with only the opt-in label, pinned to an A10G (24 GB), running `script`.
fn label_only(script: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "t", "namespace": "ml", "labels": {"memguard.io/enabled": "true"}},
        "spec": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A10G"},
            "containers": [{"name": "trainer", "image": "trainer:1",
                "command": ["bash", "-c"], "args": [script],
                "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
    })
}

/// The admitted pod, the estimate annotation and the warnings.
fn admit(pod: &Value) -> (Value, Value, Vec<String>) {
    let (out, warnings) = super::admitted(pod, &Policy::default(), &ClusterView::default());
    let estimate = super::estimate_of(&out);
    (out, estimate, warnings)
}

fn trainer_env(pod: &Value, name: &str) -> Option<String> {
    pod["spec"]["containers"][0]["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str().map(String::from))
}

/// Defect: a script that sets its own defaults in code (a `TrainingArguments` subclass with
/// accumulation 4) had `--gradient_accumulation_steps` appended on the assumption that it runs
/// at 8 × 1: effective batch 16 → 8. Now the accumulation is unknown, never written, and the
/// batch is kept; the plan turns on checkpointing instead, which is right whatever it was.
#[test]
fn a_bespoke_scripts_absent_accumulation_is_unknown_and_the_batch_is_kept() {
    let script = "python finetune.py --model_name_or_path meta-llama/Llama-3.2-1B \
                  --per_device_train_batch_size 4 --model_max_length 4096 --output_dir /out";
    let pod = label_only(script);
    let (out, estimate, warnings) = admit(&pod);
    assert_eq!(
        estimate["sources"]["grad-accumulation"], "unknown",
        "{estimate}"
    );
    assert!(
        estimate["unknown"]["grad-accumulation"]
            .as_str()
            .is_some_and(|w| w.contains("--gradient_accumulation_steps")),
        "{estimate}"
    );
    let args = out["spec"]["containers"][0]["args"][0]
        .as_str()
        .expect("script");
    assert!(!args.contains("gradient_accumulation_steps"), "{args}");
    assert!(
        args.contains("--per_device_train_batch_size 4"),
        "batch kept: {args}"
    );
    assert_eq!(estimate["config"]["batch-size"], "4", "{estimate}");
    assert_eq!(trainer_env(&out, "MEMGUARD_GRAD_ACCUMULATION"), None);
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("batch and accumulation kept")),
        "{warnings:?}"
    );
    // Read here: the batch and the sequence; the verdict stands on them.
    assert_eq!(estimate["sources"]["seq-length"], "args");
    assert!(estimate["fits"].is_boolean(), "{estimate}");
}

/// Defect: `--model_max_length 8192` (the Alpaca/FastChat/Vicuna scripts) was not read, and the
/// job was planned at 2048 and marked fits. Now it is read as the sequence, in place.
#[test]
fn model_max_length_is_the_sequence() {
    let script = "torchrun --nproc_per_node=1 fastchat/train/train.py \
                  --model_name_or_path meta-llama/Llama-2-7b-hf --model_max_length 8192 \
                  --per_device_train_batch_size 2 --gradient_accumulation_steps 16 \
                  --gradient_checkpointing True --bf16 True --output_dir /out";
    let (_, estimate, _) = admit(&label_only(script));
    assert_eq!(estimate["read"]["seq-length"], "8192", "{estimate}");
    assert_eq!(estimate["sources"]["seq-length"], "args");
    // Full fine-tuning of 7B at 8192 is far over an A10G: never "fits".
    assert_eq!(estimate["fits"], false, "{estimate}");
    for (flag, seq) in [
        ("--cutoff_len 512", "512"),
        ("--block_size 1024", "1024"),
        ("--max_seq_len 3072", "3072"),
    ] {
        let script = format!(
            "python train.py --model_name_or_path meta-llama/Llama-3.2-1B {flag} \
             --per_device_train_batch_size 1 --gradient_accumulation_steps 1 --output_dir /o"
        );
        let (_, estimate, _) = admit(&label_only(&script));
        assert_eq!(estimate["read"]["seq-length"], seq, "{flag}: {estimate}");
    }
}

/// A bespoke script that does not say its sequence: no verdict (`fits` is null), the launch
/// left as it is even though the guess does not fit, no `MEMGUARD_*` knob written, the
/// warning naming what was not read; a flag that looks like a sequence and is not read as one
/// is named too.
#[test]
fn an_unread_sequence_leaves_the_launch_and_claims_no_verdict() {
    let script = "python train.py --model_name_or_path meta-llama/Llama-2-7b-hf \
                  --per_device_train_batch_size 16 --gradient_accumulation_steps 1 \
                  --max_source_length 1024 --output_dir /out";
    let pod = label_only(script);
    let (out, estimate, warnings) = admit(&pod);
    assert!(estimate["fits"].is_null(), "{estimate}");
    assert_eq!(estimate["sources"]["seq-length"], "unknown", "{estimate}");
    assert!(estimate["unknown"]["seq-length"].is_string(), "{estimate}");
    assert_eq!(
        out["spec"]["containers"][0]["args"], pod["spec"]["containers"][0]["args"],
        "left as it is"
    );
    assert_eq!(trainer_env(&out, "MEMGUARD_BATCH_SIZE"), None);
    assert_eq!(trainer_env(&out, "MEMGUARD_CANNOT_FIT"), None);
    assert!(
        out["metadata"]["annotations"]
            .get("memguard.io/error")
            .is_none(),
        "no cannot-fit verdict on a guess"
    );
    assert!(
        warnings[0].contains("seq-length") && warnings[0].contains("not read"),
        "{warnings:?}"
    );
    assert!(
        warnings.iter().any(|w| w.contains("--max_source_length")),
        "{warnings:?}"
    );
    // Still guarded: the sidecar is injected.
    let init = out["spec"]["initContainers"].as_array().expect("init");
    assert!(init.iter().any(|c| c["name"] == "memguard-sidecar"));
}

/// The parsers memguard knows keep their cited defaults: transformers' `run_clm.py` runs at
/// `TrainingArguments`' 8 × 1 and cuts at 1024.
#[test]
fn a_known_scripts_defaults_are_cited() {
    let script = "python examples/pytorch/language-modeling/run_clm.py \
                  --model_name_or_path openai-community/gpt2 --do_train --output_dir /o";
    let (_, estimate, _) = admit(&label_only(script));
    assert_eq!(
        estimate["sources"]["batch-size"], "default:transformers-example",
        "{estimate}"
    );
    assert_eq!(estimate["config"]["seq-length"], "1024");
    assert!(estimate.get("unknown").is_none(), "{estimate}");
}

/// Defect: knobs read but not applied. `--use_liger_kernel` (a fused loss) and the LoRA target
/// modules and dropout were not read, so a Qwen2.5-7B LoRA job with Liger was planned with the
/// full logits (64.5 GiB instead of 24.6) and its all-linear adapters as q,v.
#[test]
fn liger_and_lora_targets_and_dropout_are_read() {
    let base = "python sft.py --model_name_or_path Qwen/Qwen2.5-7B --use_peft --lora_r 16 \
                --per_device_train_batch_size 4 --gradient_accumulation_steps 4 \
                --max_length 4096 --gradient_checkpointing --output_dir /o";
    let (_, plain, _) = admit(&label_only(base));
    let with =
        format!("{base} --use_liger_kernel --lora_target_modules all-linear --lora_dropout 0.05");
    let (_, read, _) = admit(&label_only(&with));
    assert_eq!(read["sources"]["loss"], "args", "{read}");
    assert_eq!(read["sources"]["lora-targets"], "args", "{read}");
    assert_eq!(read["sources"]["lora-dropout"], "args", "{read}");
    let total = |e: &Value| e["uncalibrated"].as_u64().expect("bytes");
    // The fused loss drops the full-vocabulary logits: far less, even with more adapters.
    assert!(
        total(&read) < total(&plain) * 3 / 4,
        "{} vs {}",
        total(&read),
        total(&plain)
    );
    // Another architecture's module names are not guessed at.
    let qwen1 = format!("{base} --lora_target_modules c_attn,c_proj,w1,w2");
    let (_, e, _) = admit(&label_only(&qwen1));
    assert!(e["sources"].get("lora-targets").is_none(), "{e}");
}
