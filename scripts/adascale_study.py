"""AdaScale against the linear scaling rule and VR-Momentum on Fashion-MNIST.

    python scripts/adascale_study.py --output runs/adascale --scales 8 --seeds 0 1 2
    python scripts/adascale_study.py --output runs/adascale --report

The base is `configs/fashion_mnist/momentum_b256.yaml`: SGD with momentum
0.9 at batch 256, a one-epoch warm-up, then cosine decay over 10 epochs
(2340 updates). At S times that batch, each seed trains:

- `linear`: the linear scaling rule with warm-up: the rate times S, the
  same schedule in epochs (10, the first a warm-up);
- `adascale`: `tf_vrgd.AdaScale(scale=S)` on the base's schedule, read at
  the scale-invariant step tau, until tau reaches the base's length;
- `vr_momentum`: `configs/fashion_mnist/vr_momentum_b<batch>.yaml`, the
  grid's best rate at that batch (`scripts/sweep.py`);

and the base itself. Every run is `vrgd-train`'s (4 replicas). The report
prints, per arm, the final test accuracy (mean and 95% interval over the
seeds, Student t), the updates taken and the wall time, and plots
AdaScale's gain over training (`adascale_gain.png` in --output).
"""

import argparse
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs", "fashion_mnist")
BASE_BATCH, BASE_STEPS, BASE_RATE = 256, 2340, 0.05
# Two-sided 95% quantiles of Student's t by degrees of freedom.
T_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--scales", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=["base", "linear", "adascale", "vr_momentum"])
    parser.add_argument("--report", action="store_true", help="only print the table and plot")
    return parser.parse_args(argv)


def arm_overrides(arm, scale):
    """(config file, {dotted key: value}) of one arm at batch 256 x scale."""
    batch = BASE_BATCH * scale
    per_epoch = 60000 // batch
    batches = {
        "task.train_data.global_batch_size": batch,
        "task.validation_data.global_batch_size": batch,
    }
    base = os.path.join(CONFIGS, "momentum_b256.yaml")
    if arm == "base":
        return base, {}
    if arm == "vr_momentum":
        return os.path.join(CONFIGS, f"vr_momentum_b{batch}.yaml"), {}
    schedule = "trainer.optimizer_config.learning_rate.cosine"
    if arm == "linear":
        steps = 10 * per_epoch
        return base, {
            **batches,
            "trainer.train_steps": steps,
            f"{schedule}.initial_learning_rate": BASE_RATE * scale,
            f"{schedule}.decay_steps": steps,
            "trainer.optimizer_config.warmup.linear.warmup_steps": per_epoch,
        }
    if arm == "adascale":
        # Whole epochs of at least the base's updates: the schedule is the
        # base's, unrescaled; tau ends the run before the last epoch.
        epochs = math.ceil(BASE_STEPS / per_epoch)
        inner = {"type": "sgd", "sgd": {"momentum": 0.9}}
        return base, {
            **batches,
            "trainer.train_steps": epochs * per_epoch,
            "trainer.optimizer_config.optimizer": {
                "type": "adascale",
                "adascale": {"scale": scale, "optimizer": inner},
            },
        }
    raise ValueError(f"unknown arm {arm!r}")


def run_name(arm, scale, seed):
    return f"{arm}_s1_seed{seed}" if arm == "base" else f"{arm}_s{scale}_seed{seed}"


def train(output, arm, scale, seed):
    config, overrides = arm_overrides(arm, scale)
    command = [
        sys.executable,
        "-m",
        "tf_vrgd.experiments.train",
        "--config",
        config,
        "--output",
        os.path.join(output, run_name(arm, scale, seed)),
        "--seed",
        str(seed),
        "--verbose",
        "0",
    ]
    for key, value in overrides.items():
        command += ["--override", f"{key}={json.dumps(value)}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    subprocess.run(command, check=True, env=env)


def records(output, name):
    """The records of a run's one run folder, or None before it has any."""
    folder = os.path.join(output, name)
    if not os.path.isdir(folder):
        return None
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry, "metrics.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                return [json.loads(line) for line in f]
    return None


def interval(values):
    """(mean, half-width of the 95% interval) over seeds."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, T_95.get(n - 1, 1.96) * sd / math.sqrt(n)


def report(args):
    rows = []
    arms = [("base", 1)] + [(a, s) for s in args.scales for a in args.arms if a != "base"]
    for arm, scale in arms:
        runs = [records(args.output, run_name(arm, scale, seed)) for seed in args.seeds]
        runs = [r for r in runs if r]
        if not runs:
            continue
        accuracy = interval([100 * r[-1]["test_accuracy"] for r in runs])
        updates = interval([r[-1].get("updates", float("nan")) for r in runs])
        minutes = interval([sum(e["seconds"] for e in r) / 60 for r in runs])
        rows.append((arm, scale, len(runs), accuracy, updates, minutes))
    print(
        f"{'arm':<12} {'batch':>6} {'seeds':>5} {'test accuracy %':>17} {'updates':>8} {'min':>6}"
    )
    for arm, scale, n, (acc, half), (upd, _), (mins, _) in rows:
        batch = BASE_BATCH * scale
        print(f"{arm:<12} {batch:>6} {n:>5} {acc:>9.2f} ± {half:<5.2f} {upd:>8.0f} {mins:>6.1f}")
    plot_gains(args)


def plot_gains(args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    for scale in args.scales:
        for seed in args.seeds:
            runs = records(args.output, run_name("adascale", scale, seed))
            if not runs:
                continue
            tau = [r.get("scale_invariant_steps", float("nan")) for r in runs]
            gain = [r.get("adascale_gain", float("nan")) for r in runs]
            axis.plot(tau, gain, label=f"S = {scale}, seed {seed}")
    axis.set_xlabel("scale-invariant step tau (base-batch updates)")
    axis.set_ylabel("gain r at the epoch's end")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(os.path.join(args.output, "adascale_gain.png"), dpi=120)


def main(argv=None):
    args = parse_args(argv)
    if not args.report:
        os.makedirs(args.output, exist_ok=True)
        for seed in args.seeds:
            for scale in args.scales:
                for arm in args.arms:
                    if arm == "base" and scale != args.scales[0]:
                        continue
                    train(args.output, arm, scale, seed)  # resumes, or returns when done
    report(args)


if __name__ == "__main__":
    main()
