#!/usr/bin/env bash
# Sets up a virtual environment (./.venv), installs tf_vrgd with its test
# extras, and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv test
exec .venv/bin/python -m pytest "$@"
