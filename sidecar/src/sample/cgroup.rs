//! cgroup v1 and v2 memory, read straight from the files (see docs/sidecar.md for why not
//! cgroups-rs: it maps missing files to 0 and pulls in a D-Bus stack for systemd).

use super::{Limit, MemoryEvents, MemorySample, MemorySource, SampleError, SourceInfo, read_opt};
use std::path::{Path, PathBuf};

/// Values at or above this in a v1 limit file mean "unlimited" (the kernel prints
/// `PAGE_COUNTER_MAX * PAGE_SIZE`, e.g. 9223372036854771712).
const V1_UNLIMITED: u64 = 1 << 62;

/// Which interface a cgroup directory speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Legacy memory controller (`memory.usage_in_bytes`).
    V1,
    /// Unified hierarchy (`memory.current`).
    V2,
}

impl Mode {
    /// Detects the mode from the files present; `None`: not a memory cgroup directory.
    pub fn detect(dir: &Path) -> Option<Mode> {
        if dir.join("memory.current").exists() {
            Some(Mode::V2)
        } else if dir.join("memory.usage_in_bytes").exists() {
            Some(Mode::V1)
        } else {
            None
        }
    }

    /// Short name (`v1`, `v2`).
    pub fn name(self) -> &'static str {
        match self {
            Mode::V1 => "v1",
            Mode::V2 => "v2",
        }
    }
}

/// How the cgroup hierarchies of a host are mounted under a root such as `/sys/fs/cgroup`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Only cgroup v2 at the root (`cgroup.controllers` there).
    Unified,
    /// Only v1 controllers (`memory/`, no `unified/`).
    Legacy,
    /// v1 controllers plus a v2 mount at `unified/` (systemd's hybrid mode): memory is v1.
    Hybrid,
}

impl Layout {
    /// Detects the layout from what is present under `root`.
    pub fn detect(root: &Path) -> Option<Layout> {
        let v1_memory = root.join("memory").join("memory.usage_in_bytes").exists();
        if v1_memory {
            if root.join("unified").join("cgroup.controllers").exists() {
                Some(Layout::Hybrid)
            } else {
                Some(Layout::Legacy)
            }
        } else if root.join("cgroup.controllers").exists() {
            Some(Layout::Unified)
        } else {
            None
        }
    }

    /// The memory cgroup directory of a process, from its `/proc/<pid>/cgroup` text; `None` for
    /// a cgroup outside the reader's cgroup namespace (`/../…`), which `root` does not show.
    pub fn memory_dir(self, root: &Path, proc_cgroup: &str) -> Option<PathBuf> {
        let (base, rel) = match self {
            Layout::Unified => (root.to_path_buf(), proc_cgroup_path(proc_cgroup, None)?),
            Layout::Legacy | Layout::Hybrid => (
                root.join("memory"),
                proc_cgroup_path(proc_cgroup, Some("memory"))?,
            ),
        };
        let rel = rel.trim_start_matches('/');
        (!climbs(rel)).then(|| base.join(rel))
    }
}

/// Whether a cgroup path has a `..` component: the kernel writes the path of a cgroup outside
/// the reader's cgroup namespace relative to the namespace's root, climbing out of it.
pub fn climbs(path: &str) -> bool {
    path.split('/').any(|c| c == "..")
}

/// The path of `controller` (v1) or of the unified hierarchy (`None`: the `0::` line) in
/// `/proc/<pid>/cgroup` text.
pub fn proc_cgroup_path(text: &str, controller: Option<&str>) -> Option<String> {
    text.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let id = parts.next()?;
        let controllers = parts.next()?;
        let path = parts.next()?;
        let hit = match controller {
            None => id == "0" && controllers.is_empty(),
            Some(c) => controllers.split(',').any(|x| x == c),
        };
        hit.then(|| path.to_string())
    })
}

/// A single number (`memory.current`, `memory.usage_in_bytes`).
pub fn parse_u64(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// A v2 limit: `max` or bytes.
pub fn parse_v2_limit(text: &str) -> Option<Limit> {
    match text.trim() {
        "max" => Some(Limit::Unlimited),
        s => s.parse().ok().map(Limit::Bytes),
    }
}

/// A v1 limit: bytes, where the page-counter maximum means unlimited.
pub fn parse_v1_limit(text: &str) -> Option<Limit> {
    let n: u64 = text.trim().parse().ok()?;
    Some(if n >= V1_UNLIMITED {
        Limit::Unlimited
    } else {
        Limit::Bytes(n)
    })
}

/// The value of `key` in a flat-keyed file (`memory.stat`, `memory.events`, `oom_control`).
pub fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(char::is_whitespace)?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Usage − inactive file, as the kubelet computes the working set (0 when inactive ≥ usage).
/// Without the stat figure the usage itself is the (conservative) working set.
pub fn working_set(usage: u64, inactive_file: Option<u64>) -> u64 {
    usage.saturating_sub(inactive_file.unwrap_or(0))
}

/// `statfs` magic numbers: resets are only ever written to the kernel's files, never to a copy.
const CGROUP_SUPER_MAGIC: u64 = 0x0027_e0eb;
const CGROUP2_SUPER_MAGIC: u64 = 0x6367_7270;

fn on_cgroupfs(path: &Path) -> bool {
    rustix::fs::statfs(path).is_ok_and(|s| {
        let magic = s.f_type as u64;
        magic == CGROUP_SUPER_MAGIC || magic == CGROUP2_SUPER_MAGIC
    })
}

/// How the peak between two samples is read (see docs/sidecar.md, "Peaks between samples").
#[derive(Debug)]
enum PeakReader {
    /// Not tried yet.
    Untried,
    /// v1 `memory.max_usage_in_bytes`, reset to the current usage by writing 0 after each read.
    V1Reset,
    /// v2 `memory.peak` through our own file descriptor, reset per descriptor (kernel ≥ 6.12).
    V2Fd(std::fs::File),
    /// No reset: the kernel's all-time peak, which is the interval's peak when it moved.
    AllTime,
}

/// Which peak reading is in use, for the log and `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeakKind {
    /// Reset after every sample: the exact peak between two samples.
    Reset,
    /// The all-time peak: only new highs are seen between samples.
    AllTime,
    /// No peak file: only the instant.
    None,
}

/// Reads a cgroup v1 or v2 memory directory.
#[derive(Debug)]
pub struct CgroupSource {
    dir: PathBuf,
    mode: Mode,
    peak: PeakReader,
    /// The last all-time peak read (new-high detection without a reset).
    last_all_time: Option<u64>,
    /// The highest peak seen since we started (the kernel's is reset under us).
    highest: Option<u64>,
    /// Whether the last sample found a peak file.
    peak_seen: bool,
    /// May reset v1 `memory.max_usage_in_bytes` (`--reset-v1-peak`): a global side effect.
    reset_v1: bool,
}

impl CgroupSource {
    /// A source for `dir`, whose mode was detected or given.
    pub fn new(dir: PathBuf, mode: Mode) -> Self {
        CgroupSource {
            dir,
            mode,
            peak: PeakReader::Untried,
            last_all_time: None,
            highest: None,
            peak_seen: false,
            reset_v1: false,
        }
    }

    /// Allows the v1 peak reset (`--reset-v1-peak`). v2's reset is per file descriptor and
    /// touches no one else's reading, so it needs no permission.
    pub fn with_v1_reset(mut self, on: bool) -> Self {
        self.reset_v1 = on;
        self
    }

    /// Detects the mode of `dir`; `None` when it is not a memory cgroup.
    pub fn detect(dir: PathBuf) -> Option<Self> {
        Mode::detect(&dir).map(|mode| CgroupSource::new(dir, mode))
    }

    /// Which peak reading is in use (known after the first sample).
    pub fn peak_kind(&self) -> PeakKind {
        match self.peak {
            PeakReader::V1Reset | PeakReader::V2Fd(_) => PeakKind::Reset,
            PeakReader::AllTime if self.peak_seen => PeakKind::AllTime,
            _ => PeakKind::None,
        }
    }

    /// Chooses the reader on first use: a reset where the kernel and the mount allow it.
    fn open_peak(&mut self) {
        if !matches!(self.peak, PeakReader::Untried) {
            return;
        }
        self.peak = PeakReader::AllTime;
        match self.mode {
            Mode::V1 if !self.reset_v1 => {}
            Mode::V1 => {
                let file = self.dir.join("memory.max_usage_in_bytes");
                if on_cgroupfs(&file) && std::fs::write(&file, "0").is_ok() {
                    self.peak = PeakReader::V1Reset;
                }
            }
            Mode::V2 => {
                use std::io::Write;
                let file = self.dir.join("memory.peak");
                if !on_cgroupfs(&file) {
                    return;
                }
                // Before 6.12 memory.peak is read-only (the open or the write fails).
                if let Ok(mut fd) = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(&file)
                    && fd.write_all(b"reset\n").is_ok()
                {
                    self.peak = PeakReader::V2Fd(fd);
                }
            }
        }
        tracing::info!(dir = %self.dir.display(), peak = ?self.peak_kind_name(), "peak between samples");
    }

    fn peak_kind_name(&self) -> &'static str {
        match self.peak {
            PeakReader::V1Reset => "max_usage_in_bytes, reset after each sample",
            PeakReader::V2Fd(_) => "memory.peak, reset per file descriptor",
            _ => "all-time peak only (no reset here): new highs between samples are seen",
        }
    }

    /// The usage peak since the previous sample, when it can be known, and the all-time peak.
    fn interval_peak(&mut self) -> Result<(Option<u64>, Option<u64>), SampleError> {
        self.open_peak();
        let (interval, all_time) = match &mut self.peak {
            PeakReader::V1Reset => {
                let file = self.dir.join("memory.max_usage_in_bytes");
                let peak = read_opt(&file)?.as_deref().and_then(parse_u64);
                if std::fs::write(&file, "0").is_err() {
                    self.peak = PeakReader::AllTime;
                }
                (peak, None)
            }
            PeakReader::V2Fd(fd) => {
                use std::io::{Read, Seek, SeekFrom, Write};
                let mut text = String::new();
                let read = fd
                    .seek(SeekFrom::Start(0))
                    .and_then(|_| fd.read_to_string(&mut text));
                let peak = read.ok().and_then(|_| parse_u64(&text));
                if peak.is_none() || fd.write_all(b"reset\n").is_err() {
                    self.peak = PeakReader::AllTime;
                }
                (peak, None)
            }
            PeakReader::AllTime | PeakReader::Untried => {
                let name = match self.mode {
                    Mode::V1 => "memory.max_usage_in_bytes",
                    Mode::V2 => "memory.peak",
                };
                let all = self.read(name)?.as_deref().and_then(parse_u64);
                // A new all-time high was reached since the last sample: that high is the
                // interval's peak. Otherwise the interval's peak is not known (it was lower).
                let moved = match (all, self.last_all_time) {
                    (Some(now), Some(before)) if now > before => Some(now),
                    _ => None,
                };
                self.last_all_time = all.or(self.last_all_time);
                (moved, all)
            }
        };
        self.peak_seen = interval.is_some() || all_time.is_some();
        let top = interval.max(all_time);
        if let Some(t) = top {
            self.highest = Some(self.highest.map_or(t, |h| h.max(t)));
        }
        Ok((interval, self.highest))
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    fn read(&self, name: &str) -> Result<Option<String>, SampleError> {
        read_opt(&self.dir.join(name))
    }

    fn sample_v2(&mut self) -> Result<Option<MemorySample>, SampleError> {
        let Some(current) = self.read("memory.current")? else {
            return Ok(None);
        };
        let (interval, peak_bytes) = self.interval_peak()?;
        let usage = parse_u64(&current).ok_or_else(|| SampleError::Parse {
            path: self.dir.join("memory.current"),
            what: format!("{:?} is not a number", current.trim()),
        })?;
        let stat = self.read("memory.stat")?;
        let inactive = stat.as_deref().and_then(|s| keyed(s, "inactive_file"));
        let events = self.read("memory.events")?;
        let ev = events.as_deref();
        let populated = self
            .read("cgroup.events")?
            .as_deref()
            .and_then(|s| keyed(s, "populated"))
            .map(|n| n != 0);
        Ok(Some(MemorySample {
            usage_bytes: Some(usage),
            working_set_bytes: Some(working_set(usage, inactive)),
            high: self
                .read("memory.high")?
                .as_deref()
                .and_then(parse_v2_limit),
            max: self.read("memory.max")?.as_deref().and_then(parse_v2_limit),
            peak_bytes,
            interval_peak_working_set_bytes: interval.map(|p| working_set(p, inactive)),
            events: MemoryEvents {
                high: ev.and_then(|s| keyed(s, "high")),
                max: ev.and_then(|s| keyed(s, "max")),
                oom: ev.and_then(|s| keyed(s, "oom")),
                oom_kill: ev.and_then(|s| keyed(s, "oom_kill")),
            },
            populated,
        }))
    }

    fn sample_v1(&mut self) -> Result<Option<MemorySample>, SampleError> {
        let Some(text) = self.read("memory.usage_in_bytes")? else {
            return Ok(None);
        };
        let (interval, peak_bytes) = self.interval_peak()?;
        let usage = parse_u64(&text).ok_or_else(|| SampleError::Parse {
            path: self.dir.join("memory.usage_in_bytes"),
            what: format!("{:?} is not a number", text.trim()),
        })?;
        let stat = self.read("memory.stat")?;
        let inactive = stat
            .as_deref()
            .and_then(|s| keyed(s, "total_inactive_file"));
        let oom = self.read("memory.oom_control")?;
        let populated = self
            .read("cgroup.procs")?
            .map(|s| s.lines().any(|l| !l.trim().is_empty()));
        Ok(Some(MemorySample {
            usage_bytes: Some(usage),
            working_set_bytes: Some(working_set(usage, inactive)),
            high: None,
            max: self
                .read("memory.limit_in_bytes")?
                .as_deref()
                .and_then(parse_v1_limit),
            peak_bytes,
            interval_peak_working_set_bytes: interval.map(|p| working_set(p, inactive)),
            events: MemoryEvents {
                high: None,
                max: self.read("memory.failcnt")?.as_deref().and_then(parse_u64),
                oom: None,
                oom_kill: oom.as_deref().and_then(|s| keyed(s, "oom_kill")),
            },
            populated,
        }))
    }
}

impl MemorySource for CgroupSource {
    fn sample(&mut self) -> Result<Option<MemorySample>, SampleError> {
        match self.mode {
            Mode::V1 => self.sample_v1(),
            Mode::V2 => self.sample_v2(),
        }
    }

    fn describe(&self) -> String {
        format!("cgroup-{} {}", self.mode.name(), self.dir.display())
    }

    fn info(&self) -> SourceInfo {
        SourceInfo {
            kind: match self.mode {
                Mode::V1 => "cgroup-v1",
                Mode::V2 => "cgroup-v2",
            },
            view: "flag",
            peak: match self.peak_kind() {
                PeakKind::Reset => "reset",
                PeakKind::AllTime => "all-time",
                PeakKind::None => "none",
            },
        }
    }

    fn cgroup_dir(&self) -> Option<&Path> {
        Some(&self.dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    const V1_STAT: &str = include_str!("../../fixtures/v1/memory.stat");
    const V2_STAT: &str = include_str!("../../fixtures/v2/memory.stat");

    fn fixture_tree(kind: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("tempdir");
        let src = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures")
            .join(kind);
        for entry in fs::read_dir(src).expect("fixtures") {
            let entry = entry.expect("entry");
            fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("copy");
        }
        dir
    }

    #[test]
    fn parses_limits_of_both_versions() {
        assert_eq!(parse_v2_limit("max\n"), Some(Limit::Unlimited));
        assert_eq!(
            parse_v2_limit("2147483648\n"),
            Some(Limit::Bytes(2147483648))
        );
        assert_eq!(parse_v2_limit("lots"), None);
        assert_eq!(
            parse_v1_limit("9223372036854771712\n"),
            Some(Limit::Unlimited)
        );
        assert_eq!(parse_v1_limit("268435456\n"), Some(Limit::Bytes(268435456)));
        assert_eq!(parse_v1_limit(""), None);
    }

    #[test]
    fn reads_keys_from_real_stat_files() {
        assert_eq!(keyed(V1_STAT, "total_inactive_file"), Some(1015808));
        assert_eq!(keyed(V1_STAT, "inactive_file").map(|_| ()), Some(()));
        assert_eq!(keyed(V2_STAT, "inactive_file"), Some(150994944));
        assert_eq!(keyed(V2_STAT, "anon"), Some(1701289984));
        assert_eq!(keyed(V2_STAT, "no_such_key"), None);
        let events = include_str!("../../fixtures/v2/memory.events");
        assert_eq!(keyed(events, "oom_kill"), Some(1));
        assert_eq!(keyed(events, "max"), Some(17));
    }

    #[test]
    fn working_set_is_usage_minus_inactive_file() {
        assert_eq!(working_set(100, Some(30)), 70);
        assert_eq!(working_set(100, Some(300)), 0);
        assert_eq!(working_set(100, None), 100);
    }

    #[test]
    fn samples_a_real_v1_directory_copy() {
        let dir = fixture_tree("v1");
        let mut src = CgroupSource::detect(dir.path().to_path_buf()).expect("v1 detected");
        assert_eq!(src.mode(), Mode::V1);
        let s = src.sample().expect("reads").expect("present");
        assert_eq!(s.usage_bytes, Some(75874304));
        assert_eq!(s.working_set_bytes, Some(75874304 - 1015808));
        assert_eq!(s.max, Some(Limit::Bytes(268435456)));
        assert_eq!(s.high, None);
        assert_eq!(s.events.oom_kill, Some(0));
        assert_eq!(
            s.events.high, None,
            "v1 has no memory.high: not known, not 0"
        );
        assert_eq!(s.populated, None, "no cgroup.procs in the copy");
        let ratio = s.ratio().expect("known");
        assert!((ratio - 0.2788).abs() < 0.001, "{ratio}");
    }

    #[test]
    fn samples_a_v2_directory_and_keeps_absent_files_unknown() {
        let dir = fixture_tree("v2");
        let mut src = CgroupSource::detect(dir.path().to_path_buf()).expect("v2 detected");
        assert_eq!(src.mode(), Mode::V2);
        let s = src.sample().expect("reads").expect("present");
        assert_eq!(s.usage_bytes, Some(1932963840));
        assert_eq!(s.working_set_bytes, Some(1932963840 - 150994944));
        assert_eq!(s.high, Some(Limit::Unlimited));
        assert_eq!(s.effective_limit(), Some(2147483648));
        assert_eq!(s.peak_bytes, Some(2013265920));
        assert_eq!(s.events.oom, Some(2));
        assert_eq!(s.populated, Some(true));
        // kernel < 5.19: no memory.peak.
        fs::remove_file(dir.path().join("memory.peak")).expect("rm");
        fs::write(dir.path().join("memory.high"), "1073741824\n").expect("write");
        let s = src.sample().expect("reads").expect("present");
        assert_eq!(s.peak_bytes, Some(2013265920), "the highest seen is kept");
        assert_eq!(src.info().peak, "none", "no peak file any more");
        assert_eq!(
            s.effective_limit(),
            Some(1073741824),
            "memory.high wins when set"
        );
    }

    #[test]
    fn a_new_all_time_peak_is_the_peak_between_two_samples() {
        let dir = fixture_tree("v1");
        let mut src = CgroupSource::detect(dir.path().to_path_buf()).expect("v1");
        let limit = 268435456u64;
        let put = |peak: u64| {
            fs::write(
                dir.path().join("memory.max_usage_in_bytes"),
                peak.to_string(),
            )
            .expect("w")
        };
        put(100 << 20);
        let s = src.sample().expect("ok").expect("some");
        assert_eq!(
            s.interval_peak_working_set_bytes, None,
            "nothing to compare yet"
        );
        assert_eq!(src.info().peak, "all-time", "a copy is never reset");
        // A spike to 240 MiB between two samples: the all-time peak moved, so it is this
        // interval's peak; the instant usage (72 MiB) would have missed it.
        put(240 << 20);
        let s = src.sample().expect("ok").expect("some");
        assert_eq!(
            s.interval_peak_working_set_bytes,
            Some((240 << 20) - 1015808),
            "peak minus inactive file"
        );
        let ratio = s.ratio().expect("known");
        assert!(ratio > 0.85, "{ratio} of {limit}");
        let s = src.sample().expect("ok").expect("some");
        assert_eq!(s.interval_peak_working_set_bytes, None, "no new high");
        assert!(s.ratio().expect("known") < 0.5);
        assert_eq!(s.peak_bytes, Some(240 << 20));
    }

    #[test]
    fn a_removed_cgroup_reads_as_gone() {
        let dir = fixture_tree("v2");
        let mut src = CgroupSource::new(dir.path().join("gone"), Mode::V2);
        assert!(src.sample().expect("no error").is_none());
        assert_eq!(Mode::detect(&dir.path().join("gone")), None);
    }

    #[test]
    fn finds_the_memory_cgroup_in_proc_cgroup_text() {
        let v1 = include_str!("../../fixtures/v1/proc-self-cgroup");
        let v2 = include_str!("../../fixtures/v2/proc-self-cgroup");
        let hybrid = include_str!("../../fixtures/hybrid/proc-self-cgroup");
        let root = Path::new("/sys/fs/cgroup");
        assert_eq!(
            Layout::Legacy.memory_dir(root, v1),
            Some(PathBuf::from(
                "/sys/fs/cgroup/memory/kubepods/burstable/pod7f3e2a1b-9c44-4d1e-a0b2-5f0e6c7d8e91/3b1f0c2d4e5f6071"
            ))
        );
        let unified = Layout::Unified.memory_dir(root, v2).expect("0:: line");
        assert!(unified.starts_with("/sys/fs/cgroup/kubepods.slice/"));
        assert!(unified.to_string_lossy().ends_with(".scope"));
        assert_eq!(
            Layout::Hybrid.memory_dir(root, hybrid),
            Some(PathBuf::from(
                "/sys/fs/cgroup/memory/process_api/9df7a91746ff0ac4e177a15d5fa9a7ed"
            ))
        );
        assert_eq!(proc_cgroup_path(hybrid, None).as_deref(), Some("/"));
        assert_eq!(
            proc_cgroup_path(v1, Some("cpuacct")).as_deref().map(|_| ()),
            Some(())
        );
        assert_eq!(proc_cgroup_path("garbage", Some("memory")), None);
    }

    #[test]
    fn a_cgroup_outside_the_namespace_has_no_memory_dir_under_the_root() {
        // Regression (cargo-fuzz, cgroup_files, fuzz/corpus/cgroup_files/regression-dotdot):
        // `..` in the path was joined to the root, naming a directory outside it.
        let root = Path::new("/sys/fs/cgroup");
        let outside = "0::/kubepods/b/../../trainer\n4:memory:/../trainer\n";
        for layout in [Layout::Unified, Layout::Legacy, Layout::Hybrid] {
            assert_eq!(layout.memory_dir(root, outside), None, "{layout:?}");
        }
        assert_eq!(
            Layout::Unified.memory_dir(root, "0::/a/..b\n"),
            Some(root.join("a/..b"))
        );
    }

    #[test]
    fn detects_host_layouts_from_trees() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        assert_eq!(Layout::detect(root), None);
        fs::write(
            root.join("cgroup.controllers"),
            "cpuset cpu io memory pids\n",
        )
        .expect("w");
        assert_eq!(Layout::detect(root), Some(Layout::Unified));
        fs::create_dir_all(root.join("memory")).expect("mkdir");
        fs::write(root.join("memory/memory.usage_in_bytes"), "1\n").expect("w");
        assert_eq!(Layout::detect(root), Some(Layout::Legacy));
        fs::create_dir_all(root.join("unified")).expect("mkdir");
        fs::write(root.join("unified/cgroup.controllers"), "\n").expect("w");
        assert_eq!(Layout::detect(root), Some(Layout::Hybrid));
    }
}
