# Sourced by the scripts in this folder: creates ./.venv (with $PYTHON,
# default python3) if missing and installs the package into it, with the
# extras named in $1 (e.g. "test"), quietly.
ensure_venv() {
    local extras=${1:-}
    local python=${PYTHON:-python3}
    if [ ! -x .venv/bin/python ]; then
        "$python" -m venv .venv
    fi
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".${extras:+[$extras]}"
}
