"""Side-by-side step-cost measurement (used by `scripts/bench_step.py`).

Candidates are timed in one process, interleaved repetition by repetition,
and summarised by medians, so that the ratios between them are measured
under the same machine noise. Two things are timed:

- the optimizer-only update: `optimizer.apply` on fixed per-replica
  gradients (no forward or backward pass), and
- the full training step: forward, backward and update on a fixed batch.

Bytes per parameter moved by each update rule (fp32, one pass per tensor
read or written; what a fused kernel could reach at best):

    SGD + momentum   reads g, w, m; writes w, m                      20 B
    Adam / Lamb      reads g, w, m, v; writes w, m, v                28 B
    LARS             reads g, w, v; writes w, v (+ 2 norm passes)    20 B
    VR adds          reads the square sum (4 B) and, with beta_3 > 0,
                     reads and writes the GSNR momentum (8 B)        +4 or +12 B

With gradient accumulation, each micro-step adds to the running sums:

    Keras            reads g and its accumulator; writes it          12 B
    VR               reads g and both sums; writes both sums         20 B
"""

from collections.abc import Sequence
import dataclasses
import functools
import gc
import math
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

UPDATE_BYTES_PER_PARAMETER = {
    "SGD": 20,
    "Adam": 28,
    "Lamb": 28,
    "LARS": 20,
}
# Extra bytes of the VR twin: the second sum, and the GSNR momentum if any.
VR_EXTRA_BYTES = {"sum of squares": 4, "gsnr momentum": 8}
# Bytes per parameter of one accumulation micro-step.
ACCUMULATION_BYTES = {"base": 12, "vr": 20}


def memory_bandwidth(megabytes=256, repeats=5):
    """Bytes/s of a large array copy (bytes read plus bytes written), the
    best of `repeats`."""
    source = np.ones(megabytes * 2**20 // 8, np.float64)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best


def mlp(parameters=10_000_000, inputs=784, outputs=10):
    """A 3-hidden-layer MLP with about `parameters` weights."""
    # inputs*h + 2*h*h + h*outputs ~= parameters
    a, b, c = 2.0, inputs + outputs, -float(parameters)
    width = int((-b + np.sqrt(b * b - 4 * a * c)) / (2 * a))
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(outputs),
        ]
    )


def resnet50(classes=10, size=32):
    """`keras.applications.ResNet50` on size x size x 3 inputs, untrained:
    214 trainable variables (161 of them batch-norm scales and offsets)."""
    return keras.applications.ResNet50(
        weights=None, input_shape=(size, size, 3), classes=classes, classifier_activation=None
    )


class _PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to its token embedding."""

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            shape=input_shape[1:], initializer="random_normal", name="embeddings"
        )

    def call(self, inputs):
        return inputs + self.embeddings


def encoder(
    blocks=12, hidden=256, heads=4, intermediate=1024, vocabulary=1000, sequence=32, classes=10
):
    """A BERT-style encoder built from Keras layers: token and position
    embeddings, `blocks` post-norm transformer blocks (`MultiHeadAttention`,
    `LayerNormalization`, a two-`Dense` feed-forward) and a classifier on
    the mean token. At the defaults: 196 trainable variables, 9.8 M
    parameters."""
    tokens = keras.Input((sequence,), dtype="int32")
    x = _PositionEmbedding()(keras.layers.Embedding(vocabulary, hidden)(tokens))
    for _ in range(blocks):
        attention = keras.layers.MultiHeadAttention(heads, hidden // heads)(x, x)
        x = keras.layers.LayerNormalization()(x + attention)
        feed_forward = keras.layers.Dense(intermediate, activation="gelu")(x)
        feed_forward = keras.layers.Dense(hidden)(feed_forward)
        x = keras.layers.LayerNormalization()(x + feed_forward)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(classes)(x))


def parameter_count(model):
    return int(sum(np.prod(v.shape) for v in model.trainable_variables))


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
        # Per-replica gradients, stacked: replica r takes slice r.
        self._gradients = [
            tf.constant(rng.standard_normal((replicas, *v.shape)).astype(np.float32) * 1e-3)
            for v in variables
        ]
        x, y = batch
        self._x, self._y = tf.constant(x), tf.constant(y)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
        global_batch = int(x.shape[0])

        @tf.function
        def update():
            def replica_fn():
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                grads = [tf.gather(g, replica) / replicas for g in self._gradients]
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

    Returns a dict name -> median seconds.
    """
    for candidate in candidates:
        candidate.time(kind, warmup)
    samples = {c.name: [] for c in candidates}
    for _ in range(repeats):
        for candidate in candidates:
            samples[candidate.name].append(candidate.time(kind, steps))
    return {name: statistics.median(times) for name, times in samples.items()}


def cnn():
    """The small Fashion-MNIST CNN of the CPU-scale experiments."""
    from tf_vrgd.experiments import models

    return models.fashion_mnist_cnn()


def pairs():
    """name -> (base factory, VR-or-wrapper factory, base bytes/param key)."""
    import tf_vrgd

    return {
        "Momentum": (
            lambda **k: keras.optimizers.SGD(0.01, momentum=0.9, **k),
            lambda **k: tf_vrgd.VRSGD(0.01, momentum=0.9, **k),
            "SGD",
        ),
        "Adam": (
            lambda **k: keras.optimizers.Adam(1e-3, **k),
            lambda **k: tf_vrgd.VRAdam(1e-3, **k),
            "Adam",
        ),
        "LAMB": (
            lambda **k: keras.optimizers.Lamb(1e-3, **k),
            lambda **k: tf_vrgd.VRLAMB(1e-3, **k),
            "Lamb",
        ),
        "LARS": (lambda **k: tf_vrgd.LARS(0.1, **k), lambda **k: tf_vrgd.VRLARS(0.1, **k), "LARS"),
        "LARC": (
            lambda **k: keras.optimizers.SGD(0.01, momentum=0.9, **k),
            lambda **k: tf_vrgd.LARC(keras.optimizers.SGD(0.01, momentum=0.9, **k)),
            "SGD",
        ),
    }


def _update_bytes(pair_name, optimizer, accumulation_steps=0):
    """Bytes per parameter of one update of the base and of its twin
    (VR optimizer or LARC), with `accumulation_steps` micro-steps before it."""
    base = vr = UPDATE_BYTES_PER_PARAMETER[pairs()[pair_name][2]]
    base += accumulation_steps * ACCUMULATION_BYTES["base"]
    if pair_name == "LARC":  # LARC adds no state; Keras accumulates for it
        return base, vr + accumulation_steps * ACCUMULATION_BYTES["base"]
    vr += VR_EXTRA_BYTES["sum of squares"] + accumulation_steps * ACCUMULATION_BYTES["vr"]
    if getattr(optimizer, "beta_3", 0) > 0:
        vr += VR_EXTRA_BYTES["gsnr momentum"]
    return base, vr


@dataclasses.dataclass
class Settings:
    """What `measure` runs: the matrix of set-ups x models x pairs x kinds,
    and how long it measures each (`scripts/bench_step.py` documents each
    field as a command-line flag)."""

    setups: Sequence[str] = ("mirrored", "accumulation")
    models: Sequence[str] = ("mlp", "cnn", "resnet50", "encoder")
    pairs: Sequence[str] | None = None
    kinds: Sequence[str] = ("first step", "update", "train step")
    replicas: int = 4
    accumulation: int = 4
    batch: int = 256
    batch_per_replica: int = 8
    steps: int = 5
    repeats: int = 7
    first_step_rounds: int = 3
    mlp_parameters: int = 10_000_000
    statistics: bool = False
    # Each N > 1 adds the twin with gsnr_interval = N; the timed calls of
    # every candidate are then a whole number of the largest N's cycles.
    gsnr_intervals: Sequence[int] = (1,)
    no_xla: bool = True
    image_size: int = 32  # resnet50's input side (ImageNet: 224)
    # Reduce through one device: GPUs that are logical parts of one GPU
    # (NCCL does not run between them).
    reduce_to_one_device: bool = False


MODEL_FACTORIES = {
    "mlp": lambda settings: mlp(settings.mlp_parameters),
    "cnn": lambda settings: cnn(),
    "resnet50": lambda settings: resnet50(size=settings.image_size),
    "encoder": lambda settings: encoder(),
}
# Models measured at a fixed batch per replica (`--batch-per-replica`) rather
# than at the global `--batch`.
REAL_MODELS = ("resnet50", "encoder")


def make_batch(model_name, global_batch, rng, image_size=32):
    """A fixed random batch of inputs and integer labels for `model_name`."""
    shapes = {"mlp": (784,), "cnn": (28, 28, 1), "resnet50": (image_size, image_size, 3)}
    if model_name == "encoder":
        x = rng.integers(0, 1000, (global_batch, 32)).astype(np.int32)
    else:
        x = rng.random((global_batch, *shapes[model_name]), np.float32)
    return x, rng.integers(0, 10, global_batch).astype(np.int32)


def first_step_times(factories, make_model, strategy, batch, calls=1, rounds=3):
    """Median seconds from a fresh optimizer to the end of its first update
    in a training step (trace, compile, run), per candidate, interleaved:
    each round builds every candidate anew, in the same order.

    Args:
        factories: Dict name -> optimizer factory.
        calls: Training-step calls up to the first update (the accumulation
            steps A, with accumulation: the update's branch is compiled when
            it first runs).
    """
    samples = {name: [] for name in factories}
    for _ in range(rounds):
        for name, make_optimizer in factories.items():
            candidate = Candidate(name, make_optimizer, make_model, strategy, batch)
            samples[name].append(candidate.time("train step", calls) * calls)
            del candidate
            gc.collect()
    return {name: statistics.median(times) for name, times in samples.items()}


def warm_up_runtime(strategy, extra):
    """Pays the runtime's one-time start-up (collectives, the XLA CPU
    back end) before anything is timed, with a VR training step on a tiny
    model under `strategy`."""
    import tf_vrgd

    batch = make_batch("mlp", 8 * strategy.num_replicas_in_sync, np.random.default_rng(1))
    candidate = Candidate(
        "warm-up", lambda: tf_vrgd.VRAdam(**extra), lambda: mlp(20_000), strategy, batch
    )
    candidate.time("train step", 2 * (extra.get("gradient_accumulation_steps") or 1))


def measure(settings, gpus=(), report=print):
    """The whole `bench_step.py` matrix of `settings` (a `Settings`), on the
    GPUs listed in `gpus` (or logical CPU devices where there are none).

    Returns a list of dicts, one per measured line: ``setup``, ``model``,
    ``parameters``, ``variables``, ``replicas``, ``pair``, ``kind`` ("first
    step", "update" or "train step") and ``seconds`` (candidate -> median
    seconds: "base", "vr", and "vr no-xla" / "vr statistics" where
    measured), plus, for "update", ``traffic`` (candidate -> achieved bytes/s
    over the copy bandwidth). Each row is passed to `report` as soon as it
    is measured; `format_row` makes a line of it.
    """
    bandwidth = memory_bandwidth()
    report(f"memory copy bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write)")
    chosen = {k: v for k, v in pairs().items() if not settings.pairs or k in settings.pairs}
    rng = np.random.default_rng(0)
    rows = []
    for setup in settings.setups:
        if setup == "mirrored":
            devices = (
                [f"/gpu:{i}" for i in range(len(gpus))]
                if gpus
                else [f"/cpu:{i}" for i in range(settings.replicas)]
            )
            cross_device_ops = (
                tf.distribute.ReductionToOneDevice() if settings.reduce_to_one_device else None
            )
            strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
            extra = {}
        else:
            strategy = tf.distribute.get_strategy()
            extra = {"gradient_accumulation_steps": settings.accumulation}
        copies = strategy.num_replicas_in_sync
        # With accumulation a call is a micro-step; report per update.
        calls_per_update = settings.accumulation if extra else 1
        warm_up_runtime(strategy, extra)
        for model_name in settings.models:
            make_model = functools.partial(MODEL_FACTORIES[model_name], settings)
            global_batch = (
                settings.batch_per_replica * copies if model_name in REAL_MODELS else settings.batch
            )
            batch = make_batch(model_name, global_batch, rng, settings.image_size)
            model = make_model()
            params, variables = parameter_count(model), len(model.trainable_variables)
            del model
            report(
                f"\n== {model_name} ({params / 1e6:.2f} M parameters, {variables} variables), "
                f"{setup}: {copies} replica(s), batch {global_batch}"
                f"{f', A = {settings.accumulation} micro-steps, times per update' if extra else ''}"
            )
            if not extra and "update" in settings.kinds:
                reduce = collective_times(strategy, params)
                report(
                    f"all-reduce alone: sum {reduce['sum'] * 1e3:.2f} ms, sum and squares "
                    f"{reduce['sum and squares'] * 1e3:.2f} ms "
                    f"(x{reduce['sum and squares'] / reduce['sum']:.2f})"
                )
            for pair_name, (make_base, make_vr, _) in chosen.items():
                factories = {
                    "base": functools.partial(make_base, **extra),
                    "vr": functools.partial(make_vr, **extra),
                }
                if pair_name != "LARC":
                    if settings.no_xla:
                        factories["vr no-xla"] = functools.partial(
                            make_vr, jit_update=False, **extra
                        )
                    for interval in settings.gsnr_intervals:
                        if interval > 1:
                            factories[f"vr N={interval}"] = functools.partial(
                                make_vr, gsnr_interval=interval, **extra
                            )
                    if settings.statistics:
                        factories["vr statistics"] = functools.partial(
                            make_vr, track_gsnr_statistics=True, **extra
                        )
                row = dict(
                    setup=setup,
                    model=model_name,
                    parameters=params,
                    variables=variables,
                    replicas=copies,
                    pair=pair_name,
                )
                if "first step" in settings.kinds:
                    seconds = first_step_times(
                        factories,
                        make_model,
                        strategy,
                        batch,
                        calls_per_update,
                        settings.first_step_rounds,
                    )
                    rows.append({**row, "kind": "first step", "seconds": seconds})
                    report(rows[-1])
                steady = [kind for kind in settings.kinds if kind != "first step"]
                if not steady:
                    continue
                candidates = [
                    Candidate(name, factory, make_model, strategy, batch)
                    for name, factory in factories.items()
                ]
                cycle = max(settings.gsnr_intervals) if pair_name != "LARC" else 1
                updates = math.ceil(settings.steps / cycle) * cycle
                for kind in steady:
                    seconds = compare(
                        candidates,
                        kind,
                        updates * calls_per_update,
                        settings.repeats,
                        # Starts every timing at a GSNR update of each N.
                        warmup=(math.ceil(2 / cycle) * cycle) * calls_per_update,
                    )
                    seconds = {k: v * calls_per_update for k, v in seconds.items()}
                    rows.append({**row, "kind": kind, "seconds": seconds})
                    if not extra:
                        rows[-1]["collective_bytes"] = {
                            name: collective_bytes(candidate.optimizer, params)
                            for name, candidate in zip(factories, candidates)
                        }
                    if kind == "update":
                        base_bytes, vr_bytes = _update_bytes(
                            pair_name,
                            candidates[1].optimizer,
                            settings.accumulation if extra else 0,
                        )
                        rows[-1]["traffic"] = {
                            "base": copies * base_bytes * params / seconds["base"] / bandwidth,
                            "vr": copies * vr_bytes * params / seconds["vr"] / bandwidth,
                        }
                    report(rows[-1])
                del candidates
                gc.collect()
    return rows


def collective_bytes(optimizer, parameters):
    """Mean bytes per replica an update all-reduces (float32): the
    gradient, and for a VR optimizer its squares at one update in
    `gsnr_interval`."""
    interval = getattr(optimizer, "gsnr_interval", None)
    squares = 0.0 if interval is None else 1.0 / interval
    return 4.0 * parameters * (1.0 + squares)


def format_row(row):
    """One printed line of a `measure` row (strings pass through)."""
    if isinstance(row, str):
        return row
    seconds = row["seconds"]
    unit, factor = ("s", 1.0) if row["kind"] == "first step" else ("ms", 1e3)
    line = (
        f"{row['pair']:<9} {row['kind']:<10} base {seconds['base'] * factor:8.2f} {unit}"
        f"  twin {seconds['vr'] * factor:8.2f} {unit}"
        f"  twin/base {seconds['vr'] / seconds['base']:5.2f}"
    )
    if "vr no-xla" in seconds:
        line += (
            f"  no-xla/base {seconds['vr no-xla'] / seconds['base']:5.2f}"
            f"  xla/no-xla {seconds['vr'] / seconds['vr no-xla']:5.2f}"
        )
    for name, value in seconds.items():
        if name.startswith("vr N="):
            line += f"  {name}/base {value / seconds['base']:5.2f}"
    if "collective_bytes" in row:
        sent = row["collective_bytes"]
        line += "  all-reduce MB/update " + " ".join(
            f"{name} {value / 1e6:.1f}" for name, value in sent.items()
        )
    if "vr statistics" in seconds:
        line += f"  statistics on/off {seconds['vr statistics'] / seconds['vr']:5.2f}"
    if "traffic" in row:
        line += (
            f"  traffic/bandwidth base {row['traffic']['base']:5.1%}"
            f" twin {row['traffic']['vr']:5.1%}"
        )
    return line


def run(settings, gpus=()):
    """`measure`, printing each line as it is measured."""
    return measure(settings, gpus, report=lambda row: print(format_row(row), flush=True))
