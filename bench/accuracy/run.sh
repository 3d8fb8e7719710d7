#!/usr/bin/env bash
# Scores the estimator against every measured run in bench/accuracy/data/ and prints a
# per-row table plus, per device kind, the median absolute percentage error, the worst
# under- and over-estimate and the OOM fit tests. Pass --components for each breakdown,
# --in-sample for the rows as the shipped constants score them.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec cargo run --quiet --release -p memguard-estimator --example accuracy -- "$@"
