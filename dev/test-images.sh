#!/usr/bin/env bash
# Builds the images (dev/build-images.sh) and checks what is in them: the OCI config
# (numeric user, entrypoint, no Cmd, OCI labels), one layer holding exactly the binary
# (no shell, nothing else), a static binary (no shared library, no interpreter), the size. When a
# daemonless runtime works here (podman with runc), runs each image's binary; otherwise
# runs the binary extracted from the image. Prints a figure line per image and
# "N passed, N failed" last.
#
# Usage: dev/test-images.sh [BUILD_DIR]     (default: target/images)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
build_dir="$(dev/build-images.sh "${1:-}" | tail -n 1)"
version="$(awk -F'"' '/^\[workspace.package\]/ { p = 1 } p && $1 ~ /^version *= */ { print $2; exit }' Cargo.toml)"
registry="${REBOUND_IMAGE_REGISTRY:-ghcr.io/rebound-dev}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

passed=0
failed=0
check() {
  local what="$1"
  shift
  if "$@"; then
    passed=$((passed + 1))
    echo "ok: $what"
  else
    failed=$((failed + 1))
    echo "FAILED: $what"
  fi
}

# Daemonless runtime: podman with runc, its own storage. In VMs that mount cgroup v1
# controllers beside a v2 hierarchy crun refuses ("cgroups in hybrid mode not supported"),
# and raising rlimits is refused, so cgroupfs and lowered limits are asked for.
runtime=0
if command -v podman >/dev/null && command -v runc >/dev/null; then
  runtime=1
fi
podman=(podman --root "$build_dir/podman/root" --runroot "$build_dir/podman/run" --storage-driver vfs
  --runtime runc --cgroup-manager cgroupfs)
limits=(--read-only --ulimit nofile=1024:1024 --ulimit nproc=1024:1024)
podman_run=("${podman[@]}" run --rm --network=none "${limits[@]}")

for component in operator sidecar; do
  name="rebound-$component"
  archive="$build_dir/$name-$version.oci.tar"
  dir="$work/$component"
  mkdir -p "$dir/oci" "$dir/rootfs"
  tar -xf "$archive" -C "$dir/oci"
  # Structured checks of the OCI layout, config and layer listing.
  check "$name: OCI config, labels and layer" python3 - "$dir/oci" "$dir/rootfs" "$name" "$version" "$registry/$name:$version" <<'PY'
import json, os, sys, tarfile
oci, rootfs, name, version, ref = sys.argv[1:]
def blob(digest):
    algo, hexd = digest.split(":", 1)
    return os.path.join(oci, "blobs", algo, hexd)
index = json.load(open(os.path.join(oci, "index.json")))
manifests = index["manifests"]
assert len(manifests) == 1, manifests
m = manifests[0]
assert m["annotations"]["org.opencontainers.image.ref.name"] == ref, m["annotations"]
manifest = json.load(open(blob(m["digest"])))
assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json", manifest["mediaType"]
config = json.load(open(blob(manifest["config"]["digest"])))
c = config["config"]
assert config["os"] == "linux" and config["architecture"] == "amd64", config
assert c["User"] == "65532:65532", c.get("User")
assert c["Entrypoint"] == [f"/{name}"], c.get("Entrypoint")
assert not c.get("Cmd"), c.get("Cmd")
labels = c["Labels"]
for key, want in [("title", name), ("version", version), ("licenses", "Apache-2.0")]:
    assert labels[f"org.opencontainers.image.{key}"] == want, (key, labels)
for key in ["revision", "created", "source", "description"]:
    assert labels.get(f"org.opencontainers.image.{key}"), key
layers = manifest["layers"]
assert len(layers) == 1, layers
with tarfile.open(blob(layers[0]["digest"])) as t:
    members = [x for x in t.getmembers() if x.name.strip("./")]
    names = sorted(x.name.lstrip("./") for x in members)
    assert names == [name], f"the layer holds {names}"
    member = members[0]
    assert member.isfile() and member.mode & 0o777 == 0o555, oct(member.mode)
    t.extract(member, rootfs)
size = os.path.getsize(blob(layers[0]["digest"]))
total = size + os.path.getsize(blob(manifest["config"]["digest"])) + os.path.getsize(blob(m["digest"]))
print(f"image {ref}: {total / 1048576:.1f} MiB ({layers[0]['mediaType'].rsplit('.', 1)[-1]} layer {size / 1048576:.1f} MiB)")
PY
  bin="$dir/rootfs/$name"
  # static-pie: a dynamic section for its own relocations, but no library to load.
  check "$name: static-pie, no shared library needed" bash -c "readelf -h '$bin' | grep -q 'DYN' && ! readelf -d '$bin' | grep -q '(NEEDED)'"
  check "$name: no interpreter" bash -c "! readelf -l '$bin' | grep -q 'INTERP'"
  # clap prints "<name> <version>".
  expected="$name $version"
  if ((runtime)); then
    # Installed, so it must work: a failure here is a failed check, not a fallback.
    got="$("${podman_run[@]}" "oci-archive:$archive" --version 2>"$work/podman.err" || tail -n 1 "$work/podman.err")"
    echo "ran $name --version in the image with podman"
  else
    got="$("$bin" --version)"
    echo "note: podman or runc is not installed; ran the binary extracted from the image"
  fi
  check "$name --version is '$expected' (got '$got')" test "$got" = "$expected"
  check "$name --help exits 0" bash -c "'$bin' --help >/dev/null"
done
# The images serving, not only printing their version: the sidecar answers from a policy
# file; with a cluster (dev/test.sh exports REBOUND_CLUSTER_STATE_DIR) the operator
# reconciles a policy to Ready. Host network, loopback ports only.
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
containers=()
cleanup_containers() {
  local c
  for c in "${containers[@]}"; do
    "${podman[@]}" rm -f "$c" >/dev/null 2>&1 || true
  done
  rm -rf "$work"
}
trap cleanup_containers EXIT
run_detached=("${podman[@]}" run -d --network=host "${limits[@]}")
sidecar_serves() {
  local admin grpc name="rebound-sidecar-check-$$"
  admin="$(free_port)"
  grpc="$(free_port)"
  containers+=("$name")
  "${run_detached[@]}" --name "$name" -v "$repo_root/examples/policies:/policies:ro" \
    "oci-archive:$build_dir/rebound-sidecar-$version.oci.tar" --policies-file=/policies/webhooks.yaml \
    --listen="127.0.0.1:$grpc" --admin-listen="127.0.0.1:$admin" >/dev/null || return 1
  local i
  for i in $(seq 1 100); do
    # The exact sample line: the gauge of the active state is 1.
    if curl -sf "http://127.0.0.1:$admin/metrics" | grep -qx 'rebound_sidecar_config_state{state="active"} 1'; then
      return 0
    fi
    sleep 0.3
  done
  "${podman[@]}" logs "$name" | tail -n 5
  return 1
}
operator_reconciles() {
  local state="$1" ns="images-$$-$RANDOM" name="rebound-operator-check-$$" metrics
  metrics="$(free_port)"
  # Readable by the image's user 65532.
  chmod 755 "$work"
  install -m 644 "$state/kubeconfig" "$work/kubeconfig"
  kubectl --kubeconfig "$state/kubeconfig" create namespace "$ns" >/dev/null || return 1
  containers+=("$name")
  "${run_detached[@]}" --name "$name" -v "$work/kubeconfig:/kubeconfig:ro" -e KUBECONFIG=/kubeconfig \
    "oci-archive:$build_dir/rebound-operator-$version.oci.tar" --namespaces="$ns" --leader-elect=false \
    --metrics-addr="127.0.0.1:$metrics" >/dev/null || return 1
  kubectl --kubeconfig "$state/kubeconfig" -n "$ns" apply -f "$repo_root/examples/policies/webhooks.yaml" >/dev/null &&
    kubectl --kubeconfig "$state/kubeconfig" -n "$ns" wait --for=condition=Ready retrypolicy/webhooks --timeout=60s >/dev/null ||
    { "${podman[@]}" logs "$name" | tail -n 5; return 1; }
}
if ((runtime)); then
  check "rebound-sidecar image serves a policy file" sidecar_serves
  if [[ -n "${REBOUND_CLUSTER_STATE_DIR:-}" && -f "$REBOUND_CLUSTER_STATE_DIR/kubeconfig" ]]; then
    check "rebound-operator image reconciles a RetryPolicy to Ready" operator_reconciles "$REBOUND_CLUSTER_STATE_DIR"
  else
    echo "note: no REBOUND_CLUSTER_STATE_DIR: the operator image was not run against a cluster"
  fi
fi

echo "images: $passed passed, $failed failed"
((failed == 0))
