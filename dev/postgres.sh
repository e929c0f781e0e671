#!/usr/bin/env bash
# Starts or stops a PostgreSQL server of its own for tests and demos (Debian's postgresql).
#
#   dev/postgres.sh up STATE_DIR     start (or reuse) it; last stdout line: postgres://postgres@127.0.0.1:PORT/postgres?sslmode=disable
#   dev/postgres.sh down STATE_DIR   stop it by the server's PID, wait, remove what `up` created
#   dev/postgres.sh url STATE_DIR    print the URL of a running one (exit 1 if none)
#   dev/postgres.sh env STATE_DIR    print PGHOST=, PGPORT=, PGUSER=, PGDATABASE=, DATABASE_URL= lines
#
# initdb into STATE_DIR/postgres/data (trust authentication, superuser "postgres"); listens
# on 127.0.0.1 only, on a free port chosen at the first start and kept in STATE_DIR/postgres.env;
# the unix socket is in STATE_DIR/postgres/run. PostgreSQL refuses to run as root: as root the
# server runs as $PG_RUN_AS (default: the "postgres" user, else "nobody"), and when that user
# cannot reach STATE_DIR the cluster lives in a private directory under /tmp recorded in the
# env file. No durability (fsync off): for tests. `up` returns once the server accepts
# connections; it is idempotent.
#
# Environment: PG_BIN     the directory of initdb/pg_ctl/postgres (default: newest /usr/lib/postgresql/*/bin)
#              PG_RUN_AS  the user to run the server as when started by root
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/usage.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/usage.sh"
cp_script_name=postgres
# shellcheck source-path=SCRIPTDIR source=lib/controlplane.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/controlplane.sh"

usage() { usage_from_header "${BASH_SOURCE[0]}"; }

cmd="${1:-}"
dir="${2:-}"
case "$cmd" in
  -h | --help)
    usage
    exit 0
    ;;
  up | down | url | env) ;;
  *)
    usage >&2
    exit 2
    ;;
esac
[[ -n "$dir" ]] || cp_die "usage: dev/postgres.sh $cmd STATE_DIR"
(($# <= 2)) || cp_die "unknown argument '$3'"

pg_bin() {
  local b="${PG_BIN:-}"
  if [[ -z "$b" ]]; then
    b="$(find /usr/lib/postgresql -mindepth 2 -maxdepth 2 -name bin -type d 2>/dev/null | sort -V | tail -n 1)"
  fi
  [[ -n "$b" && -x "$b/postgres" && -x "$b/initdb" && -x "$b/pg_ctl" ]] ||
    cp_die "PostgreSQL server binaries are needed (Debian: apt-get install postgresql; or set PG_BIN)"
  echo "$b"
}

load_env() {
  PG_PORT="" PG_ROOT="" PG_USER_RUN=""
  # shellcheck disable=SC1091
  [[ -f "$1/postgres.env" ]] && source "$1/postgres.env"
  return 0
}

save_env() {
  printf '# Written by dev/postgres.sh.\nPG_PORT=%s\nPG_ROOT=%q\nPG_USER_RUN=%q\n' \
    "$PG_PORT" "$PG_ROOT" "$PG_USER_RUN" >"$1/postgres.env.tmp"
  mv -f "$1/postgres.env.tmp" "$1/postgres.env"
}

# The postmaster's PID from the first line of its postmaster.pid (empty if none).
server_pid() {
  local pid=""
  [[ -n "$PG_ROOT" && -r "$PG_ROOT/data/postmaster.pid" ]] && IFS= read -r pid <"$PG_ROOT/data/postmaster.pid"
  [[ "$pid" =~ ^[0-9]+$ ]] && echo "$pid"
  return 0
}

# True if postmaster.pid names a live postgres serving this state's data directory
# (so a reused PID never matches).
pg_alive() {
  local pid cmdline
  pid="$(server_pid)"
  [[ -n "$pid" && -r "/proc/$pid/cmdline" ]] || return 1
  cmdline="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" || return 1
  [[ "$cmdline" == *postgres* && "$cmdline" == *"$PG_ROOT/data"* ]]
}

pg_ready() {
  "$bin/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -t 2 >/dev/null 2>&1
}

# Runs a command as the server's user (itself when not root).
as_user() {
  if [[ -z "$PG_USER_RUN" ]]; then
    "$@"
  elif command -v runuser >/dev/null; then
    runuser -u "$PG_USER_RUN" -- "$@"
  else
    setpriv --reuid="$PG_USER_RUN" --regid="$(id -g "$PG_USER_RUN")" --init-groups -- "$@"
  fi
}

url() { echo "postgres://postgres@127.0.0.1:$PG_PORT/postgres?sslmode=disable"; }

stop() {
  local pid i
  if ! pg_alive; then
    return 0
  fi
  pid="$(server_pid)"
  # SIGINT: "fast" shutdown (SIGTERM would wait for clients to disconnect).
  kill -INT "$pid" 2>/dev/null || true
  for ((i = 0; i < 300; i++)); do
    [[ -e "/proc/$pid" ]] || break
    sleep 0.05
  done
  if [[ -e "/proc/$pid" ]]; then
    cp_log "postgres (pid $pid) did not stop after SIGINT; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
      [[ -e "/proc/$pid" ]] || break
      sleep 0.1
    done
  fi
  [[ -e "/proc/$pid" ]] && cp_die "postgres (pid $pid) is still running"
  return 0
}

# Picks where the cluster lives and as whom it runs (first start only).
choose_root() {
  local state="$1" sock
  PG_USER_RUN=""
  if ((EUID == 0)); then
    PG_USER_RUN="${PG_RUN_AS:-}"
    if [[ -z "$PG_USER_RUN" ]]; then
      if id -u postgres >/dev/null 2>&1; then PG_USER_RUN=postgres; else PG_USER_RUN=nobody; fi
    fi
    id -u "$PG_USER_RUN" >/dev/null 2>&1 || cp_die "user '$PG_USER_RUN' (PG_RUN_AS) does not exist"
    [[ "$(id -u "$PG_USER_RUN")" != 0 ]] || cp_die "PG_RUN_AS must not be root"
  fi
  PG_ROOT="$state/postgres"
  mkdir -p "$PG_ROOT"
  [[ -n "$PG_USER_RUN" ]] && chown "$PG_USER_RUN:" "$PG_ROOT"
  chmod 700 "$PG_ROOT"
  sock="$PG_ROOT/run/.s.PGSQL.65535"
  if ((${#sock} > 100)) || ! as_user test -w "$PG_ROOT"; then
    rm -rf "$PG_ROOT"
    PG_ROOT="$(mktemp -d /tmp/rebound-postgres.XXXXXX)"
    [[ -n "$PG_USER_RUN" ]] && chown "$PG_USER_RUN:" "$PG_ROOT"
    cp_log "the cluster lives in $PG_ROOT (${PG_USER_RUN:-$USER} cannot use $state, or its path is too long for a socket)"
  fi
}

case "$cmd" in
  down)
    if [[ ! -d "$dir" ]]; then
      cp_log "nothing to do: $dir does not exist"
      exit 0
    fi
    state="$(cd "$dir" && pwd)"
    exec 9>"$state/.postgres.lock"
    flock -w 60 9 || cp_die "timed out waiting for the lock on $state/.postgres.lock"
    load_env "$state"
    stop
    if [[ -n "$PG_ROOT" && ("$PG_ROOT" == "$state/postgres" || "$PG_ROOT" == /tmp/rebound-postgres.*) ]]; then
      rm -rf "$PG_ROOT"
    fi
    rm -f "$state/postgres.env" "$state/.postgres.lock"
    rmdir "$state" 2>/dev/null || true
    cp_log "stopped"
    exit 0
    ;;
  url | env)
    state="$(cd "$dir" 2>/dev/null && pwd)" || exit 1
    bin="$(pg_bin)"
    load_env "$state"
    pg_alive && pg_ready || exit 1
    if [[ "$cmd" == url ]]; then
      url
    else
      printf 'PGHOST=127.0.0.1\nPGPORT=%s\nPGUSER=postgres\nPGDATABASE=postgres\nDATABASE_URL=%s\n' "$PG_PORT" "$(url)"
    fi
    exit 0
    ;;
esac

bin="$(pg_bin)"
state="$(cp_state_dir "$dir")"
[[ "$state" != "/" && "$state" != "$cp_repo_root" ]] || cp_die "refusing to use '$state' as a state dir"
exec 9>"$state/.postgres.lock"
flock -w 60 9 || cp_die "timed out waiting for the lock on $state/.postgres.lock"
load_env "$state"

if pg_alive && pg_ready; then
  url
  exit 0
fi
stop

if [[ -z "$PG_ROOT" || ! -d "$PG_ROOT" ]]; then
  choose_root "$state"
  save_env "$state"
fi
log="$PG_ROOT/postgres.log"
if [[ ! -s "$PG_ROOT/data/PG_VERSION" ]]; then
  rm -rf "$PG_ROOT/data"
  as_user mkdir -p "$PG_ROOT/data"
  as_user chmod 700 "$PG_ROOT/data"
  echo "--- $(date -Is) initdb" | as_user tee -a "$log" >/dev/null
  as_user "$bin/initdb" -D "$PG_ROOT/data" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 --no-sync \
    </dev/null >>"$log" 2>&1 9>&- ||
    { tail -n 20 "$log" >&2; cp_die "initdb failed (log: $log)"; }
fi
as_user mkdir -p "$PG_ROOT/run"

for ((attempt = 0; attempt < 5; attempt++)); do
  if [[ -z "$PG_PORT" ]]; then
    PG_PORT="$(cp_free_port)"
    save_env "$state"
  fi
  echo "--- $(date -Is) starting postgres on 127.0.0.1:$PG_PORT" | as_user tee -a "$log" >/dev/null
  # pg_ctl forks the postmaster (which writes postmaster.pid) and returns; stdio and the lock fd closed.
  as_user "$bin/pg_ctl" start -D "$PG_ROOT/data" -l "$log" -s \
    -o "-c listen_addresses=127.0.0.1 -p $PG_PORT -c unix_socket_directories=$PG_ROOT/run -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=100" \
    </dev/null >/dev/null 2>&1 9>&- || true
  for ((i = 0; i < 300; i++)); do
    if pg_alive && pg_ready; then
      cp_log "ready: 127.0.0.1:$PG_PORT (pid $(server_pid), data $PG_ROOT/data, log $log)"
      url
      exit 0
    fi
    if ((i > 40)) && ! pg_alive; then
      break
    fi
    sleep 0.05
  done
  stop
  if tail -n 20 "$log" | grep -q "another postmaster"; then
    # After a crash of the postmaster its children take a moment to notice and exit.
    cp_log "the previous server's processes are still exiting; retrying"
    sleep 2
    continue
  fi
  if tail -n 20 "$log" | grep -q "could not bind\|Address already in use"; then
    cp_log "port $PG_PORT is taken; retrying with another port"
    PG_PORT=""
    continue
  fi
  break
done
tail -n 20 "$log" >&2
cp_die "postgres did not accept connections (log: $log)"
