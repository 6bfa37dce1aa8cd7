"""LARS: layer-wise adaptive rate scaling with classic momentum.

Rule of You, Gitman and Ginsburg (2017), "Large Batch Training of
Convolutional Networks", in the form of the TF Model Garden `LARS`
(`official/modeling/optimization/lars.py`, `classic_momentum=True`). Keras 3
ships no LARS, and Model Garden's is Keras 2 only and does not save its
exclusion lists; this one is a Keras 3 optimizer that does.
"""

import keras
import tensorflow as tf

from tf_vrgd import functional, validation
from tf_vrgd._accumulation import ReplicaAccumulationMixin
from tf_vrgd._exclusion import LayerwiseExclusionMixin
from tf_vrgd._types import LearningRate, Patterns


@keras.saving.register_keras_serializable(package="tf_vrgd")
class LARS(LayerwiseExclusionMixin, ReplicaAccumulationMixin, keras.optimizers.Optimizer):
    """Layer-wise Adaptive Rate Scaling (You et al. 2017), classic momentum.

    Per variable `w` with gradient `g`, learning rate `lr`:

        u     = g + weight_decay_rate * w      (decay omitted if excluded)
        trust = trust_coefficient * ||w|| / ||u||   if ||w|| > 0 and ||u|| > 0
                1                                   otherwise, or if excluded
                                                    from layer adaptation
        v     <- momentum * v + lr * trust * u
        w     <- w - v                                    (nesterov=False)
        w     <- w - (momentum * v + lr * trust * u)      (nesterov=True)

    This is the Model Garden LARS with `classic_momentum=True`: the learning
    rate enters the velocity, so a change of learning rate affects only new
    contributions. Norms are taken in float32 on the cross-replica reduced
    gradient. Sparse gradients are densified (the trust ratio needs the
    whole variable). With `momentum=0` no velocity slot is created.

    Args:
        learning_rate: Float >= 0, a `keras.optimizers.schedules.
            LearningRateSchedule` or a callable. Defaults to 0.1.
        momentum: Float in [0, 1). Defaults to 0.9.
        nesterov: Bool, Nesterov momentum. Defaults to False.
        trust_coefficient: Float > 0, LARS' eta (Model Garden's `eeta`).
            Defaults to 0.001.
        weight_decay_rate: Float >= 0, coupled L2 decay added to the gradient
            before the trust ratio. Defaults to 0.0. (Keras' decoupled
            `weight_decay` keeps its Keras meaning and can be combined.)
        exclude_from_weight_decay: List of regular expressions searched in
            variable paths; matching variables get no weight decay of either
            kind. Defaults to None.
        exclude_from_layer_adaptation: List of regular expressions; matching
            variables use trust 1. Defaults to None, meaning the
            `exclude_from_weight_decay` list. An empty list excludes nothing
            (every variable is adapted); Model Garden's class, and this
            package's config reader (`tf_vrgd.config`), read an empty list
            as None instead.
        **kwargs: Keras base optimizer arguments (`name`, `weight_decay`,
            `clipnorm`, `clipvalue`, `global_clipnorm`, `use_ema`,
            `ema_momentum`, `ema_overwrite_frequency`, `loss_scale_factor`,
            `gradient_accumulation_steps`).
    """

    def __init__(
        self,
        learning_rate: LearningRate = 0.1,
        momentum: float = 0.9,
        nesterov: bool = False,
        trust_coefficient: float = 0.001,
        weight_decay_rate: float = 0.0,
        exclude_from_weight_decay: Patterns = None,
        exclude_from_layer_adaptation: Patterns = None,
        **kwargs,
    ) -> None:
        validation.check_learning_rate(learning_rate)
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.momentum = validation.check_number(
            "momentum", momentum, low=0.0, high=1.0, high_open=True
        )
        self.nesterov = validation.check_bool("nesterov", nesterov)
        self.trust_coefficient = validation.check_number(
            "trust_coefficient", trust_coefficient, low=0.0, low_open=True
        )
        self._init_exclusions(
            exclude_from_weight_decay, exclude_from_layer_adaptation, weight_decay_rate
        )

    def _build_slots(self, var_list):
        self._velocities = (
            self.add_optimizer_variables(var_list, "velocity")
            if self.momentum
            else [None] * len(var_list)
        )

    def update_step(self, gradient, variable, learning_rate):
        index = self._get_variable_index(variable)
        gradient = functional.as_float32(gradient)
        weight = tf.cast(variable, tf.float32)
        learning_rate = tf.cast(learning_rate, tf.float32)

        u, ratio = functional.layerwise_update(
            gradient,
            weight,
            self.weight_decay_rate if self._decays[index] else 0.0,
            self.trust_coefficient,
            adapt=self._adapts[index],
        )
        # The scalars first: one pass over the tensor.
        scaled_update = (learning_rate * ratio) * u
        velocity = self._velocities[index]
        if velocity is None:
            step = scaled_update
        else:
            new_velocity, step = functional.momentum_step(
                tf.cast(velocity, tf.float32),
                scaled_update,
                self.momentum,
                self.nesterov,
            )
            self.assign(velocity, new_velocity)
        self.assign_sub(variable, step)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "momentum": self.momentum,
                "nesterov": self.nesterov,
                "trust_coefficient": self.trust_coefficient,
                **self._exclusion_config(),
            }
        )
        return config
