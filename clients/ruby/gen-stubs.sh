#!/usr/bin/env bash
# Generates the Ruby messages and service stubs of proto/rebound/v1/advisor.proto with
# Debian's grpc_tools_ruby_protoc (package ruby-grpc-tools) into OUT_DIR (default: lib/).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="${1:-$here/lib}"
command -v grpc_tools_ruby_protoc >/dev/null || { echo "gen-stubs: grpc_tools_ruby_protoc is needed (apt-get install ruby-grpc-tools)" >&2; exit 1; }
mkdir -p "$out"
cd "$here/../.."
grpc_tools_ruby_protoc -I proto --ruby_out="$out" --grpc_out="$out" proto/rebound/v1/advisor.proto
