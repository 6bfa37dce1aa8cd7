"""The step-cost matrix of `scripts/bench_step.py`: each VR optimizer (and
LARC) against its base, timed side by side (`timing`) on the models of
`bench_models`. Two things are timed:

- the optimizer-only update: `optimizer.apply` on fixed per-replica
  gradients (no forward or backward pass), and
- the full training step: forward, backward and update on a fixed batch.

Bytes per parameter moved by each update rule on each device (float32,
one pass per tensor read or written: what a fused kernel could reach at
best; `update_bytes`, the table of docs/algorithms.md §6).
"""

from collections.abc import Sequence
import dataclasses
import functools
import gc
import math

import keras
import numpy as np
import tensorflow as tf

from tf_vrgd.experiments.bench_models import (
    cnn,
    encoder,
    make_batch,
    mlp,
    parameter_count,
    resnet50,
    tables,
    thin_mlp,
)
from tf_vrgd.experiments.timing import (
    Candidate,
    collective_times,
    compare,
    first_step_times,
    memory_bandwidth,
)

# The base rule on gbar: SGD + momentum reads g, w, m and writes w, m;
# Adam and Lamb read g, w, m, v and write w, m, v; LARS reads g, w, v and
# writes w, v (its two norms are reductions over w and g, counted apart
# by no rule here).
UPDATE_BYTES_PER_PARAMETER = {
    "SGD": 20,
    "Adam": 28,
    "Lamb": 28,
    "LARS": 20,
}
# Bytes per parameter of one accumulation micro-step: Keras reads g and its
# accumulator and writes it; a VR optimizer does so for both sums.
ACCUMULATION_BYTES = {"base": 12, "vr": 20}
# The pairs whose twin wraps its base (no VR twin: no interval, no XLA).
WRAPPER_PAIRS = ("LARC", "NoiseScale", "AdaScale")


def update_bytes(base_rule, vr=False, beta_3=0.0, gsnr_interval=1, accumulation_steps=0):
    """Bytes per parameter of one update (averaged over `gsnr_interval`
    updates), `accumulation_steps` micro-steps before it included.

    A VR optimizer adds, at a GSNR update: a first pass over the sums of
    gradients and of squares for the layer mean (8 B; no element can be
    scaled before it), the squares again in the update pass (4 B), and
    the GSNR momentum read and written (8 B, beta_3 > 0) or the last
    scale written (4 B, beta_3 = 0 and N > 1); between GSNR updates,
    the momentum or the last scale read (4 B).
    """
    total = UPDATE_BYTES_PER_PARAMETER[base_rule]
    if not vr:
        return total + accumulation_steps * ACCUMULATION_BYTES["base"]
    n = gsnr_interval
    at_gsnr_update = 8 + 4 + (8 if beta_3 > 0 else 4 if n > 1 else 0)
    between = 4 if beta_3 > 0 or n > 1 else 0
    total += (at_gsnr_update + (n - 1) * between) / n
    # Squares are summed at the micro-steps of GSNR updates only.
    micro = ACCUMULATION_BYTES["base"] + (ACCUMULATION_BYTES["vr"] - ACCUMULATION_BYTES["base"]) / n
    return total + accumulation_steps * micro


def pairs(tf_vrgd=None):
    """name -> (base factory, VR-or-wrapper factory, base bytes/param key).
    `tf_vrgd`: the package whose twins to make (another version of it, for
    `scripts/bench_versions.py`); this one by default."""
    if tf_vrgd is None:
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
        # Keras' Adam (with the package's accumulation, which runs under
        # MirroredStrategy) measured by the noise-scale wrapper.
        "NoiseScale": (
            lambda **k: tf_vrgd.Adam(1e-3, **k),
            lambda interval=1, **k: tf_vrgd.NoiseScale(tf_vrgd.Adam(1e-3, **k), interval=interval),
            "Adam",
        ),
        # The same Adam, its rate set by the gain from the same measurement.
        "AdaScale": (
            lambda **k: tf_vrgd.Adam(1e-3, **k),
            lambda **k: tf_vrgd.AdaScale(tf_vrgd.Adam(1e-3, **k)),
            "Adam",
        ),
    }


def own_bases():
    """name -> this package's own rule of a pair whose base is Keras': the
    twin's base rule (its `update_step`)."""
    import tf_vrgd

    return {"LAMB": lambda **k: tf_vrgd.LAMB(1e-3, **k)}


def _candidate_bytes(pair_name, optimizer, accumulation_steps=0):
    """`update_bytes` of one timed optimizer of a pair: its base, this
    package's own base, or its twin (VR optimizer or LARC, which adds no
    state; Keras accumulates for it)."""
    base_rule = pairs()[pair_name][2]
    if pair_name == "NoiseScale" and hasattr(optimizer, "interval"):
        # The wrapper reads the gradient for its squared norm before the
        # collective and the reduced one after it, at measured updates.
        return update_bytes(base_rule, accumulation_steps=accumulation_steps) + 8 / (
            optimizer.interval
        )
    if pair_name == "AdaScale" and type(optimizer).__name__ == "AdaScale":
        # The same two reads as NoiseScale's, at every update.
        return update_bytes(base_rule, accumulation_steps=accumulation_steps) + 8
    return update_bytes(
        base_rule,
        vr=hasattr(optimizer, "gsnr_interval"),
        beta_3=getattr(optimizer, "beta_3", 0.0),
        gsnr_interval=getattr(optimizer, "gsnr_interval", 1),
        accumulation_steps=accumulation_steps,
    )


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
    # The thin MLP: Dense layers of `thin_mlp_width` units, two variables
    # each (41 x 32: the 82-variable MLP of the first-step target).
    thin_mlp_layers: int = 41
    thin_mlp_width: int = 32
    statistics: bool = False
    # Each N > 1 adds the twin with gsnr_interval = N; the timed calls of
    # every candidate are then a whole number of the largest N's cycles.
    gsnr_intervals: Sequence[int] = (1,)
    no_xla: bool = True
    # Also time this package's own base rule where the pair's base is
    # Keras' (`own_bases`).
    own_base: bool = False
    # Also time a second, separately built copy of the base ("base again"):
    # its ratio to the base is what the machine's noise alone makes of a
    # ratio between two candidates of equal cost, in the same run.
    control: bool = False
    image_size: int = 32  # resnet50's input side (ImageNet: 224)
    # Reduce through one device: GPUs that are logical parts of one GPU
    # (NCCL does not run between them).
    reduce_to_one_device: bool = False


MODEL_FACTORIES = {
    "mlp": lambda settings: mlp(settings.mlp_parameters),
    "thin_mlp": lambda settings: thin_mlp(settings.thin_mlp_layers, settings.thin_mlp_width),
    "cnn": lambda settings: cnn(),
    "resnet50": lambda settings: resnet50(size=settings.image_size),
    "encoder": lambda settings: encoder(),
    "tables": lambda settings: tables(),
}
# Models measured at a fixed batch per replica (`--batch-per-replica`) rather
# than at the global `--batch`.
REAL_MODELS = ("resnet50", "encoder")


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
    measured), plus, for "first step", ``trace_seconds`` (candidate -> median
    seconds of the trace alone), for "update", ``traffic`` (candidate -> achieved bytes/s
    over the copy bandwidth). Each row is passed to `report` as soon as it
    is measured; `format_row` makes a line of it.
    """
    bandwidth = memory_bandwidth("/gpu:0" if gpus else None)
    where = "GPU 0" if gpus else "host"
    report(f"memory copy bandwidth ({where}): {bandwidth / 1e9:.1f} GB/s (read + write)")
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
                own_base = own_bases().get(pair_name) if settings.own_base else None
                if own_base is not None:
                    factories["own base"] = functools.partial(own_base, **extra)
                if settings.control:
                    factories["base again"] = functools.partial(make_base, **extra)
                if pair_name not in WRAPPER_PAIRS:
                    if settings.no_xla:
                        factories["vr no-xla"] = functools.partial(
                            make_vr, jit_update=False, **extra
                        )
                    for interval in settings.gsnr_intervals:
                        if interval > 1:
                            factories[f"vr N={interval}"] = functools.partial(
                                make_vr, gsnr_interval=interval, **extra
                            )
                            if settings.no_xla:
                                factories[f"vr N={interval} no-xla"] = functools.partial(
                                    make_vr, gsnr_interval=interval, jit_update=False, **extra
                                )
                    if settings.statistics:
                        factories["vr statistics"] = functools.partial(
                            make_vr, track_gsnr_statistics=True, **extra
                        )
                elif pair_name == "NoiseScale":  # its `interval`, for each N listed
                    for interval in settings.gsnr_intervals:
                        if interval > 1:
                            factories[f"vr N={interval}"] = functools.partial(
                                make_vr, interval=interval, **extra
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
                    seconds, traces = first_step_times(
                        factories,
                        make_model,
                        strategy,
                        batch,
                        calls_per_update,
                        settings.first_step_rounds,
                    )
                    rows.append(
                        {**row, "kind": "first step", "seconds": seconds, "trace_seconds": traces}
                    )
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
                        # Achieved bytes/s over the copy bandwidth, for every
                        # candidate (the bytes of `update_bytes`).
                        rows[-1]["bytes_per_parameter"] = {
                            name: _candidate_bytes(
                                pair_name,
                                candidate.optimizer,
                                settings.accumulation if extra else 0,
                            )
                            for name, candidate in zip(factories, candidates)
                        }
                        rows[-1]["traffic"] = {
                            name: copies * moved * params / seconds[name] / bandwidth
                            for name, moved in rows[-1]["bytes_per_parameter"].items()
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
    if "own base" in seconds:
        line += f"  own-base/base {seconds['own base'] / seconds['base']:5.2f}"
    if "base again" in seconds:  # the noise floor of a ratio in this run
        line += f"  base-again/base {seconds['base again'] / seconds['base']:5.2f}"
    for name, value in seconds.items():
        if name.startswith("vr N="):
            line += f"  {name}/base {value / seconds['base']:5.2f}"
    if "trace_seconds" in row:  # the first step's trace, the rest compiles and runs
        line += "  of which trace " + " ".join(
            f"{'twin' if name == 'vr' else name} {value:.1f} s"
            for name, value in row["trace_seconds"].items()
        )
    if "collective_bytes" in row:
        sent = row["collective_bytes"]
        line += "  all-reduce MB/update " + " ".join(
            f"{name} {value / 1e6:.1f}" for name, value in sent.items()
        )
    if "vr statistics" in seconds:
        line += f"  statistics on/off {seconds['vr statistics'] / seconds['vr']:5.2f}"
    if "traffic" in row:
        moved = row["bytes_per_parameter"]
        line += "  traffic/bandwidth (B/param) " + ", ".join(
            f"{'twin' if name == 'vr' else name} {fraction:.1%} ({moved[name]:g})"
            for name, fraction in row["traffic"].items()
        )
    return line


def run(settings, gpus=()):
    """`measure`, printing each line as it is measured."""
    return measure(settings, gpus, report=lambda row: print(format_row(row), flush=True))
