#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo-fuzz, libFuzzer) of memguard's parsers and of the webhook's whole
# review path. The targets' bodies live in fuzz-targets/ (also replayed by `cargo test`); fuzz/ is
# the cargo-fuzz crate, its corpora under fuzz/corpus/<target>/ are committed.
#
#   scripts/fuzz.sh list                      the targets
#   scripts/fuzz.sh build                     build every target (instrumented, release)
#   scripts/fuzz.sh run TARGET [SECONDS]      fuzz one target (default 300 s), growing its corpus
#   scripts/fuzz.sh cmin TARGET               minimize a corpus (edge cover) before committing it
#   scripts/fuzz.sh smoke [SECONDS]           every target for SECONDS each (default 5)
#   scripts/fuzz.sh cov TARGET                the corpus's coverage (libFuzzer's cov/ft after replay)
#
# Stable toolchain, no RUSTC_BOOTSTRAP: without a sanitizer (`-s none`) every flag cargo-fuzz
# passes to rustc is a stable one (-Cpasses=sancov-module, -Cllvm-args=-sanitizer-coverage-*,
# --cfg fuzzing, -Cdebug-assertions); only the sanitizers need nightly's -Zsanitizer. And no
# sanitizer is needed: the workspace forbids unsafe code, so AddressSanitizer would only halve
# the speed; panics, overflow checks (debug-assertions are on) and timeouts/OOMs are what
# libFuzzer catches here.
# 16 codegen units instead of cargo-fuzz's 1: the instrumented release build of k8s-openapi & co
# with one codegen unit did not finish in 35 minutes on 2 shared cores; 16 builds several times
# faster for somewhat slower fuzzing.
# fuzz/dict/<target>.dict (written by fuzz/dicts.py) holds the words the parsers compare against:
# without a sanitizer libFuzzer cannot see `memcmp`, so it would not learn them by itself.
# Be frugal on shared machines: this runs under `nice -n 19`, one target at a time.
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO_FUZZ_VERSION=0.13.2
# The same flags for every subcommand, so that each reuses the one build.
BUILD=(-s none --debug-assertions --codegen-units 16)

targets() { sed -n 's/^name = "\([a-z_]*\)"$/\1/p' fuzz/Cargo.toml | grep -v '^memguard-fuzz$'; }

ensure_cargo_fuzz() {
  if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz $CARGO_FUZZ_VERSION" >&2
    cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION" >&2
  fi
  # The fuzz crate is its own workspace: pin it to the versions the main workspace tested.
  cp Cargo.lock fuzz/Cargo.lock
}

fuzz() { # fuzz TARGET CORPUS [libFuzzer args...]
  local target=$1 corpus=$2
  shift 2
  mkdir -p "$corpus" fuzz/artifacts
  nice -n 19 cargo fuzz run "${BUILD[@]}" "$target" "$corpus" -- \
    -artifact_prefix="fuzz/artifacts/$target-" -dict="fuzz/dict/$target.dict" \
    -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 "$@"
}

cmd=${1:-list}
case $cmd in
  list) targets ;;
  build)
    ensure_cargo_fuzz
    nice -n 19 cargo fuzz build "${BUILD[@]}"
    ;;
  run)
    ensure_cargo_fuzz
    fuzz "$2" "fuzz/corpus/$2" -max_total_time="${3:-300}"
    ;;
  cmin)
    # The smallest set of inputs that covers every edge the corpus covers (libFuzzer's set-cover
    # merge, hit counts ignored): several times smaller than `cargo fuzz cmin`, which keeps an
    # input per hit-count bucket too. Inputs named regression-* (crashes fixed) are always kept.
    ensure_cargo_fuzz
    merged=$(mktemp -d)
    nice -n 19 cargo fuzz run "${BUILD[@]}" "$2" "$merged" "fuzz/corpus/$2" -- \
      -set_cover_merge=1 -use_counters=0 -timeout=10 -rss_limit_mb=2048
    for r in "fuzz/corpus/$2"/regression-*; do
      [ -e "$r" ] || continue
      rm -f "$merged/$(sha1sum "$r" | cut -d' ' -f1)"
      cp "$r" "$merged/"
    done
    rm -rf "fuzz/corpus/$2"
    mv "$merged" "fuzz/corpus/$2"
    chmod 755 "fuzz/corpus/$2"
    ;;
  cov)
    ensure_cargo_fuzz
    fuzz "$2" "fuzz/corpus/$2" -runs=0
    ;;
  smoke)
    ensure_cargo_fuzz
    for t in $(targets); do
      # A scratch copy: the smoke run must not grow the committed corpus.
      scratch=$(mktemp -d)
      cp -r "fuzz/corpus/$t/." "$scratch/"
      fuzz "$t" "$scratch" -max_total_time="${2:-5}"
      rm -rf "$scratch"
    done
    ;;
  *)
    echo "usage: $0 list|build|run TARGET [SECONDS]|cmin TARGET|cov TARGET|smoke [SECONDS]" >&2
    exit 2
    ;;
esac
