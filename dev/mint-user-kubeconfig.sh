#!/usr/bin/env bash
# Writes a kubeconfig for another user of a cluster started by dev/cluster-up.sh,
# authenticated by a client certificate signed with the cluster's CA
# (CN = user name, O = groups).
#
#   dev/mint-user-kubeconfig.sh STATE_DIR USER [GROUP...] OUT
#
# Example, a service account as RBAC sees it:
#   dev/mint-user-kubeconfig.sh .state/cluster system:serviceaccount:ns1:rebound-operator \
#     system:serviceaccounts system:serviceaccounts:ns1 /tmp/operator.kubeconfig
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/usage.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/usage.sh"
cp_script_name=mint-user-kubeconfig
# shellcheck source-path=SCRIPTDIR source=lib/controlplane.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/controlplane.sh"

if (($# < 3)); then
  usage_from_header "${BASH_SOURCE[0]}" >&2
  exit 2
fi
dir="$1"
user="$2"
out="${!#}"
groups=("${@:3:$#-3}")
[[ -f "$dir/pki/ca.key" && -f "$dir/env" ]] || cp_die "no cluster in '$dir' (start one with dev/cluster-up.sh)"
[[ -n "$user" ]] || cp_die "USER must not be empty"
state="$(cd "$dir" && pwd)"
cp_load_env "$state"

# openssl -subj needs '/' and '\' escaped.
esc() { printf '%s' "$1" | sed -e 's/[\\/]/\\&/g'; }
subject=""
for g in "${groups[@]}"; do
  subject+="/O=$(esc "$g")"
done
subject+="/CN=$(esc "$user")"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cp "$state/pki/ca.crt" "$work/ca.crt"
ln -s "$state/pki/ca.key" "$work/ca.key"
cp_issue_cert "$work" user "$subject" "basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
mkdir -p "$(dirname "$out")"
cp_write_kubeconfig "$out" "https://$(cp_api_host):$APISERVER_PORT" "$state/pki/ca.crt" \
  "$work/user.crt" "$work/user.key" "$user"
echo "$out"
