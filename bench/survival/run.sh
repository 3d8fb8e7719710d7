#!/bin/sh
# The survival proof in one command: the same numpy training run in a memory-limited cgroup v1
# dies of the kernel's OOM killer without memguard and finishes with the real memguard-sidecar.
# Needs root and a writable /sys/fs/cgroup/memory; prints SKIP and exits 0 otherwise.
#
#   bench/survival/run.sh                 # builds the sidecar (release) if needed, runs 3 arms
#   bench/survival/run.sh --limit-mib 192 # any survival.py option
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
python=${PYTHON:-python3}

if ! "$python" -c 'import numpy' 2>/dev/null; then
    echo "survival: installing numpy" >&2
    "$python" -m pip install --quiet numpy
fi
if [ -z "${MEMGUARD_SIDECAR_BIN:-}" ]; then
    if [ "${MEMGUARD_SURVIVAL_BUILD:-release}" = debug ]; then
        (cd "$repo" && cargo build --quiet -p memguard-sidecar)
        MEMGUARD_SIDECAR_BIN="$repo/target/debug/memguard-sidecar"
    else
        (cd "$repo" && cargo build --quiet --profile sidecar -p memguard-sidecar)
        MEMGUARD_SIDECAR_BIN="$repo/target/sidecar/memguard-sidecar"
    fi
    export MEMGUARD_SIDECAR_BIN
fi
status=0
"$python" "$here/survival.py" "$@" || status=$?
if [ "$status" -eq 77 ]; then
    exit 0   # SKIP already printed
fi
exit "$status"
