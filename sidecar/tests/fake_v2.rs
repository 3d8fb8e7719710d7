//! The real binary on a faithful cgroup v2 tree written by the test, with HTTP over loopback.

mod common;

use common::{Sidecar, eventually, http, promtool_check, put, read_signal};
use memguard_api::{Level, Signal, Summary};
use std::path::Path;
use std::time::Duration;

const MIB: u64 = 1 << 20;
const WAIT: Duration = Duration::from_secs(20);

/// A v2 container cgroup as the kernel shows it (kernel ≥ 5.19: memory.peak present).
fn v2_tree(dir: &Path, current: u64) {
    put(dir, "memory.current", &format!("{current}\n"));
    put(dir, "memory.max", &format!("{}\n", 1024 * MIB));
    put(dir, "memory.high", "max\n");
    put(dir, "memory.peak", &format!("{current}\n"));
    put(
        dir,
        "memory.stat",
        &include_str!("../fixtures/v2/memory.stat")
            .replace("inactive_file 150994944", "inactive_file 0"),
    );
    put(
        dir,
        "memory.events",
        "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
    );
    put(dir, "cgroup.events", "populated 1\nfrozen 0\n");
    put(
        dir,
        "memory.pressure",
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    );
}

/// A procfs stand-in holding only a quiet `pressure/memory`, so host load cannot move the test.
fn quiet_proc(dir: &Path) {
    std::fs::create_dir_all(dir.join("pressure")).expect("mkdir");
    put(
        &dir.join("pressure"),
        "memory",
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    );
}

struct Setup {
    _tmp: tempfile::TempDir,
    cg: std::path::PathBuf,
    signal: std::path::PathBuf,
    term: std::path::PathBuf,
    sidecar: Sidecar,
}

fn start(extra: &[&str]) -> Setup {
    start_with(extra, true)
}

fn start_with(extra: &[&str], create: bool) -> Setup {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cg = tmp.path().join("cgroup");
    let proc_root = tmp.path().join("proc");
    if create {
        std::fs::create_dir_all(&cg).expect("mkdir");
        v2_tree(&cg, 100 * MIB);
    }
    quiet_proc(&proc_root);
    let signal = extra
        .iter()
        .position(|a| *a == "--signal-file")
        .and_then(|i| extra.get(i + 1))
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| tmp.path().join("run/signal.json"));
    let extra: Vec<&str> = match extra.iter().position(|a| *a == "--signal-file") {
        Some(i) => [&extra[..i], &extra[i + 2..]].concat(),
        None => extra.to_vec(),
    };
    let term = tmp.path().join("termination-log");
    let mut args = vec![
        "--cgroup".to_string(),
        cg.display().to_string(),
        "--proc-root".into(),
        proc_root.display().to_string(),
        "--signal-file".into(),
        signal.display().to_string(),
        "--termination-log".into(),
        term.display().to_string(),
        "--interval".into(),
        "50ms".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let sidecar = Sidecar::spawn(&refs);
    Setup {
        _tmp: tmp,
        cg,
        signal,
        term,
        sidecar,
    }
}

#[test]
fn downgrades_over_http_and_file_then_summarizes_when_the_trainer_exits() {
    let mut s = start(&["--batch-size", "8", "--grad-accumulation", "4"]);

    // The initial signal, on disk and over HTTP.
    let first = eventually(WAIT, "initial signal file", || read_signal(&s.signal));
    assert_eq!(
        (first.seq, first.level, first.batch_size),
        (0, Level::Ok, 8)
    );
    let (code, body) = http(s.sidecar.api, "GET", "/v1/signal", None);
    assert_eq!(code, 200);
    let over_http: Signal = serde_json::from_str(&body).expect("signal json");
    assert_eq!(over_http.seq, 0);

    // A long-poll waits for the next signal; the working set jumps to 0.88 of memory.max.
    let api = s.sidecar.api;
    let poll = std::thread::spawn(move || http(api, "GET", "/v1/signal?after=0&wait=30s", None));
    std::thread::sleep(Duration::from_millis(200));
    put(&s.cg, "memory.current", &format!("{}\n", 900 * MIB));
    let (code, body) = poll.join().expect("long-poll thread");
    assert_eq!(code, 200);
    let next: Signal = serde_json::from_str(&body).expect("json");
    assert_eq!(next.level, Level::Downgrade, "{body}");
    assert_eq!((next.batch_size, next.grad_accumulation), (4, 8));
    assert_eq!(next.effective_batch(), 32);
    assert!(next.seq >= 1);
    let on_disk = eventually(WAIT, "downgrade on disk", || {
        read_signal(&s.signal).filter(|x| x.seq == next.seq)
    });
    assert_eq!(on_disk, next);

    // A report from the trainer shows in the metrics listener; names pass promtool.
    let report = r#"{"framework":"torch","allocated_bytes":1000,"reserved_bytes":2000,"peak_bytes":1500,"step":12,"batch_size":4}"#;
    let (code, _) = http(s.sidecar.api, "POST", "/v1/report", Some(report));
    assert_eq!(code, 204);
    let (code, metrics) = http(s.sidecar.metrics, "GET", "/metrics", None);
    assert_eq!(code, 200);
    assert!(
        metrics.contains("memguard_sidecar_trainer_allocated_bytes 1000"),
        "{metrics}"
    );
    assert!(metrics.contains("memguard_sidecar_level 2"), "{metrics}");
    assert!(
        metrics.contains("memguard_sidecar_downgrades_total 1"),
        "{metrics}"
    );
    promtool_check(&metrics);
    let (code, api_metrics) = http(s.sidecar.api, "GET", "/metrics", None);
    assert_eq!(code, 200);
    promtool_check(&api_metrics);

    // The metrics listener refuses the trainer API; the trace opens as Chrome trace JSON.
    assert_eq!(http(s.sidecar.metrics, "GET", "/v1/signal", None).0, 404);
    assert_eq!(
        http(s.sidecar.metrics, "POST", "/v1/report", Some(report)).0,
        404
    );
    assert_eq!(http(s.sidecar.metrics, "GET", "/healthz", None).0, 200);
    let (code, trace) = http(s.sidecar.api, "GET", "/v1/trace", None);
    assert_eq!(code, 200);
    let doc: serde_json::Value = serde_json::from_str(&trace).expect("trace json");
    let events = doc["traceEvents"].as_array().expect("events");
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "C" && e["name"] == "memory")
    );
    assert!(
        events
            .iter()
            .any(|e| e["ph"] == "i" && e["name"] == "level downgrade")
    );

    // A body over 16 KiB is refused.
    let big = format!(r#"{{"framework":"{}"}}"#, "x".repeat(20_000));
    assert_eq!(http(s.sidecar.api, "POST", "/v1/report", Some(&big)).0, 413);

    // The trainer exits: the cgroup empties; the sidecar writes its summary and stops.
    put(&s.cg, "cgroup.events", "populated 0\nfrozen 0\n");
    assert!(s.sidecar.wait_exit(WAIT), "clean exit");
    let line = std::fs::read_to_string(&s.term).expect("termination log");
    assert!(line.len() <= memguard_api::summary::MAX_SUMMARY_BYTES);
    let summary: Summary = serde_json::from_str(line.trim()).expect("summary json");
    assert_eq!(summary.exit_reason, "trainer-exited");
    assert_eq!(summary.downgrades, 1);
    assert_eq!(summary.limit_bytes, Some(1024 * MIB));
    assert_eq!(summary.batch_size, 4);
    assert!(summary.peak_bytes >= Some(900 * MIB));
}

#[test]
fn sigterm_writes_the_summary_and_a_bad_signal_dir_leaves_http_working() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let blocker = tmp.path().join("not-a-dir");
    std::fs::write(&blocker, "x").expect("w");
    let bad = blocker.join("signal.json");
    let bad = bad.display().to_string();
    let mut s = start(&["--signal-file", &bad, "--batch-size", "3"]);
    let (code, body) = http(s.sidecar.api, "GET", "/v1/signal", None);
    assert_eq!(code, 200);
    let sig: Signal = serde_json::from_str(&body).expect("json");
    assert_eq!(sig.batch_size, 3);
    eventually(WAIT, "a clear log line", || {
        s.sidecar
            .log_text()
            .contains("signal directory")
            .then_some(())
    });
    // Odd batch: the downgrade keeps the effective batch exactly (3 -> 1 x 3).
    put(&s.cg, "memory.current", &format!("{}\n", 900 * MIB));
    let after = eventually(WAIT, "downgrade over HTTP", || {
        let (_, body) = http(s.sidecar.api, "GET", "/v1/signal?after=0&wait=5s", None);
        serde_json::from_str::<Signal>(&body)
            .ok()
            .filter(|x| x.seq > 0)
    });
    assert_eq!((after.batch_size, after.grad_accumulation), (1, 3));
    let (_, metrics) = http(s.sidecar.api, "GET", "/metrics", None);
    assert!(
        !metrics.contains("memguard_sidecar_signal_write_errors_total 0\n"),
        "{metrics}"
    );
    s.sidecar.terminate();
    assert!(s.sidecar.wait_exit(WAIT));
    let summary: Summary =
        serde_json::from_str(std::fs::read_to_string(&s.term).expect("log").trim()).expect("json");
    assert_eq!(summary.exit_reason, "sigterm");
    assert_eq!(summary.max_level, Level::Downgrade);
}

#[test]
fn a_cgroup_that_is_not_there_yet_is_not_fatal() {
    let mut s = start_with(&[], false);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        s.sidecar.child.try_wait().expect("status").is_none(),
        "still running"
    );
    assert_eq!(http(s.sidecar.api, "GET", "/healthz", None).0, 200);
    let (_, metrics) = http(s.sidecar.metrics, "GET", "/metrics", None);
    assert!(
        !metrics.contains("working_set_bytes"),
        "unknown, not 0: {metrics}"
    );
    std::fs::create_dir_all(&s.cg).expect("mkdir");
    v2_tree(&s.cg, 100 * MIB);
    eventually(WAIT, "the late cgroup sampled", || {
        let (_, m) = http(s.sidecar.metrics, "GET", "/metrics", None);
        m.contains(&format!("memguard_sidecar_working_set_bytes {}", 100 * MIB))
            .then_some(())
    });
    s.sidecar.terminate();
    assert!(s.sidecar.wait_exit(WAIT));
}
