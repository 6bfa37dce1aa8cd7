"""Training throughput of the paper's tasks, each config's optimizer against
its VR twin, on synthetic inputs (docs/RESULTS.md, "Paper tasks").

    python scripts/bench_tasks.py                       # all tasks, 2 replicas, CPU sizes
    python scripts/bench_tasks.py --tasks bert --replicas 8 --full   # a GPU node

Each task is built from its config in configs/paper with the overrides of
`CPU_SIZES` (unless --full), under one MirroredStrategy. Both models train
through Keras' own train function (what `fit` runs) on the task's
`--synthetic` input; after one warm-up call each (tracing, compilation),
rounds of --steps steps alternate between the two and the medians are
compared. Prints examples per second (in all and per replica) and the step
time of each against the non-VR optimizer's.

    python scripts/bench_tasks.py --tasks dlrm --dlrm-rows 100000 1000000
    python scripts/bench_tasks.py --tasks dlrm --dlrm-rows 1000 1000000 --statistics
    python scripts/bench_tasks.py --tasks dlrm --dlrm-rows 1000000 --memory

`--dlrm-rows` runs DLRM once per table size (every one of its 26 tables
with that many rows). `--statistics` trains the VR twin alone with
`track_gsnr_statistics` and prints the embedding tables' GSNR statistics
(docs/algorithms.md §2: how the layer mean treats rows a batch did not
touch). `--memory` runs each optimizer in a process of its own and prints
its peak resident memory (memory, unlike time, does not depend on what
else the machine runs).
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--full", action="store_true", help="the configs' own sizes")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument(
        "--dlrm-rows",
        type=int,
        nargs="+",
        default=None,
        help="DLRM once per table size: each of the 26 tables with this many rows",
    )
    parser.add_argument(
        "--statistics",
        action="store_true",
        help="the VR twin's GSNR statistics of the embedding tables instead of timings",
    )
    parser.add_argument(
        "--memory",
        action="store_true",
        help="each optimizer's peak resident memory, each in a process of its own",
    )
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.rows = None  # the table size of the run in progress (--dlrm-rows)
    return args


def task_config(task_name, args, rows=None):
    """The task's config at the CPU sizes (unless --full), its DLRM tables
    with `rows` rows each if given."""
    from tf_vrgd import config
    from tf_vrgd.experiments import experiment_config

    cfg = config.load(os.path.join(ROOT, "configs", "paper", CONFIGS[task_name]))
    overrides = {} if args.full else dict(CPU_SIZES[task_name])
    rows = rows if rows is not None else args.rows
    if rows is not None:
        overrides["task.model.vocab_sizes"] = [rows] * 26
    return experiment_config.apply_overrides(
        cfg, [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    )


def build(task_name, block, strategy, args):
    """A compiled model of the task with `block`'s optimizer, its train
    function and a distributed iterator over the synthetic input."""
    import keras

    import tf_vrgd
    from tf_vrgd import config
    from tf_vrgd.experiments import task_runs

    cfg = task_config(task_name, args)
    experiment = task_runs.TaskExperiment(cfg, replicas=args.replicas, synthetic=True)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = experiment.task.build_model()
        tf_vrgd.independent_replica_noise(model)  # as vrgd-train does
        model.compile(
            optimizer=config.optimizer_from_config(block), **experiment.task.compile_args()
        )
    dataset = experiment.dataset("train", 0)
    # One `fit` step builds everything and traces the train function.
    start = time.perf_counter()
    model.fit(dataset, steps_per_epoch=experiment.accumulation, epochs=1, verbose=0)
    first = time.perf_counter() - start
    iterator = iter(strategy.experimental_distribute_dataset(dataset))
    time_steps(model, iterator, 2)  # this iterator's own trace
    return model, iterator, experiment, first


def time_steps(model, iterator, steps):
    start = time.perf_counter()
    for _ in range(steps):
        logs = model.train_function(iterator)
    float(logs["loss"])  # waits for the last step
    return (time.perf_counter() - start) / steps


def optimizer_blocks(task_name, args):
    """The task config's optimizer block and its VR twin's."""
    from tf_vrgd import config
    from tf_vrgd.experiments import twins

    block = config.optimization_block(task_config(task_name, args))
    return block, twins.twin_block(block)


def bench_task(task_name, strategy, args):
    candidates = {}
    for b in optimizer_blocks(task_name, args):
        name = b["optimizer"]["type"]
        candidates[name] = build(task_name, b, strategy, args)
    samples = {name: [] for name in candidates}
    for _ in range(args.rounds):
        for name, (model, iterator, _, _) in candidates.items():
            samples[name].append(time_steps(model, iterator, args.steps))
    rows = []
    base = next(name for name in candidates if not name.startswith("vr_"))
    for name, (model, _, experiment, first) in candidates.items():
        step = statistics.median(samples[name])
        # A step is one micro-step: 1/A of an update.
        examples = experiment.step_batch / step
        rows.append(
            {
                "task": task_name,
                "table_rows": args.rows,
                "optimizer": name,
                "parameters": int(model.count_params()),
                "variables": len(model.trainable_variables),
                "replicas": args.replicas,
                "step_batch": experiment.step_batch,
                "first_step_seconds": first,
                "step_seconds": step,
                "examples_per_second": examples,
                "examples_per_second_per_replica": examples / args.replicas,
                "step_ratio": step / statistics.median(samples[base]),
            }
        )
    return rows


def table_statistics(task_name, strategy, args):
    """The VR twin's GSNR statistics averaged over the embedding tables,
    after `--rounds` x `--steps` steps."""
    from tf_vrgd import _gsnr

    _, twin = optimizer_blocks(task_name, args)
    kind = twin["optimizer"]["type"]
    twin["optimizer"][kind] = {**(twin["optimizer"].get(kind) or {}), "track_gsnr_statistics": True}
    model, iterator, _, _ = build(task_name, twin, strategy, args)
    optimizer = _gsnr.find_vr_optimizer(model.optimizer)
    optimizer.reset_gsnr_statistics()
    time_steps(model, iterator, args.rounds * args.steps)
    tables = [s for path, s in optimizer.gsnr_statistics().items() if "embedding" in path]
    row = {"task": task_name, "table_rows": args.rows, "optimizer": kind, "tables": len(tables)}
    for name in ("mean_gsnr", "fraction_at_gamma", "fraction_at_one", "mean_scale"):
        row[name] = statistics.fmean(t[name] for t in tables)
    row["updates"] = tables[0]["updates"]
    return row


def peak_memory(task_name, args):
    """Each optimizer's peak resident memory (MiB), each measured in a child
    process that builds the model and trains `--rounds` x `--steps` steps."""
    import subprocess

    rows = []
    for which in ("base", "twin"):
        command = [sys.executable, os.path.abspath(__file__), "--tasks", task_name]
        command += ["--replicas", str(args.replicas), "--steps", str(args.steps)]
        command += ["--rounds", str(args.rounds), "--memory-child", which]
        if args.rows is not None:
            command += ["--dlrm-rows", str(args.rows)]
        if args.full:
            command.append("--full")
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    for row in rows:
        row["memory_ratio"] = row["peak_mib"] / rows[0]["peak_mib"]
    return rows


def memory_child(task_name, strategy, args):
    import resource

    block = optimizer_blocks(task_name, args)[args.memory_child == "twin"]
    model, iterator, _, _ = build(task_name, block, strategy, args)
    time_steps(model, iterator, args.rounds * args.steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux
    row = {"task": task_name, "table_rows": args.rows, "optimizer": block["optimizer"]["type"]}
    print(json.dumps({**row, "parameters": int(model.count_params()), "peak_mib": peak}))


def main(argv=None):
    args = parse_args(argv)
    from tf_vrgd.experiments import distribution

    if args.dlrm_rows and args.tasks != ["dlrm"]:
        raise SystemExit("--dlrm-rows needs --tasks dlrm")
    if args.memory:
        for rows in args.dlrm_rows or [None]:
            args.rows = rows
            for task_name in args.tasks:
                for row in peak_memory(task_name, args):
                    print(
                        f"{row['task']:<9} rows {row['table_rows']} {row['optimizer']:<12} "
                        f"params {row['parameters']:>11} peak {row['peak_mib']:>9.0f} MiB "
                        f"vs base {row['memory_ratio']:.2f}",
                        flush=True,
                    )
        return 0
    devices = distribution.setup_devices(args.replicas)
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(devices)
    if args.memory_child:
        args.rows = args.dlrm_rows[0] if args.dlrm_rows else None
        memory_child(args.tasks[0], strategy, args)
        return 0
    if args.statistics:
        for rows in args.dlrm_rows or [None]:
            args.rows = rows
            for task_name in args.tasks:
                row = table_statistics(task_name, strategy, args)
                print(
                    f"{row['task']:<9} rows {row['table_rows']} {row['optimizer']}: over "
                    f"{row['tables']} tables, {row['updates']} updates: mean GSNR "
                    f"{row['mean_gsnr']:.3g}, at gamma {row['fraction_at_gamma']:.4f}, "
                    f"at 1 {row['fraction_at_one']:.4f}, mean scale {row['mean_scale']:.4f}",
                    flush=True,
                )
        return 0
    rows = []
    header = (
        f"{'task':<9} {'optimizer':<12} {'params':>10} {'vars':>5} {'batch':>6} "
        f"{'first s':>8} {'step ms':>9} {'ex/s':>9} {'ex/s/rep':>9} {'vs base':>8}"
    )
    print(header)
    print("-" * len(header), flush=True)
    for table_rows in args.dlrm_rows or [None]:
        args.rows = table_rows
        for task_name in args.tasks:
            for row in bench_task(task_name, strategy, args):
                rows.append(row)
                name = row["task"] if table_rows is None else f"dlrm {table_rows:,}"
                print(
                    f"{name:<9} {row['optimizer']:<12} {row['parameters']:>10} "
                    f"{row['variables']:>5} {row['step_batch']:>6} "
                    f"{row['first_step_seconds']:>8.1f} {row['step_seconds'] * 1e3:>9.1f} "
                    f"{row['examples_per_second']:>9.1f} "
                    f"{row['examples_per_second_per_replica']:>9.1f} {row['step_ratio']:>8.2f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
