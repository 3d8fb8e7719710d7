//! What the memguard binaries share at start and at exit: logging set up once, and the signals
//! that end them. Small on purpose (tokio's signals, tracing-subscriber, clap's value enum): the
//! sidecar runs in every training pod and must not pull in the webhook's Kubernetes client.
#![deny(missing_docs)]

/// Log output format (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One JSON object per line, the event's fields at the top level.
    Json,
    /// Human-readable lines, no colours (logs end up in files and `kubectl logs`).
    Text,
}

/// Where log lines go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogStream {
    /// Standard output (the webhook).
    Stdout,
    /// Standard error (the sidecar: its standard output stays free for the trainer's view).
    Stderr,
}

/// Installs the global subscriber once: `format` on `stream`, levels from `RUST_LOG` (default
/// `info`). A second call changes nothing.
pub fn init_tracing(format: LogFormat, stream: LogStream) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(move || -> Box<dyn std::io::Write> {
            match stream {
                LogStream::Stdout => Box::new(std::io::stdout()),
                LogStream::Stderr => Box::new(std::io::stderr()),
            }
        });
    let _ = match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

/// The signals that end a binary: SIGTERM (what the kubelet sends) and SIGINT (ctrl-c).
/// [`Shutdown::listen`] registers them at once, so none sent afterwards is missed.
pub struct Shutdown {
    term: Option<tokio::signal::unix::Signal>,
    interrupt: Option<tokio::signal::unix::Signal>,
}

impl Shutdown {
    /// Starts listening (inside a tokio runtime). A signal that cannot be watched is left out:
    /// the other still ends [`Self::wait`].
    pub fn listen() -> Self {
        use tokio::signal::unix::{SignalKind, signal};
        Shutdown {
            term: signal(SignalKind::terminate()).ok(),
            interrupt: signal(SignalKind::interrupt()).ok(),
        }
    }

    /// Waits for the first signal and names it: `"sigterm"` or `"interrupt"`.
    pub async fn wait(mut self) -> &'static str {
        async fn next(s: Option<&mut tokio::signal::unix::Signal>) {
            match s {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        tokio::select! {
            () = next(self.term.as_mut()) => "sigterm",
            () = next(self.interrupt.as_mut()) => "interrupt",
        }
    }
}

/// [`Shutdown::listen`], then [`Shutdown::wait`].
pub async fn shutdown_signal() -> &'static str {
    Shutdown::listen().wait().await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real SIGTERM to this process ends the wait, and is named.
    #[tokio::test]
    async fn sigterm_ends_the_wait() {
        let shutdown = Shutdown::listen();
        rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::TERM)
            .expect("signal sent");
        let which = tokio::time::timeout(std::time::Duration::from_secs(10), shutdown.wait())
            .await
            .expect("the wait ended");
        assert_eq!(which, "sigterm");
    }
}
