"""The Fashion-MNIST experiment of `vrgd-train`: its settings (batch,
epochs, rescaled schedule) and one run's training, evaluated, recorded and
checkpointed at every epoch."""

import math
import os
import time

from tf_vrgd.experiments.experiment_config import lookup, rescale_schedule, runs_of
from tf_vrgd.experiments.run_folder import (
    gsnr_entries,
    learning_rate,
    read_records,
    remove_partial_checkpoints,
    resumable_checkpoints,
    save_checkpoint,
    write_records,
)

EVAL_TRAIN_EXAMPLES = 10000  # train-set examples evaluated each epoch (fixed subset)


def steps_per_epoch(batch_size, examples=60000):
    return examples // batch_size


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
        lr_multiplier: Every learning rate of the schedule times this, after
            the square-root scaling (a grid's rate multiplier).
    """

    def __init__(
        self,
        cfg,
        *,
        batch_size=None,
        epochs=None,
        seed=None,
        replicas=None,
        train_examples=None,
        lr_multiplier=1.0,
    ):
        from tf_vrgd import config
        from tf_vrgd.experiments import fields

        self.cfg = fields.check(cfg)
        model = lookup(cfg, "task.model", {}) or {}
        if model.get("type", "fashion_mnist_cnn") != "fashion_mnist_cnn":
            raise ValueError(
                f"vrgd-train builds `fashion_mnist_cnn` models only; this config's "
                f"task.model.type is {model.get('type')!r} (a GPU-cluster experiment: "
                "use its optimization block with tf_vrgd.config.optimizer_from_config)."
            )
        self.model_width = int(model.get("width", 32))
        self.label_smoothing = float(lookup(cfg, "task.losses.label_smoothing", 0.0) or 0.0)
        block = config.optimization_block(cfg)
        # Schedules count updates; with accumulation an update takes A batches.
        accumulation = config.accumulation_steps(block)
        config_batch = int(lookup(cfg, "task.train_data.global_batch_size", 256))
        config_steps = int(
            lookup(cfg, "trainer.train_steps", 10 * steps_per_epoch(config_batch) // accumulation)
        )
        config_epochs = max(1, round(config_steps * accumulation / steps_per_epoch(config_batch)))
        self.batch_size = batch_size or config_batch
        self.epochs = epochs or config_epochs
        self.seed = seed if seed is not None else int(lookup(cfg, "runtime.seed", 0) or 0)
        self.replicas = replicas or int(lookup(cfg, "runtime.num_gpus", 1) or 1)
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
        #: The updates the run plans (an AdaScale run ends when tau reaches them).
        self.total_updates = total
        step_factor = total / config_steps
        lr_factor = math.sqrt(self.batch_size / config_batch)
        self.rescaled = abs(step_factor - 1) > 1e-9 or abs(lr_factor - 1) > 1e-9
        self.block = rescale_schedule(block, step_factor, lr_factor) if self.rescaled else block
        if lr_multiplier != 1.0:
            self.block = rescale_schedule(self.block, 1.0, lr_multiplier)
        # The schedule's fields, checked before any device is set up.
        config.learning_rate_from_config(self.block)
        self.note = (
            f"schedule rescaled from {config_steps} to {total} steps, learning rates x "
            f"{lr_factor:.4g} (square-root scaling from batch {config_batch})"
            if self.rescaled
            else ""
        )
        if lr_multiplier != 1.0:
            self.note = "; ".join(filter(None, [self.note, f"learning rates x {lr_multiplier:g}"]))

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
                "learning_rate": learning_rate(model.optimizer),
                "seconds": seconds,
            }
            measured = ("gsnr", "noise_scale", "adascale", "scale_invariant")
            record.update({k: float(v) for k, v in logs.items() if k.startswith(measured)})
            record["updates"] = int(model.optimizer.iterations.numpy())
            record.update(gsnr_entries(model, vr_optimizer))
            records.append(record)
            write_records(run_dir, records)
            # The checkpoint comes last: a run killed before it redoes this epoch.
            save_checkpoint(model, run_dir, epoch + 1)

    return EpochEnd()


def _reached_its_steps(model, experiment):
    """Whether an AdaScale run's tau has reached its planned updates: it
    ended there (`ScaleInvariantStop`), and a resume has nothing to add."""
    from tf_vrgd.adascale import find_adascale

    adascale = find_adascale(model.optimizer)
    return adascale is not None and adascale.scale_invariant_steps >= experiment.total_updates


def train_run(name, block, experiment, strategy, arrays, run_dir, verbose):
    """Trains (or resumes) one run; returns its metrics records."""
    import keras
    import numpy as np

    import tf_vrgd
    from tf_vrgd import config, find_vr_optimizer, noise_scale_optimizer
    from tf_vrgd.adascale import find_adascale
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
    if initial_epoch >= experiment.epochs or _reached_its_steps(model, experiment):
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
    if (
        vr_optimizer is not None
        or noise_scale_optimizer.find_noise_scale(model.optimizer) is not None
    ):
        # Model-wide figures (and the gradient noise scale; of another
        # optimizer, in a `noise_scale` block) in the progress bar; per
        # layer in the records.
        callbacks.append(tf_vrgd.GSNRMonitor(per_variable=False, batch_size=experiment.batch_size))
    elif find_adascale(model.optimizer) is not None:
        # The gain, tau and the noise scale in the records; the run ends
        # when tau reaches its planned updates, the base schedule's length
        # (r >= 1: before the last epoch).
        stop = tf_vrgd.ScaleInvariantStop(experiment.total_updates)
        callbacks += [tf_vrgd.GSNRMonitor(batch_size=experiment.batch_size), stop]
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
