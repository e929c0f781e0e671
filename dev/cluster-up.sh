#!/usr/bin/env bash
# Starts a local control plane (etcd + kube-apiserver) and writes STATE_DIR/kubeconfig.
#
#   dev/cluster-up.sh [STATE_DIR]        (default STATE_DIR: <repo>/.state/cluster)
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
set -euo pipefail
cp_script_name=cluster-up
# shellcheck source-path=SCRIPTDIR source=lib/controlplane.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/controlplane.sh"

case "${1:-}" in
  -h | --help)
    sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 0
    ;;
esac
(($# <= 1)) || cp_die "usage: dev/cluster-up.sh [STATE_DIR]"

for tool in openssl curl ss flock setsid base64; do
  command -v "$tool" >/dev/null || cp_die "'$tool' is needed (Debian: openssl, curl, iproute2, util-linux, coreutils)"
done

started_at="$(cp_now)"
state="$(cp_state_dir "${1:-}")"
cp_lock_state "$state"
bin="$(cp_bin_dir)"
cp_load_env "$state"

cp_make_pki "$state"
cp_start_etcd "$state" "$bin"
cp_start_apiserver "$state" "$bin"
cp_write_kubeconfig "$state/kubeconfig" "https://127.0.0.1:$APISERVER_PORT" \
  "$state/pki/ca.crt" "$state/pki/admin.crt" "$state/pki/admin.key" rebound-admin

cp_log "ready in $(cp_elapsed "$started_at")s: https://127.0.0.1:$APISERVER_PORT (etcd 127.0.0.1:$ETCD_CLIENT_PORT, pids $(<"$state/etcd.pid") $(<"$state/kube-apiserver.pid"), logs $state/logs)"
cp_log "use: export KUBECONFIG=$state/kubeconfig"
echo "$state/kubeconfig"
