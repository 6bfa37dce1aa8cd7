"""Checkpoints of the VR hook's state, written by one version of the
package and read by a later one (`tests/test_checkpoint_compat.py`).

Each case trains a table (row-sparse gradients), a large kernel (the fused
update), a small kernel and a bias (the packed update) under
`MirroredStrategy` over 4 CPU replicas, saves a `tf.train.Checkpoint`
mid-run (mid-accumulation, or between GSNR updates), then runs on and
records what that version did: every optimizer variable at the save and
the weights after the later steps. Written at commit 01bec19 by

    python -m tests.data.hook_checkpoints

(from the repository root, with the test environment's Python), into
`tests/data/hook_checkpoints/`.
"""

import os
import pathlib

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import tf_vrgd

DIRECTORY = pathlib.Path(__file__).parent / "hook_checkpoints"
REPLICAS = 4
TABLE = (40, 8)
SHAPES = [TABLE, (160, 128), (12, 6), (6,)]  # the kernel of 20480 elements is fused
LOOKUPS = 6  # rows each replica looks up per step
BEFORE, AFTER = 5, 3  # `apply` calls before the save and after it

CASES = {
    "vr_adam_accumulation": lambda: tf_vrgd.VRAdam(1e-2, gradient_accumulation_steps=2),
    "vr_momentum_interval": lambda: tf_vrgd.VRSGD(0.1, momentum=0.9, gsnr_interval=2),
    "vr_lamb": lambda: tf_vrgd.VRLAMB(1e-2, weight_decay=0.01),
}


def initial_weights():
    rng = np.random.default_rng(11)
    return [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]


def gradient_stream(steps, seed=12):
    """Per step and replica: the table's rows and values, then the dense
    gradients (signal plus noise, so that the GSNR is neither 0 nor 1)."""
    rng = np.random.default_rng(seed)
    signal = [rng.standard_normal(shape) for shape in SHAPES[1:]]
    stream = []
    for _ in range(steps):
        replicas = []
        for _ in range(REPLICAS):
            rows = rng.choice(TABLE[0], LOOKUPS, replace=False).astype(np.int32)
            values = (rng.standard_normal((LOOKUPS, TABLE[1])) + 0.5).astype(np.float32)
            dense = [(s + rng.standard_normal(s.shape)).astype(np.float32) for s in signal]
            replicas.append((rows, values, dense))
        stream.append(replicas)
    return stream


def make_variables(strategy):
    with strategy.scope():
        return [keras.Variable(w, name=f"w{i}") for i, w in enumerate(initial_weights())]


def apply_stream(strategy, optimizer, variables, stream):
    """Each replica applies its own gradients, scaled by 1/R as Keras
    scales a replica's loss."""
    with strategy.scope():
        optimizer.build(variables)
    table_shape = tf.constant(TABLE, tf.int64)

    @tf.function
    def step(rows, values, *dense):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            table = tf.IndexedSlices(values[replica] / REPLICAS, rows[replica], table_shape)
            grads = [table] + [tf.gather(g, replica) / REPLICAS for g in dense]
            optimizer.apply(grads, variables)

        strategy.run(replica_fn)

    for replicas in stream:
        rows = np.stack([r for r, _, _ in replicas])
        values = np.stack([v for _, v, _ in replicas])
        dense = [np.stack([d[i] for _, _, d in replicas]) for i in range(len(SHAPES) - 1)]
        step(tf.constant(rows), tf.constant(values), *(tf.constant(d) for d in dense))


def optimizer_values(optimizer):
    """Every variable of `optimizer` by its path (on-read sums as their
    cross-replica sum, as checkpoints store them)."""
    return {v.path: np.asarray(v.numpy()) for v in optimizer.variables}


def write(strategy):
    DIRECTORY.mkdir(exist_ok=True)
    stream = gradient_stream(BEFORE + AFTER)
    for name, make in CASES.items():
        variables = make_variables(strategy)
        with strategy.scope():
            optimizer = make()
        apply_stream(strategy, optimizer, variables, stream[:BEFORE])
        checkpoint = tf.train.Checkpoint(variables=variables, optimizer=optimizer)
        checkpoint.write(str(DIRECTORY / name / "ckpt"))
        saved = optimizer_values(optimizer)
        at_save = [v.numpy() for v in variables]
        apply_stream(strategy, optimizer, variables, stream[BEFORE:])
        np.savez(
            DIRECTORY / f"{name}.npz",
            **{f"optimizer/{path}": value for path, value in saved.items()},
            **{f"at_save/{i}": w for i, w in enumerate(at_save)},
            **{f"after/{i}": v.numpy() for i, v in enumerate(variables)},
        )


def cpu_strategy():
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * REPLICAS
    )
    return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])


if __name__ == "__main__":
    write(cpu_strategy())
