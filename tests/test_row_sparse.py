"""The row-sparse path (docs/algorithms.md §2, §3 and §6): VR optimizers
given an embedding table's gradient as `tf.IndexedSlices` against the numpy
reference of the rule on the same gradients made dense, and against the
optimizer's own dense path."""

import keras
import numpy as np
import pytest
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


def assert_matches(got, expected, label):
    """Each variable (the table, then the kernel) against the reference,
    recorded under `label` with the variable's name put in."""
    for g, e, what in zip(got, expected, ("table", "kernel")):
        ref.assert_close(g, e, label.format(what=what), rtol=1e-4)


def reference(case, initial, samples, **extra):
    reference = ref.VRReference(initial, case.rule, 0.1, case.beta_3, row_sparse={0}, **extra)
    for update in samples:
        weights = reference.update(update)
    return weights


def _check_five_updates(strategy, name, replicas, seed):
    """Five updates of 5 rows per replica, against the reference; returns
    the stream, the initial weights and the weights after."""
    case = CASES[name]
    stream = row_stream(steps=5, replicas=replicas, rows_per_replica=5, seed=seed)
    initial, got, _ = run(strategy, case.make, stream)
    expected = reference(case, initial, dense_samples(stream))
    assert_matches(got, expected, f"{name} row-sparse {{what}} ({replicas} replicas)")
    return stream, initial, got


@pytest.mark.parametrize("name", CASES)
def test_rows_match_the_reference_where_most_rows_are_not_touched(strategy, name):
    stream, initial, got = _check_five_updates(strategy, name, replicas=4, seed=1)
    # Rows no update touched are as they were, but under decay.
    untouched = sorted(set(range(ROWS)) - {int(i) for s in stream for r in s for i in r[0]})
    assert untouched
    if name not in ("VR-LARS", "VR-LAMB"):
        np.testing.assert_array_equal(got[0][untouched], initial[0][untouched])


@pytest.mark.parametrize("name", ["VR-Momentum beta_3", "VR-Adam", "VR-LAMB"])
def test_dense_and_row_sparse_paths_agree_when_every_row_is_touched(strategy, name):
    """Every row has a sample at every update: per-row counts equal the
    update count, and the two paths are one rule."""
    case = CASES[name]
    stream = row_stream(steps=4, replicas=4, rows_per_replica=6, seed=2, every_row=True)
    initial, sparse, _ = run(strategy, case.make, stream)
    _, dense, _ = run(strategy, case.make, stream, dense=True)
    expected = reference(case, initial, dense_samples(stream))
    for s, d, e, what in zip(sparse, dense, expected, ("table", "kernel")):
        ref.assert_close(s, d, f"{name} row-sparse vs dense path, every row", rtol=1e-4)
        ref.assert_close(s, e, f"{name} row-sparse {what}, every row", rtol=1e-4)


@pytest.mark.parametrize("name", ["VR-SGD", "VR-LARS"])
def test_dense_and_row_sparse_paths_agree_where_most_rows_are_not_touched(strategy, name):
    """Without a GSNR momentum no count enters: the dense path, with the
    layer mean over the measured elements, is the row-sparse one."""
    case = CASES[name]
    stream = row_stream(steps=4, replicas=4, rows_per_replica=5, seed=4)
    _, sparse, _ = run(strategy, case.make, stream)
    _, dense, _ = run(strategy, case.make, stream, dense=True)
    for s, d in zip(sparse, dense):
        ref.assert_close(s, d, f"{name} row-sparse vs dense path, few rows", rtol=1e-4)


@pytest.mark.parametrize("name", ["VR-SGD", "VR-Adam", "VR-LAMB"])
def test_rows_with_accumulation_match_the_reference(strategy, name):
    case = CASES[name]
    stream = row_stream(steps=6, replicas=4, rows_per_replica=4, seed=5)
    initial, got, optimizer = run(
        strategy, lambda: case.make(gradient_accumulation_steps=2), stream
    )
    expected = reference(case, initial, dense_samples(stream, accumulation=2))
    assert_matches(got, expected, f"{name} row-sparse {{what}} (4 replicas x 2 micro-steps)")
    assert int(optimizer.iterations.numpy()) == 3
    # The accumulators are empty again after the last update.
    vr = optimizer
    assert not np.any(vr._accumulated_rows[0].numpy())
    assert not np.any(vr._accumulated_gradients[0].numpy())


@pytest.mark.parametrize("name", ["VR-SGD", "VR-Adam"])
def test_rows_on_two_replicas_match_the_reference(strategy_2, name):
    _check_five_updates(strategy_2, name, replicas=2, seed=6)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_empty_batches_of_rows(strategy, accumulation):
    """A replica without rows, and an update in which no replica has any:
    nothing moves there, no NaN, and the counts skip it."""
    case = CASES["VR-Adam"]
    stream = row_stream(steps=6, replicas=4, rows_per_replica=4, seed=7)
    empty = (np.zeros(0, np.int32), np.zeros((0, WIDTH), np.float32))
    for step, replicas in ((0, (1, 3)), (2, (0, 1, 2, 3)), (3, (0, 1, 2, 3)), (5, (2,))):
        for r in replicas:
            stream[step][r] = (*empty, stream[step][r][2])
    extra = {"gradient_accumulation_steps": accumulation} if accumulation > 1 else {}
    initial, got, _ = run(strategy, lambda: case.make(**extra), stream)
    expected = reference(case, initial, dense_samples(stream, accumulation=accumulation))
    assert_matches(got, expected, "VR-Adam row-sparse {what}, empty batches")


@pytest.mark.parametrize("name", ["VR-SGD", "VR-Adam"])
def test_rows_with_a_gsnr_interval_match_the_reference(strategy, name):
    case = CASES[name]
    stream = row_stream(steps=6, replicas=4, rows_per_replica=5, seed=8)
    initial, got, _ = run(strategy, lambda: case.make(gsnr_interval=2), stream)
    expected = reference(case, initial, dense_samples(stream), gsnr_interval=2)
    assert_matches(got, expected, f"{name} row-sparse {{what}}, gsnr_interval 2")


def test_an_update_makes_no_tensor_of_the_table_size(strategy):
    """VR-SGD on a table of 100,003 rows: no op of the traced update has an
    output with that many rows, except the table's own handle and reads."""
    table_rows = 100_003
    with strategy.scope():
        variables = [
            keras.Variable(np.zeros((table_rows, WIDTH), np.float32), name="embeddings"),
            keras.Variable(np.zeros(KERNEL, np.float32), name="kernel"),
        ]
        optimizer = tf_vrgd.VRSGD(0.1)
        optimizer.build(variables)
    shape = tf.constant([table_rows, WIDTH], tf.int64)

    @tf.function
    def step():
        def replica_fn():
            ids = tf.constant([3, 5, 3, 99_999])
            rows = tf.IndexedSlices(tf.ones((4, WIDTH)), ids, shape)
            optimizer.apply([rows, tf.ones(KERNEL)], variables)

        strategy.run(replica_fn)

    graph = step.get_concrete_function().graph
    table_sized = set()

    def visit(graph):
        for op in graph.get_operations():
            for output in op.outputs:
                sized = output.shape.rank and output.shape[0] == table_rows
                if sized and op.type not in ("ReadVariableOp", "VarHandleOp", "Identity"):
                    table_sized.add(op.type)
            for function in getattr(graph, "_functions", {}).values():
                visit(function.graph)

    visit(graph)
    assert not table_sized, table_sized
    step()
    assert int(optimizer.iterations.numpy()) == 1


@pytest.mark.parametrize("name", ["VR-SGD", "VR-Adam"])
def test_rows_with_accumulation_under_xla_on_one_device(name):
    """`model.compile(jit_compile=True)` on one device compiles the whole
    step: the accumulated rows are then a list whose size XLA knows only
    at run time. Row 0 is looked up in every micro-step (the row XLA pads
    such lists with), among 5 of 30 rows."""
    case = CASES[name]
    table_rows = 30
    stream = row_stream(steps=6, replicas=1, rows_per_replica=5, seed=9, table_rows=table_rows)
    for (replica,) in stream:
        replica[0][0] = 0
    initial = initial_weights(table_rows)
    variables = [
        keras.Variable(initial[0], name="embeddings"),
        keras.Variable(initial[1], name="kernel"),
    ]
    optimizer = case.make(gradient_accumulation_steps=2)
    optimizer.build(variables)
    table_shape = tf.constant([table_rows, WIDTH], tf.int64)

    @tf.function(jit_compile=True)
    def step(ids, values, kernel):
        optimizer.apply([tf.IndexedSlices(values, ids, table_shape), kernel], variables)

    for ((ids, values, kernel),) in stream:
        step(tf.constant(ids), tf.constant(values), tf.constant(kernel))
    expected = reference(case, initial, dense_samples(stream, table_rows, accumulation=2))
    assert_matches(
        [v.numpy() for v in variables], expected, f"{name} row-sparse {{what}}, XLA, 1 x 2"
    )
