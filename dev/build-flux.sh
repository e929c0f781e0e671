#!/usr/bin/env bash
# Builds Flux's source-controller and kustomize-controller (the GitOps engine of
# tests/tests/gitops_flux.rs) and githttp (dev/flux/githttp: the Git server they sync from)
# from the Go module dev/flux/ into a cache outside the repository, with the CRDs the two
# controllers serve (GitRepository, Kustomization and the other source kinds) copied from
# their modules:
#
#   ${REBOUND_CACHE:-$HOME/.cache/rebound}/tools/flux/<versions>/bin/{source-controller,kustomize-controller,githttp,crds/}
#
# Usage: dev/build-flux.sh [--print-bin-dir] [--force]
#
#   --print-bin-dir  print the bin dir and exit (builds nothing)
#   --force          rebuild even if the cached binaries are up to date
#
# The versions come from dev/flux/go.mod (a wrapper module: the controllers' own go.mod
# files hold `replace` lines, which `go install pkg@version` refuses). One `go build` of
# the three commands, CGO off; downloads go to the shared Go module cache, the compile to a
# temporary GOCACHE like every build of lib/cached-build.sh. A second run with the same
# go.mod, go.sum, githttp source and Go version is a no-op. The last line printed on stdout
# is always the bin dir.
#
# Environment:
#   REBOUND_CACHE        cache root (default: $HOME/.cache/rebound)
#   REBOUND_GO_BUILD_P   go build -p (default: number of CPUs)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
flux_mod="$repo_root/dev/flux"
cb_name=build-flux
# shellcheck source-path=SCRIPTDIR source=lib/cached-build.sh
source "$repo_root/dev/lib/cached-build.sh"
cb_parse_flags "$@"

for f in "$flux_mod/go.mod" "$flux_mod/go.sum" "$flux_mod/githttp/main.go"; do
  [[ -f "$f" ]] || cb_die "missing $f"
done

module_version() {
  awk -v m="$1" '$1 == m && $2 ~ /^v/ { print $2; exit }' "$flux_mod/go.mod"
}
source_version="$(module_version github.com/fluxcd/source-controller)"
kustomize_version="$(module_version github.com/fluxcd/kustomize-controller)"
[[ "$source_version" =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] ||
  cb_die "could not read the source-controller version from $flux_mod/go.mod (got '$source_version')"
[[ "$kustomize_version" =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] ||
  cb_die "could not read the kustomize-controller version from $flux_mod/go.mod (got '$kustomize_version')"

cache_root="${REBOUND_CACHE:-${HOME:?HOME is not set}/.cache/rebound}"
version_dir="$cache_root/tools/flux/source-$source_version-kustomize-$kustomize_version"

if ((cb_print_only)); then
  echo "$version_dir/bin"
  exit 0
fi

command -v go >/dev/null || cb_die "go is not on PATH (Go >= 1.26 is needed to build Flux)"

export CGO_ENABLED=0 GOWORK=off GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false"
go_version="$(go env GOVERSION)"
jobs="${REBOUND_GO_BUILD_P:-$(nproc 2>/dev/null || echo 2)}"
ldflags="-s -w"
stamp="$(
  {
    echo "go=$go_version ldflags=$ldflags"
    cat "$flux_mod/go.mod" "$flux_mod/go.sum" "$flux_mod/githttp/main.go"
  } | sha256sum | cut -d' ' -f1
)"

commands=(source-controller kustomize-controller githttp)
# Their CRDs (config/crd/bases): every source kind, since source-controller starts a
# reconciler for each and kustomize-controller watches each as a possible source.
crd_modules=(github.com/fluxcd/source-controller github.com/fluxcd/kustomize-controller)

build() {
  local out="$1" start=$SECONDS
  cb_log "building source-controller $source_version, kustomize-controller $kustomize_version and githttp with $go_version (-p $jobs)"
  cb_log "a cold build takes several minutes on 2 cores"
  (cd "$flux_mod" && go mod download) || cb_die "downloading the modules of $flux_mod failed"
  cb_log "modules downloaded after $((SECONDS - start))s"
  (cd "$flux_mod" && go build -p "$jobs" -trimpath -ldflags "$ldflags" -o "$out/" \
    github.com/fluxcd/source-controller github.com/fluxcd/kustomize-controller ./githttp) ||
    cb_die "building Flux failed"
  # The binaries say which module version they hold (no --version flag).
  local binary module want got
  for binary in source-controller kustomize-controller; do
    module="github.com/fluxcd/$binary"
    want="$(module_version "$module")"
    got="$(go version -m "$out/$binary" | awk -v m="$module" '($1 == "mod" || $1 == "dep") && $2 == m { print $3; exit }')"
    [[ "$got" == "$want" ]] || cb_die "$binary holds $module '$got', expected $want"
  done
  mkdir -p "$out/crds"
  local dir
  for module in "${crd_modules[@]}"; do
    dir="$(cd "$flux_mod" && go list -m -f '{{.Dir}}' "$module")" || cb_die "could not find the module $module"
    cp "$dir"/config/crd/bases/*.yaml "$out/crds/" || cb_die "no CRDs in $dir/config/crd/bases"
  done
  chmod 644 "$out"/crds/*.yaml
}

cb_build "$version_dir" "$stamp" "source-controller $source_version, kustomize-controller $kustomize_version, githttp" \
  build "${commands[@]}" crds
