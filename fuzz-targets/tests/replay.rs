//! Replays every committed corpus file (`fuzz/corpus/<target>/*`, seeded from the fixtures and
//! grown by `scripts/fuzz.sh`) through its target, on the stable toolchain: every input the
//! fuzzer found interesting, and every crash it found (kept as a regression), must pass. Beside
//! it, `mutation_smoke.rs` fuzzes around these inputs on every run; the libFuzzer run itself is
//! `scripts/fuzz.sh smoke` (docs/reliability.md says why it is not in CI).

mod common;

use common::{corpus, fuzz_dir};
use std::collections::BTreeSet;
use std::path::Path;

fn names_in(dir: &Path, strip: &str) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").file_name())
        .filter_map(|n| {
            n.to_str()
                .and_then(|n| n.strip_suffix(strip))
                .map(str::to_string)
        })
        .collect()
}

#[test]
fn every_committed_corpus_file_passes_its_target() {
    let mut total = 0;
    for (name, target) in memguard_fuzz_targets::TARGETS {
        let files = corpus(name);
        assert!(
            files.len() >= 3,
            "corpus {name} has {} files; it is seeded from the fixtures",
            files.len()
        );
        for (file, data) in &files {
            let run = std::panic::catch_unwind(|| target(data));
            assert!(run.is_ok(), "{name}: {} fails", file.display());
        }
        total += files.len();
    }
    eprintln!("replayed {total} corpus files");
}

/// The replay above covers every corpus only if the targets it knows are all there are: the
/// cargo-fuzz binaries, their sources, the corpus directories and the dictionaries name the same
/// targets as `TARGETS`.
#[test]
fn the_replayed_targets_are_every_fuzz_target_and_corpus() {
    let known: BTreeSet<String> = memguard_fuzz_targets::TARGETS
        .iter()
        .map(|(name, _)| name.to_string())
        .collect();
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz/Cargo.toml");
    let mut bins = BTreeSet::new();
    let mut in_bin = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_bin = line == "[[bin]]";
        } else if in_bin && let Some(name) = line.strip_prefix("name = ") {
            bins.insert(name.trim_matches('"').to_string());
        }
    }
    assert_eq!(bins, known, "fuzz/Cargo.toml's [[bin]]s");
    assert_eq!(
        names_in(&fuzz_dir().join("fuzz_targets"), ".rs"),
        known,
        "fuzz/fuzz_targets/"
    );
    assert_eq!(
        names_in(&fuzz_dir().join("corpus"), ""),
        known,
        "fuzz/corpus/"
    );
    assert_eq!(
        names_in(&fuzz_dir().join("dict"), ".dict"),
        known,
        "fuzz/dict/"
    );
}
