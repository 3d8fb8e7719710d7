//! `memguard`: the estimator and the webhook's mutation, offline.

mod client;
mod crdgen;
mod estimate;
mod explain;
mod host;
mod input;
mod mutate;
mod serving;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// memguard keeps ML training jobs from dying of out-of-memory.
#[derive(Parser)]
#[command(name = "memguard", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Estimate the peak memory of one training step, and plan downgrades to fit a budget.
    Estimate(Box<estimate::Args>),
    /// Apply the webhook's mutation to a manifest on disk (pod, or a workload's pod template).
    Mutate(mutate::Args),
    /// Explain what happened to a pod's memory (`kubectl get pod NAME -o yaml | memguard explain -f -`),
    /// or what admission gives a workload's pods (`memguard mutate -f job.yaml | memguard explain -f -`).
    Explain(explain::Args),
    /// Write the CRD manifests (MemguardPolicy, MemoryProfile).
    Crdgen(crdgen::Args),
    /// The Python client this binary embeds (`memguard client install DIR`: the webhook's init
    /// container).
    Client(client::Args),
}

/// Exit code for bad input (usage errors and invalid values), as clap uses.
const EXIT_BAD_INPUT: u8 = 2;
/// Exit code of `memguard estimate` when its plan does not fit the budget (the output, table
/// or JSON, is written in full, with what would fit).
const EXIT_DOES_NOT_FIT: u8 = 3;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Estimate(args) => estimate::run(*args),
        Command::Mutate(args) => mutate::run(args),
        Command::Explain(args) => explain::run(args),
        Command::Crdgen(args) => crdgen::run(args),
        Command::Client(args) => client::run(args),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::from(1)
        }
    }
}
