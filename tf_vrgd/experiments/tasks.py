"""The paper's tasks, built from an experiment's `task` block (Model Garden
field names): the model, its loss and metrics, and its input pipelines,
from files in the formats the public tools write or, with `synthetic`,
from random tensors of the same shapes made on the device.

- `bert`: BERT pretraining, masked-LM and next-sentence heads on KerasHub's
  `BertBackbone`, reading the TFRecords of BERT's `create_pretraining_data`.
- `resnet`: ResNet-50 v1.5 on ImageNet TFRecords (`image/encoded`,
  `image/class/label`), or ResNet-56 (`resnet.model_id: 56`) on CIFAR-10's
  binary or python batches.
- `dlrm`: DLRM (bottom MLP, embedding tables, dot interaction from Keras-RS,
  top MLP) on Criteo's TSV lines.

Every task returns its datasets batched by the per-step (global) batch,
repeating without end; `vrgd-train` sizes the steps.
"""

import copy
import os
import pickle

import keras
import numpy as np
import tensorflow as tf

from tf_vrgd.experiments import resnet
from tf_vrgd.experiments.experiment_config import lookup


def _tfrecord_problem(name, problem_of):
    """The first problem of TFRecord file `name`: a record that does not
    read (a truncated or corrupted file) or one for which
    `problem_of(tf.train.Example)` says what is wrong."""
    index = 0
    try:
        for index, record in enumerate(tf.data.TFRecordDataset([name]).as_numpy_iterator()):
            try:
                example = tf.train.Example.FromString(record)
            except Exception:  # protobuf's DecodeError
                return f"record {index}: not a tf.train.Example."
            problem = problem_of(example)
            if problem:
                return f"record {index}: {problem}"
    except (tf.errors.DataLossError, tf.errors.OutOfRangeError) as error:
        return f"the record after record {index} does not read ({error.message.splitlines()[0]})"
    return ""


def _labels_in_range(name, labels, count, field):
    """A check in the input pipeline: every one of `labels` in [0, count)."""
    labels = tf.convert_to_tensor(labels)
    valid = tf.reduce_all((labels >= 0) & (labels < count))
    check = tf.debugging.Assert(valid, [f"{name} out of range [0, {count}) ({field}):", labels])
    with tf.control_dependencies([check]):
        return tf.identity(labels)


def _first_example(path):
    """The first `tf.train.Example` of a TFRecord file; None if it has none."""
    for record in tf.data.TFRecordDataset([path]).take(1):
        return tf.train.Example.FromString(record.numpy())
    return None


def _read(files, reader, shard):
    """`reader(files)` in file order (evaluation), or with `shard = (count,
    index)` input pipeline `index` of `count`: every count-th file from
    `index` where there are at least `count` files, else every count-th
    record."""
    if shard is None:
        return reader(files)
    count, index = shard
    if len(files) >= count:
        return reader(files[index::count])
    return reader(files).shard(count, index)


# Consecutive records of a pass that a training stream puts in a random
# order together (the memory a shuffle buffer of this size would take).
SHUFFLE_BLOCK = 10000


def count_records(files, reader):
    """The number of records `reader` reads from each of `files` (each file
    read through once, several at a time)."""
    counts = tf.data.Dataset.from_tensor_slices(list(files)).map(
        lambda name: reader(name).reduce(tf.constant(0, tf.int64), lambda n, _: n + 1),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return [int(n) for n in counts.as_numpy_iterator()]


def training_records(files, reader, seed, start=0, shard=None, block=SHUFFLE_BLOCK):
    """The training stream of the records `reader` reads from `files`, from
    its record `start` on: a deterministic function of the files and `seed`.

    Pass p (p = 0, 1, ...) reads the files in an order drawn from (seed, p),
    and puts each block of `block` consecutive records of the pass in an
    order drawn from (seed, p, the block's index): every record once per
    pass, mixed with its neighbours as a shuffle buffer of `block` records
    mixes them. Every iterator reads the same stream, and the stream from
    `start` is the one from 0 less its first `start` records, so a run
    resumed after `start` records reads exactly what the uninterrupted run
    reads next. Reaching `start` reads each file's record count once
    (`count_records`) and then at most one file up to one block: never the
    records before it.

    `shard = (count, index)`: input pipeline `index` of `count` (a worker of
    a multi-worker run) reads every count-th file from `index` where there
    are at least `count` files, else every count-th record of each pass;
    `start` counts this pipeline's records.
    """
    files = list(files)
    if shard is not None:
        count, index = shard
        if len(files) >= count:
            files, shard = files[index::count], None
    names = tf.constant(files)
    seed = tf.constant(seed, tf.int64)

    def pass_seed(epoch):
        return tf.stack([seed, tf.cast(epoch, tf.int64)])

    def order(epoch):
        return tf.random.experimental.stateless_shuffle(
            tf.range(len(files), dtype=tf.int64), seed=pass_seed(epoch)
        )

    def shuffled(seed_of_pass, index, records):
        size = tf.shape(tf.nest.flatten(records)[0], out_type=tf.int64)[0]
        permutation = tf.random.experimental.stateless_shuffle(
            tf.range(size), seed=tf.random.experimental.stateless_fold_in(seed_of_pass, index)
        )
        return tf.data.Dataset.from_tensor_slices(
            tf.nest.map_structure(lambda r: tf.gather(r, permutation), records)
        )

    def one_pass(epoch, skip_files=0, skip_records=0, first_block=0):
        records = reader(tf.gather(names, order(epoch)[skip_files:]))
        if shard is not None:
            records = records.shard(*shard)
        blocks = records.skip(skip_records).batch(block).enumerate(start=first_block)
        seed_of_pass = pass_seed(epoch)
        return blocks.flat_map(lambda i, records: shuffled(seed_of_pass, i, records))

    epoch = skip_files = skip_records = first_block = within = 0
    if start:
        counts = count_records(files, reader)
        total = sum(counts)
        per_pass = total if shard is None else len(range(shard[1], total, shard[0]))
        if per_pass == 0:
            raise ValueError(f"{', '.join(files)}: no records to train on.")
        epoch, offset = divmod(start, per_pass)
        first_block, within = divmod(offset, block)
        skip_records = first_block * block
        if shard is None:  # whole files first, without reading them
            for i in order(epoch).numpy():
                if skip_records < counts[i]:
                    break
                skip_records -= counts[i]
                skip_files += 1
    first = one_pass(tf.constant(epoch, tf.int64), skip_files, skip_records, first_block)
    later = tf.data.Dataset.range(epoch + 1, 2**62).flat_map(one_pass)
    return first.skip(within).concatenate(later)


def _records(split, files, reader, seed, start, shard):
    """The records of a split: the training stream, or the files once."""
    if split == "train":
        return training_records(files, reader, seed, start, shard)
    return _read(files, reader, shard)


def _files(pattern):
    """The files of a Model Garden `input_path`: comma-separated globs
    (through `tf.io.gfile`, so cloud storage paths work too)."""
    if not pattern:
        raise ValueError(
            "The task reads files but task.train_data.input_path is not set: pass "
            "--override task.train_data.input_path=PATH, or --synthetic."
        )
    found = sorted(f for part in str(pattern).split(",") for f in tf.io.gfile.glob(part.strip()))
    if not found:
        raise FileNotFoundError(f"No file matches input_path {pattern!r}.")
    return found


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
        names none (`train` must: `_files` says so)."""
        path = lookup(self._data_cfg(split), "input_path")
        return path if path or split == "train" else None

    def check_input(self, split):
        """Reads the first record of `split`'s first file and raises
        ValueError if it does not have the layout the config implies (a
        mismatch would otherwise surface as a parse error deep in `fit`)."""
        path = self.input_path(split)
        if path is None:
            return
        files = _files(path)
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
        for name in _files(path):
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


# --- BERT --------------------------------------------------------------------


class BertPretraining(Task):
    """BERT pretraining: masked LM on `max_predictions_per_seq` positions and
    next-sentence prediction, losses summed (as in BERT); the masked-LM loss
    is the mean over real (weight 1) predictions."""

    name = "bert"

    def __init__(self, cfg):
        super().__init__(cfg)
        bert = lookup(self.model_cfg, "encoder.bert", {})
        self.vocab_size = int(bert.get("vocab_size", 30522))
        self.hidden_size = int(bert.get("hidden_size", 768))
        self.num_layers = int(bert.get("num_layers", 12))
        self.num_heads = int(bert.get("num_attention_heads", 12))
        self.intermediate_size = int(bert.get("intermediate_size", 3072))
        self.max_position = int(bert.get("max_position_embeddings", 512))
        self.type_vocab_size = int(bert.get("type_vocab_size", 2))
        self.dropout = float(bert.get("dropout_rate", 0.1))
        data = self._data_cfg("train")
        self.seq_length = int(data.get("seq_length", 128))
        self.max_predictions = int(data.get("max_predictions_per_seq", 20))
        if self.seq_length > self.max_position:
            raise ValueError(
                f"task.train_data.seq_length {self.seq_length} exceeds the encoder's "
                f"max_position_embeddings {self.max_position}."
            )

    def build_model(self):
        import keras_hub

        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=self.vocab_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            hidden_dim=self.hidden_size,
            intermediate_dim=self.intermediate_size,
            dropout=self.dropout,
            max_sequence_length=self.max_position,
            num_segments=self.type_vocab_size,
        )
        inputs = {
            "token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
            "segment_ids": keras.Input((None,), dtype="int32", name="segment_ids"),
            "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask"),
            "mask_positions": keras.Input((None,), dtype="int32", name="mask_positions"),
        }
        encoded = backbone({k: inputs[k] for k in ("token_ids", "segment_ids", "padding_mask")})
        # Logits over the vocabulary, the output projection tied to the
        # token embedding (BERT's).
        mlm = keras_hub.layers.MaskedLMHead(
            token_embedding=backbone.token_embedding,
            intermediate_activation="gelu",
            name="mlm",
        )(encoded["sequence_output"], mask_positions=inputs["mask_positions"])
        nsp = keras.layers.Dense(2, name="nsp")(encoded["pooled_output"])
        return keras.Model(inputs, {"mlm": mlm, "nsp": nsp}, name="bert_pretraining")

    def compile_args(self):
        return {
            "loss": {
                "mlm": keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True, reduction="mean_with_sample_weight"
                ),
                "nsp": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            },
            "weighted_metrics": {"mlm": ["sparse_categorical_accuracy"]},
            "metrics": {"nsp": ["sparse_categorical_accuracy"]},
        }

    def _example(self, features):
        x = {
            "token_ids": features["input_ids"],
            "segment_ids": features["segment_ids"],
            "padding_mask": features["input_mask"],
            "mask_positions": features["masked_lm_positions"],
        }
        y = {"mlm": features["masked_lm_ids"], "nsp": features["next_sentence_labels"]}
        weights = {
            "mlm": features["masked_lm_weights"],
            "nsp": tf.ones_like(features["next_sentence_labels"], tf.float32),
        }
        return x, y, weights

    def feature_spec(self):
        """BERT's pretraining TFRecord features."""
        seq, preds = self.seq_length, self.max_predictions
        ints = tf.int64
        return {
            "input_ids": tf.io.FixedLenFeature([seq], ints),
            "input_mask": tf.io.FixedLenFeature([seq], ints),
            "segment_ids": tf.io.FixedLenFeature([seq], ints),
            "masked_lm_positions": tf.io.FixedLenFeature([preds], ints),
            "masked_lm_ids": tf.io.FixedLenFeature([preds], ints),
            "masked_lm_weights": tf.io.FixedLenFeature([preds], tf.float32),
            "next_sentence_labels": tf.io.FixedLenFeature([1], ints),
        }

    def _input_problem(self, files):
        example = _first_example(files[0])
        if example is None:
            return "no records."
        return self._example_problem(example)

    def _file_problem(self, name):
        return _tfrecord_problem(name, self._example_problem)

    def _example_problem(self, example):
        stored = example.features.feature
        fields = {self.seq_length: "seq_length", self.max_predictions: "max_predictions_per_seq"}
        for name, spec in self.feature_spec().items():
            if name not in stored:
                return (
                    f"no feature {name!r}; BERT's create_pretraining_data writes "
                    f"{', '.join(sorted(self.feature_spec()))}."
                )
            kind = "float_list" if spec.dtype == tf.float32 else "int64_list"
            count = len(getattr(stored[name], kind).value)
            if count != spec.shape[0]:
                field = fields.get(spec.shape[0])
                expected = f"task.train_data.{field} {spec.shape[0]}" if field else spec.shape[0]
                return f"{name} holds {count} {kind} values where the config expects {expected}."
        for name, bound, field in (
            ("input_ids", self.vocab_size, "task.model.encoder.bert.vocab_size"),
            ("masked_lm_ids", self.vocab_size, "task.model.encoder.bert.vocab_size"),
            ("segment_ids", self.type_vocab_size, "task.model.encoder.bert.type_vocab_size"),
            ("masked_lm_positions", self.seq_length, "task.train_data.seq_length"),
        ):
            values = stored[name].int64_list.value
            if values and not 0 <= min(values) <= max(values) < bound:
                return f"{name} holds values outside [0, {bound}) ({field})."
        return ""

    def _decode(self, record):
        features = tf.io.parse_single_example(record, self.feature_spec())
        features = {
            k: tf.cast(v, tf.int32) if v.dtype == tf.int64 else v for k, v in features.items()
        }
        features["next_sentence_labels"] = tf.reshape(features["next_sentence_labels"], [])
        # Out-of-range ids would read zeros from an embedding on a GPU.
        for name in ("input_ids", "masked_lm_ids"):
            features[name] = _labels_in_range(
                name, features[name], self.vocab_size, "task.model.encoder.bert.vocab_size"
            )
        features["segment_ids"] = _labels_in_range(
            "segment_ids",
            features["segment_ids"],
            self.type_vocab_size,
            "task.model.encoder.bert.type_vocab_size",
        )
        return self._example(features)

    def dataset(self, split, batch_size, seed, shard=None, start=0):
        path = self.input_path(split)
        if path is None:
            return None
        ds = _records(split, _files(path), tf.data.TFRecordDataset, seed, start, shard)
        ds = ds.map(self._decode, num_parallel_calls=tf.data.AUTOTUNE)
        return ds.batch(batch_size, drop_remainder=self._drop_remainder(split)).prefetch(
            tf.data.AUTOTUNE
        )

    def synthetic_batch(self, batch_size, seed):
        seq, preds = self.seq_length, self.max_predictions
        seeds = [[seed, i] for i in range(5)]
        positions = tf.random.stateless_uniform(
            [batch_size, preds], seeds[0], maxval=seq, dtype=tf.int32
        )
        features = {
            "input_ids": tf.random.stateless_uniform(
                [batch_size, seq], seeds[1], maxval=self.vocab_size, dtype=tf.int32
            ),
            "input_mask": tf.ones([batch_size, seq], tf.int32),
            "segment_ids": tf.random.stateless_uniform(
                [batch_size, seq], seeds[2], maxval=self.type_vocab_size, dtype=tf.int32
            ),
            "masked_lm_positions": positions,
            "masked_lm_ids": tf.random.stateless_uniform(
                [batch_size, preds], seeds[3], maxval=self.vocab_size, dtype=tf.int32
            ),
            "masked_lm_weights": tf.ones([batch_size, preds], tf.float32),
            "next_sentence_labels": tf.random.stateless_uniform(
                [batch_size], seeds[4], maxval=2, dtype=tf.int32
            ),
        }
        return self._example(features)


# --- image classification ---------------------------------------------------------

# ImageNet's per-channel mean and standard deviation (of 0-255 pixels).
IMAGENET_MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
IMAGENET_STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)
# CIFAR-10's, over the training set.
CIFAR_MEAN = (125.3, 123.0, 113.9)
CIFAR_STD = (63.0, 62.1, 66.7)
CIFAR_RECORD_BYTES = 1 + 32 * 32 * 3


class ImageClassification(Task):
    """ResNet-50 v1.5 on ImageNet TFRecords, or the CIFAR-10 ResNet-56
    (`resnet.model_id: 56`) on CIFAR-10 files.

    Labels are used as stored: Model Garden's ImageNet records count classes
    from 1 with 0 unused (`num_classes: 1001`).
    """

    name = "image_classification"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.depth = int(lookup(self.model_cfg, "resnet.model_id", 50))
        self.cifar = self.depth in resnet.CIFAR_DEPTHS
        if not self.cifar and self.depth not in resnet.IMAGENET_BLOCKS:
            raise ValueError(
                f"task.model.resnet.model_id must be one of "
                f"{sorted(resnet.IMAGENET_BLOCKS) + sorted(resnet.CIFAR_DEPTHS)}. "
                f"Received: {self.depth}"
            )
        default_size = [32, 32, 3] if self.cifar else [224, 224, 3]
        self.input_size = [int(s) for s in lookup(self.model_cfg, "input_size", default_size)]
        self.num_classes = int(lookup(self.model_cfg, "num_classes", 10 if self.cifar else 1001))
        losses = lookup(cfg, "task.losses", {})
        self.label_smoothing = float(losses.get("label_smoothing", 0.0) or 0.0)
        self.l2 = float(losses.get("l2_weight_decay", 0.0) or 0.0)

    def build_model(self):
        build = resnet.cifar_resnet if self.cifar else resnet.resnet_v1_5
        return build(
            self.depth,
            input_shape=tuple(self.input_size),
            num_classes=self.num_classes,
            l2_weight_decay=self.l2,
        )

    def compile_args(self):
        return {
            "loss": keras.losses.CategoricalCrossentropy(
                from_logits=True, label_smoothing=self.label_smoothing
            ),
            "metrics": ["categorical_accuracy"],
        }

    def _one_hot(self, image, label):
        # tf.one_hot makes zeros of a label out of range: refuse it.
        label = _labels_in_range("label", label, self.num_classes, "task.model.num_classes")
        return image, tf.one_hot(label, self.num_classes)

    def synthetic_batch(self, batch_size, seed):
        images = tf.random.stateless_normal([batch_size, *self.input_size], [seed, 0])
        labels = tf.random.stateless_uniform(
            [batch_size], [seed, 1], maxval=self.num_classes, dtype=tf.int32
        )
        return self._one_hot(images, labels)

    def dataset(self, split, batch_size, seed, shard=None, start=0):
        path = self.input_path(split)
        if path is None:
            return None
        training = split == "train"
        if self.cifar:
            files, reader, decode = self._cifar(path, training)
        else:
            files, reader, decode = _files(path), tf.data.TFRecordDataset, self._decode_imagenet
        preprocess = self._preprocess_cifar if self.cifar else self._preprocess_imagenet
        if training:
            # Example i of the stream is cropped and flipped by the seed
            # (seed, i): the same augmentation in every iterator and in a
            # resumed run, whatever order the parallel map runs in.
            ds = training_records(files, reader, seed, start, shard).enumerate(start=start)

            def example(index, record):
                image, label = decode(record)
                return self._one_hot(
                    preprocess(image, tf.stack([tf.constant(seed, tf.int64), index])), label
                )

        else:
            ds = _read(files, reader, shard)

            def example(record):
                image, label = decode(record)
                return self._one_hot(preprocess(image, None), label)

        ds = ds.map(example, num_parallel_calls=tf.data.AUTOTUNE)
        return ds.batch(batch_size, drop_remainder=self._drop_remainder(split)).prefetch(
            tf.data.AUTOTUNE
        )

    # ImageNet.

    def _input_problem(self, files):
        if self.cifar:
            return ""  # `check_input` reads CIFAR's files whole
        example = _first_example(files[0])
        if example is None:
            return "no records."
        return self._imagenet_example_problem(example)

    def _file_problem(self, name):
        if self.cifar:
            return _cifar_file_problem(name)
        return _tfrecord_problem(name, self._imagenet_example_problem)

    def _imagenet_example_problem(self, example):
        stored = example.features.feature
        for name in ("image/encoded", "image/class/label"):
            if name not in stored:
                return f"no feature {name!r} (Model Garden's ImageNet layout)."
        label = list(stored["image/class/label"].int64_list.value)
        if len(label) != 1 or not 0 <= label[0] < self.num_classes:
            return (
                f"image/class/label is {label}, not one label in [0, {self.num_classes}) "
                "(task.model.num_classes)."
            )
        return ""

    def check_input(self, split):
        if not self.cifar:
            return super().check_input(split)
        # CIFAR-10 is small enough to check whole before training.
        problem = self.find_record_problem(split)
        if problem:
            raise ValueError(f"task.{split}_data: {problem}")

    def find_record_problem(self, split):
        if not self.cifar:
            return super().find_record_problem(split)
        path = self.input_path(split)
        if path is None:
            return ""
        binary, python = _cifar_files(path, split == "train")
        for name in binary or python:
            problem = _cifar_file_problem(name)
            if problem:
                return f"{name}: {problem}"
        return ""

    @staticmethod
    def _decode_imagenet(record):
        features = tf.io.parse_single_example(
            record,
            {
                "image/encoded": tf.io.FixedLenFeature([], tf.string),
                "image/class/label": tf.io.FixedLenFeature([], tf.int64),
            },
        )
        return features["image/encoded"], tf.cast(features["image/class/label"], tf.int32)

    def _preprocess_imagenet(self, encoded, seed):
        """Inception-style crop (8% to 100% of the area, aspect 3/4 to 4/3)
        and flip for training (`seed`: the example's augmentation seed); the
        central 87.5% for evaluation (`seed` None); resized to the input size
        and standardised per channel."""
        height, width = self.input_size[:2]
        shape = tf.image.extract_jpeg_shape(encoded)
        training = seed is not None
        if training:
            crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
            begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
                shape,
                bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
                seed=crop_seed,
                min_object_covered=0.1,
                aspect_ratio_range=(3 / 4, 4 / 3),
                area_range=(0.08, 1.0),
                max_attempts=10,
                use_image_if_no_bounding_boxes=True,
            )
            window = tf.stack([begin[0], begin[1], size[0], size[1]])
        else:
            side = tf.cast(0.875 * tf.cast(tf.minimum(shape[0], shape[1]), tf.float32), tf.int32)
            window = tf.stack([(shape[0] - side) // 2, (shape[1] - side) // 2, side, side])
        image = tf.image.decode_and_crop_jpeg(encoded, window, channels=3)
        image = tf.image.resize(image, [height, width])
        if training:
            image = tf.image.stateless_random_flip_left_right(image, flip_seed)
        return (image - IMAGENET_MEAN) / IMAGENET_STD

    # CIFAR-10.

    def _cifar(self, path, training):
        """CIFAR-10 from a folder with the binary batches
        (`data_batch_1.bin`..., `test_batch.bin`) or the python ones
        (`data_batch_1`..., `test_batch`): (files, reader, decode), where
        `reader(files)` reads records and `decode(record)` makes an
        (image, label) of one. The python batches are read at once, as one
        "file" of all their records."""
        binary, python = _cifar_files(path, training)
        if binary:
            return (
                binary,
                lambda files: tf.data.FixedLengthRecordDataset(files, CIFAR_RECORD_BYTES),
                _decode_cifar_record,
            )
        images, labels = [], []
        for f in python:
            with open(f, "rb") as handle:
                batch = pickle.load(handle, encoding="bytes")
            images.append(np.asarray(batch[b"data"], np.uint8).reshape(-1, 3, 32, 32))
            labels.append(np.asarray(batch[b"labels"], np.int32))
        records = {
            "image": np.concatenate(images).transpose(0, 2, 3, 1),
            "label": np.concatenate(labels),
        }
        return (
            [path],
            lambda _: tf.data.Dataset.from_tensor_slices(records),
            lambda record: (record["image"], record["label"]),
        )

    def _preprocess_cifar(self, image, seed):
        """4-pixel padding, random 32x32 crop and flip for training (`seed`:
        the example's augmentation seed; None for evaluation); standardised
        per channel."""
        image = tf.cast(image, tf.float32)
        if seed is not None:
            crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, 2))
            image = tf.image.pad_to_bounding_box(image, 4, 4, 40, 40)
            image = tf.image.stateless_random_crop(image, [32, 32, 3], crop_seed)
            image = tf.image.stateless_random_flip_left_right(image, flip_seed)
        return (image - CIFAR_MEAN) / CIFAR_STD


def _cifar_files(path, training):
    """The CIFAR-10 batch files of a split in folder `path`: (binary, [])
    or ([], python); FileNotFoundError if it has neither set whole."""
    if not path or not os.path.isdir(path):
        raise FileNotFoundError(
            f"task.*_data.input_path must be a folder of CIFAR-10 batches. Received: {path!r}"
        )
    names = [f"data_batch_{i}" for i in range(1, 6)] if training else ["test_batch"]
    binary = [os.path.join(path, f"{n}.bin") for n in names]
    python = [os.path.join(path, n) for n in names]
    if all(os.path.exists(f) for f in binary):
        return binary, []
    if all(os.path.exists(f) for f in python):
        return [], python
    expected = ", ".join(os.path.basename(b) for b in binary)
    raise FileNotFoundError(
        f"{path} has neither CIFAR-10's binary batches ({expected}) nor its python batches."
    )


def _cifar_file_problem(name):
    """What is wrong with a CIFAR-10 batch file (binary or python): its
    size or layout, or the first label out of [0, 10); "" if nothing."""
    if name.endswith(".bin"):
        with tf.io.gfile.GFile(name, "rb") as f:
            data = np.frombuffer(f.read(), np.uint8)
        if data.size == 0 or data.size % CIFAR_RECORD_BYTES:
            return (
                f"{data.size} bytes, not a whole number of {CIFAR_RECORD_BYTES}-byte records "
                "(a label byte and 3072 pixel bytes each)."
            )
        labels = data[::CIFAR_RECORD_BYTES]
    else:
        try:
            with tf.io.gfile.GFile(name, "rb") as f:
                batch = pickle.load(f, encoding="bytes")
            rows = np.asarray(batch[b"data"])
            labels = np.asarray(batch[b"labels"])
        except Exception as error:  # any unpickling or layout failure
            return f"not a CIFAR-10 python batch ({type(error).__name__}: {error})."
        if rows.ndim != 2 or rows.shape[1] != 3072 or len(labels) != len(rows):
            return f"data of shape {rows.shape} and {len(labels)} labels, not [n, 3072] and n."
    bad = np.flatnonzero(labels >= 10)
    if bad.size:
        return f"record {bad[0]}: label {int(labels[bad[0]])}, not in [0, 10)."
    return ""


def _decode_cifar_record(record):
    raw = tf.io.decode_raw(record, tf.uint8)
    label = tf.cast(raw[0], tf.int32)
    image = tf.transpose(tf.reshape(raw[1:], [3, 32, 32]), [1, 2, 0])
    return image, label


# --- DLRM ----------------------------------------------------------------------

# Model Garden's DLRM defaults (Criteo Terabyte, MLPerf's vocabulary sizes).
CRITEO_VOCAB_SIZES = [
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10,
    2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
]  # fmt: skip
NUM_DENSE = 13


class Dlrm(Task):
    """DLRM: dense features through the bottom MLP, one embedding per
    categorical feature, pairwise dot products of all of them (Keras-RS
    `DotInteraction`) with the bottom output, then the top MLP to one
    logit. Criteo TSV lines: the label, 13 integer and 26 hexadecimal
    categorical features; integers enter as log(1 + max(x, 0)),
    categories are hashed into each table."""

    name = "dlrm"

    def __init__(self, cfg):
        super().__init__(cfg)
        m = self.model_cfg
        self.vocab_sizes = [int(v) for v in m.get("vocab_sizes", CRITEO_VOCAB_SIZES)]
        self.embedding_dim = int(m.get("embedding_dim", 128))
        self.bottom_mlp = [int(u) for u in m.get("bottom_mlp", [512, 256, self.embedding_dim])]
        self.top_mlp = [int(u) for u in m.get("top_mlp", [1024, 1024, 512, 256, 1])]
        self.num_dense = int(m.get("num_dense_features", NUM_DENSE))
        if self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                "task.model.bottom_mlp must end in embedding_dim "
                f"({self.embedding_dim}) for the dot interaction. Received: {self.bottom_mlp}"
            )
        if self.top_mlp[-1] != 1:
            raise ValueError(f"task.model.top_mlp must end in 1. Received: {self.top_mlp}")

    def build_model(self):
        import keras_rs

        dense = keras.Input((self.num_dense,), name="dense_features")
        sparse = keras.Input((len(self.vocab_sizes),), dtype="int32", name="sparse_features")
        x = dense
        for i, units in enumerate(self.bottom_mlp):
            x = keras.layers.Dense(units, activation="relu", name=f"bottom_{i}")(x)
        embeddings = [
            keras.layers.Embedding(size, self.embedding_dim, name=f"embedding_{i}")(sparse[:, i])
            for i, size in enumerate(self.vocab_sizes)
        ]
        interaction = keras_rs.layers.DotInteraction(name="interaction")([x, *embeddings])
        y = keras.layers.Concatenate(name="top_input")([x, interaction])
        for i, units in enumerate(self.top_mlp):
            last = i == len(self.top_mlp) - 1
            y = keras.layers.Dense(units, activation=None if last else "relu", name=f"top_{i}")(y)
        return keras.Model({"dense_features": dense, "sparse_features": sparse}, y, name="dlrm")

    def compile_args(self):
        return {
            "loss": keras.losses.BinaryCrossentropy(from_logits=True),
            "metrics": [keras.metrics.AUC(from_logits=True, name="auc")],
        }

    def _input_problem(self, files):
        with tf.io.gfile.GFile(files[0]) as f:
            line = f.readline().rstrip("\n")
        if not line:
            return "no lines."
        expected = 1 + self.num_dense + len(self.vocab_sizes)
        count = len(line.split("\t"))
        if count != expected:
            return (
                f"the first line has {count} tab-separated fields; the config expects "
                f"{expected} (label, {self.num_dense} integers, {len(self.vocab_sizes)} "
                "categories: task.model.num_dense_features and vocab_sizes)."
            )
        return ""

    def _file_problem(self, name):
        expected = 1 + self.num_dense + len(self.vocab_sizes)
        with tf.io.gfile.GFile(name) as f:
            for number, line in enumerate(f, start=1):
                fields = line.rstrip("\n").split("\t")
                if len(fields) != expected:
                    return (
                        f"line {number}: {len(fields)} tab-separated fields; the config expects "
                        f"{expected} (task.model.num_dense_features and vocab_sizes)."
                    )
                if fields[0] not in ("0", "1"):
                    return f"line {number}: label {fields[0]!r}, not 0 or 1."
                for i, value in enumerate(fields[1 : 1 + self.num_dense], start=1):
                    if value and not _is_number(value):
                        return f"line {number}: integer feature {i} is {value!r}, not a number."
        return ""

    def _parse_lines(self, lines):
        defaults = [[0.0]] + [[0.0]] * self.num_dense + [[""]] * len(self.vocab_sizes)
        columns = tf.io.decode_csv(lines, defaults, field_delim="\t")
        # Clicks are 0 or 1; another label would train silently.
        valid = tf.reduce_all((columns[0] == 0.0) | (columns[0] == 1.0))
        check = tf.debugging.Assert(valid, ["Criteo labels must be 0 or 1:", columns[0]])
        with tf.control_dependencies([check]):
            label = tf.reshape(columns[0], [-1, 1])
        dense = tf.math.log1p(tf.maximum(tf.stack(columns[1 : 1 + self.num_dense], 1), 0.0))
        sparse = tf.stack(
            [
                tf.strings.to_hash_bucket_fast(column, size)
                for column, size in zip(columns[1 + self.num_dense :], self.vocab_sizes)
            ],
            1,
        )
        features = {"dense_features": dense, "sparse_features": tf.cast(sparse, tf.int32)}
        return features, label

    def dataset(self, split, batch_size, seed, shard=None, start=0):
        path = self.input_path(split)
        if path is None:
            return None
        ds = _records(split, _files(path), tf.data.TextLineDataset, seed, start, shard)
        ds = ds.batch(batch_size, drop_remainder=self._drop_remainder(split))
        return ds.map(self._parse_lines, num_parallel_calls=tf.data.AUTOTUNE).prefetch(
            tf.data.AUTOTUNE
        )

    def synthetic_batch(self, batch_size, seed):
        dense = tf.math.log1p(
            tf.random.stateless_uniform([batch_size, self.num_dense], [seed, 0], maxval=100.0)
        )
        sparse = tf.stack(
            [
                tf.random.stateless_uniform(
                    [batch_size], [seed, 1 + i], maxval=size, dtype=tf.int32
                )
                for i, size in enumerate(self.vocab_sizes)
            ],
            1,
        )
        labels = tf.cast(
            tf.random.stateless_uniform([batch_size, 1], [seed, 99]) < 0.25, tf.float32
        )
        return {"dense_features": dense, "sparse_features": sparse}, labels


def _is_number(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


TASKS = {"bert": BertPretraining, "resnet": ImageClassification, "dlrm": Dlrm}


def from_config(cfg):
    """The task of an experiment, by `task.model.type`."""
    kind = lookup(cfg, "task.model.type")
    if kind not in TASKS:
        raise ValueError(
            f"task.model.type must be one of {sorted(TASKS)} or fashion_mnist_cnn. "
            f"Received: {kind!r}"
        )
    return TASKS[kind](cfg)
