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
cb_name=build-helm
# shellcheck source-path=SCRIPTDIR source=lib/cached-build.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/cached-build.sh"
cb_parse_flags "$@"

[[ "$helm_version" =~ ^v4\.[0-9]+\.[0-9]+$ ]] || cb_die "REBOUND_HELM_VERSION must look like v4.X.Y (got '$helm_version')"

cache_root="${REBOUND_CACHE:-${HOME:?HOME is not set}/.cache/rebound}"
version_dir="$cache_root/tools/helm/$helm_version"

if ((cb_print_only)); then
  echo "$version_dir/bin"
  exit 0
fi

command -v go >/dev/null || cb_die "go is not on PATH (needed to build helm)"

export CGO_ENABLED=0 GOWORK=off GOTOOLCHAIN=local GOFLAGS="-mod=mod -buildvcs=false"
go_version="$(go env GOVERSION)"
jobs="${REBOUND_GO_BUILD_P:-$(nproc 2>/dev/null || echo 2)}"
# helm prints this as its version (`helm version --template '{{.Version}}'`).
ldflags="-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version"
stamp="$(echo "helm=$helm_version go=$go_version ldflags=$ldflags" | sha256sum | cut -d' ' -f1)"

build() {
  local out="$1"
  cb_log "building helm $helm_version with $go_version (-p $jobs); a cold build takes a few minutes"
  GOBIN="$out" go install -p "$jobs" -trimpath -ldflags "$ldflags" \
    "helm.sh/helm/v4/cmd/helm@$helm_version" || cb_die "building helm $helm_version failed"
  local got
  got="$("$out/helm" version --template '{{.Version}}' 2>&1 || true)"
  [[ "$got" == "$helm_version" ]] || cb_die "helm version says '$got', expected $helm_version"
}

cb_build "$version_dir" "$stamp" "helm $helm_version" build helm
