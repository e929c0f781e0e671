#!/usr/bin/env bash
# Checks what dev/demo.sh or dev/test.sh needs on this machine before either builds
# anything, and installs what is missing from Debian's packages (apt-get, as root or
# through sudo). A no-op when everything is there. Rust, Go, Python 3 and Node come with
# the machine; the control plane, Helm, grpcurl and the registry packages (pip, npm ci)
# are built or installed by the scripts that use them.
#
# Usage: dev/prerequisites.sh demo|test
#
#   demo  the tools of the whole loop: openssl, curl, ss, flock/setsid, pgrep, python3
#         with pip, redis-server, node and npm
#   test  those, plus the adapters' libraries (Ruby with Sidekiq, ActiveJob and gRPC;
#         PostgreSQL; protoc; python3-venv), rsvg-convert for the plots, buildah, podman
#         and runc for the images, and the node's containerd, CNI plugins, iptables,
#         nftables and conntrack
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/usage.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/usage.sh"

log() { echo "prerequisites: $*" >&2; }
die() {
  echo "error: $*" >&2
  exit 1
}

case "${1:-}" in
  demo | test) scope="$1" ;;
  -h | --help)
    usage_from_header "${BASH_SOURCE[0]}"
    exit 0
    ;;
  *) die "usage: dev/prerequisites.sh demo|test (try --help)" ;;
esac

for tool in cargo go python3 node; do
  command -v "$tool" >/dev/null 2>&1 ||
    die "$tool is not on PATH: Rust (cargo), Go >= 1.26, Python 3 and Node >= 20 are needed"
done

packages=()
# The node's packages come without Debian's recommendations (containerd's would pull in more).
node_packages=()
need_tool() { command -v "$1" >/dev/null 2>&1 || packages+=("$2"); }
need_node_tool() { command -v "$1" >/dev/null 2>&1 || node_packages+=("$2"); }

# Only the packages of missing tools: a machine may already have Node from another source
# (NodeSource's nodejs bundles npm and conflicts with Debian's npm package).
need_tool openssl openssl
need_tool curl curl
need_tool ss iproute2
need_tool pgrep procps
need_tool flock util-linux
need_tool setsid util-linux
need_tool redis-server redis-server
need_tool npm npm
python3 -m pip --version >/dev/null 2>&1 || packages+=(python3-pip)

if [[ "$scope" == test ]]; then
  need_tool rsvg-convert librsvg2-bin
  # The Flux test's repository: git, and git http-backend behind dev/flux/githttp.
  need_tool git git
  # Python venvs (clients/python/dev-env.sh) need ensurepip, in Debian's python3-venv.
  python3 -c 'import ensurepip' >/dev/null 2>&1 || packages+=(python3-venv)
  # The Sidekiq adapter (clients/ruby): Ruby, Sidekiq 6.4, ActiveJob 6.1, gRPC, its stub
  # generator, rake.
  if ! command -v sidekiq >/dev/null 2>&1 || ! command -v grpc_tools_ruby_protoc >/dev/null 2>&1 ||
    ! command -v rake >/dev/null 2>&1 || ! ruby -e 'require "grpc"; require "active_job"' >/dev/null 2>&1; then
    packages+=(ruby ruby-sidekiq ruby-activejob ruby-grpc ruby-grpc-tools rake)
  fi
  # Its Prometheus counters' tests: prometheus-client-mmap (Debian packages no
  # prometheus-client gem) and WEBrick, which serves them in the README's worker.
  ruby -e 'require "prometheus/client"; require "webrick"' >/dev/null 2>&1 ||
    packages+=(ruby-prometheus-client-mmap ruby-webrick)
  # The River adapter (clients/go): PostgreSQL (dev/postgres.sh) and protoc (the stubs'
  # drift test, clients/go/gen.sh).
  compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || packages+=(postgresql)
  need_tool protoc protobuf-compiler
  # Images: buildah builds them (dev/build-images.sh), podman with runc runs them.
  need_tool buildah buildah
  need_tool podman podman
  need_tool runc runc
  need_tool readelf binutils
  # The local node (dev/cluster-up.sh --node; dev/lib/node.sh names them).
  need_node_tool containerd containerd
  need_node_tool ctr containerd
  need_node_tool iptables iptables
  need_node_tool nft nftables
  need_node_tool conntrack conntrack
  [[ -x /usr/lib/cni/bridge && -x /usr/lib/cni/host-local ]] || node_packages+=(containernetworking-plugins)
fi

((${#packages[@]} + ${#node_packages[@]})) || exit 0
all=("${packages[@]}" "${node_packages[@]}")

apt=(apt-get)
if ((EUID != 0)); then
  command -v sudo >/dev/null 2>&1 ||
    die "missing Debian packages: ${all[*]} (install them as root: apt-get install ${all[*]})"
  apt=(sudo apt-get)
fi
log "installing Debian packages: ${all[*]}"
export DEBIAN_FRONTEND=noninteractive
"${apt[@]}" update -qq
if ((${#packages[@]})); then
  mapfile -t packages < <(printf '%s\n' "${packages[@]}" | sort -u)
  "${apt[@]}" install -y -qq "${packages[@]}" >/dev/null
fi
if ((${#node_packages[@]})); then
  mapfile -t node_packages < <(printf '%s\n' "${node_packages[@]}" | sort -u)
  "${apt[@]}" install -y -qq --no-install-recommends "${node_packages[@]}" >/dev/null
fi
# Installing redis-server or postgresql may also start Debian's system-wide servers (6379,
# 5432), and containerd its own (/run/containerd); the scripts never use them: dev/redis.sh,
# dev/postgres.sh and the node start their own, on their own ports and sockets.
