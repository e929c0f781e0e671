#!/usr/bin/env bash
# Starts or stops a Prometheus server of its own (the one dev/build-prometheus.sh builds) for
# tests and demos:
#
#   dev/prometheus.sh up STATE_DIR --config FILE   start (or reuse) it; last stdout line: http://127.0.0.1:PORT
#   dev/prometheus.sh down STATE_DIR               stop it by PID, wait, remove what `up` created
#   dev/prometheus.sh url STATE_DIR                print the URL of a running one (exit 1 if none)
#
# Listens on 127.0.0.1 only, on a free port chosen at the first start and kept (with the
# config file's path) in STATE_DIR/prometheus.env. TSDB, log and PID file live in STATE_DIR.
# `up` returns once /-/ready answers; it is idempotent (a running server keeps its config).
#
# Environment: REBOUND_PROMETHEUS  the prometheus binary (default: dev/build-prometheus.sh's)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/usage.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/usage.sh"
cp_script_name=prometheus
# shellcheck source-path=SCRIPTDIR source=lib/controlplane.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/controlplane.sh"

usage() { usage_from_header "${BASH_SOURCE[0]}"; }

cmd="${1:-}"
dir="${2:-}"
config=""
case "$cmd" in
  -h | --help)
    usage
    exit 0
    ;;
  up | down | url) ;;
  *)
    usage >&2
    exit 2
    ;;
esac
[[ -n "$dir" ]] || cp_die "usage: dev/prometheus.sh $cmd STATE_DIR"
args=("${@:3}")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --config)
      [[ "$cmd" == up ]] || cp_die "--config only applies to 'up'"
      ((i + 1 < ${#args[@]})) || cp_die "--config needs a file"
      config="${args[i + 1]}"
      i=$((i + 1))
      ;;
    *) cp_die "unknown argument '${args[i]}'" ;;
  esac
done

load_env() {
  PROMETHEUS_PORT=""
  PROMETHEUS_CONFIG=""
  # shellcheck disable=SC1091
  [[ -f "$1/prometheus.env" ]] && source "$1/prometheus.env"
  return 0
}

save_env() {
  printf '# Written by dev/prometheus.sh.\nPROMETHEUS_PORT=%s\nPROMETHEUS_CONFIG=%q\n' \
    "$PROMETHEUS_PORT" "$PROMETHEUS_CONFIG" >"$1/prometheus.env.tmp"
  mv -f "$1/prometheus.env.tmp" "$1/prometheus.env"
}

ready() { curl -fsS --max-time 2 "http://127.0.0.1:$1/-/ready" >/dev/null 2>&1; }

case "$cmd" in
  down)
    if [[ ! -d "$dir" ]]; then
      cp_log "nothing to do: $dir does not exist"
      exit 0
    fi
    state="$(cd "$dir" && pwd)"
    exec 9>"$state/.prometheus.lock"
    flock -w 60 9 || cp_die "timed out waiting for the lock on $state/.prometheus.lock"
    cp_stop_pid "$state/prometheus.pid" prometheus
    rm -rf "$state/prometheus-data"
    rm -f "$state/prometheus.env" "$state/prometheus.log" "$state/.prometheus.lock"
    rmdir "$state" 2>/dev/null || true
    cp_log "stopped"
    exit 0
    ;;
  url)
    state="$(cd "$dir" 2>/dev/null && pwd)" || exit 1
    load_env "$state"
    cp_pid_alive "$state/prometheus.pid" prometheus && ready "$PROMETHEUS_PORT" || exit 1
    echo "http://127.0.0.1:$PROMETHEUS_PORT"
    exit 0
    ;;
esac

server="${REBOUND_PROMETHEUS:-$("$(dirname "${BASH_SOURCE[0]}")/build-prometheus.sh" --print-bin-dir)/prometheus}"
[[ -x "$server" ]] || cp_die "$server is missing: run dev/build-prometheus.sh"

state="$(cp_state_dir "$dir")"
[[ "$state" != "/" && "$state" != "$cp_repo_root" ]] || cp_die "refusing to use '$state' as a state dir"
exec 9>"$state/.prometheus.lock"
flock -w 60 9 || cp_die "timed out waiting for the lock on $state/.prometheus.lock"
load_env "$state"
if [[ -n "$config" ]]; then
  [[ -f "$config" ]] || cp_die "--config: $config does not exist"
  PROMETHEUS_CONFIG="$(cd "$(dirname "$config")" && pwd)/$(basename "$config")"
fi
[[ -n "$PROMETHEUS_CONFIG" ]] || cp_die "the first 'up' needs --config FILE"

if cp_pid_alive "$state/prometheus.pid" prometheus && ready "$PROMETHEUS_PORT"; then
  echo "http://127.0.0.1:$PROMETHEUS_PORT"
  exit 0
fi
cp_stop_pid "$state/prometheus.pid" prometheus

for ((attempt = 0; attempt < 5; attempt++)); do
  if [[ -z "$PROMETHEUS_PORT" ]]; then
    PROMETHEUS_PORT="$(cp_free_port)"
  fi
  save_env "$state"
  echo "--- $(date -Is) starting prometheus on 127.0.0.1:$PROMETHEUS_PORT" >>"$state/prometheus.log"
  cp_launch "$state/prometheus.pid" "$server" \
    --config.file="$PROMETHEUS_CONFIG" \
    --storage.tsdb.path="$state/prometheus-data" \
    --web.listen-address="127.0.0.1:$PROMETHEUS_PORT" \
    </dev/null >>"$state/prometheus.log" 2>&1 9>&- ||
    cp_die "could not start $server"
  cp_wait_exec "$(<"$state/prometheus.pid")" prometheus || true
  for ((i = 0; i < 600; i++)); do
    if ready "$PROMETHEUS_PORT"; then
      cp_log "ready: 127.0.0.1:$PROMETHEUS_PORT (pid $(<"$state/prometheus.pid"), log $state/prometheus.log)"
      echo "http://127.0.0.1:$PROMETHEUS_PORT"
      exit 0
    fi
    cp_pid_alive "$state/prometheus.pid" prometheus || break
    sleep 0.1
  done
  cp_stop_pid "$state/prometheus.pid" prometheus
  if tail -n 20 "$state/prometheus.log" | grep -q "address already in use"; then
    cp_log "port $PROMETHEUS_PORT is taken; retrying with another port"
    PROMETHEUS_PORT=""
    continue
  fi
  break
done
tail -n 20 "$state/prometheus.log" >&2
cp_die "prometheus did not become ready (log: $state/prometheus.log)"
