//! Helpers for tests that run the real `memguard-sidecar` binary.
#![allow(dead_code)]

use memguard_api::Signal;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running sidecar; killed on drop.
pub struct Sidecar {
    pub child: Child,
    pub api: SocketAddr,
    pub metrics: SocketAddr,
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Sidecar {
    /// Starts the binary with `args` plus ephemeral listeners and text logs; waits until both
    /// listeners are up.
    pub fn spawn(args: &[&str]) -> Sidecar {
        Sidecar::spawn_command(Command::new(env!("CARGO_BIN_EXE_memguard-sidecar")), args)
    }

    /// Like `spawn`, through `command` (a wrapper that ends by running the sidecar with the
    /// arguments appended), whose stderr must be the sidecar's.
    pub fn spawn_command(mut command: Command, args: &[&str]) -> Sidecar {
        let mut child = command
            .args(args)
            .args([
                "--listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "127.0.0.1:0",
                "--log-format",
                "text",
            ])
            .env_remove("MEMGUARD_BATCH_SIZE")
            .env_remove("MEMGUARD_GRAD_ACCUMULATION")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("sidecar binary starts");
        let stderr = child.stderr.take().expect("piped");
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("listening") {
                    let addr = line
                        .split_whitespace()
                        .find_map(|w| w.strip_prefix("addr="))
                        .and_then(|a| a.parse::<SocketAddr>().ok());
                    let what = if line.contains("trainer-api") {
                        "api"
                    } else {
                        "metrics"
                    };
                    if let Some(a) = addr {
                        let _ = tx.send((what, a));
                    }
                }
                sink.lock().expect("log lock").push(line);
            }
        });
        let (mut api, mut metrics) = (None, None);
        while api.is_none() || metrics.is_none() {
            match rx.recv_timeout(Duration::from_secs(20)) {
                Ok(("api", a)) => api = Some(a),
                Ok((_, a)) => metrics = Some(a),
                Err(_) => {
                    let _ = child.kill();
                    panic!("sidecar did not listen: {:?}", log.lock().expect("lock"));
                }
            }
        }
        Sidecar {
            child,
            api: api.expect("set"),
            metrics: metrics.expect("set"),
            log,
        }
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        let pid = rustix::process::Pid::from_raw(self.child.id() as i32).expect("pid");
        rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("kill");
    }

    /// Waits for the process to exit (bounded); returns whether it exited successfully.
    pub fn wait_exit(&mut self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "sidecar still running: {:?}",
            self.log.lock().expect("lock")
        );
    }

    pub fn log_text(&self) -> String {
        self.log.lock().expect("lock").join("\n")
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A minimal HTTP/1.1 exchange over loopback: (status, body).
pub fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(70)))
        .expect("timeout");
    let body = body.unwrap_or("");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("http response");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status code");
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    (
        status,
        if chunked {
            dechunk(rest)
        } else {
            rest.to_string()
        },
    )
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// Reads the signal file, if present and whole.
pub fn read_signal(path: &Path) -> Option<Signal> {
    serde_json::from_str(&std::fs::read_to_string(path).ok()?).ok()
}

/// Polls `f` until it returns `Some`, or panics after `within`.
pub fn eventually<T>(within: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Writes a file the way the kernel presents it: whole (write a temp, rename).
pub fn put(dir: &Path, name: &str, text: &str) {
    let tmp: PathBuf = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, dir.join(name)).expect("rename");
}

/// Runs `promtool check metrics` on the sidecar's exposition (classic text format).
pub fn promtool_check(text: &str) {
    memguard_e2e::promtool_check_metrics(text);
}
