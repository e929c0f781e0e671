#!/usr/bin/env bash
# Copies monitoring/rules.yaml and monitoring/dashboard.json into charts/rebound/files/
# (Helm reads no file outside the chart): the chart's PrometheusRule and dashboard ConfigMap
# are made from these copies. `--check` fails if a copy is stale.
#
# Usage: dev/gen-chart-monitoring.sh [--check]
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out_dir="$repo_root/charts/rebound/files/monitoring"
check=0
case "${1:-}" in
  --check) check=1 ;;
  "") ;;
  *)
    echo "error: unknown argument '$1' (usage: dev/gen-chart-monitoring.sh [--check])" >&2
    exit 2
    ;;
esac

status=0
for name in rules.yaml dashboard.json; do
  source_file="$repo_root/monitoring/$name"
  target="$out_dir/$name"
  if ((check)); then
    if ! cmp -s "$source_file" "$target"; then
      echo "stale: ${target#"$repo_root"/} (run dev/gen-chart-monitoring.sh)" >&2
      status=1
    fi
  else
    mkdir -p "$out_dir"
    cp "$source_file" "$target"
  fi
done
exit "$status"
