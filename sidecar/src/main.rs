//! `memguard-sidecar`: see the library for the wiring.
use memguard_sidecar::{Args, Config};
use std::process::ExitCode;

fn main() -> ExitCode {
    let lookup = |name: &str| std::env::var(name).ok();
    let args = match Args::from_env(std::env::args_os(), &lookup) {
        Ok(a) => a,
        Err(e) if e.use_stderr() => {
            let _ = e.print();
            return ExitCode::from(64);
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
    };
    let config = match Config::resolve(args, lookup) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("memguard-sidecar: {e}");
            return ExitCode::from(64);
        }
    };
    memguard_sidecar::init_tracing(config.args.log_format);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    let result = runtime
        .map_err(anyhow::Error::from)
        .and_then(|rt| rt.block_on(memguard_sidecar::run(config)));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "memguard-sidecar failed");
            ExitCode::FAILURE
        }
    }
}
