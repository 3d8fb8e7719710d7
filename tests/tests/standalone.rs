//! The repository stands alone: a plain clone, with nothing beside it, installs its own tools,
//! and nothing the project runs or documents reaches outside the repository.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the repository root")
        .to_path_buf()
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Clones the repository into an empty directory (so no reference folder or anything else is beside
/// it), runs the installer step of the README's test command there with a fresh HOME, and
/// checks that the helm and kubectl it put in place run.
#[test]
fn a_plain_clone_installs_helm_and_kubectl_by_itself() {
    let scratch = tempfile::tempdir().expect("tempdir");
    let clone = scratch.path().join("alone").join("memguard");
    run(Command::new("git")
        .arg("clone")
        .arg("--quiet")
        .arg(repo_root())
        .arg(&clone));
    let tools = scratch.path().join("tools");
    let printed = run(Command::new("bash")
        .arg(clone.join("scripts/install-helm.sh"))
        .arg(&tools)
        .env("HOME", scratch.path())
        .current_dir(&clone));
    let bin = tools.join("bin");
    assert_eq!(
        printed.trim(),
        bin.to_string_lossy(),
        "prints its bin folder"
    );
    let helm = run(Command::new(bin.join("helm")).args(["version", "--short"]));
    assert!(helm.starts_with("v4."), "helm v4 expected, got {helm}");
    let kubectl = run(Command::new(bin.join("kubectl")).args(["version", "--client"]));
    assert!(kubectl.contains("Client Version"), "{kubectl}");
    // Idempotent: a second run finds both and downloads nothing.
    let again = run(Command::new("bash")
        .arg(clone.join("scripts/install-helm.sh"))
        .arg(&tools)
        .env("HOME", scratch.path()));
    assert_eq!(again.trim(), bin.to_string_lossy());
}

/// Nothing in scripts/, tests/, docs/, the CI entry point or the README names a path outside the
/// repository (the reference folder the developers keep beside it included).
#[test]
fn nothing_the_project_runs_or_documents_names_a_path_outside_the_repository() {
    let root = repo_root();
    let listed = run(Command::new("git")
        .args([
            "ls-files",
            "scripts",
            "tests",
            "docs",
            ".ci",
            "README.md",
            "bench",
        ])
        .current_dir(&root));
    let needle = ["..", "/shared"].concat();
    let mut offenders = Vec::new();
    for file in listed.lines() {
        let Ok(text) = std::fs::read_to_string(root.join(file)) else {
            continue; // binary fixtures
        };
        for (n, line) in text.lines().enumerate() {
            if line.contains(&needle) {
                offenders.push(format!("{file}:{}: {line}", n + 1));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "paths outside the repository:\n{}",
        offenders.join("\n")
    );
}
