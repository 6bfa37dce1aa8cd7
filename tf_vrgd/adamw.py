"""Model Garden's `AdamWeightDecay` (the `adamw` type of its optimization
configs) as a Keras 3 optimizer."""

import keras

from tf_vrgd import validation
from tf_vrgd._accumulation import ReplicaAccumulationMixin
from tf_vrgd._exclusion import LayerwiseExclusionMixin
from tf_vrgd._types import Patterns


@keras.saving.register_keras_serializable(package="tf_vrgd")
class AdamWeightDecay(LayerwiseExclusionMixin, ReplicaAccumulationMixin, keras.optimizers.AdamW):
    """Keras AdamW with Model Garden's `adamw` weight-decay selection.

    Model Garden's `AdamWeightDecay` decays ``w <- w - lr * rate * w``
    before the Adam step (what Keras' AdamW does), except for variables whose
    name matches an `exclude_from_weight_decay` regex, unless one of
    `include_in_weight_decay` matches first. Both lists are saved.

    Args:
        learning_rate: Float >= 0, schedule or callable, first as in every
            Keras optimizer. Defaults to 0.001.
        *args: Keras AdamW's other positional arguments, in its order
            (`weight_decay`, `beta_1`, `beta_2`, `epsilon`, ...).
        include_in_weight_decay: List of regular expressions (searched in
            variable paths) of variables that decay even if an exclusion
            matches them, or None. Keyword only.
        exclude_from_weight_decay: List of regular expressions of variables
            that do not decay, or None. Keyword only.
        **kwargs: Keras AdamW's keyword arguments.
    """

    def __init__(
        self,
        learning_rate=0.001,
        *args,
        include_in_weight_decay: Patterns = None,
        exclude_from_weight_decay: Patterns = None,
        **kwargs,
    ) -> None:
        validation.check_learning_rate(learning_rate)
        super().__init__(learning_rate, *args, **kwargs)
        self._init_exclusions(exclude_from_weight_decay, None)
        self._include_patterns = (
            validation.check_regex_list("include_in_weight_decay", include_in_weight_decay) or None
        )

    def _use_weight_decay(self, variable):
        if self._matches(self._include_patterns, variable):
            return True
        return super()._use_weight_decay(variable)

    def get_config(self):
        return {
            **super().get_config(),
            "include_in_weight_decay": self._include_patterns,
            "exclude_from_weight_decay": self._weight_decay_patterns,
        }
