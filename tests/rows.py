"""Row-sparse fixtures: the VR optimizers under test on an embedding
table (`CASES`), streams of looked-up rows per replica, their dense
samples for the numpy reference, and a driver that applies the rows as
`tf.IndexedSlices` under a strategy (`test_row_sparse`, `test_multiworker`
and its worker processes use them)."""

import keras
import numpy as np
import tensorflow as tf

from tests import references as ref
import tf_vrgd

ROWS, WIDTH = 40, 3
KERNEL = (5, 4)


class Case:
    def __init__(self, make, rule, beta_3):
        self.make, self.rule, self.beta_3 = make, rule, beta_3


CASES = {
    "VR-SGD": Case(lambda **k: tf_vrgd.VRSGD(0.5, **k), ref.sgd(0.5), 0.0),
    "VR-Momentum beta_3": Case(
        lambda **k: tf_vrgd.VRSGD(0.5, momentum=0.9, beta_3=0.8, **k), ref.sgd(0.5, 0.9), 0.8
    ),
    "VR-Adam": Case(lambda **k: tf_vrgd.VRAdam(0.05, **k), ref.adam(0.05), 0.9),
    "VR-LARS": Case(
        lambda **k: tf_vrgd.VRLARS(2.0, trust_coefficient=0.01, weight_decay_rate=0.01, **k),
        ref.lars(2.0, trust_coefficient=0.01, weight_decay_rate=0.01),
        0.0,
    ),
    "VR-LAMB": Case(
        lambda **k: tf_vrgd.VRLAMB(0.05, weight_decay_rate=0.01, **k),
        ref.lamb(0.05, weight_decay_rate=0.01),
        0.9,
    ),
}


def row_stream(steps, replicas, rows_per_replica, seed, table_rows=ROWS, every_row=False):
    """[steps][replicas] of (indices, values, kernel gradient): each replica
    looks up `rows_per_replica` ids (with repeats) from a window of the
    table that moves with the step, so that updates touch different rows;
    `every_row` adds every row once. A count of 0 is an empty batch."""
    rng = np.random.default_rng(seed)
    stream = []
    for step in range(steps):
        replicas_of_step = []
        for _ in range(replicas):
            count = rows_per_replica
            start = (step * 7) % table_rows
            ids = (start + rng.integers(0, 12, count)) % table_rows
            if count:
                ids[-1] = ids[0]  # a duplicate, as Keras' Embedding gives
            if every_row:
                ids = np.concatenate([ids, np.arange(table_rows)])
            values = rng.standard_normal((len(ids), WIDTH)).astype(np.float32)
            kernel = rng.standard_normal(KERNEL).astype(np.float32)
            replicas_of_step.append((ids.astype(np.int32), values, kernel))
        stream.append(replicas_of_step)
    return stream


def dense_samples(stream, table_rows=ROWS, accumulation=1):
    """The samples of each update, made dense: [updates][variable] [k, ...]."""
    updates = []
    for u in range(len(stream) // accumulation):
        micro = stream[u * accumulation : (u + 1) * accumulation]
        tables, kernels = [], []
        for step in micro:
            for ids, values, kernel in step:
                table = np.zeros((table_rows, WIDTH))
                np.add.at(table, ids, values.astype(np.float64))
                tables.append(table)
                kernels.append(kernel.astype(np.float64))
        updates.append([np.stack(tables), np.stack(kernels)])
    return updates


def apply_rows(strategy, optimizer, variables, stream, dense=False):
    """Each replica applies its own rows (scaled by 1/R as Keras scales a
    replica's loss) as a `tf.IndexedSlices`, or made dense if `dense`."""
    replicas = strategy.num_replicas_in_sync
    with strategy.scope():
        optimizer.build(variables)
    table_shape = tf.constant(variables[0].shape.as_list(), tf.int64)

    @tf.function
    def step(ids, values, counts, kernels):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            count = counts[replica]
            rows = tf.IndexedSlices(
                values[replica][:count] / replicas, ids[replica][:count], table_shape
            )
            table = tf.convert_to_tensor(rows) if dense else rows
            optimizer.apply([table, kernels[replica] / replicas], variables)

        strategy.run(replica_fn)

    for replicas_of_step in stream:
        longest = max(len(ids) for ids, _, _ in replicas_of_step)
        ids = np.zeros((replicas, longest), np.int32)
        values = np.zeros((replicas, longest, WIDTH), np.float32)
        for r, (i, v, _) in enumerate(replicas_of_step):
            ids[r, : len(i)], values[r, : len(i)] = i, v
        counts = np.array([len(i) for i, _, _ in replicas_of_step], np.int32)
        kernels = np.stack([k for _, _, k in replicas_of_step])
        step(*(tf.constant(x) for x in (ids, values, counts, kernels)))


def initial_weights(table_rows=ROWS, seed=3):
    rng = np.random.default_rng(seed)
    return [
        rng.standard_normal((table_rows, WIDTH)).astype(np.float32),
        rng.standard_normal(KERNEL).astype(np.float32),
    ]


def run(strategy, make_optimizer, stream, table_rows=ROWS, dense=False):
    initial = initial_weights(table_rows)
    with strategy.scope():
        variables = [
            keras.Variable(initial[0], name="embeddings"),
            keras.Variable(initial[1], name="kernel"),
        ]
        optimizer = make_optimizer()
    apply_rows(strategy, optimizer, variables, stream, dense=dense)
    return initial, [v.numpy() for v in variables], optimizer


def assert_matches(got, expected, label, initial):
    """Each variable's update (the table, then the kernel) against the
    reference's from `initial`, recorded under `label` with the variable's
    name put in."""
    for g, e, w0, what in zip(got, expected, initial, ("table", "kernel")):
        ref.assert_close(g, e, label.format(what=what), rtol=1e-4, start=w0)


def reference(case, initial, samples, **extra):
    reference = ref.VRReference(initial, case.rule, 0.1, case.beta_3, row_sparse={0}, **extra)
    for update in samples:
        weights = reference.update(update)
    return weights
