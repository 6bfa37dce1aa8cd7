"""Timing candidates side by side in one process: each repetition runs
every candidate in turn, and medians summarise, so that ratios between
candidates are measured under the same machine noise."""

import functools
import gc
import statistics
import time

import keras
import numpy as np
import tensorflow as tf


def memory_bandwidth(device=None, megabytes=256, repeats=5):
    """Bytes/s of a large array copy (bytes read plus bytes written), the
    best of `repeats`: on the host (numpy) when `device` is None, else one
    float32 variable assigned to another on that device (a GPU: the
    memory its updates run from)."""
    if device is None:
        source = np.ones(megabytes * 2**20 // 8, np.float64)
        target = np.empty_like(source)
        copy, nbytes = functools.partial(np.copyto, target, source), source.nbytes
    else:
        with tf.device(device):
            source = tf.Variable(tf.ones([megabytes * 2**20 // 4]))
            target = tf.Variable(tf.zeros_like(source))

        @tf.function
        def assign():
            target.assign(source.read_value())
            return target[0]

        assign()  # traced and run once before timing
        copy, nbytes = lambda: assign().numpy(), megabytes * 2**20
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copy()
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


class Candidate:
    """One optimizer on its own copy of a model, with compiled update and
    training-step functions."""

    def __init__(self, name, make_optimizer, make_model, strategy, batch, seed=0):
        self.name = name
        self.strategy = strategy
        with strategy.scope():
            keras.utils.set_random_seed(seed)
            self.model = make_model()
            self.optimizer = make_optimizer()
            self.optimizer.build(self.model.trainable_variables)
        variables = self.model.trainable_variables
        replicas = strategy.num_replicas_in_sync
        rng = np.random.default_rng(seed)
        x, y = batch
        self._x, self._y = tf.constant(x), tf.constant(y)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        global_batch = int(x.shape[0])
        # Per-replica gradients, stacked: replica r takes slice r. An
        # embedding table's arrive as rows (tf.IndexedSlices), one looked-up
        # row per example, as in the training step.
        tables = {
            id(layer.embeddings)
            for layer in self.model.layers
            if isinstance(layer, keras.layers.Embedding)
        }
        local = global_batch // replicas

        def gradient(v):
            if id(v) not in tables:
                return tf.constant(
                    rng.standard_normal((replicas, *v.shape)).astype(np.float32) * 1e-3
                )
            rows, width = v.shape
            values = rng.standard_normal((replicas, local, width)).astype(np.float32) * 1e-3
            ids = rng.integers(0, rows, (replicas, local)).astype(np.int64)
            return tf.constant(values), tf.constant(ids), tf.constant(v.shape, tf.int64)

        self._gradients = [gradient(v) for v in variables]

        def replica_gradient(g, replica):
            if isinstance(g, tuple):
                values, ids, shape = g
                return tf.IndexedSlices(
                    tf.gather(values, replica) / replicas, tf.gather(ids, replica), shape
                )
            return tf.gather(g, replica) / replicas

        @tf.function
        def update():
            def replica_fn():
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                grads = [replica_gradient(g, replica) for g in self._gradients]
                self.optimizer.apply(grads, variables)

            strategy.run(replica_fn)

        @tf.function
        def train_step():
            def replica_fn():
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                local = global_batch // replicas
                xs = self._x[replica * local : (replica + 1) * local]
                ys = self._y[replica * local : (replica + 1) * local]
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(
                        loss_fn(ys, self.model(xs, training=True)),
                        global_batch_size=global_batch,
                    )
                grads = tape.gradient(loss, variables)
                self.optimizer.apply(grads, variables)

            strategy.run(replica_fn)

        self.functions = {"update": update, "train step": train_step}

    def first_step(self, calls=1):
        """``(trace seconds, total seconds)`` of the first `calls` training
        steps of this fresh candidate: the trace of the step function (its
        Python, the per-device programs' traces included), then to the end
        of the calls (graph optimisation, XLA compilation, the run)."""
        function = self.functions["train step"]
        start = time.perf_counter()
        function.get_concrete_function()
        traced = time.perf_counter() - start
        for _ in range(calls):
            function()
        self.model.trainable_variables[0].numpy()
        return traced, time.perf_counter() - start

    def time(self, kind, steps):
        function = self.functions[kind]
        start = time.perf_counter()
        for _ in range(steps):
            function()
        # The last step's result is on the device: read a weight to wait.
        self.model.trainable_variables[0].numpy()
        return (time.perf_counter() - start) / steps


def collective_times(strategy, parameters, steps=5, repeats=7):
    """Median seconds of one cross-replica SUM of `parameters` float32
    values, and of that sum together with the sum of squares (what a VR
    update reduces), interleaved."""
    replicas = strategy.num_replicas_in_sync
    value = tf.constant(np.ones((replicas, parameters), np.float32))

    def make(with_squares):
        @tf.function
        def reduce():
            def replica_fn():
                ctx = tf.distribute.get_replica_context()
                g = tf.gather(value, ctx.replica_id_in_sync_group)
                values = [g, g * g] if with_squares else [g]
                return ctx.all_reduce(tf.distribute.ReduceOp.SUM, values)[0]

            return strategy.run(replica_fn)

        return reduce

    functions = {"sum": make(False), "sum and squares": make(True)}
    samples = {name: [] for name in functions}
    for fn in functions.values():
        fn()
    for _ in range(repeats):
        for name, fn in functions.items():
            start = time.perf_counter()
            for _ in range(steps):
                result = fn()
            strategy.experimental_local_results(result)[0].numpy()
            samples[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(times) for name, times in samples.items()}


def compare(candidates, kind, steps=10, repeats=7, warmup=3):
    """Median seconds per call of each candidate, interleaved.

    Repetition r starts with candidate r (mod their number) and goes round:
    each candidate takes each place in the order equally often when
    `repeats` is a multiple of the number of candidates, so that what the
    place costs (the first of a round after the last of the one before) is
    no candidate's alone.

    Returns a dict name -> median seconds.
    """
    for candidate in candidates:
        candidate.time(kind, warmup)
    samples = {c.name: [] for c in candidates}
    for repeat in range(repeats):
        for candidate in rotated(candidates, repeat):
            samples[candidate.name].append(candidate.time(kind, steps))
    return _medians(samples)


def rotated(items, start):
    """`items` from index `start` (mod their number) round to the one before."""
    items = list(items)
    start %= max(len(items), 1)
    return items[start:] + items[:start]


def first_step_times(factories, make_model, strategy, batch, calls=1, rounds=3):
    """Median seconds from a fresh optimizer to the end of its first update
    in a training step (trace, compile, run), and of its trace alone
    (`Candidate.first_step`), per candidate, interleaved: each round builds
    every candidate anew, round r starting with candidate r (`compare`).

    Args:
        factories: Dict name -> optimizer factory.
        calls: Training-step calls up to the first update (the accumulation
            steps A, with accumulation: the update's branch is compiled when
            it first runs).

    Returns:
        ``(seconds, trace seconds)``: two dicts name -> median seconds.
    """
    samples = {name: [] for name in factories}
    traced = {name: [] for name in factories}
    for round_ in range(rounds):
        for name, make_optimizer in rotated(factories.items(), round_):
            candidate = Candidate(name, make_optimizer, make_model, strategy, batch)
            trace, total = candidate.first_step(calls)
            samples[name].append(total)
            traced[name].append(trace)
            del candidate
            gc.collect()
    return _medians(samples), _medians(traced)


def _medians(samples):
    return {name: statistics.median(times) for name, times in samples.items()}
