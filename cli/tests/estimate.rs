//! `memguard estimate` end to end, through the real binary.

use serde_json::Value;
use std::process::{Command, Output};

fn memguard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memguard"))
        .args(args)
        .output()
        .expect("the memguard binary runs")
}

fn json(args: &[&str]) -> Value {
    let out = memguard(&[args, &["--output", "json"]].concat());
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}

fn u64_at(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

#[test]
fn json_output_has_totals_and_components_that_add_up() {
    let v = json(&["estimate", "--model", "llama-3-8b", "--method", "lora"]);
    let total = u64_at(&v, "total_bytes");
    let tensor_peak = u64_at(&v, "tensor_peak_bytes");
    assert!(tensor_peak > 0 && tensor_peak <= total);
    let components = v["components"].as_object().expect("components object");
    let sum: u64 = components.values().filter_map(Value::as_u64).sum();
    assert_eq!(sum, total, "components add up to the total");
    assert!(v.get("fits").is_none(), "no plan without a budget");
}

#[test]
fn budget_that_is_too_small_downgrades_and_keeps_the_effective_batch() {
    let base = ["estimate", "--model", "llama-3-8b", "--method", "lora"];
    let args = [
        &base[..],
        &[
            "--batch-size",
            "8",
            "--grad-accumulation",
            "2",
            "--seq-length",
            "4096",
        ],
    ]
    .concat();
    let unplanned = json(&args);
    let budget = u64_at(&unplanned, "total_bytes") * 3 / 4;
    let budget_arg = budget.to_string();
    let v = json(&[&args[..], &["--budget", &budget_arg]].concat());
    assert_eq!(u64_at(&v, "budget_bytes"), budget);
    let steps = v["steps"].as_array().expect("steps");
    assert!(!steps.is_empty(), "a budget below the estimate needs steps");
    assert_eq!(
        steps[0]["rung"], "grad-checkpointing",
        "checkpointing comes first"
    );
    let config = &v["config"];
    let batch = config["batch_size"].as_u64().expect("batch");
    let accumulation = config["grad_accumulation"].as_u64().expect("accumulation");
    assert_eq!(batch * accumulation, 16, "effective batch 8 × 2 is kept");
    if v["fits"].as_bool() == Some(true) {
        assert!(u64_at(&v, "planned_total_bytes") <= budget);
    }
}

#[test]
fn generous_budget_needs_no_steps() {
    let v = json(&[
        "estimate",
        "--model",
        "llama-3-8b",
        "--method",
        "qlora",
        "--budget",
        "1TiB",
    ]);
    assert_eq!(v["fits"], true);
    assert_eq!(v["steps"].as_array().map(Vec::len), Some(0));
}

#[test]
fn gpu_memory_and_safety_ratio_give_the_budget() {
    let v = json(&[
        "estimate",
        "--model",
        "llama-3-8b",
        "--gpu-memory",
        "80GiB",
        "--safety-ratio",
        "0.5",
    ]);
    assert_eq!(u64_at(&v, "budget_bytes"), 40 << 30);
}

#[test]
fn bad_input_names_every_flag_and_exits_2() {
    let out = memguard(&[
        "estimate",
        "--model",
        "llama-3-8b",
        "--method",
        "lora",
        "--lora-rank",
        "0",
        "--optimizer",
        "adamx",
        "--budget",
        "lots",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--lora-rank"), "{stderr}");
    assert!(stderr.contains("--optimizer"), "{stderr}");
    assert!(out.stdout.is_empty(), "nothing half-printed on stdout");
}

#[test]
fn shape_errors_name_the_flag() {
    for (args, flag) in [
        (
            &[
                "--hidden-size",
                "1000",
                "--num-layers",
                "2",
                "--num-heads",
                "3",
                "--vocab-size",
                "10",
            ][..],
            "--num-heads",
        ),
        (&["--model", "gpt-9"][..], "--model"),
        (
            &["--model", "llama-3-8b", "--budget", "-5G"][..],
            "--budget",
        ),
    ] {
        let out = memguard(&[&["estimate"][..], args].concat());
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
    }
}

#[test]
fn table_output_shows_components_and_the_plan() {
    let out = memguard(&[
        "estimate",
        "--model",
        "llama-3-8b",
        "--batch-size",
        "4",
        "--budget",
        "1GiB",
    ]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("weights"), "{text}");
    assert!(text.contains("DOES NOT FIT"), "{text}");
}

#[test]
fn lists_catalog_models() {
    let out = memguard(&["estimate", "--list-models"]);
    assert!(out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l == "llama-3-8b")
    );
}

#[test]
fn serving_counts_the_kv_cache_ceiling_and_how_many_sequences_fit() {
    let base = [
        "estimate",
        "--serve",
        "--model",
        "llama-3-8b",
        "--seq-length",
        "8192",
    ];
    let one = json(&[&base[..], &["--max-sequences", "1"]].concat());
    let sixteen = json(&[&base[..], &["--max-sequences", "16", "--budget", "80GiB"]].concat());
    assert_eq!(one["mode"], "serve");
    // Llama 3 8B caches 2 · 32 layers · 8 KV heads · 128 dims · 2 bytes = 128 KiB per token.
    let kv = |v: &Value| v["components"]["kv_cache"].as_u64().expect("kv_cache");
    assert_eq!(kv(&one), 8192 * 128 * 1024);
    assert_eq!(kv(&sixteen), 16 * kv(&one));
    assert_eq!(sixteen["fits"], true);
    let max = u64_at(&sixteen, "max_sequences_within_budget");
    assert!(max >= 16, "{max}");
    // The reported maximum fits, one more does not.
    let at = |n: u64| {
        let n = n.to_string();
        json(&[&base[..], &["--max-sequences", &n, "--budget", "80GiB"]].concat())
    };
    assert_eq!(at(max)["fits"], true);
    assert_eq!(at(max + 1)["fits"], false);
}

/// `--gpu-resource` asks offline what the webhook would budget: the same stage, the same source.
#[test]
fn gpu_resource_gives_the_budget_the_webhook_would() {
    let base = ["estimate", "--model", "llama-3-8b", "--method", "lora"];
    let rows: [(&[&str], &str, u64, &str); 5] = [
        (
            &["--gpu-resource", "nvidia.com/mig-1g.10gb"],
            "mig",
            9728 << 20,
            "cuda",
        ),
        (
            &[
                "--gpu-resource",
                "nvidia.com/mig-1g.10gb",
                "--gpu-product",
                "NVIDIA-H100-80GB-HBM3",
            ],
            "mig",
            9984 << 20,
            "cuda",
        ),
        (
            &[
                "--gpu-resource",
                "nvidia.com/gpu",
                "--gpu-resource",
                "nvidia.com/gpumem=8000",
            ],
            "hami",
            8000 << 20,
            "cuda",
        ),
        (
            &["--pod-annotation", "gpu-fraction=0.5"],
            "kai",
            40 << 30,
            "cuda",
        ),
        (
            &[
                "--gpu-resource",
                "amd.com/gpu",
                "--gpu-product",
                "AMD_Instinct_MI300X_OAM",
            ],
            "gpu-product",
            205_822_885_888,
            "rocm",
        ),
    ];
    for (flags, kind, memory, device) in rows {
        let v = json(&[&base[..], flags].concat());
        assert_eq!(v["budget_source"]["kind"], kind, "{flags:?}");
        assert_eq!(u64_at(&v, "device_memory_bytes"), memory, "{flags:?}");
        assert!(
            u64_at(&v, "budget_bytes").abs_diff(memory * 9 / 10) <= 1,
            "{flags:?}"
        );
        assert_eq!(v["device"], device, "{flags:?}");
    }
}

#[test]
fn gpu_resource_refuses_what_it_cannot_size() {
    for (flags, message) in [
        (&["--gpu-resource", "gpu"][..], "not an extended resource"),
        (
            &["--gpu-resource", "nvidia.com/gpu=lots"][..],
            "not a quantity",
        ),
        (
            &["--gpu-resource", "example.com/npu"][..],
            "unknown accelerator",
        ),
        (&["--pod-annotation", "gpu-fraction"][..], "not KEY=VALUE"),
        (
            &["--gpu-resource", "nvidia.com/gpu", "--budget", "10GiB"][..],
            "pick one",
        ),
    ] {
        let out = memguard(&[&["estimate", "--model", "llama-3-8b"][..], flags].concat());
        assert_eq!(out.status.code(), Some(2), "{flags:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(message), "{flags:?}: {stderr}");
    }
}

fn fixture(name: &str) -> String {
    format!(
        "{}/../api/fixtures/hf-config/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn a_hugging_face_config_json_gives_the_same_estimate_as_its_catalog_entry() {
    let from_config = json(&["estimate", "--model-config", &fixture("llama-3.1-8b")]);
    let from_catalog = json(&["estimate", "--model", "meta-llama/Llama-3.1-8B"]);
    let total = |v: &Value| u64_at(v, "total_bytes") as f64;
    // The config derives its parameter count (within 0.1 % of the published one).
    let diff = (total(&from_config) - total(&from_catalog)).abs() / total(&from_catalog);
    assert!(diff < 0.001, "{from_config} vs {from_catalog}");
}

#[test]
fn quantization_config_sets_the_storage_bits() {
    let args = |file: &str| {
        json(&[
            "estimate",
            "--model-config",
            &fixture(file),
            "--method",
            "qlora",
        ])
    };
    let quantized = args("llama-3-8b-bnb-4bit");
    let plain = json(&[
        "estimate",
        "--model-config",
        &fixture("llama-3-8b-bnb-4bit"),
        "--method",
        "qlora",
        "--double-quant",
        "false",
    ]);
    // bnb_4bit_use_double_quant shrinks the NF4 scales from 4 bytes per 64 weights to ~1.
    let scales = |v: &Value| v["components"]["quant_scales"].as_u64().expect("scales");
    assert!(
        scales(&quantized) * 3 < scales(&plain),
        "{quantized} {plain}"
    );
    // An 8B model in 4 bits: well under 16-bit weights.
    let weights = quantized["components"]["weights"]
        .as_u64()
        .expect("weights");
    assert!(weights < 7_000_000_000, "{weights}");
    let moe = args("qwen3-30b-a3b");
    assert!(u64_at(&moe, "total_bytes") > 15_000_000_000);
}

#[test]
fn bad_config_json_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("config.json");
    std::fs::write(
        &bad,
        r#"{"hidden_size": 64, "num_hidden_layers": "two", "num_attention_heads": 4,
            "vocab_size": 10, "quantization_config": {"quant_method": "magic"}}"#,
    )
    .expect("write");
    let out = memguard(&["estimate", "--model-config", bad.to_str().expect("utf-8")]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("num_hidden_layers"), "{stderr}");
    assert!(stderr.contains("unknown `magic`"), "{stderr}");
    let missing = memguard(&["estimate", "--model-config", "/nonexistent/config.json"]);
    assert_eq!(missing.status.code(), Some(2));
    let both = memguard(&[
        "estimate",
        "--model-config",
        &fixture("gpt2"),
        "--model",
        "gpt2",
    ]);
    assert_eq!(both.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&both.stderr).contains("not both"));
}
