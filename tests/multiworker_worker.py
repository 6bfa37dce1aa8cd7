"""One worker of the multi-worker test (`test_multiworker.py` starts two).

Run as ``python -m tests.multiworker_worker OUTPUT.npz`` with `TF_CONFIG`
set. Under `MultiWorkerMirroredStrategy` each worker holds one replica (on a
machine without GPUs, TensorFlow gives each worker one CPU device), and
applies the gradient stream that `test_multiworker.py` derives from the same
seeds:

- VR-Momentum, no accumulation: k = 2 workers;
- VR-Adam with 2 accumulation micro-steps: k = 2 workers x 2 = 4, the
  samples that one process with 4 replicas applies in one update;
- an embedding table's rows (`test_row_sparse.py`'s stream): VR-Adam
  without accumulation, VR-SGD with 2 micro-steps;
- `tf_vrgd.NoiseScale` around Keras' Adam on the VR-Momentum stream, and
  around the package's Adam with 2 micro-steps on the VR-Adam samples:
  their running sums;
- `tf_vrgd.AdaScale`, without and with 2 micro-steps: weights, gain and
  tau.

Every worker writes the final weights of both runs to its output file.
"""

import functools
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

from tests import helpers, rows
import tf_vrgd

UPDATES = 4
# With k = 2 samples the variance (g_1 - g_2)^2 / 4 is tiny where the two
# nearly agree, and its float32 error dominates the layer mean; a variance
# floor of 1e-3 s bounds the raw GSNR (and that error) so that the update
# can be checked to 1e-4.
VR_MOMENTUM = dict(learning_rate=0.05, momentum=0.9, gamma=0.2, gsnr_epsilon=1e-3)
VR_ADAM = dict(learning_rate=0.01, gamma=0.2)


def four_replica_stream():
    """[updates][4 replicas][variables]: the samples of the VR-Adam run."""
    return helpers.gradient_stream(
        helpers.model_shapes(), UPDATES, replicas=4, scales=[1.0, 0.1, 3.0, 0.01], seed=7
    )


def two_worker_micro_steps(stream):
    """The same samples as micro-steps of two one-replica workers:
    update u = micro-step [s0, s1] then micro-step [s2, s3]."""
    return [micro for step in stream for micro in (step[:2], step[2:])]


def two_worker_stream():
    """[updates][2 replicas][variables]: the samples of the VR-Momentum run."""
    return helpers.gradient_stream(helpers.model_shapes(), UPDATES, replicas=2, seed=3)


ROW_RUNS = {
    "rows_adam": ("VR-Adam", {}, 1),
    "rows_sgd_accumulation": ("VR-SGD", {"gradient_accumulation_steps": 2}, 2),
}


# name: (AdaScale, micro-steps): k = 2 workers, and 2 workers x 2
# micro-steps (k = 4, S = 16), on `adascale_stream`.
ADASCALE_RUNS = {
    "adascale_two_workers": (lambda: tf_vrgd.AdaScale(keras.optimizers.SGD(0.1), decay=0.5), 1),
    "adascale_micro_steps": (
        lambda: tf_vrgd.AdaScale(
            tf_vrgd.SGD(0.05, momentum=0.9, gradient_accumulation_steps=2), scale=16, decay=0.9
        ),
        2,
    ),
}


def adascale_stream(accumulation):
    """[micro-steps][2 replicas][variables], 4 updates: samples around a
    mean shared by the update's samples, so that the gain is resolved."""
    shapes = helpers.model_shapes()
    stream = helpers.gradient_stream(shapes, UPDATES * accumulation, replicas=2, seed=11)
    means = helpers.gradient_stream(shapes, UPDATES, replicas=1, seed=12)
    return [
        [[g + 0.7 * m for g, m in zip(replica, means[i // accumulation][0])] for replica in step]
        for i, step in enumerate(stream)
    ]


def row_stream(accumulation):
    """[micro-steps][2 replicas] of rows: 3 updates."""
    return rows.row_stream(steps=3 * accumulation, replicas=2, rows_per_replica=5, seed=9)


def main(output):
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert strategy.num_replicas_in_sync == 2, strategy.num_replicas_in_sync
    results = {}
    runs = {
        "momentum": (lambda: tf_vrgd.VRSGD(**VR_MOMENTUM), two_worker_stream()),
        "adam": (
            lambda: tf_vrgd.VRAdam(**VR_ADAM, gradient_accumulation_steps=2),
            two_worker_micro_steps(four_replica_stream()),
        ),
    }
    for name, (make_optimizer, stream) in runs.items():
        _, weights, optimizer = helpers.run_mirrored(strategy, make_optimizer, stream)
        assert int(optimizer.iterations.numpy()) == UPDATES  # updates, not micro-steps
        for i, w in enumerate(weights):
            results[f"{name}_{i}"] = w
    noise_runs = {
        "noise_scale": (
            lambda: tf_vrgd.NoiseScale(keras.optimizers.Adam(0.01)),
            runs["momentum"][1],
        ),
        "noise_scale_accumulation": (
            lambda: tf_vrgd.NoiseScale(tf_vrgd.Adam(0.01, gradient_accumulation_steps=2)),
            runs["adam"][1],
        ),
    }
    for name, (make_optimizer, stream) in noise_runs.items():
        _, _, optimizer = helpers.run_mirrored(strategy, make_optimizer, stream)
        results[f"{name}_sums"] = optimizer.noise_scale_sums()
    for name, (make_optimizer, accumulation) in ADASCALE_RUNS.items():
        stream = adascale_stream(accumulation)
        _, weights, optimizer = helpers.run_mirrored(strategy, make_optimizer, stream)
        results[f"gain_and_tau_of_{name}"] = np.array(
            [optimizer.gain, optimizer.scale_invariant_steps]
        )
        for i, w in enumerate(weights):
            results[f"{name}_{i}"] = w
    for name, (case, extra, accumulation) in ROW_RUNS.items():
        make = functools.partial(rows.CASES[case].make, **extra)
        _, weights, optimizer = rows.run(strategy, make, row_stream(accumulation))
        assert int(optimizer.iterations.numpy()) == 3
        for i, w in enumerate(weights):
            results[f"{name}_{i}"] = w
    np.savez(output, **results)


if __name__ == "__main__":
    main(sys.argv[1])
