//! Samplers. Each parses from `&str` (so tests feed real file text) and reports what it does not
//! know as `None`, never as a silent 0.

pub mod cgroup;
pub mod discover;
pub mod dmem;
pub mod gpu;
pub mod procfs;
pub mod psi;
pub mod reported;

use std::io;
use std::path::{Path, PathBuf};

/// A cgroup limit: a number of bytes, or no limit at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// Limited to this many bytes.
    Bytes(u64),
    /// `max` (v2) or the v1 "unlimited" page-counter maximum.
    Unlimited,
}

impl Limit {
    /// The byte value when limited.
    pub fn bytes(self) -> Option<u64> {
        match self {
            Limit::Bytes(b) => Some(b),
            Limit::Unlimited => None,
        }
    }
}

/// Counters from `memory.events` (v2) or `memory.failcnt`/`memory.oom_control` (v1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryEvents {
    /// Times usage went over memory.high (v2).
    pub high: Option<u64>,
    /// Times usage hit memory.max (v2) or the v1 `failcnt`.
    pub max: Option<u64>,
    /// OOM situations (v2 `oom`; v1 `under_oom` is a state, not a count).
    pub oom: Option<u64>,
    /// Processes killed by the OOM killer (v2 `oom_kill`; v1 `oom_kill`, kernel ≥ 4.13).
    pub oom_kill: Option<u64>,
}

/// One memory sample of the trainer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemorySample {
    /// Usage including page cache (`memory.current` / `memory.usage_in_bytes`, or summed RSS).
    pub usage_bytes: Option<u64>,
    /// Usage − inactive file, as the kubelet computes it.
    pub working_set_bytes: Option<u64>,
    /// `memory.high` (v2 only).
    pub high: Option<Limit>,
    /// `memory.max` / `memory.limit_in_bytes` (or the downward-API limit in the RSS fallback).
    pub max: Option<Limit>,
    /// The highest usage the kernel recorded while we watched (`memory.peak`, v2 kernel ≥ 5.19;
    /// `memory.max_usage_in_bytes`, v1).
    pub peak_bytes: Option<u64>,
    /// The peak usage since the previous sample minus the inactive file cache, when known: a
    /// spike between two samples (see docs/sidecar.md, "Peaks between samples").
    pub interval_peak_working_set_bytes: Option<u64>,
    /// Event counters.
    pub events: MemoryEvents,
    /// Whether the cgroup holds processes; `None` when that is not known.
    pub populated: Option<bool>,
}

impl MemorySample {
    /// The limit pressure is measured against: memory.high when set, else memory.max.
    pub fn effective_limit(&self) -> Option<u64> {
        self.high
            .and_then(Limit::bytes)
            .or_else(|| self.max.and_then(Limit::bytes))
    }

    /// Working set / effective limit, when both are known; a higher peak since the previous
    /// sample counts, so a spike between two samples is not missed.
    pub fn ratio(&self) -> Option<f64> {
        let ws = self
            .working_set_bytes?
            .max(self.interval_peak_working_set_bytes.unwrap_or(0));
        let limit = self.effective_limit().filter(|&l| l > 0)?;
        Some(ws as f64 / limit as f64)
    }
}

/// A sampler failure (counted and logged; never fatal).
#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    /// A file exists but could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A file held something unexpected.
    #[error("parsing {path}: {what}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        what: String,
    },
}

impl SampleError {
    /// Short label for the `memguard_sidecar_sample_errors_total` counter.
    pub fn metric_label(&self) -> &'static str {
        match self {
            SampleError::Read { .. } => "read",
            SampleError::Parse { .. } => "parse",
        }
    }
}

/// Which view of the trainer's memory a source has, for the log and `/metrics`
/// (`memguard_sidecar_source_info{kind, view}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceInfo {
    /// `cgroup-v1`, `cgroup-v2`, `rss` (summed RSS: no events, no PSI, no page cache), or
    /// `none` (nothing found yet).
    pub kind: &'static str,
    /// How it was reached: `flag` (`--cgroup`), `trainer-mount` (the trainer's mount namespace),
    /// `own-mount` (the sidecar's), `procfs` (RSS), `none`.
    pub view: &'static str,
    /// The peak between two samples: `reset` (exact), `all-time` (new highs only), `none`.
    pub peak: &'static str,
}

impl SourceInfo {
    /// Nothing found yet.
    pub const NONE: SourceInfo = SourceInfo {
        kind: "none",
        view: "none",
        peak: "none",
    };
}

/// Where the trainer's memory figures come from.
pub trait MemorySource: Send {
    /// One sample. `Ok(None)`: the source is gone (the cgroup was removed).
    fn sample(&mut self) -> Result<Option<MemorySample>, SampleError>;
    /// A word for logs (`cgroup-v1 /sys/fs/cgroup/memory/x`).
    fn describe(&self) -> String;
    /// Which view this is.
    fn info(&self) -> SourceInfo {
        SourceInfo::NONE
    }
    /// The cgroup directory read, once known (for kernel event sources and PSI).
    fn cgroup_dir(&self) -> Option<&Path> {
        None
    }
    /// Which cgroup the OOM-kill counter belongs to (its directory's inode): a cgroup created
    /// again under the same name (a container restarted in place) has a new one.
    fn cgroup_identity(&self) -> Option<u64> {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(self.cgroup_dir()?).ok().map(|m| m.ino())
    }
    /// The trainer left (its cgroup emptied or vanished): look for it again from now on, as a
    /// restarted trainer (`restartPolicy: OnFailure`) gets a new process and a new cgroup.
    fn forget(&mut self) {}
    /// A pidfd of the trainer's main process, once, to wake the loop the moment it exits: its
    /// cgroup's counters are read before the runtime removes the cgroup.
    fn take_exit_watch(&mut self) -> Option<std::os::fd::OwnedFd> {
        None
    }
}

/// Reads a file; absent (or a vanished cgroup: ENODEV) is `Ok(None)`.
pub fn read_opt(path: &Path) -> Result<Option<String>, SampleError> {
    match std::fs::read_to_string(path) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) if e.raw_os_error() == Some(19) => Ok(None), // ENODEV: cgroup being removed
        Err(source) => Err(SampleError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn effective_limit_prefers_high_then_max() {
        let mut s = MemorySample {
            working_set_bytes: Some(50),
            high: Some(Limit::Unlimited),
            max: Some(Limit::Bytes(200)),
            ..Default::default()
        };
        assert_eq!(s.effective_limit(), Some(200));
        assert_eq!(s.ratio(), Some(0.25));
        s.high = Some(Limit::Bytes(100));
        assert_eq!(s.ratio(), Some(0.5));
        s.high = None;
        s.max = Some(Limit::Unlimited);
        assert_eq!(s.ratio(), None, "no limit: no ratio");
    }

    #[test]
    fn absent_file_is_not_known() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(matches!(read_opt(&dir.path().join("nope")), Ok(None)));
    }
}
