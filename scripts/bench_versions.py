"""The VR update of this checkout against the same update at another commit,
in one process (docs/RESULTS.md, "The VR update before and after a change").

    python scripts/bench_versions.py --commit 2d21554
    python scripts/bench_versions.py --commit HEAD~3 --models encoder --pairs Adam
    python scripts/bench_versions.py --commit HEAD~1 --models resnet50 --pairs LAMB \
        --gsnr-interval 16 --kind "train step"

The package as it was at `--commit` is copied out of git (`git archive`)
under another name, so that both versions import side by side; each pair
then times Keras' base optimizer, the VR twin of that commit and this
checkout's VR twin on their own copies of the model, `optimizer.apply` on
fixed per-replica gradients (`timing.Candidate`), interleaved repetition by
repetition, and prints the medians and the ratio new / old. Both twins
take the same `--gsnr-interval` and `--no-xla`; `--kind "train step"`
times the whole training step instead, and `--kind "first step"` the
first training step of fresh candidates (trace, graph optimisation, XLA
compilation, the run; `timing.first_step_times`), one round of every
candidate per `--repeats`.
"""

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAIRS = ("Momentum", "Adam", "LAMB", "LARS")  # benchmark.pairs() with a VR twin


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", required=True, help="the git revision to compare with")
    parser.add_argument(
        "--models",
        nargs="+",
        default=["encoder", "resnet50"],
        choices=["encoder", "resnet50", "thin_mlp"],
        help="thin_mlp: 214 variables of at most 256 elements (the per-variable cost alone)",
    )
    parser.add_argument("--pairs", nargs="+", default=["Adam", "LAMB"], choices=PAIRS)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--batch-per-replica", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="updates per timed repetition")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--gsnr-interval",
        type=int,
        default=1,
        help="both twins' gsnr_interval (N > 1: repetitions and warm-up of whole cycles)",
    )
    parser.add_argument("--no-xla", action="store_true", help="both twins with jit_update=False")
    parser.add_argument(
        "--control",
        action="store_true",
        help="also time a second copy of the other commit's twin: its ratio to the first "
        "is the run's noise floor for this/other",
    )
    parser.add_argument(
        "--kind",
        default="update",
        choices=("update", "train step", "first step"),
        help="what is timed",
    )
    args = parser.parse_args(argv)
    if args.gsnr_interval < 1:
        parser.error("--gsnr-interval must be >= 1")
    return args


def import_at(commit, folder):
    """The `tf_vrgd` package of `commit`, imported as `tf_vrgd_at_commit`
    from a copy in `folder`."""
    import importlib

    name = "tf_vrgd_at_commit"
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", commit, "tf_vrgd"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    os.rename(os.path.join(folder, "tf_vrgd"), os.path.join(folder, name))
    for directory, _, files in os.walk(os.path.join(folder, name)):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(directory, file)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(re.sub(r"\btf_vrgd\b", name, text))
    sys.path.insert(0, folder)
    return importlib.import_module(name)


def main(argv=None):
    args = parse_args(argv)
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * args.replicas
        )
    import numpy as np

    import tf_vrgd
    from tf_vrgd.experiments import bench_models, benchmark, timing

    with tempfile.TemporaryDirectory() as folder:
        old = import_at(args.commit, folder)
        devices = [f"/gpu:{i}" for i in range(len(gpus))] or [
            f"/cpu:{i}" for i in range(args.replicas)
        ]
        strategy = tf.distribute.MirroredStrategy(devices)
        benchmark.warm_up_runtime(strategy, {})
        factories = {
            "encoder": bench_models.encoder,
            "resnet50": bench_models.resnet50,
            "thin_mlp": bench_models.thin_mlp,
        }
        rng = np.random.default_rng(0)
        twin_fields = {}
        if args.gsnr_interval > 1:
            twin_fields["gsnr_interval"] = args.gsnr_interval
        if args.no_xla:
            twin_fields["jit_update"] = False
        label = "".join(f" {k}={v}" for k, v in twin_fields.items())
        # Whole cycles of N updates per repetition and in the warm-up, so
        # that every repetition holds the same share of GSNR updates.
        n = args.gsnr_interval
        steps = -(-args.steps // n) * n
        warmup = max(3, n)
        for model_name in args.models:
            batch = bench_models.make_batch(
                model_name, args.batch_per_replica * strategy.num_replicas_in_sync, rng
            )
            for pair in args.pairs:
                base, _, _ = benchmark.pairs()[pair]
                _, old_twin, _ = benchmark.pairs(old)[pair]
                _, new_twin, _ = benchmark.pairs(tf_vrgd)[pair]
                makers = {
                    name: functools.partial(make, **fields)
                    for name, make, fields in (
                        ("base", base, {}),
                        ("old", old_twin, twin_fields),
                        ("new", new_twin, twin_fields),
                        *([("old again", old_twin, twin_fields)] if args.control else []),
                    )
                }
                if args.kind == "first step":
                    s, _ = timing.first_step_times(
                        makers, factories[model_name], strategy, batch, rounds=args.repeats
                    )
                else:
                    candidates = [
                        timing.Candidate(name, make, factories[model_name], strategy, batch)
                        for name, make in makers.items()
                    ]
                    s = timing.compare(candidates, args.kind, steps, args.repeats, warmup=warmup)
                    del candidates
                # The control: the same twin built twice, whose ratio only
                # the machine's noise moves from 1.
                control = (
                    f"  {args.commit} again/{args.commit} {s['old again'] / s['old']:.3f}"
                    if args.control
                    else ""
                )
                print(
                    f"{model_name:<9} {pair:<9} {args.kind}{label}: "
                    f"base {s['base'] * 1e3:8.1f} ms  "
                    f"{args.commit} {s['old'] * 1e3:8.1f} ms ({s['old'] / s['base']:.2f}x)  "
                    f"this {s['new'] * 1e3:8.1f} ms ({s['new'] / s['base']:.2f}x)  "
                    f"this/{args.commit} {s['new'] / s['old']:.3f}{control}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
