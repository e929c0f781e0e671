#!/usr/bin/env bash
# The full test suite, as CI runs it: builds (or reuses) the local control plane and the
# test tools, starts one kube-apiserver + etcd for the whole run, runs every workspace
# test against it (tests/tests/node.rs, injection_node.rs and monitoring_node.rs each
# start a real node: kubelet, containerd, Pods; cargo runs test binaries one at a time), then the Node package's unit and end-to-end tests and the
# webhook-delivery example's test against the same cluster (each starts its own operator,
# sidecar and Redis), the Python (Celery), Ruby (Sidekiq) and Go (River) adapters' tests,
# the GitOps checks and the images, and stops the cluster again.
#
# Usage: dev/test.sh [extra cargo test arguments]
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

# Every Debian package the suite needs, before anything is built (a no-op when installed).
dev/prerequisites.sh test

# GitOps with a real engine (tests/tests/gitops_flux.rs): Flux's source-controller and
# kustomize-controller, their CRDs and githttp, the Git server they sync from. A cold build
# takes about 7 minutes of CPU: it runs in the background at the lowest priority, so it
# uses the cores the Rust build and the waiting tests leave idle; the test waits for it
# (the build's lock) and fails naming dev/build-flux.sh when it did not produce them.
mkdir -p .state
setsid nice -n 19 dev/build-flux.sh >.state/flux-build.log 2>&1 &
flux_build_pid=$!
REBOUND_FLUX_BIN_DIR="$(dev/build-flux.sh --print-bin-dir)"
export REBOUND_FLUX_BIN_DIR

state="$repo_root/.state/test-cluster"
bin_dir="$(dev/build-control-plane.sh | tail -n 1)"
tools_dir="$(dev/install-tools.sh | tail -n 1)"
export PATH="$bin_dir:$tools_dir:$PATH"

# The node tests start and stop a node of their own in .state/node (one per machine);
# stopped here too in case a test binary was killed.
node_state="$repo_root/.state/node"
export REBOUND_NODE_STATE_DIR="$node_state"
cleanup() {
  kill -- "-$flux_build_pid" 2>/dev/null || true # the build script and its go build
  dev/cluster-down.sh "$state" >/dev/null 2>&1 || true
  dev/cluster-down.sh "$node_state" >/dev/null 2>&1 || true
}
trap cleanup EXIT
dev/cluster-up.sh "$state" >/dev/null
export REBOUND_CLUSTER_STATE_DIR="$state"

# Charts (tests/tests/chart.rs, install_doc.rs) run the Helm that dev/build-helm.sh builds.
REBOUND_HELM="$(dev/build-helm.sh | tail -n 1)/helm"
export REBOUND_HELM

# Rules and alerts (monitoring/): promtool and prometheus from dev/build-prometheus.sh, the
# rules checked and their unit tests run (tests/tests/monitoring.rs runs them too, with the
# checks that every alert is tested and documented; monitoring_node.rs runs the server on
# the real node).
prometheus_bin="$(dev/build-prometheus.sh | tail -n 1)"
export REBOUND_PROMETHEUS_BIN_DIR="$prometheus_bin"
"$prometheus_bin/promtool" check rules monitoring/rules.yaml
"$prometheus_bin/promtool" test rules monitoring/tests/*.yaml


# The images the node tests import, built before them (the tests rebuild nothing then).
dev/build-images.sh >/dev/null

# Every test binary runs even when one fails, so one run reports every failure.
cargo test --workspace --locked --no-fail-fast "$@"

# Node: the lockfiles' packages (npm ci) when not installed yet; .ci/run installs them too.
for dir in clients/node examples/webhook-delivery; do
  [[ -d "$dir/node_modules" ]] || (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
done
rm -rf .state/node-e2e # logs of the previous run's end-to-end stacks
(cd clients/node && npm test)
(cd clients/node && npm run test:e2e)
(cd examples/webhook-delivery && npm test)

# Python (clients/python): the Celery adapter's tests in a venv under .state/ (PyPI packages,
# clients/python/dev-env.sh), against real prefork workers, Redis and a rebound-sidecar.
cargo build --locked --quiet -p rebound-sidecar -p rebound-operator
rm -rf .state/py-tests # logs of the previous run's workers and sidecars
py_venv="$(clients/python/dev-env.sh | tail -n 1)"
(cd clients/python && "$py_venv/bin/python" -m pytest -q)

# Ruby (clients/ruby): the Sidekiq adapter's tests (Debian packages, installed by .ci/run)
# against real sidekiq processes, Redis and a rebound-sidecar.
rm -rf .state/rb-tests # logs of the previous run's workers and sidecars
(cd clients/ruby && rake test)

# Go (clients/go): the client and the River adapter, with every scenario of
# clients/conformance/scenarios.json, on real River workers, PostgreSQL (dev/postgres.sh,
# restarted by one scenario) and rebound-sidecars (found under $CARGO_TARGET_DIR), and the
# full stack on this cluster.
cargo build --locked --quiet -p rebound-sidecar -p rebound-operator
rm -rf .state/go-tests # logs of the previous run's sidecars, workers and PostgreSQL
(cd clients/go && GOTOOLCHAIN=local GOFLAGS=-mod=readonly go test -count=1 -timeout 15m ./...)

# GitOps health (gitops/, a Go module; modules from the proxy): the Argo CD Lua check and
# kstatus on RetryPolicies the real operator wrote, and the repository's kustomization.
cargo build --locked --quiet -p rebound-operator
(cd gitops && REBOUND_OPERATOR_BIN="${CARGO_TARGET_DIR:-$repo_root/target}/debug/rebound-operator" \
  GOTOOLCHAIN=local GOFLAGS=-mod=readonly go test -count=1 ./...)

# Images: build both with buildah, inspect them, run them with podman (dev/test-images.sh).
dev/test-images.sh
