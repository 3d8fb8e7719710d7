#!/usr/bin/env bash
# One device run, about 3 minutes on one H200 (under 8): bench/gpu/trainstart.py, the train-start
# plan forced down by a per-device budget and the growth back on measured CUDA peaks, with a
# real HF Trainer (Llama 3.2 1B's shape, random init, bf16, 16 × 1024 configured) and the real
# sidecar binary, built here and carried with the tree (the device machine has torch and
# transformers, and no network):
#
#   cargo build -p memguard-sidecar
#   # device tool: command "bash bench/gpu/trainstart.sh", carry ["target/debug/memguard-sidecar"]
#
# Writes $OUT/gpu-trainstart.json ($OUT defaults to bench/gpu/out). Extra arguments go to
# trainstart.py (e.g. --budget-gib 60 --steps 60).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-bench/gpu/out}
bin=${MEMGUARD_SIDECAR_BIN:-target/debug/memguard-sidecar}
if [[ ! -x $bin ]]; then
  echo "trainstart.sh: no $bin: build it with cargo build -p memguard-sidecar and carry it" >&2
  exit 2
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
export PYTHONUNBUFFERED=1
exec timeout 470 python3 bench/gpu/trainstart.py --out "$out" --sidecar "$bin" "$@"
