#!/usr/bin/env bash
# Installs what the tests and the demo need beyond Rust and Go, from the package
# registries only, and is a no-op when everything is there:
#   - Python gRPC packages for the cross-language client test (pip);
#   - grpcurl, a generic gRPC client that works from server reflection (Go module proxy),
#     into ${REBOUND_CACHE:-$HOME/.cache/rebound}/tools/bin.
# Prints the tools bin dir as its last line.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_root="${REBOUND_CACHE:-${HOME:?HOME is not set}/.cache/rebound}"
tools_bin="$cache_root/tools/bin"
grpcurl_version="v1.9.4"
log() { echo "install-tools: $*" >&2; }

requirements="$repo_root/sidecar/tests/python/requirements.txt"
if ! python3 -c 'import grpc, grpc_tools, grpc_health, grpc_reflection' 2>/dev/null; then
  log "installing Python packages from ${requirements#"$repo_root"/}"
  # A Debian system Python refuses plain installs (PEP 668); the test packages are
  # self-contained wheels, so allow them there.
  python3 -m pip install --quiet --disable-pip-version-check -r "$requirements" >&2 ||
    python3 -m pip install --quiet --disable-pip-version-check --break-system-packages \
      -r "$requirements" >&2
fi

if [[ ! -x "$tools_bin/grpcurl" ]] || ! grep -qs "$grpcurl_version" "$tools_bin/.grpcurl-version"; then
  log "building grpcurl $grpcurl_version"
  mkdir -p "$tools_bin"
  GOBIN="$tools_bin" GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0 \
    go install "github.com/fullstorydev/grpcurl/cmd/grpcurl@$grpcurl_version" >&2
  echo "$grpcurl_version" >"$tools_bin/.grpcurl-version"
fi
echo "$tools_bin"
