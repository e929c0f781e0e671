#!/usr/bin/env bash
# Starts or stops a Redis server of its own for tests and demos (Debian's redis-server).
#
#   dev/redis.sh up STATE_DIR [--persist]   start (or reuse) it; last stdout line: redis://127.0.0.1:PORT
#   dev/redis.sh down STATE_DIR             stop it by PID, wait, remove what `up` created
#   dev/redis.sh url STATE_DIR              print the URL of a running one (exit 1 if none)
#
# Listens on 127.0.0.1 only, on a free port chosen at the first start and kept in
# STATE_DIR/redis.env. Data, log and PID file live in STATE_DIR. No RDB snapshots and
# no AOF unless --persist. `up` returns once PING answers PONG; it is idempotent.
#
# Environment: REDIS_SERVER  the redis-server binary (default: redis-server on PATH)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/usage.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/usage.sh"
cp_script_name=redis
# shellcheck source-path=SCRIPTDIR source=lib/controlplane.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/controlplane.sh"

usage() { usage_from_header "${BASH_SOURCE[0]}"; }

cmd="${1:-}"
dir="${2:-}"
persist=0
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
[[ -n "$dir" ]] || cp_die "usage: dev/redis.sh $cmd STATE_DIR"
for arg in "${@:3}"; do
  case "$arg" in
    --persist) [[ "$cmd" == up ]] || cp_die "--persist only applies to 'up'"; persist=1 ;;
    *) cp_die "unknown argument '$arg'" ;;
  esac
done

# True if the PID in STATE/redis.pid is a redis-server serving 127.0.0.1:$REDIS_PORT.
# (redis-server rewrites its process title to "redis-server 127.0.0.1:PORT".)
redis_alive() {
  local state="$1" pid cmdline
  [[ -f "$state/redis.pid" && -n "${REDIS_PORT:-}" ]] || return 1
  pid="$(<"$state/redis.pid")"
  [[ "$pid" =~ ^[0-9]+$ && -r "/proc/$pid/cmdline" ]] || return 1
  cmdline="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" || return 1
  [[ "$cmdline" == *redis-server* && "$cmdline" == *"127.0.0.1:$REDIS_PORT"* ]]
}

# Sends PING over a plain TCP connection (no redis-cli needed); true on +PONG.
redis_ping() {
  local port="$1" reply
  exec 7<>"/dev/tcp/127.0.0.1/$port" 2>/dev/null || return 1
  printf 'PING\r\n' >&7
  IFS= read -r -t 2 reply <&7 || reply=""
  exec 7<&- 7>&-
  [[ "$reply" == "+PONG"* ]]
}

load_env() {
  REDIS_PORT=""
  # shellcheck disable=SC1091
  [[ -f "$1/redis.env" ]] && source "$1/redis.env"
  return 0
}

save_env() {
  printf '# Written by dev/redis.sh.\nREDIS_PORT=%s\n' "$REDIS_PORT" >"$1/redis.env.tmp"
  mv -f "$1/redis.env.tmp" "$1/redis.env"
}

stop() {
  local state="$1" pid i
  if ! redis_alive "$state"; then
    rm -f "$state/redis.pid"
    return 0
  fi
  pid="$(<"$state/redis.pid")"
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    redis_alive "$state" || break
    sleep 0.05
  done
  if redis_alive "$state"; then
    cp_log "redis-server (pid $pid) did not stop after SIGTERM; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
      redis_alive "$state" || break
      sleep 0.1
    done
  fi
  redis_alive "$state" && cp_die "redis-server (pid $pid) is still running"
  rm -f "$state/redis.pid"
}

case "$cmd" in
  down)
    if [[ ! -d "$dir" ]]; then
      cp_log "nothing to do: $dir does not exist"
      exit 0
    fi
    state="$(cd "$dir" && pwd)"
    exec 9>"$state/.redis.lock"
    flock -w 60 9 || cp_die "timed out waiting for the lock on $state/.redis.lock"
    load_env "$state"
    stop "$state"
    rm -rf "$state/redis-data"
    rm -f "$state/redis.env" "$state/redis.log" "$state/.redis.lock"
    rmdir "$state" 2>/dev/null || true
    cp_log "stopped"
    exit 0
    ;;
  url)
    state="$(cd "$dir" 2>/dev/null && pwd)" || exit 1
    load_env "$state"
    redis_alive "$state" && redis_ping "$REDIS_PORT" || exit 1
    echo "redis://127.0.0.1:$REDIS_PORT"
    exit 0
    ;;
esac

server="${REDIS_SERVER:-$(command -v redis-server || true)}"
[[ -n "$server" && -x "$server" ]] || cp_die "redis-server is needed (Debian: apt-get install redis-server)"

state="$(cp_state_dir "$dir")"
[[ "$state" != "/" && "$state" != "$cp_repo_root" ]] || cp_die "refusing to use '$state' as a state dir"
exec 9>"$state/.redis.lock"
flock -w 60 9 || cp_die "timed out waiting for the lock on $state/.redis.lock"
load_env "$state"

if redis_alive "$state" && redis_ping "$REDIS_PORT"; then
  echo "redis://127.0.0.1:$REDIS_PORT"
  exit 0
fi
stop "$state"

if ((persist)); then
  persistence=(--appendonly yes --save "3600 1 300 100 60 10000")
else
  persistence=(--appendonly no --save "")
fi

for ((attempt = 0; attempt < 5; attempt++)); do
  if [[ -z "$REDIS_PORT" ]]; then
    REDIS_PORT="$(cp_free_port)"
    save_env "$state"
  fi
  mkdir -p "$state/redis-data"
  chmod 700 "$state/redis-data"
  echo "--- $(date -Is) starting redis-server on 127.0.0.1:$REDIS_PORT" >>"$state/redis.log"
  rm -f "$state/redis.pid"
  # --daemonize: the server forks and writes its own PID file; stdin/out and the lock fd closed.
  "$server" --port "$REDIS_PORT" --bind 127.0.0.1 --protected-mode yes \
    --dir "$state/redis-data" --pidfile "$state/redis.pid" --logfile "$state/redis.log" \
    --daemonize yes "${persistence[@]}" </dev/null >/dev/null 2>>"$state/redis.log" 9>&- || true
  for ((i = 0; i < 200; i++)); do
    if redis_alive "$state" && redis_ping "$REDIS_PORT"; then
      cp_log "ready: 127.0.0.1:$REDIS_PORT (pid $(<"$state/redis.pid"), log $state/redis.log)"
      echo "redis://127.0.0.1:$REDIS_PORT"
      exit 0
    fi
    # Give the daemon a moment to write its PID file before concluding it died.
    if ((i > 20)) && ! redis_alive "$state"; then
      break
    fi
    sleep 0.05
  done
  stop "$state"
  if tail -n 20 "$state/redis.log" | grep -q "Address already in use"; then
    cp_log "port $REDIS_PORT is taken; retrying with another port"
    REDIS_PORT=""
    continue
  fi
  break
done
tail -n 20 "$state/redis.log" >&2
cp_die "redis-server did not answer PING (log: $state/redis.log)"
