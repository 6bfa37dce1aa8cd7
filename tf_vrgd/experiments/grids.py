"""Resumable grids of Fashion-MNIST runs (`scripts/sweep.py`,
`scripts/study.py`): one JSON line per finished run in a results file, so
that a rerun skips what is done (and `fashion_mnist.train_run` resumes an
unfinished run from its last checkpoint)."""

import json
import os


def load_results(path, key):
    """`{key(row): row}` of the rows in the JSONL file at `path` ({} if none)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {key(r): r for r in rows}


def fashion_setup(replicas, data_dir=None, cache_dir=None):
    """The MirroredStrategy over `replicas` devices (logical CPUs without a
    GPU; must run before TensorFlow starts) and the Fashion-MNIST arrays."""
    from tf_vrgd.experiments import distribution

    devices = distribution.setup_devices(replicas)
    import tensorflow as tf

    from tf_vrgd.experiments import data

    arrays = data.load(data_dir, cache_dir)
    return tf.distribute.MirroredStrategy(devices), arrays


def run_missing(runs, key, results, path, train_one, describe):
    """Trains each run of `runs` whose key is not in `results` with
    `train_one(run) -> row`, appends the row to `path` and to `results`, and
    prints `describe(run_key, row)`."""
    for run in runs:
        run_key = key(run)
        if run_key in results:
            continue
        row = train_one(run)
        results[run_key] = row
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(describe(run_key, row), flush=True)
