#!/usr/bin/env bash
# Writes the plain manifests for `kubectl apply` from the chart, so that charts/rebound is
# the one source: the chart rendered with its default values for release "rebound" in
# namespace rebound-system, after the Namespace itself (Pod Security "restricted").
#
# Usage: dev/gen-deploy.sh [OUT_FILE]    (default: stdout)
#        dev/gen-deploy.sh --check FILE  (fails if FILE differs from what it would write)
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
helm="$("$repo_root/dev/build-helm.sh" | tail -n 1)/helm"

render() {
  cat <<'YAML'
# Generated from charts/rebound by dev/gen-deploy.sh; do not edit. Apply after the CRD:
#   kubectl apply --server-side -f crds/ && kubectl apply --server-side -f THIS_FILE
apiVersion: v1
kind: Namespace
metadata:
  name: rebound-system
  labels:
    app.kubernetes.io/part-of: rebound
    pod-security.kubernetes.io/enforce: restricted
YAML
  HELM_CACHE_HOME="$tmp/cache" HELM_CONFIG_HOME="$tmp/config" HELM_DATA_HOME="$tmp/data" \
    "$helm" template rebound "$repo_root/charts/rebound" --namespace rebound-system |
    sed -e '/^# Source: /d'
}

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
case "${1:-}" in
  --check)
    [[ -n "${2:-}" ]] || { echo "usage: $0 --check FILE" >&2; exit 2; }
    if ! diff -u "$2" <(render); then
      echo "$2 is stale: run dev/gen-deploy.sh $2" >&2
      exit 1
    fi
    ;;
  "") render ;;
  *) render >"$1" ;;
esac
