//! The fuzzing smoke run of the suite: for each target, thousands of inputs mutated from its
//! committed corpus the way libFuzzer mutates (erase, insert, flip, shuffle, copy, dictionary
//! words, numbers, crossing two inputs), each run through the target. The corpus replay
//! (`replay.rs`) checks what the fuzzer already found; this checks the neighbourhood of it on
//! every `cargo test`, in seconds, on the stable toolchain and without cargo-fuzz. It is not
//! coverage-guided: the campaign itself is `scripts/fuzz.sh` (docs/reliability.md).
//!
//! Each run takes a fresh seed (a fixed one under `CI=true`) and prints it; `MEMGUARD_FUZZ_SEED=<seed>` replays a run, and
//! `MEMGUARD_FUZZ_MUTATIONS=<n>` sets the inputs per target (default 10,000). An input that
//! breaks its target is saved under `target/fuzz-smoke/` and named in the failure, ready to be
//! added to the corpus as `regression-*` once fixed.

mod common;

use common::fuzz_dir;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

const DEFAULT_MUTATIONS: usize = 10_000;
/// The seed under `CI=true` (any fixed value: the run is deterministic).
const CI_SEED: u64 = 20_261_129;
/// libFuzzer's default cap on a grown input is this order; larger inputs only slow the run.
const MAX_LEN: usize = 8 * 1024;

/// SplitMix64: small, fast, and the same sequence for the same seed everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn env_number(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{name}={value:?}: {e}")),
    )
}

fn corpus(target: &str) -> Vec<Vec<u8>> {
    common::corpus(target)
        .into_iter()
        .map(|(_, data)| data)
        .collect()
}

/// The words of `fuzz/dict/<target>.dict` (libFuzzer's format: one `"word"` per line, `\xNN`
/// and `\\`/`\"` escapes, `#` comments).
fn dictionary(target: &str) -> Vec<Vec<u8>> {
    let path = fuzz_dir().join("dict").join(format!("{target}.dict"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut words = Vec::new();
    for line in text.lines().map(str::trim) {
        let Some(quoted) = line.strip_prefix('"').and_then(|l| l.strip_suffix('"')) else {
            assert!(
                line.is_empty() || line.starts_with('#'),
                "{}: not a dictionary line: {line:?}",
                path.display()
            );
            continue;
        };
        let mut word = Vec::new();
        let bytes = quoted.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            match (bytes[i], bytes.get(i + 1)) {
                (b'\\', Some(b'x')) => {
                    let hex = std::str::from_utf8(&bytes[i + 2..i + 4]).expect("hex escape");
                    word.push(u8::from_str_radix(hex, 16).expect("hex escape"));
                    i += 4;
                }
                (b'\\', Some(&c)) => {
                    word.push(c);
                    i += 2;
                }
                (c, _) => {
                    word.push(c);
                    i += 1;
                }
            }
        }
        words.push(word);
    }
    words
}

/// One libFuzzer-style mutation of `data`, in place.
fn mutate(data: &mut Vec<u8>, rng: &mut Rng, dict: &[Vec<u8>], corpus: &[Vec<u8>]) {
    let pos = |rng: &mut Rng, len: usize| rng.below(len + 1);
    match rng.below(10) {
        // Erase a run of bytes.
        0 if !data.is_empty() => {
            let at = rng.below(data.len());
            let n = 1 + rng.below((data.len() - at).min(16));
            data.drain(at..at + n);
        }
        // Insert one byte, or a run of one repeated byte.
        1 => {
            let at = pos(rng, data.len());
            let n = if rng.below(4) == 0 {
                1 + rng.below(64)
            } else {
                1
            };
            let byte = rng.next() as u8;
            data.splice(at..at, std::iter::repeat_n(byte, n));
        }
        // Change a byte, or flip one bit.
        2 if !data.is_empty() => {
            let at = rng.below(data.len());
            data[at] = rng.next() as u8;
        }
        3 if !data.is_empty() => {
            let at = rng.below(data.len());
            data[at] ^= 1 << rng.below(8);
        }
        // Shuffle a few bytes.
        4 if data.len() > 1 => {
            let at = rng.below(data.len() - 1);
            let n = 2 + rng.below((data.len() - at - 1).min(7));
            for i in (1..n).rev() {
                let j = rng.below(i + 1);
                data.swap(at + i, at + j);
            }
        }
        // Copy a part of the input elsewhere in it.
        5 if !data.is_empty() => {
            let from = rng.below(data.len());
            let n = 1 + rng.below((data.len() - from).min(64));
            let part = data[from..from + n].to_vec();
            let at = pos(rng, data.len());
            if rng.below(2) == 0 {
                data.splice(at..at, part);
            } else {
                let end = (at + n).min(data.len());
                data.splice(at..end, part);
            }
        }
        // Insert or overwrite with a dictionary word.
        6 | 7 if !dict.is_empty() => {
            let word = &dict[rng.below(dict.len())];
            let at = pos(rng, data.len());
            if rng.below(2) == 0 {
                data.splice(at..at, word.iter().copied());
            } else {
                let end = (at + word.len()).min(data.len());
                data.splice(at..end, word.iter().copied());
            }
        }
        // Replace an ASCII number with an interesting one.
        8 => {
            const NUMBERS: &[&str] = &[
                "0",
                "-1",
                "1",
                "255",
                "65536",
                "2147483648",
                "4294967296",
                "9223372036854775807",
                "18446744073709551616",
                "1e308",
                "-0.0",
                "NaN",
                "0.1",
            ];
            let number = NUMBERS[rng.below(NUMBERS.len())].as_bytes();
            match data.iter().position(|b| b.is_ascii_digit()) {
                Some(first) if rng.below(2) == 0 => {
                    let start = first + rng.below(data.len() - first);
                    let start = (start..data.len())
                        .find(|&i| data[i].is_ascii_digit())
                        .unwrap_or(first);
                    let end = (start..data.len())
                        .find(|&i| !data[i].is_ascii_digit())
                        .unwrap_or(data.len());
                    data.splice(start..end, number.iter().copied());
                }
                _ => {
                    let at = pos(rng, data.len());
                    data.splice(at..at, number.iter().copied());
                }
            }
        }
        // Cross over: a prefix of this input, the rest of another.
        _ if !corpus.is_empty() => {
            let other = &corpus[rng.below(corpus.len())];
            let keep = pos(rng, data.len());
            let from = pos(rng, other.len());
            data.truncate(keep);
            data.extend_from_slice(&other[from..]);
        }
        _ => data.push(rng.next() as u8),
    }
    data.truncate(MAX_LEN);
}

fn save_failure(target: &str, seed: u64, index: usize, data: &[u8]) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fuzz-smoke");
    std::fs::create_dir_all(&dir).expect("target/fuzz-smoke");
    let path = dir.join(format!("{target}-seed{seed}-{index}"));
    std::fs::write(&path, data).expect("failing input");
    path
}

#[test]
fn mutated_corpus_inputs_keep_every_target_invariant() {
    // CI's gate is the same inputs every time: a new find on a fresh seed is a bug to fix, not
    // a landing to refuse at random. Anywhere else each run explores a fresh neighbourhood.
    let in_ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let seed = env_number("MEMGUARD_FUZZ_SEED").unwrap_or_else(|| {
        if in_ci {
            CI_SEED
        } else {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        }
    });
    let mutations = env_number("MEMGUARD_FUZZ_MUTATIONS").map_or(DEFAULT_MUTATIONS, |n| n as usize);
    eprintln!("mutation smoke: MEMGUARD_FUZZ_SEED={seed}, {mutations} inputs per target");
    for (index, (name, target)) in memguard_fuzz_targets::TARGETS.iter().enumerate() {
        let started = Instant::now();
        let inputs = corpus(name);
        let dict = dictionary(name);
        assert!(!inputs.is_empty(), "corpus {name} is empty");
        let mut rng = Rng(seed ^ (index as u64).wrapping_mul(0xA24B_AED4_963E_E407));
        for i in 0..mutations {
            let mut data = inputs[rng.below(inputs.len())].clone();
            // Stacked mutations, as libFuzzer does (up to 5 per input).
            for _ in 0..1 + rng.below(5) {
                mutate(&mut data, &mut rng, &dict, &inputs);
            }
            if std::panic::catch_unwind(|| target(&data)).is_err() {
                let saved = save_failure(name, seed, i, &data);
                panic!(
                    "{name}: mutated input {i} breaks the target (MEMGUARD_FUZZ_SEED={seed}); \
                     saved to {}",
                    saved.display()
                );
            }
        }
        eprintln!(
            "{name}: {mutations} mutated inputs from {} corpus files and {} words, {:.1} s",
            inputs.len(),
            dict.len(),
            started.elapsed().as_secs_f64()
        );
    }
}

/// The smoke run finds what it is meant to find: a mutation operator that never produced, say,
/// a dictionary word or a grown input would make the test above pass vacuously.
#[test]
fn the_mutations_reach_dictionary_words_and_new_lengths() {
    let dict = vec![b"memguard.io/lora-rank".to_vec()];
    let corpus = vec![b"batch=8".to_vec()];
    let mut rng = Rng(7);
    let (mut with_word, mut longer, mut shorter, mut changed) = (0, 0, 0, 0);
    for _ in 0..2_000 {
        let mut data = corpus[0].clone();
        mutate(&mut data, &mut rng, &dict, &corpus);
        let text = String::from_utf8_lossy(&data);
        with_word += usize::from(text.contains("memguard.io/lora-rank"));
        longer += usize::from(data.len() > corpus[0].len());
        shorter += usize::from(data.len() < corpus[0].len());
        changed += usize::from(data != corpus[0]);
    }
    assert!(with_word > 100, "dictionary words in {with_word} of 2000");
    assert!(
        longer > 300 && shorter > 100,
        "longer {longer}, shorter {shorter}"
    );
    assert!(changed > 1_800, "changed {changed} of 2000");
}
