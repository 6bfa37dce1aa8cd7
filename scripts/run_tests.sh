#!/usr/bin/env bash
# Sets up two virtual environments and runs the whole test suite: ./.venv
# (tf_vrgd with its test extras) for everything but tests/model_garden,
# then ./.venv-mg (the Model Garden stack: tf_keras and Model Garden) for
# tests/model_garden. Extra arguments go to both pytest runs.
#
# Each run uses one process per core, at most four (pytest-xdist; each
# test process splits the CPU into four logical devices of its own): on
# two cores, two processes took 0.64 of one's time (964 s against 1513 s,
# README, Test). TF_VRGD_TEST_WORKERS sets the number (0: no worker
# processes); a `-n` among the arguments wins too.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv test
# .venv-mg is set up while the main suite runs: its installs (about a
# minute) are mostly waiting on files, not on the cores the tests use.
mg_log="$(mktemp)"
trap 'rm -f "$mg_log"' EXIT
ensure_model_garden_venv >"$mg_log" 2>&1 &
mg_setup=$!
workers="${TF_VRGD_TEST_WORKERS:-$(
    .venv/bin/python -c 'import os; print(min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(), 4))'
)}"
if [ "$workers" -le 1 ]; then
    workers=0
fi
# worksteal: an idle process takes tests queued for a busy one, so that the
# long end-to-end tests near the end of the collection do not leave a core idle.
main=0
.venv/bin/python -m pytest -n "$workers" --dist worksteal --ignore=tests/model_garden "$@" || main=$?
setup=0
wait "$mg_setup" || setup=$?
cat "$mg_log"
if [ "$setup" -ne 0 ]; then
    echo "run_tests.sh: setting up .venv-mg failed (above)" >&2
    exit 1
fi
if [ "$main" -ne 0 ]; then
    exit "$main"
fi
echo "--- tests/model_garden, in .venv-mg (tf_keras and Model Garden) ---"
.venv-mg/bin/python -m pytest -n "$workers" --dist worksteal tests/model_garden "$@"
