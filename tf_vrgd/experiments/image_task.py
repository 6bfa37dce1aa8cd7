"""Image classification: ResNet-50 v1.5 on ImageNet TFRecords
(`image/encoded`, `image/class/label`), or ResNet-56 on CIFAR-10's binary or
python batches."""

import os
import pickle

import keras
import numpy as np
import tensorflow as tf

from tf_vrgd.experiments import resnet
from tf_vrgd.experiments.experiment_config import lookup
from tf_vrgd.experiments.records import (
    first_example,
    input_files,
    labels_in_range,
    read_in_order,
    tfrecord_problem,
    training_records,
)
from tf_vrgd.experiments.task import Task

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
        self.cifar = resnet.is_cifar_depth(self.depth)
        if not self.cifar and self.depth not in resnet.IMAGENET_BLOCKS:
            raise ValueError(
                f"task.model.resnet.model_id must be one of {sorted(resnet.IMAGENET_BLOCKS)} "
                f"(ImageNet) or another 6n + 2 for some n >= 1 (CIFAR: 8, 20, 56...). "
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
        label = labels_in_range("label", label, self.num_classes, "task.model.num_classes")
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
            files, reader = input_files(path), tf.data.TFRecordDataset
            decode = self._decode_imagenet
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
            ds = read_in_order(files, reader, shard)

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
        example = first_example(files[0])
        if example is None:
            return "no records."
        return self._imagenet_example_problem(example)

    def _file_problem(self, name):
        if self.cifar:
            return _cifar_file_problem(name)
        return tfrecord_problem(name, self._imagenet_example_problem)

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
