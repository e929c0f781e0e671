#!/usr/bin/env bash
# Builds the rebound-operator and rebound-sidecar container images, daemonless, into OCI
# archives:
#
#   BUILD_DIR/rebound-operator-<version>.oci.tar   (ghcr.io/rebound-dev/rebound-operator:<version>)
#   BUILD_DIR/rebound-sidecar-<version>.oci.tar    (ghcr.io/rebound-dev/rebound-sidecar:<version>)
#
# Usage: dev/build-images.sh [BUILD_DIR]      (default: target/images)
#
# The binaries are built on the host, statically linked (glibc with crt-static), stripped;
# images/*/Dockerfile copy them FROM scratch. buildah (Debian's) builds the images with
# its own storage under BUILD_DIR/buildah (vfs driver, no daemon, nothing else touched).
# <version> is the workspace version in Cargo.toml, the chart's appVersion.
# The last line printed on stdout is BUILD_DIR.
#
# Environment:
#   REBOUND_IMAGE_REGISTRY  image name prefix (default: ghcr.io/rebound-dev)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
build_dir="$(realpath -m "${1:-$repo_root/target/images}")"
registry="${REBOUND_IMAGE_REGISTRY:-ghcr.io/rebound-dev}"
target=x86_64-unknown-linux-gnu
log() { echo "build-images: $*" >&2; }
die() {
  echo "error: $*" >&2
  exit 1
}

command -v buildah >/dev/null || die "buildah is not installed (apt-get install -y buildah)"
version="$(awk -F'"' '/^\[workspace.package\]/ { p = 1 } p && $1 ~ /^version *= */ { print $2; exit }' Cargo.toml)"
[[ -n "$version" ]] || die "could not read the workspace version from Cargo.toml"
revision="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
# Reproducible: the commit's time, not the build's.
created="$(TZ=UTC git log -1 --format=%cd --date=format-local:%Y-%m-%dT%H:%M:%SZ 2>/dev/null || echo 1970-01-01T00:00:00Z)"

start=$SECONDS
log "cargo build --release --target $target (static) of rebound-operator and rebound-sidecar"
# Stripped and without debug info: the image carries only what runs.
RUSTFLAGS='-C target-feature=+crt-static' CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=symbols \
  cargo build --release --locked --target "$target" \
  -p rebound-operator --bin rebound-operator -p rebound-sidecar --bin rebound-sidecar >&2
log "binaries built after $((SECONDS - start))s"

mkdir -p "$build_dir"
storage=(--root "$build_dir/buildah/root" --runroot "$build_dir/buildah/run" --storage-driver vfs)
for component in operator sidecar; do
  name="rebound-$component"
  binary="target/$target/release/$name"
  [[ -x "$binary" ]] || die "$binary was not built"
  if readelf -d "$binary" 2>/dev/null | grep -q NEEDED; then
    die "$binary is dynamically linked"
  fi
  context="$build_dir/context-$component"
  rm -rf "$context"
  mkdir -p "$context"
  cp "$binary" "$context/$name"
  image="$registry/$name:$version"
  archive="$build_dir/$name-$version.oci.tar"
  log "buildah build $image"
  buildah "${storage[@]}" build --quiet --format oci --isolation chroot \
    --build-arg "VERSION=$version" --build-arg "REVISION=$revision" --build-arg "CREATED=$created" \
    --timestamp 0 -f "images/$component/Dockerfile" -t "$image" "$context" >&2
  rm -f "$archive"
  buildah "${storage[@]}" push --quiet "$image" "oci-archive:$archive:$image" >&2
  buildah "${storage[@]}" rmi "$image" >/dev/null 2>&1 || true
  rm -rf "$context"
  log "$archive ($(du -h "$archive" | cut -f1))"
done
log "done in $((SECONDS - start))s"
echo "$build_dir"
