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
log() { echo "build-control-plane: $*" >&2; }

for f in "$kube_mod/go.mod" "$kube_mod/go.sum" "$etcd_mod/go.mod" "$etcd_mod/go.sum"; do
  [[ -f "$f" ]] || die "missing $f"
done

# Versions come from the committed go.mod files.
k8s_version="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ { print $2; exit }' "$kube_mod/go.mod")"
etcd_version="$(awk '$1 == "go.etcd.io/etcd/server/v3" && $2 ~ /^v/ { print $2; exit }' "$etcd_mod/go.mod")"
[[ "$k8s_version" =~ ^v([0-9]+)\.([0-9]+)\.([0-9]+)$ ]] ||
  die "could not read the k8s.io/kubernetes version from $kube_mod/go.mod (got '$k8s_version')"
git_major="${BASH_REMATCH[1]}"
git_minor="${BASH_REMATCH[2]}"
[[ -n "$etcd_version" ]] || die "could not read the go.etcd.io/etcd/server/v3 version from $etcd_mod/go.mod"

cache_root="${REBOUND_CACHE:-${HOME:?HOME is not set}/.cache/rebound}"
version_dir="$cache_root/controlplane/$k8s_version"
bin_dir="$version_dir/bin"

if ((print_only)); then
  echo "$bin_dir"
  exit 0
fi

command -v go >/dev/null || die "go is not on PATH (Go >= 1.26 is needed to build the control plane)"

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
binaries=("${kube_commands[@]}" etcd)
up_to_date() {
  [[ -f "$version_dir/stamp" && "$(cat "$version_dir/stamp")" == "$stamp" ]] || return 1
  local b
  for b in "${binaries[@]}"; do
    [[ -x "$bin_dir/$b" ]] || return 1
  done
}

mkdir -p "$version_dir"
# One build at a time per version (parallel test binaries or CI steps may call this).
exec 9>"$version_dir/.lock"
flock 9

if ((force == 0)) && up_to_date; then
  log "up to date: ${kube_commands[*]} $k8s_version, etcd $etcd_version"
  echo "$bin_dir"
  exit 0
fi

log "building ${kube_commands[*]} $k8s_version and etcd $etcd_version with $go_version (-p $jobs)"
log "a cold build takes several minutes on 2 cores"
start=$SECONDS
tmp_bin="$(mktemp -d "$version_dir/bin.tmp.XXXXXX")"
chmod 755 "$tmp_bin"
# The Kubernetes build leaves ~3.5 GiB of compiler cache that nothing reuses once the
# binaries are cached: keep it in a directory removed with the build.
go_cache="$(mktemp -d "$version_dir/gocache.tmp.XXXXXX")"
export GOCACHE="$go_cache"
trap 'rm -rf "$tmp_bin" "$go_cache"' EXIT

build_flags=(-p "$jobs" -trimpath -tags "$tags")

(cd "$etcd_mod" && go build "${build_flags[@]}" -ldflags "-s -w" -o "$tmp_bin/etcd" go.etcd.io/etcd/server/v3) ||
  die "building etcd $etcd_version failed"
log "etcd built after $((SECONDS - start))s"

(cd "$kube_mod" && go build "${build_flags[@]}" -ldflags "$ldflags" -o "$tmp_bin/" \
  "${kube_commands[@]/#/k8s.io/kubernetes/cmd/}") ||
  die "building ${kube_commands[*]} $k8s_version failed"

for b in "${binaries[@]}"; do
  [[ -x "$tmp_bin/$b" ]] || die "the build did not produce $b"
done
got="$("$tmp_bin/kube-apiserver" --version 2>&1 || true)"
[[ "$got" == *"$k8s_version"* ]] || die "kube-apiserver --version says '$got', expected $k8s_version"

rm -rf "$bin_dir"
mv "$tmp_bin" "$bin_dir"
rm -rf "$go_cache"
trap - EXIT
echo "$stamp" >"$version_dir/stamp"
log "built in $((SECONDS - start))s: $(cd "$bin_dir" && du -sh -- "${binaries[@]}" | tr '\t\n' ' ')"
echo "$bin_dir"
