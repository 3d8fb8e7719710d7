//! `memguard client install DIR`: writes the pure-Python client this binary embeds, so the
//! webhook's init container is this binary alone (the image needs no shell and no Python).
//!
//! `DIR` gets `sitecustomize.py` (the hook Python runs at start-up when `DIR` is on
//! `PYTHONPATH`) and the `memguard_client` package. Writing again overwrites: idempotent.
use anyhow::Context;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Flags of `memguard client`.
#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Write the client (sitecustomize.py and the memguard_client package) into DIR.
    Install {
        /// Folder to write into (created if missing); put it first on the trainer's PYTHONPATH.
        dir: PathBuf,
    },
}

macro_rules! client_files {
    ($($path:literal),* $(,)?) => {
        &[$(($path, include_str!(concat!("../../clients/python/", $path)))),*]
    };
}

/// Every file of the injected client: (path under `clients/python/`, content). The install
/// path drops the `src/` and `inject/` prefixes.
pub const FILES: &[(&str, &str)] = client_files![
    "inject/sitecustomize.py",
    "src/memguard_client/__init__.py",
    "src/memguard_client/allocator.py",
    "src/memguard_client/auto.py",
    "src/memguard_client/batching.py",
    "src/memguard_client/distributed.py",
    "src/memguard_client/env.py",
    "src/memguard_client/frameworks.py",
    "src/memguard_client/guard.py",
    "src/memguard_client/hf.py",
    "src/memguard_client/mlx.py",
    "src/memguard_client/oom.py",
    "src/memguard_client/own_cgroup.py",
    "src/memguard_client/peaks.py",
    "src/memguard_client/phase.py",
    "src/memguard_client/py.typed",
    "src/memguard_client/recovery.py",
    "src/memguard_client/signal.py",
    "src/memguard_client/torch.py",
    "src/memguard_client/train_config.py",
];

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    match args.command {
        Command::Install { dir } => {
            let written = install(&dir)?;
            eprintln!(
                "wrote the memguard client ({written} files) to {}",
                dir.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes [`FILES`] under `dir`; returns how many.
pub fn install(dir: &Path) -> anyhow::Result<usize> {
    for (path, text) in FILES {
        let rel = path
            .strip_prefix("src/")
            .or_else(|| path.strip_prefix("inject/"))
            .unwrap_or(path);
        let target = dir.join(rel);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)
                .with_context(|| format!("creating {}", parent.display()))?;
        }
        std::fs::write(&target, text).with_context(|| format!("writing {}", target.display()))?;
    }
    Ok(FILES.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn listed(dir: &str) -> BTreeSet<String> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../clients/python");
        std::fs::read_dir(root.join(dir))
            .expect("the client's sources")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".py") || n == "py.typed")
            .map(|n| format!("{dir}/{n}"))
            .collect()
    }

    /// A file added to the client is embedded too (or this fails): the pod gets the whole client.
    #[test]
    fn embeds_every_file_of_the_client() {
        let mut on_disk = listed("src/memguard_client");
        on_disk.extend(listed("inject"));
        let embedded: BTreeSet<String> = FILES.iter().map(|(p, _)| p.to_string()).collect();
        assert_eq!(embedded, on_disk);
    }

    #[test]
    fn installs_the_package_and_the_hook_and_again_idempotently() {
        let dir = tempfile::tempdir().expect("tempdir");
        for _ in 0..2 {
            assert_eq!(install(dir.path()).expect("install"), FILES.len());
        }
        let hook = std::fs::read_to_string(dir.path().join("sitecustomize.py")).expect("hook");
        assert!(hook.contains("memguard_client"));
        let guard = dir.path().join("memguard_client/guard.py");
        assert_eq!(
            std::fs::read_to_string(guard).expect("guard.py"),
            include_str!("../../clients/python/src/memguard_client/guard.py")
        );
    }

    #[test]
    fn an_unwritable_target_is_a_clear_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("a-file");
        std::fs::write(&file, "x").expect("write");
        let err = install(&file.join("sub")).expect_err("not a directory");
        assert!(format!("{err:#}").contains("creating"), "{err:#}");
    }
}
