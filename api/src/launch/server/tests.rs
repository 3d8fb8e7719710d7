use super::*;
use crate::launch::Field;

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn find(command: &[&str], args: &[&str]) -> Option<ServerLaunch> {
    ServerLaunch::find(&strings(command), &strings(args), !args.is_empty())
}

impl ServerLaunch {
    fn rewrite_ok(&self, set: &[(&str, String)]) -> Vec<ArgvEdit> {
        self.rewrite(set).expect("writable")
    }
}

fn set(key: &'static str, value: &str) -> (&'static str, String) {
    (key, value.to_string())
}

#[test]
fn recognises_the_three_launch_forms_and_their_models() {
    let cases: &[(&[&str], &[&str], Engine, &str)] = &[
        (
            &["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"],
            &[],
            Engine::Vllm,
            "meta-llama/Llama-3.1-8B-Instruct",
        ),
        (
            &["/usr/local/bin/vllm"],
            &[
                "serve",
                "Qwen/Qwen2.5-7B-Instruct",
                "--max-model-len",
                "8192",
            ],
            Engine::Vllm,
            "Qwen/Qwen2.5-7B-Instruct",
        ),
        (
            &["python3", "-m", VLLM_MODULE],
            &["--model=mistralai/Mistral-7B-v0.1"],
            Engine::Vllm,
            "mistralai/Mistral-7B-v0.1",
        ),
        (
            &["python", "-m", VLLM_MODULE],
            &[],
            Engine::Vllm,
            VLLM_DEFAULT_MODEL,
        ),
        (
            &[
                "python3.11",
                "-m",
                SGLANG_MODULE,
                "--model-path",
                "/models/llama-3-8b",
            ],
            &[],
            Engine::Sglang,
            "/models/llama-3-8b",
        ),
        (
            &["bash", "-c"],
            &[
                "pip list; exec python3 -m sglang.launch_server --model-path 'Qwen/Qwen2.5-7B' --port 30000",
            ],
            Engine::Sglang,
            "Qwen/Qwen2.5-7B",
        ),
        (
            &[
                "/bin/sh",
                "-ec",
                "HF_HOME=/cache vllm serve \"google/gemma-2-9b-it\" && sleep 1",
            ],
            &[],
            Engine::Vllm,
            "google/gemma-2-9b-it",
        ),
    ];
    for (command, args, engine, model) in cases {
        let l = find(command, args).unwrap_or_else(|| panic!("{command:?} {args:?}"));
        assert_eq!(l.engine, *engine, "{command:?}");
        assert_eq!(l.model, *model, "{command:?}");
    }
}

#[test]
fn other_programs_are_not_servers() {
    for (command, args) in [
        (vec!["python", "train.py"], vec!["--model", "x"]),
        (vec!["python", "-m", "vllm.entrypoints.cli.main"], vec![]),
        (vec!["vllm", "bench", "serve"], vec![]),
        (vec!["bash", "-c", "echo vllm serve x"], vec![]),
        (vec!["bash", "script.sh"], vec![]),
        (vec!["torchrun", "-m", SGLANG_MODULE], vec![]),
    ] {
        assert!(find(&command, &args).is_none(), "{command:?} {args:?}");
    }
}

#[test]
fn flags_follow_argparse_last_wins_both_forms_and_vllm_underscores() {
    let l = find(
        &["vllm", "serve", "m"],
        &[
            "--max_model_len",
            "4096",
            "--gpu-memory-utilization=0.8",
            "--max-model-len=8192",
            "-tp",
            "2",
            "--enforce-eager",
        ],
    )
    .expect("server");
    assert_eq!(l.flag(VLLM_FLAGS.max_length), Some("8192"));
    assert_eq!(l.flag(VLLM_FLAGS.fraction), Some("0.8"));
    assert_eq!(l.flag(VLLM_FLAGS.tensor_parallel), Some("2"));
    assert!(l.switch("enforce-eager"));
    // SGLang's argparse has no underscore spelling.
    let s = find(
        &["python", "-m", SGLANG_MODULE],
        &["--model-path", "m", "--context_length", "4096"],
    )
    .expect("server");
    assert_eq!(s.flag(SGLANG_FLAGS.max_length), None);
}

#[test]
fn settings_read_every_memory_flag() {
    let shape = memguard_estimator::catalog::lookup("llama-3-8b").expect("catalog");
    let l = find(
        &["vllm", "serve", "m"],
        &[
            "--max-model-len",
            "32k",
            "--max-num-seqs",
            "64",
            "--max-num-batched-tokens",
            "4096",
            "--tensor-parallel-size",
            "2",
            "--kv-cache-dtype",
            "fp8_e4m3",
            "--quantization",
            "awq",
            "--gpu-memory-utilization",
            "0.7",
            "--kv-cache-memory-bytes",
            "8G",
            "--enforce-eager",
        ],
    )
    .expect("server");
    let s = l.settings(shape.clone(), None).expect("valid");
    assert_eq!(s.serving.max_seq_length, 32_000);
    assert!(s.max_length_given);
    assert_eq!(s.max_sequences, Some(64));
    assert_eq!(s.batched_tokens, Some(4096));
    assert_eq!(s.tensor_parallel, 2);
    assert_eq!(s.serving.kv_cache_bits, 8);
    assert_eq!(s.serving.model_bits, 4);
    assert_eq!(s.fraction, Some(0.7));
    assert_eq!(s.kv_cache_memory, Some(Bytes(8 << 30)));
    assert!(s.enforce_eager);

    let bad = find(
        &["python", "-m", SGLANG_MODULE],
        &[
            "--model-path",
            "m",
            "--mem-fraction-static",
            "1.5",
            "--context-length",
            "lots",
            "--kv-cache-dtype",
            "int3",
        ],
    )
    .expect("server");
    let errors = bad.settings(shape.clone(), None).expect_err("invalid");
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert!(errors.iter().any(|e| e.contains("--mem-fraction-static")));
    assert!(errors.iter().any(|e| e.contains("--context-length")));

    // KAITO's `--max-model-len=auto` leaves the length to the engine.
    let auto = find(&["vllm", "serve", "m", "--max-model-len=auto"], &[]).expect("server");
    assert!(!auto.settings(shape, None).expect("valid").max_length_given);
}

#[test]
fn argv_rewrites_replace_values_in_place_and_append_what_is_missing() {
    let l = find(
        &["vllm", "serve"],
        &["m", "--max-model-len=32768", "--port", "8000"],
    )
    .expect("server");
    let edits = l.rewrite_ok(&[
        set(VLLM_FLAGS.max_length, "16384"),
        set(VLLM_FLAGS.fraction, "0.48"),
    ]);
    assert_eq!(
        edits,
        vec![
            ArgvEdit::Replace {
                field: Field::Args,
                index: 1,
                value: "--max-model-len=16384".into()
            },
            ArgvEdit::Append {
                field: Field::Args,
                value: "--gpu-memory-utilization".into()
            },
            ArgvEdit::Append {
                field: Field::Args,
                value: "0.48".into()
            },
        ]
    );
    // All in `command`: the values go there.
    let l = find(
        &["vllm", "serve", "m", "--gpu-memory-utilization", "0.9"],
        &[],
    )
    .expect("server");
    assert_eq!(
        l.rewrite_ok(&[set(VLLM_FLAGS.fraction, "0.48")]),
        vec![ArgvEdit::Replace {
            field: Field::Command,
            index: 4,
            value: "0.48".into()
        }]
    );
}

#[test]
fn script_rewrites_keep_every_other_byte() {
    let script = "set -e\n# serve\nexec python3 -m sglang.launch_server \\\n  --model-path \"Qwen/Qwen2.5-7B\" --context-length=\"32768\" --port 30000 && echo done";
    let l = find(&["bash", "-c", script], &[]).expect("server");
    let edits = l.rewrite_ok(&[
        set(SGLANG_FLAGS.max_length, "9000"),
        set(SGLANG_FLAGS.fraction, "0.375"),
    ]);
    let [
        ArgvEdit::Replace {
            field,
            index,
            value,
        },
    ] = edits.as_slice()
    else {
        panic!("{edits:?}");
    };
    assert_eq!((*field, *index), (Field::Command, 2));
    assert_eq!(
        value,
        "set -e\n# serve\nexec python3 -m sglang.launch_server \\\n  --model-path \"Qwen/Qwen2.5-7B\" --context-length=9000 --port 30000 --mem-fraction-static 0.375 && echo done"
    );
    // A quoted `"--k=v"` word keeps its closing quote.
    let l = find(&["sh", "-c", "vllm serve m \"--max-model-len=4096\""], &[]).expect("server");
    let edits = l.rewrite_ok(&[set(VLLM_FLAGS.max_length, "2048")]);
    let [ArgvEdit::Replace { value, .. }] = edits.as_slice() else {
        panic!("{edits:?}");
    };
    assert_eq!(value, "vllm serve m \"--max-model-len=2048\"");
}

#[test]
fn a_server_after_another_python_program_is_found() {
    // `launch::find` alone stops at the first launch (the download); the server is after it.
    let l = find(
        &["bash", "--login", "-c"],
        &["python download.py && exec env HF_HOME=/c vllm serve m --max_model_len 4096"],
    )
    .expect("server");
    assert_eq!((l.engine, l.model.as_str()), (Engine::Vllm, "m"));
    assert_eq!(l.flag(VLLM_FLAGS.max_length), Some("4096"));
    // A switch does not take the next word; `--no-…` turns it off.
    let l = find(
        &[
            "vllm",
            "serve",
            "m",
            "--enforce-eager",
            "--no-enforce-eager",
        ],
        &[],
    )
    .expect("server");
    assert!(!l.switch("enforce-eager"));
    // After `--` a flag cannot be appended.
    let l = find(&["vllm", "serve", "m", "--", "x"], &[]).expect("server");
    assert_eq!(
        l.rewrite(&[set(VLLM_FLAGS.fraction, "0.5")]),
        Err(SetError::OptionsEnded(VLLM_FLAGS.fraction.into()))
    );
    // `-tp=2` is an option too.
    let l = find(&["vllm", "serve", "m", "-tp=2"], &[]).expect("server");
    assert_eq!(l.flag(VLLM_FLAGS.tensor_parallel), Some("2"));
    assert_eq!(
        l.rewrite_ok(&[set(VLLM_FLAGS.tensor_parallel, "4")]),
        vec![ArgvEdit::Replace {
            field: Field::Command,
            index: 3,
            value: "-tp=4".into()
        }]
    );
}

#[test]
fn human_ints_follow_vllm() {
    assert_eq!(human_int("25600"), Some(25600));
    assert_eq!(human_int("1k"), Some(1000));
    assert_eq!(human_int("1K"), Some(1024));
    assert_eq!(human_int("2G"), Some(2 << 30));
    assert_eq!(human_int("x"), None);
    assert_eq!(human_int(""), None);
}

#[test]
fn a_script_in_args_is_rewritten_in_args() {
    let l = find(
        &["/bin/bash", "-lc"],
        &["vllm serve m --gpu-memory-utilization 0.95 # the whole card"],
    )
    .expect("server");
    assert!(l.in_script());
    assert_eq!(
        l.rewrite_ok(&[set(VLLM_FLAGS.fraction, "0.48")]),
        vec![ArgvEdit::Replace {
            field: Field::Args,
            index: 0,
            value: "vllm serve m --gpu-memory-utilization 0.48 # the whole card".into()
        }]
    );
    // Setting what is already there changes nothing.
    assert!(l.rewrite_ok(&[set(VLLM_FLAGS.fraction, "0.95")]).is_empty());
    // Empty `args` next to a full `command`: appended flags follow the command, in `args`.
    let l = ServerLaunch::find(&strings(&["vllm", "serve", "m"]), &[], true).expect("server");
    assert_eq!(
        l.rewrite_ok(&[set(VLLM_FLAGS.max_length, "4096")])[0],
        ArgvEdit::Append {
            field: Field::Args,
            value: "--max-model-len".into()
        }
    );
}
