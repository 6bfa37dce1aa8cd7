"""Small files in the real input formats of the paper's tasks, written by
the tests (never fetched): BERT pretraining TFRecords, CIFAR-10 binary and
python batches, ImageNet TFRecords with JPEGs, Criteo TSV lines. Each
writer returns what it wrote, for the tests to compare the decoded input
against."""

import json
import os
import pickle

import numpy as np
import tensorflow as tf


def _int64(values):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in values]))


def _float(values):
    return tf.train.Feature(float_list=tf.train.FloatList(value=[float(v) for v in values]))


def _bytes(value):
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))


def write_bert_records(path, count, seq_length, max_predictions, vocab_size, seed=0):
    """BERT `create_pretraining_data` records: real tokens then padding,
    some prediction slots unused (weight 0, id 0, position 0)."""
    rng = np.random.default_rng(seed)
    examples = []
    with tf.io.TFRecordWriter(path) as writer:
        for _ in range(count):
            length = int(rng.integers(seq_length // 2, seq_length + 1))
            ids = np.zeros(seq_length, np.int64)
            ids[:length] = rng.integers(1, vocab_size, length)
            mask = (np.arange(seq_length) < length).astype(np.int64)
            segments = np.zeros(seq_length, np.int64)
            segments[length // 2 : length] = 1
            used = int(rng.integers(1, max_predictions + 1))
            positions = np.zeros(max_predictions, np.int64)
            positions[:used] = np.sort(rng.choice(length, used, replace=False))
            labels = np.zeros(max_predictions, np.int64)
            labels[:used] = rng.integers(1, vocab_size, used)
            weights = (np.arange(max_predictions) < used).astype(np.float32)
            next_sentence = int(rng.integers(0, 2))
            example = {
                "input_ids": ids,
                "input_mask": mask,
                "segment_ids": segments,
                "masked_lm_positions": positions,
                "masked_lm_ids": labels,
                "masked_lm_weights": weights,
                "next_sentence_labels": np.array([next_sentence]),
            }
            features = {
                k: _float(v) if v.dtype == np.float32 else _int64(v) for k, v in example.items()
            }
            writer.write(
                tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()
            )
            examples.append(example)
    return examples


def _cifar_arrays(count, seed):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (count, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, count).astype(np.uint8)
    return images, labels


CIFAR_TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]


def write_cifar(folder, per_file, python=False, seed=0, label=None):
    """CIFAR-10's five train batches and its test batch: binary
    (`<name>.bin`, label byte then 3072 bytes in CHW order) or python
    (pickled dicts of b"data" [n, 3072] CHW rows and b"labels"); every
    label `label` if given (a mean gradient that stands out of the noise).
    Returns {"train": (images, labels), "test": ...} in HWC order."""
    os.makedirs(folder, exist_ok=True)
    written = {}
    for split, names in (("train", CIFAR_TRAIN_FILES), ("test", ["test_batch"])):
        images, labels = [], []
        for i, name in enumerate(names):
            x, y = _cifar_arrays(per_file, seed * 100 + i + (50 if split == "test" else 0))
            if label is not None:
                y = np.full_like(y, label)
            rows = x.transpose(0, 3, 1, 2).reshape(per_file, -1)
            if python:
                with open(os.path.join(folder, name), "wb") as f:
                    pickle.dump({b"data": rows, b"labels": [int(v) for v in y]}, f)
            else:
                with open(os.path.join(folder, f"{name}.bin"), "wb") as f:
                    f.write(np.concatenate([y[:, None], rows], 1).tobytes())
            images.append(x)
            labels.append(y)
        written[split] = (np.concatenate(images), np.concatenate(labels))
    return written


def write_imagenet_records(path, count, size=(48, 64), num_classes=1001, seed=0):
    """ImageNet TFRecords as Model Garden's converter writes them (JPEG in
    `image/encoded`, label in `image/class/label`)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(1, num_classes, count)
    with tf.io.TFRecordWriter(path) as writer:
        for label in labels:
            image = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            features = {
                "image/encoded": _bytes(tf.io.encode_jpeg(image).numpy()),
                "image/class/label": _int64([label]),
                "image/format": _bytes(b"JPEG"),
            }
            writer.write(
                tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()
            )
    return labels


def write_criteo(path, count, seed=0, label=None):
    """Criteo TSV lines: label, 13 integer features (some missing, some
    negative), 26 hexadecimal categories (some missing). Returns the label
    and integer columns (NaN where missing)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, count) if label is None else np.full(count, label)
    dense = rng.integers(-2, 1000, (count, 13)).astype(np.float64)
    dense[rng.random((count, 13)) < 0.1] = np.nan
    with open(path, "w") as f:
        for label, row in zip(labels, dense):
            ints = ["" if np.isnan(v) else str(int(v)) for v in row]
            cats = [
                "" if rng.random() < 0.1 else f"{int(rng.integers(0, 2**32)):08x}"
                for _ in range(26)
            ]
            f.write("\t".join([str(label), *ints, *cats]) + "\n")
    return labels, dense


def write_preprocessed_criteo(path, count, vocab_size, seed=0):
    """Model Garden's preprocessed Criteo TSV lines: label, 13 features
    already log(1 + x), 26 integer ids below `vocab_size`. Returns the ids
    (count x 26)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, count)
    dense = np.log1p(rng.integers(0, 1000, (count, 13)))
    ids = rng.integers(0, vocab_size, (count, 26))
    with open(path, "w") as f:
        for label, row, cats in zip(labels, dense, ids):
            f.write("\t".join([str(label), *(f"{v:.6f}" for v in row), *map(str, cats)]) + "\n")
    return ids


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER = os.path.join(ROOT, "configs", "paper")


def _tiny(task):
    from tf_vrgd.experiments import tasks

    return {**tasks.TINY_SIZES[task], "task.train_data.global_batch_size": 16}


# Overrides that make each paper task small enough for a test.
TINY_BERT = _tiny("bert")
TINY_DLRM = _tiny("dlrm")
TINY_CIFAR = _tiny("resnet")


def paper_config(name, overrides):
    """The experiment `configs/paper/<name>` with `overrides` ({dotted key:
    value}) applied as `--override` applies them."""
    from tf_vrgd import config
    from tf_vrgd.experiments import experiment_config

    return experiment_config.apply_overrides(
        config.load(os.path.join(PAPER, name)),
        [f"{k}={json.dumps(v)}" for k, v in overrides.items()],
    )


def flat(batch):
    """The tensors of a (nested) batch as numpy arrays, in order."""
    return [np.asarray(t) for t in tf.nest.flatten(batch)]
