"""Step cost of each VR optimizer (and LARC) against its base, side by side.

    python scripts/bench_step.py                     # everything
    python scripts/bench_step.py --pairs Adam --kinds update --models mlp
    python scripts/bench_step.py --models resnet50 encoder --setups mirrored \
        --pairs Adam LAMB --kinds "train step" --gsnr-intervals 1 4 16

Prints, per model and device set-up, the median seconds per call of each
optimizer (interleaved repetitions, one process), the VR/base ratios, the
XLA/non-XLA ratio of the VR update (and, with --statistics, the cost of
tracking the GSNR statistics), and the achieved memory traffic of each
update against the machine's copy bandwidth. See `tf_vrgd/experiments/benchmark.py`.
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--replicas",
        type=int,
        default=4,
        help="logical CPU replicas (or GPUs, if present) for the mirrored set-up",
    )
    parser.add_argument(
        "--accumulation",
        type=int,
        default=4,
        help="micro-steps per update in the one-device set-up",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=["mlp", "cnn", "resnet50", "encoder"],
        choices=["mlp", "thin_mlp", "cnn", "resnet50", "encoder", "tables"],
        help="thin_mlp: --thin-mlp-layers Dense layers of --thin-mlp-width units (82 "
        "variables by default); tables: 26 embedding tables of 1000 x 16 and a "
        "two-layer head (DLRM's categorical side, row-sparse gradients)",
    )
    parser.add_argument(
        "--setups",
        nargs="+",
        default=["mirrored", "accumulation"],
        choices=["mirrored", "accumulation"],
    )
    parser.add_argument(
        "--pairs",
        nargs="+",
        default=None,
        help="subset of: Momentum Adam LAMB LARS LARC NoiseScale AdaScale",
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=["first step", "update", "train step"],
        choices=["first step", "update", "train step"],
    )
    parser.add_argument(
        "--batch", type=int, default=256, help="global batch of the mlp and cnn train step"
    )
    parser.add_argument(
        "--batch-per-replica",
        type=int,
        default=8,
        help="batch per replica (per micro-step) of resnet50 and encoder",
    )
    parser.add_argument(
        "--first-step-rounds",
        type=int,
        default=3,
        help="interleaved rounds of fresh candidates for the first step",
    )
    parser.add_argument("--steps", type=int, default=5, help="calls per timed repetition")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repetitions")
    parser.add_argument("--mlp-parameters", type=int, default=10_000_000)
    parser.add_argument("--thin-mlp-layers", type=int, default=41)
    parser.add_argument("--thin-mlp-width", type=int, default=32)
    parser.add_argument(
        "--statistics",
        action="store_true",
        help="also time each VR optimizer with track_gsnr_statistics=True",
    )
    parser.add_argument(
        "--gsnr-intervals",
        type=int,
        nargs="+",
        default=[1],
        help="also time each VR twin with gsnr_interval = N for every N > 1 listed",
    )
    parser.add_argument(
        "--logical-gpus",
        type=int,
        default=0,
        help="split GPU 0 into this many logical GPUs for the mirrored set-up (one GPU: "
        "replicas for a VR twin; all-reduces then run through one device)",
    )
    parser.add_argument(
        "--logical-gpu-memory", type=int, default=32768, help="MiB of each logical GPU"
    )
    parser.add_argument(
        "--image-size", type=int, default=32, help="resnet50's input side (ImageNet: 224)"
    )
    parser.add_argument("--json", default=None, help="also write the measured rows to this file")
    parser.add_argument(
        "--own-base",
        action="store_true",
        help="also time this package's own base rule where the base is Keras' "
        "(tf_vrgd.LAMB beside keras.optimizers.Lamb)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="also time a second copy of each base: its ratio to the base is the run's "
        "noise floor for a ratio",
    )
    parser.add_argument(
        "--no-xla",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time each VR twin (each N) without XLA too (--no-no-xla skips it)",
    )
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)

    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    logical, memory = args.logical_gpus, args.logical_gpu_memory
    del args.logical_gpus, args.logical_gpu_memory
    if gpus and logical:
        tf.config.set_logical_device_configuration(
            gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=memory)] * logical
        )
        gpus = tf.config.list_logical_devices("GPU")
        args.reduce_to_one_device = True
    if not gpus:
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * args.replicas
        )

    from tf_vrgd.experiments import benchmark

    output = args.json
    del args.json
    rows = benchmark.run(benchmark.Settings(**vars(args)), gpus)
    if output:
        import json

        with open(output, "w") as f:
            json.dump({"settings": vars(args), "gpus": len(gpus), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
