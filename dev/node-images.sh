#!/usr/bin/env bash
# Builds the two images the local node needs besides Rebound's own (dev/build-images.sh),
# static and FROM scratch, into OCI archives cached by the hash of their sources:
#
#   rebound.dev/pause:1          the Pods' sandbox (dev/node/pause)
#   rebound.dev/node-worker:dev  the node tests' worker, on clients/go (dev/node/worker),
#                                also tagged example/worker:1.0: on the local node the
#                                examples' placeholder worker image is this demo worker
#
#   dev/node-images.sh [--import STATE_DIR] [ARCHIVE...]
#
# With --import, loads them and every ARCHIVE given (e.g. target/images/*.oci.tar) into the
# containerd of the node of STATE_DIR (namespace k8s.io), where Pods find them by their
# exact tag without a registry. The last line printed on stdout is the archives' dir.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/usage.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/usage.sh"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { echo "node-images: $*" >&2; }
die() {
  echo "error: $*" >&2
  exit 1
}

import_state=""
archives=()
while (($#)); do
  case "$1" in
    --import)
      (($# >= 2)) || die "--import needs a STATE_DIR"
      import_state="$2"
      shift 2
      ;;
    -h | --help)
      usage_from_header "${BASH_SOURCE[0]}"
      exit 0
      ;;
    -*) die "unknown option '$1'" ;;
    *)
      archives+=("$(realpath "$1")")
      shift
      ;;
  esac
done

command -v buildah >/dev/null || die "buildah is not installed (apt-get install -y buildah)"
command -v go >/dev/null || die "go is not on PATH"

key="$(cd "$repo_root" && {
  go env GOVERSION
  git ls-files -s dev/node clients/go 2>/dev/null
  # Uncommitted edits count too.
  find dev/node clients/go -type f \( -name '*.go' -o -name 'go.*' -o -name Dockerfile \) -print0 |
    sort -z | xargs -0 sha256sum
} | sha256sum | cut -c1-16)"
cache="${REBOUND_CACHE:-${HOME:?HOME is not set}/.cache/rebound}/node-images/$key"

if [[ ! -f "$cache/.complete" ]]; then
  start=$SECONDS
  rm -rf "$cache"
  mkdir -p "$cache"
  storage=(--root "$cache/buildah/root" --runroot "$cache/buildah/run" --storage-driver vfs)
  build() { # build NAME IMAGE MODULE_DIR BINARY
    local name="$1" image="$2" module="$3" binary="$4" context="$cache/context-$1"
    mkdir -p "$context"
    (cd "$module" && CGO_ENABLED=0 GOWORK=off GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false" \
      go build -trimpath -ldflags='-s -w' -o "$context/$binary" .)
    buildah "${storage[@]}" build --quiet --format oci --isolation chroot --timestamp 0 \
      -f "$module/Dockerfile" -t "$image" "$context" >/dev/null
    buildah "${storage[@]}" push --quiet "$image" "oci-archive:$cache/$name.oci.tar:$image" >&2
    rm -rf "$context"
  }
  build pause rebound.dev/pause:1 "$repo_root/dev/node/pause" pause
  build node-worker rebound.dev/node-worker:dev "$repo_root/dev/node/worker" node-worker
  rm -rf "$cache/buildah"
  touch "$cache/.complete"
  log "built in $((SECONDS - start))s: $cache"
fi

if [[ -n "$import_state" ]]; then
  state="$(cd "$import_state" && pwd)"
  socket="$state/node/containerd/containerd.sock"
  [[ -S "$socket" ]] || die "no containerd of a node at $socket (dev/cluster-up.sh --node $import_state)"
  for archive in "$cache/pause.oci.tar" "$cache/node-worker.oci.tar" "${archives[@]}"; do
    ctr --address "$socket" --namespace k8s.io images import "$archive" >/dev/null ||
      die "ctr could not import $archive"
    log "imported $(basename "$archive")"
  done
  ctr --address "$socket" --namespace k8s.io images tag --force rebound.dev/node-worker:dev \
    docker.io/example/worker:1.0 >/dev/null || die "ctr could not tag the demo worker"
fi
echo "$cache"
