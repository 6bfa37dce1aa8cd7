"""Resumable grids of Fashion-MNIST runs (`scripts/sweep.py`,
`scripts/study.py`): each run's experiment derived from its config in
`configs/fashion_mnist`, trained, and kept as one JSON line in a results
file, so that a rerun skips what is done (and `fashion_mnist.train_run`
resumes an unfinished run from its last checkpoint)."""

import json
import math
import os
import statistics


def load_results(path, key):
    """`{key(row): row}` of the rows in the JSONL file at `path` ({} if none)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {key(r): r for r in rows}


def fashion_setup(replicas, data_dir=None, cache_dir=None):
    """The MirroredStrategy over `replicas` devices (logical CPUs without a
    GPU; must run before TensorFlow starts) and the Fashion-MNIST arrays."""
    from tf_vrgd.experiments import distribution

    devices = distribution.setup_devices(replicas)
    import tensorflow as tf

    from tf_vrgd.experiments import data

    arrays = data.load(data_dir, cache_dir)
    return tf.distribute.MirroredStrategy(devices), arrays


class Grid:
    """The runs of a grid in folder `output`: their result rows in
    `results.jsonl` (`results`: key -> row, `key(run)` naming a run), each
    run's folder under `runs/`."""

    def __init__(self, output, key):
        os.makedirs(output, exist_ok=True)
        self.output = output
        self.key = key
        self.path = os.path.join(output, "results.jsonl")
        self.results = load_results(self.path, key)

    def run_dir(self, run):
        return os.path.join(self.output, "runs", self.key(run))

    def run_missing(self, runs, train_one, describe):
        """Trains each run of `runs` whose row is missing with `train_one(run)
        -> row`, appends the row to the results file and to `results`, and
        prints `describe(key, row)`."""
        for run in runs:
            run_key = self.key(run)
            if run_key in self.results:
                continue
            row = train_one(run)
            self.results[run_key] = row
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(describe(run_key, row), flush=True)


def train(run, experiment, strategy, arrays, run_dir):
    """Trains (or resumes) one run of `experiment` in `run_dir`, in a fresh
    Keras session; returns its `result_row`."""
    import keras

    from tf_vrgd.experiments import fashion_mnist

    keras.backend.clear_session()  # fresh layer names and graph state per run
    records = fashion_mnist.train_run(
        run["optimizer"], experiment.block, experiment, strategy, arrays, run_dir, verbose=0
    )
    return result_row(run, records)


def config_path(folder, optimizer, batch):
    """The config of `optimizer` (its config name: `adam`, `vr_adam`, ...) at
    global batch `batch` in `folder` (a checkout's configs/fashion_mnist)."""
    return os.path.join(folder, f"{optimizer}_b{batch}.yaml")


def experiment(
    folder,
    optimizer,
    batch,
    *,
    epochs,
    seed,
    replicas,
    lr_multiplier=1.0,
    width=None,
    accumulation=1,
    optimizer_fields=None,
    noise_scale=False,
):
    """The `fashion_mnist.Experiment` of one grid run: the config of
    `optimizer` at `batch`, with the CNN's `width` if given, its optimizer's
    `optimizer_fields` added, and with `accumulation` > 1 an update of
    `accumulation` steps of batch / accumulation (the schedule counts
    updates, so it and the rate stay the config's); then trained for
    `epochs` with `seed`, every rate times `lr_multiplier`. With
    `noise_scale`, an optimizer outside the VR family is wrapped in a
    `noise_scale` block (the same updates, and the noise scale logged)."""
    from tf_vrgd import config
    from tf_vrgd.experiments import fashion_mnist

    cfg = config.load(config_path(folder, optimizer, batch))
    if width is not None:
        cfg["task"]["model"]["width"] = width
    fields = {}
    if accumulation > 1:
        if batch % accumulation:
            raise ValueError(f"Batch {batch} does not split into {accumulation} steps.")
        cfg["task"]["train_data"]["global_batch_size"] = batch // accumulation
        fields["gradient_accumulation_steps"] = accumulation
    fields.update(optimizer_fields or {})
    if fields:
        block = cfg["trainer"]["optimizer_config"]["optimizer"]
        kind = block["type"]  # vr_momentum's type is vr_sgd
        block[kind] = {**(block.get(kind) or {}), **fields}
    optimization = cfg["trainer"]["optimizer_config"]
    if noise_scale and not optimization["optimizer"]["type"].startswith("vr_"):
        optimization["optimizer"] = {
            "type": "noise_scale",
            "noise_scale": {"optimizer": optimization["optimizer"]},
        }
    return fashion_mnist.Experiment(
        cfg, epochs=epochs, seed=seed, replicas=replicas, lr_multiplier=lr_multiplier
    )


def experiment_of_run(folder, run, args, name=None, **options):
    """`experiment` of one grid `run` (its optimizer, or `name`, its batch,
    seed and rate multiplier) with a script's `args` (its epochs and
    replicas); `options` are `experiment`'s other keywords."""
    return experiment(
        folder,
        name or run["optimizer"],
        run["batch"],
        epochs=args.epochs,
        seed=run["seed"],
        replicas=args.replicas,
        lr_multiplier=run["lr_multiplier"],
        **options,
    )


def result_row(run, records):
    """A results line: the run's fields and what its epoch records say (best
    and final accuracies, final losses and gap, divergence, time, and for a
    VR optimizer its GSNR statistics averaged over the epochs)."""
    last = records[-1]
    row = {
        **run,
        "epochs": len(records),
        "best_test_accuracy": max(r["test_accuracy"] for r in records),
        "final_test_accuracy": last["test_accuracy"],
        "final_train_accuracy": last["train_accuracy"],
        "generalization_gap": last["generalization_gap"],
        "final_train_loss": last["train_loss"],
        "final_test_loss": last["test_loss"],
        "diverged": not all(math.isfinite(r["train_loss"]) for r in records),
        "seconds": sum(r["seconds"] for r in records),
    }
    row.update(scale_means(records))
    if any("noise_scale" in r for r in records):
        row["noise_scale_per_epoch"] = [r.get("noise_scale", math.nan) for r in records]
    return row


def scale_means(records):
    """Model-wide (element-weighted) per-epoch GSNR statistics averaged over
    the epochs that had a GSNR update (with `gsnr_interval` above the
    updates per epoch, some epochs have none, and their statistics are
    NaN); empty for a base optimizer."""
    means = {}
    for column in ("gsnr_scale", "gsnr_at_gamma", "gsnr_at_one"):
        values = [r[column] for r in records if math.isfinite(r.get(column, math.nan))]
        if values:
            means[f"mean_{column}"] = statistics.fmean(values)
    return means
