"""The ResNets of the paper's image tasks, as Keras functional models.

- `resnet_v1_5`: the ImageNet bottleneck ResNet (He et al. 2016) with the
  stride of each down-sampling block on its 3x3 convolution (v1.5, as in
  Model Garden and NVIDIA's recipes; `keras.applications.ResNet50` puts it
  on the first 1x1).
- `cifar_resnet`: the CIFAR ResNet of He et al. (2016, section 4.2): depth
  6n + 2, three stages of n basic blocks with 16, 32 and 64 filters;
  ResNet-56 is n = 9, ResNet-8 (n = 1) the tiny size of the checks.
  Shortcuts change shape through a 1x1 projection.

Batch normalisation as in Model Garden (momentum 0.99, epsilon 0.001); with
`l2_weight_decay`, each kernel adds ``l2_weight_decay / 2 * ||w||^2`` to the
loss (Model Garden's convention).
"""

import keras

IMAGENET_BLOCKS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


def is_cifar_depth(depth):
    """Whether `depth` names a CIFAR ResNet: 6n + 2 with n >= 1 (8, 20, ..., 56,
    110), except the ImageNet depths of that form (50 and 152), which name
    the ImageNet ResNets."""
    return depth >= 8 and (depth - 2) % 6 == 0 and depth not in IMAGENET_BLOCKS


_BN = {"momentum": 0.99, "epsilon": 0.001}


def _conv_kwargs(l2_weight_decay):
    return {
        "use_bias": False,
        "padding": "same",
        "kernel_initializer": "he_normal",
        "kernel_regularizer": (
            keras.regularizers.L2(l2_weight_decay / 2) if l2_weight_decay else None
        ),
    }


def _bottleneck(x, filters, stride, conv):
    shortcut = x
    if stride != 1 or x.shape[-1] != 4 * filters:
        shortcut = keras.layers.Conv2D(4 * filters, 1, strides=stride, **conv)(x)
        shortcut = keras.layers.BatchNormalization(**_BN)(shortcut)
    y = keras.layers.Conv2D(filters, 1, **conv)(x)
    y = keras.layers.ReLU()(keras.layers.BatchNormalization(**_BN)(y))
    y = keras.layers.Conv2D(filters, 3, strides=stride, **conv)(y)
    y = keras.layers.ReLU()(keras.layers.BatchNormalization(**_BN)(y))
    y = keras.layers.Conv2D(4 * filters, 1, **conv)(y)
    y = keras.layers.BatchNormalization(**_BN)(y)
    return keras.layers.ReLU()(keras.layers.Add()([shortcut, y]))


def _basic(x, filters, stride, conv):
    shortcut = x
    if stride != 1 or x.shape[-1] != filters:
        shortcut = keras.layers.Conv2D(filters, 1, strides=stride, **conv)(x)
        shortcut = keras.layers.BatchNormalization(**_BN)(shortcut)
    y = keras.layers.Conv2D(filters, 3, strides=stride, **conv)(x)
    y = keras.layers.ReLU()(keras.layers.BatchNormalization(**_BN)(y))
    y = keras.layers.Conv2D(filters, 3, **conv)(y)
    y = keras.layers.BatchNormalization(**_BN)(y)
    return keras.layers.ReLU()(keras.layers.Add()([shortcut, y]))


def _head(x, num_classes, l2_weight_decay):
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.layers.Dense(
        num_classes,
        kernel_regularizer=keras.regularizers.L2(l2_weight_decay / 2) if l2_weight_decay else None,
        name="logits",
    )(x)


def resnet_v1_5(depth=50, input_shape=(224, 224, 3), num_classes=1001, l2_weight_decay=0.0):
    """The ImageNet ResNet v1.5 of `depth` (50, 101 or 152); logits out."""
    if depth not in IMAGENET_BLOCKS:
        raise ValueError(f"depth must be one of {sorted(IMAGENET_BLOCKS)}. Received: {depth}")
    conv = _conv_kwargs(l2_weight_decay)
    inputs = keras.Input(input_shape)
    x = keras.layers.Conv2D(64, 7, strides=2, **conv)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(**_BN)(x))
    x = keras.layers.MaxPooling2D(3, strides=2, padding="same")(x)
    for stage, blocks in enumerate(IMAGENET_BLOCKS[depth]):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            x = _bottleneck(x, 64 * 2**stage, stride, conv)
    return keras.Model(inputs, _head(x, num_classes, l2_weight_decay), name=f"resnet{depth}")


def cifar_resnet(depth=56, input_shape=(32, 32, 3), num_classes=10, l2_weight_decay=0.0):
    """The CIFAR ResNet of `depth` = 6n + 2 (n >= 1: 8, 20, ..., 56, 110); logits out."""
    if not is_cifar_depth(depth):
        raise ValueError(
            f"depth must be 6n + 2 for some n >= 1, other than {sorted(IMAGENET_BLOCKS)} "
            f"(8, 20, 56...). Received: {depth}"
        )
    n = (depth - 2) // 6
    conv = _conv_kwargs(l2_weight_decay)
    inputs = keras.Input(input_shape)
    x = keras.layers.Conv2D(16, 3, **conv)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(**_BN)(x))
    for stage in range(3):
        for block in range(n):
            stride = 2 if stage > 0 and block == 0 else 1
            x = _basic(x, 16 * 2**stage, stride, conv)
    return keras.Model(inputs, _head(x, num_classes, l2_weight_decay), name=f"cifar_resnet{depth}")
