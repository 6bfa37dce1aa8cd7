#!/usr/bin/env bash
# The main job, set-up included: a virtual environment (./.venv) with the
# package, the Fashion-MNIST files (Debian package dataset-fashion-mnist),
# then `vrgd-train`: LAMB vs VR-LAMB at batch 8192 on 4 replicas (logical CPU
# devices without GPUs), ending with the side-by-side table. Extra arguments
# go to vrgd-train and override the defaults (e.g. --config, --output).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
ensure_venv experiments
DATA=/usr/share/datasets/fashion-mnist
if [ ! -f "$DATA/train-images-idx3-ubyte.gz" ] && [[ " $* " != *" --data-dir"* ]]; then
    echo "Installing the Fashion-MNIST files (dataset-fashion-mnist) into $DATA"
    if [ "$(id -u)" = 0 ]; then
        apt_get() { apt-get "$@"; }
    elif sudo -n true 2>/dev/null; then
        apt_get() { sudo -n apt-get "$@"; }
    else
        echo "Cannot install it without root: run 'sudo apt-get install dataset-fashion-mnist'," >&2
        echo "or pass --data-dir with the four Fashion-MNIST IDX .gz files." >&2
        exit 1
    fi
    apt_get install -y -q dataset-fashion-mnist >/dev/null 2>&1 ||
        { apt_get update -q >/dev/null && apt_get install -y -q dataset-fashion-mnist >/dev/null; }
fi
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
exec .venv/bin/vrgd-train --config configs/fashion_mnist/lamb_b8192.yaml --compare \
    --output runs/lamb_b8192 "$@"
