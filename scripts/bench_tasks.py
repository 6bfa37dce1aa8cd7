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
    return parser.parse_args(argv)


def build(task_name, block, strategy, args):
    """A compiled model of the task with `block`'s optimizer, its train
    function and a distributed iterator over the synthetic input."""
    import keras

    import tf_vrgd
    from tf_vrgd import config
    from tf_vrgd.experiments import task_runs, train

    cfg = config.load(os.path.join(ROOT, "configs", "paper", CONFIGS[task_name]))
    if not args.full:
        cfg = train.apply_overrides(
            cfg, [f"{k}={json.dumps(v)}" for k, v in CPU_SIZES[task_name].items()]
        )
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


def bench_task(task_name, strategy, args):
    from tf_vrgd import config
    from tf_vrgd.experiments import twins

    cfg = config.load(os.path.join(ROOT, "configs", "paper", CONFIGS[task_name]))
    block = config.optimization_block(cfg)
    twin = twins.twin_block(block)
    candidates = {}
    for b in (block, twin):
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


def main(argv=None):
    args = parse_args(argv)
    from tf_vrgd.experiments import train

    devices = train.setup_devices(args.replicas)
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(devices)
    rows = []
    header = (
        f"{'task':<9} {'optimizer':<12} {'params':>10} {'vars':>5} {'batch':>6} "
        f"{'first s':>8} {'step ms':>9} {'ex/s':>9} {'ex/s/rep':>9} {'vs base':>8}"
    )
    print(header)
    print("-" * len(header), flush=True)
    for task_name in args.tasks:
        for row in bench_task(task_name, strategy, args):
            rows.append(row)
            print(
                f"{row['task']:<9} {row['optimizer']:<12} {row['parameters']:>10} "
                f"{row['variables']:>5} {row['step_batch']:>6} {row['first_step_seconds']:>8.1f} "
                f"{row['step_seconds'] * 1e3:>9.1f} {row['examples_per_second']:>9.1f} "
                f"{row['examples_per_second_per_replica']:>9.1f} {row['step_ratio']:>8.2f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
