"""`LossScaleOptimizer`: Keras' dynamic loss scaling with its overflow
check agreed across replicas."""

import keras
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tf_vrgd")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Keras' `LossScaleOptimizer` whose overflow check counts every
    replica.

    Under `MirroredStrategy`, Keras 3.15's wrapper decides whether to skip
    a step from the first replica's gradients alone (its check assumes
    gradients that are already summed across replicas, which Keras 3's
    optimizers sum later, in `apply`): an overflow on another replica is
    applied. Here each replica's check is all-reduced (one number per
    replica): if any replica's gradients hold a NaN or an Inf, every replica
    skips the step and the scale halves, as on one device. Arguments,
    config and state are Keras'.

    Under "mixed_float16", `model.compile` keeps a `LossScaleOptimizer` it
    is given instead of wrapping the optimizer in Keras' own:
    ``model.compile(optimizer=tf_vrgd.LossScaleOptimizer(tf_vrgd.VRAdam()))``.

    Args:
        inner_optimizer: The optimizer to wrap (any Keras optimizer).
        initial_scale: Float, the first loss scale. Defaults to 2**15.
        dynamic_growth_steps: Int, double the scale after this many steps
            without an overflow. Defaults to 2000.
        name: String, the optimizer's name. Defaults to None.
    """

    def check_finite(self, grads):
        finite = super().check_finite(grads)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return finite
        overflowed = context.all_reduce("sum", 1.0 - tf.cast(finite, tf.float32))
        return tf.equal(overflowed, 0.0)
