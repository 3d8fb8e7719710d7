use super::*;
use memguard_api::crd::{MAX_RUNS, TrainingKnobs};
use memguard_api::env;
use memguard_api::policy::DEFAULT_MAX_OOM_RECOVERIES as MAX_OOM_RECOVERIES;
use memguard_decide::testutil::{PodBuilder, at, summary};

/// Observes under the default policy (the built-in catalog only), without DRA objects.
fn try_observe(
    pod: &k8s_openapi::api::core::v1::Pod,
) -> Result<crate::observe::Observation, crate::observe::NotObserved> {
    crate::observe::try_observe(
        pod,
        &memguard_api::Policy::default(),
        memguard_api::Cluster::default(),
    )
}

const GIB: u64 = 1 << 30;

/// A LoRA pod on one GPU that ran at batch 16 with checkpointing, estimated at 12 GiB.
fn pod(name: &str, finished: i64) -> PodBuilder {
    running_pod(name).trainer_terminated("Completed", 0, finished)
}

/// [`pod`] before its trainer terminated.
fn running_pod(name: &str) -> PodBuilder {
    PodBuilder::trainer()
        .named(name, &format!("uid-{name}"))
        .annotate("model", "llama-3-8b")
        .annotate("method", "lora")
        .annotate("gpu-memory", "16Gi")
        .estimated(12 * GIB, Some(16 * GIB))
        .gpus(1)
        .env(env::BATCH_SIZE, "16")
        .env(env::GRAD_ACCUMULATION, "1")
        .env(env::GRAD_CHECKPOINTING, "true")
}

fn ok_run(name: &str, finished: i64, peak: u64) -> Observation {
    try_observe(
        &pod(name, finished)
            .native_sidecar_done(&summary(None, Some(peak), Some(16 * GIB)))
            .build(),
    )
    .expect("observed")
}

fn oom_run(name: &str, finished: i64) -> Observation {
    let mut p = pod(name, finished).build();
    let status = p
        .status
        .as_mut()
        .and_then(|s| s.container_statuses.as_mut())
        .and_then(|s| s.first_mut())
        .and_then(|s| s.state.as_mut())
        .and_then(|s| s.terminated.as_mut())
        .expect("terminated trainer");
    status.reason = Some("OOMKilled".into());
    status.exit_code = 137;
    p.status.as_mut().expect("status").phase = Some("Failed".into());
    try_observe(&p).expect("observed")
}

#[test]
fn a_successful_run_is_recorded_with_its_estimate_and_peak() {
    let status = apply(&MemoryProfileStatus::default(), &ok_run("a", 10, 13 * GIB));
    assert_eq!(status.run_count, 1);
    let run = &status.runs[0];
    assert_eq!(
        (
            run.pod.as_str(),
            run.uid.as_str(),
            run.estimate_bytes,
            run.measured_peak_bytes
        ),
        ("a", "uid-a", 12 * GIB, Some(13 * GIB))
    );
    assert_eq!(run.finished_at, at(10));
    assert!(!run.oom_killed);
    assert!(status.oom_events.is_empty() && status.recovery.is_none());
}

#[test]
fn the_factor_appears_after_three_runs() {
    let mut status = MemoryProfileStatus::default();
    for (i, name) in ["a", "b"].into_iter().enumerate() {
        status = apply(&status, &ok_run(name, i as i64, 12 * GIB * 6 / 5));
    }
    assert_eq!(status.median_correction_factor, None);
    status = apply(&status, &ok_run("c", 3, 12 * GIB * 6 / 5));
    let factor = status.median_correction_factor.expect("three runs");
    assert!((factor - 1.2).abs() < 1e-6, "{factor}");
}

#[test]
fn replaying_a_pod_changes_nothing_even_after_it_left_the_history() {
    let first = ok_run("first", 1, 13 * GIB);
    let mut status = apply(&MemoryProfileStatus::default(), &first);
    assert_eq!(
        apply(&status, &first),
        status,
        "replay while in the history"
    );
    for i in 0..MAX_RUNS {
        status = apply(&status, &ok_run(&format!("p{i}"), 10 + i as i64, 13 * GIB));
    }
    assert!(status.runs.iter().all(|r| r.pod != "first"));
    assert_eq!(
        apply(&status, &first),
        status,
        "replay after it was dropped"
    );
    let oom = oom_run("dead", 1000);
    let after = apply(&status, &oom);
    assert_eq!(apply(&after, &oom), after, "an OOM is recorded once");
    assert_eq!(after.oom_events.len(), 1);
}

#[test]
fn an_oom_kill_records_the_event_and_a_recovery_one_rung_down() {
    let status = apply(&MemoryProfileStatus::default(), &oom_run("trainer-0", 50));
    assert_eq!(status.oom_events.len(), 1);
    let event = &status.oom_events[0];
    assert_eq!(
        (event.pod.as_str(), event.reason.as_str()),
        ("trainer-0", "OOMKilled")
    );
    assert_eq!(event.config.batch_size, Some(16));
    assert_eq!(status.last_oom_at, Some(at(50)));
    assert!(status.runs[0].oom_killed);

    let recovery = status.recovery.expect("a recovery");
    // Checkpointing was already on: the next rung halves the batch, keeping the effective batch.
    assert_eq!(recovery.rungs, 1);
    assert_eq!(recovery.config.batch_size, Some(8));
    assert_eq!(recovery.config.grad_accumulation, Some(2));
    // Died with 16 GiB against an estimate of 12 GiB: plan with at least 16/12.
    let factor = recovery.factor.expect("limit and estimate known");
    assert!((factor - 16.0 / 12.0).abs() < 1e-9, "{factor}");
    assert!(
        recovery.reason.starts_with(
            "pod trainer-0 OOMKilled at batch 16, seq 2048, rank 16 (limit 16.00 GiB): start with batch 16 → 8"
        ),
        "{}",
        recovery.reason
    );
    assert!(
        recovery.reason.ends_with("plan with factor ≥ 1.33"),
        "{}",
        recovery.reason
    );
}

/// (rungs, batch, checkpointing, factor)
type Want = (u32, Option<u64>, Option<bool>, Option<f64>);

#[test]
fn recovery_decisions() {
    let base = oom_run("x", 1);
    let knobs = |b: u64, ckpt: bool| TrainingKnobs {
        batch_size: Some(b),
        grad_accumulation: Some(1),
        grad_checkpointing: Some(ckpt),
        ..TrainingKnobs::default()
    };
    let with = |f: &dyn Fn(&mut Observation)| {
        let mut o = base.clone();
        f(&mut o);
        o
    };
    // (name, observation, previous recovery factor, expected (rungs, batch, checkpointing, factor))
    let table: Vec<(&str, Observation, Option<f64>, Want)> = vec![
        (
            // The planner's next step: halving 16 long sequences saves more per unit of cost
            // than checkpointing.
            "checkpointing off, batch 16: the batch halves first",
            with(&|o| {
                o.ran.grad_checkpointing = false;
                o.ran.batch_size = 16;
                o.knobs = knobs(16, false);
            }),
            None,
            (1, Some(8), Some(false), Some(16.0 / 12.0)),
        ),
        (
            "checkpointing off at batch 1: switch it on",
            with(&|o| {
                o.ran.grad_checkpointing = false;
                o.ran.batch_size = 1;
                o.knobs = knobs(1, false);
            }),
            None,
            (1, Some(1), Some(true), Some(16.0 / 12.0)),
        ),
        (
            "peak above the limit: the peak sets the factor",
            with(&|o| o.measured_peak = Some(Bytes(18 * GIB))),
            None,
            (1, Some(8), Some(true), Some(18.0 / 12.0)),
        ),
        (
            "estimate already above the limit: factor at least 1",
            with(&|o| o.estimate = Some(Bytes(20 * GIB))),
            None,
            (1, Some(8), Some(true), Some(1.0)),
        ),
        (
            "no estimate: the rung alone",
            with(&|o| o.estimate = None),
            None,
            (1, Some(8), Some(true), None),
        ),
        (
            "a previous, larger factor is kept",
            base.clone(),
            Some(2.0),
            (1, Some(8), Some(true), Some(2.0)),
        ),
        (
            "everything at its floor: no rung, same config",
            with(&|o| {
                o.ran.batch_size = 1;
                o.ran.seq_length = 256;
                o.ran.lora_rank = 4;
                o.ran.lora_layers = Some(1);
            }),
            None,
            (0, Some(1), Some(true), Some(16.0 / 12.0)),
        ),
    ];
    for (name, obs, previous, want) in table {
        let prev = previous.map(|f| Recovery {
            factor: Some(f),
            ..Recovery::default()
        });
        let r = recovery(&obs, prev.as_ref(), &Floors::default());
        let got = (
            r.rungs,
            r.config.batch_size,
            r.config.grad_checkpointing,
            r.factor,
        );
        assert_eq!(got.0, want.0, "{name}: rungs");
        assert_eq!(got.1, want.1, "{name}: batch");
        assert_eq!(got.2, want.2, "{name}: checkpointing");
        match (got.3, want.3) {
            (Some(a), Some(b)) => assert!((a - b).abs() < 1e-9, "{name}: {a} vs {b}"),
            (a, b) => assert_eq!(a, b, "{name}: factor"),
        }
        assert!(
            r.reason.starts_with("pod x OOMKilled at batch "),
            "{name}: {}",
            r.reason
        );
    }
    assert!(
        recovery(
            &with(&|o| {
                o.ran.batch_size = 1;
                o.ran.seq_length = 256;
                o.ran.lora_rank = 4;
                o.ran.lora_layers = Some(1);
            }),
            None,
            &Floors::default(),
        )
        .reason
        .contains("every knob is at its floor")
    );
}

#[test]
fn a_successful_run_after_an_oom_keeps_the_recovery() {
    let after_oom = apply(&MemoryProfileStatus::default(), &oom_run("dead", 10));
    let after_success = apply(&after_oom, &ok_run("alive", 20, 11 * GIB));
    assert_eq!(after_success.recovery, after_oom.recovery);
    assert_eq!(after_success.run_count, 2);
    // A second kill steps further down from the config that died then.
    let again = apply(&after_success, &oom_run("dead-again", 30));
    assert_eq!(again.oom_events.len(), 2);
    assert_eq!(again.last_oom_at, Some(at(30)));
}

#[test]
fn oom_recoveries_stop_at_the_limit_with_a_verdict_and_a_success_clears_them() {
    let mut status = MemoryProfileStatus::default();
    for i in 0..MAX_OOM_RECOVERIES {
        status = apply(&status, &oom_run(&format!("p{i}"), 10 + i64::from(i)));
        assert_eq!(status.oom_recoveries, i + 1);
        assert_eq!(status.verdict, None, "still recovering");
    }
    let kept = status.recovery.clone().expect("a recovery");
    let past = apply(&status, &oom_run("p-last", 50));
    assert_eq!(past.oom_recoveries, MAX_OOM_RECOVERIES + 1);
    assert_eq!(
        past.recovery,
        Some(kept.clone()),
        "no further downgrade past the limit"
    );
    let verdict = past.verdict.clone().expect("verdict");
    assert!(
        verdict.starts_with("cannot fit: 4 OOMs in a row (limit 3); smallest config tried: batch"),
        "{verdict}"
    );
    let ok = apply(&past, &ok_run("fine", 60, 13 * GIB));
    assert_eq!((ok.oom_recoveries, ok.verdict), (0, None));
    assert_eq!(ok.recovery, Some(kept), "a success keeps the recovery");
}

#[test]
fn the_policy_limit_decides_when_recoveries_stop() {
    /// (limit, OOMs in a row, expected (recoveries made, verdict))
    type Row = (u32, u32, (u32, Option<&'static str>));
    let table: [Row; 5] = [
        (0, 1, (0, Some("cannot fit: 1 OOM in a row (limit 0)"))),
        (1, 1, (1, None)),
        (1, 2, (1, Some("cannot fit: 2 OOMs in a row (limit 1)"))),
        (5, 5, (5, None)),
        (5, 6, (5, Some("cannot fit: 6 OOMs in a row (limit 5)"))),
    ];
    for (limit, ooms, (made, verdict)) in table {
        let mut status = MemoryProfileStatus::default();
        let mut recoveries = Vec::new();
        for i in 0..ooms {
            status = apply_limited(
                &status,
                &oom_run(&format!("p{i}"), i64::from(i)),
                &limited(limit),
            );
            if recoveries.last() != status.recovery.as_ref() {
                recoveries.push(status.recovery.clone().expect("only ever set"));
            }
        }
        let made_now = u32::try_from(recoveries.len()).expect("small");
        assert_eq!(made_now, made, "limit {limit}, {ooms} OOMs: recoveries");
        match (verdict, &status.verdict) {
            (None, None) => {}
            (Some(want), Some(got)) => assert!(
                got.starts_with(want) && got.contains("smallest config tried: batch 16"),
                "limit {limit}, {ooms} OOMs: {got}"
            ),
            (want, got) => panic!("limit {limit}, {ooms} OOMs: {want:?} != {got:?}"),
        }
    }
}

#[test]
fn a_limit_raised_after_the_verdict_lets_the_next_oom_step_down_again() {
    let mut status = MemoryProfileStatus::default();
    for i in 0..2 {
        status = apply_limited(&status, &oom_run(&format!("p{i}"), i), &limited(1));
    }
    assert!(status.verdict.is_some(), "past the limit of 1");
    let kept = status.recovery.clone();
    let raised = apply_limited(&status, &oom_run("p2", 2), &limited(5));
    assert_eq!(raised.verdict, None, "recovering again: {raised:?}");
    assert_ne!(raised.recovery, kept, "a new step down");
    assert_eq!(raised.oom_recoveries, 3);
}

fn limited(max_recoveries: u32) -> OomRules {
    OomRules {
        max_recoveries,
        ..OomRules::default()
    }
}

/// A policy that raises the floors: the recovery never plans below them (the webhook would clamp
/// it back to the config that died), and once nothing is left above them the verdict says so.
#[test]
fn recoveries_stop_at_the_policys_floors_not_the_defaults() {
    let died = oom_run("p0", 0);
    let batch = died.ran.batch_size;
    assert!(
        batch > 1,
        "the fixture run must have room to shrink: {batch}"
    );
    let floors = Floors {
        batch_size: batch,
        ..Floors::default()
    };
    let strict = OomRules {
        floors,
        ..OomRules::default()
    };
    let by_default = apply_limited(&MemoryProfileStatus::default(), &died, &OomRules::default());
    let by_policy = apply_limited(&MemoryProfileStatus::default(), &died, &strict);
    let default_batch = by_default
        .recovery
        .as_ref()
        .and_then(|r| r.config.batch_size);
    let policy_batch = by_policy
        .recovery
        .as_ref()
        .and_then(|r| r.config.batch_size);
    assert!(
        policy_batch.is_none_or(|b| b >= batch),
        "below the policy's floor of {batch}: {by_policy:?}"
    );
    assert_ne!(
        default_batch, policy_batch,
        "the floors must matter here: {by_default:?}"
    );
}

#[test]
fn an_fsdp_oom_kill_recovers_by_syncing_each_batch_and_the_next_pod_starts_so() {
    // Full fine-tuning under FSDP on 8 ranks, checkpointing on, accumulating under no_sync.
    let mut p = pod("fsdp-0", 50)
        .annotate("method", "full")
        .annotate("parallelism", "fsdp")
        .annotate("world-size", "8")
        .env(env::BATCH_SIZE, "4")
        .env(env::GRAD_ACCUMULATION, "4")
        .env(env::GRAD_SYNC, "accumulate")
        .build();
    let terminated = p
        .status
        .as_mut()
        .and_then(|s| s.container_statuses.as_mut())
        .and_then(|s| s.first_mut())
        .and_then(|s| s.state.as_mut())
        .and_then(|s| s.terminated.as_mut())
        .expect("terminated trainer");
    terminated.reason = Some("OOMKilled".into());
    terminated.exit_code = 137;
    let obs = try_observe(&p).expect("observed");
    assert_eq!(obs.knobs.grad_sync.as_deref(), Some("accumulate"));

    let r = recovery(&obs, None, &Floors::default());
    assert_eq!(r.rungs, 1);
    assert_eq!(r.config.grad_sync.as_deref(), Some("each-batch"));
    assert_eq!(r.config.batch_size, Some(4), "the batch is not halved yet");
    assert!(r.reason.contains("every micro-batch"), "{}", r.reason);

    let start = memguard_decide::adjust::recovery_start(&obs.ran, &r, &Floors::default());
    assert_eq!(start.grad_sync, memguard_estimator::GradSync::EachBatch);
    assert!(r.config.describe().contains("gradients synced each batch"));

    // Without accumulation, syncing alone would change nothing: the batch is halved with it.
    let mut single = obs.clone();
    single.ran.batch_size = 8;
    single.ran.grad_accumulation = 1;
    let r = recovery(&single, None, &Floors::default());
    assert_eq!(r.rungs, 2);
    assert_eq!(r.config.grad_sync.as_deref(), Some("each-batch"));
    assert_eq!(
        (r.config.batch_size, r.config.grad_accumulation),
        (Some(4), Some(2))
    );
    assert!(r.reason.contains("then batch 8 → 4"), "{}", r.reason);
}

/// A pod whose sidecar's summary carries the trainer's report at train start, and, when
/// `killed_in` is set, an OOM kill in that phase.
fn reported_run(
    name: &str,
    finished: i64,
    config: &[(&str, f64)],
    mismatch: &[&str],
    killed_in: Option<memguard_api::phase::TrainerPhase>,
) -> Observation {
    let mut s = summary(None, Some(13 * GIB), Some(16 * GIB));
    s.trainer_config = config.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    s.config_mismatch = mismatch.iter().map(|k| k.to_string()).collect();
    s.oom_kill_phase = killed_in;
    let builder = if killed_in.is_some() {
        s.oom_events = 1;
        running_pod(name).trainer_terminated("Error", 137, finished)
    } else {
        pod(name, finished)
    };
    try_observe(&builder.native_sidecar_done(&s).build()).expect("observed")
}

#[test]
fn the_profile_keeps_the_latest_trainer_report_and_its_mismatches() {
    use memguard_api::phase::TrainerPhase;
    let first = reported_run(
        "a",
        10,
        &[
            ("batch-size", 16.0),
            ("seq-length", 1024.0),
            ("grad-checkpointing", 1.0),
            // A knob the sidecar's report may carry besides the first eight: kept too.
            ("hidden-size", 4096.0),
        ],
        &["seq-length"],
        None,
    );
    let status = apply(&MemoryProfileStatus::default(), &first);
    let report = status.trainer_report.as_ref().expect("report kept");
    assert_eq!((report.pod.as_str(), report.uid.as_str()), ("a", "uid-a"));
    assert_eq!(report.finished_at, at(10));
    assert_eq!(report.config["seq-length"], 1024.0);
    assert_eq!(report.config["hidden-size"], 4096.0);
    assert_eq!(report.mismatch, ["seq-length"]);

    // A newer run replaces it; an older one replayed later does not.
    let newer = reported_run("b", 20, &[("seq-length", 2048.0)], &[], None);
    let status = apply(&status, &newer);
    assert_eq!(status.trainer_report.as_ref().expect("kept").pod, "b");
    let older = reported_run("c", 5, &[("seq-length", 512.0)], &[], None);
    let status = apply(&status, &older);
    let report = status.trainer_report.as_ref().expect("kept");
    assert_eq!(report.pod, "b");
    assert!(report.mismatch.is_empty());
    assert_eq!(report.config["seq-length"], 2048.0);

    // A run that reported nothing leaves the report where it is.
    let status = apply(&status, &ok_run("d", 30, 13 * GIB));
    assert_eq!(status.trainer_report.as_ref().expect("kept").pod, "b");
    // Replays change nothing.
    assert_eq!(apply(&status, &newer), status);
    assert_eq!(status.last_kill_phase(), None::<TrainerPhase>);
}

#[test]
fn oom_kills_are_counted_by_the_phase_they_came_in() {
    use memguard_api::phase::TrainerPhase;
    let save = reported_run("a", 10, &[], &[], Some(TrainerPhase::Save));
    assert!(save.oom.is_some(), "an OOM kill: {:?}", save.oom);
    let status = apply(&MemoryProfileStatus::default(), &save);
    assert_eq!(status.oom_kill_phases.save, 1);
    assert_eq!(status.oom_events[0].phase, Some(TrainerPhase::Save));
    assert_eq!(status.last_kill_phase(), Some(TrainerPhase::Save));
    let status = apply(
        &status,
        &reported_run("b", 20, &[], &[], Some(TrainerPhase::Load)),
    );
    let status = apply(
        &status,
        &reported_run("c", 30, &[], &[], Some(TrainerPhase::Save)),
    );
    let p = status.oom_kill_phases;
    assert_eq!((p.load, p.step, p.save), (1, 0, 2));
    assert_eq!(status.last_kill_phase(), Some(TrainerPhase::Save));
    // An OOM kill with no phase recorded counts in no phase, and is the newest kill.
    let status = apply(&status, &oom_run("d", 40));
    assert_eq!(status.oom_kill_phases, p);
    assert_eq!(status.last_kill_phase(), None);
    // The status carries it through JSON, as the API stores it.
    let json = serde_json::to_value(&status).expect("json");
    assert_eq!(json["oomKillPhases"]["save"], 2);
    assert_eq!(json["oomEvents"][0]["phase"], "save");
}

#[test]
fn a_report_too_large_is_bounded() {
    use memguard_api::crd::{MAX_KNOB_NAME_LEN, MAX_REPORTED_KNOBS};
    let names: Vec<String> = (0..MAX_REPORTED_KNOBS + 10)
        .map(|i| format!("knob-{i:03}"))
        .collect();
    let long = "k".repeat(MAX_KNOB_NAME_LEN + 1);
    let mut config: Vec<(&str, f64)> = names.iter().map(|n| (n.as_str(), 1.0)).collect();
    config.push((&long, 1.0));
    let mismatch: Vec<&str> = names.iter().map(String::as_str).collect();
    let status = apply(
        &MemoryProfileStatus::default(),
        &reported_run("a", 10, &config, &mismatch, None),
    );
    let report = status.trainer_report.expect("kept");
    assert_eq!(report.config.len(), MAX_REPORTED_KNOBS);
    assert!(!report.config.contains_key(&long));
    assert_eq!(report.mismatch.len(), MAX_REPORTED_KNOBS);
}
