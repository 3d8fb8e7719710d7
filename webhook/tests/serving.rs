//! Inference servers at admission, end to end through `mutate` and `patch::build`: every pod
//! under `tests/fixtures/serving/` is admitted under the fixture policy (and, where the maximum
//! length does not fit, under one that allows shortening it). Each output is applied, checked by
//! `kubernetes-validate --strict`, admitted again (no second patch), and its command line is read
//! back by the engines' argument parsers as written from their source at pinned versions
//! (`tests/fixtures/serving/engine_args.py`: vLLM v0.10.1, SGLang v0.4.9).

use json_patch::Patch;
use k8s_openapi::api::core::v1::Pod;
use memguard_api::Policy;
use memguard_api::annotations as keys;
use memguard_webhook::policy_sources::{Overrides, policy_from_str};
use memguard_webhook::{ClusterView, Outcome, mutate, patch};
use serde_json::{Value, json};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn policy(extra: &str) -> Policy {
    let text = std::fs::read_to_string(fixtures().join("policy.yaml")).expect("policy fixture");
    policy_from_str(Some(&format!("{text}\n{extra}")), &Overrides::default()).expect("valid policy")
}

struct Admitted {
    original: Value,
    applied: Value,
    outcome: Outcome,
    patch: Patch,
}

fn admit(file: &str, policy: &Policy) -> Admitted {
    let text = std::fs::read_to_string(fixtures().join("serving").join(file)).expect("fixture");
    let original: Value = serde_saphyr::from_str(&text).expect("YAML");
    let pod: Pod = serde_json::from_value(original.clone()).expect("a Pod");
    let outcome = mutate(&pod, policy, &ClusterView::default());
    let patch = patch::build(&pod, &outcome);
    let mut applied = original.clone();
    json_patch::patch(&mut applied, &patch).expect("patch applies");
    // Admitted again (reinvocation), the pod needs nothing more.
    let mutated: Pod = serde_json::from_value(applied.clone()).expect("still a Pod");
    let again = patch::build(&mutated, &mutate(&mutated, policy, &ClusterView::default()));
    assert!(again.0.is_empty(), "{file}: second patch {again:?}");
    Admitted {
        original,
        applied,
        outcome,
        patch,
    }
}

fn argv(pod: &Value) -> Vec<String> {
    let c = &pod["spec"]["containers"][0];
    ["command", "args"]
        .iter()
        .flat_map(|f| c[f].as_array().cloned().unwrap_or_default())
        .map(|v| v.as_str().expect("string").to_string())
        .collect()
}

fn estimate(pod: &Value) -> Value {
    let text = pod["metadata"]["annotations"][keys::ESTIMATE]
        .as_str()
        .expect("estimate annotation");
    serde_json::from_str(text).expect("estimate JSON")
}

/// The engines' parsers (pinned, see the module's doc) on each argv.
fn engine_parse(argvs: &[Vec<String>]) -> Vec<Value> {
    let Some(python) =
        memguard_e2e::find_tool("python3", "PYTHON").or_else(|| memguard_e2e::missing("python3"))
    else {
        return Vec::new();
    };
    let mut child = Command::new(python)
        .arg(fixtures().join("serving/engine_args.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(json!(argvs).to_string().as_bytes())
        .expect("write");
    let out = child.wait_with_output().expect("parser runs");
    assert!(out.status.success());
    serde_json::from_slice(&out.stdout).expect("parser JSON")
}

#[test]
fn vllm_on_half_an_h100_through_kai_gets_a_utilization_within_its_half() {
    let a = admit("vllm-kai-half.yaml", &policy(""));
    let Outcome::Served(s) = &a.outcome else {
        panic!("{:?}", a.outcome);
    };
    assert!(s.error.is_none(), "{:?}", s.error);
    let args = argv(&a.applied);
    // The user's words kept, the utilization appended.
    assert_eq!(args[..7], argv(&a.original)[..], "{args:?}");
    assert_eq!(args[7], "--gpu-memory-utilization");
    let parsed = &engine_parse(std::slice::from_ref(&args))[..];
    if let [p] = parsed {
        let fraction = p["fraction"].as_f64().expect("fraction");
        // 81008 MiB seen; the pod's half, CUDA graphs (outside the utilization) included.
        let seen_gib = 81008.0 / 1024.0;
        assert!(
            fraction * seen_gib + 1.5 <= seen_gib / 2.0,
            "{fraction} of {seen_gib} GiB is not within half"
        );
        assert!(fraction >= 0.45, "{fraction}: the half is used");
        assert_eq!(p["maxLength"], 8192);
        assert_eq!(p["model"], "meta-llama/Llama-3.1-8B-Instruct");
    }
    let e = estimate(&a.applied);
    assert_eq!(e["engine"], "vllm");
    assert_eq!(e["budgetSource"]["kind"], "kai");
    assert!(e["tokensFit"].as_u64().expect("tokens") >= 8192);
    assert!(e["concurrency"].as_f64().expect("concurrency") >= 1.0);
    assert!(e["kvCacheBytes"].as_u64().expect("bytes") > 0);
}

#[test]
fn vllm_whose_length_cannot_fit_its_mig_slice_is_told_why_or_shortened() {
    // The policy does not allow a shorter length: the numbers, and the command line as written.
    let strict = admit("vllm-mig-too-long.yaml", &policy(""));
    assert_eq!(argv(&strict.applied), argv(&strict.original));
    let error = strict.applied["metadata"]["annotations"][keys::ERROR]
        .as_str()
        .expect("memguard.io/error");
    assert!(
        error.starts_with("cannot fit: vllm --max-model-len 32768 needs 4.00 GiB"),
        "{error}"
    );
    assert!(error.contains("tokens fit"), "{error}");
    assert!(error.contains("does not allow shorter"), "{error}");
    assert_eq!(estimate(&strict.applied)["fits"], false);

    // It does: the length the slice holds, with the utilization the slice allows.
    let lenient = admit(
        "vllm-mig-too-long.yaml",
        &policy("servingShortenMaxLength: true"),
    );
    let Outcome::Served(s) = &lenient.outcome else {
        panic!("{:?}", lenient.outcome);
    };
    assert!(s.error.is_none(), "{:?}", s.error);
    let args = argv(&lenient.applied);
    assert!(lenient.applied["metadata"]["annotations"][keys::ERROR].is_null());
    let parsed = engine_parse(std::slice::from_ref(&args));
    if let [p] = &parsed[..] {
        let length = p["maxLength"].as_u64().expect("length");
        assert!((8192..32768).contains(&length), "{length}");
        assert_eq!(length, s.fit.tokens_fit);
        let fraction = p["fraction"].as_f64().expect("fraction");
        assert!(fraction > 0.9 && fraction < 1.0, "{fraction}");
    }
    // The user's `--max_model_len=` word is rewritten in place, in its own spelling.
    assert!(args[4].starts_with("--max_model_len="), "{args:?}");
}

#[test]
fn servers_that_fit_keep_their_command_lines_byte_for_byte() {
    for file in ["sglang-hami-fits.yaml", "vllm-whole-fits.yaml"] {
        let a = admit(file, &policy(""));
        let Outcome::Served(s) = &a.outcome else {
            panic!("{file}: {:?}", a.outcome);
        };
        assert!(
            s.fit.as_written() && s.error.is_none(),
            "{file}: {:?}",
            s.fit
        );
        let touched: Vec<String> = a
            .patch
            .0
            .iter()
            .map(|op| op.path().to_string())
            .filter(|p| p.starts_with("/spec"))
            .collect();
        assert!(touched.is_empty(), "{file}: {touched:?}");
        assert_eq!(a.applied["spec"], a.original["spec"], "{file}");
        assert_eq!(estimate(&a.applied)["fits"], true, "{file}");
    }
}

#[test]
fn sglang_on_half_an_h100_through_kai_keeps_its_reserve_within_the_half() {
    let a = admit("sglang-kai-half.yaml", &policy(""));
    let Outcome::Served(s) = &a.outcome else {
        panic!("{:?}", a.outcome);
    };
    let args = argv(&a.applied);
    assert_eq!(args.len(), 3);
    assert!(
        args[2].ends_with("--port 30000 --mem-fraction-static 0.375"),
        "{args:?}"
    );
    assert!(s.fit.peak <= s.share, "{:?}", s.fit);
    let parsed = engine_parse(std::slice::from_ref(&args));
    if let [p] = &parsed[..] {
        assert_eq!(p["engine"], "sglang");
        assert_eq!(p["fraction"], 0.375);
        assert_eq!(p["maxLength"], 16384);
    }
}

/// Every output is a valid pod for the Kubernetes schema.
#[test]
fn every_output_is_valid_kubernetes() {
    let Some(tool) = memguard_e2e::kubernetes_validate() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut files = Vec::new();
    let lenient = policy("servingShortenMaxLength: true");
    for entry in std::fs::read_dir(fixtures().join("serving")).expect("fixtures") {
        let path = entry.expect("entry").path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if !name.ends_with(".yaml") {
            continue;
        }
        for (tag, p) in [("strict", policy("")), ("lenient", lenient.clone())] {
            let a = admit(name, &p);
            let file = dir.path().join(format!("{tag}-{name}"));
            std::fs::write(&file, a.applied.to_string()).expect("write");
            files.push(file);
        }
    }
    assert_eq!(files.len(), 10);
    if let Err(out) = memguard_e2e::validate_manifests(&tool, &files) {
        panic!("kubernetes-validate rejected a server pod:\n{out}");
    }
}
