#!/usr/bin/env bash
# Starts a local control plane (etcd + kube-apiserver) and writes STATE_DIR/kubeconfig.
#
#   dev/cluster-up.sh [--node] [STATE_DIR]   (default STATE_DIR: <repo>/.state/cluster)
#
# --node adds a real node (dev/lib/node.sh): kube-controller-manager, kube-scheduler,
# containerd, kubelet and kube-proxy, so Pods run; the API server then listens on the
# node's address (10.200.0.1) instead of 127.0.0.1. Needs root, cgroup v1 and the Debian
# packages it names. One node per machine; a state dir keeps the mode it started with.
#
# Idempotent: if the cluster of STATE_DIR is already up it only checks that it is
# ready; if a process of it is gone (e.g. after `dev/apiserver-restart.sh --stop-only`)
# it starts that process again with the same ports, certificates and data.
# Several clusters may run at once, each with its own STATE_DIR.
#
# Prints the kubeconfig path as the last line of stdout.
#
# Environment:
#   REBOUND_CONTROLPLANE_BIN  dir with kube-apiserver and etcd (default: the
#                             dev/build-control-plane.sh cache; built if missing)
#   REBOUND_APISERVER_PROFILING  true serves /debug/pprof on the API server (admin
#                             client certificate), e.g. to see where a benchmark's
#                             requests spend its CPU (default false)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/usage.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/usage.sh"
cp_script_name=cluster-up
# shellcheck source-path=SCRIPTDIR source=lib/controlplane.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/controlplane.sh"

# shellcheck source-path=SCRIPTDIR source=lib/node.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/node.sh"

with_node=0
dir=""
for arg in "$@"; do
  case "$arg" in
    -h | --help)
      usage_from_header "${BASH_SOURCE[0]}"
      exit 0
      ;;
    --node) with_node=1 ;;
    -*) cp_die "unknown option '$arg'" ;;
    *)
      [[ -z "$dir" ]] || cp_die "usage: dev/cluster-up.sh [--node] [STATE_DIR]"
      dir="$arg"
      ;;
  esac
done

for tool in openssl curl ss flock setsid base64; do
  command -v "$tool" >/dev/null || cp_die "'$tool' is needed (Debian: openssl, curl, iproute2, util-linux, coreutils)"
done

started_at="$(cp_now)"
state="$(cp_state_dir "$dir")"
cp_lock_state "$state"
bin="$(cp_bin_dir)"
cp_load_env "$state"
if [[ -f "$state/env" && "$NODE_MODE" != "$with_node" ]]; then
  cp_die "$state was started $( ((NODE_MODE)) && echo with || echo without) --node; stop it first (dev/cluster-down.sh $state)"
fi
NODE_MODE=$with_node
if ((with_node)); then
  node_check_host
  for b in kube-controller-manager kube-scheduler kubelet kube-proxy; do
    [[ -x "$bin/$b" ]] || cp_die "no $b in $bin (run dev/build-control-plane.sh)"
  done
  mkdir -p "$state/node"
  node_make_bridge "$state"
fi

cp_make_pki "$state"
((with_node)) && node_make_pki "$state"
cp_start_etcd "$state" "$bin"
cp_start_apiserver "$state" "$bin"
cp_write_kubeconfig "$state/kubeconfig" "https://$(cp_api_host):$APISERVER_PORT" \
  "$state/pki/ca.crt" "$state/pki/admin.crt" "$state/pki/admin.key" rebound-admin
((with_node)) && node_up "$state" "$bin"

cp_log "ready in $(cp_elapsed "$started_at")s: https://$(cp_api_host):$APISERVER_PORT (etcd 127.0.0.1:$ETCD_CLIENT_PORT, pids $(<"$state/etcd.pid") $(<"$state/kube-apiserver.pid"), logs $state/logs)"
cp_log "use: export KUBECONFIG=$state/kubeconfig"
echo "$state/kubeconfig"
