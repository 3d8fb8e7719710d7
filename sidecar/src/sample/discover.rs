//! Sources that find their target late: a `--cgroup` directory that does not exist yet, or a
//! trainer that starts after the sidecar (native sidecars start first).

use super::cgroup::CgroupSource;
use super::procfs::{RssSource, View, find_trainer, trainer_cgroup};
use super::{MemorySample, MemorySource, SampleError, SourceInfo};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

/// What the summed-RSS fallback cannot see, for the log.
pub const RSS_LOSES: &str = "no memory.events/oom_control (OOM kills are not detected or learnt), \
no cgroup PSI, no page cache or kernel memory in the working set, no memory.high, no peaks \
between samples; the limit is the downward-API one";

/// A cgroup directory that is detected (v1 or v2) on first sight and re-detected until then.
pub struct DirSource {
    dir: PathBuf,
    inner: Option<CgroupSource>,
    reset_v1: bool,
}

impl DirSource {
    /// Watches `dir`; `reset_v1` allows the v1 peak reset (`--reset-v1-peak`).
    pub fn new(dir: PathBuf, reset_v1: bool) -> Self {
        let inner = CgroupSource::detect(dir.clone()).map(|s| s.with_v1_reset(reset_v1));
        DirSource {
            dir,
            inner,
            reset_v1,
        }
    }

    /// The detected source, once there is one.
    pub fn detected(&self) -> Option<&CgroupSource> {
        self.inner.as_ref()
    }
}

impl MemorySource for DirSource {
    fn sample(&mut self) -> Result<Option<MemorySample>, SampleError> {
        if self.inner.is_none() {
            self.inner =
                CgroupSource::detect(self.dir.clone()).map(|s| s.with_v1_reset(self.reset_v1));
        }
        match &mut self.inner {
            Some(s) => s.sample(),
            None => Ok(None),
        }
    }

    fn describe(&self) -> String {
        match &self.inner {
            Some(s) => s.describe(),
            None => format!("cgroup {} (not a memory cgroup yet)", self.dir.display()),
        }
    }

    fn info(&self) -> SourceInfo {
        match &self.inner {
            Some(s) => SourceInfo {
                view: "flag",
                ..s.info()
            },
            None => SourceInfo::NONE,
        }
    }

    fn cgroup_dir(&self) -> Option<&Path> {
        self.inner.as_ref().map(|s| s.dir())
    }
}

/// A discovered cgroup with the view it was reached through. Its directory is held open and
/// read through `/proc/self/fd/<n>`: the path through `/proc/<pid>/root` dies with the trainer's
/// last process, the open directory lives until the runtime removes the cgroup, so the counters
/// of a trainer that was just OOM-killed can still be read.
struct Discovered {
    inner: CgroupSource,
    view: View,
    /// The directory as found (for the log); `inner` reads through the held descriptor.
    found: PathBuf,
    _held: Option<OwnedFd>,
}

impl Discovered {
    fn new(found: CgroupSource, view: View, reset_v1: bool) -> Self {
        let path = found.dir().to_path_buf();
        let held = rustix::fs::open(
            &path,
            rustix::fs::OFlags::RDONLY
                | rustix::fs::OFlags::DIRECTORY
                | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
        .ok();
        let through_fd = held.as_ref().and_then(|fd| {
            CgroupSource::detect(PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd())))
        });
        let (inner, held) = match through_fd {
            Some(src) => (src, held),
            None => (found, None),
        };
        Discovered {
            inner: inner.with_v1_reset(reset_v1),
            view,
            found: path,
            _held: held,
        }
    }
}

impl MemorySource for Discovered {
    fn sample(&mut self) -> Result<Option<MemorySample>, SampleError> {
        self.inner.sample()
    }

    fn describe(&self) -> String {
        format!(
            "cgroup-{} {} (via {})",
            self.inner.mode().name(),
            self.found.display(),
            self.view.name()
        )
    }

    fn info(&self) -> SourceInfo {
        SourceInfo {
            view: self.view.name(),
            ..self.inner.info()
        }
    }

    fn cgroup_dir(&self) -> Option<&Path> {
        Some(self.inner.dir())
    }
}

/// Samples during which a trainer whose cgroup cannot be read is tried again (3 s at 100 ms).
const CGROUP_RETRIES: u32 = 30;

/// The trainer found through the shared process namespace: its cgroup when readable, else its
/// summed RSS against the downward-API limit. Looks again every `retry_every` samples until found.
pub struct TrainerSource {
    proc_root: PathBuf,
    self_pid: u32,
    limit: Option<u64>,
    retry_every: u32,
    calls: u32,
    inner: Option<Box<dyn MemorySource>>,
    reset_v1: bool,
    exit_watch: Option<OwnedFd>,
    /// The trainer's pid, the tries left and the last reason, while its cgroup is retried.
    cgroup_retry: Option<(u32, u32, String)>,
}

impl TrainerSource {
    /// Looks for the trainer under `proc_root`.
    pub fn new(proc_root: PathBuf, self_pid: u32, limit: Option<u64>, retry_every: u32) -> Self {
        TrainerSource {
            proc_root,
            self_pid,
            limit,
            retry_every: retry_every.max(1),
            calls: 0,
            inner: None,
            reset_v1: false,
            exit_watch: None,
            cgroup_retry: None,
        }
    }

    fn reading_cgroup(&self, pid: u32, found: CgroupSource, view: View) -> Box<dyn MemorySource> {
        let src = Discovered::new(found, view, self.reset_v1);
        tracing::info!(
            pid,
            source = %src.describe(),
            kind = src.info().kind,
            view = src.info().view,
            "found the trainer; reading its own cgroup"
        );
        Box::new(src)
    }

    /// One more try at the cgroup of a trainer read through RSS meanwhile; the fallback is
    /// logged (warn) when the tries run out.
    fn retry_cgroup(&mut self) {
        let Some((pid, left, why)) = self.cgroup_retry.take() else {
            return;
        };
        match trainer_cgroup(&self.proc_root, self.self_pid, pid) {
            Ok((found, view)) => self.inner = Some(self.reading_cgroup(pid, found, view)),
            Err(why) if left > 1 => self.cgroup_retry = Some((pid, left - 1, why)),
            Err(_) => {
                let source = self
                    .inner
                    .as_ref()
                    .map(|s| s.describe())
                    .unwrap_or_default();
                tracing::warn!(
                    pid,
                    %source,
                    kind = "rss",
                    %why,
                    lost = RSS_LOSES,
                    "found the trainer but not its cgroup; falling back to summed RSS \
                     (give the sidecar the trainer's uid/gid, see docs/sidecar.md)"
                );
            }
        }
    }

    /// Allows the v1 peak reset on the cgroup found (`--reset-v1-peak`).
    pub fn with_v1_reset(mut self, on: bool) -> Self {
        self.reset_v1 = on;
        self
    }

    fn discover(&mut self) {
        let pids = find_trainer(&self.proc_root, self.self_pid);
        let Some(&first) = pids.first() else {
            return;
        };
        let src: Box<dyn MemorySource> = match trainer_cgroup(&self.proc_root, self.self_pid, first)
        {
            Ok((inner, view)) => self.reading_cgroup(first, inner, view),
            Err(why) => {
                let src = RssSource::new(self.proc_root.clone(), pids, self.limit);
                // A process caught while the runtime still sets it up (runc's init, as root and
                // not dumpable, before it becomes the trainer's uid) cannot be read yet: try
                // again for a while before settling for RSS.
                tracing::info!(pid = first, %why, "found the trainer, not its cgroup yet; trying again");
                self.cgroup_retry = Some((first, CGROUP_RETRIES, why));
                Box::new(src)
            }
        };
        self.inner = Some(src);
        // Only pids of the real procfs name real processes (tests pass a fake tree).
        if self.proc_root == Path::new("/proc") {
            self.exit_watch = rustix::process::Pid::from_raw(first as i32).and_then(|pid| {
                rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).ok()
            });
        }
    }
}

impl MemorySource for TrainerSource {
    fn sample(&mut self) -> Result<Option<MemorySample>, SampleError> {
        if self.inner.is_none() {
            if self.calls.is_multiple_of(self.retry_every) {
                self.discover();
            }
            self.calls = self.calls.wrapping_add(1);
        } else {
            self.retry_cgroup();
        }
        match &mut self.inner {
            Some(s) => s.sample(),
            None => Ok(None),
        }
    }

    fn describe(&self) -> String {
        match &self.inner {
            Some(s) => s.describe(),
            None => "trainer not found yet (shared process namespace)".into(),
        }
    }

    fn info(&self) -> SourceInfo {
        self.inner.as_ref().map_or(SourceInfo::NONE, |s| s.info())
    }

    fn cgroup_dir(&self) -> Option<&Path> {
        self.inner.as_ref().and_then(|s| s.cgroup_dir())
    }

    fn forget(&mut self) {
        self.inner = None;
        self.exit_watch = None;
        self.cgroup_retry = None;
        self.calls = 0;
        // A restart in place follows at once: look at every sample, or a restarted trainer
        // killed again within the retry period would be killed unseen.
        self.retry_every = 1;
    }

    fn take_exit_watch(&mut self) -> Option<OwnedFd> {
        self.exit_watch.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn a_directory_that_appears_later_is_picked_up() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cg = dir.path().join("trainer");
        let mut src = DirSource::new(cg.clone(), false);
        assert!(src.sample().expect("ok").is_none());
        fs::create_dir(&cg).expect("mkdir");
        fs::write(cg.join("memory.current"), "4096\n").expect("w");
        let s = src.sample().expect("ok").expect("now present");
        assert_eq!(s.usage_bytes, Some(4096));
        assert!(src.describe().starts_with("cgroup-v2"));
    }

    #[test]
    fn a_trainer_that_starts_later_is_found_through_procfs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        let mk = |pid: u32, comm: &str, cg: &str, kb: u64| {
            let d = root.join(pid.to_string());
            fs::create_dir_all(&d).expect("mkdir");
            fs::write(d.join("comm"), comm).expect("w");
            fs::write(d.join("cgroup"), cg).expect("w");
            fs::write(d.join("status"), format!("VmRSS:\t{kb} kB\n")).expect("w");
        };
        mk(5, "memguard-sidecar", "0::/sidecar\n", 10);
        let mut src = TrainerSource::new(root.to_path_buf(), 5, Some(1 << 30), 1);
        assert!(src.sample().expect("ok").is_none(), "not started yet");
        mk(9, "python3", "0::/trainer\n", 2048);
        let s = src.sample().expect("ok").expect("found");
        assert_eq!(s.working_set_bytes, Some(2048 * 1024));
        assert_eq!(s.effective_limit(), Some(1 << 30));
    }
}
