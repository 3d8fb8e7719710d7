#!/usr/bin/env bash
# Host-memory ground truth on this machine's CPUs (root, cgroup v1 memory controller at
# /sys/fs/cgroup/memory): every case of bench/host/measure.py, each in its own fresh memory
# cgroup, appended as one JSON line to bench/host/results/host.jsonl (or $OUT). About 40 minutes
# on 2 cores shared with other work (load average 8-13); every case but the 4-rank and m400 saves
# (up to 9.6 GiB) stays under 8 GiB. Random-init checkpoints are built once under
# $MEMGUARD_HOST_MODELS (default /tmp/memguard-host-models, 4.6 GiB of disk).
#
#   sudo bash bench/host/run.sh                 # the full sweep
#   sudo bash bench/host/run.sh --only load-m150 # the cases whose name contains load-m150
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ $(id -u) != 0 ]]; then
  echo "run.sh: needs root (fresh memory cgroups, drop_caches)" >&2
  exit 2
fi
if [[ ! -w /sys/fs/cgroup/memory/cgroup.procs ]]; then
  echo "run.sh: no writable cgroup v1 memory controller at /sys/fs/cgroup/memory" >&2
  exit 2
fi
out=${OUT:-bench/host/results/host.jsonl}
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
exec nice -n 5 python3 bench/host/measure.py sweep --out "$out" "$@"
