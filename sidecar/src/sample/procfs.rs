//! Finding the trainer through the shared process namespace, and the summed-RSS fallback.
//!
//! With `shareProcessNamespace: true` the sidecar sees the trainer's processes. Their cgroup
//! differs from ours; the pause process (`comm` = `pause`) is left out. The trainer's own cgroup
//! is readable at `/proc/<pid>/root/sys/fs/cgroup` (its mount namespace, rooted at its cgroup).
//! When that cannot be read, the trainer's RSS is summed and compared with the limit passed by
//! the downward API.

use super::cgroup::{CgroupSource, Layout};
use super::{Limit, MemorySample, MemorySource, SampleError};
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

/// The trainer's processes: those outside our cgroup, not the pause process, grouped by cgroup;
/// the group with the largest RSS wins. Empty when nothing else is visible.
pub fn find_trainer(proc_root: &Path, self_pid: u32) -> Vec<u32> {
    let read = |pid: u32, f: &str| std::fs::read_to_string(proc_root.join(pid.to_string()).join(f));
    let Ok(ours) = read(self_pid, "cgroup") else {
        return Vec::new();
    };
    let mut groups: BTreeMap<String, (u64, Vec<u32>)> = BTreeMap::new();
    for pid in pids(proc_root) {
        if pid == self_pid {
            continue;
        }
        let (Ok(cg), Ok(comm)) = (read(pid, "cgroup"), read(pid, "comm")) else {
            continue;
        };
        if cg == ours || comm.trim() == "pause" {
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

/// The trainer's own cgroup as seen through its mount namespace, when readable.
pub fn trainer_cgroup(proc_root: &Path, pid: u32) -> Option<CgroupSource> {
    let root = proc_root.join(pid.to_string()).join("root/sys/fs/cgroup");
    let dir = match Layout::detect(&root)? {
        Layout::Unified => root,
        Layout::Legacy | Layout::Hybrid => root.join("memory"),
    };
    CgroupSource::detect(dir)
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

    #[test]
    fn nothing_else_visible_means_no_trainer() {
        let dir = tempfile::tempdir().expect("tempdir");
        proc_entry(dir.path(), 7, "memguard-sidecar", "0::/a\n", 1);
        assert!(find_trainer(dir.path(), 7).is_empty());
        assert!(find_trainer(dir.path(), 99).is_empty());
    }
}
