#!/usr/bin/env bash
# One device run, under 10 minutes on one H100: every case of bench/gpu/measure.py (full, LoRA,
# QLoRA when bitsandbytes imports; padded, packed and expandable-segment LoRA runs), each next to
# `memguard estimate` for the same config. Needs torch, transformers, peft (and bitsandbytes for
# QLoRA) and the release binary, built here and carried with the tree:
#
#   cargo build --release -p memguard
#   # device tool: command "bash bench/gpu/run.sh", carry ["target/release/memguard"]
#
# Writes $OUT/gpu-measured.csv (the rows, in bench/accuracy/collected/'s columns) and
# $OUT/cases.jsonl (every figure); $OUT defaults to bench/gpu/out. Extra arguments go to
# `measure.py all` (e.g. --only llama-full-b4-s1024).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-bench/gpu/out}
bin=${MEMGUARD_BIN:-target/release/memguard}
if [[ ! -x $bin ]]; then
  echo "run.sh: no $bin: build it with cargo build --release -p memguard and carry it" >&2
  exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
exec python3 bench/gpu/measure.py all --device cuda --out "$out" --memguard "$bin" --budget-s 480 "$@"
