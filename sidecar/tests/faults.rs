//! Fault injection on the real binary: the trainer's cgroup vanishing, unreadable and garbage
//! cgroup files, a read-only or full signal directory (real tmpfs mounts: the tests run as root),
//! SIGKILL in the middle of signal writes, and nonsense or floods on `POST /v1/report`.
//!
//! The expectation is the same each time: no panic, no exit, the degraded state visible in the
//! metrics and the logs, and no data lost (the signal on disk is always a whole one, and the
//! latest one once the fault clears). See docs/reliability.md.

mod common;

use common::{Sidecar, eventually, http, put, read_signal};
use memguard_api::{Level, Signal};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const WAIT: Duration = Duration::from_secs(20);

/// A v2 container cgroup as the kernel shows it, `current` bytes of 1 GiB.
fn v2_tree(dir: &Path, current: u64) {
    std::fs::create_dir_all(dir).expect("mkdir");
    put(dir, "memory.current", &format!("{current}\n"));
    put(dir, "memory.max", &format!("{}\n", 1024 * MIB));
    put(dir, "memory.high", "max\n");
    put(dir, "memory.stat", "anon 0\nfile 0\ninactive_file 0\n");
    put(
        dir,
        "memory.events",
        "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n",
    );
    put(dir, "cgroup.events", "populated 1\nfrozen 0\n");
}

struct Setup {
    tmp: tempfile::TempDir,
    cg: PathBuf,
    sidecar: Sidecar,
}

/// The sidecar on a fake v2 cgroup (quiet host PSI), signal file at `signal` (default under the
/// temp dir), plus `extra` flags.
fn start(signal: Option<&Path>, extra: &[&str]) -> Setup {
    let tmp = tempfile::tempdir().expect("tempdir");
    let cg = tmp.path().join("cgroup");
    v2_tree(&cg, 100 * MIB);
    let proc_root = tmp.path().join("proc");
    std::fs::create_dir_all(proc_root.join("pressure")).expect("mkdir");
    put(
        &proc_root.join("pressure"),
        "memory",
        "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    );
    let signal = signal.map_or_else(|| tmp.path().join("run/signal.json"), Path::to_path_buf);
    let term = tmp.path().join("termination-log");
    let mut args: Vec<String> = [
        "--cgroup",
        &cg.display().to_string(),
        "--proc-root",
        &proc_root.display().to_string(),
        "--signal-file",
        &signal.display().to_string(),
        "--termination-log",
        &term.display().to_string(),
        "--interval",
        "20ms",
        "--cooldown",
        "0s",
        "--batch-size",
        "64",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let sidecar = Sidecar::spawn(&refs);
    Setup { tmp, cg, sidecar }
}

fn metrics(s: &Setup) -> String {
    let (code, text) = http(s.sidecar.metrics, "GET", "/metrics", None);
    assert_eq!(code, 200);
    text
}

/// The value of a metric line (`name{labels} value`), exactly as rendered.
fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

fn alive(s: &mut Setup) {
    assert!(
        s.sidecar.child.try_wait().expect("status").is_none(),
        "the sidecar exited: {}",
        s.sidecar.log_text()
    );
    assert_eq!(http(s.sidecar.api, "GET", "/healthz", None).0, 200);
    assert!(!s.sidecar.log_text().contains("panicked"));
}

fn signal_over_http(s: &Setup) -> Signal {
    let (_, body) = http(s.sidecar.api, "GET", "/v1/signal", None);
    serde_json::from_str(&body).expect("signal json")
}

/// The working set jumps to 0.9 of the limit: a downgrade, seq ≥ 1.
fn pressure(s: &Setup) {
    put(&s.cg, "memory.current", &format!("{}\n", 920 * MIB));
}

#[test]
fn the_trainers_cgroup_vanishing_mid_run_is_reported_and_survived() {
    let mut s = start(None, &["--exit-when-empty", "false"]);
    eventually(WAIT, "a first sample", || {
        (metric(&metrics(&s), "memguard_sidecar_source_up") == Some(1.0)).then_some(())
    });
    std::fs::remove_dir_all(&s.cg).expect("rm cgroup");
    eventually(WAIT, "the source reported down", || {
        (metric(&metrics(&s), "memguard_sidecar_source_up") == Some(0.0)).then_some(())
    });
    alive(&mut s);
    // The cgroup comes back (an in-place restart): sampling resumes, under pressure.
    v2_tree(&s.cg, 920 * MIB);
    let sig = eventually(WAIT, "a downgrade from the new cgroup", || {
        Some(signal_over_http(&s)).filter(|x| x.level >= Level::Downgrade)
    });
    assert!(sig.batch_size < 64);
    assert_eq!(
        metric(&metrics(&s), "memguard_sidecar_source_up"),
        Some(1.0)
    );
    alive(&mut s);
}

#[test]
fn the_default_sidecar_ends_with_a_summary_when_the_cgroup_vanishes() {
    // By design (exit-when-empty, the default), a vanished cgroup means the trainer is gone:
    // the sidecar exits cleanly, and what it saw is in the termination summary, not lost.
    let mut s = start(None, &[]);
    pressure(&s);
    eventually(WAIT, "the downgrade", || {
        Some(signal_over_http(&s)).filter(|x| x.level >= Level::Downgrade)
    });
    std::fs::remove_dir_all(&s.cg).expect("rm cgroup");
    assert!(s.sidecar.wait_exit(WAIT), "clean exit");
    let term = s.tmp.path().join("termination-log");
    let summary: memguard_api::Summary =
        serde_json::from_str(std::fs::read_to_string(term).expect("summary").trim())
            .expect("summary json");
    assert_eq!(summary.exit_reason, "trainer-exited");
    assert!(summary.peak_bytes >= Some(920 * MIB), "{summary:?}");
    assert!(summary.downgrades >= 1, "{summary:?}");
}

#[test]
fn unreadable_and_garbage_cgroup_files_are_counted_logged_and_survived() {
    let mut s = start(None, &["--exit-when-empty", "false"]);
    let cg = s.cg.clone();
    let current = cg.join("memory.current");
    let faults: [(&str, &dyn Fn()); 5] = [
        ("garbage", &|| put(&cg, "memory.current", "lots\n")),
        ("not utf-8", &|| {
            std::fs::write(&current, [0xff, 0xfe, b'1', b'\n']).expect("w")
        }),
        ("negative", &|| put(&cg, "memory.current", "-5\n")),
        ("overflow", &|| {
            put(&cg, "memory.current", "99999999999999999999999\n")
        }),
        // Root reads through any mode bits; a directory in the file's place fails every read.
        ("unreadable (EISDIR)", &|| {
            std::fs::remove_file(&current).expect("rm");
            std::fs::create_dir(&current).expect("mkdir");
        }),
    ];
    let mut errors_before = 0.0;
    for (what, inject) in faults {
        inject();
        let errors = eventually(WAIT, what, || {
            let m = metrics(&s);
            let read = metric(&m, "memguard_sidecar_sample_errors_total{kind=\"read\"}");
            let parse = metric(&m, "memguard_sidecar_sample_errors_total{kind=\"parse\"}");
            let total = read.unwrap_or(0.0) + parse.unwrap_or(0.0);
            (total > errors_before && metric(&m, "memguard_sidecar_source_up") == Some(0.0))
                .then_some(total)
        });
        errors_before = errors;
        alive(&mut s);
        // Garbage never becomes a figure: the last good one is kept, the level unchanged.
        assert_eq!(signal_over_http(&s).level, Level::Ok, "{what}");
        if current.is_dir() {
            std::fs::remove_dir(&current).expect("rmdir");
        }
        put(&s.cg, "memory.current", &format!("{}\n", 100 * MIB));
        eventually(WAIT, "recovery", || {
            (metric(&metrics(&s), "memguard_sidecar_source_up") == Some(1.0)).then_some(())
        });
    }
    assert!(s.sidecar.log_text().contains("sampler failed; carrying on"));
    // Still working: real pressure is still acted on.
    pressure(&s);
    eventually(WAIT, "a downgrade after the faults", || {
        Some(signal_over_http(&s)).filter(|x| x.level >= Level::Downgrade)
    });
}

/// A tmpfs of `size` mounted at a fresh directory; unmounted on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: PathBuf, size: &str) -> Tmpfs {
        std::fs::create_dir_all(&at).expect("mkdir");
        mount(
            &["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"],
            &at,
        );
        Tmpfs(at)
    }
    fn remount(&self, opt: &str) {
        mount(&["-o", &format!("remount,{opt}")], &self.0);
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn mount(args: &[&str], at: &Path) {
    let out = Command::new("mount")
        .args(args)
        .arg(at)
        .output()
        .expect("mount runs");
    assert!(
        out.status.success(),
        "mount {args:?} {}: {} (these tests need root, as CI has)",
        at.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn write_errors(s: &Setup) -> f64 {
    metric(&metrics(s), "memguard_sidecar_signal_write_errors_total").expect("metric")
}

#[test]
fn a_read_only_signal_directory_keeps_the_last_signal_whole_and_catches_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fs = Tmpfs::mount(dir.path().join("run"), "1m");
    let path = fs.0.join("signal.json");
    let mut s = start(Some(&path), &["--exit-when-empty", "false"]);
    let first = eventually(WAIT, "the first signal on disk", || read_signal(&path));
    fs.remount("ro");
    pressure(&s);
    let newer = eventually(WAIT, "the downgrade over HTTP", || {
        Some(signal_over_http(&s)).filter(|x| x.seq > first.seq)
    });
    eventually(WAIT, "write errors counted", || {
        (write_errors(&s) > 0.0).then_some(())
    });
    assert_eq!(read_signal(&path), Some(first), "the old signal is intact");
    assert!(s.sidecar.log_text().contains("signal file not written"));
    alive(&mut s);
    fs.remount("rw");
    let on_disk = eventually(WAIT, "the latest signal on disk", || {
        read_signal(&path).filter(|x| x.seq >= newer.seq)
    });
    assert!(on_disk.level >= Level::Downgrade);
    assert!(s.sidecar.log_text().contains("signal file writable again"));
}

#[test]
fn a_full_signal_filesystem_keeps_the_last_signal_whole_and_catches_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fs = Tmpfs::mount(dir.path().join("run"), "16k");
    let path = fs.0.join("signal.json");
    let mut s = start(Some(&path), &["--exit-when-empty", "false"]);
    let first = eventually(WAIT, "the first signal on disk", || read_signal(&path));
    // Fill what is left (ENOSPC ends the write).
    let filler = fs.0.join("filler");
    let _ = std::fs::write(&filler, vec![0u8; 64 * 1024]);
    pressure(&s);
    let newer = eventually(WAIT, "the downgrade over HTTP", || {
        Some(signal_over_http(&s)).filter(|x| x.seq > first.seq)
    });
    eventually(WAIT, "write errors counted", || {
        (write_errors(&s) > 0.0).then_some(())
    });
    assert_eq!(read_signal(&path), Some(first), "the old signal is intact");
    alive(&mut s);
    std::fs::remove_file(&filler).expect("rm filler");
    let on_disk = eventually(WAIT, "the latest signal on disk", || {
        read_signal(&path).filter(|x| x.seq >= newer.seq)
    });
    assert!(on_disk.level >= Level::Downgrade);
}

#[test]
fn sigkill_while_writing_never_leaves_a_torn_signal_and_seq_only_grows() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let path = tmp.path().join("signal.json");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // A reader that reads as fast as it can, as a trainer polling the file would.
    let reader = {
        let (path, stop) = (path.clone(), stop.clone());
        std::thread::spawn(move || {
            let (mut reads, mut torn) = (0u64, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(text) = std::fs::read_to_string(&path) {
                    reads += 1;
                    if serde_json::from_str::<Signal>(&text).is_err() {
                        torn.push(text);
                    }
                }
            }
            (reads, torn)
        })
    };
    let mut last_seq = None;
    let rounds = 15;
    let started = Instant::now();
    for round in 0..rounds {
        let mut s = start(Some(&path), &["--exit-when-empty", "false"]);
        // Flap the pressure so that the sidecar writes new signals continuously.
        let flap_until = Instant::now() + Duration::from_millis(150 + 37 * (round % 5));
        let mut high = round % 2 == 0;
        while Instant::now() < flap_until {
            let mib = if high { 1000 } else { 50 };
            put(&s.cg, "memory.current", &format!("{}\n", mib * MIB));
            high = !high;
            std::thread::sleep(Duration::from_millis(15));
        }
        s.sidecar.child.kill().expect("SIGKILL");
        s.sidecar.child.wait().expect("reaped");
        let on_disk = read_signal(&path).expect("a whole signal after SIGKILL");
        if let Some(prev) = last_seq {
            assert!(on_disk.seq > prev, "seq {} after {prev}", on_disk.seq);
        }
        last_seq = Some(on_disk.seq);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (reads, torn) = reader.join().expect("reader");
    eprintln!(
        "{rounds} SIGKILLs in {:?}, {reads} reads, last seq {last_seq:?}",
        started.elapsed()
    );
    assert!(reads > 100, "the reader read ({reads})");
    assert!(torn.is_empty(), "torn reads: {torn:?}");
    assert!(
        last_seq >= Some(rounds),
        "signals were written and carried over"
    );
}

#[test]
fn nonsense_and_floods_on_the_report_endpoint_are_refused_and_survived() {
    let mut s = start(None, &["--exit-when-empty", "false"]);
    let deep = format!("{}1{}", "[".repeat(5_000), "]".repeat(5_000));
    let bad: Vec<String> = vec![
        "".into(),
        "null".into(),
        "[]".into(),
        r#"["torch", 1, 2]"#.into(),
        "{".into(),
        "\u{0}\u{1}garbage".into(),
        r#"{"allocated_bytes": -1}"#.into(),
        r#"{"allocated_bytes": 1e30}"#.into(),
        r#"{"allocated_bytes": "lots"}"#.into(),
        r#"{"allocated": 5}"#.into(),
        r#"{"framework": 7}"#.into(),
        format!(r#"{{"framework": "{}"}}"#, "x".repeat(65)),
        deep,
        // Figures that cannot be: more in use than the device has.
        r#"{"reserved_bytes": 18446744073709551615, "total_bytes": 1}"#.into(),
        r#"{"allocated_bytes": 2000, "total_bytes": 1000}"#.into(),
        r#"{"peak_bytes": 2000, "total_bytes": 1000}"#.into(),
        r#"{"total_bytes": 0, "allocated_bytes": 1}"#.into(),
    ];
    for body in &bad {
        let (code, _) = http(s.sidecar.api, "POST", "/v1/report", Some(body));
        assert!(
            code == 400 || code == 413 || code == 415 || code == 422,
            "{code} for {body:.80}"
        );
    }
    let m = metrics(&s);
    assert_eq!(metric(&m, "memguard_sidecar_reports_total"), Some(0.0));
    assert_eq!(
        metric(&m, "memguard_sidecar_reports_rejected_total"),
        Some(bad.len() as f64)
    );
    assert_eq!(
        signal_over_http(&s).level,
        Level::Ok,
        "nonsense moved nothing"
    );
    assert!(s.sidecar.log_text().contains("report refused"));

    // A flood: 8 threads × 250 reports, as fast as loopback goes.
    let api = s.sidecar.api;
    let flood: Vec<_> = (0..8)
        .map(|t| {
            std::thread::spawn(move || {
                for i in 0..250u64 {
                    let body = format!(
                        r#"{{"framework":"torch","allocated_bytes":{},"total_bytes":{},"step":{}}}"#,
                        100 + i,
                        1000 * MIB,
                        t * 1000 + i
                    );
                    assert_eq!(http(api, "POST", "/v1/report", Some(&body)).0, 204);
                }
            })
        })
        .collect();
    for t in flood {
        t.join().expect("flood thread");
    }
    let m = metrics(&s);
    assert_eq!(metric(&m, "memguard_sidecar_reports_total"), Some(2000.0));
    alive(&mut s);
    assert_eq!(signal_over_http(&s).level, Level::Ok);
    // The sampler kept sampling through the flood.
    let before = metric(&m, "memguard_sidecar_samples_total").expect("samples");
    eventually(WAIT, "samples after the flood", || {
        (metric(&metrics(&s), "memguard_sidecar_samples_total") > Some(before)).then_some(())
    });
}

/// The sidecar's own container restarted in place (SIGKILL, then the same command again, as the
/// kubelet does) after an OOM kill: it starts from the sticky downgrade in the signal file, never
/// relaxes above it, steps further down at the next OOM, and its summary carries the floor.
#[test]
fn a_restarted_sidecar_keeps_the_sticky_downgrade() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let signal = tmp.path().join("signal.json");
    let oom_kills = |s: &Setup, n: u64| {
        put(
            &s.cg,
            "memory.events",
            &format!("low 0\nhigh 0\nmax {n}\noom {n}\noom_kill {n}\n"),
        )
    };
    // The OOM kill must come after the sidecar's first look at the counter (its baseline).
    let sampled = |s: &Setup| {
        eventually(WAIT, "a few samples", || {
            metric(&metrics(s), "memguard_sidecar_samples_total").filter(|n| *n >= 3.0)
        })
    };
    let mut first = start(Some(&signal), &["--exit-when-empty", "false"]);
    sampled(&first);
    oom_kills(&first, 1);
    let sticky = eventually(WAIT, "a sticky downgrade", || {
        read_signal(&signal).filter(|s| s.sticky.is_some())
    });
    assert_eq!(
        (sticky.batch_size, sticky.grad_accumulation),
        (32, 2),
        "one rung below 64 × 1"
    );
    first.sidecar.child.kill().expect("SIGKILL");
    first.sidecar.child.wait().expect("reaped");

    // Restarted with the same env (batch 64), on the same emptyDir (the signal file), watching
    // a fresh container cgroup.
    let second = start(Some(&signal), &["--exit-when-empty", "false"]);
    sampled(&second);
    let restarted = eventually(WAIT, "the restarted sidecar's signal", || {
        read_signal(&signal).filter(|s| s.seq > sticky.seq)
    });
    assert_eq!(restarted.batch_size, 32, "{restarted:?}");
    assert_eq!(restarted.sticky, sticky.sticky, "the floor is carried over");
    // Calm for a while: never above the sticky batch.
    let calm_until = Instant::now() + Duration::from_millis(600);
    while Instant::now() < calm_until {
        let now = signal_over_http(&second);
        assert!(now.batch_size <= 32, "relaxed above the floor: {now:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The next OOM kill steps down from there.
    oom_kills(&second, 1);
    let lower = eventually(WAIT, "a second sticky downgrade", || {
        read_signal(&signal).filter(|s| s.batch_size < 32)
    });
    assert_eq!(
        lower.sticky.map(|k| (k.batch_size, k.grad_accumulation)),
        Some((16, 4))
    );
    second.sidecar.terminate();
    let summary = eventually(WAIT, "the summary", || {
        std::fs::read_to_string(second.tmp.path().join("termination-log"))
            .ok()
            .filter(|t| !t.is_empty())
    });
    let summary: memguard_api::Summary = serde_json::from_str(summary.trim()).expect("summary");
    assert_eq!(summary.sticky_batch_size, Some(16), "{summary:?}");
    drop(tmp);
}
