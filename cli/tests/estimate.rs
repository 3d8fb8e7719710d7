//! `memguard estimate` end to end, through the real binary.

use serde_json::Value;
use std::process::{Command, Output};

fn memguard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memguard"))
        .args(args)
        .output()
        .expect("the memguard binary runs")
}

/// The JSON output; the exit code must say what `fits` says: 0, or 3 for a plan that does not
/// fit.
fn json(args: &[&str]) -> Value {
    let out = memguard(&[args, &["--output", "json"]].concat());
    let value: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!(
            "exit {:?}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let expected = if value["fits"] == false { 3 } else { 0 };
    assert_eq!(
        out.status.code(),
        Some(expected),
        "{value}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    value
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
    // The upper bound at the default level, above the point estimate.
    assert_eq!(v["upper_level"], 0.95);
    assert!(u64_at(&v, "total_upper_bytes") > total);
}

#[test]
fn a_seq_length_spread_costs_reserve_only_without_expandable_segments() {
    let base = [
        "estimate",
        "--model",
        "llama-3-8b",
        "--method",
        "lora",
        "--seq-length",
        "4096",
    ];
    let total = |extra: &[&str]| u64_at(&json(&[&base[..], extra].concat()), "total_bytes");
    let even = total(&[]);
    // The webhook sets expandable_segments:True when the trainer does not: no fragmentation.
    assert_eq!(total(&["--seq-length-spread", "0.8"]), even);
    let own = ["--pytorch-cuda-alloc-conf", "max_split_size_mb:128"];
    assert!(total(&[&own[..], &["--seq-length-spread", "0.8"]].concat()) > even);
    assert_eq!(
        total(
            &[
                &own[..],
                &["--seq-length-spread", "0.8", "--packing", "true"]
            ]
            .concat()
        ),
        even,
        "packed batches have one shape"
    );
    let out = memguard(&[&base[..], &["--seq-length-spread", "1.5"]].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("seq-length-spread"));
}

#[test]
fn the_upper_bound_follows_the_policys_estimate_level_and_the_plan_is_checked_against_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let policy = dir.path().join("policy.yaml");
    std::fs::write(
        &policy,
        "apiVersion: training.memguard.io/v1alpha1\nkind: MemguardPolicy\nmetadata:\n  name: default\nspec:\n  estimateLevel: 0.8\n",
    )
    .expect("policy written");
    let base = ["estimate", "--model", "llama-3-8b", "--method", "lora"];
    let default = json(&base);
    let path = policy.to_string_lossy().to_string();
    let lower = json(&[&base[..], &["--policy-file", &path]].concat());
    assert_eq!(lower["upper_level"], 0.8);
    assert!(u64_at(&lower, "total_upper_bytes") <= u64_at(&default, "total_upper_bytes"));
    assert_eq!(lower["total_bytes"], default["total_bytes"]);

    // A budget at the point estimate: the bound does not fit it, so the plan downgrades.
    let budget = format!("{}B", u64_at(&default, "total_bytes"));
    let v = json(&[&base[..], &["--budget", &budget]].concat());
    assert!(!v["steps"].as_array().expect("steps").is_empty());
    if v["fits"] == true {
        assert!(u64_at(&v, "planned_upper_bytes") <= u64_at(&v, "budget_bytes"));
    }
    let out = memguard(&[&base[..], &["--policy-file", &path]].concat());
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("upper bound at 0.8: "), "{table}");
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
    let budget_arg = format!("{budget}B");
    let v = json(&[&args[..], &["--budget", &budget_arg]].concat());
    assert_eq!(u64_at(&v, "budget_bytes"), budget);
    let steps = v["steps"].as_array().expect("steps");
    assert!(!steps.is_empty(), "a budget below the estimate needs steps");
    // 8 × 4096 tokens per micro-batch: halving the batch costs no math and hardly any speed,
    // so it saves more per unit of cost than checkpointing.
    assert_eq!(
        steps[0]["rung"], "halve-batch",
        "the cheapest saving comes first"
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
fn grad_sync_flag_keeps_fsdp_gradients_sharded_and_the_plan_syncs_before_halving() {
    let fsdp = [
        "estimate",
        "--model",
        "llama-3-8b",
        "--parallelism",
        "fsdp",
        "--world-size",
        "8",
        "--batch-size",
        "4",
        "--grad-accumulation",
        "2",
        "--seq-length",
        "1024",
    ];
    let grads = |v: &Value| v["components"]["gradients"].as_u64().expect("gradients");
    let accumulate = json(&fsdp);
    let each = json(&[&fsdp[..], &["--grad-sync", "each-batch"]].concat());
    // Unsharded under no_sync, one eighth with a reduce-scatter per micro-batch.
    assert_eq!(grads(&accumulate), grads(&each) * 8);
    assert_eq!(
        json(&[&fsdp[..], &["--grad-sync", "accumulate"]].concat()),
        accumulate,
        "accumulate is the default"
    );

    // Planned into the synced config's upper bound (what the plan is checked against):
    // the sync rung (accumulating, the unsharded gradients are the larger saving), then
    // checkpointing, and it says so.
    let checkpointed = [
        &fsdp[..],
        &["--grad-sync", "each-batch", "--grad-checkpointing", "true"],
    ]
    .concat();
    let budget = format!("{}B", u64_at(&json(&checkpointed), "total_upper_bytes"));
    let v = json(&[&fsdp[..], &["--budget", &budget]].concat());
    let rungs: Vec<&str> = v["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .filter_map(|s| s["rung"].as_str())
        .collect();
    assert_eq!(rungs, ["sync-each-batch", "grad-checkpointing"]);
    assert_eq!(v["config"]["grad_sync"], "each-batch");

    let out = memguard(&[&fsdp[..], &["--grad-sync", "sometimes"]].concat());
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--grad-sync") && stderr.contains("accumulate each-batch"),
        "{stderr}"
    );
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
    assert_eq!(
        out.status.code(),
        Some(3),
        "a plan that does not fit exits 3"
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("weights"), "{text}");
    assert!(text.contains("DOES NOT FIT"), "{text}");
}

/// The issue's example: Llama 3 8B, full fine-tuning, batch 8, on one 80 GiB GPU. It does not
/// fit (exit 3) and says what would, each with its estimate: sharding over N GPUs, LoRA, an
/// 8-bit optimizer, optimizer offload; the sequence is never cut without permission.
#[test]
fn an_8b_full_finetune_on_80_gib_ends_with_a_change_that_fits() {
    let args = [
        "estimate",
        "--model",
        "llama-3-8b",
        "--method",
        "full",
        "--batch-size",
        "8",
        "--gpu-memory",
        "80GiB",
    ];
    let v = json(&args);
    assert_eq!(v["fits"], false, "{v}");
    assert_eq!(v["config"]["seq_length"], 2048, "{v}");
    let suggestions = v["suggestions"].as_array().expect("suggestions");
    let find = |prefix: &str| {
        suggestions
            .iter()
            .find(|s| s["change"].as_str().is_some_and(|c| c.starts_with(prefix)))
            .unwrap_or_else(|| panic!("{prefix}: {v}"))
    };
    let gpus = find("FSDP");
    assert_eq!(gpus["fits"], true, "{v}");
    assert!(gpus["world_size"].as_u64().is_some_and(|n| n >= 2), "{v}");
    assert_eq!(find("LoRA")["fits"], true, "{v}");
    find("8-bit AdamW");
    find("optimizer state offloaded");
    for s in suggestions {
        let upper = s["upper_bytes"].as_u64().expect("upper");
        assert_eq!(s["fits"], upper <= u64_at(s, "budget_bytes"), "{s}");
    }
    // The table says the same, after DOES NOT FIT.
    let out = memguard(&args);
    assert_eq!(out.status.code(), Some(3));
    let text = String::from_utf8_lossy(&out.stdout);
    let tail = text.split_once("DOES NOT FIT").expect("verdict").1;
    assert!(tail.contains("GPUs: ") && tail.contains("(fits)"), "{text}");
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

/// `webhook/tests/fixtures/policy-models.yaml`: a `MemguardPolicy` adding Qwen2.5-Coder-7B as
/// `acme-coder-7b` (and a GPTQ variant).
fn models_policy() -> String {
    format!(
        "{}/../webhook/tests/fixtures/policy-models.yaml",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn a_policy_file_adds_models_by_name_and_alias() {
    let policy = models_policy();
    let with = |model: &str| {
        json(&[
            "estimate",
            "--policy-file",
            &policy,
            "--model",
            model,
            "--method",
            "lora",
            "--gpu-memory",
            "24GiB",
        ])
    };
    let by_name = with("acme-coder-7b");
    assert_eq!(by_name["model"], "acme-coder-7b");
    assert_eq!(with("qwen/qwen2.5-coder-7b-instruct"), by_name, "alias");
    // The same config.json given directly: the same estimate, but for the published count the
    // policy states (7615616512; the config derives 7615487488 without Qwen's q/k/v biases).
    let from_config = json(&[
        "estimate",
        "--model-config",
        &fixture("qwen2.5-coder-7b-instruct"),
        "--model-params",
        "7615616512",
        "--method",
        "lora",
        "--gpu-memory",
        "24GiB",
    ]);
    assert_eq!(
        u64_at(&from_config, "total_bytes"),
        u64_at(&by_name, "total_bytes")
    );
    assert_eq!(from_config["steps"], by_name["steps"]);
    // The GPTQ variant's quantization_config stores the base in 4 bits (embeddings and head stay
    // 16-bit: about 2.8× less, not 4×).
    let gptq = json(&[
        "estimate",
        "--policy-file",
        &policy,
        "--model",
        "acme-coder-7b-gptq",
        "--method",
        "lora",
    ]);
    let weights = |v: &Value| v["components"]["weights"].as_u64().expect("weights");
    assert!(
        weights(&gptq) * 5 < weights(&by_name) * 2,
        "{} vs {}",
        weights(&gptq),
        weights(&by_name)
    );

    // Without the policy the name is unknown, and the error says where memguard looked.
    let out = memguard(&["estimate", "--model", "acme-coder-7b"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "--model: unknown model `acme-coder-7b`: not in the built-in catalog, and the policy adds no models"
        ),
        "{stderr}"
    );
}

#[test]
fn list_models_marks_the_policys_models() {
    let out = memguard(&[
        "estimate",
        "--list-models",
        "--policy-file",
        &models_policy(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[..2],
        [
            "acme-coder-7b (policy; aliases: Qwen/Qwen2.5-Coder-7B-Instruct)",
            "acme-coder-7b-gptq (policy; aliases: Qwen/Qwen2.5-Coder-7B-Instruct-GPTQ-Int4)",
        ]
    );
    assert!(lines.contains(&"llama-3-8b"), "{text}");
}

#[test]
fn a_policy_file_with_a_bad_model_is_refused_naming_the_entry_and_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = std::fs::read_to_string(models_policy())
        .expect("fixture")
        .replace("params: 7615616512", "params: 8030261248")
        .replace(
            "- name: acme-coder-7b-gptq",
            "- name: ACME_coder.7b-GPTQ\n      # a typo\n      param: 1",
        );
    let path = dir.path().join("policy.yaml");
    std::fs::write(&path, text).expect("write");
    let path = path.to_str().expect("utf-8");
    let out = memguard(&[
        "estimate",
        "--policy-file",
        path,
        "--model",
        "acme-coder-7b",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unknown field `param`"), "{stderr}");
    let text = std::fs::read_to_string(models_policy())
        .expect("fixture")
        .replace("params: 7615616512", "params: 8030261248")
        .replace("- name: acme-coder-7b-gptq", "- name: ACME_coder-7b");
    std::fs::write(path, text).expect("write");
    let out = memguard(&["estimate", "--policy-file", path, "--list-models"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "models[acme-coder-7b].params: published 8030261248, but the config derives 7615487488 (-5.2 %, more than 2 %)"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("models[ACME_coder-7b].name: `ACME_coder-7b` is already a name of models[acme-coder-7b].name"),
        "{stderr}"
    );
}

/// A policy model named like a built-in one wins over it, for every spelling, and the CLI says so.
#[test]
fn a_policy_model_shadowing_a_built_in_one_wins_with_a_note() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = std::fs::read_to_string(models_policy())
        .expect("fixture")
        .replace("- name: acme-coder-7b\n", "- name: llama-3-8b\n");
    let path = dir.path().join("policy.yaml");
    std::fs::write(&path, text).expect("write");
    let path = path.to_str().expect("utf-8");
    let out = memguard(&[
        "estimate",
        "--policy-file",
        path,
        "--model",
        "meta-llama/Meta-Llama-3-8B-Instruct",
        "--output",
        "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("note: models[llama-3-8b] shadows the built-in model `llama-3-8b`"),
        "{stderr}"
    );
    let shadowed: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let builtin = json(&["estimate", "--model", "meta-llama/Meta-Llama-3-8B-Instruct"]);
    let coder = json(&[
        "estimate",
        "--policy-file",
        &models_policy(),
        "--model",
        "acme-coder-7b",
    ]);
    assert_eq!(
        shadowed["total_bytes"], coder["total_bytes"],
        "the policy's config"
    );
    assert_ne!(shadowed["total_bytes"], builtin["total_bytes"]);
    let out = memguard(&["estimate", "--policy-file", path, "--list-models"]);
    let list = String::from_utf8_lossy(&out.stdout);
    assert!(
        list.lines().any(|l| l
            == "llama-3-8b (policy; aliases: Qwen/Qwen2.5-Coder-7B-Instruct; shadows the built-in llama-3-8b)"),
        "{list}"
    );
    assert!(
        list.lines()
            .any(|l| l == "llama-3-8b (built-in, shadowed by the policy's llama-3-8b)"),
        "{list}"
    );
}

/// `--dra-claim` with `--dra`: the claim's device and memory, as the webhook reads them; a
/// claim whose objects are missing is an error naming what is missing, and no guess.
#[test]
fn a_dra_claim_gives_its_device_and_memory_offline() {
    let objects = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../webhook/tests/fixtures/dra/objects.yaml"
    );
    let base = ["estimate", "--model", "llama-3-8b", "--method", "lora"];
    let with = |claim: &str| {
        let mut a = base.to_vec();
        a.extend(["--dra-claim", claim, "--dra", objects]);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let args = with("claim/shared-h200");
    let v = json(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(v["device"], "cuda");
    assert_eq!(v["budget_source"]["kind"], "dra");
    assert_eq!(u64_at(&v, "device_memory_bytes"), 143_071 << 20);
    let args = with("one-mi300x");
    let out = memguard(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no ResourceSlice of driver gpu.amd.com"),
        "{err}"
    );
    let out = memguard(&[
        "estimate",
        "--model",
        "llama-3-8b",
        "--dra-claim",
        "single-h100",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--dra-claim needs --dra"));
}

/// `--policy-file`'s floors bound the plan, as at admission; the sequence is a quality knob,
/// cut only with the policy's permission (`floors.allowQuality`) or the pod's
/// (`--allow-quality`): without either it stays at 4096 and the config does not fit; with
/// permission it is halved below 2048 to fit; with a 2048 floor it stays there.
#[test]
fn the_policy_files_floors_bound_the_plan() {
    let dir = tempfile::tempdir().expect("tempdir");
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).expect("write");
        path.to_str().expect("utf-8").to_string()
    };
    let allowed = write("allowed.yaml", "floors: {allowQuality: true}\n");
    let floored = write(
        "floors.yaml",
        "floors: {seqLength: 2048, allowQuality: true}\n",
    );
    let base = [
        "estimate",
        "--model",
        "llama-3-8b",
        "--method",
        "lora",
        "--batch-size",
        "4",
        "--seq-length",
        "4096",
    ];
    for budget in [
        &["--budget", "20GiB"][..],
        &["--gpu-memory", "26GiB", "--gpu-resource", "nvidia.com/gpu"][..],
    ] {
        let denied = json(&[&base[..], budget].concat());
        assert_eq!(denied["fits"], false, "{budget:?}: {denied}");
        assert_eq!(denied["config"]["seq_length"], 4096, "{budget:?}: {denied}");
        for permission in [
            &["--policy-file", &allowed][..],
            &["--allow-quality", "true"][..],
        ] {
            let free = json(&[&base[..], budget, permission].concat());
            assert_eq!(free["fits"], true, "{budget:?} {permission:?}: {free}");
            // Halved below the floor (how far depends on the upper bound the plan checks).
            let seq = free["config"]["seq_length"].as_u64().expect("seq_length");
            assert!(seq < 2048, "{budget:?}: {free}");
        }
        let floored = json(&[&base[..], budget, &["--policy-file", &floored]].concat());
        assert_eq!(floored["fits"], false, "{budget:?}: {floored}");
        assert_eq!(
            floored["config"]["seq_length"], 2048,
            "{budget:?}: {floored}"
        );
        // The pod's word overrides the policy's.
        let refused = json(
            &[
                &base[..],
                budget,
                &["--policy-file", &allowed, "--allow-quality", "false"],
            ]
            .concat(),
        );
        assert_eq!(
            refused["config"]["seq_length"], 4096,
            "{budget:?}: {refused}"
        );
    }
}

/// `--budget 24` was 24 bytes, silently; a unit is required, and the message suggests one, in
/// the words of the one size parser the policy shares (issue 38). So does `--gpu-memory 40`, and
/// a figure in bytes needs its `B`.
/// `--batch-size 7B` was taken as 7e9; counts are whole numbers.
#[test]
fn a_budget_needs_a_unit_and_a_batch_size_is_a_whole_number() {
    let base = ["estimate", "--model", "llama-3-8b"];
    for (args, said) in [
        (
            &["--budget", "24"][..],
            "error: --budget: `24` has no unit: did you mean `24Gi`? (sizes are like 24Gi, 80G, \
             23028Mi or 24GiB)\n",
        ),
        (
            &["--budget", "40"][..],
            "error: --budget: `40` has no unit: did you mean `40Gi`? (sizes are like 24Gi, 80G, \
             23028Mi or 24GiB)\n",
        ),
        (
            &["--budget", "42949672960"][..],
            "error: --budget: `42949672960` has no unit: did you mean `42949672960B`? (sizes are \
             like 24Gi, 80G, 23028Mi or 24GiB)\n",
        ),
        (
            &["--gpu-memory", "40"][..],
            "error: --gpu-memory: `40` has no unit: did you mean `40Gi`? (sizes are like 24Gi, \
             80G, 23028Mi or 24GiB)\n",
        ),
    ] {
        let out = memguard(&[&base[..], args].concat());
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(said), "{args:?}: {err}");
    }
    // Both spellings as before; the table says the budget back as written.
    let out = memguard(&[&base[..], &["--budget", "40GiB"]].concat());
    assert_ne!(out.status.code(), Some(2), "read (fits or not)");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("\nbudget 40GiB (40.00 GiB)\n"), "{table}");
    let out = memguard(&[&base[..], &["--budget", "40Gi", "--output", "json"]].concat());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["budget_bytes"], 40u64 << 30);
    let out = memguard(&[&base[..], &["--batch-size", "7B"]].concat());
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("batch-size") && err.contains("whole number"),
        "{err}"
    );
}

/// `--serve` ignored `--method` and `--batch-size` without a word; it says so now.
#[test]
fn serve_names_the_training_flags_it_ignores() {
    let out = memguard(&[
        "estimate",
        "--model",
        "llama-3-8b",
        "--serve",
        "--method",
        "lora",
        "--batch-size",
        "4",
    ]);
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--serve ignores --method, --batch-size"),
        "{err}"
    );
    let out = memguard(&["estimate", "--model", "llama-3-8b", "--serve"]);
    assert!(!String::from_utf8_lossy(&out.stderr).contains("ignores"));
}

/// Issue 38, item 6: the verdict names the upper bound it is taken against, and the shortfall
/// from it (the old line read "needs 64.68 GiB of 72.00 GiB (0 B short)"); a larger GPU of the
/// policy's table is named when one fits.
#[test]
fn the_verdict_says_the_upper_bound_and_names_a_larger_gpu() {
    let args = [
        "estimate",
        "--model",
        "llama-3.2-3b",
        "--method",
        "full",
        "--batch-size",
        "4",
        "--seq-length",
        "2048",
        "--gpu-memory",
        "80GiB",
    ];
    let out = memguard(&args);
    assert_eq!(out.status.code(), Some(3));
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with("DOES NOT FIT"))
        .expect("verdict");
    let v = json(&args);
    let (total, upper, budget) = (
        u64_at(&v, "planned_total_bytes"),
        u64_at(&v, "planned_upper_bytes"),
        u64_at(&v, "budget_bytes"),
    );
    assert!(total <= budget && upper > budget, "the case: {v}");
    assert!(
        line.contains(" (upper bound ")
            && line.contains(" at 0.95) of 72.00 GiB (")
            && !line.contains("(0 B short)"),
        "{line}"
    );
    let larger = v["suggestions"]
        .as_array()
        .expect("suggestions")
        .iter()
        .find(|s| {
            s["change"]
                .as_str()
                .is_some_and(|c| c.starts_with("a larger GPU: "))
        })
        .unwrap_or_else(|| panic!("{v}"));
    assert_eq!(larger["fits"], true, "{larger}");
    // Planned into that GPU's budget, which the suggestion carries.
    assert!(
        u64_at(larger, "budget_bytes") > budget
            && u64_at(larger, "upper_bytes") <= u64_at(larger, "budget_bytes"),
        "{larger}"
    );
    assert!(text.contains("  - a larger GPU: "), "{text}");
}

/// Issue 38, item 6: what the flags leave to a default or ignore is said, and two budgets are
/// refused; the header shows the parallelism and the world size.
#[test]
fn ignored_or_defaulted_parallelism_flags_are_said_and_two_budgets_refused() {
    let base = ["estimate", "--model", "llama-3-8b", "--method", "lora"];
    let out = memguard(&[&base[..], &["--parallelism", "fsdp"]].concat());
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--parallelism fsdp without --world-size: world size 1 assumed"),
        "{err}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with(
            "llama-3-8b: lora training, bf16-mixed, adamw on cuda, parallelism fsdp × 1;"
        ),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = memguard(&[&base[..], &["--world-size", "8"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--world-size 8 ignored"), "{err}");
    let out = memguard(&[&base[..], &["--parallelism", "zero3", "--world-size", "8"]].concat());
    assert!(String::from_utf8_lossy(&out.stderr).is_empty());
    assert!(String::from_utf8_lossy(&out.stdout).contains("parallelism zero3 × 8;"));
    for other in [
        &["--gpu-memory", "80GiB"][..],
        &["--safety-ratio", "0.5"][..],
    ] {
        let out = memguard(&[&base[..], &["--budget", "40GiB"], other].concat());
        assert_eq!(out.status.code(), Some(2), "{other:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--budget is the memory the plan aims at") && err.contains(other[0]),
            "{err}"
        );
    }
}
