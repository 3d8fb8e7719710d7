//! Finding the trainer through the shared process namespace, and the summed-RSS fallback.
//!
//! With `shareProcessNamespace: true` the sidecar sees the trainer's processes. Their cgroup
//! differs from ours; the pause process (`comm` = `pause`) is left out. The trainer's own cgroup
//! is found from its `/proc/<pid>/cgroup` path and the cgroup mounts of its mount namespace
//! (`/proc/<pid>/mountinfo`, reached through `/proc/<pid>/root`, which needs ptrace-read access:
//! see docs/sidecar.md). A runtime that bind-mounts the container's cgroup at `/sys/fs/cgroup`
//! (containerd, v1) or roots it with a cgroup namespace (v2) shows it there; a host-wide mount
//! shows it below. When it cannot be read, the trainer's RSS is summed and compared with the
//! limit passed by the downward API.

use super::cgroup::CgroupSource;
use super::{Limit, MemorySample, MemorySource, SampleError, SourceInfo};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `VmRSS` from `/proc/<pid>/status`, bytes.
pub fn parse_status_rss(status: &str) -> Option<u64> {
    status.lines().find_map(|l| {
        let rest = l.strip_prefix("VmRSS:")?;
        let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
        kb.checked_mul(1024)
    })
}

/// The numeric entries of a procfs root.
pub fn pids(proc_root: &Path) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

/// What pod sandboxes run as their infra process: the kubelet's `pause`, podman's `catatonit`.
const INFRA_COMMS: [&str; 2] = ["pause", "catatonit"];

/// The trainer's processes: those outside our cgroup, grouped by cgroup; the group with the
/// largest RSS wins. Empty when nothing else is visible. The pod's infra process is never the
/// trainer: it is PID 1 of a shared process namespace, whatever its name, and it is also known by
/// name (`pause`, `catatonit`) where a harness runs it elsewhere.
pub fn find_trainer(proc_root: &Path, self_pid: u32) -> Vec<u32> {
    let read = |pid: u32, f: &str| std::fs::read_to_string(proc_root.join(pid.to_string()).join(f));
    let Ok(ours) = read(self_pid, "cgroup") else {
        return Vec::new();
    };
    let mut groups: BTreeMap<String, (u64, Vec<u32>)> = BTreeMap::new();
    for pid in pids(proc_root) {
        if pid == self_pid || pid == 1 {
            continue;
        }
        let (Ok(cg), Ok(comm)) = (read(pid, "cgroup"), read(pid, "comm")) else {
            continue;
        };
        if cg == ours || INFRA_COMMS.contains(&comm.trim()) {
            continue;
        }
        let rss = read(pid, "status")
            .ok()
            .and_then(|s| parse_status_rss(&s))
            .unwrap_or(0);
        let entry = groups.entry(cg).or_default();
        entry.0 += rss;
        entry.1.push(pid);
    }
    groups
        .into_values()
        .max_by_key(|(rss, _)| *rss)
        .map(|(_, pids)| pids)
        .unwrap_or_default()
}

/// A cgroup filesystem mounted in some mount namespace, from a `mountinfo` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupMount {
    /// The cgroup mounted there, as a path in the hierarchy (relative to the reader's cgroup
    /// namespace, like the paths in `/proc/<pid>/cgroup`). `/` for the whole hierarchy; the
    /// container's own cgroup where the runtime bind-mounts it or a cgroup namespace roots it.
    pub root: String,
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// `cgroup2` (the unified hierarchy) rather than a v1 `memory` hierarchy.
    pub unified: bool,
}

/// `\040`-style octal escapes of mountinfo paths. Three octal digits above `\377` are no byte
/// (the kernel never writes them) and stay as they are; computing them in a `u8` overflowed
/// (found by cargo-fuzz, cgroup_files).
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let escaped = (b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)))
        .then(|| {
            b[i + 1..i + 4]
                .iter()
                .fold(0u32, |v, c| v * 8 + u32::from(c - b'0'))
        })
        .and_then(|v| u8::try_from(v).ok());
        if let Some(v) = escaped {
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The v1 `memory` and the `cgroup2` mounts in `/proc/<pid>/mountinfo` text; other lines and
/// malformed ones are skipped.
/// Mounts hidden by a later mount on the same point or on a parent (a container runtime's tmpfs
/// over `/sys/fs/cgroup`) are left out: their paths lead somewhere else.
pub fn cgroup_mounts(mountinfo: &str) -> Vec<CgroupMount> {
    let points: Vec<PathBuf> = mountinfo
        .lines()
        .map(|line| PathBuf::from(unescape(line.split(' ').nth(4).unwrap_or(""))))
        .collect();
    mountinfo
        .lines()
        .enumerate()
        .filter(|(i, _)| {
            !points[i + 1..]
                .iter()
                .any(|later| !later.as_os_str().is_empty() && points[*i].starts_with(later))
        })
        .filter_map(|(_, line)| {
            let fields: Vec<&str> = line.split(' ').collect();
            let sep = fields.iter().position(|f| *f == "-")?;
            if sep < 6 {
                return None;
            }
            let fstype = *fields.get(sep + 1)?;
            let options = fields.get(sep + 3).copied().unwrap_or("");
            let unified = match fstype {
                "cgroup2" => true,
                "cgroup" if options.split(',').any(|o| o == "memory") => false,
                _ => return None,
            };
            Some(CgroupMount {
                root: unescape(fields[3]),
                mount_point: PathBuf::from(unescape(fields[4])),
                unified,
            })
        })
        .collect()
}

/// `path` below `root` (both cgroup paths), component-wise: `Some("")` when equal. A path that
/// climbs out of `root` (`/../trainer` under `/`: the kernel writes a cgroup outside the reader's
/// cgroup namespace so) is not below it; joined to the mount point it would name a directory
/// outside the mount (found by fuzzing `cgroup_files`).
fn below<'a>(path: &'a str, root: &str) -> Option<&'a str> {
    let root = root.trim_end_matches('/');
    let rest = path.strip_prefix(root)?;
    if !(rest.is_empty() || rest.starts_with('/') || root.is_empty()) {
        return None;
    }
    let rest = rest.trim_start_matches('/');
    (!super::cgroup::climbs(rest)).then_some(rest)
}

/// Where the cgroup named in `proc_cgroup` (a process's `/proc/<pid>/cgroup`) is visible among
/// `mounts`, as paths relative to that mount namespace's root: the v1 memory hierarchy first,
/// then the unified one. A mount shows the cgroup only when the cgroup lies at or below the
/// mount's root, which is what a container runtime's bind mount or a cgroup namespace changes;
/// the deepest such mount wins.
pub fn locate_cgroup(proc_cgroup: &str, mounts: &[CgroupMount]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for unified in [false, true] {
        let controller = if unified { None } else { Some("memory") };
        let Some(path) = super::cgroup::proc_cgroup_path(proc_cgroup, controller) else {
            continue;
        };
        let best = mounts
            .iter()
            .filter(|m| m.unified == unified)
            .filter_map(|m| below(&path, &m.root).map(|rel| (m, rel)))
            .max_by_key(|(m, _)| m.root.len());
        if let Some((m, rel)) = best {
            found.push(if rel.is_empty() {
                m.mount_point.clone()
            } else {
                m.mount_point.join(rel)
            });
        }
    }
    found
}

/// How the trainer's cgroup was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// Through the trainer's own mount namespace (`/proc/<pid>/root`), as the trainer sees it.
    TrainerMount,
    /// Through the sidecar's own mounts (a host-wide cgroup mount).
    OwnMount,
}

impl View {
    /// Label value for logs and `/metrics`.
    pub fn name(self) -> &'static str {
        match self {
            View::TrainerMount => "trainer-mount",
            View::OwnMount => "own-mount",
        }
    }
}

/// The trainer's own memory cgroup, or why it could not be read (for the log).
pub fn trainer_cgroup(
    proc_root: &Path,
    self_pid: u32,
    pid: u32,
) -> Result<(CgroupSource, View), String> {
    let proc_pid = proc_root.join(pid.to_string());
    let cgroup_text = std::fs::read_to_string(proc_pid.join("cgroup"))
        .map_err(|e| format!("reading /proc/{pid}/cgroup: {e}"))?;
    let mut why = Vec::new();
    let candidates = [
        (View::TrainerMount, proc_pid.clone(), proc_pid.join("root")),
        (
            View::OwnMount,
            proc_root.join(self_pid.to_string()),
            PathBuf::from("/"),
        ),
    ];
    for (view, mount_pid, base) in candidates {
        let Ok(mountinfo) = std::fs::read_to_string(mount_pid.join("mountinfo")) else {
            why.push(format!("{}: no mountinfo", view.name()));
            continue;
        };
        if let Err(e) = std::fs::read_dir(&base) {
            why.push(format!(
                "{}: {} not readable: {e}",
                view.name(),
                base.display()
            ));
            continue;
        }
        let dirs = locate_cgroup(&cgroup_text, &cgroup_mounts(&mountinfo));
        if dirs.is_empty() {
            why.push(format!(
                "{}: the trainer's cgroup is not below any cgroup mount there",
                view.name()
            ));
        }
        for rel in dirs {
            let dir = base.join(rel.strip_prefix("/").unwrap_or(&rel));
            match CgroupSource::detect(dir.clone()) {
                Some(src) => return Ok((src, view)),
                None => why.push(format!(
                    "{}: {} has no memory controller files",
                    view.name(),
                    dir.display()
                )),
            }
        }
    }
    Err(why.join("; "))
}

/// Summed RSS of the trainer's processes against the downward-API limit.
#[derive(Debug, Clone)]
pub struct RssSource {
    proc_root: PathBuf,
    pids: Vec<u32>,
    limit: Option<u64>,
}

impl RssSource {
    /// Watches `pids` under `proc_root`, limited by `limit` when known.
    pub fn new(proc_root: PathBuf, pids: Vec<u32>, limit: Option<u64>) -> Self {
        RssSource {
            proc_root,
            pids,
            limit,
        }
    }
}

impl MemorySource for RssSource {
    fn sample(&mut self) -> Result<Option<MemorySample>, SampleError> {
        let mut total = 0u64;
        let mut alive = Vec::new();
        for &pid in &self.pids {
            let path = self.proc_root.join(pid.to_string()).join("status");
            if let Some(text) = super::read_opt(&path)?
                && let Some(rss) = parse_status_rss(&text)
            {
                total = total.saturating_add(rss);
                alive.push(pid);
            }
        }
        self.pids = alive;
        Ok(Some(MemorySample {
            usage_bytes: Some(total),
            working_set_bytes: Some(total),
            max: self.limit.map(Limit::Bytes),
            populated: Some(!self.pids.is_empty()),
            ..Default::default()
        }))
    }

    fn describe(&self) -> String {
        format!("rss of pids {:?} (limit {:?})", self.pids, self.limit)
    }

    fn info(&self) -> SourceInfo {
        SourceInfo {
            kind: "rss",
            view: "procfs",
            peak: "none",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    const STATUS: &str = "Name:\tpython3\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4242\n\
VmPeak:\t 1234560 kB\nVmSize:\t 1200000 kB\nVmHWM:\t  600000 kB\nVmRSS:\t  524288 kB\n\
RssAnon:\t  500000 kB\nThreads:\t12\n";

    fn proc_entry(root: &Path, pid: u32, comm: &str, cgroup: &str, rss_kb: u64) {
        let d = root.join(pid.to_string());
        fs::create_dir_all(&d).expect("mkdir");
        fs::write(d.join("comm"), format!("{comm}\n")).expect("w");
        fs::write(d.join("cgroup"), cgroup).expect("w");
        fs::write(
            d.join("status"),
            format!("Name:\t{comm}\nVmRSS:\t {rss_kb} kB\n"),
        )
        .expect("w");
    }

    #[test]
    fn parses_vmrss_from_real_status_text() {
        assert_eq!(parse_status_rss(STATUS), Some(524288 * 1024));
        assert_eq!(
            parse_status_rss("Name:\tkthreadd\n"),
            None,
            "kernel threads have none"
        );
    }

    #[test]
    fn the_pods_infra_process_is_never_the_trainer_even_when_it_is_all_there_is() {
        // Between two in-place restarts of the trainer, podman's infra process (PID 1,
        // `catatonit`, with the most RSS left) was taken for the trainer.
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        proc_entry(root, 1, "catatonit", "0::/pod/infra\n", 900);
        proc_entry(root, 7, "memguard-sidecar", "0::/pod/sidecar\n", 5000);
        assert!(
            find_trainer(root, 7).is_empty(),
            "PID 1 is the infra process"
        );
        proc_entry(root, 3, "pause", "0::/pod/infra2\n", 900);
        assert!(find_trainer(root, 7).is_empty(), "pause, wherever it runs");
        proc_entry(root, 40, "python3", "0::/pod/trainer\n", 100);
        assert_eq!(find_trainer(root, 7), vec![40]);
    }

    #[test]
    fn finds_the_biggest_foreign_group_and_sums_its_rss() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        proc_entry(root, 1, "pause", "0::/pod/pause\n", 400);
        proc_entry(root, 7, "memguard-sidecar", "0::/pod/sidecar\n", 5000);
        proc_entry(root, 20, "python3", "0::/pod/trainer\n", 900_000);
        proc_entry(root, 21, "python3", "0::/pod/trainer\n", 100_000);
        proc_entry(root, 30, "sh", "0::/pod/logger\n", 2000);
        let mut found = find_trainer(root, 7);
        found.sort();
        assert_eq!(found, vec![20, 21]);
        let mut src = RssSource::new(root.to_path_buf(), found, Some(2 << 30));
        let s = src.sample().expect("ok").expect("some");
        assert_eq!(s.working_set_bytes, Some(1_000_000 * 1024));
        assert_eq!(s.populated, Some(true));
        fs::remove_dir_all(root.join("20")).expect("rm");
        fs::remove_dir_all(root.join("21")).expect("rm");
        let s = src.sample().expect("ok").expect("some");
        assert_eq!(s.populated, Some(false), "trainer gone");
    }

    /// A containerd v1 container: the memory hierarchy bind-mounted at its own cgroup (read-only),
    /// a v2 container in a cgroup namespace, and a host with the whole hierarchies mounted.
    const CONTAINERD_V1: &str = "\
1203 1190 0:101 / / ro,relatime master:312 - overlay overlay rw,lowerdir=/l,upperdir=/u
1211 1203 0:105 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - tmpfs tmpfs rw,mode=755
1215 1211 0:30 /kubepods/burstable/pod7f/3b1f /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime master:14 - cgroup cgroup rw,memory
1216 1211 0:31 /kubepods/burstable/pod7f/3b1f /sys/fs/cgroup/cpu,cpuacct ro,nosuid,nodev,noexec,relatime master:15 - cgroup cgroup rw,cpu,cpuacct
";
    const CGROUPNS_V2: &str = "\
1300 1290 0:120 / / rw,relatime - overlay overlay rw
1310 1300 0:27 / /sys/fs/cgroup ro,nosuid,nodev,noexec,relatime - cgroup2 cgroup rw,nsdelegate
";
    const HOST: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn reads_the_cgroup_mounts_of_a_mount_namespace() {
        let m = cgroup_mounts(CONTAINERD_V1);
        assert_eq!(
            m,
            vec![CgroupMount {
                root: "/kubepods/burstable/pod7f/3b1f".into(),
                mount_point: "/sys/fs/cgroup/memory".into(),
                unified: false,
            }],
            "only the memory hierarchy of v1"
        );
        assert_eq!(cgroup_mounts(CGROUPNS_V2)[0].root, "/");
        assert!(cgroup_mounts(CGROUPNS_V2)[0].unified);
        assert_eq!(cgroup_mounts(HOST).len(), 2);
        let shadowed = format!("{HOST}50 31 0:60 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n");
        assert!(
            cgroup_mounts(&shadowed).is_empty(),
            "a tmpfs mounted over /sys/fs/cgroup later hides the host's hierarchies"
        );
        assert!(cgroup_mounts("garbage\n1 2 3\n - cgroup2\n").is_empty());
        let spaced = "9 1 0:5 /a\\040b /mnt/x\\040y rw - cgroup2 none rw\n";
        assert_eq!(cgroup_mounts(spaced)[0].root, "/a b");
        // Regression (cargo-fuzz, cgroup_files): `\777` overflowed a u8; it is no escape.
        let odd = "9 1 0:5 /a\\777\\377\\134 /mnt rw - cgroup2 none rw\n";
        assert_eq!(cgroup_mounts(odd)[0].root, "/a\\777\u{fffd}\\");
        assert_eq!(
            cgroup_mounts(spaced)[0].mount_point,
            PathBuf::from("/mnt/x y")
        );
    }

    #[test]
    fn locates_the_trainer_cgroup_where_the_mount_shows_it_and_not_the_hierarchy_root() {
        let v1 = "4:memory:/kubepods/burstable/pod7f/3b1f\n0::/\n";
        assert_eq!(
            locate_cgroup(v1, &cgroup_mounts(CONTAINERD_V1)),
            vec![PathBuf::from("/sys/fs/cgroup/memory")],
            "containerd mounts the container's own cgroup"
        );
        assert_eq!(
            locate_cgroup(v1, &cgroup_mounts(HOST)),
            vec![
                PathBuf::from("/sys/fs/cgroup/memory/kubepods/burstable/pod7f/3b1f"),
                PathBuf::from("/sys/fs/cgroup/unified"),
            ],
            "a host-wide mount: the cgroup below it, not the root of the hierarchy"
        );
        let sibling = "4:memory:/kubepods/burstable/pod7f/99aa\n";
        assert!(
            locate_cgroup(sibling, &cgroup_mounts(CONTAINERD_V1)).is_empty(),
            "another container's mount does not show this cgroup"
        );
        let prefix_only = "4:memory:/kubepods/burstable/pod7f/3b1f0\n";
        assert!(locate_cgroup(prefix_only, &cgroup_mounts(CONTAINERD_V1)).is_empty());
        // In another cgroup namespace both paths are relative to the reader's root.
        let ns = "0::/../trainer\n";
        let mut mounts = cgroup_mounts(CGROUPNS_V2);
        mounts[0].root = "/../trainer".into();
        assert_eq!(
            locate_cgroup(ns, &mounts),
            vec![PathBuf::from("/sys/fs/cgroup")]
        );
    }

    #[test]
    fn a_cgroup_outside_the_mounts_root_is_not_located_outside_the_mount() {
        // Regression (cargo-fuzz, cgroup_files): under a mount of the whole hierarchy, or of a
        // subtree, a path that climbs out with `..` used to be joined to the mount point,
        // naming `/sys/fs/cgroup/../trainer`.
        let mut mounts = cgroup_mounts(CGROUPNS_V2);
        mounts[0].root = "/".into();
        for outside in [
            "0::/../trainer\n",
            "0::/kubepods/../../trainer\n",
            "0::/..\n",
        ] {
            assert!(
                locate_cgroup(outside, &mounts).is_empty(),
                "{outside:?} located under {mounts:?}"
            );
        }
        mounts[0].root = "/kubepods".into();
        assert!(locate_cgroup("0::/kubepods/../etc\n", &mounts).is_empty());
        assert_eq!(
            locate_cgroup("0::/kubepods/pod1/..scope\n", &mounts),
            vec![PathBuf::from("/sys/fs/cgroup/pod1/..scope")],
            "a name that merely starts with two dots is a cgroup like any other"
        );
    }

    #[test]
    fn reads_the_cgroup_through_the_sidecars_own_mounts_when_they_show_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let proc = dir.path().join("proc");
        let hier = dir.path().join("memory");
        let cg = hier.join("pod/trainer");
        fs::create_dir_all(&cg).expect("mkdir");
        fs::write(cg.join("memory.usage_in_bytes"), "4096\n").expect("w");
        fs::write(hier.join("memory.usage_in_bytes"), "999999\n").expect("w");
        proc_entry(&proc, 7, "memguard-sidecar", "4:memory:/pod/sidecar\n", 1);
        proc_entry(&proc, 9, "python3", "4:memory:/pod/trainer\n", 1);
        let err = trainer_cgroup(&proc, 7, 9).expect_err("no mountinfo anywhere");
        assert!(err.contains("trainer-mount: no mountinfo"), "{err}");
        let line = format!(
            "35 31 0:32 / {} rw,relatime - cgroup cgroup rw,memory\n",
            hier.display()
        );
        fs::write(proc.join("7/mountinfo"), line).expect("w");
        let (mut src, view) = trainer_cgroup(&proc, 7, 9).expect("own view");
        assert_eq!(view, View::OwnMount);
        assert_eq!(src.dir(), cg.as_path());
        let s = src.sample().expect("ok").expect("some");
        assert_eq!(s.usage_bytes, Some(4096), "the trainer's, not the root's");
    }

    #[test]
    fn nothing_else_visible_means_no_trainer() {
        let dir = tempfile::tempdir().expect("tempdir");
        proc_entry(dir.path(), 7, "memguard-sidecar", "0::/a\n", 1);
        assert!(find_trainer(dir.path(), 7).is_empty());
        assert!(find_trainer(dir.path(), 99).is_empty());
    }
}
