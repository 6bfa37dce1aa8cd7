"""Model Garden's `AdamWeightDecay` (the `adamw` type of its optimization
configs) as a Keras 3 optimizer."""

import keras

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
    """

    def __init__(
        self,
        include_in_weight_decay: Patterns = None,
        exclude_from_weight_decay: Patterns = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self._init_exclusions(exclude_from_weight_decay, None)
        self._include_patterns = [str(p) for p in include_in_weight_decay or []] or None

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
