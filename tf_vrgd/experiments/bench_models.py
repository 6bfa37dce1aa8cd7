"""The models the step-cost benchmarks time, at real layer structures
(ResNet-50, a BERT-style encoder) and small ones (an MLP, the Fashion-MNIST
CNN), and fixed random batches for them."""

import keras
import numpy as np


def mlp(parameters=10_000_000, inputs=784, outputs=10):
    """A 3-hidden-layer MLP with about `parameters` weights."""
    # inputs*h + 2*h*h + h*outputs ~= parameters
    a, b, c = 2.0, inputs + outputs, -float(parameters)
    width = int((-b + np.sqrt(b * b - 4 * a * c)) / (2 * a))
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(outputs),
        ]
    )


def thin_mlp(layers=107, width=16, inputs=16, outputs=10):
    """`layers` Dense layers of `width` units: 2 x `layers` variables of at
    most width x width elements (214 variables and 27 k parameters by
    default, as many variables as ResNet-50), so that a step costs what an
    optimizer does per variable and nearly nothing per element."""
    hidden = [keras.layers.Dense(width, activation="relu") for _ in range(layers - 1)]
    return keras.Sequential([keras.Input((inputs,)), *hidden, keras.layers.Dense(outputs)])


def resnet50(classes=10, size=32):
    """`keras.applications.ResNet50` on size x size x 3 inputs, untrained:
    214 trainable variables (161 of them batch-norm scales and offsets)."""
    return keras.applications.ResNet50(
        weights=None, input_shape=(size, size, 3), classes=classes, classifier_activation=None
    )


class _PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to its token embedding."""

    def build(self, input_shape):
        self.embeddings = self.add_weight(
            shape=input_shape[1:], initializer="random_normal", name="embeddings"
        )

    def call(self, inputs):
        return inputs + self.embeddings


def encoder(
    blocks=12, hidden=256, heads=4, intermediate=1024, vocabulary=1000, sequence=32, classes=10
):
    """A BERT-style encoder built from Keras layers: token and position
    embeddings, `blocks` post-norm transformer blocks (`MultiHeadAttention`,
    `LayerNormalization`, a two-`Dense` feed-forward) and a classifier on
    the mean token. At the defaults: 196 trainable variables, 9.8 M
    parameters."""
    tokens = keras.Input((sequence,), dtype="int32")
    x = _PositionEmbedding()(keras.layers.Embedding(vocabulary, hidden)(tokens))
    for _ in range(blocks):
        attention = keras.layers.MultiHeadAttention(heads, hidden // heads)(x, x)
        x = keras.layers.LayerNormalization()(x + attention)
        feed_forward = keras.layers.Dense(intermediate, activation="gelu")(x)
        feed_forward = keras.layers.Dense(hidden)(feed_forward)
        x = keras.layers.LayerNormalization()(x + feed_forward)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(classes)(x))


def tables(count=26, rows=1000, width=16, classes=10):
    """DLRM's categorical side in small: `count` embedding tables of
    `rows` x `width` (26 as for Criteo's categorical features), one id per
    table and example, concatenated into a two-layer head. The tables'
    gradients arrive as `tf.IndexedSlices` (the VR row-sparse path)."""
    ids = keras.Input((count,), dtype="int32")
    columns = [keras.layers.Embedding(rows, width)(ids[:, i]) for i in range(count)]
    x = keras.layers.Dense(64, activation="relu")(keras.layers.Concatenate()(columns))
    return keras.Model(ids, keras.layers.Dense(classes)(x))


def parameter_count(model):
    return int(sum(np.prod(v.shape) for v in model.trainable_variables))


def cnn():
    """The small Fashion-MNIST CNN of the CPU-scale experiments."""
    from tf_vrgd.experiments import models

    return models.fashion_mnist_cnn()


def make_batch(model_name, global_batch, rng, image_size=32):
    """A fixed random batch of inputs and integer labels for `model_name`."""
    shapes = {
        "mlp": (784,),
        "thin_mlp": (16,),
        "cnn": (28, 28, 1),
        "resnet50": (image_size, image_size, 3),
    }
    if model_name == "encoder":
        x = rng.integers(0, 1000, (global_batch, 32)).astype(np.int32)
    elif model_name == "tables":
        x = rng.integers(0, 1000, (global_batch, 26)).astype(np.int32)
    else:
        x = rng.random((global_batch, *shapes[model_name]), np.float32)
    return x, rng.integers(0, 10, global_batch).astype(np.int32)
