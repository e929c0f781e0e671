#!/usr/bin/env bash
# The full test suite, as CI runs it: builds (or reuses) the local control plane and the
# test tools, starts one kube-apiserver + etcd for the whole run, runs every workspace
# test against it, and stops it again.
#
# Usage: dev/test.sh [extra cargo test arguments]
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

state="$repo_root/.state/test-cluster"
bin_dir="$(dev/build-control-plane.sh | tail -n 1)"
tools_dir="$(dev/install-tools.sh | tail -n 1)"
export PATH="$bin_dir:$tools_dir:$PATH"

cleanup() { dev/cluster-down.sh "$state" >/dev/null 2>&1 || true; }
trap cleanup EXIT
dev/cluster-up.sh "$state" >/dev/null
export REBOUND_CLUSTER_STATE_DIR="$state"

# Charts (tests/tests/chart.rs, install_doc.rs) run the Helm that dev/build-helm.sh builds.
REBOUND_HELM="$(dev/build-helm.sh | tail -n 1)/helm"
export REBOUND_HELM

cargo test --workspace --locked "$@"

# Images: build both with buildah, inspect them, run them with podman (dev/test-images.sh).
dev/test-images.sh
