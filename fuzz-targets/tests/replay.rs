//! Replays every committed corpus file (`fuzz/corpus/<target>/*`, seeded from the fixtures and
//! grown by `scripts/fuzz.sh`) through its target, on the stable toolchain: every input the
//! fuzzer found interesting, and every crash it found (kept as a regression), must pass.

use std::path::{Path, PathBuf};

fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target)
}

#[test]
fn every_committed_corpus_file_passes_its_target() {
    let mut total = 0;
    for (name, target) in memguard_fuzz_targets::TARGETS {
        let dir = corpus(name);
        let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
            .map(|e| e.expect("directory entry").path())
            .collect();
        files.sort();
        assert!(
            files.len() >= 3,
            "corpus {name} has {} files; it is seeded from the fixtures",
            files.len()
        );
        for file in &files {
            let data = std::fs::read(file).expect("corpus file");
            let run = std::panic::catch_unwind(|| target(&data));
            assert!(run.is_ok(), "{name}: {} fails", file.display());
        }
        total += files.len();
    }
    eprintln!("replayed {total} corpus files");
}
