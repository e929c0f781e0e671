#!/usr/bin/env bash
# Builds Prometheus and promtool from the Go module proxy into a cache outside the
# repository (rules and alert tests: monitoring/; a real Prometheus: dev/prometheus.sh):
#
#   ${REBOUND_CACHE:-$HOME/.cache/rebound}/tools/prometheus/<version>/bin/{prometheus,promtool}
#
# Usage: dev/build-prometheus.sh [--print-bin-dir] [--force]
#
#   --print-bin-dir  print the bin dir and exit (builds nothing)
#   --force          rebuild even if the cached binaries are up to date
#
# One `go install` of both commands (they share one compile), CGO off, with only the
# Kubernetes service discovery (`remove_all_sd,enable_kubernetes_sd`: no cloud SDKs to
# compile) and without `builtinassets` (it needs a generated web/ui/embed.go that the module
# lacks): the web UI pages answer 404, the HTTP API works. Downloads go to the shared Go
# module cache. A second run with the same version, tags and Go version is a no-op.
# The last line printed on stdout is always the bin dir.
#
# Environment:
#   REBOUND_CACHE               cache root (default: $HOME/.cache/rebound)
#   REBOUND_PROMETHEUS_VERSION  github.com/prometheus/prometheus module version (below)
#   REBOUND_GO_BUILD_P          go build -p (default: number of CPUs)
set -euo pipefail

# The module's v0.3XX.Y is Prometheus 3.XX.Y; v0.316.0's go.mod has no replace/exclude
# directive, which `go install pkg@version` refuses.
module_version="${REBOUND_PROMETHEUS_VERSION:-v0.316.0}"
cb_name=build-prometheus
# shellcheck source-path=SCRIPTDIR source=lib/cached-build.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/cached-build.sh"
cb_parse_flags "$@"

[[ "$module_version" =~ ^v0\.([0-9]+)\.([0-9]+)$ ]] ||
  cb_die "REBOUND_PROMETHEUS_VERSION must look like v0.3XX.Y (got '$module_version')"
minor="${BASH_REMATCH[1]}"
patch="${BASH_REMATCH[2]}"
((minor >= 300)) || cb_die "REBOUND_PROMETHEUS_VERSION $module_version is not a Prometheus 3 module version"
prom_version="3.$((minor - 300)).$patch"

cache_root="${REBOUND_CACHE:-${HOME:?HOME is not set}/.cache/rebound}"
version_dir="$cache_root/tools/prometheus/$module_version"

if ((cb_print_only)); then
  echo "$version_dir/bin"
  exit 0
fi

command -v go >/dev/null || cb_die "go is not on PATH (needed to build prometheus)"

export CGO_ENABLED=0 GOWORK=off GOTOOLCHAIN=local GOFLAGS="-mod=mod -buildvcs=false"
go_version="$(go env GOVERSION)"
jobs="${REBOUND_GO_BUILD_P:-$(nproc 2>/dev/null || echo 2)}"
tags="remove_all_sd,enable_kubernetes_sd"
ldflags="-s -w -X github.com/prometheus/common/version.Version=$prom_version"
ldflags+=" -X github.com/prometheus/common/version.Branch=$module_version"
stamp="$(echo "prometheus=$module_version go=$go_version tags=$tags ldflags=$ldflags" | sha256sum | cut -d' ' -f1)"

build() {
  local out="$1"
  cb_log "building prometheus and promtool $prom_version ($module_version) with $go_version (-p $jobs)"
  GOBIN="$out" go install -p "$jobs" -trimpath -tags "$tags" -ldflags "$ldflags" \
    "github.com/prometheus/prometheus/cmd/prometheus@$module_version" \
    "github.com/prometheus/prometheus/cmd/promtool@$module_version" ||
    cb_die "building prometheus $module_version failed"
  local binary got
  for binary in prometheus promtool; do
    got="$("$out/$binary" --version 2>&1 | head -n 1 || true)"
    [[ "$got" == *"version $prom_version "* ]] || cb_die "$binary --version says '$got', expected $prom_version"
  done
}

cb_build "$version_dir" "$stamp" "prometheus, promtool $prom_version" build prometheus promtool
