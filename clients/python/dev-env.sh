#!/usr/bin/env bash
# Creates (or reuses) a virtualenv with this package and its test dependencies from PyPI,
# and prints its directory as the last line. Usage: clients/python/dev-env.sh [VENV_DIR]
# (default: <repo>/.state/py-venv). Reinstalls the package each time (it is small).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-$here/../../.state/py-venv}"
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
# [metrics]: prometheus_client, for the tests of the adapter's Prometheus counters.
"$venv/bin/pip" install -q --disable-pip-version-check "$here[test,metrics]" >&2
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$here" >&2
cd "$venv" && pwd
