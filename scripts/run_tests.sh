#!/usr/bin/env bash
# Sets up a virtual environment (./.venv), installs tf_vrgd with its test
# extras, and runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test]"
exec .venv/bin/python -m pytest "$@"
