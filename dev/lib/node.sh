# The local node of dev/cluster-up.sh --node: kube-controller-manager, kube-scheduler,
# containerd, kubelet and kube-proxy beside the control plane of dev/lib/controlplane.sh.
# Sourced after it, not executed.
#
# One node per machine: it owns the bridge rebound0 (the node's address $cp_node_ip/24,
# Pods on the rest of the /24), the cgroup /rebound-node and kube-proxy's nftables tables.
# Everything else lives in STATE_DIR/node:
#   containerd/          config.toml, its socket, root, state (netns mounts too), runc root
#   kubelet/             the kubelet's root dir (Pod volumes are mounted here)
#   cni/                 the CNI network config and host-local's address records
#   *.kubeconfig *.yaml  the components' credentials and configuration
#   *.pid                one per process; logs in STATE_DIR/logs

# shellcheck shell=bash

node_name=rebound-node
node_bridge=rebound0
node_pod_subnet="${cp_node_ip%.*}.0/24"
node_cgroup=rebound-node
# Debian package of each command the node runs.
declare -A node_package_of=([containerd]=containerd [containerd-shim-runc-v2]=containerd [ctr]=containerd
  [runc]=runc [pgrep]=procps [iptables]=iptables [ip6tables]=iptables [nft]=nftables [conntrack]=conntrack [ip]=iproute2
  [buildah]=buildah)

# Fails with the apt-get command that installs whatever the node lacks, or with what this
# machine cannot give a kubelet (not root, no cgroup v1 controllers, no bridge netfilter).
node_check_host() {
  local missing=() tool plugin controller
  for tool in "${!node_package_of[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("${node_package_of[$tool]}")
  done
  for plugin in bridge host-local loopback; do
    [[ -x "/usr/lib/cni/$plugin" ]] || missing+=(containernetworking-plugins)
  done
  if ((${#missing[@]})); then
    mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
    cp_die "the node needs Debian packages: apt-get install -y ${missing[*]}"
  fi
  ((EUID == 0)) || cp_die "the node runs containers: run as root"
  for controller in cpu cpuacct cpuset memory pids devices freezer; do
    [[ -d "/sys/fs/cgroup/$controller" ]] ||
      cp_die "no cgroup v1 controller '$controller' mounted at /sys/fs/cgroup/$controller (the node's kubelet uses cgroupfs on cgroup v1)"
  done
  grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null ||
    cp_die "the kernel has no overlay filesystem (containerd's overlayfs snapshotter needs it)"
}

# Certificates of the node's components, signed by the cluster CA (once).
node_make_pki() {
  local pki="$1/pki" client="basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  [[ -f "$pki/.node-complete" ]] && return 0
  cp_issue_cert "$pki" kubelet-client "/O=system:nodes/CN=system:node:$node_name" "$client"
  cp_issue_cert "$pki" kubelet-serving "/CN=$node_name" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:$cp_node_ip,DNS:$node_name"
  cp_issue_cert "$pki" apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$client"
  cp_issue_cert "$pki" controller-manager "/CN=system:kube-controller-manager" "$client"
  cp_issue_cert "$pki" scheduler "/CN=system:kube-scheduler" "$client"
  cp_issue_cert "$pki" kube-proxy "/CN=system:kube-proxy" "$client"
  touch "$pki/.node-complete"
}

# The bridge carries the node's address, so the API server can listen there before the
# first Pod exists (the CNI bridge plugin then uses it as it is).
node_make_bridge() {
  local state="$1"
  if ip link show "$node_bridge" >/dev/null 2>&1; then
    [[ -f "$state/node/bridge" ]] ||
      cp_die "$node_bridge exists but this state dir did not create it: another node runs here (dev/cluster-down.sh its STATE_DIR)"
  else
    ip link add "$node_bridge" type bridge || cp_die "could not create the bridge $node_bridge (ip link add ... type bridge)"
  fi
  : >"$state/node/bridge"
  ip addr replace "$cp_node_ip/24" dev "$node_bridge"
  ip link set "$node_bridge" up
}

# Writes the node's configuration files (idempotent; ports are chosen once, in env).
node_write_config() {
  local state="$1" node="$1/node" pki="$1/pki" server
  server="https://$cp_node_ip:$APISERVER_PORT"
  mkdir -p "$node/containerd" "$node/kubelet" "$node/cni/net.d" "$node/cni/ipam" "$state/logs/pods"
  for component in kubelet-client:kubelet controller-manager:controller-manager scheduler:scheduler kube-proxy:kube-proxy; do
    cp_write_kubeconfig "$node/${component#*:}.kubeconfig" "$server" "$pki/ca.crt" \
      "$pki/${component%%:*}.crt" "$pki/${component%%:*}.key" "${component#*:}"
  done
  cat >"$node/containerd/config.toml" <<EOF
# The node's own containerd (dev/lib/node.sh): nothing under /var/lib or /run/containerd.
version = 2
root = "$node/containerd/root"
state = "$node/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "$node/containerd/containerd.sock"
[ttrpc]
  address = "$node/containerd/containerd.sock.ttrpc"
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "rebound.dev/pause:1"
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  disable_apparmor = true
  # Without CAP_SYS_RESOURCE (these VMs drop it) no process may lower its oom_score_adj;
  # the kubelet asks -998 for sandboxes: keep every container at containerd's own or above.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        Root = "$node/containerd/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$node/cni/net.d"
EOF
  cat >"$node/cni/net.d/10-rebound.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "rebound",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$node_bridge",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$node_pod_subnet", "gateway": "$cp_node_ip", "rangeStart": "${cp_node_ip%.*}.10"}]],
        "routes": [{"dst": "0.0.0.0/0"}],
        "dataDir": "$node/cni/ipam"
      }
    }
  ]
}
EOF
  cat >"$node/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# These machines: cgroup v1 (a tmpfs /sys/fs/cgroup), no systemd, no swap accounting.
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
cgroupRoot: /$node_cgroup
containerRuntimeEndpoint: unix://$node/containerd/containerd.sock
address: $cp_node_ip
port: $KUBELET_PORT
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTHZ_PORT
tlsCertFile: $pki/kubelet-serving.crt
tlsPrivateKeyFile: $pki/kubelet-serving.key
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $pki/ca.crt}
authorization: {mode: Webhook}
podLogsDir: $state/logs/pods
# ConfigMap volumes follow their ConfigMap within about syncFrequency (the default is 1m;
# docs/install.md says what that means for file mode).
syncFrequency: ${REBOUND_NODE_SYNC_FREQUENCY:-5s}
# Images come from dev/node-images.sh, never a registry: never collect them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
serializeImagePulls: false
resolvConf: /etc/resolv.conf
EOF
  cat >"$node/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
# nftables: every rule in kube-proxy's own tables, which dev/cluster-down.sh deletes.
mode: nftables
clientConnection: {kubeconfig: $node/kube-proxy.kubeconfig}
hostnameOverride: $node_name
clusterCIDR: $node_pod_subnet
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:$KUBE_PROXY_HEALTHZ_PORT
metricsBindAddress: 127.0.0.1:$KUBE_PROXY_METRICS_PORT
nodePortAddresses: ["$cp_node_ip/32"]
conntrack: {maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
}

# node_start NAME PIDFILE_BASENAME BIN ARGS...: starts a node process unless it runs.
node_start() {
  local state="$1" name="$2" try
  shift 2
  cp_pid_alive "$state/node/$name.pid" "$name" && return 0
  # A start whose process is gone at once, without a line of output, is tried once more:
  # on a loaded machine (a release build just before) containerd was seen to vanish so.
  # A second such start is left to node_wait, which fails with the log.
  for try in 1 2; do
    echo "--- $(date -Is) starting $name (try $try)" >>"$state/logs/$name.log"
    cp_launch "$state/node/$name.pid" "$@" </dev/null >>"$state/logs/$name.log" 2>&1 8>&- ||
      cp_die "could not start $name"
    cp_wait_exec "$(cat "$state/node/$name.pid" 2>/dev/null)" "$name" && sleep 0.2 &&
      cp_pid_alive "$state/node/$name.pid" "$name" && return 0
  done
}

# Waits until CHECK (a command) succeeds, while the process NAME runs; fails with its log.
node_wait() {
  local state="$1" name="$2" what="$3" i
  shift 3
  for ((i = 0; i < 1200; i++)); do
    cp_pid_alive "$state/node/$name.pid" "$name" || break
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  tail -n 30 "$state/logs/$name.log" >&2
  cp_die "$name: $what (log: $state/logs/$name.log)"
}

node_kubectl() { kubectl --kubeconfig "$1/kubeconfig" "${@:2}"; }

# Starts the node's processes (after etcd and the API server) and waits for Node Ready.
node_up() {
  local state="$1" bin="$2" node="$1/node" pki="$1/pki" images controller
  for port in KUBELET_PORT KUBELET_HEALTHZ_PORT KUBE_PROXY_HEALTHZ_PORT KUBE_PROXY_METRICS_PORT; do
    [[ -n "${!port:-}" ]] || printf -v "$port" '%s' "$(cp_free_port)"
  done
  cp_save_env "$state"
  node_write_config "$state"
  # What node_down may delete is what did not exist before the node's first start.
  [[ -f "$node/host-nft-tables" ]] || nft list tables >"$node/host-nft-tables"
  # The kubelet wants its cgroup root in every v1 hierarchy (name=systemd too).
  for controller in $(node_cgroup_hierarchies); do
    mkdir -p "$controller/$node_cgroup"
  done
  # cpuset children start empty: give the node's cgroup every CPU and memory node.
  cp /sys/fs/cgroup/cpuset/cpuset.cpus "/sys/fs/cgroup/cpuset/$node_cgroup/cpuset.cpus"
  cp /sys/fs/cgroup/cpuset/cpuset.mems "/sys/fs/cgroup/cpuset/$node_cgroup/cpuset.mems"

  node_start "$state" kube-controller-manager "$bin/kube-controller-manager" \
    --kubeconfig="$node/controller-manager.kubeconfig" \
    --authentication-kubeconfig="$node/controller-manager.kubeconfig" \
    --authorization-kubeconfig="$node/controller-manager.kubeconfig" \
    --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
    --use-service-account-credentials=true --leader-elect=false \
    --bind-address=127.0.0.1 --secure-port=0 --controllers='*,-bootstrapsigner,-tokencleaner'
  node_start "$state" kube-scheduler "$bin/kube-scheduler" \
    --kubeconfig="$node/scheduler.kubeconfig" \
    --authentication-kubeconfig="$node/scheduler.kubeconfig" \
    --authorization-kubeconfig="$node/scheduler.kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1 --secure-port=0
  node_start "$state" containerd "$(command -v containerd)" --config "$node/containerd/config.toml"
  node_wait "$state" containerd "did not answer on its socket" \
    ctr --address "$node/containerd/containerd.sock" version
  images="$("$cp_repo_root/dev/node-images.sh" --import "$state" | tail -n 1)" ||
    cp_die "could not load the node's images"
  node_start "$state" kubelet "$bin/kubelet" --config="$node/kubelet.yaml" \
    --kubeconfig="$node/kubelet.kubeconfig" --root-dir="$node/kubelet" \
    --hostname-override="$node_name" --node-ip="$cp_node_ip" --cert-dir="$node/kubelet/pki"
  node_start "$state" kube-proxy "$bin/kube-proxy" --config="$node/kube-proxy.yaml"
  node_wait "$state" kubelet "the Node did not become Ready" node_ready "$state"
  node_wait "$state" kube-controller-manager "the default ServiceAccount was not created" \
    node_kubectl "$state" get serviceaccount default -n default
  cp_log "node $node_name Ready (images from $images)"
}

# Removes the kubelet's iptables chains (KUBE-*, with the rules that jump to them) and
# every nftables table that did not exist before the node started (kube-proxy's, and the
# iptables-nft tables the kubelet's chains created).
node_remove_rules() {
  local state="$1" cmd table rule chain
  for cmd in iptables ip6tables; do
    for table in mangle nat filter; do
      while read -r rule; do
        # shellcheck disable=SC2086 # a rule is a list of words
        "$cmd" -w -t "$table" -D ${rule#-A } 2>/dev/null || true
      done < <("$cmd" -w -t "$table" -S 2>/dev/null | grep -E '^-A .* -j KUBE-' || true)
      while read -r chain; do
        "$cmd" -w -t "$table" -F "$chain" 2>/dev/null || true
        "$cmd" -w -t "$table" -X "$chain" 2>/dev/null || true
      done < <("$cmd" -w -t "$table" -S 2>/dev/null | awk '$1 == "-N" && $2 ~ /^KUBE-/ { print $2 }')
    done
  done
  [[ -f "$state/node/host-nft-tables" ]] || return 0
  while read -r table; do
    grep -qxF "$table" "$state/node/host-nft-tables" || nft delete $table 2>/dev/null || true
  done < <(nft list tables 2>/dev/null)
}

# The mount points of the cgroup v1 hierarchies.
node_cgroup_hierarchies() {
  awk '{ for (i = 7; i < NF; i++) if ($i == "-") { if ($(i + 1) == "cgroup") print $5; break } }' /proc/self/mountinfo
}

# The mount points of the cgroup v2 hierarchy (on a hybrid host, /sys/fs/cgroup/unified):
# the kubelet creates the node's cgroups there too, though it runs on v1.
node_cgroup2_mounts() {
  awk '{ for (i = 7; i < NF; i++) if ($i == "-") { if ($(i + 1) == "cgroup2") print $5; break } }' /proc/self/mountinfo
}

node_ready() {
  [[ "$(node_kubectl "$1" get node "$node_name" \
    -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}

# Stops everything node_up started and removes what its Pods left on the host: container
# processes (by the node's cgroup), shims, mounts under STATE_DIR, network namespaces,
# the bridge and its veths, kube-proxy's and the kubelet's rules, the node's cgroups.
node_down() {
  local state="$1" node="$1/node" pid controller mnt table family
  [[ -d "$node" ]] || return 0
  cp_stop_pid "$node/kubelet.pid" kubelet
  cp_stop_pid "$node/kube-proxy.pid" kube-proxy
  # Delete every container through containerd, so each shim exits and removes its socket.
  local ctr=(ctr --address "$node/containerd/containerd.sock" --namespace k8s.io) id
  if cp_pid_alive "$node/containerd.pid" containerd; then
    for id in $("${ctr[@]}" tasks ls -q 2>/dev/null); do
      "${ctr[@]}" tasks delete --force "$id" >/dev/null 2>&1 || true
    done
    for id in $("${ctr[@]}" containers ls -q 2>/dev/null); do
      "${ctr[@]}" containers delete "$id" >/dev/null 2>&1 || true
    done
  fi
  # Backstops when containerd is gone: every container process is in the node's cgroup
  # tree (the pause processes too), and our shims name our socket.
  if [[ -d "/sys/fs/cgroup/pids/$node_cgroup" ]]; then
    while read -r pid; do kill -KILL "$pid" 2>/dev/null || true; done < <(
      find "/sys/fs/cgroup/pids/$node_cgroup" -name cgroup.procs -exec cat {} + 2>/dev/null)
  fi
  cp_stop_pid "$node/containerd.pid" containerd
  local shim="containerd-shim-runc-v2 .*-address $node/containerd/containerd.sock"
  pkill -KILL -f "$shim" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do
    pgrep -f "$shim" >/dev/null || break
    sleep 0.1
  done
  # A killed shim leaves its socket in /run/containerd/s (containerd 1.6 keeps them there
  # whatever its state dir): remove the sockets nothing listens on.
  if [[ -d /run/containerd/s ]]; then
    local listening
    listening="$(ss -Hxl 2>/dev/null | awk '{ print $5 }')"
    local socket
    for socket in /run/containerd/s/*; do
      [[ -S "$socket" ]] && ! grep -qxF "$socket" <<<"$listening" && rm -f "$socket"
    done
  fi
  # Mounts under the state dir, deepest first: Pod volumes, rootfs overlays, netns.
  while read -r mnt; do
    umount "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || true
  done < <(awk -v dir="$node/" 'index($5, dir) == 1 { print $5 }' /proc/self/mountinfo | sort -r)
  ip link delete "$node_bridge" 2>/dev/null || true
  node_remove_rules "$state"
  cp_stop_pid "$node/kube-scheduler.pid" kube-scheduler
  cp_stop_pid "$node/kube-controller-manager.pid" kube-controller-manager
  for controller in $(node_cgroup_hierarchies) $(node_cgroup2_mounts); do
    [[ -d "$controller/$node_cgroup" ]] || continue
    find "$controller/$node_cgroup" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
  rm -f "$node/bridge"
}
