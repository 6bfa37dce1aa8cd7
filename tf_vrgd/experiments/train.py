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

The paper's tasks (BERT, ResNet, DLRM configs) train in
`tf_vrgd.experiments.task_runs`; with `TF_CONFIG` set, on several machines
under `MultiWorkerMirroredStrategy` (the same command on every worker).
"""

import argparse
import contextlib
import copy
import csv
import json
import math
import numbers
import os
import shutil
import sys
import time

EVAL_TRAIN_EXAMPLES = 10000  # train-set examples evaluated each epoch (fixed subset)


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
        "--worker-timeout",
        type=_positive_int,
        default=600,
        help="with TF_CONFIG: seconds to wait for every task of the cluster to "
        "connect before giving up (default 600)",
    )
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def setup_devices(replicas):
    """Splits the CPU into `replicas` logical devices when there is no GPU;
    returns the MirroredStrategy device list. Must run before TF starts."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if replicas > len(gpus):
            raise ValueError(f"--replicas {replicas} but only {len(gpus)} GPU(s) here.")
        return [f"/gpu:{i}" for i in range(replicas)]
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * replicas
    )
    return [f"/cpu:{i}" for i in range(replicas)]


# --- experiment config -------------------------------------------------------


def _get(cfg, path, default=None):
    for key in path.split("."):
        if not isinstance(cfg, dict) or key not in cfg:
            return default
        cfg = cfg[key]
    return cfg


def steps_per_epoch(batch_size, examples=60000):
    return examples // batch_size


def rescale_schedule(block, step_factor, lr_factor):
    """The optimization block with every step count (decay_steps,
    warmup_steps, boundaries, offset) multiplied by `step_factor` and every
    learning rate by `lr_factor`."""
    block = copy.deepcopy(block)
    step_keys = ("decay_steps", "warmup_steps", "offset")
    rate_keys = (
        "learning_rate",
        "initial_learning_rate",
        "end_learning_rate",
        "warmup_learning_rate",
    )
    for section in ("learning_rate", "warmup"):
        kind = _get(block, f"{section}.type")
        fields = _get(block, f"{section}.{kind}") if kind else None
        if not fields:
            continue
        for key in step_keys:
            if isinstance(fields.get(key), numbers.Real) and fields[key]:
                fields[key] = max(1, round(fields[key] * step_factor))
        if isinstance(fields.get("boundaries"), list):
            fields["boundaries"] = [
                max(1, round(b * step_factor)) if isinstance(b, numbers.Real) else b
                for b in fields["boundaries"]
            ]
        # Values that are not numbers are left to the optimization block's
        # checks, which name the field.
        for key in rate_keys:
            if isinstance(fields.get(key), numbers.Real):
                fields[key] = fields[key] * lr_factor
        if isinstance(fields.get("values"), list):
            fields["values"] = [
                v * lr_factor if isinstance(v, numbers.Real) else v for v in fields["values"]
            ]
    return block


class Experiment:
    """The parts of an experiment config that `vrgd-train` uses, with
    overrides applied (None keeps the config's value).

    Args:
        cfg: The experiment (a dict, as `tf_vrgd.config.load` returns it).
        batch_size: Global batch; the learning rates scale by
            ``sqrt(batch_size / config batch)``.
        epochs: Epochs; the schedule's step counts follow the new total.
        seed: Seed of the initial weights and the data order.
        replicas: MirroredStrategy replicas.
        train_examples: Train on the first N training examples only.
    """

    def __init__(
        self, cfg, *, batch_size=None, epochs=None, seed=None, replicas=None, train_examples=None
    ):
        from tf_vrgd import config
        from tf_vrgd.experiments import fields

        self.cfg = fields.check(cfg)
        model = _get(cfg, "task.model", {}) or {}
        if model.get("type", "fashion_mnist_cnn") != "fashion_mnist_cnn":
            raise ValueError(
                f"vrgd-train builds `fashion_mnist_cnn` models only; this config's "
                f"task.model.type is {model.get('type')!r} (a GPU-cluster experiment: "
                "use its optimization block with tf_vrgd.config.optimizer_from_config)."
            )
        self.model_width = int(model.get("width", 32))
        self.label_smoothing = float(_get(cfg, "task.losses.label_smoothing", 0.0) or 0.0)
        block = config.optimization_block(cfg)
        # Schedules count updates; with accumulation an update takes A batches.
        accumulation = config.accumulation_steps(block)
        config_batch = int(_get(cfg, "task.train_data.global_batch_size", 256))
        config_steps = int(
            _get(cfg, "trainer.train_steps", 10 * steps_per_epoch(config_batch) // accumulation)
        )
        config_epochs = max(1, round(config_steps * accumulation / steps_per_epoch(config_batch)))
        self.batch_size = batch_size or config_batch
        self.epochs = epochs or config_epochs
        self.seed = seed if seed is not None else int(_get(cfg, "runtime.seed", 0) or 0)
        self.replicas = replicas or int(_get(cfg, "runtime.num_gpus", 1) or 1)
        if self.batch_size % self.replicas:
            raise ValueError(
                f"The global batch {self.batch_size} does not split over {self.replicas} replicas."
            )
        self.train_examples = train_examples or 60000
        if self.train_examples > 60000:
            raise ValueError(
                f"--train-examples must be at most 60000. Received: {self.train_examples}"
            )
        self.steps_per_epoch = steps_per_epoch(self.batch_size, self.train_examples)
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"Batch {self.batch_size} exceeds the {self.train_examples} training examples."
            )
        total = self.epochs * self.steps_per_epoch // accumulation
        step_factor = total / config_steps
        lr_factor = math.sqrt(self.batch_size / config_batch)
        self.rescaled = abs(step_factor - 1) > 1e-9 or abs(lr_factor - 1) > 1e-9
        self.block = rescale_schedule(block, step_factor, lr_factor) if self.rescaled else block
        # The schedule's fields, checked before any device is set up.
        config.learning_rate_from_config(self.block)
        self.note = (
            f"schedule rescaled from {config_steps} to {total} steps, learning rates x "
            f"{lr_factor:.4g} (square-root scaling from batch {config_batch})"
            if self.rescaled
            else ""
        )

    @classmethod
    def from_args(cls, cfg, args):
        """From `vrgd-train`'s parsed command line."""
        return cls(
            cfg,
            batch_size=args.batch_size,
            epochs=args.epochs,
            seed=args.seed,
            replicas=args.replicas,
            train_examples=args.train_examples,
        )

    def settings(self, compare):
        """What a run folder's results depend on: the config and every
        setting that changes the training, recorded at the first start and
        compared at each resume."""
        return {
            "config": self.cfg,
            "batch_size": self.batch_size,
            "epochs": self.epochs,
            "seed": self.seed,
            "replicas": self.replicas,
            "train_examples": self.train_examples,
            "compare": bool(compare),
        }

    def runs(self, compare):
        return runs_of(self.block, compare)


def runs_of(block, compare):
    """[(run name, optimization block)]: the config's, then its twin."""
    from tf_vrgd.experiments import twins

    runs = [(block["optimizer"]["type"], block)]
    if compare:
        twin = twins.twin_block(block)
        runs.append((twin["optimizer"]["type"], twin))
    return runs


def apply_overrides(cfg, overrides):
    """`cfg` with each ``DOTTED.KEY=VALUE`` set (VALUE read as YAML); the
    missing blocks on the way are created."""
    import yaml

    cfg = copy.deepcopy(cfg)
    for override in overrides:
        path, sep, text = override.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise ValueError(f"--override takes DOTTED.KEY=VALUE. Received: {override!r}")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ValueError(f"--override {override!r}: the value is not YAML ({error}).") from None
        node = cfg
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ValueError(
                    f"--override {override!r}: {'.'.join(keys[: depth + 1])} is a value, "
                    "not a block."
                )
            node = child
        node[keys[-1]] = value
    return cfg


# --- one run -------------------------------------------------------------------


def read_records(path, before_epoch):
    """The metrics records of epochs < `before_epoch` (a resumed run drops
    any record written after its last checkpoint)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r["epoch"] < before_epoch]


def _replace(path, write):
    """Writes through `write(file)` to a temporary file, then renames it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        write(f)
    os.replace(tmp, path)


def write_records(run_dir, records):
    """metrics.jsonl and metrics.csv, each replaced whole."""
    _replace(
        os.path.join(run_dir, "metrics.jsonl"),
        lambda f: f.writelines(json.dumps(r) + "\n" for r in records),
    )
    keys = []
    for r in records:
        keys += [k for k in r if k not in keys]

    def table(f):
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(records)

    _replace(os.path.join(run_dir, "metrics.csv"), table)


def _checkpoints(run_dir):
    """{completed epochs: path} of the run's checkpoints."""
    found = {}
    for name in os.listdir(run_dir):
        if name.startswith("checkpoint-epoch") and name.endswith(".keras"):
            found[int(name[len("checkpoint-epoch") : -len(".keras")])] = os.path.join(run_dir, name)
    return found


def resumable_checkpoints(run_dir, name):
    """{completed epochs: path} of the run's checkpoints, the unreadable ones
    (an empty or truncated file: a full disk, a copy cut short) left out,
    each named in a printed line; {} where `run_dir` does not exist."""
    if not os.path.isdir(run_dir):
        return {}
    checkpoints = _checkpoints(run_dir)
    for epochs in sorted(checkpoints, reverse=True):
        problem = _checkpoint_problem(checkpoints[epochs])
        if not problem:
            break
        print(
            f"[{name}] {checkpoints.pop(epochs)} is unreadable ({problem}); "
            "resuming from the newest intact checkpoint before it, if any",
            flush=True,
        )
    return checkpoints


def _checkpoint_problem(path):
    """Why the `.keras` file (a zip archive) at `path` cannot be read; ""
    if every member reads back with its checksum."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        return f"{type(error).__name__}: {error}"
    return f"member {bad} fails its checksum" if bad else ""


def remove_partial_checkpoints(run_dir):
    """Removes the `tmp<pid>.keras` files that `save_checkpoint` leaves when
    killed while writing (one process trains a run folder at a time)."""
    for entry in os.listdir(run_dir):
        if entry.startswith("tmp") and entry.endswith(".keras"):
            os.remove(os.path.join(run_dir, entry))


def save_checkpoint(model, run_dir, epochs_done, keep=1):
    """Model and optimizer after `epochs_done` epochs, written under a
    temporary name and renamed (a kill leaves the previous one intact); all
    but the newest `keep` checkpoints are removed afterwards."""
    path = os.path.join(run_dir, f"checkpoint-epoch{epochs_done}.keras")
    tmp = os.path.join(run_dir, f"tmp{os.getpid()}.keras")
    model.save(tmp)
    os.replace(tmp, path)
    for epochs, old in _checkpoints(run_dir).items():
        if epochs <= epochs_done - keep:
            os.remove(old)


def gsnr_entries(model, vr_optimizer):
    """`{"<log key>/<variable path>": value}` of the VR optimizer's GSNR
    statistics since the epoch began (GSNRMonitor resets them at epoch
    start); empty without a VR optimizer."""
    from tf_vrgd import statistics

    entries = {}
    if vr_optimizer is None:
        return entries
    for path, stats in vr_optimizer.gsnr_statistics().items():
        # A loaded model's paths lack the model-name prefix of a fresh one;
        # keys must not change when a run resumes.
        path = path.removeprefix(f"{model.name}/")
        for column, key in statistics.LOG_KEYS.items():
            entries[f"{key}/{path}"] = stats[column]
    return entries


def _epoch_callback(model, vr_optimizer, run_dir, records, evaluate):
    import keras

    class EpochEnd(keras.callbacks.Callback):
        """Evaluates, records the epoch's metrics, then checkpoints."""

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.time()

        def on_epoch_end(self, epoch, logs=None):
            seconds = time.time() - self.start
            logs = dict(logs or {})
            train = evaluate("train")
            test = evaluate("test")
            record = {
                "epoch": epoch,
                "train_loss": train[0],
                "train_accuracy": train[1],
                "test_loss": test[0],
                "test_accuracy": test[1],
                "generalization_gap": train[1] - test[1],
                "loss_gap": test[0] - train[0],
                "running_train_loss": float(logs.get("loss", float("nan"))),
                "learning_rate": float(model.optimizer.learning_rate.numpy()),
                "seconds": seconds,
            }
            record.update({k: float(v) for k, v in logs.items() if k.startswith("gsnr")})
            record.update(gsnr_entries(model, vr_optimizer))
            records.append(record)
            write_records(run_dir, records)
            # The checkpoint comes last: a run killed before it redoes this epoch.
            save_checkpoint(model, run_dir, epoch + 1)

    return EpochEnd()


SETTINGS_FILE = "settings.json"


def check_settings(output, settings, restart, write=True):
    """Records `settings` in `output` (if `write`), or checks them against
    the ones a previous start recorded there: a resume must continue the
    same run. With `restart`, the folder's earlier results are discarded
    instead."""
    path = os.path.join(output, SETTINGS_FILE)
    if restart:
        for entry in os.listdir(output):
            run_dir = os.path.join(output, entry)
            if os.path.isdir(run_dir) and (
                _checkpoints(run_dir) or os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
            ):
                shutil.rmtree(run_dir)
        if os.path.exists(path):
            os.remove(path)
    if os.path.exists(path):
        with open(path) as f:
            recorded = json.load(f)
        from tf_vrgd.experiments import fields

        # Compared field by field (dotted paths into nested blocks), so that
        # the message names the fields that changed, not the whole config.
        recorded = fields.leaves(recorded)
        settings = fields.leaves(json.loads(json.dumps(settings)))  # as JSON reads it back
        missing = "(unset)"
        changed = sorted(
            k
            for k in set(recorded) | set(settings)
            if recorded.get(k, missing) != settings.get(k, missing)
        )
        if changed:
            details = "; ".join(
                f"{k}: {_short(recorded.get(k, missing))} then, "
                f"{_short(settings.get(k, missing))} now"
                for k in changed
            )
            raise SystemExit(
                f"vrgd-train: {output} holds a run started with other settings ({details}). "
                "Resuming would continue that run with these settings. Use a new --output, "
                "or pass --restart to discard the folder's results and start over."
            )
        return
    if write:
        _replace(path, lambda f: json.dump(settings, f, indent=2, sort_keys=True))


def _short(value):
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def check_runs(experiment, compare):
    """Builds each run's optimizer before anything trains, so that a run
    that cannot train (a VR optimizer with k < 2 samples per update)
    stops the command before the first run, not after it."""
    from tf_vrgd import config, find_vr_optimizer

    for name, block in experiment.runs(compare):
        try:
            optimizer = config.optimizer_from_config(block)
        except ValueError as error:
            raise SystemExit(f"vrgd-train: run {name!r}: {error}") from None
        vr = find_vr_optimizer(optimizer)
        if vr is not None:
            try:
                vr.check_sample_count(experiment.replicas)
            except ValueError as error:
                raise SystemExit(f"vrgd-train: run {name!r} cannot train: {error}") from None


def train_run(name, block, experiment, strategy, arrays, run_dir, verbose):
    """Trains (or resumes) one run; returns its metrics records."""
    import keras
    import numpy as np

    import tf_vrgd
    from tf_vrgd import config, find_vr_optimizer
    from tf_vrgd.experiments import data, models

    os.makedirs(run_dir, exist_ok=True)
    remove_partial_checkpoints(run_dir)
    (x_train, y_train), (x_test, y_test) = arrays
    x_train, y_train = x_train[: experiment.train_examples], y_train[: experiment.train_examples]
    checkpoints = resumable_checkpoints(run_dir, name)
    initial_epoch = max(checkpoints, default=0)
    with strategy.scope():
        if initial_epoch:
            model = keras.models.load_model(checkpoints[initial_epoch])
        else:
            keras.utils.set_random_seed(experiment.seed)
            model = models.fashion_mnist_cnn(width=experiment.model_width)
            # Label smoothing needs one-hot labels.
            loss = (
                keras.losses.CategoricalCrossentropy(
                    from_logits=True, label_smoothing=experiment.label_smoothing
                )
                if experiment.label_smoothing
                else keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            )
            model.compile(
                optimizer=config.optimizer_from_config(block), loss=loss, metrics=["accuracy"]
            )
    records = read_records(os.path.join(run_dir, "metrics.jsonl"), initial_epoch)
    if initial_epoch >= experiment.epochs:
        return records
    if initial_epoch:
        print(
            f"[{name}] resuming after epoch {initial_epoch} from {checkpoints[initial_epoch]}",
            flush=True,
        )

    one_hot = bool(experiment.label_smoothing)

    def labels(y):
        return np.eye(data.NUM_CLASSES, dtype=np.float32)[y] if one_hot else y

    train_ds = data.dataset(
        x_train,
        labels(y_train),
        experiment.batch_size,
        seed=experiment.seed,
        epochs=experiment.epochs,
        initial_epoch=initial_epoch,
    )
    eval_sets = {
        "train": data.dataset(
            x_train[:EVAL_TRAIN_EXAMPLES],
            labels(y_train[:EVAL_TRAIN_EXAMPLES]),
            experiment.batch_size,
            drop_remainder=False,
        ),
        "test": data.dataset(x_test, labels(y_test), experiment.batch_size, drop_remainder=False),
    }

    def evaluate(split):
        loss, accuracy = model.evaluate(eval_sets[split], verbose=0)
        return float(loss), float(accuracy)

    callbacks = []
    vr_optimizer = find_vr_optimizer(model.optimizer)
    if vr_optimizer is not None:
        # Read at build, which comes with the first update (a resumed model's
        # saved config has it already).
        vr_optimizer.track_gsnr_statistics = True
        # Model-wide figures in the progress bar; per layer in the records.
        callbacks.append(tf_vrgd.GSNRMonitor(per_variable=False))
    callbacks.append(_epoch_callback(model, vr_optimizer, run_dir, records, evaluate))
    model.fit(
        train_ds,
        epochs=experiment.epochs,
        initial_epoch=initial_epoch,
        steps_per_epoch=experiment.steps_per_epoch,
        callbacks=callbacks,
        verbose=verbose,
        shuffle=False,
    )  # the dataset is shuffled per epoch already
    model.save_weights(os.path.join(run_dir, "final.weights.h5"))
    return records


# --- report -------------------------------------------------------------------


def summarize(runs, experiment):
    """One row per run: final and best figures."""
    rows = []
    for name, records in runs.items():
        if not records:
            continue
        last = records[-1]
        rows.append(
            {
                "run": name,
                "batch": experiment.batch_size,
                "replicas": experiment.replicas,
                "epochs": len(records),
                "train_acc": last["train_accuracy"],
                "test_acc": last["test_accuracy"],
                "best_test_acc": max(r["test_accuracy"] for r in records),
                "gap": last["generalization_gap"],
                "train_loss": last["train_loss"],
                "test_loss": last["test_loss"],
                "s_per_epoch": sum(r["seconds"] for r in records) / len(records),
            }
        )
    return rows


def format_table(rows):
    columns = [
        ("run", "{}"),
        ("batch", "{}"),
        ("replicas", "{}"),
        ("epochs", "{}"),
        ("train_acc", "{:.4f}"),
        ("test_acc", "{:.4f}"),
        ("best_test_acc", "{:.4f}"),
        ("gap", "{:+.4f}"),
        ("train_loss", "{:.4f}"),
        ("test_loss", "{:.4f}"),
        ("s_per_epoch", "{:.1f}"),
    ]
    cells = [[name for name, _ in columns]] + [
        [fmt.format(row[name]) for name, fmt in columns] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(runs, output):
    """accuracy.png, loss.png (all runs) and gsnr_<run>.png (per layer)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for metric in ("accuracy", "loss"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, records in runs.items():
            epochs = [r["epoch"] + 1 for r in records]
            for split, style in (("train", "--"), ("test", "-")):
                ax.plot(
                    epochs,
                    [r[f"{split}_{metric}"] for r in records],
                    style,
                    label=f"{name} {split}",
                )
        ax.set_xlabel("epoch")
        ax.set_ylabel(metric)
        ax.legend()
        ax.grid(alpha=0.3)
        path = os.path.join(output, f"{metric}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    for name, records in runs.items():
        keys = sorted({k for r in records for k in r if k.startswith("gsnr_mean/")})
        if not keys:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(16, 4))
        for key in keys:
            layer = key.split("/", 1)[1]
            epochs = [r["epoch"] + 1 for r in records]
            axes[0].plot(epochs, [r.get(key) for r in records], label=layer)
            axes[1].plot(epochs, [r.get("gsnr_at_gamma/" + layer) for r in records], label=layer)
            axes[2].plot(epochs, [r.get("gsnr_scale/" + layer) for r in records], label=layer)
        axes[0].set_yscale("log")
        axes[0].set_ylabel("mean raw GSNR")
        axes[1].set_ylabel("fraction clipped to gamma")
        axes[2].set_ylabel("mean applied scale (effective rate multiplier)")
        for ax in axes:
            ax.set_xlabel("epoch")
            ax.grid(alpha=0.3)
        axes[2].legend(fontsize=7)
        fig.suptitle(f"GSNR per layer: {name}")
        fig.tight_layout()
        path = os.path.join(output, f"gsnr_{name}.png")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


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
    os.makedirs(args.output, exist_ok=True)
    check_settings(args.output, experiment.settings(args.compare), args.restart, write)
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
        fields.check_override_keys(cfg, args.override)
        cfg = fields.check(apply_overrides(cfg, args.override))
    except ValueError as error:
        raise SystemExit(f"vrgd-train: {error}") from None
    if _get(cfg, "task.model.type", "fashion_mnist_cnn") != "fashion_mnist_cnn":
        return main_task(args, cfg)
    for flag, value in (("--train-steps", args.train_steps), ("--synthetic", args.synthetic)):
        if value:
            raise SystemExit(
                f"vrgd-train: {flag} is for the paper's tasks; a Fashion-MNIST run "
                "takes --epochs and reads its IDX files."
            )
    with _config_errors_exit():
        experiment = Experiment.from_args(cfg, args)
    devices = setup_devices(experiment.replicas)

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
    table = write_summary(args, experiment, summarize(runs, experiment), format_table)
    plots = plot(runs, args.output)
    print(f"\nplots: {', '.join(plots)}")
    print(f"\n{table}", flush=True)
    return 0


# Under --output, the folders the other workers of a multi-worker run write
# to (removed when their runs end).
WORKER_SCRATCH = ".workers"


def multi_worker_cluster(args):
    """The cluster of a multi-worker run ("2 workers"), from the `TF_CONFIG`
    that `MultiWorkerMirroredStrategy` reads (Model Garden's way); "" on
    one machine."""
    spec = os.environ.get("TF_CONFIG")
    if not spec:
        return ""
    try:
        parsed = json.loads(spec)
        cluster, task = parsed["cluster"], parsed["task"]
    except (ValueError, KeyError, TypeError):
        raise SystemExit(
            "vrgd-train: TF_CONFIG must be JSON with a 'cluster' and a 'task', as "
            "MultiWorkerMirroredStrategy reads it."
        ) from None
    for flag, value in (("--replicas", args.replicas), ("--restart", args.restart)):
        if value:
            raise SystemExit(
                f"vrgd-train: {flag} is for one machine. With TF_CONFIG every worker trains on "
                "its GPUs (one replica each; a CPU-only worker is one replica)"
                + (", and a restart must clear --output first." if flag == "--restart" else ".")
            )
    problem = _cluster_problem(cluster, task)
    if problem:
        raise SystemExit(f"vrgd-train: TF_CONFIG: {problem} (TF_CONFIG={spec})")
    tasks = sum(len(addresses) for addresses in cluster.values())
    return f"{tasks} workers"


def _cluster_problem(cluster, task):
    """What is wrong with TF_CONFIG's `cluster` and `task`; "" if nothing."""
    if not isinstance(cluster, dict) or not cluster:
        return "'cluster' must map task types (chief, worker) to lists of host:port"
    for kind, addresses in cluster.items():
        if kind not in ("chief", "worker", "evaluator"):
            return f"cluster task type {kind!r} is not chief, worker or evaluator"
        if not isinstance(addresses, list) or not all(
            isinstance(a, str) and ":" in a for a in addresses
        ):
            return f"cluster[{kind!r}] must be a list of host:port strings"
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        return "'task' must be {\"type\": ..., \"index\": ...}, this process's place in 'cluster'"
    kind, index = task["type"], task["index"]
    if kind not in cluster:
        return f"task type {kind!r} is not in the cluster ({', '.join(sorted(cluster))})"
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(cluster[kind]):
        return (
            f"task index {index!r} is out of range: cluster[{kind!r}] has "
            f"{len(cluster[kind])} address(es), indexed from 0"
        )
    return ""


def multi_worker_strategy():
    """`MultiWorkerMirroredStrategy` from `TF_CONFIG` (its constructor waits
    until every task of the cluster has connected: see `supervise`), with a
    `reduce` that takes what Keras' `fit` and `evaluate` pass it with more
    than one worker
    (keras-team/keras#20329, #20585): a whole input batch, nested (to build
    the metrics), as `MirroredStrategy`'s `reduce` takes it; and the
    per-replica scalar logs with `axis=0`, which for a scalar means the mean
    over replicas (`axis=None`)."""
    import tensorflow as tf

    class Strategy(tf.distribute.MultiWorkerMirroredStrategy):
        def reduce(self, reduce_op, value, axis):
            if tf.nest.is_nested(value):
                return tf.nest.map_structure(lambda v: self.reduce(reduce_op, v, axis), value)
            local = self.experimental_local_results(value)
            if axis is not None and all(v.shape.rank == 0 for v in local):
                axis = None
            return super().reduce(reduce_op, value, axis)

    strategy = Strategy()
    # Tell a supervising vrgd-train (`supervise`) that the cluster is up.
    fd = os.environ.pop(CONNECTED_FD, None)
    if fd:
        os.write(int(fd), b"connected")
        os.close(int(fd))
    return strategy


# The pipe on which a supervised multi-worker process says it connected.
CONNECTED_FD = "VRGD_TRAIN_CONNECTED_FD"


def supervise(argv, timeout):
    """Runs this command again as a child process and watches it until its
    cluster has connected: TensorFlow's wait for the other tasks neither
    returns to Python (where signal handlers run, so SIGINT and SIGTERM go
    unheard) nor ends. Says what it waits for; after `timeout` seconds, or
    on SIGTERM or SIGINT while waiting, ends the child with a message. Once
    connected, signals are passed on to the child (TensorFlow's own
    handling) and the child's exit status is returned."""
    import select
    import signal
    import subprocess

    spec = json.loads(os.environ["TF_CONFIG"])
    task = spec["task"]
    others = ", ".join(
        f"{kind} {i} ({address})"
        for kind, addresses in spec["cluster"].items()
        for i, address in enumerate(addresses)
        if (kind, i) != (task["type"], task["index"])
    )
    read, write = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-m", "tf_vrgd.experiments.train", *argv],
        env=dict(os.environ, **{CONNECTED_FD: str(write)}),
        pass_fds=(write,),
    )
    os.close(write)
    print(
        f"experiment: {task['type']} {task['index']} waiting for {others or 'no other task'} "
        f"to connect (up to {timeout} s, --worker-timeout)",
        flush=True,
    )
    connected = False

    def stop(reason):
        print(f"vrgd-train: {reason}", file=sys.stderr, flush=True)
        child.kill()
        child.wait()
        return 1

    def on_signal(number, frame):
        if connected:
            child.send_signal(number)
        else:
            raise KeyboardInterrupt(signal.Signals(number).name)

    previous = {n: signal.signal(n, on_signal) for n in (signal.SIGTERM, signal.SIGINT)}
    try:
        deadline = time.monotonic() + timeout
        while not connected and child.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return stop(
                    f"not every task of TF_CONFIG's cluster connected within {timeout} s "
                    f"(waiting for {others}): start them, check their addresses and ports, "
                    "or raise --worker-timeout."
                )
            ready, _, _ = select.select([read], [], [], min(left, 1.0))
            if ready:
                connected = bool(os.read(read, 64))  # b"" when the child has ended
                if not connected:
                    break
        code = child.wait()
    except KeyboardInterrupt as interrupt:
        return stop(
            f"{interrupt.args[0] if interrupt.args else 'SIGINT'} while waiting for {others}."
        )
    finally:
        os.close(read)
        for number, handler in previous.items():
            signal.signal(number, handler)
    return 128 - code if code < 0 else code


def is_chief(strategy):
    """Whether this process writes the run's files: always on one machine;
    under MultiWorkerMirroredStrategy, the `chief` task, or worker 0 of a
    cluster without one."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return True
    if resolver.task_type == "chief":
        return True
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    return resolver.task_type == "worker" and resolver.task_id == 0 and not has_chief


@contextlib.contextmanager
def _config_errors_exit():
    """A config or its files that cannot train (ValueError,
    FileNotFoundError) end the command with the message, not a traceback."""
    try:
        yield
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"vrgd-train: {error}") from None


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
    cluster = multi_worker_cluster(args)
    strategy = devices = None
    if cluster and CONNECTED_FD not in os.environ:
        return supervise(args.argv, args.worker_timeout)
    if cluster:
        # Before anything else starts TensorFlow's runtime.
        strategy = multi_worker_strategy()
    with _config_errors_exit():
        experiment = task_runs.TaskExperiment(
            cfg,
            train_steps=args.train_steps,
            seed=args.seed,
            replicas=strategy.num_replicas_in_sync if strategy else args.replicas,
            synthetic=args.synthetic,
        )
    if not cluster:
        devices = setup_devices(experiment.replicas)
    with _config_errors_exit():
        experiment.check_input()

    import tensorflow as tf

    chief = is_chief(strategy)
    prepare_output(args, experiment, write=chief)
    where = devices
    if cluster:
        task = strategy.cluster_resolver
        where = f"on {cluster}, this one {task.task_type} {task.task_id}"
    print(f"experiment: {args.config}: {experiment.describe()} {where}", flush=True)
    if experiment.note:
        print(f"experiment: {experiment.note}", flush=True)
    if not cluster and _get(cfg, "runtime.distribution_strategy") == "multi_worker_mirrored":
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
        scratch = os.path.join(args.output, WORKER_SCRATCH, f"{task.task_type}-{task.task_id}")

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

    with _config_errors_exit():
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


def train_each(args, experiment, train_one, write=True):
    """`{run name: records}`: each run of the experiment (the config's, then
    with --compare its twin) trained by `train_one(name, block, run_dir)`,
    its optimization block written beside it (if `write`)."""
    runs = {}
    for name, block in experiment.runs(args.compare):
        print(f"\n=== {name} ===", flush=True)
        if write:
            with open(os.path.join(args.output, f"{name}.optimization.json"), "w") as f:
                json.dump(block, f, indent=2)
        runs[name] = train_one(name, block, os.path.join(args.output, name))
    return runs


def write_summary(args, experiment, rows, format_rows):
    """summary.json and summary.txt in --output; returns the table."""
    table = format_rows(rows)
    with open(os.path.join(args.output, "summary.json"), "w") as f:
        json.dump({"config": args.config, "note": experiment.note, "runs": rows}, f, indent=2)
    with open(os.path.join(args.output, "summary.txt"), "w") as f:
        f.write(table + "\n")
    return table


if __name__ == "__main__":
    sys.exit(main())
