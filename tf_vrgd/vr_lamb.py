"""VR-LAMB (Algorithm 5 of "Accelerating Large Batch Training via Gradient
Signal to Noise Ratio"), on LAMB in its TF Model Garden form (You et al.
2020, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes")."""

import keras

from tf_vrgd import _gsnr
from tf_vrgd._gsnr import GSNRMixin
from tf_vrgd._types import LearningRate, Patterns
from tf_vrgd.lamb import LAMB


@keras.saving.register_keras_serializable(package="tf_vrgd")
class VRLAMB(GSNRMixin, LAMB):
    """VR-LAMB (Algorithm 5): `tf_vrgd.LAMB` on the GSNR-scaled mean gradient.

        ghat as in `tf_vrgd.VRSGD` (GSNR momentum beta_3 by default, as in the
        paper's BERT runs), then the LAMB rule of `tf_vrgd.LAMB` with ghat in
        place of the gradient. With `weight_decay_rate = 0` and `gamma = 1` this
        is exactly `keras.optimizers.Lamb`.

        Args:
            learning_rate, beta_1, beta_2, epsilon, weight_decay_rate,
            exclude_from_weight_decay, exclude_from_layer_adaptation: as in
                `tf_vrgd.LAMB` (defaults 0.001, 0.9, 0.999, 1e-6, 0.0, None, None).
    {vr_args}"""

    _row_sparse_base_rule = False  # the trust ratio needs the whole gradient

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-6,
        weight_decay_rate: float = 0.0,
        exclude_from_weight_decay: Patterns = None,
        exclude_from_layer_adaptation: Patterns = None,
        gamma: float = 0.1,
        beta_3: float = 0.9,
        gsnr_epsilon: float = 1e-6,
        jit_update: bool = True,
        track_gsnr_statistics: bool = False,
        gsnr_interval: int = 1,
        **kwargs,
    ) -> None:
        super().__init__(
            learning_rate=learning_rate,
            beta_1=beta_1,
            beta_2=beta_2,
            epsilon=epsilon,
            weight_decay_rate=weight_decay_rate,
            exclude_from_weight_decay=exclude_from_weight_decay,
            exclude_from_layer_adaptation=exclude_from_layer_adaptation,
            **kwargs,
        )
        self._init_gsnr(
            gamma, beta_3, gsnr_epsilon, jit_update, track_gsnr_statistics, gsnr_interval
        )

    def get_config(self):
        return {**super().get_config(), **self._gsnr_config()}


VRLAMB.__doc__ = _gsnr.fill_vr_arguments(VRLAMB.__doc__, beta_3=0.9)
