"""LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning:
Training BERT in 76 minutes") with TF Model Garden's arguments: coupled
`weight_decay_rate` and regex exclusion lists. docs/algorithms.md §4."""

import keras
import tensorflow as tf

from tf_vrgd import functional, validation
from tf_vrgd._accumulation import ReplicaAccumulationMixin
from tf_vrgd._exclusion import LayerwiseExclusionMixin
from tf_vrgd._types import LearningRate, Patterns


@keras.saving.register_keras_serializable(package="tf_vrgd")
class LAMB(LayerwiseExclusionMixin, ReplicaAccumulationMixin, keras.optimizers.Optimizer):
    """LAMB (You et al. 2020) in its TF Model Garden form.

        m <- b1 m + (1-b1) g;   v <- b2 v + (1-b2) g^2
        u  = mhat / (sqrt(vhat) + epsilon) + weight_decay_rate * w
             (decay omitted for variables excluded from weight decay)
        ratio = ||w|| / ||u|| if both > 0 else 1 (1 if excluded from
                layer adaptation)
        w <- w - lr * ratio * u

    With `weight_decay_rate = 0` this is `keras.optimizers.Lamb`; unlike
    it, it has Model Garden's coupled `weight_decay_rate` and regex
    exclusion lists (saved by `get_config`).

    Args:
        learning_rate: Defaults to 0.001.
        beta_1: Float in [0, 1). Defaults to 0.9.
        beta_2: Float in [0, 1). Defaults to 0.999.
        epsilon: Float >= 0. Defaults to 1e-6.
        weight_decay_rate: Float >= 0, LAMB's decay. Defaults to 0.0.
        exclude_from_weight_decay: Regex list. Defaults to None.
        exclude_from_layer_adaptation: Regex list. Defaults to None (the
            weight-decay list). An empty list excludes nothing (every
            variable is adapted); Model Garden's class, and this package's
            config reader (`tf_vrgd.config`), read an empty list as None.
        **kwargs: Keras base optimizer arguments.
    """

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-6,
        weight_decay_rate: float = 0.0,
        exclude_from_weight_decay: Patterns = None,
        exclude_from_layer_adaptation: Patterns = None,
        **kwargs,
    ) -> None:
        validation.check_learning_rate(learning_rate)
        super().__init__(learning_rate=learning_rate, **kwargs)
        self.beta_1 = validation.check_number("beta_1", beta_1, low=0.0, high=1.0, high_open=True)
        self.beta_2 = validation.check_number("beta_2", beta_2, low=0.0, high=1.0, high_open=True)
        self.epsilon = validation.check_number("epsilon", epsilon, low=0.0)
        self._init_exclusions(
            exclude_from_weight_decay, exclude_from_layer_adaptation, weight_decay_rate
        )

    def _build_slots(self, var_list):
        self._momentums, self._velocities = self.add_optimizer_variables(
            var_list, ["momentum", "velocity"]
        )

    def update_step(self, gradient, variable, learning_rate):
        index = self._get_variable_index(variable)
        m, v = self._momentums[index], self._velocities[index]
        gradient = functional.as_float32(gradient)
        # The moments in place, in the form of Keras' Lamb (m + (1 - b1)(g - m)
        # is b1 m + (1 - b1) g): no new moment tensor beside each slot.
        self.assign_add(
            m, tf.cast((gradient - tf.cast(m, tf.float32)) * (1.0 - self.beta_1), m.dtype)
        )
        self.assign_add(
            v,
            tf.cast((tf.square(gradient) - tf.cast(v, tf.float32)) * (1.0 - self.beta_2), v.dtype),
        )
        direction = functional.bias_corrected_direction(
            tf.cast(m, tf.float32),
            tf.cast(v, tf.float32),
            self.beta_1,
            self.beta_2,
            self.epsilon,
            self.iterations + 1,
        )
        u, ratio = functional.layerwise_update(
            direction,
            tf.cast(variable, tf.float32),
            self.weight_decay_rate if self._decays[index] else 0.0,
            1.0,
            adapt=self._adapts[index],
        )
        step = (tf.cast(learning_rate, tf.float32) * ratio) * u
        self.assign_sub(variable, tf.cast(step, variable.dtype))

    def get_config(self):
        return {
            **super().get_config(),
            "beta_1": self.beta_1,
            "beta_2": self.beta_2,
            "epsilon": self.epsilon,
            **self._exclusion_config(),
        }
