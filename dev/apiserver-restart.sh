#!/usr/bin/env bash
# Restarts only the kube-apiserver of a cluster started by dev/cluster-up.sh, keeping
# its port, certificates and etcd data (for tests of clients that must survive an API
# server restart).
#
#   dev/apiserver-restart.sh [--stop-only] [STATE_DIR]
#
# --stop-only stops the API server and returns; `dev/cluster-up.sh STATE_DIR` (or this
# script without --stop-only) starts it again on the same port.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/usage.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/usage.sh"
cp_script_name=apiserver-restart
# shellcheck source-path=SCRIPTDIR source=lib/controlplane.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/controlplane.sh"

stop_only=0
dir=""
for arg in "$@"; do
  case "$arg" in
    --stop-only) stop_only=1 ;;
    -h | --help)
      usage_from_header "${BASH_SOURCE[0]}"
      exit 0
      ;;
    -*) cp_die "unknown option '$arg'" ;;
    *)
      [[ -z "$dir" ]] || cp_die "usage: dev/apiserver-restart.sh [--stop-only] [STATE_DIR]"
      dir="$arg"
      ;;
  esac
done
dir="${dir:-$cp_default_state_dir}"
[[ -f "$dir/env" && -d "$dir/pki" ]] || cp_die "no cluster in '$dir' (start one with dev/cluster-up.sh)"
state="$(cd "$dir" && pwd)"

started_at="$(cp_now)"
cp_lock_state "$state"
cp_load_env "$state"
cp_stop_pid "$state/kube-apiserver.pid" kube-apiserver
cp_log "kube-apiserver stopped"
if ((stop_only)); then
  exit 0
fi
bin="$(cp_bin_dir)"
cp_start_etcd "$state" "$bin"
cp_start_apiserver "$state" "$bin"
cp_log "kube-apiserver back on https://$(cp_api_host):$APISERVER_PORT after $(cp_elapsed "$started_at")s"
