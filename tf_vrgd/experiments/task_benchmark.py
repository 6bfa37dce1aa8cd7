"""Training throughput of the paper's tasks (used by `scripts/bench_tasks.py`):
each config's optimizer against its VR twin, on synthetic inputs, timed
side by side in one process.

Each task is built from its config in `configs/paper`, at `CPU_SIZES`
unless `full`. Both models train through Keras' own train function (what
`fit` runs); after one warm-up call each (tracing, compilation), rounds of
`steps` steps alternate between the two and medians are compared.
"""

import dataclasses
import json
import os
import resource
import statistics
import time

import keras

import tf_vrgd
from tf_vrgd import config
from tf_vrgd.experiments import experiment_config, task_runs, twins

CONFIG_FOLDER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "configs",
    "paper",
)
CONFIGS = {
    "bert": "bert_large_vr_lamb_32k_phase1.yaml",
    "resnet50": "imagenet_resnet50_vr_lars_4k.yaml",
    "resnet56": "cifar10_resnet56_vr_momentum_1k.yaml",
    "dlrm": "dlrm_sgd_64k.yaml",
}
# Sizes that run on a 2-core CPU in seconds per step (real layer structure,
# smaller widths, inputs and batches).
CPU_SIZES = {
    "bert": {
        "task.model.encoder.bert.num_layers": 4,
        "task.model.encoder.bert.hidden_size": 128,
        "task.model.encoder.bert.num_attention_heads": 2,
        "task.model.encoder.bert.intermediate_size": 512,
        "task.train_data.seq_length": 64,
        "task.train_data.max_predictions_per_seq": 10,
        "task.train_data.global_batch_size": 32,
    },
    "resnet50": {"task.model.input_size": [64, 64, 3], "task.train_data.global_batch_size": 16},
    "resnet56": {"task.train_data.global_batch_size": 64},
    "dlrm": {
        "task.model.embedding_dim": 16,
        "task.model.vocab_sizes": [100_000] * 26,
        "task.model.bottom_mlp": [512, 256, 16],
        "task.model.top_mlp": [512, 256, 1],
        "task.train_data.global_batch_size": 2048,
    },
}
DLRM_TABLES = 26


@dataclasses.dataclass
class Settings:
    """What one measurement runs (`scripts/bench_tasks.py` documents each
    field as a command-line flag)."""

    replicas: int = 2
    steps: int = 3  # steps per timed round
    rounds: int = 5
    full: bool = False  # the configs' own sizes, not `CPU_SIZES`
    rows: int | None = None  # rows of each DLRM table, if set


@dataclasses.dataclass
class Built:
    """A compiled model of a task, its train function traced."""

    model: keras.Model
    iterator: object  # over the distributed synthetic input
    experiment: task_runs.TaskExperiment
    first_step_seconds: float


def task_config(task_name, settings):
    """The task's config at the CPU sizes (unless `full`), its DLRM tables
    with `rows` rows each if set."""
    cfg = config.load(os.path.join(CONFIG_FOLDER, CONFIGS[task_name]))
    overrides = {} if settings.full else dict(CPU_SIZES[task_name])
    if settings.rows is not None:
        overrides["task.model.vocab_sizes"] = [settings.rows] * DLRM_TABLES
    return experiment_config.apply_overrides(
        cfg, [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    )


def optimizer_blocks(task_name, settings):
    """The task config's optimizer block and its VR twin's."""
    block = config.optimization_block(task_config(task_name, settings))
    return block, twins.twin_block(block)


def build(task_name, block, strategy, settings):
    """The task with `block`'s optimizer under `strategy`, built, compiled
    and trained one update by `fit` (which traces the train function)."""
    cfg = task_config(task_name, settings)
    experiment = task_runs.TaskExperiment(cfg, replicas=settings.replicas, synthetic=True)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = experiment.task.build_model()
        tf_vrgd.independent_replica_noise(model)  # as vrgd-train does
        model.compile(
            optimizer=config.optimizer_from_config(block), **experiment.task.compile_args()
        )
    dataset = experiment.dataset("train", 0)
    start = time.perf_counter()
    model.fit(dataset, steps_per_epoch=experiment.accumulation, epochs=1, verbose=0)
    first = time.perf_counter() - start
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    time_steps(model, iterator, 2)  # this iterator's own trace
    return Built(model, iterator, experiment, first)


def time_steps(model, iterator, steps):
    """Seconds per call of the model's train function, over `steps` calls."""
    start = time.perf_counter()
    for _ in range(steps):
        logs = model.train_function(iterator)
    float(logs["loss"])  # waits for the last step
    return (time.perf_counter() - start) / steps


def compare(task_name, strategy, settings):
    """One row per optimizer (the config's, then its twin's): step time and
    examples per second, medians of interleaved rounds, and the step time
    over the non-VR optimizer's."""
    candidates = {}
    for block in optimizer_blocks(task_name, settings):
        candidates[block["optimizer"]["type"]] = build(task_name, block, strategy, settings)
    samples = {name: [] for name in candidates}
    for _ in range(settings.rounds):
        for name, built in candidates.items():
            samples[name].append(time_steps(built.model, built.iterator, settings.steps))
    base = statistics.median(samples[next(n for n in candidates if not n.startswith("vr_"))])
    rows = []
    for name, built in candidates.items():
        step = statistics.median(samples[name])
        # A step is one micro-step: 1/A of an update.
        examples = built.experiment.step_batch / step
        rows.append(
            {
                "task": task_name,
                "table_rows": settings.rows,
                "optimizer": name,
                "parameters": int(built.model.count_params()),
                "variables": len(built.model.trainable_variables),
                "replicas": settings.replicas,
                "step_batch": built.experiment.step_batch,
                "first_step_seconds": built.first_step_seconds,
                "step_seconds": step,
                "examples_per_second": examples,
                "examples_per_second_per_replica": examples / settings.replicas,
                "step_ratio": step / base,
            }
        )
    return rows


def table_statistics(task_name, strategy, settings):
    """The VR twin's GSNR statistics averaged over the embedding tables,
    after `rounds` x `steps` steps."""
    _, twin = optimizer_blocks(task_name, settings)
    kind = twin["optimizer"]["type"]
    twin["optimizer"][kind] = {**(twin["optimizer"].get(kind) or {}), "track_gsnr_statistics": True}
    built = build(task_name, twin, strategy, settings)
    optimizer = tf_vrgd.find_vr_optimizer(built.model.optimizer)
    optimizer.reset_gsnr_statistics()
    time_steps(built.model, built.iterator, settings.rounds * settings.steps)
    tables = [s for path, s in optimizer.gsnr_statistics().items() if "embedding" in path]
    row = {"task": task_name, "table_rows": settings.rows, "optimizer": kind, "tables": len(tables)}
    for name in ("mean_gsnr", "fraction_at_gamma", "fraction_at_one", "mean_scale"):
        row[name] = statistics.fmean(t[name] for t in tables)
    row["updates"] = tables[0]["updates"]
    return row


def peak_memory(task_name, strategy, settings, twin):
    """This process's peak resident memory (MiB) after building the task with
    its config's optimizer (or, with `twin`, the VR twin's) and training
    `rounds` x `steps` steps: call it in a fresh process, once."""
    block = optimizer_blocks(task_name, settings)[int(twin)]
    built = build(task_name, block, strategy, settings)
    time_steps(built.model, built.iterator, settings.rounds * settings.steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    return {
        "task": task_name,
        "table_rows": settings.rows,
        "optimizer": block["optimizer"]["type"],
        "parameters": int(built.model.count_params()),
        "peak_mib": peak,
    }
