//! What the replay and the mutation smoke run share: where the cargo-fuzz crate is, and a
//! target's committed corpus.

use std::path::{Path, PathBuf};

/// The cargo-fuzz crate: `corpus/`, `dict/`, `fuzz_targets/`, `Cargo.toml`.
pub fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// Every file of `fuzz/corpus/<target>/`, sorted by name, with its bytes. A file gone between
/// listing and reading was reduced away by a fuzzer running on the same corpus
/// (`scripts/fuzz.sh run`) and is skipped; any other error fails the test.
pub fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = fuzz_dir().join("corpus").join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    files.sort();
    files
        .into_iter()
        .filter_map(|f| match std::fs::read(&f) {
            Ok(data) => Some((f, data)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => panic!("{}: {e}", f.display()),
        })
        .collect()
}
