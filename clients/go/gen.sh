#!/usr/bin/env bash
# Generates reboundv1/ (Go messages and gRPC stubs) from proto/rebound/v1/advisor.proto.
#
#   clients/go/gen.sh [OUT_DIR]    default: clients/go/reboundv1 (the committed copy)
#
# protoc is Debian's protobuf-compiler; protoc-gen-go and protoc-gen-go-grpc are installed
# with `go install` from the module proxy, at the versions below, into
# ${REBOUND_CACHE:-$HOME/.cache/rebound}/tools/<name>/<version>/bin. The generated files
# name the protoc version, so gen_test.go compares against a regeneration with the same one.
set -euo pipefail

protoc_gen_go_version=v1.36.12     # google.golang.org/protobuf (the go.mod version)
protoc_gen_go_grpc_version=v1.6.2  # google.golang.org/grpc/cmd/protoc-gen-go-grpc

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${1:-$here/reboundv1}"
cache="${REBOUND_CACHE:-$HOME/.cache/rebound}/tools"

command -v protoc >/dev/null || { echo "gen.sh: protoc is needed (Debian: apt-get install protobuf-compiler)" >&2; exit 1; }

# go install PKG@VERSION into the cache once; prints the bin dir.
tool() {
  local name="$1" pkg="$2" version="$3" dir
  dir="$cache/$name/$version/bin"
  if [[ ! -x "$dir/$name" ]]; then
    mkdir -p "$dir"
    GOTOOLCHAIN=local GOFLAGS=-mod=mod GOBIN="$dir" go install "$pkg@$version" >&2
  fi
  echo "$dir"
}
go_bin="$(tool protoc-gen-go google.golang.org/protobuf/cmd/protoc-gen-go "$protoc_gen_go_version")"
grpc_bin="$(tool protoc-gen-go-grpc google.golang.org/grpc/cmd/protoc-gen-go-grpc "$protoc_gen_go_grpc_version")"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
PATH="$go_bin:$grpc_bin:$PATH" protoc -I "$repo/proto" \
  --go_out="$tmp" --go_opt=paths=source_relative \
  --go-grpc_out="$tmp" --go-grpc_opt=paths=source_relative \
  rebound/v1/advisor.proto
mkdir -p "$out"
cp "$tmp/rebound/v1/advisor.pb.go" "$tmp/rebound/v1/advisor_grpc.pb.go" "$out/"
echo "$out"
