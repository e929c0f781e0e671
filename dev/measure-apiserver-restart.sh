#!/usr/bin/env bash
# Measures, on the real node, how long an API server restart delays a policy edit: the
# charts installed, three worker Pods of examples/worker/worker-watch.yaml (watch mode,
# fleet Leases) each asking its sidecar every 50 ms; for each outage the API server is
# stopped (dev/apiserver-restart.sh --stop-only), left down OUTAGE seconds, started again
# (dev/cluster-up.sh --node); as soon as /readyz answers the RetryPolicy is edited, and
# the script prints when the operator wrote the new ConfigMap hash (a watch on it) and
# when each worker first got an answer carrying that hash (its JSON lines, `kubectl
# logs`), all in seconds after /readyz, plus the worker answers that did not come from
# the sidecar meanwhile.
#
#   dev/measure-apiserver-restart.sh [--outages "10 20 60"] [--log-level FILTER] [--keep] STATE_DIR
#
# Starts the node in STATE_DIR if it is not up (root; one node per machine), builds and
# imports the images (dev/build-images.sh, dev/node-images.sh), installs both charts.
# Stops the node (dev/cluster-down.sh STATE_DIR) at the end, on failure too, unless
# --keep (the operator's logs, at --log-level, an EnvFilter such as
# "info,rebound_operator=debug", stay readable with kubectl until then). One line per
# outage on stdout:
#   outage=20s crd_watch=1.20s compiled=1.31s workers=1.35,1.36,1.40s fallbacks=0
# (crd_watch: when the new API server first served a RetryPolicy watch)
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/usage.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/usage.sh"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
outages="10 20 60"
keep=0
log_level=info
state=""
while (($#)); do
  case "$1" in
    --outages)
      (($# >= 2)) || { echo "error: --outages needs a list" >&2; exit 2; }
      outages="$2"
      shift 2
      ;;
    --keep) keep=1; shift ;;
    --log-level)
      (($# >= 2)) || { echo "error: --log-level needs a filter" >&2; exit 2; }
      log_level="$2"
      shift 2
      ;;
    -h | --help)
      usage_from_header "${BASH_SOURCE[0]}"
      exit 0
      ;;
    -*) echo "error: unknown option '$1'" >&2; exit 2 ;;
    *)
      [[ -z "$state" ]] || { echo "error: one STATE_DIR only" >&2; exit 2; }
      state="$(realpath -m "$1")"
      shift
      ;;
  esac
done
[[ -n "$state" ]] || { usage_from_header "${BASH_SOURCE[0]}" >&2; exit 2; }

ns=restart-measure
replicas=3
log() { echo "measure: $*" >&2; }
now_ms() { date +%s%3N; }
k() { kubectl --kubeconfig "$state/kubeconfig" "$@"; }
scratch="$(mktemp -d)"
# Ends the ConfigMap watch (its curl; the rest of its pipeline then ends on EOF).
stop_watch() {
  [[ ! -s "$scratch/watch.pid" ]] || kill "$(cat "$scratch/watch.pid")" 2>/dev/null || true
  rm -f "$scratch/watch.pid"
}
cleanup() {
  stop_watch
  rm -rf "$scratch"
  if ((keep == 0)); then
    "$repo_root/dev/cluster-down.sh" "$state" >&2 || log "cluster-down.sh $state failed"
  fi
}
trap cleanup EXIT

PATH="$("$repo_root/dev/build-control-plane.sh" --print-bin-dir | tail -1):$("$repo_root/dev/build-helm.sh" --print-bin-dir | tail -1):$PATH"
images="$("$repo_root/dev/build-images.sh" | tail -1)"
"$repo_root/dev/cluster-up.sh" --node "$state" >/dev/null
"$repo_root/dev/node-images.sh" --import "$state" "$images"/*.oci.tar >/dev/null

# shellcheck disable=SC1091
source "$state/env"
api="https://10.200.0.1:$APISERVER_PORT"
curl_auth=(-sS --cacert "$state/pki/ca.crt" --cert "$state/pki/admin.crt" --key "$state/pki/admin.key")

log "installing the charts"
helm --kubeconfig "$state/kubeconfig" upgrade --install rebound-crds "$repo_root/charts/rebound-crds" \
  --take-ownership --wait >/dev/null
helm --kubeconfig "$state/kubeconfig" upgrade --install rebound "$repo_root/charts/rebound" \
  --namespace rebound-system --create-namespace --set image.pullPolicy=Never \
  --set-string "logLevel=${log_level//,/\\,}" --wait --timeout 180s >/dev/null

k create namespace "$ns" --dry-run=client -o yaml | k apply -f - >/dev/null
k -n "$ns" apply -f "$repo_root/examples/policies/webhooks.yaml" >/dev/null
# The example as it is, with three replicas, the node's test worker (every 50 ms) and
# images that are imported, never pulled.
k -n "$ns" create --dry-run=client -o json -f "$repo_root/examples/worker/worker-watch.yaml" |
  jq -s --argjson n "$replicas" '{apiVersion: "v1", kind: "List", items: .} | (.items[] | select(.kind == "Deployment")) |= (
      .spec.replicas = $n
      | .spec.template.spec.initContainers[].imagePullPolicy = "Never"
      | .spec.template.spec.containers[0].image = "rebound.dev/node-worker:dev"
      | .spec.template.spec.containers[0].imagePullPolicy = "Never"
      | .spec.template.spec.containers[0].env += [
          {"name": "INTERVAL", "value": "50ms"}, {"name": "QUEUE", "value": "webhooks"},
          {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}])' |
  k -n "$ns" apply -f - >/dev/null
k -n "$ns" rollout status deployment/worker-watch --timeout=180s >&2

config_hash() {
  k -n "$ns" get configmap rebound-policies -o json | jq -r '.metadata.annotations["rebound.dev/hash"]'
}
pods() {
  k -n "$ns" get pods -l app.kubernetes.io/name=worker-watch -o json |
    jq -r '.items[] | select(.metadata.deletionTimestamp == null and .status.phase == "Running") | .metadata.name'
}
# The worker's first answer carrying HASH at or after FROM_MS (unix ms), or nothing.
first_answer_with() { # POD HASH FROM_MS
  k -n "$ns" logs "$1" -c worker --since=10m 2>/dev/null |
    jq -R -c --arg h "$2" --argjson from "$3" 'fromjson? | select(.event == "answer" and .configHash == $h and .unixMs >= $from) | .unixMs' |
    head -1 || true
}
# Worker answers in [FROM_MS, TO_MS] that did not come from the sidecar.
fallbacks_between() { # POD FROM_MS TO_MS
  k -n "$ns" logs "$1" -c worker --since=10m 2>/dev/null |
    jq -R -c --argjson from "$2" --argjson to "$3" 'fromjson? | select(.event == "answer" and .unixMs >= $from and .unixMs <= $to and .source != "sidecar")' |
    wc -l
}
# The hash of POD's latest answer.
latest_hash() { # POD
  k -n "$ns" logs "$1" -c worker --tail=50 2>/dev/null |
    jq -R -r 'fromjson? | select(.event == "answer") | .configHash' | tail -1
}
secs() { awk -v ms="$1" 'BEGIN { printf "%.2f", ms / 1000 }'; }

edit=0
for outage in $outages; do
  old_hash="$(config_hash)"
  mapfile -t workers < <(pods)
  ((${#workers[@]} == replicas)) || { log "${#workers[@]} worker Pods running, want $replicas"; exit 1; }
  for pod in "${workers[@]}"; do
    for _ in $(seq 30); do
      [[ "$(latest_hash "$pod")" != "$old_hash" ]] || continue 2
      sleep 1
    done
    log "$pod does not serve the ConfigMap's hash $old_hash"
    exit 1
  done
  log "outage ${outage}s: stopping the API server (serving $old_hash)"
  stopped_ms="$(now_ms)"
  "$repo_root/dev/apiserver-restart.sh" --stop-only "$state" >&2
  sleep "$outage"
  "$repo_root/dev/cluster-up.sh" --node "$state" >"$scratch/up.log" 2>&1 &
  up_pid=$!
  until [[ "$(curl "${curl_auth[@]}" -m 1 "$api/readyz" 2>/dev/null)" == ok ]]; do sleep 0.05; done
  ready_ms="$(now_ms)"
  # When the new API server first serves a RetryPolicy watch: it answers 429 "storage is
  # (re)initializing" until its watch cache for the CRD is ready, and no watch-based
  # client (the operator included) sees an edit before then.
  (
    until [[ "$(curl "${curl_auth[@]}" -s -o /dev/null -w '%{http_code}' -m 2 \
      "$api/apis/rebound.dev/v1alpha1/retrypolicies?watch=1&resourceVersion=0&timeoutSeconds=1")" == 200 ]]; do
      sleep 0.1
    done
    now_ms >"$scratch/crd-watch"
  ) &
  crd_probe=$!
  # The ConfigMap's hash at each watch event, stamped on arrival; the edit waits for the
  # watch's first event, so the first new hash is the operator's write, not a late start.
  {
    curl "${curl_auth[@]}" -N -m 150 "$api/api/v1/namespaces/$ns/configmaps?watch=1&fieldSelector=metadata.name%3Drebound-policies" &
    echo $! >"$scratch/watch.pid"
    wait
  } |
    jq --unbuffered -r '.object.metadata.annotations["rebound.dev/hash"] // "-"' |
    while IFS= read -r hash; do printf '%s %s\n' "$(now_ms)" "$hash"; done >"$scratch/cm-watch" &
  until [[ -s "$scratch/cm-watch" ]]; do sleep 0.02; done
  edit=$((edit + 1))
  for try in $(seq 50); do
    k -n "$ns" patch retrypolicy webhooks --type merge -p "{\"spec\":{\"maxAttempts\":$((30 + edit))}}" >/dev/null && break
    ((try < 50)) || exit 1
    sleep 0.1
  done
  edited_ms="$(now_ms)"
  wait "$up_pid" || { cat "$scratch/up.log" >&2; exit 1; }
  wait "$crd_probe"
  crd_watch_ms="$(cat "$scratch/crd-watch")"

  compiled_ms=""
  for _ in $(seq 600); do
    compiled_ms="$(awk -v old="$old_hash" '$2 != old { print $1; exit }' "$scratch/cm-watch")"
    [[ -z "$compiled_ms" ]] || break
    sleep 0.1
  done
  [[ -n "$compiled_ms" ]] || { log "the operator did not compile the edit within 60 s"; exit 1; }
  stop_watch
  new_hash="$(config_hash)"

  served=()
  fallbacks=0
  for pod in "${workers[@]}"; do
    at=""
    for _ in $(seq 120); do
      at="$(first_answer_with "$pod" "$new_hash" "$ready_ms")"
      [[ -z "$at" ]] || break
      sleep 1
    done
    [[ -n "$at" ]] || { log "$pod did not serve $new_hash within 120 s"; exit 1; }
    served+=("$(secs $((at - ready_ms)))")
    fallbacks=$((fallbacks + $(fallbacks_between "$pod" "$stopped_ms" "$at")))
  done
  log "outage ${outage}s: /readyz at +$(secs $((ready_ms - stopped_ms)))s, edit applied $(secs $((edited_ms - ready_ms)))s after it"
  echo "outage=${outage}s crd_watch=$(secs $((crd_watch_ms - ready_ms)))s compiled=$(secs $((compiled_ms - ready_ms)))s workers=$(IFS=,; echo "${served[*]}")s fallbacks=$fallbacks"
  # The fleet settles (Leases renewed, watches idle) before the next outage.
  sleep 10
done
