//! The real binary on a real cgroup v1 memory controller: a process grows inside a 256 MiB
//! child cgroup and must be told to downgrade (batch halved) before it reaches the limit.
//! Needs root and `/sys/fs/cgroup/memory`; elsewhere it says SKIP loudly. CI runs it as root.

mod common;

use common::{Sidecar, eventually, read_signal};
use memguard_api::{Level, Summary};
use memguard_sidecar::sample::cgroup::proc_cgroup_path;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const LIMIT: u64 = 256 * MIB;
const V1_ROOT: &str = "/sys/fs/cgroup/memory";

/// Grows by 8 MiB every 50 ms (touching every byte), reading the signal file after each step as
/// a trainer would; on `downgrade` or `critical` it prints what it saw and stops growing.
const GROWER: &str = r#"
import json, sys, time
path, step = sys.argv[1], 8 << 20
held, total = [], 0
print("READY", flush=True)
while total < (1 << 30):
    held.append(b"\x01" * step)
    total += step
    try:
        with open(path) as f:
            s = json.load(f)
    except Exception:
        s = {}
    if s.get("level") in ("downgrade", "critical"):
        print("SAW", s["level"], s["batch_size"], s["grad_accumulation"], total, flush=True)
        time.sleep(60)
        break
    print("STEP", total, flush=True)
    time.sleep(0.05)
print("NO-SIGNAL", total, flush=True)
"#;

fn skip(why: &str) {
    eprintln!(
        "\n********************************************************************\n\
         SKIP real_cgroup: {why}\n\
         (needs root and a writable cgroup v1 memory controller at {V1_ROOT}; CI has both)\n\
         ********************************************************************\n"
    );
}

/// A child cgroup, emptied (processes killed) and removed on drop, even when the test fails.
struct CgroupGuard(PathBuf);

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let procs = std::fs::read_to_string(self.0.join("cgroup.procs")).unwrap_or_default();
            let pids: Vec<i32> = procs
                .lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect();
            if pids.is_empty() || Instant::now() > deadline {
                break;
            }
            for p in pids {
                if let Some(pid) = rustix::process::Pid::from_raw(p) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Err(e) = std::fs::remove_dir(&self.0) {
            eprintln!("could not remove {}: {e}", self.0.display());
        }
    }
}

struct Grower(Child);

impl Drop for Grower {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn parent_cgroup() -> PathBuf {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let rel = proc_cgroup_path(&own, Some("memory")).unwrap_or_else(|| "/".into());
    let dir = Path::new(V1_ROOT).join(rel.trim_start_matches('/'));
    if dir.join("cgroup.procs").exists() {
        dir
    } else {
        PathBuf::from(V1_ROOT)
    }
}

#[test]
fn a_growing_process_is_told_to_downgrade_before_it_reaches_the_limit() {
    if !rustix::process::geteuid().is_root() {
        return skip("not running as root");
    }
    if !Path::new(V1_ROOT).join("memory.usage_in_bytes").exists() {
        return skip("no cgroup v1 memory controller");
    }
    if Command::new("python3").arg("-V").output().is_err() {
        return skip("python3 not found (the growing process is a python3 loop)");
    }
    let cg = parent_cgroup().join(format!("memguard-test-{}", std::process::id()));
    std::fs::create_dir(&cg).expect("create child cgroup as root");
    let _guard = CgroupGuard(cg.clone());
    std::fs::write(cg.join("memory.limit_in_bytes"), LIMIT.to_string()).expect("set limit");

    let tmp = tempfile::tempdir().expect("tempdir");
    let signal = tmp.path().join("signal.json");
    let term = tmp.path().join("termination-log");
    let (cg_s, sig_s, term_s) = (
        cg.display().to_string(),
        signal.display().to_string(),
        term.display().to_string(),
    );
    let mut sidecar = Sidecar::spawn(&[
        "--cgroup",
        &cg_s,
        "--signal-file",
        &sig_s,
        "--termination-log",
        &term_s,
        "--batch-size",
        "8",
        "--grad-accumulation",
        "2",
    ]);
    let first = eventually(Duration::from_secs(10), "initial signal", || {
        read_signal(&signal)
    });
    assert_eq!((first.level, first.batch_size), (Level::Ok, 8));

    // Into the cgroup first (the shell moves itself), then exec the grower: every byte it
    // allocates is charged to the limited cgroup.
    let script = format!(
        "echo $$ > {}/cgroup.procs && exec python3 -c \"$0\" \"$1\"",
        cg_s
    );
    let child = Command::new("sh")
        .args(["-c", &script, GROWER, &sig_s])
        .stdout(Stdio::piped())
        .spawn()
        .expect("grower starts");
    let mut grower = Grower(child);
    let out = BufReader::new(grower.0.stdout.take().expect("piped"));
    let mut saw = None;
    let mut last_step = 0u64;
    for line in out.lines().map_while(Result::ok) {
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.first().copied() {
            Some("STEP") => last_step = w[1].parse().unwrap_or(0),
            Some("SAW") => {
                saw = Some((
                    w[1].to_string(),
                    w[2].to_string(),
                    w[3].to_string(),
                    w[4].to_string(),
                ));
                break;
            }
            Some("NO-SIGNAL") => break,
            _ => {}
        }
    }
    let log = sidecar.log_text();
    let Some((level, batch, accum, at)) = saw else {
        panic!(
            "the grower never saw a downgrade (last step {last_step} bytes, killed by OOM?)\n{log}"
        );
    };
    let at: u64 = at.parse().expect("bytes");
    eprintln!(
        "grower saw {level} (batch {batch}, accumulation {accum}) after allocating {} MiB of a {} MiB limit",
        at / MIB,
        LIMIT / MIB
    );
    assert!(level == "downgrade" || level == "critical");
    let (batch, accum): (u64, u64) = (batch.parse().expect("n"), accum.parse().expect("n"));
    assert!(
        batch < 8 && batch * accum == 16,
        "halved, effective batch kept: {batch} x {accum}"
    );
    assert!(
        log.contains("level=downgrade batch_size=4 grad_accumulation=4"),
        "first downgrade halves 8 -> 4:\n{log}"
    );
    assert!(at < LIMIT, "signalled before the limit");
    assert!(
        grower.0.try_wait().expect("status").is_none(),
        "grower alive, not OOM-killed"
    );
    let oom = std::fs::read_to_string(cg.join("memory.oom_control")).unwrap_or_default();
    assert!(
        !oom.contains("oom_kill 1"),
        "no OOM kill in the cgroup: {oom}"
    );

    // The trainer goes: the cgroup empties, the sidecar writes its summary and exits.
    drop(grower);
    assert!(sidecar.wait_exit(Duration::from_secs(20)), "clean exit");
    let summary: Summary = serde_json::from_str(
        std::fs::read_to_string(&term)
            .expect("termination log")
            .trim(),
    )
    .expect("summary json");
    assert_eq!(summary.exit_reason, "trainer-exited");
    assert!(summary.downgrades >= 1);
    assert_eq!(summary.limit_bytes, Some(LIMIT));
    assert_eq!(summary.oom_events, 0);
}

/// A trainer on `memguard_client`: reads the signal file before its first step (the Guard does,
/// at construction), then runs four steps whose activations are 40 MiB per sample, allocated
/// at once: at batch 8 a step needs 320 MiB, over the 256 MiB limit, and the kernel kills it
/// within milliseconds, long before any poll.
const SPIKY_TRAINER: &str = r#"
import sys
sys.path.insert(0, sys.argv[2])
from memguard_client import Guard
guard = Guard(signal_file=sys.argv[1], sidecar_url="", oom_hook=False)
batch, accum = guard.batch_size, guard.grad_accumulation
print("START", batch, accum, guard.seq, flush=True)
for step in range(4):
    activations = b"\x01" * (batch * (40 << 20))
    del activations
    print("STEP", step, flush=True)
print("DONE", batch, accum, flush=True)
"#;

#[test]
fn an_oom_kill_faster_than_any_poll_makes_the_in_place_restart_start_smaller_and_finish() {
    if !rustix::process::geteuid().is_root() {
        return skip("not running as root");
    }
    if !Path::new(V1_ROOT).join("memory.usage_in_bytes").exists() {
        return skip("no cgroup v1 memory controller");
    }
    let cg = parent_cgroup().join(format!("memguard-restart-{}", std::process::id()));
    std::fs::create_dir(&cg).expect("create child cgroup as root");
    let _guard = CgroupGuard(cg.clone());
    std::fs::write(cg.join("memory.limit_in_bytes"), LIMIT.to_string()).expect("set limit");
    let client = Path::new(env!("CARGO_MANIFEST_DIR")).join("../clients/python/src");

    let tmp = tempfile::tempdir().expect("tempdir");
    let signal = tmp.path().join("signal.json");
    let term = tmp.path().join("termination-log");
    let (cg_s, sig_s, term_s) = (
        cg.display().to_string(),
        signal.display().to_string(),
        term.display().to_string(),
    );
    // The sidecar runs throughout: it does not end its run when the trainer's cgroup empties
    // between two starts.
    let mut sidecar = Sidecar::spawn(&[
        "--cgroup",
        &cg_s,
        "--signal-file",
        &sig_s,
        "--termination-log",
        &term_s,
        "--batch-size",
        "8",
        "--grad-accumulation",
        "2",
        "--exit-when-empty",
        "false",
        // Host-wide PSI (cgroup v1 has none of its own) moves with whatever else the machine
        // runs, the other tests' OOM kills included: a pressure downgrade before the first start
        // would make this test about PSI, not about the kill it counts.
        "--psi-threshold",
        "100",
    ]);
    eventually(Duration::from_secs(10), "initial signal", || {
        read_signal(&signal)
    });

    // The kubelet's part: start the container in its cgroup, and restart it in place (same
    // env, no admission) when it dies, after a second's back-off, at most three times.
    let script = format!("echo $$ > {cg_s}/cgroup.procs && exec python3 -c \"$0\" \"$1\" \"$2\"");
    let mut starts: Vec<(String, Option<i32>, Option<i32>)> = Vec::new();
    for _ in 0..3 {
        let out = Command::new("sh")
            .args(["-c", &script, SPIKY_TRAINER, &sig_s])
            .arg(&client)
            .output()
            .expect("trainer starts");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let signal_no = std::os::unix::process::ExitStatusExt::signal(&out.status);
        starts.push((stdout, out.status.code(), signal_no));
        if out.status.success() {
            break;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let log = sidecar.log_text();
    eprintln!("starts: {starts:?}");
    assert!(
        starts.len() >= 2,
        "the first start survived the spike: {starts:?}"
    );
    let (first, _, killed_by) = &starts[0];
    assert!(
        first.starts_with("START 8 2"),
        "first start at the admitted batch: {first}"
    );
    assert!(
        !first.contains("STEP 0"),
        "killed in its first step: {first}"
    );
    assert_eq!(*killed_by, Some(9), "SIGKILL from the OOM killer");
    let oom = std::fs::read_to_string(cg.join("memory.oom_control")).unwrap_or_default();
    assert!(
        oom.contains("oom_kill 1"),
        "the kernel OOM-killed it: {oom}"
    );

    let (second, code, _) = &starts[1];
    assert_eq!(*code, Some(0), "the second start finishes: {second}\n{log}");
    let knobs: Vec<u64> = second
        .split_whitespace()
        .skip(1)
        .take(2)
        .filter_map(|w| w.parse().ok())
        .collect();
    let [batch, accum] = knobs[..] else {
        panic!("no START line: {second}");
    };
    // One rung below what was in force when the kernel killed it. The usage-threshold events
    // may have let the sidecar signal pressure downgrades during the spike (which the dying
    // trainer never applied); they count as in force, so the batch is 4, 2 or 1.
    assert!(batch < 8, "started smaller: {second}");
    assert_eq!(batch * accum, 16, "effective batch kept: {second}");
    assert!(
        second.contains(&format!("DONE {batch} {accum}")),
        "{second}"
    );
    assert!(
        log.contains(&format!(
            "OOM kill in the trainer's cgroup (oom_kill 0 -> 1): sticky downgrade to batch {batch}, accumulation {accum}"
        )),
        "{log}"
    );
    let sticky = read_signal(&signal).expect("signal");
    assert_eq!(
        (sticky.batch_size, sticky.grad_accumulation),
        (batch, accum)
    );

    sidecar.terminate();
    assert!(sidecar.wait_exit(Duration::from_secs(20)), "clean exit");
    let summary: Summary = serde_json::from_str(
        std::fs::read_to_string(&term)
            .expect("termination log")
            .trim(),
    )
    .expect("summary json");
    assert_eq!(summary.oom_events, 1);
    assert_eq!(summary.sticky_batch_size, Some(batch));
    assert_eq!(
        summary.batch_size, batch,
        "never relaxed above the sticky downgrade"
    );
}

/// Holds 140 MiB (about 60 % of the limit with the interpreter), then once rises by 75 MiB (to
/// about 88 %, above the 85 % downgrade threshold and below the 95 % critical one) for 20 ms and
/// frees it again; prints how long the spike lasted.
/// The spike is one populated anonymous mapping, so it comes and goes in a few milliseconds.
const SPIKER: &str = r#"
import mmap, sys, time
base = b"\x01" * (140 << 20)
print("READY", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
spike = mmap.mmap(-1, 75 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
t1 = time.monotonic()
time.sleep(0.02)
t2 = time.monotonic()
spike.close()
t3 = time.monotonic()
ms = lambda a, b: int((b - a) * 1000)
print("SPIKED", ms(t0, t3), "ms in all:", ms(t0, t1), "up,", ms(t1, t2), "held,", ms(t2, t3), "down", flush=True)
time.sleep(60)
"#;

#[test]
fn a_20_ms_spike_between_two_100_ms_polls_is_told_to_downgrade() {
    use std::io::Write;
    if !rustix::process::geteuid().is_root() {
        return skip("not running as root");
    }
    if !Path::new(V1_ROOT).join("memory.usage_in_bytes").exists() {
        return skip("no cgroup v1 memory controller");
    }
    let cg = parent_cgroup().join(format!("memguard-spike-{}", std::process::id()));
    std::fs::create_dir(&cg).expect("create child cgroup as root");
    let _guard = CgroupGuard(cg.clone());
    std::fs::write(cg.join("memory.limit_in_bytes"), LIMIT.to_string()).expect("set limit");
    let tmp = tempfile::tempdir().expect("tempdir");
    let signal = tmp.path().join("signal.json");
    let (cg_s, sig_s) = (cg.display().to_string(), signal.display().to_string());
    let script = format!("echo $$ > {cg_s}/cgroup.procs && exec python3 -c \"$0\"");
    let child = Command::new("sh")
        .args(["-c", &script, SPIKER])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spiker starts");
    let mut spiker = Grower(child);
    let mut out = BufReader::new(spiker.0.stdout.take().expect("piped")).lines();
    assert_eq!(
        out.next().and_then(Result::ok).as_deref(),
        Some("READY"),
        "spiker ready"
    );
    // Kernel events off: only the 100 ms poll can see the spike, as with a read-only mount.
    let sidecar = Sidecar::spawn(&[
        "--cgroup",
        &cg_s,
        "--signal-file",
        &sig_s,
        "--termination-log",
        &tmp.path().join("term").display().to_string(),
        "--batch-size",
        "8",
        "--interval",
        "100ms",
        "--events",
        "false",
        // The exact peak between two samples (opt-in on v1: it rewrites everyone's peak).
        "--reset-v1-peak",
        "true",
        // No host PSI (the machine's other load must not decide this test).
        "--proc-root",
        &tmp.path().display().to_string(),
    ]);
    let first = eventually(Duration::from_secs(10), "initial signal", || {
        read_signal(&signal)
    });
    assert_eq!(first.level, Level::Ok, "60 % is fine");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(read_signal(&signal).map(|s| s.level), Some(Level::Ok));
    let mut stdin = spiker.0.stdin.take().expect("piped");
    writeln!(stdin, "go").expect("go");
    let spiked = out.next().and_then(Result::ok).unwrap_or_default();
    eprintln!("spike: {spiked}");
    // The spike is over when SPIKED is printed; the downgrade must follow from the peak the
    // kernel kept (an instant sample lands inside the spike only by chance).
    let deadline = Instant::now() + Duration::from_secs(3);
    let after = loop {
        let s = read_signal(&signal).expect("signal");
        if s.level >= Level::Downgrade || Instant::now() > deadline {
            break s;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let log = sidecar.log_text();
    assert_eq!(after.level, Level::Downgrade, "{after:?}\n{log}");
    assert_eq!(after.batch_size, 4);
    let ratio = after.pressure.memory_ratio.expect("ratio");
    let instant = after.pressure.working_set_bytes.expect("ws") as f64 / LIMIT as f64;
    eprintln!("downgraded at ratio {ratio:.3}; the instant working set was {instant:.3}");
    assert!((0.85..0.95).contains(&ratio), "{ratio}");
    assert!(
        log.contains("peak between samples") && log.contains("reset after each sample"),
        "{log}"
    );
}
