"""The row-sparse path (docs/algorithms.md §2, §3 and §6): VR optimizers
given an embedding table's gradient as `tf.IndexedSlices` against the numpy
reference of the rule on the same gradients made dense, and against the
optimizer's own dense path."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import references as ref
from tests.rows import (
    CASES,
    KERNEL,
    ROWS,
    WIDTH,
    assert_matches,
    dense_samples,
    initial_weights,
    reference,
    row_stream,
    run,
)
import tf_vrgd


def _check_five_updates(strategy, name, replicas, seed):
    """Five updates of 5 rows per replica, against the reference; returns
    the stream, the initial weights and the weights after."""
    case = CASES[name]
    stream = row_stream(steps=5, replicas=replicas, rows_per_replica=5, seed=seed)
    initial, got, _ = run(strategy, case.make, stream)
    expected = reference(case, initial, dense_samples(stream))
    assert_matches(got, expected, f"{name} row-sparse {{what}} ({replicas} replicas)", initial)
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
    for s, d, e, w0, what in zip(sparse, dense, expected, initial, ("table", "kernel")):
        ref.assert_close(s, d, f"{name} row-sparse vs dense path, every row", rtol=1e-4, start=w0)
        ref.assert_close(s, e, f"{name} row-sparse {what}, every row", rtol=1e-4, start=w0)


@pytest.mark.parametrize("name", ["VR-SGD", "VR-LARS"])
def test_dense_and_row_sparse_paths_agree_where_most_rows_are_not_touched(strategy, name):
    """Without a GSNR momentum no count enters: the dense path, with the
    layer mean over the measured elements, is the row-sparse one."""
    case = CASES[name]
    stream = row_stream(steps=4, replicas=4, rows_per_replica=5, seed=4)
    initial, sparse, _ = run(strategy, case.make, stream)
    _, dense, _ = run(strategy, case.make, stream, dense=True)
    for s, d, w0 in zip(sparse, dense, initial):
        ref.assert_close(s, d, f"{name} row-sparse vs dense path, few rows", rtol=1e-4, start=w0)


@pytest.mark.parametrize("name", ["VR-SGD", "VR-Adam", "VR-LAMB"])
def test_rows_with_accumulation_match_the_reference(strategy, name):
    case = CASES[name]
    stream = row_stream(steps=6, replicas=4, rows_per_replica=4, seed=5)
    initial, got, optimizer = run(
        strategy, lambda: case.make(gradient_accumulation_steps=2), stream
    )
    expected = reference(case, initial, dense_samples(stream, accumulation=2))
    assert_matches(
        got, expected, f"{name} row-sparse {{what}} (4 replicas x 2 micro-steps)", initial
    )
    assert int(optimizer.iterations.numpy()) == 3
    # The accumulators are empty again after the last update.
    vr = optimizer
    assert not np.any(vr._intake.rows[0].numpy())
    assert not np.any(vr._intake.sums[0].numpy())


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
    assert_matches(got, expected, "VR-Adam row-sparse {what}, empty batches", initial)


@pytest.mark.parametrize("name", ["VR-SGD", "VR-Adam"])
def test_rows_with_a_gsnr_interval_match_the_reference(strategy, name):
    case = CASES[name]
    stream = row_stream(steps=6, replicas=4, rows_per_replica=5, seed=8)
    initial, got, _ = run(strategy, lambda: case.make(gsnr_interval=2), stream)
    expected = reference(case, initial, dense_samples(stream), gsnr_interval=2)
    assert_matches(got, expected, f"{name} row-sparse {{what}}, gsnr_interval 2", initial)


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
        [v.numpy() for v in variables],
        expected,
        f"{name} row-sparse {{what}}, XLA, 1 x 2",
        initial,
    )


def test_gamma_one_is_keras_dense_rule_on_repeated_ids(strategy):
    """With gamma = 1, VR-Adam on a table's rows equals Keras' Adam given
    the same gradient made dense (repeated ids summed first), not Keras'
    Adam given the rows: Keras' sparse path adds each lookup's square to
    the second moment apart, which differs where an id repeats."""
    stream = row_stream(steps=3, replicas=4, rows_per_replica=6, seed=11)
    assert any(len(set(ids)) < len(ids) for step in stream for ids, _, _ in step)
    initial, vr, _ = run(strategy, lambda: tf_vrgd.VRAdam(0.05, gamma=1.0), stream)
    _, dense, _ = run(strategy, lambda: keras.optimizers.Adam(0.05), stream, dense=True)
    _, sparse, _ = run(strategy, lambda: keras.optimizers.Adam(0.05), stream)
    ref.assert_close(
        vr[0], dense[0], "VR-Adam gamma=1 vs Keras Adam (dense), repeated ids", start=initial[0]
    )
    assert np.max(np.abs(vr[0] - sparse[0])) > 1e-3


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("name", ["VR-SGD", "VR-Adam", "VR-LARS", "VR-LAMB"])
def test_a_rank_one_table_matches_the_reference(strategy, name, accumulation):
    """A per-item bias looked up by id (`ops.take(bias, ids, axis=0)`)
    gives rank-1 `tf.IndexedSlices`: against the reference on the same
    samples made dense."""
    case = CASES[name]
    table_rows, replicas = 10, strategy.num_replicas_in_sync
    rng = np.random.default_rng(12)
    steps = 3 * accumulation
    ids = rng.integers(0, table_rows, (steps, replicas, 4)).astype(np.int32)
    ids[..., -1] = ids[..., 0]  # a repeated id in every batch
    values = rng.standard_normal((steps, replicas, 4)).astype(np.float32)
    initial = rng.standard_normal(table_rows).astype(np.float32)
    with strategy.scope():
        bias = keras.Variable(initial, name="bias")
        extra = {"gradient_accumulation_steps": accumulation} if accumulation > 1 else {}
        optimizer = case.make(**extra)
        optimizer.build([bias])

    @tf.function
    def step(ids, values):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            rows = tf.IndexedSlices(
                values[replica] / replicas, ids[replica], tf.constant([table_rows])
            )
            optimizer.apply([rows], [bias])

        strategy.run(replica_fn)

    samples = []
    for s in range(steps):
        step(tf.constant(ids[s]), tf.constant(values[s]))
        for r in range(replicas):
            dense = np.zeros(table_rows)
            np.add.at(dense, ids[s, r], values[s, r].astype(np.float64))
            samples.append(dense)
    k = replicas * accumulation
    updates = [[np.stack(samples[u * k : (u + 1) * k])] for u in range(steps // accumulation)]
    expected = ref.VRReference([initial], case.rule, 0.1, case.beta_3)
    for update in updates:
        weights = expected.update(update)
    ref.assert_close(bias.numpy(), weights[0], f"{name} rank-1 table", rtol=1e-4, start=initial)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_noise_terms_sum_over_the_touched_rows(strategy, accumulation):
    """The gradient noise scale's terms of a table (`tf_vrgd.noise_scale`),
    on the row path: per update, the squared norm of the samples' mean and
    the mean of their squared norms over the rows a batch touched (the
    others hold no sample and add nothing), against the dense samples."""
    from tf_vrgd import statistics

    stream = row_stream(3 * accumulation, 4, 6, seed=5)
    _, _, optimizer = run(
        strategy,
        lambda: tf_vrgd.VRSGD(
            0.5,
            gradient_accumulation_steps=accumulation if accumulation > 1 else None,
            track_gsnr_statistics=True,
        ),
        stream,
    )
    updates = dense_samples(stream, accumulation=accumulation)
    big, small = statistics.noise_terms(optimizer.gsnr_statistic_sums())
    for i in range(2):  # the table, then the kernel
        expected_big = np.mean([np.sum(update[i].mean(axis=0) ** 2) for update in updates])
        expected_small = np.mean(
            [np.mean(np.sum(update[i] ** 2, axis=(1, 2))) for update in updates]
        )
        ref.assert_close(big[i], expected_big, "noise term |G_big|^2 (rows)", rtol=1e-5)
        ref.assert_close(small[i], expected_small, "noise term |G_small|^2 (rows)", rtol=1e-5)


# Tables of rows of one shape travel as one message (stacked, then split
# back on each device); a table of another width travels alone.
TABLES = [(40, 3), (25, 3), (12, 5), (7, 3)]
LOOKUPS = [4, 1, 3, 2]  # ids per replica and step, in each table


@pytest.mark.parametrize("accumulation", [None, 2])
@pytest.mark.parametrize("name", ["VR-Momentum beta_3", "VR-Adam"])
def test_several_tables_match_the_reference(strategy, name, accumulation):
    case = CASES[name]
    replicas, steps = strategy.num_replicas_in_sync, 3 * (accumulation or 1)
    rng = np.random.default_rng(7)
    initial = [rng.standard_normal(shape).astype(np.float32) for shape in TABLES]
    initial.append(rng.standard_normal(KERNEL).astype(np.float32))
    # Per table, [step, replica, lookup] ids (repeats within and across
    # replicas) and their rows' gradients.
    ids = [
        rng.integers(0, rows, (steps, replicas, n)).astype(np.int32)
        for (rows, _), n in zip(TABLES, LOOKUPS)
    ]
    values = [
        rng.standard_normal((steps, replicas, n, width)).astype(np.float32)
        for (_, width), n in zip(TABLES, LOOKUPS)
    ]
    kernels = rng.standard_normal((steps, replicas, *KERNEL)).astype(np.float32)
    with strategy.scope():
        variables = [keras.Variable(w, name=f"table_{i}") for i, w in enumerate(initial)]
        optimizer = case.make(gradient_accumulation_steps=accumulation)
        optimizer.build(variables)

    @tf.function
    def apply(ids, values, kernels):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            grads = [
                tf.IndexedSlices(v[replica] / replicas, i[replica], tf.constant(shape, tf.int64))
                for i, v, shape in zip(ids, values, TABLES)
            ]
            optimizer.apply(grads + [kernels[replica] / replicas], variables)

        strategy.run(replica_fn)

    for step in range(steps):
        apply([i[step] for i in ids], [v[step] for v in values], kernels[step])

    reference = ref.VRReference(
        initial, case.rule, 0.1, case.beta_3, row_sparse=set(range(len(TABLES)))
    )
    micro = accumulation or 1
    for u in range(steps // micro):
        samples = [[] for _ in range(len(TABLES) + 1)]
        for step in range(u * micro, (u + 1) * micro):
            for r in range(replicas):
                for t, shape in enumerate(TABLES):
                    table = np.zeros(shape)
                    np.add.at(table, ids[t][step, r], values[t][step, r].astype(np.float64))
                    samples[t].append(table)
                samples[-1].append(kernels[step, r].astype(np.float64))
        expected = reference.update([np.stack(x) for x in samples])
    for i, (variable, want) in enumerate(zip(variables, expected)):
        ref.assert_close(
            variable.numpy(), want, f"{name} table {i} of several (A = {accumulation})", rtol=1e-4
        )


@pytest.mark.parametrize("accumulation", [None, 2])
def test_several_tables_train_under_fit(strategy, accumulation):
    """Four tables, three of one row shape (stacked into one message), beside
    a large kernel (the fused program) and a small one (the packed pass), in
    Keras' compiled training step under `fit`, against the numpy reference.

    The model predicts p = sum_t sum_j E_t[x_t, j] + sum_k sum_j (f_k W_k)_j
    and minimises the mean squared error. With e_b = 2 (p_b - y_b) / n_r
    over replica r's n_r examples (Keras' 1/R loss scaling is undone by the
    optimizer), replica r's sample for table t is, at row i, the sum of e_b
    over its examples b with x_bt = i, in every column, and for kernel k,
    at (i, j), the sum over its examples of e_b f_kb,i. MirroredStrategy
    gives replica r the r-th contiguous quarter of each global batch.
    """
    case = CASES["VR-Momentum beta_3"]
    # Row starts in the stacked message of width 4: 0, 300 and 580, past
    # the small integers that Python keeps one object of (a start that
    # travels through `merge_call` as a Python int must come back as one).
    shapes = [(300, 4), (280, 4), (9, 3), (15, 4)]
    kernels = [(130, 128), (3, 2)]  # over and under 2^14 elements
    replicas, per_replica = strategy.num_replicas_in_sync, 4
    micro = accumulation or 1
    steps = 3 * micro
    batch = replicas * per_replica
    rng = np.random.default_rng(11)
    ids = np.stack([rng.integers(0, rows, steps * batch) for rows, _ in shapes], axis=1)
    ids = ids.astype(np.int32)
    features = [rng.standard_normal((steps * batch, n)).astype(np.float32) for n, _ in kernels]
    y = rng.standard_normal(steps * batch).astype(np.float32)
    initial = [(0.3 * rng.standard_normal(shape)).astype(np.float32) for shape in shapes]
    initial += [(0.01 * rng.standard_normal(shape)).astype(np.float32) for shape in kernels]
    with strategy.scope():
        inputs = [keras.Input((len(shapes),), dtype="int32")]
        inputs += [keras.Input((n,)) for n, _ in kernels]
        layers = [
            keras.layers.Embedding(rows, width, weights=[w])
            for (rows, width), w in zip(shapes, initial)
        ]
        layers += [
            keras.layers.Dense(
                units, use_bias=False, kernel_initializer=keras.initializers.Constant(w)
            )
            for (_, units), w in zip(kernels, initial[len(shapes) :])
        ]
        tables, dense = layers[: len(shapes)], layers[len(shapes) :]
        terms = [keras.ops.sum(table(inputs[0][:, t]), axis=-1) for t, table in enumerate(tables)]
        terms += [keras.ops.sum(layer(f), axis=-1) for layer, f in zip(dense, inputs[1:])]
        prediction = keras.ops.sum(keras.ops.stack(terms, axis=-1), axis=-1, keepdims=True)
        model = keras.Model(inputs, prediction)
        model.compile(optimizer=case.make(gradient_accumulation_steps=accumulation), loss="mse")
    model.fit([ids, *features], y[:, None], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 3

    reference = ref.VRReference(
        initial, case.rule, 0.1, case.beta_3, row_sparse=set(range(len(shapes)))
    )
    weights = [w.astype(np.float64) for w in initial]
    for u in range(3):
        samples = [[] for _ in initial]
        for step in range(u * micro, (u + 1) * micro):
            for r in range(replicas):
                rows = slice(step * batch + r * per_replica, step * batch + (r + 1) * per_replica)
                xs, fs, ys = ids[rows], [f[rows] for f in features], y[rows]
                p = sum(weights[t][xs[:, t]].sum(axis=1) for t in range(len(shapes)))
                p = p + sum((f @ w).sum(axis=1) for f, w in zip(fs, weights[len(shapes) :]))
                error = 2.0 * (p - ys) / per_replica
                for t, shape in enumerate(shapes):
                    table = np.zeros(shape)
                    np.add.at(table, xs[:, t], error[:, None] * np.ones(shape[1]))
                    samples[t].append(table)
                for k, (f, (_, units)) in enumerate(zip(fs, kernels)):
                    gradient = (error[:, None] * f).sum(axis=0)[:, None] * np.ones(units)
                    samples[len(shapes) + k].append(gradient)
        weights = reference.update([np.stack(s) for s in samples])
    for i, (layer, want) in enumerate(zip(layers, weights)):
        ref.assert_close(
            layer.weights[0].numpy(),
            want,
            f"variable {i} under fit (A = {accumulation})",
            rtol=1e-4,
        )
    # Every device runs the one traced update on its own copies: each
    # replica device's copy of every weight and slot is the first's.
    for variable in [*model.trainable_variables, *model.optimizer.variables]:
        copies = [c.numpy() for c in strategy.experimental_local_results(variable.value)]
        assert len(copies) == replicas
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0], err_msg=variable.path)
