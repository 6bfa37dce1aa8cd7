"""`vrgd-train`: trains a Model Garden-format experiment (Fashion-MNIST, or
the paper's BERT, ResNet and DLRM tasks), optionally beside its VR twin
(`--compare`), from the same initial weights and data order, and resumes
after interruption.

    vrgd-train --config configs/fashion_mnist/lamb_b8192.yaml --compare --output runs/lamb

Per run (a subfolder of --output named after the optimizer type): per-epoch
metrics (`metrics.jsonl`, `metrics.csv`: train and test loss and accuracy,
generalization gap, GSNR statistics), `checkpoint-epoch<N>.keras`
(model and optimizer, written under a temporary name and renamed at every
epoch end) and `final.weights.h5`.
At the top of --output: `summary.json`, `summary.txt` (the table printed at
the end) and PNG plots.

This module is the command line: a Fashion-MNIST experiment trains in
`fashion_mnist`, the paper's tasks (BERT, ResNet, DLRM configs) in
`task_runs`, with `TF_CONFIG` set on several machines under
`MultiWorkerMirroredStrategy` (`distribution`; the same command on every
worker); `run_folder` keeps what a resume reads.
"""

import argparse
import contextlib
import os
import shutil
import sys

from tf_vrgd.experiments import distribution, reporting, run_folder
from tf_vrgd.experiments.experiment_config import (
    apply_overrides,
    check_runs,
    config_errors_exit,
    lookup,
)
from tf_vrgd.experiments.fashion_mnist import Experiment, train_run
from tf_vrgd.experiments.run_folder import check_settings, train_each, write_summary


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="vrgd-train", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    parser.add_argument("--config", required=True, help="experiment YAML (Model Garden layout)")
    parser.add_argument("--output", required=True, help="output folder; rerun to resume")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also train the optimizer's VR twin (or its base, for a VR config)",
    )
    parser.add_argument(
        "--replicas",
        type=_positive_int,
        default=None,
        help="MirroredStrategy replicas: GPUs, or logical CPU devices without "
        "GPUs (default: runtime.num_gpus of the config)",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=None,
        help="global batch override; the learning rate is scaled by "
        "sqrt(new / old) and the schedule's steps follow the new total",
    )
    parser.add_argument(
        "--epochs",
        type=_positive_int,
        default=None,
        help="epochs override; the schedule's steps follow the new total",
    )
    parser.add_argument(
        "--seed", type=int, default=None, help="seed override (weights and data order)"
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="folder with the Fashion-MNIST IDX .gz files "
        "(default /usr/share/datasets/fashion-mnist)",
    )
    parser.add_argument(
        "--cache-dir", default=None, help="tensorflow-datasets folder for the prepared dataset"
    )
    parser.add_argument(
        "--train-examples",
        type=_positive_int,
        default=None,
        help="train on the first N training examples only (quick runs)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic TensorFlow ops (bit-reproducible resumes)",
    )
    parser.add_argument(
        "--verbose", type=int, default=1, choices=[0, 1, 2], help="Keras progress output"
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="DOTTED.KEY=VALUE",
        help="set a field of the experiment (Model Garden's names, the value read as "
        "YAML), e.g. task.model.encoder.bert.num_layers=2; repeatable",
    )
    parser.add_argument(
        "--train-steps",
        type=_positive_int,
        default=None,
        help="paper tasks: updates to train; the schedule's steps follow the new total",
    )
    parser.add_argument(
        "--synthetic",
        action="store_true",
        help="paper tasks: random inputs of the task's shapes made on the device, no files",
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help="discard the checkpoints and metrics already in --output and "
        "start over (needed to reuse a folder with other settings)",
    )
    parser.add_argument(
        "--accept-input-change",
        action="store_true",
        help="paper tasks: resume although the input files differ from the ones the "
        "run started on (refused otherwise: the stream would be neither run's)",
    )
    parser.add_argument(
        "--worker-timeout",
        type=_positive_int,
        default=600,
        help="with TF_CONFIG: seconds to wait for every task of the cluster to "
        "connect before giving up (default 600)",
    )
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def check_experiment_dependencies():
    """Stops with the install command if the `experiments` extra is missing."""
    import importlib.util

    modules = ("tensorflow_datasets", "matplotlib", "keras_hub", "keras_rs")
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"vrgd-train needs {', '.join(missing)}: install the package with its "
            "experiments extra, pip install 'tf_vrgd[experiments]' (or '.[experiments]' "
            "from a checkout)."
        )


def prepare_output(args, experiment, write=True):
    """Op determinism if asked; `--output` made, its settings recorded
    (`write`: by the chief of a multi-worker run only) or checked; every
    run's optimizer checked before the first trains."""
    import tensorflow as tf

    if args.deterministic:
        tf.config.experimental.enable_op_determinism()
    run_folder.prepare_folder(args.output)
    if write:
        # The writing process (the chief of a multi-worker run) holds the
        # folder until it ends.
        run_folder.lock_folder(args.output)
    check_settings(
        args.output,
        experiment.settings(args.compare),
        args.restart,
        write,
        accept_input_change=args.accept_input_change,
    )
    check_runs(experiment, args.compare)


def main(argv=None):
    args = parse_args(argv)
    check_experiment_dependencies()
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tf_vrgd import config
    from tf_vrgd.experiments import fields

    try:
        cfg = config.load(args.config)
        fields.check_config_keys(cfg, args.config)
        fields.check_override_keys(cfg, args.override)
        cfg = fields.check(apply_overrides(cfg, args.override))
    except ValueError as error:
        raise SystemExit(f"vrgd-train: {error}") from None
    if lookup(cfg, "task.model.type", "fashion_mnist_cnn") != "fashion_mnist_cnn":
        return main_task(args, cfg)
    for flag, value in (("--train-steps", args.train_steps), ("--synthetic", args.synthetic)):
        if value:
            raise SystemExit(
                f"vrgd-train: {flag} is for the paper's tasks; a Fashion-MNIST run "
                "takes --epochs and reads its IDX files."
            )
    with config_errors_exit():
        experiment = Experiment.from_args(cfg, args)
    devices = distribution.setup_devices(experiment.replicas)

    import tensorflow as tf

    from tf_vrgd.experiments import data

    prepare_output(args, experiment)
    print(
        f"experiment: {args.config}: {experiment.train_examples} training examples, "
        f"batch {experiment.batch_size}, {experiment.epochs} epochs "
        f"x {experiment.steps_per_epoch} steps, {experiment.replicas} replica(s) {devices}, "
        f"seed {experiment.seed}",
        flush=True,
    )
    if experiment.note:
        print(f"experiment: {experiment.note}", flush=True)
    if os.environ.get("TF_CONFIG"):
        print(
            "experiment: TF_CONFIG is set, but a Fashion-MNIST run trains on this machine "
            "only (the paper's tasks train on several)",
            flush=True,
        )
    arrays = data.load(args.data_dir, args.cache_dir)
    strategy = tf.distribute.MirroredStrategy(devices)
    runs = train_each(
        args,
        experiment,
        lambda name, block, run_dir: train_run(
            name, block, experiment, strategy, arrays, run_dir, args.verbose
        ),
    )
    table = write_summary(
        args, experiment, reporting.summarize(runs, experiment), reporting.format_table
    )
    plots = reporting.plot(runs, args.output, batch=experiment.batch_size)
    print(f"\nplots: {', '.join(plots)}")
    print(f"\n{table}", flush=True)
    return 0


def main_task(args, cfg):
    """`vrgd-train` on a paper task (BERT, ResNet, DLRM)."""
    from tf_vrgd.experiments import task_runs

    for flag, value in (
        ("--epochs", args.epochs),
        ("--batch-size", args.batch_size),
        ("--train-examples", args.train_examples),
        ("--data-dir", args.data_dir),
        ("--cache-dir", args.cache_dir),
    ):
        if value is not None:
            raise SystemExit(
                f"vrgd-train: {flag} is for Fashion-MNIST runs; a paper task takes "
                "--train-steps, and --override for its batch "
                "(task.train_data.global_batch_size) and files (task.train_data.input_path)."
            )
    cluster = distribution.multi_worker_cluster(args)
    strategy = devices = None
    if cluster and distribution.CONNECTED_FD not in os.environ:
        return distribution.supervise(args.argv, args.worker_timeout)
    if cluster:
        # Before anything else starts TensorFlow's runtime.
        strategy = distribution.multi_worker_strategy()
    with config_errors_exit():
        experiment = task_runs.TaskExperiment(
            cfg,
            train_steps=args.train_steps,
            seed=args.seed,
            replicas=strategy.num_replicas_in_sync if strategy else args.replicas,
            synthetic=args.synthetic,
        )
    if not cluster:
        devices = distribution.setup_devices(experiment.replicas)
    with config_errors_exit():
        experiment.check_input()

    import tensorflow as tf

    chief = distribution.is_chief(strategy)
    prepare_output(args, experiment, write=chief)
    where = devices
    if cluster:
        task = strategy.cluster_resolver
        where = f"on {cluster}, this one {task.task_type} {task.task_id}"
    print(f"experiment: {args.config}: {experiment.describe()} {where}", flush=True)
    if experiment.note:
        print(f"experiment: {experiment.note}", flush=True)
    if not cluster and lookup(cfg, "runtime.distribution_strategy") == "multi_worker_mirrored":
        print(
            "experiment: the config's runtime is multi_worker_mirrored; without TF_CONFIG "
            f"vrgd-train runs MirroredStrategy on this machine, so k = {experiment.replicas} x "
            f"{experiment.accumulation}, not the paper's (see the config's header)",
            flush=True,
        )
    strategy = strategy or tf.distribute.MirroredStrategy(devices)

    scratch = None
    if not chief:
        task = strategy.cluster_resolver
        scratch = os.path.join(
            args.output, distribution.WORKER_SCRATCH, f"{task.task_type}-{task.task_id}"
        )

    def train_one(name, block, run_dir):
        return task_runs.train_task_run(
            name,
            block,
            experiment,
            strategy,
            run_dir,
            args.verbose,
            scratch and os.path.join(scratch, name),
        )

    with config_errors_exit():
        runs = train_each(args, experiment, train_one, write=chief)
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
        with contextlib.suppress(OSError):  # the other workers' may remain
            os.rmdir(os.path.dirname(scratch))
        return 0
    table = write_summary(
        args, experiment, task_runs.summarize(runs, experiment), task_runs.format_table
    )
    print(f"\n{table}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
