//! `memguard crdgen`: writes the CRD manifests, one file per kind.
use anyhow::Context;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// Flags of `memguard crdgen`.
#[derive(clap::Args)]
pub struct Args {
    /// Folder to write `<plural>.training.memguard.io.yaml` files into (created if missing). Without it,
    /// every CRD goes to stdout as one multi-document stream.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let files = memguard_api::crd::render().context("rendering the CRDs")?;
    match args.out {
        Some(dir) => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            for (name, text) in files {
                let path = dir.join(name);
                std::fs::write(&path, text)
                    .with_context(|| format!("writing {}", path.display()))?;
                eprintln!("wrote {}", path.display());
            }
        }
        None => {
            let mut stdout = std::io::stdout().lock();
            for (i, (_, text)) in files.iter().enumerate() {
                if i > 0 {
                    stdout.write_all(b"---\n")?;
                }
                stdout.write_all(text.as_bytes())?;
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
