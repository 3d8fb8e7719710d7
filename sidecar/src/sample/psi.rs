//! Pressure stall information: `/proc/pressure/memory` and a cgroup's `memory.pressure`.
//! Parsing is separate from trigger registration.

use rustix::fd::OwnedFd;
use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// One PSI line (`some` or `full`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PsiLine {
    /// Percent of the last 10 s.
    pub avg10: f64,
    /// Percent of the last 60 s.
    pub avg60: f64,
    /// Percent of the last 300 s.
    pub avg300: f64,
    /// Total stall time, microseconds.
    pub total_us: u64,
}

/// A PSI file: `some` and (memory, io; cpu since 5.13) `full`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Psi {
    /// Some tasks stalled.
    pub some: Option<PsiLine>,
    /// All non-idle tasks stalled.
    pub full: Option<PsiLine>,
}

/// Parses PSI text; lines that do not parse are left out (`None`).
pub fn parse_psi(text: &str) -> Psi {
    let mut psi = Psi::default();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let kind = words.next();
        let (mut a10, mut a60, mut a300, mut total) = (None, None, None, None);
        for w in words {
            match w.split_once('=') {
                Some(("avg10", v)) => a10 = v.parse().ok(),
                Some(("avg60", v)) => a60 = v.parse().ok(),
                Some(("avg300", v)) => a300 = v.parse().ok(),
                Some(("total", v)) => total = v.parse().ok(),
                _ => {}
            }
        }
        let parsed = match (a10, a60, a300, total) {
            (Some(avg10), Some(avg60), Some(avg300), Some(total_us)) => Some(PsiLine {
                avg10,
                avg60,
                avg300,
                total_us,
            }),
            _ => None,
        };
        match kind {
            Some("some") => psi.some = parsed,
            Some("full") => psi.full = parsed,
            _ => {}
        }
    }
    psi
}

/// Why a PSI file that is there gave no figures.
#[derive(Debug, thiserror::Error)]
pub enum PsiError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The PSI file.
        path: PathBuf,
        /// What reading it said.
        #[source]
        source: std::io::Error,
    },
    /// The file holds no complete `some` line.
    #[error("{path}: no `some avg10=… avg60=… avg300=… total=…` line")]
    Parse {
        /// The PSI file.
        path: PathBuf,
    },
}

/// Reads and parses a PSI file. `Ok(None)` when there is none to read (absent, or PSI turned
/// off: `EOPNOTSUPP`); an error when it is there but unreadable or holds no `some` line.
pub fn read_psi(path: &Path) -> Result<Option<Psi>, PsiError> {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let psi = parse_psi(&text);
            match psi.some {
                Some(_) => Ok(Some(psi)),
                None => Err(PsiError::Parse {
                    path: path.to_path_buf(),
                }),
            }
        }
        Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::Unsupported) => Ok(None),
        Err(source) => Err(PsiError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The trigger text the kernel wants: `some <stall_us> <window_us>`.
pub fn trigger_text(stall: Duration, window: Duration) -> String {
    format!("some {} {}", stall.as_micros(), window.as_micros())
}

/// A registered PSI trigger: poll the fd for `POLLPRI`.
#[derive(Debug)]
pub struct Trigger {
    /// The open PSI file holding the trigger.
    pub fd: OwnedFd,
    /// The window the kernel accepted.
    pub window: Duration,
    /// The stall threshold within it.
    pub stall: Duration,
}

/// Registers `some <stall> <window>` on a PSI file. Unprivileged writers (no CAP_SYS_RESOURCE)
/// may only use windows that are multiples of 2 s: on `EINVAL` the window is rounded up to 2 s
/// and the stall scaled with it, once.
pub fn register_trigger(path: &Path, stall: Duration, window: Duration) -> Result<Trigger, Errno> {
    match try_register(path, stall, window) {
        Ok(fd) => Ok(Trigger { fd, window, stall }),
        Err(Errno::INVAL) if !window.as_micros().is_multiple_of(2_000_000) => {
            let secs = window.as_secs_f64();
            let w2 = Duration::from_secs(((secs / 2.0).ceil() as u64).max(1) * 2);
            let s2 = stall.mul_f64(w2.as_secs_f64() / secs.max(f64::EPSILON));
            let s2 = s2.min(w2);
            try_register(path, s2, w2).map(|fd| Trigger {
                fd,
                window: w2,
                stall: s2,
            })
        }
        Err(e) => Err(e),
    }
}

fn try_register(path: &Path, stall: Duration, window: Duration) -> Result<OwnedFd, Errno> {
    let fd = rustix::fs::open(
        path,
        OFlags::RDWR | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    if !is_kernel_fs(&fd) {
        // A regular file (a fake tree in tests): never write a trigger into it.
        return Err(Errno::NOTSUP);
    }
    let mut text = trigger_text(stall, window).into_bytes();
    text.push(0);
    rustix::io::write(&fd, &text)?;
    Ok(fd)
}

/// Whether `fd` lives on procfs or a cgroup filesystem (where trigger and event-control writes
/// mean something), not on a regular filesystem.
#[allow(clippy::unnecessary_cast)] // f_type is i64 or u32 depending on the backend
pub fn is_kernel_fs(fd: &OwnedFd) -> bool {
    const PROC_SUPER_MAGIC: u64 = 0x9fa0;
    const CGROUP_SUPER_MAGIC: u64 = 0x27e0eb;
    const CGROUP2_SUPER_MAGIC: u64 = 0x6367_7270;
    match rustix::fs::fstatfs(fd) {
        Ok(st) => matches!(
            st.f_type as u64,
            PROC_SUPER_MAGIC | CGROUP_SUPER_MAGIC | CGROUP2_SUPER_MAGIC
        ),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_real_proc_pressure_memory() {
        let psi = parse_psi(include_str!("../../fixtures/psi-proc-pressure-memory"));
        let some = psi.some.expect("some line");
        assert_eq!(some.avg10, 0.0);
        assert!(psi.full.is_some());
    }

    #[test]
    fn parses_a_cgroup_memory_pressure_under_load() {
        let psi = parse_psi(include_str!("../../fixtures/v2/memory.pressure"));
        assert_eq!(
            psi.some,
            Some(PsiLine {
                avg10: 12.5,
                avg60: 4.21,
                avg300: 0.98,
                total_us: 8731412
            })
        );
        assert_eq!(psi.full.map(|f| f.avg10), Some(9.75));
    }

    #[test]
    fn cpu_pressure_before_5_13_has_no_full_line_and_garbage_is_unknown() {
        let psi = parse_psi("some avg10=1.00 avg60=0.50 avg300=0.10 total=1234\n");
        assert_eq!(psi.some.map(|s| s.total_us), Some(1234));
        assert_eq!(psi.full, None);
        assert_eq!(
            parse_psi("some avg10=x avg60=0 avg300=0 total=0"),
            Psi::default()
        );
        assert_eq!(parse_psi(""), Psi::default());
    }

    #[test]
    fn trigger_text_is_in_microseconds() {
        assert_eq!(
            trigger_text(Duration::from_millis(150), Duration::from_secs(1)),
            "some 150000 1000000"
        );
    }

    #[test]
    fn never_writes_a_trigger_into_a_regular_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("memory.pressure");
        let text = "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        std::fs::write(&p, text).expect("w");
        let e = register_trigger(&p, Duration::from_millis(100), Duration::from_secs(1));
        assert_eq!(e.map(|_| ()), Err(Errno::NOTSUP));
        assert_eq!(
            std::fs::read_to_string(&p).expect("r"),
            text,
            "file untouched"
        );
    }

    /// Real: where the kernel has PSI, a trigger is accepted (2 s windows at worst).
    #[test]
    fn arms_a_real_trigger_on_proc_pressure_memory() {
        let p = Path::new("/proc/pressure/memory");
        if !p.exists() {
            eprintln!("SKIP: no /proc/pressure/memory on this kernel (PSI off)");
            return;
        }
        match register_trigger(p, Duration::from_millis(100), Duration::from_secs(1)) {
            Ok(t) => assert!(t.window.as_secs() <= 2 && t.stall <= t.window),
            Err(Errno::ACCESS) | Err(Errno::PERM) => {
                eprintln!("SKIP: PSI triggers not permitted for this user")
            }
            Err(e) => panic!("trigger refused: {e}"),
        }
    }

    #[test]
    fn registering_on_a_missing_file_fails_cleanly() {
        let e = register_trigger(
            Path::new("/nonexistent/memory.pressure"),
            Duration::from_millis(100),
            Duration::from_secs(1),
        )
        .expect_err("no file");
        assert_eq!(e, Errno::NOENT);
    }
}
