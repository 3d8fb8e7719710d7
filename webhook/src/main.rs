//! `memguard-webhook`: parse flags, install the crypto provider, serve. See the library.
use clap::Parser;
use std::process::ExitCode;

#[tokio::main]
async fn main() -> ExitCode {
    let args = memguard_webhook::args::Args::parse();
    // Only one provider is compiled in; installing it can fail only if one already is.
    let _ = rustls::crypto::ring::default_provider().install_default();
    match memguard_webhook::server::run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("memguard-webhook: {error:#}");
            ExitCode::FAILURE
        }
    }
}
