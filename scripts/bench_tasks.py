"""Training throughput of the paper's tasks, each config's optimizer against
its VR twin, on synthetic inputs (docs/RESULTS.md, "Paper tasks").

    python scripts/bench_tasks.py                       # all tasks, 2 replicas, CPU sizes
    python scripts/bench_tasks.py --tasks bert --replicas 8 --full   # a GPU node

Each task is built from its config in configs/paper at CPU sizes (unless
--full), under one MirroredStrategy; `tf_vrgd.experiments.task_benchmark`
says how it is timed. Prints examples per second (in all and per replica)
and the step time of each against the non-VR optimizer's.

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
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TASKS = ("bert", "resnet50", "resnet56", "dlrm")  # task_benchmark.CONFIGS, without importing TF


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
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
    if args.dlrm_rows and args.tasks != ["dlrm"]:
        parser.error("--dlrm-rows needs --tasks dlrm")
    return args


def settings_of(args, rows):
    from tf_vrgd.experiments import task_benchmark

    return task_benchmark.Settings(args.replicas, args.steps, args.rounds, args.full, rows)


def peak_memory(task_name, args, rows):
    """Each optimizer's peak resident memory (MiB), each measured in a child
    process of this script."""
    measured = []
    for which in ("base", "twin"):
        command = [sys.executable, os.path.abspath(__file__), "--tasks", task_name]
        command += ["--replicas", str(args.replicas), "--steps", str(args.steps)]
        command += ["--rounds", str(args.rounds), "--memory-child", which]
        if rows is not None:
            command += ["--dlrm-rows", str(rows)]
        if args.full:
            command.append("--full")
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        measured.append(json.loads(out.strip().splitlines()[-1]))
    for row in measured:
        row["memory_ratio"] = row["peak_mib"] / measured[0]["peak_mib"]
    return measured


def main(argv=None):
    args = parse_args(argv)
    table_sizes = args.dlrm_rows or [None]
    if args.memory:
        for rows in table_sizes:
            for task_name in args.tasks:
                for row in peak_memory(task_name, args, rows):
                    print(
                        f"{row['task']:<9} rows {row['table_rows']} {row['optimizer']:<12} "
                        f"params {row['parameters']:>11} peak {row['peak_mib']:>9.0f} MiB "
                        f"vs base {row['memory_ratio']:.2f}",
                        flush=True,
                    )
        return 0
    from tf_vrgd.experiments import distribution

    devices = distribution.setup_devices(args.replicas)
    import tensorflow as tf

    from tf_vrgd.experiments import task_benchmark

    strategy = tf.distribute.MirroredStrategy(devices)
    if args.memory_child:
        settings = settings_of(args, table_sizes[0])
        twin = args.memory_child == "twin"
        row = task_benchmark.peak_memory(args.tasks[0], strategy, settings, twin)
        print(json.dumps(row))
        return 0
    if args.statistics:
        for rows in table_sizes:
            for task_name in args.tasks:
                row = task_benchmark.table_statistics(task_name, strategy, settings_of(args, rows))
                print(
                    f"{row['task']:<9} rows {row['table_rows']} {row['optimizer']}: over "
                    f"{row['tables']} tables, {row['updates']} updates: mean GSNR "
                    f"{row['mean_gsnr']:.3g}, at gamma {row['fraction_at_gamma']:.4f}, "
                    f"at 1 {row['fraction_at_one']:.4f}, mean scale {row['mean_scale']:.4f}",
                    flush=True,
                )
        return 0
    header = (
        f"{'task':<9} {'optimizer':<12} {'params':>10} {'vars':>5} {'batch':>6} "
        f"{'first s':>8} {'step ms':>9} {'ex/s':>9} {'ex/s/rep':>9} {'vs base':>8}"
    )
    print(header)
    print("-" * len(header), flush=True)
    measured = []
    for rows in table_sizes:
        for task_name in args.tasks:
            for row in task_benchmark.compare(task_name, strategy, settings_of(args, rows)):
                measured.append(row)
                name = row["task"] if rows is None else f"dlrm {rows:,}"
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
            json.dump(measured, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
