//! `memguard estimate`.
use std::process::ExitCode;

/// Flags of `memguard estimate`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    let _ = super::EXIT_BAD_INPUT;
    anyhow::bail!("not built yet")
}
