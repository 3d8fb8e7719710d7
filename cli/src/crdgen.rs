//! `memguard crdgen` (built by the chart and CRD work, issue 6).
use std::process::ExitCode;

/// Flags of `memguard crdgen`.
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`memguard crdgen` is not built yet")
}
