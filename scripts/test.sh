#!/usr/bin/env bash
# The whole test suite: formatting, lints, every Rust test (unit, snapshot, real-binary
# end-to-end, real cgroup v1 when root), the chart tests, the Python client and survival
# tests, then the image (built once, scripts/build-image.sh) and the pods `memguard mutate`
# writes, run by podman with that image as their sidecar (tests/podman). Installs what it needs
# first (scripts/install-deps.sh).
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
# tests/launch: the webhook's rewrite of stock HF launches, re-read by transformers' own parser.
MEMGUARD_BIN=$PWD/target/debug/memguard MEMGUARD_SIDECAR_BIN=$PWD/target/debug/memguard-sidecar python3 -m pytest -q -rs --durations=15 clients/python/tests bench/survival bench/gpu bench/host tests/launch

step "image: scripts/build-image.sh (once; the pod tests reuse it)"
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/scripts/containers.conf}
export MEMGUARD_IMAGE=${MEMGUARD_IMAGE:-localhost/memguard:dev}
image_start=$SECONDS
if command -v podman >/dev/null 2>&1 && [[ $(id -u) -eq 0 ]]; then
  bash scripts/build-image.sh "$MEMGUARD_IMAGE"
elif [[ ${CI:-} == true ]]; then
  echo "the image cannot be built under CI=true: podman missing or not root" >&2
  exit 1
else
  echo "SKIP: the image (needs root and podman; scripts/install-deps.sh installs it)"
fi
echo "image step: $((SECONDS - image_start)) s"

step "image and pods under podman (tests/podman)"
pods_start=$SECONDS
MEMGUARD_BIN=$PWD/target/debug/memguard python3 -m pytest -q -rs --durations=5 tests/podman --ignore tests/podman/test_prometheus.py
echo "podman step: $((SECONDS - pods_start)) s"

step "a real Prometheus scrapes the pod and the webhook container (tests/podman/test_prometheus.py)"
prom_start=$SECONDS
export PATH=${MEMGUARD_TOOLS:-$HOME/.cache/memguard-tools}/bin:$PATH
MEMGUARD_BIN=$PWD/target/debug/memguard python3 -m pytest -q -rs tests/podman/test_prometheus.py
echo "prometheus step: $((SECONDS - prom_start)) s"
