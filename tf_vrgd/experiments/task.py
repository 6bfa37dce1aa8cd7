"""The interface every paper task implements (`tasks` lists them): the
model, its compile arguments, its datasets from the config's files or
synthetic, and checks of those files."""

import copy

import tensorflow as tf

from tf_vrgd.experiments.experiment_config import lookup
from tf_vrgd.experiments.records import input_files


class Task:
    """One task of an experiment config. Subclasses fill in the model, its
    compile arguments and the datasets.

    Args:
        cfg: The experiment (a dict, as `tf_vrgd.config.load` returns it).
    """

    name = ""
    # Default of `trainer.validation_steps` when the config has none.
    validation_steps = 10

    def __init__(self, cfg):
        self.cfg = cfg
        self.model_cfg = copy.deepcopy(lookup(cfg, "task.model", {}))

    def build_model(self):
        raise NotImplementedError

    def compile_args(self):
        """`loss`, `metrics` (and `loss_weights`) for `model.compile`."""
        raise NotImplementedError

    def synthetic_batch(self, batch_size, seed):
        """One batch `(x, y[, sample_weight])` of random tensors."""
        raise NotImplementedError

    def dataset(self, split, batch_size, seed, shard=None, start=0):
        """The `train` or `validation` dataset from the config's input
        files, batched; None where the config names no files for `split`.

        `train` is the endless stream of `training_records` fixed by `seed`,
        from its record `start` on (a run resumed after n batches of b
        examples passes n * b); `validation` reads the files once, in order.
        `shard = (count, index)` reads input pipeline `index` of `count`
        (one per worker of a multi-worker run): every count-th file from
        `index` where there are at least `count` files, else every count-th
        record.
        """
        raise NotImplementedError

    def input_path(self, split):
        """`split`'s `input_path`; None where a split other than `train`
        names none (`train` must: `input_files` says so)."""
        path = lookup(self._data_cfg(split), "input_path")
        return path if path or split == "train" else None

    def check_input(self, split):
        """Reads the first record of `split`'s first file and raises
        ValueError if it does not have the layout the config implies (a
        mismatch would otherwise surface as a parse error deep in `fit`)."""
        path = self.input_path(split)
        if path is None:
            return
        files = input_files(path)
        problem = self._input_problem(files)
        if problem:
            raise ValueError(f"task.{split}_data: {files[0]}: {problem}")

    def _input_problem(self, files):
        """What is wrong with the first record of `files`; "" if nothing."""
        return ""

    def find_record_problem(self, split):
        """The first record of `split`'s files, in file order, that the
        input pipeline cannot read or that holds a value out of range, as
        "FILE: line N: what" (or "record N"); "" if every record reads.
        Reads every record: `vrgd-train` calls it when reading the input
        failed during training, to say where."""
        path = self.input_path(split)
        if path is None:
            return ""
        for name in input_files(path):
            problem = self._file_problem(name)
            if problem:
                return f"{name}: {problem}"
        return ""

    def _file_problem(self, name):
        """What is wrong with the first bad record of file `name`; "" if none."""
        return ""

    def synthetic_dataset(self, batch_size, seed):
        """One random batch, made on the device and repeated: the shapes
        and dtypes of the real input, no files (Model Garden's synthetic
        mode does the same)."""
        batch = self.synthetic_batch(batch_size, seed)
        return tf.data.Dataset.from_tensors(batch).repeat()

    def _data_cfg(self, split):
        return lookup(self.cfg, f"task.{split}_data", {})

    def _drop_remainder(self, split):
        """Model Garden's `drop_remainder` (default True): batches of fewer
        examples than the batch are dropped; a partial batch split over
        replicas can leave a replica without examples, which BatchNorm and
        some reductions refuse."""
        return bool(lookup(self._data_cfg(split), "drop_remainder", True))
