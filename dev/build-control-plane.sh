#!/usr/bin/env bash
# Builds the local control plane (kube-apiserver, etcd, kubectl) and the binaries of a
# node (kube-controller-manager, kube-scheduler, kubelet, kube-proxy: see dev/node.sh)
# from the Go modules in dev/controlplane/ into a cache outside the repository, keyed by
# version (one `go build` for all the Kubernetes commands, so they share one compile):
#
#   ${REBOUND_CACHE:-$HOME/.cache/rebound}/controlplane/<k8s version>/bin
#
# Usage: dev/build-control-plane.sh [--print-bin-dir] [--force]
#
#   --print-bin-dir  print the bin dir and exit (builds nothing)
#   --force          rebuild even if the cached binaries are up to date
#
# A second run with the same inputs (go.mod, go.sum, flags, Go version) is a no-op.
# The last line printed on stdout is always the bin dir.
#
# Environment:
#   REBOUND_CACHE        cache root (default: $HOME/.cache/rebound)
#   REBOUND_GO_BUILD_P   go build -p (parallel compile jobs; default: number of CPUs)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
kube_mod="$repo_root/dev/controlplane/kube"
etcd_mod="$repo_root/dev/controlplane/etcd"
cb_name=build-control-plane
# shellcheck source-path=SCRIPTDIR source=lib/cached-build.sh
source "$repo_root/dev/lib/cached-build.sh"
cb_parse_flags "$@"

for f in "$kube_mod/go.mod" "$kube_mod/go.sum" "$etcd_mod/go.mod" "$etcd_mod/go.sum"; do
  [[ -f "$f" ]] || cb_die "missing $f"
done

# Versions come from the committed go.mod files.
k8s_version="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ { print $2; exit }' "$kube_mod/go.mod")"
etcd_version="$(awk '$1 == "go.etcd.io/etcd/server/v3" && $2 ~ /^v/ { print $2; exit }' "$etcd_mod/go.mod")"
[[ "$k8s_version" =~ ^v([0-9]+)\.([0-9]+)\.([0-9]+)$ ]] ||
  cb_die "could not read the k8s.io/kubernetes version from $kube_mod/go.mod (got '$k8s_version')"
git_major="${BASH_REMATCH[1]}"
git_minor="${BASH_REMATCH[2]}"
[[ -n "$etcd_version" ]] || cb_die "could not read the go.etcd.io/etcd/server/v3 version from $etcd_mod/go.mod"

cache_root="${REBOUND_CACHE:-${HOME:?HOME is not set}/.cache/rebound}"
version_dir="$cache_root/controlplane/$k8s_version"

if ((cb_print_only)); then
  echo "$version_dir/bin"
  exit 0
fi

command -v go >/dev/null || cb_die "go is not on PATH (Go >= 1.26 is needed to build the control plane)"

export CGO_ENABLED=0 GOWORK=off GOTOOLCHAIN=local GOFLAGS="-mod=readonly -buildvcs=false"
go_version="$(go env GOVERSION)"
jobs="${REBOUND_GO_BUILD_P:-$(nproc 2>/dev/null || echo 2)}"
tags="selinux,notest,grpcnotrace"

ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$k8s_version"
  ldflags+=" -X $pkg.gitMajor=$git_major"
  ldflags+=" -X $pkg.gitMinor=$git_minor"
  ldflags+=" -X $pkg.gitTreeState=clean"
done

# Everything that determines the output; when it changes, the binaries are rebuilt.
stamp="$(
  {
    echo "go=$go_version tags=$tags ldflags=$ldflags"
    cat "$kube_mod/go.mod" "$kube_mod/go.sum" "$etcd_mod/go.mod" "$etcd_mod/go.sum"
  } | sha256sum | cut -d' ' -f1
)"

kube_commands=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl)

# One `go build` for all the Kubernetes commands, so they share one compile.
build() {
  local out="$1" start=$SECONDS
  local build_flags=(-p "$jobs" -trimpath -tags "$tags")
  cb_log "building ${kube_commands[*]} $k8s_version and etcd $etcd_version with $go_version (-p $jobs)"
  cb_log "a cold build takes several minutes on 2 cores"
  (cd "$etcd_mod" && go build "${build_flags[@]}" -ldflags "-s -w" -o "$out/etcd" go.etcd.io/etcd/server/v3) ||
    cb_die "building etcd $etcd_version failed"
  cb_log "etcd built after $((SECONDS - start))s"
  (cd "$kube_mod" && go build "${build_flags[@]}" -ldflags "$ldflags" -o "$out/" \
    "${kube_commands[@]/#/k8s.io/kubernetes/cmd/}") ||
    cb_die "building ${kube_commands[*]} $k8s_version failed"
  local got
  got="$("$out/kube-apiserver" --version 2>&1 || true)"
  [[ "$got" == *"$k8s_version"* ]] || cb_die "kube-apiserver --version says '$got', expected $k8s_version"
}

cb_build "$version_dir" "$stamp" "${kube_commands[*]} $k8s_version, etcd $etcd_version" build \
  "${kube_commands[@]}" etcd
