# Shared functions of the dev/ control-plane scripts. Sourced, not executed.
#
# State dir layout (one per cluster; several clusters may run at once):
#   env                  ports and binary dir of this cluster (sourced by the scripts)
#   kubeconfig           admin kubeconfig (embedded certs); written once the API server is ready
#   pki/                 ca.{crt,key}, apiserver.{crt,key}, admin.{crt,key}, sa.{key,pub}
#   etcd.pid, kube-apiserver.pid
#   etcd-data/           etcd data (deleted by cluster-down.sh)
#   logs/etcd.log, logs/kube-apiserver.log

# shellcheck shell=bash

cp_repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cp_default_state_dir="$cp_repo_root/.state/cluster"
# The local node's address, on its own bridge (dev/lib/node.sh). With a node, the API
# server listens there (Pods must reach it) instead of on 127.0.0.1.
cp_node_ip=10.200.0.1

cp_die() {
  echo "error: $*" >&2
  exit 1
}
cp_log() { echo "${cp_script_name:-controlplane}: $*" >&2; }

cp_now() { date +%s.%N; }
cp_elapsed() { awk -v a="$1" -v b="$(cp_now)" 'BEGIN { printf "%.1f", b - a }'; }

# Resolves STATE_DIR to an absolute path (it need not exist yet).
cp_state_dir() {
  local dir="${1:-$cp_default_state_dir}"
  mkdir -p "$dir"
  (cd "$dir" && pwd)
}

# Takes an exclusive lock on the state dir for the rest of the calling script.
cp_lock_state() {
  local state="$1"
  exec 8>"$state/.lock"
  if ! flock -w 600 8; then
    cp_die "timed out waiting for the lock on $state/.lock"
  fi
}

# True if the PID in $1 (a pid file in a state dir) is alive and runs the binary named
# $2 with arguments that point into that state dir (so a reused PID never matches).
cp_pid_alive() {
  local pidfile="$1" name="$2" pid cmd
  [[ -f "$pidfile" ]] || return 1
  pid="$(<"$pidfile")"
  [[ "$pid" =~ ^[0-9]+$ ]] || return 1
  [[ -r "/proc/$pid/cmdline" ]] || return 1
  cmd="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" || return 1
  [[ "$cmd" == *"/$name "* && "$cmd" == *"$(dirname "$pidfile")/"* ]]
}

# Starts BIN ARGS... in a session of its own, in the background, and records its real PID
# in PIDFILE. (`setsid` forks when its caller leads a process group, as under job control,
# so `$!` is not always the daemon's PID; the PID is written from inside instead.)
cp_launch() {
  local pidfile="$1" i
  shift
  rm -f "$pidfile"
  # shellcheck disable=SC2016 # $$ and $@ belong to the inner shell
  setsid bash -c 'echo "$$" >"$0" && exec "$@"' "$pidfile" "$@" &
  for ((i = 0; i < 200; i++)); do
    [[ -s "$pidfile" ]] && return 0
    sleep 0.01
  done
  return 1
}

# After `cp_launch`, waits until the child has exec'd BIN (its cmdline shows it).
cp_wait_exec() {
  local pid="$1" name="$2" i cmd
  # Up to 30 s: on a loaded 2-core machine a fork can take seconds to reach its exec.
  for ((i = 0; i < 600; i++)); do
    [[ -r "/proc/$pid/cmdline" ]] || return 1
    cmd="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" || return 1
    [[ "$cmd" == *"/$name "* ]] && return 0
    sleep 0.05
  done
  return 1
}

# Stops the process recorded in pid file $1 if it is still the binary $2; waits for it.
cp_stop_pid() {
  local pidfile="$1" name="$2" pid i
  if ! cp_pid_alive "$pidfile" "$name"; then
    rm -f "$pidfile"
    return 0
  fi
  pid="$(<"$pidfile")"
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 150; i++)); do
    cp_pid_alive "$pidfile" "$name" || break
    sleep 0.1
  done
  if cp_pid_alive "$pidfile" "$name"; then
    cp_log "$name (pid $pid) did not stop after SIGTERM; sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
      cp_pid_alive "$pidfile" "$name" || break
      sleep 0.1
    done
  fi
  # A zombie (child of a shell that has not reaped it) no longer runs the binary.
  cp_pid_alive "$pidfile" "$name" && cp_die "$name (pid $pid) is still running"
  rm -f "$pidfile"
}

# Prints a TCP port on 127.0.0.1 that nothing listens on, outside the ephemeral range.
cp_free_port() {
  local port i
  for ((i = 0; i < 200; i++)); do
    port=$((20000 + (RANDOM * 32768 + RANDOM) % 12000))
    if [[ -z "$(ss -Htan "( sport = :$port )" 2>/dev/null)" ]]; then
      echo "$port"
      return 0
    fi
  done
  cp_die "found no free TCP port"
}

# Locates the binaries: $REBOUND_CONTROLPLANE_BIN, else the build cache (building if needed).
cp_bin_dir() {
  local dir
  if [[ -n "${REBOUND_CONTROLPLANE_BIN:-}" ]]; then
    dir="$REBOUND_CONTROLPLANE_BIN"
  else
    dir="$("$cp_repo_root/dev/build-control-plane.sh" --print-bin-dir)"
    if [[ ! -x "$dir/kube-apiserver" || ! -x "$dir/etcd" ]]; then
      cp_log "control-plane binaries not built yet; running dev/build-control-plane.sh"
      dir="$("$cp_repo_root/dev/build-control-plane.sh" | tail -n 1)"
    fi
  fi
  [[ -x "$dir/kube-apiserver" && -x "$dir/etcd" ]] ||
    cp_die "no kube-apiserver/etcd in '$dir' (run dev/build-control-plane.sh or set REBOUND_CONTROLPLANE_BIN)"
  echo "$dir"
}

# Issues a certificate signed by the cluster CA.
#   cp_issue_cert PKI NAME SUBJECT EXTENSIONS
cp_issue_cert() {
  local pki="$1" name="$2" subject="$3" ext="$4" extfile
  extfile="$(mktemp)"
  printf '%s\n' "$ext" >"$extfile"
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$pki/$name.key" 2>/dev/null
  openssl req -new -key "$pki/$name.key" -subj "$subject" -out "$pki/$name.csr" 2>/dev/null
  openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 3650 -sha256 -extfile "$extfile" -out "$pki/$name.crt" 2>/dev/null ||
    { rm -f "$extfile"; cp_die "openssl could not issue the $name certificate"; }
  rm -f "$extfile" "$pki/$name.csr"
  chmod 600 "$pki/$name.key"
}

# Creates the CA, serving cert, admin client cert and service-account keys (once).
cp_make_pki() {
  local pki="$1/pki"
  [[ -f "$pki/.complete" ]] && return 0
  command -v openssl >/dev/null || cp_die "openssl is needed to create certificates (apt-get install openssl)"
  rm -rf "$pki"
  mkdir -p "$pki"
  chmod 700 "$pki"
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$pki/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$pki/ca.key" -subj "/CN=rebound-dev-ca" -days 3650 -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
    -out "$pki/ca.crt" 2>/dev/null || cp_die "openssl could not create the CA"
  chmod 600 "$pki/ca.key"
  cp_issue_cert "$pki" apiserver "/CN=kube-apiserver" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:$cp_node_ip,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:10.0.0.1"
  cp_issue_cert "$pki" admin "/O=system:masters/CN=rebound-admin" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$pki/sa.key" 2>/dev/null
  openssl pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  chmod 600 "$pki/sa.key"
  touch "$pki/.complete"
}

# Writes a kubeconfig with embedded data. cp_write_kubeconfig OUT SERVER CA CERT KEY USER
cp_write_kubeconfig() {
  local out="$1" server="$2" ca="$3" cert="$4" key="$5" user="$6" tmp
  tmp="$(mktemp "$out.tmp.XXXXXX")"
  cat >"$tmp" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: rebound-dev
  cluster:
    server: $server
    certificate-authority-data: $(base64 -w0 <"$ca")
users:
- name: $user
  user:
    client-certificate-data: $(base64 -w0 <"$cert")
    client-key-data: $(base64 -w0 <"$key")
contexts:
- name: rebound-dev
  context:
    cluster: rebound-dev
    user: $user
current-context: rebound-dev
EOF
  chmod 600 "$tmp"
  mv -f "$tmp" "$out"
}

# The API server's address: the node's with a node (NODE_MODE=1 in env), else loopback.
cp_api_host() {
  if [[ "${NODE_MODE:-0}" == 1 ]]; then echo "$cp_node_ip"; else echo 127.0.0.1; fi
}

cp_curl_api() {
  local state="$1" path="$2"
  # shellcheck disable=SC2154 # set by sourcing $state/env
  curl -sS --max-time 5 --cacert "$state/pki/ca.crt" --cert "$state/pki/admin.crt" \
    --key "$state/pki/admin.key" "https://$(cp_api_host):${APISERVER_PORT}$path"
}

# Starts etcd if it is not running. Chooses ports on first start, keeps them afterwards.
cp_start_etcd() {
  local state="$1" bin="$2" attempt i
  cp_pid_alive "$state/etcd.pid" etcd && return 0
  for ((attempt = 0; attempt < 5; attempt++)); do
    if [[ -z "${ETCD_CLIENT_PORT:-}" ]]; then
      ETCD_CLIENT_PORT="$(cp_free_port)"
      ETCD_PEER_PORT="$(cp_free_port)"
      cp_save_env "$state"
    fi
    mkdir -p "$state/etcd-data" "$state/logs"
    chmod 700 "$state/etcd-data"
    echo "--- $(date -Is) starting etcd" >>"$state/logs/etcd.log"
    cp_launch "$state/etcd.pid" "$bin/etcd" \
      --name=rebound-dev \
      --data-dir="$state/etcd-data" \
      --listen-client-urls="http://127.0.0.1:$ETCD_CLIENT_PORT" \
      --advertise-client-urls="http://127.0.0.1:$ETCD_CLIENT_PORT" \
      --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
      --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
      --initial-cluster="rebound-dev=http://127.0.0.1:$ETCD_PEER_PORT" \
      --unsafe-no-fsync=true \
      --log-level=warn \
      </dev/null >>"$state/logs/etcd.log" 2>&1 8>&- || true
    cp_wait_exec "$(cat "$state/etcd.pid" 2>/dev/null)" etcd || true
    for ((i = 0; i < 300; i++)); do
      if ! cp_pid_alive "$state/etcd.pid" etcd; then
        break
      fi
      if curl -sf --max-time 2 "http://127.0.0.1:$ETCD_CLIENT_PORT/health" 2>/dev/null | grep -q '"health":"true"'; then
        return 0
      fi
      sleep 0.1
    done
    cp_stop_pid "$state/etcd.pid" etcd
    if tail -n 20 "$state/logs/etcd.log" | grep -q "address already in use"; then
      cp_log "etcd port $ETCD_CLIENT_PORT or $ETCD_PEER_PORT is taken; retrying with other ports"
      ETCD_CLIENT_PORT=""
      continue
    fi
    break
  done
  tail -n 20 "$state/logs/etcd.log" >&2
  cp_die "etcd did not become healthy (log: $state/logs/etcd.log)"
}

# Starts kube-apiserver if it is not running and waits for /readyz and the default namespace.
cp_start_apiserver() {
  local state="$1" bin="$2" attempt i pki="$1/pki" host mode_flags
  host="$(cp_api_host)"
  if [[ "${NODE_MODE:-0}" == 1 ]]; then
    # What a node needs: ServiceAccount admission (tokens for Pods), the Node authorizer
    # and NodeRestriction for the kubelet, the kubernetes Service's endpoints, and a
    # client certificate to reach the kubelet (logs, exec).
    mode_flags=(--authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction
      --endpoint-reconciler-type=lease
      --kubelet-client-certificate="$pki/apiserver-kubelet-client.crt"
      --kubelet-client-key="$pki/apiserver-kubelet-client.key"
      --kubelet-certificate-authority="$pki/ca.crt" --kubelet-preferred-address-types=InternalIP)
  else
    mode_flags=(--authorization-mode=RBAC --disable-admission-plugins=ServiceAccount
      --endpoint-reconciler-type=none)
  fi
  if cp_pid_alive "$state/kube-apiserver.pid" kube-apiserver; then
    cp_wait_apiserver "$state"
    return 0
  fi
  for ((attempt = 0; attempt < 5; attempt++)); do
    if [[ -z "${APISERVER_PORT:-}" ]]; then
      APISERVER_PORT="$(cp_free_port)"
      cp_save_env "$state"
    fi
    mkdir -p "$state/logs"
    echo "--- $(date -Is) starting kube-apiserver" >>"$state/logs/kube-apiserver.log"
    cp_launch "$state/kube-apiserver.pid" "$bin/kube-apiserver" \
      --etcd-servers="http://127.0.0.1:$ETCD_CLIENT_PORT" \
      --bind-address="$host" \
      --advertise-address="$host" \
      --secure-port="$APISERVER_PORT" \
      --tls-cert-file="$pki/apiserver.crt" \
      --tls-private-key-file="$pki/apiserver.key" \
      --client-ca-file="$pki/ca.crt" \
      "${mode_flags[@]}" \
      --service-account-issuer="https://127.0.0.1:$APISERVER_PORT" \
      --service-account-key-file="$pki/sa.pub" \
      --service-account-signing-key-file="$pki/sa.key" \
      --service-cluster-ip-range=10.0.0.0/24 \
      --allow-privileged=true \
      --profiling="${REBOUND_APISERVER_PROFILING:-false}" \
      </dev/null >>"$state/logs/kube-apiserver.log" 2>&1 8>&- || true
    cp_wait_exec "$(cat "$state/kube-apiserver.pid" 2>/dev/null)" kube-apiserver || true
    if cp_wait_apiserver "$state"; then
      return 0
    fi
    cp_stop_pid "$state/kube-apiserver.pid" kube-apiserver
    if tail -n 50 "$state/logs/kube-apiserver.log" | grep -q 'address already in use'; then
      cp_log "API server port $APISERVER_PORT is taken; retrying with another port (the kubeconfig changes)"
      APISERVER_PORT=""
      continue
    fi
    break
  done
  tail -n 30 "$state/logs/kube-apiserver.log" >&2
  cp_die "kube-apiserver did not become ready (log: $state/logs/kube-apiserver.log)"
}

# Waits up to ~120 s for /readyz and the default namespace; fails early if the process died.
cp_wait_apiserver() {
  local state="$1" i
  for ((i = 0; i < 1200; i++)); do
    cp_pid_alive "$state/kube-apiserver.pid" kube-apiserver || return 1
    if [[ "$(cp_curl_api "$state" /readyz 2>/dev/null)" == "ok" ]] &&
      cp_curl_api "$state" /api/v1/namespaces/default 2>/dev/null | grep -q '"phase": *"Active"'; then
      return 0
    fi
    sleep 0.1
  done
  return 1
}

cp_save_env() {
  local state="$1"
  cat >"$state/env.tmp" <<EOF
# Written by dev/cluster-up.sh; read by the other dev/ scripts.
ETCD_CLIENT_PORT=${ETCD_CLIENT_PORT:-}
ETCD_PEER_PORT=${ETCD_PEER_PORT:-}
APISERVER_PORT=${APISERVER_PORT:-}
NODE_MODE=${NODE_MODE:-0}
KUBELET_PORT=${KUBELET_PORT:-}
KUBELET_HEALTHZ_PORT=${KUBELET_HEALTHZ_PORT:-}
KUBE_PROXY_HEALTHZ_PORT=${KUBE_PROXY_HEALTHZ_PORT:-}
KUBE_PROXY_METRICS_PORT=${KUBE_PROXY_METRICS_PORT:-}
EOF
  mv -f "$state/env.tmp" "$state/env"
}

cp_load_env() {
  local state="$1"
  ETCD_CLIENT_PORT="" ETCD_PEER_PORT="" APISERVER_PORT="" NODE_MODE=0
  KUBELET_PORT="" KUBELET_HEALTHZ_PORT="" KUBE_PROXY_HEALTHZ_PORT="" KUBE_PROXY_METRICS_PORT=""
  if [[ -f "$state/env" ]]; then
    # shellcheck disable=SC1091
    source "$state/env"
  fi
}
