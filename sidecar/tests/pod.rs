//! Sidecar discovery in a pod-shaped harness, with no `--cgroup` flag: a shared PID namespace with
//! a pause process as PID 1, and a trainer and a sidecar each in its own memory cgroup, its own
//! mount namespace (its cgroup bind-mounted read-only at /sys/fs/cgroup/memory as containerd does
//! for v1, or a cgroup namespace for v2) and the uid, gid and capabilities Kubernetes would give
//! it (tests/pod/pod.sh builds it with `unshare` and `setpriv`). The trainer holds 100 MiB in a
//! 400 MiB cgroup. Needs root and a cgroup v1 memory controller; it fails rather than skips in CI.

mod common;

use common::{Sidecar, eventually, http};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const LIMIT: u64 = 400 * MIB;
const HELD: u64 = 100 * MIB;
const V1_ROOT: &str = "/sys/fs/cgroup/memory";
/// The cgroup2 mount of a hybrid host (this one, and CI's).
const V2_ROOT: &str = "/sys/fs/cgroup/unified";
/// The capabilities containerd gives a container that asks for none (a root trainer's).
const RUNTIME_DEFAULT: &str = "-all,+chown,+dac_override,+fowner,+fsetid,+kill,+setgid,+setuid,\
+setpcap,+net_bind_service,+net_raw,+sys_chroot,+mknod,+audit_write,+setfcap";
const NO_CAPS: &str = "-all";
const TRAINER: &str = "exec python3 -c 'import time
held = b\"\\x01\" * (100 << 20)
print(\"READY\", flush=True)
time.sleep(300)'";

/// What /sys/fs/cgroup looks like inside each container.
#[derive(Clone, Copy)]
enum Layout {
    /// containerd on cgroup v1: the container's own memory cgroup, bind-mounted.
    V1,
    /// The host's whole hierarchy (privileged, hostPath): the trainer's cgroup lies below.
    Host,
    /// A cgroup namespace rooted at the container's cgroup, cgroup2 mounted there.
    V2,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::V1 => "v1",
            Layout::Host => "host",
            Layout::V2 => "v2",
        }
    }
}

/// uid, gid and bounding set of a container.
struct Id(u32, u32, &'static str);

impl Id {
    fn arg(&self) -> String {
        format!("{}:{}:{}", self.0, self.1, self.2)
    }
}

fn available() -> Result<(), String> {
    if !rustix::process::geteuid().is_root() {
        return Err("not running as root".into());
    }
    if !Path::new(V1_ROOT).join("memory.usage_in_bytes").exists() {
        return Err("no cgroup v1 memory controller".into());
    }
    for tool in ["unshare", "setpriv", "python3"] {
        let found = Command::new(tool)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            return Err(format!("{tool} not found"));
        }
    }
    Ok(())
}

/// Whether the harness can run; in CI it must.
fn harness() -> bool {
    match available() {
        Ok(()) => true,
        Err(why) if std::env::var("CI").as_deref() == Ok("true") => {
            panic!("the pod harness must run in CI: {why}")
        }
        Err(why) => {
            eprintln!(
                "\n********************************************************************\n\
                 SKIP pod harness: {why} (needs root, cgroup v1 memory, unshare, setpriv)\n\
                 ********************************************************************\n"
            );
            false
        }
    }
}

fn own_v1_cgroup() -> PathBuf {
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let rel = memguard_sidecar::sample::cgroup::proc_cgroup_path(&own, Some("memory"))
        .unwrap_or_else(|| "/".into());
    let dir = Path::new(V1_ROOT).join(rel.trim_start_matches('/'));
    if dir.join("cgroup.procs").exists() {
        dir
    } else {
        PathBuf::from(V1_ROOT)
    }
}

/// The pod's cgroups (pause, trainer, sidecar) and files; every process in them is killed and
/// the cgroups removed on drop, even when the test fails.
struct Pod {
    cgroups: Vec<PathBuf>,
    tmp: tempfile::TempDir,
}

impl Pod {
    fn new(name: &str, v2: bool) -> Pod {
        let mut roots = vec![own_v1_cgroup()];
        if v2 {
            roots.push(PathBuf::from(V2_ROOT));
        }
        let mut cgroups = Vec::new();
        for root in roots {
            let pod = root.join(format!("memguard-pod-{name}-{}", std::process::id()));
            std::fs::create_dir(&pod).expect("pod cgroup");
            cgroups.push(pod.clone());
            for c in ["pause", "trainer", "sidecar"] {
                std::fs::create_dir(pod.join(c)).expect("container cgroup");
                cgroups.push(pod.join(c));
            }
        }
        let trainer = cgroups[0].join("trainer");
        std::fs::write(trainer.join("memory.limit_in_bytes"), LIMIT.to_string()).expect("limit");
        let tmp = tempfile::tempdir().expect("tempdir");
        chmod(tmp.path(), 0o755);
        std::fs::copy("/bin/sleep", tmp.path().join("pause")).expect("pause binary");
        let bin = tmp.path().join("memguard-sidecar");
        if std::fs::hard_link(env!("CARGO_BIN_EXE_memguard-sidecar"), &bin).is_err() {
            std::fs::copy(env!("CARGO_BIN_EXE_memguard-sidecar"), &bin).expect("copy sidecar");
        }
        std::fs::create_dir(tmp.path().join("signal")).expect("mkdir");
        chmod(&tmp.path().join("signal"), 0o777);
        Pod { cgroups, tmp }
    }

    fn v1(&self) -> &Path {
        &self.cgroups[0]
    }
}

fn chmod(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

impl Drop for Pod {
    fn drop(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        for cg in self.cgroups.iter().rev() {
            loop {
                let procs = std::fs::read_to_string(cg.join("cgroup.procs")).unwrap_or_default();
                let pids: Vec<i32> = procs.lines().filter_map(|l| l.parse().ok()).collect();
                if pids.is_empty() || Instant::now() > deadline {
                    break;
                }
                for p in pids {
                    if let Some(pid) = rustix::process::Pid::from_raw(p) {
                        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if let Err(e) = std::fs::remove_dir(cg) {
                eprintln!("could not remove {}: {e}", cg.display());
            }
        }
    }
}

/// Starts the pod; returns once the sidecar has settled on a source.
fn start(name: &str, layout: Layout, trainer: Id, sidecar: Id) -> (Pod, Sidecar) {
    let pod = Pod::new(name, matches!(layout, Layout::V2));
    let t = pod.tmp.path();
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--kill-child", "--mount-proc", "/bin/sh"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/pod/pod.sh"))
        .env("LAYOUT", layout.name())
        .env("POD_V1", pod.v1())
        .env("POD_TMP", t)
        .env("TRAINER_ID", trainer.arg())
        .env("SIDECAR_ID", sidecar.arg())
        .env("PAUSE_ID", Id(65535, 65535, NO_CAPS).arg())
        .env("TRAINER_CMD", TRAINER)
        .env("SIDECAR_BIN", t.join("memguard-sidecar"))
        .env("MEMGUARD_TRAINER_MEMORY_LIMIT", LIMIT.to_string());
    if let Some(v2) = pod.cgroups.get(4) {
        cmd.env("POD_V2", v2);
    }
    let signal = t.join("signal/signal.json").display().to_string();
    let term = t.join("signal/termination-log").display().to_string();
    let sc = Sidecar::spawn_command(cmd, &["--signal-file", &signal, "--termination-log", &term]);
    eventually(Duration::from_secs(120), "the trainer to be found", || {
        let text = sc.log_text();
        text.contains("found the trainer").then_some(())
    });
    eventually(
        Duration::from_secs(120),
        "the trainer to hold its memory",
        || {
            let ready =
                std::fs::read_to_string(t.join("trainer.out")).is_ok_and(|s| s.contains("READY"));
            let ws = value(&metrics(&sc), "memguard_sidecar_working_set_bytes")?;
            (ready && ws >= HELD as f64).then_some(())
        },
    );
    (pod, sc)
}

fn metrics(sc: &Sidecar) -> String {
    http(sc.metrics, "GET", "/metrics", None).1
}

/// The value of an unlabelled sample, or of the first sample whose name and labels start so.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        let v = rest.rsplit(' ').next()?;
        (rest.starts_with(' ') || rest.starts_with('{') || series.ends_with('}'))
            .then(|| v.parse().ok())
            .flatten()
    })
}

/// The trainer's own cgroup: its limit, its working set (what it holds, not the host's), its
/// kernel event counters, through the trainer's mount namespace.
fn assert_reads_the_trainers_cgroup(sc: &Sidecar, kind: &str) {
    let m = metrics(sc);
    let log = sc.log_text();
    // The runtime mounts the cgroup read-only: no reset, the all-time peak's new highs.
    let info = format!(
        "memguard_sidecar_source_info{{kind=\"{kind}\",view=\"trainer-mount\",peak=\"all-time\"}}"
    );
    assert_eq!(value(&m, &info), Some(1.0), "{m}\n{log}");
    assert_eq!(
        value(&m, "memguard_sidecar_limit_bytes"),
        Some(LIMIT as f64)
    );
    let ws = value(&m, "memguard_sidecar_working_set_bytes").expect("working set");
    assert!(
        ws >= HELD as f64 && ws < LIMIT as f64,
        "the trainer's working set, not the host's: {ws}"
    );
    assert!(
        value(
            &m,
            "memguard_sidecar_cgroup_memory_events_total{event=\"oom_kill\"}"
        )
        .is_some(),
        "OOM kills are counted from the cgroup:\n{m}"
    );
    assert!(log.contains("reading its own cgroup"), "{log}");
}

/// The summed-RSS fallback, said so in the log and on /metrics.
fn assert_falls_back_to_rss(sc: &Sidecar) {
    // The cgroup is tried again for 3 s (a trainer caught while its runtime sets it up cannot
    // be read yet) before the fallback is logged.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(8);
    while !sc.log_text().contains("falling back to summed RSS")
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let m = metrics(sc);
    let log = sc.log_text();
    assert_eq!(
        value(
            &m,
            "memguard_sidecar_source_info{kind=\"rss\",view=\"procfs\",peak=\"none\"}"
        ),
        Some(1.0),
        "{m}\n{log}"
    );
    assert_eq!(
        value(&m, "memguard_sidecar_limit_bytes"),
        Some(LIMIT as f64),
        "the downward-API limit"
    );
    assert!(
        !m.contains("cgroup_memory_events_total"),
        "no event counters"
    );
    assert!(
        log.contains("falling back to summed RSS") && log.contains("lost=\"no memory.events"),
        "{log}"
    );
}

#[test]
fn a_root_trainer_is_read_by_a_root_sidecar_with_the_trainers_capabilities() {
    if !harness() {
        return;
    }
    let (_pod, sc) = start(
        "root-same",
        Layout::V1,
        Id(0, 0, RUNTIME_DEFAULT),
        Id(0, 0, RUNTIME_DEFAULT),
    );
    assert_reads_the_trainers_cgroup(&sc, "cgroup-v1");
    let log = sc.log_text();
    assert!(
        log.contains("/root/sys/fs/cgroup/memory (via trainer-mount)"),
        "containerd's mount is the container's own cgroup:\n{log}"
    );
}

#[test]
fn a_root_trainer_is_read_by_a_root_sidecar_with_cap_sys_ptrace_alone() {
    if !harness() {
        return;
    }
    let (_pod, sc) = start(
        "root-ptrace",
        Layout::V1,
        Id(0, 0, RUNTIME_DEFAULT),
        Id(0, 0, "-all,+sys_ptrace"),
    );
    assert_reads_the_trainers_cgroup(&sc, "cgroup-v1");
}

#[test]
fn a_root_trainer_beside_a_non_root_sidecar_leaves_only_rss() {
    if !harness() {
        return;
    }
    let (_pod, sc) = start(
        "root-nonroot",
        Layout::V1,
        Id(0, 0, RUNTIME_DEFAULT),
        Id(65532, 65532, NO_CAPS),
    );
    assert_falls_back_to_rss(&sc);
    assert!(sc.log_text().contains("Permission denied"));
}

#[test]
fn a_non_root_trainer_is_read_by_a_sidecar_with_its_uid_and_gid() {
    if !harness() {
        return;
    }
    let (_pod, sc) = start(
        "same-uid",
        Layout::V1,
        Id(1000, 1000, NO_CAPS),
        Id(1000, 1000, NO_CAPS),
    );
    assert_reads_the_trainers_cgroup(&sc, "cgroup-v1");
}

#[test]
fn a_trainer_with_another_non_root_uid_leaves_only_rss() {
    if !harness() {
        return;
    }
    let (_pod, sc) = start(
        "other-uid",
        Layout::V1,
        Id(1000, 1000, NO_CAPS),
        Id(65532, 65532, NO_CAPS),
    );
    assert_falls_back_to_rss(&sc);
}

#[test]
fn a_host_wide_mount_is_read_at_the_trainers_cgroup_not_at_the_hierarchy_root() {
    if !harness() {
        return;
    }
    let (pod, sc) = start(
        "host",
        Layout::Host,
        Id(1000, 1000, NO_CAPS),
        Id(1000, 1000, NO_CAPS),
    );
    assert_reads_the_trainers_cgroup(&sc, "cgroup-v1");
    let rel = pod.v1().join("trainer");
    let rel = rel.strip_prefix(V1_ROOT).expect("below the v1 root");
    let log = sc.log_text();
    assert!(
        log.contains(&format!("/root/sys/fs/cgroup/memory/{}", rel.display())),
        "{log}"
    );
}

#[test]
fn a_v2_cgroup_namespace_is_resolved_to_the_containers_own_cgroup() {
    if !harness() {
        return;
    }
    if !Path::new(V2_ROOT).join("cgroup.controllers").exists() {
        eprintln!("NOTE: no cgroup2 mount at {V2_ROOT}: the v2 layout cannot be made here");
        return;
    }
    let (pod, sc) = start(
        "v2",
        Layout::V2,
        Id(1000, 1000, NO_CAPS),
        Id(1000, 1000, NO_CAPS),
    );
    if pod.cgroups[6].join("memory.current").exists() {
        return assert_reads_the_trainers_cgroup(&sc, "cgroup-v2");
    }
    // This host's cgroup2 has no memory controller (it is bound to v1): the sidecar must still
    // resolve the trainer's cgroup namespace root, and say why it cannot use it.
    assert_falls_back_to_rss(&sc);
    let log = sc.log_text();
    assert!(
        log.contains("/root/sys/fs/cgroup has no memory controller files"),
        "{log}"
    );
}
