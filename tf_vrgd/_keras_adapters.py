"""Small adapters to Keras 3's optimizer internals (TensorFlow backend),
shared by the cross-replica update paths of this package (`_gsnr`,
`_accumulation`): the update-step test of gradient accumulation, the
`tf.Variable` behind a Keras variable, Keras' decoupled weight decay and
its EMA step. Keras' private names are read here and in those two modules
only; `tests/test_vr_keras.py` pins the Keras range they are written for.
"""

import keras
import tensorflow as tf


def is_update_step(optimizer):
    """Whether this `apply` ends an accumulation: `_iterations` counts
    micro-steps and is incremented after `apply`, so replica and
    cross-replica code read the same value."""
    return tf.equal((optimizer._iterations + 1) % optimizer.gradient_accumulation_steps, 0)


def build_without_keras_accumulators(optimizer, keras_build, var_list):
    """Runs Keras' `build` (`keras_build`, the base class' bound method)
    with `optimizer.gradient_accumulation_steps` hidden, so that Keras
    makes no accumulators: its own are mirrored variables (only one
    replica's partial sum would be kept and saved), and the package's
    replace them."""
    steps = optimizer.gradient_accumulation_steps
    optimizer.gradient_accumulation_steps = None
    try:
        keras_build(var_list)
    finally:
        optimizer.gradient_accumulation_steps = steps


def tf_variable(variable):
    """The `tf.Variable` behind a Keras variable (a plain one is itself)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def decay(variable, weight_decay, learning_rate):
    """Keras' decoupled weight decay: ``w -= w * weight_decay * lr``."""
    variable.assign_sub(
        variable * tf.cast(weight_decay, variable.dtype) * tf.cast(learning_rate, variable.dtype)
    )


def decay_weights(optimizer, distribution, variables, learning_rate):
    """Cross-replica context: Keras' decoupled weight decay of `variables`
    (Keras variables; those `_use_weight_decay` takes) at `learning_rate`,
    on each device, before the update step."""
    if optimizer.weight_decay is None:
        return
    for variable in variables:
        if optimizer._use_weight_decay(variable):
            distribution.extended.update(
                tf_variable(variable),
                decay,
                args=(optimizer.weight_decay, learning_rate),
                group=False,
            )


def apply_moving_average(optimizer, replica_context):
    """Keras' EMA step after an `apply` (once per call, micro-steps
    included, as Keras does), with the periodic overwrite of the model's
    variables made in cross-replica context, where its `tf.cond` may hold
    per-device updates under MirroredStrategy."""
    if not optimizer.use_ema:
        return
    optimizer._update_model_variables_moving_average(optimizer._trainable_variables)
    if optimizer.ema_overwrite_frequency:
        replica_context.merge_call(_overwrite_with_moving_average, args=(optimizer,))


def _overwrite_with_moving_average(distribution, optimizer):
    del distribution  # Keras' method uses the optimizer's own.
    tf.cond(
        tf.equal((optimizer.iterations + 1) % optimizer.ema_overwrite_frequency, 0),
        lambda: optimizer._overwrite_model_variables_with_average_value(
            optimizer._trainable_variables
        ),
        lambda: None,
    )


class Untracked:
    """Holds a value out of sight of Keras' and TensorFlow's trackers, so
    that it is neither optimizer state nor saved in checkpoints."""

    def __init__(self, value):
        self.value = value
