#!/usr/bin/env bash
# Writes charts/rebound-crds/templates/ from crds/: the same CRD, with the chart's labels
# and the keep annotation added to its metadata. `--check` fails if the templates are stale.
#
# Usage: dev/gen-chart-crds.sh [--check]
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out_dir="$repo_root/charts/rebound-crds/templates"
check=0
[[ "${1:-}" == "--check" ]] && check=1

render() {
  local crd="$1"
  grep -q '{{' "$crd" && {
    echo "error: $crd contains '{{', which Helm would read as a template" >&2
    exit 1
  }
  echo "# Generated from crds/$(basename "$crd") by dev/gen-chart-crds.sh; do not edit."
  # The only change: labels and annotations after metadata.name.
  awk '
    /^#/ && !started { next }
    { started = 1 }
    { print }
    /^metadata:$/ { in_meta = 1; next }
    in_meta && /^  name: / {
      print "  labels:"
      print "    app.kubernetes.io/name: rebound-crds"
      print "    app.kubernetes.io/instance: {{ .Release.Name }}"
      print "    app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}"
      print "    app.kubernetes.io/part-of: rebound"
      print "    app.kubernetes.io/managed-by: {{ .Release.Service }}"
      print "    helm.sh/chart: {{ printf \"%s-%s\" .Chart.Name .Chart.Version | replace \"+\" \"_\" }}"
      print "  {{- if .Values.keep }}"
      print "  annotations:"
      print "    # Uninstalling the release must not delete every RetryPolicy."
      print "    helm.sh/resource-policy: keep"
      print "  {{- end }}"
      in_meta = 0
    }
  ' "$crd"
}

status=0
for crd in "$repo_root"/crds/*.yaml; do
  target="$out_dir/$(basename "$crd")"
  if ((check)); then
    if ! diff -q <(render "$crd") "$target" >/dev/null 2>&1; then
      echo "stale: ${target#"$repo_root"/} (run dev/gen-chart-crds.sh)" >&2
      status=1
    fi
  else
    mkdir -p "$out_dir"
    render "$crd" >"$target"
  fi
done
exit "$status"
