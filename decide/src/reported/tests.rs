use super::*;
use crate::testutil::at;
use k8s_openapi::api::core::v1::Pod;
use memguard_api::{Cluster, Policy};

/// A bespoke `train.py` taking `TrainingArguments`' flags on one 80 GB GPU: what it does not
/// pass, its own parser sets (unknown to admission).
fn script_pod(flags: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "sft", "namespace": "ml", "labels": {"memguard.io/enabled": "true"}},
        "spec": {"containers": [{
            "name": "t", "image": "x",
            "resources": {"limits": {"nvidia.com/gpu": "1"}},
            "command": ["python", "train.py"],
            "args": format!("--model_name_or_path meta-llama/Llama-3.1-8B \
                --per_device_train_batch_size 2 --gradient_accumulation_steps 4 \
                --output_dir /out {flags}").split_whitespace().collect::<Vec<_>>()
        }]}
    }))
    .expect("a pod")
}

fn report(config: &[(&str, f64)], mismatch: &[&str]) -> TrainerReport {
    TrainerReport {
        pod: "sft-1".into(),
        uid: "uid-1".into(),
        finished_at: at(10),
        config: config.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        mismatch: mismatch.iter().map(|k| k.to_string()).collect(),
    }
}

fn resolve(pod: &Pod) -> TrainingPod<'_> {
    TrainingPod::resolve(pod, &Policy::default(), Cluster::default()).expect("resolves")
}

#[test]
fn an_unknown_sequence_is_planned_on_the_reported_one() {
    let pod = script_pod("");
    let training = resolve(&pod);
    assert!(training.unknown.contains_key(&Knob::SeqLength));
    assert!(
        training.guessed().contains(&"seq-length"),
        "unplanned before"
    );

    let on = on_report(
        &training,
        &report(&[("seq-length", 1024.0), ("batch-size", 2.0)], &[]),
    );
    assert_eq!(on.filled, [(Knob::SeqLength, "1024".to_string())]);
    for pod in [&on.planning, &on.admitted] {
        assert_eq!(pod.config.seq_length, 1024);
        assert!(!pod.unknown.contains_key(&Knob::SeqLength));
        assert_eq!(pod.reported[&Knob::SeqLength], PROVENANCE);
        // Never a source read from the launch: nothing writes it there.
        assert!(!pod.sources.contains_key(&Knob::SeqLength));
        assert!(pod.guessed().is_empty(), "planned: {:?}", pod.guessed());
    }
    assert!(on.mismatches.is_empty());
    assert!(
        on.warnings[0].contains("report for seq-length 1024") && on.warnings[0].contains("sft-1"),
        "{:?}",
        on.warnings
    );
    // The decision now has a verdict on the reported sequence.
    let decided =
        crate::decision::decide(&on.planning, &Policy::default(), |_| None).expect("decided");
    assert_eq!(decided.plan.config.seq_length, 1024);
    assert!(decided.budget.is_some());
}

#[test]
fn a_read_value_the_trainer_ran_otherwise_is_planned_on_the_report_and_kept_in_the_launch() {
    let pod = script_pod("--max_length 512");
    let training = resolve(&pod);
    assert_eq!(training.config.seq_length, 512);
    let on = on_report(
        &training,
        &report(
            &[("seq-length", 1024.0), ("batch-size", 4.0)],
            // Only what the sidecar flagged: batch 4 was memguard's own plan, say.
            &["seq-length"],
        ),
    );
    assert!(on.filled.is_empty());
    assert_eq!(
        on.mismatches,
        [Mismatch {
            knob: Knob::SeqLength,
            read: "512".into(),
            reported: "1024".into()
        }]
    );
    assert_eq!(on.planning.config.seq_length, 1024);
    assert_eq!(on.planning.config.batch_size, 2, "not flagged: as read");
    assert_eq!(on.admitted.config.seq_length, 512, "the launch as read");
    assert!(
        on.warnings
            .iter()
            .any(|w| w.contains("the trainer ran seq-length 1024 where the launch says 512")),
        "{:?}",
        on.warnings
    );
    // The plan left the sequence at what runs: the rewrite leaves the launch's 512 alone; a
    // plan that cut below it writes the cut.
    let mut planned = on.planning.config.clone();
    assert_eq!(on.rewrite_target(&planned).seq_length, 512);
    planned.seq_length = 256;
    assert_eq!(on.rewrite_target(&planned).seq_length, 256);
}

#[test]
fn a_value_that_is_not_the_knobs_is_not_used() {
    let pod = script_pod("");
    let training = resolve(&pod);
    for bad in [0.0, -4.0, 2.5, f64::INFINITY, 1e12] {
        let on = on_report(&training, &report(&[("seq-length", bad)], &[]));
        assert!(!on.changes_anything(), "{bad}");
        assert!(on.planning.unknown.contains_key(&Knob::SeqLength), "{bad}");
    }
    let base = &training.config;
    assert_eq!(
        knob_value(Knob::GradCheckpointing, 1.0, base).as_deref(),
        Some("true")
    );
    assert_eq!(
        knob_value(Knob::GradCheckpointing, 0.0, base).as_deref(),
        Some("false")
    );
    assert_eq!(knob_value(Knob::GradCheckpointing, 0.5, base), None);
    assert_eq!(knob_value(Knob::GradSync, 1.0, base), None);
}

#[test]
fn a_batch_filled_from_the_report_is_never_rewritten_and_keeps_the_launchs_product() {
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "sft", "namespace": "ml", "labels": {"memguard.io/enabled": "true"}},
        "spec": {"containers": [{
            "name": "t", "image": "x",
            "resources": {"limits": {"nvidia.com/gpu": "1"}},
            "command": ["python", "train.py"],
            "args": ["--model_name_or_path", "meta-llama/Llama-3.1-8B",
                     "--gradient_accumulation_steps", "4", "--max_length", "2048",
                     "--output_dir", "/out"]
        }]}
    }))
    .expect("a pod");
    let training = resolve(&pod);
    assert!(training.unknown.contains_key(&Knob::BatchSize));
    let on = on_report(&training, &report(&[("batch-size", 8.0)], &[]));
    assert_eq!(on.planning.config.batch_size, 8);
    // A plan that halves the batch and doubles the accumulation: the launch says neither the
    // batch nor a way to keep the product, so neither is written.
    let mut planned = on.planning.config.clone();
    planned.batch_size = 4;
    planned.grad_accumulation = 8;
    planned.grad_checkpointing = true;
    let target = on.rewrite_target(&planned);
    assert_eq!((target.batch_size, target.grad_accumulation), (8, 4));
    assert!(
        target.grad_checkpointing,
        "what the launch can take is still written"
    );
}
