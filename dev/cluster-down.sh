#!/usr/bin/env bash
# Stops the control plane started by dev/cluster-up.sh for STATE_DIR and removes STATE_DIR.
#
#   dev/cluster-down.sh [STATE_DIR] [--keep-state]
#
# Only the processes recorded in STATE_DIR (etcd.pid, kube-apiserver.pid, node/*.pid) are
# stopped, and only if they still run the binary they were started as. Waits until they
# exit. With a node (--node), also removes what its Pods left on the host: container
# processes, shims, mounts, network namespaces, the bridge, kube-proxy's nftables tables,
# the kubelet's iptables chains and the node's cgroups.
# --keep-state stops the processes but keeps certificates, data and logs.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/usage.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/usage.sh"
cp_script_name=cluster-down
# shellcheck source-path=SCRIPTDIR source=lib/controlplane.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/controlplane.sh"
# shellcheck source-path=SCRIPTDIR source=lib/node.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/node.sh"

keep=0
dir=""
for arg in "$@"; do
  case "$arg" in
    --keep-state) keep=1 ;;
    -h | --help)
      usage_from_header "${BASH_SOURCE[0]}"
      exit 0
      ;;
    -*) cp_die "unknown option '$arg'" ;;
    *)
      [[ -z "$dir" ]] || cp_die "usage: dev/cluster-down.sh [STATE_DIR] [--keep-state]"
      dir="$arg"
      ;;
  esac
done
dir="${dir:-$cp_default_state_dir}"

if [[ ! -d "$dir" ]]; then
  cp_log "nothing to do: $dir does not exist"
  exit 0
fi
state="$(cd "$dir" && pwd)"
[[ "$state" != "/" && "$state" != "$cp_repo_root" ]] || cp_die "refusing to use '$state' as a state dir"
cp_lock_state "$state"
cp_load_env "$state"

((NODE_MODE)) && node_down "$state"
cp_stop_pid "$state/kube-apiserver.pid" kube-apiserver
cp_stop_pid "$state/etcd.pid" etcd
if ((keep)); then
  rm -f "$state/kubeconfig"
  cp_log "stopped; state kept in $state"
else
  # Only remove what cluster-up.sh creates, so a mistyped path cannot wipe anything else.
  rm -rf "$state/etcd-data" "$state/pki" "$state/logs" "$state/env" "$state/kubeconfig" "$state/node"
  rm -f "$state"/*.kubeconfig "$state/.lock"
  rmdir "$state" 2>/dev/null || cp_log "left $state in place: it holds files cluster-up.sh did not create"
  cp_log "stopped and removed $state"
fi
