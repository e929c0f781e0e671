#!/usr/bin/env bash
# The whole Rebound loop on this machine:
#   a real kube-apiserver + etcd  →  RetryPolicy CRD  →  rebound-operator compiles the
#   example policies into a ConfigMap  →  rebound-sidecar watches that ConfigMap  →
#   a worker's questions answered over gRPC (asked with grpcurl, from reflection alone)  →
#   a real BullMQ worker (examples/webhook-delivery) delivering webhooks to a flaky
#   receiver, its retries decided by that sidecar, on a Redis of its own (dev/redis.sh).
# Everything keeps running afterwards; `dev/demo.sh stop` ends it.
#
# Usage: dev/demo.sh [stop]
# Environment: REBOUND_DEMO_STATE (default .state/demo), REBOUND_DEMO_PORT (sidecar gRPC
# port, default 7411; admin = port + 1; operator metrics = port + 2).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
state="${REBOUND_DEMO_STATE:-$repo_root/.state/demo}"
port="${REBOUND_DEMO_PORT:-7411}"
namespace=shop

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
die() { echo "demo: $*" >&2; exit 1; }

stop_pid_file() {
  local file="$1"
  [[ -f "$file" ]] || return 0
  local pid
  pid="$(cat "$file")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

if [[ "${1:-}" == "stop" ]]; then
  stop_pid_file "$state/sidecar.pid"
  stop_pid_file "$state/operator.pid"
  dev/redis.sh down "$state/redis" 2>/dev/null || true
  [[ -d "$state" ]] && dev/cluster-down.sh "$state"
  echo "demo stopped"
  exit 0
fi
[[ $# -eq 0 ]] || die "unknown argument $1 (usage: dev/demo.sh [stop])"

step "Checking prerequisites (installs missing Debian packages)"
dev/prerequisites.sh demo

step "Building the control plane (cached after the first run), tools and Rebound"
bin_dir="$(dev/build-control-plane.sh | tail -n 1)"
tools_dir="$(dev/install-tools.sh | tail -n 1)"
export PATH="$bin_dir:$tools_dir:$PATH"
cargo build --quiet -p rebound-cli -p rebound-operator -p rebound-sidecar
target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/debug"

step "Starting kube-apiserver + etcd on 127.0.0.1"
export KUBECONFIG
KUBECONFIG="$(dev/cluster-up.sh "$state" | tail -n 1)"
mkdir -p "$state/logs"

step "Installing the RetryPolicy CRD and the example policies (namespace $namespace)"
kubectl apply --server-side -f crds/ >/dev/null
kubectl wait --for=condition=Established crd/retrypolicies.rebound.dev --timeout=60s >/dev/null
"$target_dir/rebound" validate -f examples/policies/*.yaml
kubectl get namespace "$namespace" >/dev/null 2>&1 || kubectl create namespace "$namespace" >/dev/null
kubectl -n "$namespace" apply -f examples/policies/

step "Starting rebound-operator"
stop_pid_file "$state/operator.pid"
nohup "$target_dir/rebound-operator" --leader-elect=false --log-format=text \
  --metrics-addr "127.0.0.1:$((port + 2))" >"$state/logs/operator.log" 2>&1 &
echo $! >"$state/operator.pid"
kubectl -n "$namespace" wait --for=condition=Ready retrypolicy --all --timeout=60s >/dev/null ||
  die "policies did not become Ready; see $state/logs/operator.log"
kubectl -n "$namespace" get retrypolicies
hash="$(kubectl -n "$namespace" get configmap rebound-policies -o jsonpath='{.data.policies\.json}' |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["hash"])')"
echo "ConfigMap $namespace/rebound-policies holds document $hash"

step "Starting rebound-sidecar on 127.0.0.1:$port, watching that ConfigMap"
stop_pid_file "$state/sidecar.pid"
nohup "$target_dir/rebound-sidecar" --configmap "$namespace/rebound-policies" \
  --listen "127.0.0.1:$port" --admin-listen "127.0.0.1:$((port + 1))" \
  >"$state/logs/sidecar.log" 2>&1 &
echo $! >"$state/sidecar.pid"
for _ in $(seq 100); do
  if grpcurl -plaintext -d '{"service":""}' "127.0.0.1:$port" grpc.health.v1.Health/Check 2>/dev/null |
    grep -q SERVING; then break; fi
  sleep 0.1
done
grpcurl -plaintext "127.0.0.1:$port" list

ask() {
  local what="$1" request="$2"
  printf '\n\033[1m%s\033[0m\n  %s\n' "$what" "$request"
  grpcurl -plaintext -d "$request" "127.0.0.1:$port" rebound.v1.RetryAdvisor/Decide 2>&1 | sed 's/^/  /'
}

step "A worker asks (grpcurl, using server reflection only)"
ask "A webhook delivery failed for the 3rd time:" \
  '{"queue":"webhooks","attempt":3,"job_id":"delivery-8812"}'
ask "The same question again (hooks run twice) — the same answer:" \
  '{"queue":"webhooks","attempt":3,"job_id":"delivery-8812"}'
ask "A card was declined: never retry a payment for that." \
  '{"queue":"payments.charge","attempt":1,"job_id":"order-77","error_class":"CardDeclined"}'
ask "The 25th and last attempt of a webhook failed:" \
  '{"queue":"webhooks-eu","attempt":25,"job_id":"delivery-9"}'
ask "A queue no policy names falls to the namespace catch-all (*):" \
  '{"queue":"thumbnails","attempt":2,"job_id":"img-1"}'

step "A BullMQ worker delivering webhooks, retried by the RetryPolicy (examples/webhook-delivery)"
for dir in clients/node examples/webhook-delivery; do
  [[ -d "$dir/node_modules" ]] || (cd "$dir" && npm ci --no-audit --no-fund --loglevel=error)
done
redis_url="$(dev/redis.sh up "$state/redis" | tail -n 1)"
kubectl -n "$namespace" apply -f examples/webhook-delivery/policy.yaml
kubectl -n "$namespace" wait --for=condition=Ready retrypolicy/webhook-delivery --timeout=60s >/dev/null
for _ in $(seq 100); do
  grpcurl -plaintext -d '{"queue":"webhook-delivery"}' "127.0.0.1:$port" rebound.v1.RetryAdvisor/GetPolicy 2>/dev/null |
    grep -q '"name": "webhook-delivery"' && break
  sleep 0.1
done
echo "Redis $redis_url; 40 events to a receiver that fails, times out after accepting, answers 429,"
echo "or is gone; every attempt carries the event's idempotency key:"
echo
REDIS_URL="$redis_url" REBOUND_TARGET="127.0.0.1:$port" EVENTS=40 node examples/webhook-delivery/run.js

cat <<MSG

Everything is still running:
  export KUBECONFIG=$KUBECONFIG PATH=$bin_dir:$tools_dir:\$PATH
  kubectl -n $namespace get retrypolicies         # edit examples/policies/ and apply again
  grpcurl -plaintext 127.0.0.1:$port describe rebound.v1.RetryAdvisor
  REDIS_URL=$redis_url REBOUND_TARGET=127.0.0.1:$port EVENTS=40 node examples/webhook-delivery/run.js
  logs: $state/logs/
Stop it all with: dev/demo.sh stop
MSG
