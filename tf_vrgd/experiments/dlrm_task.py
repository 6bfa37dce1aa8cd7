"""DLRM (bottom MLP, embedding tables, Keras-RS's dot interaction, top
MLP) on Criteo's TSV lines."""

import keras
import tensorflow as tf

from tf_vrgd.experiments.records import input_files, split_records
from tf_vrgd.experiments.task import Task

# Model Garden's DLRM defaults (Criteo Terabyte, MLPerf's vocabulary sizes).
CRITEO_VOCAB_SIZES = [
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10,
    2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
]  # fmt: skip
NUM_DENSE = 13
# NVIDIA's DLRM on Criteo Terabyte, the paper's model.
EMBEDDING_DIM = 128
BOTTOM_MLP = (512, 256, EMBEDDING_DIM)
TOP_MLP = (1024, 1024, 512, 256, 1)


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
        self.embedding_dim = int(m.get("embedding_dim", EMBEDDING_DIM))
        self.bottom_mlp = [
            int(u) for u in m.get("bottom_mlp", [*BOTTOM_MLP[:-1], self.embedding_dim])
        ]
        self.top_mlp = [int(u) for u in m.get("top_mlp", TOP_MLP)]
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
        ds = split_records(split, input_files(path), tf.data.TextLineDataset, seed, start, shard)
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
