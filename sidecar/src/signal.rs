//! The signal file: replaced atomically (temp file, fsync, rename, fsync directory), only when
//! it changes, with a monotonic `seq`.

use memguard_api::Signal;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// A signal-file failure (logged; the HTTP side keeps working).
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The file's directory is missing and could not be created.
    #[error("signal directory {dir} is missing and cannot be created: {source}")]
    Directory {
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Writing, syncing or renaming failed.
    #[error("writing signal file {path}: {source}")]
    Write {
        /// The file (or its temp file).
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// Writes the signal file.
#[derive(Debug)]
pub struct SignalWriter {
    path: PathBuf,
    tmp: PathBuf,
    last: Option<Signal>,
}

impl SignalWriter {
    /// A writer for `path` (its temp file sits next to it: rename stays within one filesystem).
    pub fn new(path: PathBuf) -> Self {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "signal.json".into());
        let tmp = path.with_file_name(format!(".{name}.tmp"));
        SignalWriter {
            path,
            tmp,
            last: None,
        }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `signal` unless it equals the last one written. Returns whether it wrote.
    pub fn write(&mut self, signal: &Signal) -> Result<bool, WriteError> {
        if self.last.as_ref() == Some(signal) {
            return Ok(false);
        }
        let dir = self
            .path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        if !dir.is_dir() {
            fs::create_dir_all(&dir).map_err(|source| WriteError::Directory {
                dir: dir.clone(),
                source,
            })?;
        }
        let mut body = serde_json::to_vec(signal).map_err(|e| WriteError::Write {
            path: self.tmp.clone(),
            source: io::Error::other(e),
        })?;
        body.push(b'\n');
        let werr = |path: &Path| {
            let path = path.to_path_buf();
            move |source| WriteError::Write { path, source }
        };
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&self.tmp)
            .map_err(werr(&self.tmp))?;
        f.write_all(&body).map_err(werr(&self.tmp))?;
        f.sync_all().map_err(werr(&self.tmp))?;
        drop(f);
        fs::rename(&self.tmp, &self.path).map_err(werr(&self.path))?;
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(werr(&dir))?;
        self.last = Some(signal.clone());
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_atomically_and_only_on_change() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("sub/signal.json");
        let mut w = SignalWriter::new(path.clone());
        let mut s = Signal::initial(8, 2, false);
        assert!(w.write(&s).expect("writes"), "missing directory is created");
        assert!(!w.write(&s).expect("ok"), "unchanged: not rewritten");
        let back: Signal =
            serde_json::from_str(&fs::read_to_string(&path).expect("read")).expect("parses");
        assert_eq!(back, s);
        s.seq = 1;
        s.batch_size = 4;
        assert!(w.write(&s).expect("writes"));
        let names: Vec<String> = fs::read_dir(dir.path().join("sub"))
            .expect("ls")
            .map(|e| e.expect("e").file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["signal.json"], "no temp file left behind");
    }

    #[test]
    fn an_unwritable_directory_is_reported_clearly() {
        let dir = tempfile::tempdir().expect("tempdir");
        let blocker = dir.path().join("file");
        fs::write(&blocker, "x").expect("w");
        let mut w = SignalWriter::new(blocker.join("signal.json"));
        let e = w
            .write(&Signal::initial(1, 1, false))
            .expect_err("not a dir");
        assert!(e.to_string().contains("signal directory"), "{e}");
    }
}
