//! The host figure of `memguard estimate` (issue #39), end to end through the real binary.

use serde_json::Value;
use std::process::{Command, Output};

fn memguard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memguard"))
        .args(args)
        .output()
        .expect("the memguard binary runs")
}

fn json(args: &[&str]) -> Value {
    let out = memguard(&[&["estimate"], args, &["--output", "json"]].concat());
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the output is JSON")
}

fn component(v: &Value, name: &str) -> u64 {
    v["host_components"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("host_components.{name} missing in {v}"))
}

const FSDP_8: [&str; 6] = [
    "--model",
    "llama-3-8b",
    "--parallelism",
    "fsdp",
    "--world-size",
    "16",
];

#[test]
fn a_gpu_job_has_a_host_figure_per_pod_with_its_components() {
    let v = json(&[&FSDP_8[..], &["--gpus-per-pod", "8"]].concat());
    assert_eq!(v["host_ranks_in_pod"], 8);
    let parts = ["load", "input", "save", "offload", "runtime"].map(|c| component(&v, c));
    let [load, input, save, offload, runtime] = parts;
    let peak = v["host_bytes"].as_u64().expect("host_bytes");
    // The peak is the largest phase, never their sum.
    assert_eq!(peak, (runtime + load).max(runtime + input + offload + save));
    // An 8B bf16 checkpoint's pages are cached once: at least 16 GB at load.
    assert!(load >= 16_000_000_000, "{v}");
    assert!(runtime > 0 && save > 0);
    assert_eq!(offload, 0);
    assert!(v["total_bytes"].as_u64().is_some(), "the GPU figure stays");
}

#[test]
fn upcasting_on_load_costs_a_copy_per_rank_of_the_pod() {
    let auto = json(&[&FSDP_8[..], &["--gpus-per-pod", "8"]].concat());
    let fp32 = json(
        &[
            &FSDP_8[..],
            &["--gpus-per-pod", "8", "--load-dtype", "fp32"],
        ]
        .concat(),
    );
    let four = json(
        &[
            &FSDP_8[..],
            &["--gpus-per-pod", "4", "--load-dtype", "fp32"],
        ]
        .concat(),
    );
    let copy8 = component(&fp32, "load") - component(&auto, "load");
    let copy4 = component(&four, "load") - component(&auto, "load");
    // 8 copies of 8B parameters in fp32, then 4.
    assert!(copy8 > 8 * 30_000_000_000, "{copy8}");
    assert_eq!(copy8 / 2 / 1_000_000, copy4 / 1_000_000);
}

#[test]
fn the_host_flags_move_their_components() {
    let base = json(&[&FSDP_8[..], &["--gpus-per-pod", "8"]].concat());
    let fed = json(
        &[
            &FSDP_8[..],
            &["--gpus-per-pod", "8", "--dataloader-workers", "8"],
            &["--batch-size", "8", "--seq-length", "8192"],
            &[
                "--save",
                "full-with-optimizer",
                "--optimizer-offload",
                "true",
            ],
        ]
        .concat(),
    );
    assert!(component(&fed, "input") > component(&base, "input"));
    assert!(component(&fed, "save") > component(&base, "save"));
    assert!(component(&fed, "offload") > 0);
}

#[test]
fn each_defaulted_host_flag_is_said() {
    let v = json(&["--model", "llama-3-8b"]);
    let defaults = v["host_defaults"].as_array().expect("host_defaults");
    let table = memguard(&["estimate", "--model", "llama-3-8b"]);
    let table = String::from_utf8_lossy(&table.stdout);
    for flag in [
        "--gpus-per-pod",
        "--checkpoint-dtype",
        "--load-dtype",
        "--save",
    ] {
        assert!(
            defaults
                .iter()
                .any(|d| d.as_str().is_some_and(|d| d.contains(flag))),
            "{flag} not in {defaults:?}"
        );
        assert!(
            table.contains(&format!("  host: {flag} not given: ")),
            "{flag} not said: {table}"
        );
    }
    let given = json(&[
        "--model",
        "llama-3-8b",
        "--gpus-per-pod",
        "1",
        "--checkpoint-dtype",
        "bf16",
        "--load-dtype",
        "auto",
        "--save",
        "none",
        "--dataloader-workers",
        "2",
    ]);
    assert_eq!(given["host_defaults"], serde_json::json!([]));
    assert_eq!(component(&given, "save"), 0);
}

#[test]
fn the_table_shows_the_host_figure_beside_the_gpu_figure() {
    let out = memguard(&["estimate", "--model", "llama-3-8b", "--gpus-per-pod", "2"]);
    let table = String::from_utf8_lossy(&out.stdout);
    let gpu = table.find("total").expect("the GPU total");
    let host = table
        .find("host memory per pod (2 rank(s)):")
        .expect("the host line");
    assert!(host > gpu, "{table}");
}

#[test]
fn the_ranks_in_the_pod_are_the_gpus_it_asks_for_unless_given() {
    let gpus = ["--gpu-resource", "nvidia.com/gpu=4"];
    let v = json(&[&FSDP_8[..], &gpus].concat());
    assert_eq!(v["host_ranks_in_pod"], 4);
    assert!(
        v["host_defaults"][0]
            .as_str()
            .is_some_and(|d| d.contains("the GPUs --gpu-resource asks for")),
        "{v}"
    );
    let v = json(&[&FSDP_8[..], &gpus, &["--gpus-per-pod", "2"]].concat());
    assert_eq!(v["host_ranks_in_pod"], 2);
}

#[test]
fn a_cpu_job_has_no_separate_host_figure() {
    let v = json(&["--model", "llama-3-8b", "--device", "cpu"]);
    assert!(v.get("host_bytes").is_none(), "{v}");
}

#[test]
fn bad_host_flags_are_refused_with_a_clear_message() {
    for (args, expected) in [
        (
            &["--save", "everything"][..],
            "--save: unknown mode `everything`",
        ),
        (&["--load-dtype", "int3"][..], "--load-dtype: unknown dtype"),
        (
            &["--gpus-per-pod", "0"][..],
            "--gpus-per-pod: must be at least 1",
        ),
    ] {
        let out = memguard(&[&["estimate", "--model", "llama-3-8b"], args].concat());
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expected), "{stderr}");
    }
}

/// `--ram-efficient-loading true` is counted as admission counts FSDP's
/// `cpu_ram_efficient_loading: true` under transformers 5.23: every rank still loads (measured,
/// `bench/host/ram_efficient_load.py`), so the load is the same as without it, and the output
/// says why (source `inert:transformers-5`).
#[test]
fn ram_efficient_loading_is_counted_as_admission_counts_it() {
    let loading = |flag: &[&str]| {
        let args = [
            &FSDP_8[..],
            &["--gpus-per-pod", "8", "--load-dtype", "fp32"],
            flag,
        ]
        .concat();
        json(&args)
    };
    let off = loading(&["--ram-efficient-loading", "false"]);
    let on = loading(&["--ram-efficient-loading", "true"]);
    assert_eq!(component(&on, "load"), component(&off, "load"), "{on}");
    let said = on["host_defaults"].to_string();
    assert!(said.contains("inert:transformers-5"), "{said}");
    let table = memguard(
        &[
            &["estimate"],
            &FSDP_8[..],
            &["--gpus-per-pod", "8", "--ram-efficient-loading", "true"],
        ]
        .concat(),
    );
    let stdout = String::from_utf8_lossy(&table.stdout);
    assert!(stdout.contains("inert:transformers-5"), "{stdout}");
    let help = memguard(&["estimate", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("every rank"), "{help}");
}
