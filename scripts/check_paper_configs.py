"""Starts training every experiment of configs/paper, in one process: each
task at a tiny size (`tasks.TINY_SIZES`), its config's optimizer exactly as the file
gives it (type, fields, accumulation, schedule), on `--synthetic` input,
for `--updates` updates under `--replicas` replicas, through `vrgd-train`'s
own run (`task_runs.train_task_run`, into a temporary folder). Prints one
line per file and exits non-zero if any fails to train or gives a
non-finite loss.

    python scripts/check_paper_configs.py              # all files, 2 replicas
    python scripts/check_paper_configs.py --match dlrm
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER = os.path.join(ROOT, "configs", "paper")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--match", default="", help="only files whose name contains this")
    args = parser.parse_args(argv)

    from tf_vrgd.experiments import distribution, experiment_config

    devices = distribution.setup_devices(args.replicas)
    import keras
    import tensorflow as tf

    from tf_vrgd import config
    from tf_vrgd.experiments import task_runs, tasks

    strategy = tf.distribute.MirroredStrategy(devices)
    failures = 0
    for name in sorted(os.listdir(PAPER)):
        if args.match not in name:
            continue
        cfg = config.load(os.path.join(PAPER, name))
        kind = cfg["task"]["model"]["type"]
        overrides = dict(tasks.TINY_SIZES[kind])
        if kind == "resnet" and cfg["task"]["model"]["resnet"]["model_id"] == 50:
            overrides = {"task.model.input_size": [32, 32, 3]}  # ResNet-50, small images
        # The smallest batch that splits into the file's micro-steps and replicas.
        steps = config.accumulation_steps(cfg)
        overrides["task.train_data.global_batch_size"] = 2 * steps * args.replicas
        cfg = experiment_config.apply_overrides(
            cfg, [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
        )
        start = time.perf_counter()
        try:
            keras.backend.clear_session()
            experiment = task_runs.TaskExperiment(
                cfg, train_steps=args.updates, replicas=args.replicas, synthetic=True
            )
            with tempfile.TemporaryDirectory() as run_dir:
                records = task_runs.train_task_run(
                    name, experiment.block, experiment, strategy, run_dir, verbose=0
                )
            loss, updates = records[-1]["train_loss"], records[-1]["updates"]
            ok = math.isfinite(loss) and updates == args.updates
            detail = f"loss {loss:.4g}, {updates} updates of {experiment.accumulation} step(s)"
        except Exception as error:  # reported per file, then the run goes on
            ok, detail = False, f"{type(error).__name__}: {error}"[:300]
        failures += not ok
        seconds = time.perf_counter() - start
        print(f"{'ok  ' if ok else 'FAIL'} {name:<48} {seconds:5.1f} s  {detail}", flush=True)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
