//! `memguard mutate` (built by the webhook work, issue 3).
use std::process::ExitCode;

/// Flags of `memguard mutate`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`memguard mutate` is not built yet")
}
