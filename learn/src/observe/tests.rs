use super::*;
use memguard_api::env;
use memguard_decide::testutil::{PodBuilder, summary};

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

fn gpu_pod() -> PodBuilder {
    PodBuilder::trainer()
        .annotate("model", "llama-3-8b")
        .annotate("method", "lora")
        .gpus(1)
        .env(env::BATCH_SIZE, "16")
        .env(env::GRAD_ACCUMULATION, "1")
        .env(env::GRAD_CHECKPOINTING, "true")
        .env(env::ESTIMATE_BYTES, "12000000000")
        .estimated(12_000_000_000, None)
}

#[test]
fn waits_for_the_trainer_and_for_the_sidecars_summary() {
    let done = summary(None, Some(15 * GIB), Some(16 * GIB));
    // (name, pod, expected)
    let table: Vec<(&str, Pod, Result<(), NotObserved>)> = vec![
        (
            "not opted in",
            {
                let mut p = gpu_pod().trainer_terminated("Completed", 0, 100).build();
                p.metadata.labels = None;
                p
            },
            Err(NotObserved::NotOptedIn),
        ),
        (
            "trainer running",
            gpu_pod().trainer_running().native_sidecar_running().build(),
            Err(NotObserved::Running),
        ),
        (
            "no status at all",
            gpu_pod().build(),
            Err(NotObserved::Running),
        ),
        (
            "trainer done, sidecar still summarizing",
            gpu_pod()
                .trainer_terminated("Completed", 0, 100)
                .native_sidecar_running()
                .build(),
            Err(NotObserved::AwaitingSummary),
        ),
        (
            "trainer done, sidecar running, but the pod failed: take it without a summary",
            gpu_pod()
                .trainer_terminated("Error", 1, 100)
                .native_sidecar_running()
                .phase("Failed")
                .build(),
            Ok(()),
        ),
        (
            "trainer and native sidecar done",
            gpu_pod()
                .trainer_terminated("Completed", 0, 100)
                .native_sidecar_done(&done)
                .build(),
            Ok(()),
        ),
        (
            "trainer restarted in place after an OOM kill: observe the last state now",
            gpu_pod()
                .trainer_restarted("OOMKilled", 137, 100)
                .native_sidecar_running()
                .build(),
            Ok(()),
        ),
        (
            "no key: bad annotations",
            PodBuilder::trainer()
                .annotate("model", "nope")
                .trainer_terminated("Completed", 0, 100)
                .build(),
            Err(NotObserved::NoKey(String::new())),
        ),
    ];
    for (name, pod, want) in table {
        let got = try_observe(&pod).map(|_| ());
        match (&got, &want) {
            (Err(NotObserved::NoKey(_)), Err(NotObserved::NoKey(_))) => {}
            _ => assert_eq!(got, want, "{name}"),
        }
    }
}

#[test]
fn reads_the_summary_from_native_or_classic_sidecars() {
    let s = summary(Some(3 * GIB), Some(15 * GIB), Some(16 * GIB));
    let native = gpu_pod()
        .trainer_terminated("Completed", 0, 100)
        .native_sidecar_done(&s)
        .build();
    let message = serde_json::to_string(&s).expect("serializes");
    let classic = gpu_pod()
        .trainer_terminated("Completed", 0, 100)
        .classic_sidecar_done(&message)
        .build();
    for pod in [native, classic] {
        let obs = try_observe(&pod).expect("observed");
        assert_eq!(obs.summary.as_ref(), Some(&s));
        // A GPU profile learns from the GPU peak, not the host's.
        assert_eq!(obs.measured_peak, Some(Bytes(15 * GIB)));
        assert_eq!(obs.limit, Some(Bytes(16 * GIB)));
        assert_eq!(obs.oom, None);
        assert_eq!(obs.finished_at, memguard_decide::testutil::at(100));
        assert_eq!(obs.pod, "trainer-0");
        assert_eq!(obs.uid, "uid-0");
    }
    let garbled = gpu_pod()
        .trainer_terminated("Completed", 0, 100)
        .classic_sidecar_done("panicked at …")
        .build();
    let obs = try_observe(&garbled).expect("observed without a summary");
    assert_eq!((obs.summary, obs.measured_peak), (None, None));
}

#[test]
fn a_cpu_profile_learns_from_host_memory_and_the_memory_limit() {
    let pod = PodBuilder::trainer()
        .annotate("model", "llama-3-8b")
        .memory_limit("32Gi")
        .trainer_terminated("Completed", 0, 100)
        .classic_sidecar_done(
            &serde_json::to_string(&summary(Some(20 * GIB), None, None)).expect("json"),
        )
        .build();
    let obs = try_observe(&pod).expect("observed");
    assert_eq!(obs.key.spec.device_class, DeviceClass::Cpu);
    assert_eq!(obs.measured_peak, Some(Bytes(20 * GIB)));
    assert_eq!(obs.limit, Some(Bytes(32 * GIB)));
}

/// The memory limit is a Kubernetes quantity, read as admission reads it: `m` is milli (a
/// quantity the API server normalized), not mega.
#[test]
fn the_memory_limit_is_read_as_a_kubernetes_quantity() {
    for (quantity, bytes) in [
        ("32Gi", 32 * GIB),
        ("34359738368000m", 32 * GIB),
        ("32G", 32_000_000_000),
    ] {
        let pod = PodBuilder::trainer()
            .annotate("model", "llama-3-8b")
            .memory_limit(quantity)
            .trainer_terminated("Completed", 0, 100)
            .build();
        let obs = try_observe(&pod).expect("observed");
        assert_eq!(obs.limit, Some(Bytes(bytes)), "{quantity}");
    }
}

/// (name, estimate annotation, expected raw estimate, expected start of the problem)
type EstimateCase<'a> = (&'a str, Option<&'a str>, Option<u64>, Option<&'a str>);

/// The estimate is the annotation's `uncalibrated`, and nothing else: the env and the sidecar's
/// summary carry the calibrated total, which measured against itself would pull every factor
/// back to 1. An annotation missing or unreadable says so, and the run does not calibrate.
#[test]
fn the_estimate_is_the_annotations_uncalibrated_or_none_with_the_reason() {
    // (name, estimate annotation, expected raw estimate, expected problem)
    let v1 = PodBuilder::trainer()
        .estimated(1000, None)
        .build()
        .metadata
        .annotations
        .expect("annotated")[keys::ESTIMATE]
        .clone();
    let calibrated = v1.replace(r#""total":1000"#, r#""total":1200"#).replace(
        r#""uncalibrated":1000"#,
        r#""uncalibrated":1000,"calibration":{"factor":1.2,"runs":3}"#,
    );
    let table: [EstimateCase; 6] = [
        ("version 1", Some(&v1), Some(1000), None),
        (
            "calibrated: uncalibrated",
            Some(&calibrated),
            Some(1000),
            None,
        ),
        (
            "an older shape: no guess from total / factor",
            Some(r#"{"total":1200,"calibration":{"factor":1.2,"runs":3}}"#),
            None,
            Some("memguard.io/estimate is not a versioned estimate"),
        ),
        (
            "another version",
            Some(r#"{"v":2,"uncalibrated":1000}"#),
            None,
            Some("memguard.io/estimate has version 2"),
        ),
        (
            "garbled: not the env",
            Some("{not json"),
            None,
            Some("memguard.io/estimate is not a versioned estimate"),
        ),
        (
            "no annotation: not the env",
            None,
            None,
            Some("no memguard.io/estimate annotation"),
        ),
    ];
    for (name, annotation, want, problem) in table {
        let pod = match annotation {
            Some(a) => gpu_pod().annotate(keys::ESTIMATE, a),
            None => gpu_pod().without_annotation(keys::ESTIMATE),
        };
        let obs = try_observe(&pod.trainer_terminated("Completed", 0, 1).build()).expect(name);
        assert_eq!(obs.estimate, want.map(Bytes), "{name}");
        match problem {
            None => assert_eq!(obs.estimate_problem, None, "{name}"),
            Some(p) => assert!(
                obs.estimate_problem
                    .as_deref()
                    .is_some_and(|e| e.starts_with(p)),
                "{name}: {:?}",
                obs.estimate_problem
            ),
        }
    }
}

/// (name, reason, exit code, termination message, summary, disrupted, expected)
type OomCase<'a> = (
    &'a str,
    &'a str,
    i32,
    &'a str,
    Option<&'a Summary>,
    bool,
    Option<&'a str>,
);

#[test]
fn knows_an_oom_from_other_deaths() {
    let oom_summary = Summary {
        oom_events: 1,
        max_level: Level::Critical,
        ..summary(None, None, None)
    };
    let quiet = summary(None, None, None);
    let fixture = include_str!("../../../api/fixtures/oom-record-v1.json");
    let record: OomRecord = serde_json::from_str(fixture).expect("fixture");
    let cuda_line = serde_json::to_string(&record).expect("line");
    let cpu_line = serde_json::to_string(&OomRecord {
        kind: OomKind::CpuOom,
        ..record.clone()
    })
    .expect("line");
    let fatal_in_summary = Summary {
        last_oom: Some(record.clone()),
        oom_reports: 1,
        ..summary(None, None, None)
    };
    let recovered_in_summary = Summary {
        last_oom: Some(OomRecord {
            outcome: OomOutcome::Recovered,
            ..record.clone()
        }),
        oom_reports: 1,
        ..summary(None, None, None)
    };
    let cuda_traceback = "  File \"train.py\", line 40, in <module>\n    loss.backward()\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.25 GiB";
    let memory_error =
        "Traceback (most recent call last):\n  File \"prep.py\", line 3\nMemoryError\n";
    let table: [OomCase; 14] = [
        (
            "kernel OOM kill",
            "OOMKilled",
            137,
            "",
            None,
            false,
            Some(OOM_KILLED),
        ),
        ("success", "Completed", 0, "", Some(&quiet), false, None),
        (
            "success after a recovered OOM",
            "Completed",
            0,
            &cuda_line,
            Some(&fatal_in_summary),
            false,
            None,
        ),
        (
            "CUDA OOM record",
            "Error",
            86,
            &cuda_line,
            None,
            false,
            Some(CUDA_OOM),
        ),
        (
            "host OOM record",
            "Error",
            86,
            &cpu_line,
            Some(&quiet),
            false,
            Some(CPU_OOM),
        ),
        (
            "CUDA out of memory in the log tail",
            "Error",
            1,
            cuda_traceback,
            None,
            false,
            Some(CUDA_OOM),
        ),
        (
            "MemoryError in the log tail",
            "Error",
            1,
            memory_error,
            None,
            false,
            Some(CPU_OOM),
        ),
        (
            "fatal record only in the sidecar summary",
            "Error",
            86,
            "",
            Some(&fatal_in_summary),
            false,
            Some(CUDA_OOM),
        ),
        (
            "crash after a recovered OOM",
            "Error",
            1,
            "",
            Some(&recovered_in_summary),
            false,
            None,
        ),
        (
            "SIGKILL and the sidecar counted an OOM",
            "Error",
            137,
            "",
            Some(&oom_summary),
            false,
            Some(OOM_KILLED),
        ),
        (
            "SIGKILL of an evicted pod",
            "Error",
            137,
            "",
            Some(&quiet),
            true,
            None,
        ),
        (
            "SIGKILL, no other explanation",
            "Error",
            137,
            "",
            None,
            false,
            Some(KILLED_EXIT_137),
        ),
        (
            "crash after a critical level and an OOM event",
            "Error",
            1,
            "",
            Some(&oom_summary),
            false,
            Some(OOM_KILLED),
        ),
        (
            "ordinary crash",
            "Error",
            1,
            "ValueError: bad config",
            Some(&quiet),
            false,
            None,
        ),
    ];
    for (name, reason, code, message, summary, disrupted, want) in table {
        let mut pod = gpu_pod().build();
        if disrupted {
            pod.metadata.deletion_timestamp = Some(memguard_decide::testutil::at(5));
        }
        let terminated = ContainerStateTerminated {
            reason: Some(reason.into()),
            exit_code: code,
            message: (!message.is_empty()).then(|| message.to_string()),
            ..ContainerStateTerminated::default()
        };
        assert_eq!(
            oom_reason(&pod, &terminated, summary).as_deref(),
            want,
            "{name}"
        );
    }
    let crash = ContainerStateTerminated {
        exit_code: 1,
        ..ContainerStateTerminated::default()
    };
    assert_eq!(
        oom_reason(&gpu_pod().build(), &crash, None),
        None,
        "crash without summary"
    );
}

#[test]
fn a_cuda_oom_record_recovers_exactly_as_an_oom_kill() {
    // The fixture's record, at the config the env says (batch 16 × 1, checkpointing).
    let record = include_str!("../../../api/fixtures/oom-record-v1.json")
        .replace('\n', "")
        .replace(r#""batch_size": 8"#, r#""batch_size": 16"#)
        .replace(r#""grad_accumulation": 4"#, r#""grad_accumulation": 1"#);
    let with = |pod: PodBuilder| {
        let obs = try_observe(&pod.phase("Failed").build()).expect("observed");
        let status = crate::update::apply(&Default::default(), &obs);
        (obs.oom, status.recovery.expect("a recovery"))
    };
    let (reason, cuda) = with(gpu_pod().trainer_failed_with(86, &record, 7));
    assert_eq!(reason.as_deref(), Some(CUDA_OOM));
    let (_, traceback) = with(gpu_pod().trainer_failed_with(
        1,
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
        7,
    ));
    let (reason, killed) = with(gpu_pod().trainer_terminated("OOMKilled", 137, 7));
    assert_eq!(reason.as_deref(), Some(OOM_KILLED));
    for recovery in [&cuda, &traceback] {
        assert_eq!(recovery.rungs, 1);
        assert_eq!(recovery.config, killed.config, "the same step down");
        assert_eq!(recovery.factor, killed.factor);
    }
    assert!(
        cuda.reason.contains("CudaOOM at batch 16"),
        "{}",
        cuda.reason
    );
}

#[test]
fn the_config_that_ran_is_the_annotations_with_the_trainers_env() {
    let obs = try_observe(
        &gpu_pod()
            .annotate("batch-size", "32")
            .env(env::SEQ_LENGTH, "garbage")
            .trainer_terminated("OOMKilled", 137, 7)
            .build(),
    )
    .expect("observed");
    assert_eq!(obs.knobs.batch_size, Some(16));
    assert_eq!(obs.knobs.seq_length, None, "garbled values are ignored");
    assert_eq!(obs.ran.batch_size, 16);
    assert!(obs.ran.grad_checkpointing);
    assert_eq!(obs.ran.seq_length, obs.key.config.seq_length);
    assert_eq!(obs.oom.as_deref(), Some(OOM_KILLED));
}

/// Admitted at 2 × 8, grown back to 16 × 1 at run time: the peak was measured at 16, so that
/// is the config that ran. With a downgrade as well, the env stays (which rung peaked is not
/// known from the summary).
#[test]
fn a_run_grown_back_ran_the_summarys_final_config() {
    let admitted = || {
        gpu_pod()
            .env(env::BATCH_SIZE, "2")
            .env(env::GRAD_ACCUMULATION, "8")
            .trainer_terminated("Completed", 0, 7)
    };
    let grown = Summary {
        growths: 3,
        batch_size: 16,
        grad_accumulation: 1,
        ..summary(None, Some(9 * GIB), Some(16 * GIB))
    };
    let obs = try_observe(&admitted().native_sidecar_done(&grown).build()).expect("observed");
    assert_eq!(
        (obs.knobs.batch_size, obs.knobs.grad_accumulation),
        (Some(16), Some(1))
    );
    let shrunk_too = Summary {
        downgrades: 1,
        ..grown.clone()
    };
    let obs = try_observe(&admitted().native_sidecar_done(&shrunk_too).build()).expect("observed");
    assert_eq!(
        (obs.knobs.batch_size, obs.knobs.grad_accumulation),
        (Some(2), Some(8))
    );
}

#[test]
fn the_next_step_down_starts_from_the_config_the_oom_record_says_was_in_force() {
    // The env says batch 16 × 1; the sidecar had taken the trainer down to 4 × 4 at run time
    // when it died: the recovery steps down from 4, not from 16.
    let record = include_str!("../../../api/fixtures/oom-record-v1.json")
        .replace('\n', "")
        .replace(r#""batch_size": 8"#, r#""batch_size": 4"#);
    let recovery_of = |pod: PodBuilder| {
        let obs = try_observe(&pod.phase("Failed").build()).expect("observed");
        let status = crate::update::apply(&Default::default(), &obs);
        (obs, status.recovery.expect("a recovery"))
    };
    // (name, pod)
    let table = [
        (
            "record as the termination message",
            gpu_pod().trainer_failed_with(86, &record, 7),
        ),
        (
            "traceback as the message, fatal record in the sidecar's summary",
            gpu_pod()
                .trainer_failed_with(1, "torch.OutOfMemoryError: CUDA out of memory.", 7)
                .native_sidecar_done(&Summary {
                    last_oom: Some(serde_json::from_str(&record).expect("record")),
                    oom_reports: 1,
                    ..summary(None, Some(15 * GIB), Some(16 * GIB))
                }),
        ),
    ];
    for (name, pod) in table {
        let (obs, recovery) = recovery_of(pod);
        assert_eq!(
            (
                obs.knobs.batch_size,
                obs.knobs.grad_accumulation,
                obs.knobs.grad_checkpointing
            ),
            (Some(4), Some(4), Some(true)),
            "{name}: the record's config"
        );
        assert_eq!(obs.ran.batch_size, 4, "{name}");
        assert_eq!(
            (
                recovery.config.batch_size,
                recovery.config.grad_accumulation
            ),
            (Some(2), Some(8)),
            "{name}: one rung below 4 × 4, effective batch kept: {}",
            recovery.reason
        );
        assert!(
            recovery.reason.contains("at batch 4"),
            "{name}: {}",
            recovery.reason
        );
    }
    // Without a record (a kernel OOM kill) the env is all there is.
    let (obs, recovery) = recovery_of(gpu_pod().trainer_terminated("OOMKilled", 137, 7));
    assert_eq!(obs.knobs.batch_size, Some(16));
    assert_eq!(recovery.config.batch_size, Some(8));
}

/// The trainer reported at train start a config other than the one admission estimated: the
/// run is learned as the config that ran (what an OOM recovery steps down from), and it does
/// not calibrate the estimate of another config (issue 37, item 4).
#[test]
fn what_the_trainer_reported_is_the_config_that_ran() {
    let mut s = summary(None, Some(15 * GIB), Some(16 * GIB));
    s.trainer_config = [
        ("seq-length".to_string(), 4096.0),
        ("grad-checkpointing".to_string(), 0.0),
        ("params".to_string(), 8.03e9),
        // Not a count: ignored, the env's value stays.
        ("batch-size".to_string(), 0.5),
    ]
    .into();
    s.config_mismatch = vec!["seq-length".into(), "grad-checkpointing".into()];
    let obs = try_observe(
        &gpu_pod()
            .trainer_terminated("Completed", 0, 100)
            .native_sidecar_done(&s)
            .build(),
    )
    .expect("observed");
    assert_eq!(obs.ran.seq_length, 4096);
    assert!(!obs.ran.grad_checkpointing);
    assert_eq!(obs.ran.batch_size, 16);
    assert_eq!(obs.knobs.seq_length, Some(4096));
    assert_eq!(obs.estimate, None, "an estimate of another config");
    let why = obs.estimate_problem.unwrap_or_default();
    assert!(
        why.contains("seq-length, grad-checkpointing differed"),
        "{why}"
    );

    // Reported as admission believed: the run calibrates.
    s.config_mismatch.clear();
    let obs = try_observe(
        &gpu_pod()
            .trainer_terminated("Completed", 0, 100)
            .native_sidecar_done(&s)
            .build(),
    )
    .expect("observed");
    assert_eq!(obs.estimate.map(|b| b.0), Some(12_000_000_000));
}

/// A pod admission could not read (Guarded: a script whose only argument is a JSON file): its
/// trainer's report at train start is the config that ran, learnt under its launch key; a
/// report that lacks a value the estimate needs is not a run to learn, and says which.
#[test]
fn a_guarded_pods_report_is_learnt_under_its_launch_key() {
    let guarded = |s: &memguard_api::Summary| {
        let mut pod = PodBuilder::trainer()
            .memory_limit("4Gi")
            .trainer_terminated("Completed", 0, 100)
            .native_sidecar_done(s)
            .build();
        let trainer = &mut pod.spec.as_mut().expect("spec").containers[0];
        trainer.image = Some("trainer:1".into());
        trainer.command = Some(vec![
            "python".into(),
            "train.py".into(),
            "/config/train.json".into(),
        ]);
        pod
    };
    let mut s = summary(Some(2 * GIB), None, Some(4 * GIB));
    s.trainer_config = memguard_decide::testutil::tiny_llama_report();
    let pod = guarded(&s);
    let launch = memguard_decide::key::launch_key(&pod, &memguard_api::Policy::default())
        .expect("a launch key");
    let obs = try_observe(&pod).expect("observed");
    assert_eq!((&obs.key.name, &obs.key.spec), (&launch.name, &launch.spec));
    assert!(obs.key.spec.model.starts_with("launch-"));
    assert_eq!(
        obs.ran,
        memguard_decide::trainer_config::training_config(&s.trainer_config).expect("a config")
    );
    assert_eq!(obs.measured_peak.map(|b| b.0), Some(2 * GIB));
    // Planned at train start: the client ran the reported 16 × 1 as 4 × 4 from step 1.
    let mut planned = s.clone();
    planned.train_start = Some(memguard_api::train_start::TrainStartPlan {
        planned: true,
        batch_size: Some(4),
        grad_accumulation: Some(4),
        grad_checkpointing: Some(false),
        ..Default::default()
    });
    let ran = try_observe(&guarded(&planned)).expect("observed").ran;
    assert_eq!((ran.batch_size, ran.grad_accumulation), (4, 4));
    let status = crate::update::apply(&Default::default(), &obs);
    let report = status.trainer_report.expect("the report kept");
    assert_eq!(report.config, s.trainer_config);
    assert_eq!(status.runs.len(), 1);

    s.trainer_config.remove("head-dim");
    let Err(NotObserved::NoKey(why)) = try_observe(&guarded(&s)) else {
        panic!("observed without its head-dim")
    };
    assert!(why.contains("not reported: head-dim"), "{why}");
}
