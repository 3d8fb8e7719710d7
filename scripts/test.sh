#!/usr/bin/env bash
# The whole test suite: formatting, lints, every Rust test (unit, snapshot, real-binary
# end-to-end, real cgroup v1 when root), the chart tests, and the Python client and survival
# tests. Installs what it needs first (scripts/install-deps.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
export PATH="${MEMGUARD_TOOLS:-$HOME/.cache/memguard-tools}/bin:$PATH"

step() { printf '\n=== %s ===\n' "$*"; }

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test"
cargo build --workspace --locked --bins
cargo test --workspace --locked --no-fail-fast

step "python client and survival tests"
python3 -m pip install -q --disable-pip-version-check ./clients/python
# In CI (root, cgroup v1) the survival proof must run, not skip; it uses the sidecar built above.
if [[ ${CI:-} == true ]]; then export MEMGUARD_REQUIRE_SURVIVAL=1; fi
MEMGUARD_SIDECAR_BIN=$PWD/target/debug/memguard-sidecar python3 -m pytest -q -rs clients/python/tests bench/survival bench/gpu
