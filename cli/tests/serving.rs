//! One serving decision, three commands: the webhook's serving fixtures through `memguard
//! mutate` (admission), `memguard explain` (the pod as given) and `memguard estimate
//! --server-command` (the pod described by flags) give the same fraction, maximum length, KV
//! cache, tokens and error. Through the real binary.

use serde_json::Value;
use std::process::{Command, Output};

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../webhook/tests/fixtures/serving"
);

fn memguard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memguard"))
        .args(args)
        .output()
        .expect("memguard runs")
}

fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// The fixture, its policy (`servingShortenMaxLength` or not), and the estimate flags for the
/// same pod.
struct Case {
    file: &'static str,
    policy: &'static str,
    command: &'static str,
    pod_flags: &'static [&'static str],
}

const CASES: &[Case] = &[
    Case {
        file: "vllm-kai-half.yaml",
        policy: "{}",
        command: "vllm serve meta-llama/Llama-3.1-8B-Instruct --max-model-len 8192 --port 8000",
        pod_flags: &[
            "--gpu-product",
            "NVIDIA-H100-80GB-HBM3",
            "--pod-annotation",
            "gpu-fraction=0.5",
        ],
    },
    Case {
        file: "vllm-mig-too-long.yaml",
        policy: "{}",
        command: "python3 -m vllm.entrypoints.openai.api_server \
                  --model=meta-llama/Llama-3.1-8B-Instruct --max_model_len=32768",
        pod_flags: &[
            "--gpu-product",
            "NVIDIA-H100-80GB-HBM3-MIG-2g.20gb",
            "--gpu-resource",
            "nvidia.com/gpu",
        ],
    },
    Case {
        file: "vllm-mig-too-long.yaml",
        policy: "servingShortenMaxLength: true",
        command: "python3 -m vllm.entrypoints.openai.api_server \
                  --model=meta-llama/Llama-3.1-8B-Instruct --max_model_len=32768",
        pod_flags: &[
            "--gpu-product",
            "NVIDIA-H100-80GB-HBM3-MIG-2g.20gb",
            "--gpu-resource",
            "nvidia.com/gpu",
        ],
    },
];

const SAME: &[&str] = &[
    "engine",
    "fraction",
    "maxLength",
    "kvCacheBytes",
    "tokensFit",
    "concurrency",
    "seen",
    "budget",
    "budgetSource",
    "fits",
];

#[test]
fn mutate_explain_and_estimate_agree_on_each_server() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (i, case) in CASES.iter().enumerate() {
        let policy = dir.path().join(format!("policy-{i}.yaml"));
        std::fs::write(&policy, case.policy).expect("policy");
        let policy = policy.to_str().expect("path");
        let pod = format!("{FIXTURES}/{}", case.file);

        let mutated = json_of(&memguard(&[
            "mutate",
            "-f",
            &pod,
            "-o",
            "json",
            "--policy-file",
            policy,
        ]));
        let annotated: Value = serde_json::from_str(
            mutated["metadata"]["annotations"]["memguard.io/estimate"]
                .as_str()
                .expect("estimate annotation"),
        )
        .expect("estimate JSON");
        let explained = json_of(&memguard(&[
            "explain",
            "-f",
            &pod,
            "-o",
            "json",
            "--policy-file",
            policy,
        ]));
        let mut flags = vec![
            "estimate",
            "--server-command",
            case.command,
            "--output",
            "json",
        ];
        flags.extend(["--policy-file", policy]);
        flags.extend(case.pod_flags);
        // `estimate` exits 3 exactly when the server cannot fit its share (as for a training
        // plan); its JSON is printed either way.
        let out = memguard(&flags);
        let estimated: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        let want = if estimated["error"].is_null() { 0 } else { 3 };
        assert_eq!(out.status.code(), Some(want), "{}: {estimated}", case.file);
        for key in SAME {
            assert_eq!(
                annotated[key], explained[key],
                "{} {}: {key}",
                case.file, case.policy
            );
            assert_eq!(
                annotated[key], estimated[key],
                "{} {}: {key}",
                case.file, case.policy
            );
        }
        let error = mutated["metadata"]["annotations"]["memguard.io/error"].as_str();
        assert_eq!(error, explained["error"].as_str(), "{}", case.file);
        assert_eq!(error, estimated["error"].as_str(), "{}", case.file);
        // The mutated pod, explained again, fits as written: the decision is stable.
        let again = dir.path().join(format!("mutated-{i}.json"));
        std::fs::write(&again, mutated.to_string()).expect("write");
        let re = json_of(&memguard(&[
            "explain",
            "-f",
            again.to_str().expect("path"),
            "-o",
            "json",
            "--policy-file",
            policy,
        ]));
        assert_eq!(re["asWritten"], true, "{}: {re}", case.file);
    }
}

#[test]
fn a_command_that_is_no_server_is_bad_input() {
    let out = memguard(&[
        "estimate",
        "--server-command",
        "python train.py",
        "--gpu-resource",
        "nvidia.com/gpu",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("launches no server"));
}

#[test]
fn a_server_without_a_gpu_is_told_which_flag_gives_one() {
    // A product alone pins no GPU to the pod: the server would run on the CPU, which memguard
    // does not fit; the message names the flag that asks for one.
    let out = memguard(&[
        "estimate",
        "--server-command",
        "vllm serve meta-llama/Llama-3.1-8B-Instruct",
        "--gpu-product",
        "NVIDIA-A100-SXM4-40GB",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--gpu-resource nvidia.com/gpu"), "{stderr}");
}
