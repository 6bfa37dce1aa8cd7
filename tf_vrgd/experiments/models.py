"""Models of the CPU-scale experiments."""

import keras


def fashion_mnist_cnn(num_classes=10, width=32, name="fashion_mnist_cnn"):
    """A small CNN for 28x28x1 images in [0, 1] (about 0.2 M parameters at
    width 32): two conv/pool blocks and a dense head, no batch norm, so that
    every trainable variable is updated by the optimizer under test."""
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(width, 3, activation="relu", name="conv1"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(2 * width, 3, activation="relu", name="conv2"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(4 * width, activation="relu", name="dense"),
            keras.layers.Dense(num_classes, name="logits"),
        ],
        name=name,
    )
