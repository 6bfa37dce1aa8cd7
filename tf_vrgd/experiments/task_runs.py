"""`vrgd-train` on the paper's tasks (`tf_vrgd.experiments.tasks`): training
counted in updates, checkpointed every `trainer.checkpoint_interval`
updates, with the throughput of each interval in the metrics.

A run folder holds `metrics.jsonl` / `metrics.csv` (one record per
interval: running train loss and metrics, validation metrics where the
config names validation files, learning rate, seconds, examples per second
in all and per replica, and the GSNR statistics of a VR optimizer) and
`checkpoint-epoch<N>.keras` after N intervals (model, optimizer state).
The training stream is fixed by the run's seed (`records.training_records`)
and read on from interval to interval; a run resumed from its last
checkpoint starts it after the updates done, so it sees the examples the
uninterrupted run would have seen.
"""

import math
import os
import time

import numpy as np

from tf_vrgd.experiments import experiment_config, run_folder

DEFAULT_CHECKPOINT_INTERVAL = 1000

# Model Garden's `runtime.mixed_precision_dtype`: the Keras dtype policy.
# Under float16 the optimizer goes into `tf_vrgd.LossScaleOptimizer`
# (dynamic loss scale, every replica's overflow counted; VR optimizers read
# through it), which Keras' `compile` keeps instead of wrapping in its own.
DTYPE_POLICIES = {"float32": "float32", "float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}


class TaskExperiment:
    """The parts of a paper-task config that `vrgd-train` uses.

    Args:
        cfg: The experiment, overrides applied.
        train_steps: Updates to train (None: `trainer.train_steps`); the
            schedule's step counts follow the new total.
        seed: Seed of the initial weights and the input order.
        replicas: MirroredStrategy replicas (None: `runtime.num_gpus`).
        synthetic: Random inputs instead of the config's files.
    """

    def __init__(self, cfg, *, train_steps=None, seed=None, replicas=None, synthetic=False):
        from tf_vrgd import config
        from tf_vrgd.experiments import fields, tasks

        get = experiment_config.lookup
        self.cfg = fields.check(cfg)
        self.task = tasks.from_config(cfg)
        block = config.optimization_block(cfg)
        self.accumulation = config.accumulation_steps(block)
        # Model Garden's global_batch_size: the examples of one update.
        self.global_batch = int(get(cfg, "task.train_data.global_batch_size", 0) or 0)
        self.replicas = replicas or int(get(cfg, "runtime.num_gpus", 1) or 1)
        if self.global_batch < 1:
            raise ValueError("task.train_data.global_batch_size must be set.")
        if self.global_batch % (self.accumulation * self.replicas):
            raise ValueError(
                f"task.train_data.global_batch_size {self.global_batch} does not split into "
                f"{self.accumulation} accumulation steps over {self.replicas} replicas."
            )
        # Each step (one Keras batch) is 1/A of an update.
        self.step_batch = self.global_batch // self.accumulation
        config_steps = get(cfg, "trainer.train_steps")
        if not config_steps:
            raise ValueError("trainer.train_steps must be set.")
        config_steps = int(config_steps)
        self.train_steps = train_steps or config_steps
        self.interval = min(
            int(get(cfg, "trainer.checkpoint_interval", DEFAULT_CHECKPOINT_INTERVAL)),
            self.train_steps,
        )
        self.intervals = math.ceil(self.train_steps / self.interval)
        self.validation_steps = int(
            get(cfg, "trainer.validation_steps", self.task.validation_steps)
        )
        self.init_checkpoint = get(cfg, "task.init_checkpoint")
        if self.init_checkpoint and not os.path.isfile(self.init_checkpoint):
            raise FileNotFoundError(
                f"task.init_checkpoint {self.init_checkpoint!r} is not a file (a "
                "`.weights.h5` written by `model.save_weights`, e.g. a run's final.weights.h5)."
            )
        # Model Garden's field: the checkpoints kept (the newest ones).
        self.max_to_keep = int(get(cfg, "trainer.max_to_keep", 1))
        if self.max_to_keep < 1:
            raise ValueError(f"trainer.max_to_keep must be >= 1. Received: {self.max_to_keep}")
        self.seed = seed if seed is not None else int(get(cfg, "runtime.seed", 0) or 0)
        precision = get(cfg, "runtime.mixed_precision_dtype") or "float32"
        if precision not in DTYPE_POLICIES:
            raise ValueError(
                f"runtime.mixed_precision_dtype must be one of {sorted(DTYPE_POLICIES)}. "
                f"Received: {precision!r}"
            )
        self.dtype_policy = DTYPE_POLICIES[precision]
        loss_scale = get(cfg, "runtime.loss_scale")
        if loss_scale not in (None, "dynamic"):
            raise ValueError(
                "runtime.loss_scale must be 'dynamic' (or unset): Keras 3's LossScaleOptimizer "
                f"has no fixed scale. Received: {loss_scale!r}"
            )
        self.synthetic = bool(synthetic)
        self.block = block
        self.note = ""
        if self.train_steps != config_steps:
            self.block = experiment_config.rescale_schedule(
                block, self.train_steps / config_steps, 1.0
            )
            self.note = f"schedule rescaled from {config_steps} to {self.train_steps} updates"
        # The schedule's fields, checked before any device is set up (the
        # optimizers are built, and their fields checked, once they are).
        config.learning_rate_from_config(self.block)

    def updates_in(self, interval):
        """The updates of interval `interval` (the last may have fewer)."""
        return min(self.interval, self.train_steps - interval * self.interval)

    def settings(self, compare):
        return {
            "config": self.cfg,
            "train_steps": self.train_steps,
            "seed": self.seed,
            "replicas": self.replicas,
            "synthetic": self.synthetic,
            "compare": bool(compare),
            run_folder.INPUT_FILES: self.input_files(),
        }

    def input_files(self):
        """``{split: {file: bytes}}`` of the files the run reads ({} for
        synthetic input). Recorded with the settings: the stream a resumed
        run reads on is the uninterrupted run's only over the same files,
        and a glob names no files."""
        if self.synthetic:
            return {}
        import tensorflow as tf

        from tf_vrgd.experiments.records import input_files

        return {
            split: {
                name: int(tf.io.gfile.stat(name).length)
                for name in input_files(self.task.input_path(split))
            }
            for split in ("train", "validation")
            if self.has_input(split)
        }

    def runs(self, compare):
        return experiment_config.runs_of(self.block, compare)

    def check_input(self):
        """Raises ValueError if the first record of a split's files does not
        have the layout the config implies, or if the validation files hold
        less than one batch (reads them with TensorFlow: call it once the
        devices are set up)."""
        if self.synthetic:
            return
        for split in ("train", "validation"):
            self.task.check_input(split)
        validation = self.dataset("validation")
        if validation is not None and next(iter(validation.take(1)), None) is None:
            raise ValueError(
                f"task.validation_data: {self.task.input_path('validation')} holds fewer "
                f"records than one validation batch of {self.step_batch} "
                "(task.train_data.global_batch_size / gradient_accumulation_steps): "
                "name more files, or no validation files."
            )

    def find_record_problem(self):
        """Where the input files first hold a record the pipeline cannot
        read or a value out of range ("task.SPLIT_data: FILE: line N:
        what"); "" if nowhere. Reads every record of every split."""
        if self.synthetic:
            return ""
        for split in ("train", "validation"):
            if split == "train" or self.has_input(split):
                problem = self.task.find_record_problem(split)
                if problem:
                    return f"task.{split}_data: {problem}"
        return ""

    def describe(self):
        source = "synthetic inputs" if self.synthetic else "the config's files"
        return (
            f"task {self.task.name}: {self.train_steps} updates of {self.global_batch} "
            f"examples ({self.accumulation} step(s) of {self.step_batch} each) on "
            f"{self.replicas} replica(s), {self.dtype_policy}, checkpoints every "
            f"{self.interval} updates, {source}, seed {self.seed}"
        )

    def has_input(self, split):
        """Whether `split` has input: always `train`; `validation` where the
        config names files for it (synthetic runs validate nothing)."""
        if split == "train":
            return True
        return not self.synthetic and self.task.input_path(split) is not None

    def dataset(self, split, updates=0):
        """`split`'s input on one machine: the training stream fixed by the
        run's seed from the example after `updates` updates on (a resumed
        run reads what the uninterrupted one reads next), or the validation
        files."""
        if not self.has_input(split):
            return None
        if self.synthetic:
            # One batch for the whole run, as Model Garden's synthetic mode.
            return self.task.synthetic_dataset(self.step_batch, self.seed)
        start = updates * self.global_batch if split == "train" else 0
        return self.task.dataset(split, self.step_batch, self.seed, start=start)

    def input(self, strategy, split, updates=0):
        """What `fit` (from the update after `updates` on) or `evaluate`
        reads (None where the config names no data for `split`): the
        dataset, whose batches Keras splits over the replicas; under
        `MultiWorkerMirroredStrategy`, each worker's own part of the input
        (its files, or every n-th record; its own seed) batched per replica,
        so that no worker reads and drops the others' examples. A worker's
        validation part repeats: every worker must take part in all
        `validation_steps`."""
        import tensorflow as tf

        if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
            return self.dataset(split, updates)
        if not self.has_input(split):
            return None

        def per_worker(context):
            batch = context.get_per_replica_batch_size(self.step_batch)
            worker = context.input_pipeline_id
            if self.synthetic:
                return self.task.synthetic_dataset(batch, self.seed * 1009 + worker)
            seed = self.seed * 1009 + worker
            shard = (context.num_input_pipelines, worker)
            if split != "train":
                return self.task.dataset(split, batch, seed, shard).repeat()
            # This worker's replicas each take a batch per step.
            local = context.num_replicas_in_sync // context.num_input_pipelines
            start = updates * self.accumulation * local * batch
            return self.task.dataset(split, batch, seed, shard, start=start)

        return strategy.distribute_datasets_from_function(per_worker)


def _interval_callback(experiment, strategy, model, vr_optimizer, run_dir, records, first):
    """The callback of `fit`'s epochs, one per interval: reseeds the random
    layers, ends the last interval after its updates, records the
    interval's metrics and throughput, then checkpoints. `first`: the
    first interval of this process (its time includes tracing)."""
    import keras

    class IntervalEnd(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            _reseed_random_layers(model, epoch)
            self.updates = experiment.updates_in(epoch)
            self.batches = 0
            self.start = time.time()

        def on_train_batch_end(self, batch, logs=None):
            self.batches = batch + 1
            # The last interval may be shorter than fit's epochs.
            short = self.updates < experiment.interval
            if short and batch + 1 >= self.updates * experiment.accumulation:
                model.stop_training = True

        def on_epoch_end(self, epoch, logs=None):
            seconds = time.time() - self.start
            # The updates taken: another callback (ScaleInvariantStop) may
            # have ended the interval early.
            taken = min(self.updates, self.batches // experiment.accumulation)
            examples = taken * experiment.global_batch
            record = {
                "epoch": epoch,
                "updates": (epoch * experiment.interval) + taken,
                "seconds": seconds,
                "examples_per_second": examples / seconds,
                "examples_per_second_per_replica": examples / seconds / experiment.replicas,
                "learning_rate": run_folder.learning_rate(model.optimizer),
                # Tracing and compilation fall in a process's first interval.
                "includes_startup": epoch == first,
            }
            record.update({f"train_{k}": float(v) for k, v in (logs or {}).items()})
            validation = experiment.input(strategy, "validation")
            if validation is not None:
                values = model.evaluate(
                    validation, steps=experiment.validation_steps, verbose=0, return_dict=True
                )
                record.update({f"validation_{k}": float(v) for k, v in values.items()})
            record.update(run_folder.gsnr_entries(model, vr_optimizer))
            records.append(record)
            run_folder.write_records(run_dir, records)
            run_folder.save_checkpoint(model, run_dir, epoch + 1, keep=experiment.max_to_keep)

    return IntervalEnd()


def train_task_run(name, block, experiment, strategy, run_dir, verbose, scratch=None):
    """Trains (or resumes) one run of a paper task; returns its records.

    `scratch`: on the workers of a multi-worker run other than the chief, a
    folder of their own for the files they write (every worker writes its
    checkpoints, as saving reads variables with collectives); they resume
    from the chief's checkpoints in `run_dir`, which all workers must see.
    """
    import keras

    import tf_vrgd
    from tf_vrgd import config, find_vr_optimizer, noise_scale_optimizer
    from tf_vrgd.adascale import find_adascale

    write_dir = scratch or run_dir
    os.makedirs(write_dir, exist_ok=True)
    run_folder.remove_partial_checkpoints(write_dir)
    checkpoints = run_folder.resumable_checkpoints(run_dir, name)
    done = max(checkpoints, default=0)
    _check_workers_agree(strategy, done, run_dir)
    keras.mixed_precision.set_global_policy(experiment.dtype_policy)
    with strategy.scope():
        keras.utils.set_random_seed(experiment.seed)
        model = experiment.task.build_model()
        # Dropout masks of their own on each replica (Keras draws one for
        # all): the per-replica gradients are separate samples.
        tf_vrgd.independent_replica_noise(model)
        optimizer = config.optimizer_from_config(block)
        if experiment.dtype_policy == "mixed_float16":
            optimizer = tf_vrgd.LossScaleOptimizer(optimizer)
        model.compile(optimizer=optimizer, **experiment.task.compile_args())
        vr_optimizer = find_vr_optimizer(model.optimizer)
        if vr_optimizer is not None:
            # Read at build.
            vr_optimizer.track_gsnr_statistics = True
        if not done and experiment.init_checkpoint:
            # Model Garden's task.init_checkpoint: weights only (BERT's phase
            # 2 starts from phase 1's `final.weights.h5`).
            model.load_weights(experiment.init_checkpoint)
        if done:
            # Into the model as built here: `load_model` cannot rebuild
            # BERT's output layer tied to its token embedding.
            model.optimizer.build(model.trainable_variables)
            model.load_weights(checkpoints[done])
    records = run_folder.read_records(os.path.join(run_dir, "metrics.jsonl"), done)
    if done:
        print(f"[{name}] resuming after interval {done} from {checkpoints[done]}", flush=True)
    monitor = []
    adascale = find_adascale(model.optimizer)
    total = experiment.intervals * experiment.interval
    measured = noise_scale_optimizer.find_noise_scale(model.optimizer) is not None
    if vr_optimizer is not None or measured:
        # A Keras step's examples: the monitor counts the accumulation.
        monitor = [tf_vrgd.GSNRMonitor(per_variable=False, batch_size=experiment.step_batch)]
    elif adascale is not None:
        # The gain, tau and the noise scale in the logs; the run's updates
        # are the base schedule's length, which tau reaches first (r >= 1).
        monitor = [
            tf_vrgd.GSNRMonitor(batch_size=experiment.step_batch),
            tf_vrgd.ScaleInvariantStop(total),
        ]
    if adascale is not None and adascale.scale_invariant_steps >= total:
        done = experiment.intervals  # it ended when tau reached the train steps
    if done < experiment.intervals:
        # One fit, an epoch per interval: one iterator reads the training
        # stream on from interval to interval (a resumed run starts it
        # after the updates done).
        callback = _interval_callback(
            experiment, strategy, model, vr_optimizer, write_dir, records, done
        )
        import tensorflow as tf

        try:
            model.fit(
                experiment.input(strategy, "train", done * experiment.interval),
                initial_epoch=done,
                epochs=experiment.intervals,
                steps_per_epoch=experiment.interval * experiment.accumulation,
                callbacks=[*monitor, callback],
                verbose=verbose,
            )
        except (tf.errors.InvalidArgumentError, tf.errors.DataLossError) as error:
            # A record that does not parse, or a value out of range: the
            # pipeline's error names a shuffled batch, so find the file.
            problem = experiment.find_record_problem()
            if problem:
                raise ValueError(f"the input cannot be read: {problem}") from error
            raise
    model.save_weights(os.path.join(write_dir, "final.weights.h5"))
    return records


def _check_workers_agree(strategy, done, run_dir):
    """Under `MultiWorkerMirroredStrategy`, stops every worker unless all
    found the same last checkpoint (a worker starting afresh beside one
    that resumes would train with other weights, or hang)."""
    import tensorflow as tf

    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return
    total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(float(done))), axis=None)
    if float(total) != done * strategy.num_replicas_in_sync:
        raise ValueError(
            f"the workers found different checkpoints in {run_dir} (this one: "
            f"{done} interval(s) done): --output must be one folder that every worker "
            "sees (a shared file system), as the chief writes the checkpoints."
        )


# Calls of a random layer (dropout) in one interval stay below this.
RANDOM_CALLS_PER_INTERVAL = 2**20


def _reseed_random_layers(model, interval):
    """Restarts every random layer's stream (dropout) at a point fixed by the
    interval: a checkpoint does not hold those streams, and a resumed run
    must draw what the uninterrupted one drew."""
    from tf_vrgd import replica_noise

    counter = interval * RANDOM_CALLS_PER_INTERVAL % 2**31
    for generator in replica_noise.seed_generators(model):
        seed = generator.state.numpy()[0]
        generator.state.assign(np.array([seed, counter], generator.state.dtype))


def summarize(runs, experiment):
    """One row per run: its last record's metrics and the throughput of
    the intervals that are not a process's first (those pay tracing and
    compilation; where every interval is, all of them)."""
    rows = []
    for name, records in runs.items():
        if not records:
            continue
        steady = [r for r in records if not r.get("includes_startup", r is records[0])]
        steady = steady or records
        seconds = sum(r["seconds"] for r in steady)
        examples = sum(r["examples_per_second"] * r["seconds"] for r in steady)
        last = records[-1]
        row = {
            "run": name,
            "updates": last["updates"],
            "batch": experiment.global_batch,
            # The gradient noise scale (VR runs), at the first and last interval.
            "noise_scale_start": records[0].get("train_noise_scale", float("nan")),
            "noise_scale_end": last.get("train_noise_scale", float("nan")),
            "replicas": experiment.replicas,
            "train_loss": last.get("train_loss", float("nan")),
            "examples_per_second": examples / seconds,
            "first_interval_seconds": records[0]["seconds"],
        }
        row.update({k: v for k, v in last.items() if k.startswith("validation_")})
        rows.append(row)
    return rows


def format_table(rows):
    keys = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    cells = [keys] + [
        [f"{row[k]:.4g}" if isinstance(row.get(k), float) else str(row.get(k, "")) for k in keys]
        for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(keys))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
