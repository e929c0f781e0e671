#!/usr/bin/env bash
# Builds Helm from the Go module proxy into a cache outside the repository:
#
#   ${REBOUND_CACHE:-$HOME/.cache/rebound}/tools/helm/<version>/bin/helm
#
# Usage: dev/build-helm.sh [--print-bin-dir] [--force]
#
#   --print-bin-dir  print the bin dir and exit (builds nothing)
#   --force          rebuild even if the cached binary is up to date
#
# A second run with the same version, flags and Go version is a no-op.
# The last line printed on stdout is always the bin dir.
#
# Environment:
#   REBOUND_CACHE         cache root (default: $HOME/.cache/rebound)
#   REBOUND_HELM_VERSION  helm.sh/helm/v4 version to build (default below)
#   REBOUND_GO_BUILD_P    go build -p (default: number of CPUs)
set -euo pipefail

helm_version="${REBOUND_HELM_VERSION:-v4.3.2}"

print_only=0
force=0
for arg in "$@"; do
  case "$arg" in
    --print-bin-dir) print_only=1 ;;
    --force) force=1 ;;
    -h | --help)
      sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "error: unknown argument '$arg' (try --help)" >&2
      exit 2
      ;;
  esac
done

die() {
  echo "error: $*" >&2
  exit 1
}
log() { echo "build-helm: $*" >&2; }

[[ "$helm_version" =~ ^v4\.[0-9]+\.[0-9]+$ ]] || die "REBOUND_HELM_VERSION must look like v4.X.Y (got '$helm_version')"

cache_root="${REBOUND_CACHE:-${HOME:?HOME is not set}/.cache/rebound}"
version_dir="$cache_root/tools/helm/$helm_version"
bin_dir="$version_dir/bin"

if ((print_only)); then
  echo "$bin_dir"
  exit 0
fi

command -v go >/dev/null || die "go is not on PATH (needed to build helm)"

export CGO_ENABLED=0 GOWORK=off GOTOOLCHAIN=local GOFLAGS="-mod=mod -buildvcs=false"
go_version="$(go env GOVERSION)"
jobs="${REBOUND_GO_BUILD_P:-$(nproc 2>/dev/null || echo 2)}"
# helm prints this as its version (`helm version --template '{{.Version}}'`).
ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version"
stamp="$(echo "helm=$helm_version go=$go_version ldflags=$ldflags" | sha256sum | cut -d' ' -f1)"

up_to_date() {
  [[ -f "$version_dir/stamp" && "$(cat "$version_dir/stamp")" == "$stamp" && -x "$bin_dir/helm" ]]
}

mkdir -p "$version_dir"
# One build at a time per version.
exec 9>"$version_dir/.lock"
flock 9

if ((force == 0)) && up_to_date; then
  log "up to date: helm $helm_version"
  echo "$bin_dir"
  exit 0
fi

log "building helm $helm_version with $go_version (-p $jobs); a cold build takes a few minutes"
start=$SECONDS
tmp_bin="$(mktemp -d "$version_dir/bin.tmp.XXXXXX")"
chmod 755 "$tmp_bin"
# Nothing reuses the compiler cache once the binary is cached.
go_cache="$(mktemp -d "$version_dir/gocache.tmp.XXXXXX")"
export GOCACHE="$go_cache"
trap 'rm -rf "$tmp_bin" "$go_cache"' EXIT

GOBIN="$tmp_bin" go install -p "$jobs" -trimpath -ldflags "$ldflags" \
  "helm.sh/helm/v4/cmd/helm@$helm_version" || die "building helm $helm_version failed"
[[ -x "$tmp_bin/helm" ]] || die "the build did not produce helm"
got="$("$tmp_bin/helm" version --template '{{.Version}}' 2>&1 || true)"
[[ "$got" == "$helm_version" ]] || die "helm version says '$got', expected $helm_version"

rm -rf "$bin_dir"
mv "$tmp_bin" "$bin_dir"
rm -rf "$go_cache"
trap - EXIT
echo "$stamp" >"$version_dir/stamp"
log "built in $((SECONDS - start))s: $(du -sh "$bin_dir/helm" | cut -f1)"
echo "$bin_dir"
