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

# The Model Garden release the tests of tf_vrgd.model_garden run against.
MODEL_GARDEN_PACKAGE="tf-models-nightly==2.21.0.dev20260217"

# Creates ./.venv-mg if missing, with the package, its model-garden extra,
# pytest and Model Garden (installed without its dependencies: the nightly
# package pins tf-nightly, which would replace TensorFlow).
ensure_model_garden_venv() {
    local python=${PYTHON:-python3}
    if [ ! -x .venv-mg/bin/python ]; then
        "$python" -m venv .venv-mg
    fi
    .venv-mg/bin/python -m pip install --quiet --upgrade pip
    .venv-mg/bin/python -m pip install --quiet -e ".[model-garden]" "pytest>=7" "pytest-xdist>=3"
    .venv-mg/bin/python -m pip install --quiet --no-deps "$MODEL_GARDEN_PACKAGE"
}
