//! Kernel events that wake the sampler before its next tick: cgroup v1 usage thresholds and OOM
//! notifications (`cgroup.event_control` + eventfd), PSI triggers (`POLLPRI`), and cgroup v2
//! `memory.events` changes (inotify). All through rustix, without `unsafe`. The poll keeps running
//! whatever happens here: an event source that cannot be set up is logged and left out.

use crate::sample::psi;
use rustix::event::{EventfdFlags, eventfd};
use rustix::fd::{AsFd, AsRawFd, OwnedFd};
use rustix::fs::{Mode, OFlags, inotify};
use rustix::io::Errno;
use std::mem::MaybeUninit;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

/// Registers an owned fd with the reactor. Tokio deprecates the safe constructor because a
/// generic `T: AsRawFd` could close its fd while registered; an `OwnedFd` moved into the
/// `AsyncFd` cannot, which is exactly the contract of the `unsafe` replacement, so this use is
/// sound and keeps the crate free of `unsafe`.
#[allow(deprecated)]
fn async_fd(fd: OwnedFd, interest: Interest) -> std::io::Result<AsyncFd<OwnedFd>> {
    AsyncFd::with_interest(fd, interest)
}

/// The text written to `cgroup.event_control`: `<eventfd> <target fd> [<args>]`.
pub fn event_control_line(efd: i32, target_fd: i32, args: Option<&str>) -> String {
    match args {
        Some(a) => format!("{efd} {target_fd} {a}"),
        None => format!("{efd} {target_fd}"),
    }
}

/// The v1 usage thresholds (bytes) worth an event for `limit`: each ratio of it.
pub fn threshold_bytes(limit: u64, ratios: &[f64]) -> Vec<u64> {
    let mut v: Vec<u64> = ratios
        .iter()
        .filter(|r| **r > 0.0 && **r <= 1.0)
        .map(|r| (limit as f64 * r) as u64)
        .filter(|&b| b > 0)
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// An eventfd registered for v1 usage thresholds and OOM notification on `dir`.
pub struct V1Events {
    efd: OwnedFd,
    // The registration holds these files open in the kernel; kept for clarity of ownership.
    _targets: Vec<OwnedFd>,
}

impl V1Events {
    /// Registers `thresholds` on `memory.usage_in_bytes` and OOM on `memory.oom_control`.
    /// Fails when `cgroup.event_control` is not writable (not root, or a v2 dir).
    pub fn register(dir: &Path, thresholds: &[u64]) -> Result<Self, Errno> {
        let efd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        let control = rustix::fs::open(
            dir.join("cgroup.event_control"),
            OFlags::WRONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        if !psi::is_kernel_fs(&control) {
            return Err(Errno::NOTSUP);
        }
        let mut targets = Vec::new();
        let usage = rustix::fs::open(
            dir.join("memory.usage_in_bytes"),
            OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        for t in thresholds {
            let line = event_control_line(efd.as_raw_fd(), usage.as_raw_fd(), Some(&t.to_string()));
            rustix::io::write(&control, line.as_bytes())?;
        }
        targets.push(usage);
        if let Ok(oom) = rustix::fs::open(
            dir.join("memory.oom_control"),
            OFlags::RDONLY | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            let line = event_control_line(efd.as_raw_fd(), oom.as_raw_fd(), None);
            if rustix::io::write(&control, line.as_bytes()).is_ok() {
                targets.push(oom);
            }
        }
        Ok(V1Events {
            efd,
            _targets: targets,
        })
    }

    /// Wakes `notify` on every event until the task is aborted.
    pub fn spawn(self, notify: Arc<Notify>) -> std::io::Result<JoinHandle<()>> {
        let V1Events { efd, _targets } = self;
        let afd = async_fd(efd, Interest::READABLE)?;
        Ok(tokio::spawn(async move {
            let _keep = _targets;
            loop {
                let Ok(mut guard) = afd.readable().await else {
                    return;
                };
                let mut buf = [0u8; 8];
                match rustix::io::read(afd.get_ref().as_fd(), &mut buf) {
                    Ok(_) => notify.notify_one(),
                    Err(Errno::AGAIN) => guard.clear_ready(),
                    Err(_) => return,
                }
            }
        }))
    }
}

/// Registers a PSI trigger (`some <stall> <window>`) and wakes `notify` on each `POLLPRI`.
/// Returns the accepted window with the task.
pub fn spawn_psi_trigger(
    path: &Path,
    stall: Duration,
    window: Duration,
    notify: Arc<Notify>,
) -> Result<(Duration, JoinHandle<()>), String> {
    let trigger = psi::register_trigger(path, stall, window)
        .map_err(|e| format!("PSI trigger on {}: {e}", path.display()))?;
    let accepted = trigger.window;
    let afd =
        async_fd(trigger.fd, Interest::PRIORITY).map_err(|e| format!("PSI trigger poll: {e}"))?;
    Ok((
        accepted,
        tokio::spawn(async move {
            loop {
                let Ok(mut guard) = afd.ready(Interest::PRIORITY).await else {
                    return;
                };
                notify.notify_one();
                guard.clear_ready();
            }
        }),
    ))
}

/// Wakes the loop once when the process behind `pidfd` exits. The kernel marks a pidfd readable
/// as the process exits, after its OOM kill was counted and before the runtime (which learns of
/// the exit later, through its own wait) removes the container's cgroup: the sample taken then
/// still reads the cgroup's counters through the held directory.
pub fn spawn_exit_watch(pidfd: OwnedFd, notify: Arc<Notify>) -> Result<JoinHandle<()>, String> {
    let afd = async_fd(pidfd, Interest::READABLE).map_err(|e| format!("pidfd: {e}"))?;
    Ok(tokio::spawn(async move {
        if afd.readable().await.is_ok() {
            notify.notify_one();
        }
    }))
}

/// Watches a file with inotify (`IN_MODIFY`): cgroup v2 `memory.events` changes on every
/// `high`, `max`, `oom` and `oom_kill` event.
pub fn spawn_inotify(path: &Path, notify: Arc<Notify>) -> Result<JoinHandle<()>, String> {
    let fd = inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)
        .map_err(|e| format!("inotify: {e}"))?;
    inotify::add_watch(&fd, path, inotify::WatchFlags::MODIFY)
        .map_err(|e| format!("inotify watch on {}: {e}", path.display()))?;
    let afd = async_fd(fd, Interest::READABLE).map_err(|e| format!("inotify: {e}"))?;
    Ok(tokio::spawn(async move {
        let mut buf = [MaybeUninit::<u8>::uninit(); 1024];
        loop {
            let Ok(mut guard) = afd.readable().await else {
                return;
            };
            let mut reader = inotify::Reader::new(afd.get_ref(), &mut buf);
            let mut any = false;
            loop {
                match reader.next() {
                    Ok(_) => any = true,
                    Err(Errno::AGAIN) => break,
                    Err(_) => return,
                }
            }
            guard.clear_ready();
            if any {
                notify.notify_one();
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_control_lines_follow_the_kernel_format() {
        assert_eq!(event_control_line(5, 6, Some("1048576")), "5 6 1048576");
        assert_eq!(event_control_line(5, 7, None), "5 7");
    }

    #[test]
    fn thresholds_are_the_ratios_of_the_limit() {
        assert_eq!(
            threshold_bytes(1000, &[0.85, 0.7, 0.95, 0.7]),
            vec![700, 850, 950]
        );
        assert_eq!(threshold_bytes(1000, &[0.0, 1.5]), Vec::<u64>::new());
    }

    #[test]
    fn v1_registration_fails_cleanly_on_a_plain_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(V1Events::register(dir.path(), &[1]).is_err());
    }

    #[tokio::test]
    async fn inotify_wakes_on_a_modified_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("memory.events");
        std::fs::write(&path, "max 0\n").expect("w");
        let notify = Arc::new(Notify::new());
        let task = spawn_inotify(&path, notify.clone()).expect("watch");
        std::fs::write(&path, "max 1\n").expect("w");
        notify.notified().await; // completes only if the event arrived
        task.abort();
    }
}
