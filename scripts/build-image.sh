#!/usr/bin/env bash
# Builds the memguard image from the repository's Dockerfile with buildah: no daemon, and no
# registry needed. Where the Dockerfile's bases cannot be pulled, scripts/image-bases.sh builds
# them from Debian packages and this machine's Rust toolchain and tags them under the
# Dockerfile's own names, so the same Dockerfile builds here and where the registries answer.
#
# Usage: scripts/build-image.sh [TAG]      (default localhost/memguard:dev)
#   MEMGUARD_IMAGE_PULL=0   never try the registries (build missing bases at once)
# Prints the image's size at the end. Needs root (rootful containers-storage).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tag=${1:-localhost/memguard:dev}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$root/scripts/containers.conf}

for tool in buildah podman; do
  command -v "$tool" >/dev/null || {
    echo "build-image: $tool is missing (scripts/install-deps.sh installs it)" >&2
    exit 1
  }
done

rust_version=$(sed -n 's/^ARG RUST_VERSION=//p' "$root/Dockerfile")
declare -A bases=(
  [rust]="docker.io/library/rust:${rust_version}-bookworm"
  [distroless]="gcr.io/distroless/cc-debian12:nonroot"
)
for kind in rust distroless; do
  image=${bases[$kind]}
  if buildah inspect --type image "$image" >/dev/null 2>&1; then
    continue
  fi
  if [[ ${MEMGUARD_IMAGE_PULL:-1} != 0 ]] && timeout 60 buildah pull -q "$image" >/dev/null 2>&1; then
    echo "build-image: pulled $image" >&2
    continue
  fi
  echo "build-image: $image cannot be pulled; building it locally" >&2
  bash "$root/scripts/image-bases.sh" "$kind" "$rust_version"
done

old=$(podman image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
start=$SECONDS
# --network host: the build stage fetches crates (crates.io) with cargo. --pull-never: the bases
# are local now. The cargo registry and target directory are cache mounts (Dockerfile), kept by
# buildah between builds, so a rebuild compiles only what changed; no intermediate layers are
# kept (`--no-cache`: the build stage is 1 GB), and a failed build leaves no container behind.
buildah bud --quiet --pull-never --network host --no-cache --force-rm \
  --build-arg RUST_VERSION="$rust_version" \
  -f "$root/Dockerfile" -t "$tag" "$root" >/dev/null
# The image this tag named before, now untagged: removed (a rebuild leaves no 50 MB orphan).
new=$(podman image inspect --format '{{.Id}}' "$tag")
if [[ -n $old && $old != "$new" ]]; then podman rmi "$old" >/dev/null 2>&1 || true; fi
size=$(podman image inspect --format '{{.Size}}' "$tag")
echo "build-image: built $tag in $((SECONDS - start)) s: $((size / 1024 / 1024)) MiB ($size bytes)"
