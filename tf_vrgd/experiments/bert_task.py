"""BERT pretraining on KerasHub's `BertBackbone`, reading the TFRecords of
BERT's `create_pretraining_data`."""

import keras
import tensorflow as tf

from tf_vrgd.experiments.experiment_config import lookup
from tf_vrgd.experiments.records import (
    first_example,
    input_files,
    labels_in_range,
    split_records,
    tfrecord_problem,
)
from tf_vrgd.experiments.task import Task


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
        example = first_example(files[0])
        if example is None:
            return "no records."
        return self._example_problem(example)

    def _file_problem(self, name):
        return tfrecord_problem(name, self._example_problem)

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
            features[name] = labels_in_range(
                name, features[name], self.vocab_size, "task.model.encoder.bert.vocab_size"
            )
        features["segment_ids"] = labels_in_range(
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
        ds = split_records(split, input_files(path), tf.data.TFRecordDataset, seed, start, shard)
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
