"""VR-LARS: LARS on the GSNR-scaled gradient ("Accelerating Large Batch
Training via Gradient Signal to Noise Ratio", section 4.2; no algorithm box
there)."""

import keras

from tf_vrgd import _gsnr
from tf_vrgd._gsnr import GSNRMixin
from tf_vrgd._types import LearningRate, Patterns
from tf_vrgd.lars import LARS


@keras.saving.register_keras_serializable(package="tf_vrgd")
class VRLARS(GSNRMixin, LARS):
    """VR-LARS: `tf_vrgd.LARS` applied to ``ghat = phat * gbar``.

        ghat as in `tf_vrgd.VRSGD`; then ``u = ghat + weight_decay_rate * w``,
        ``trust = trust_coefficient * ||w|| / ||u||`` (1 on zero norms or for
        excluded variables), ``v <- momentum v + lr trust u; w <- w - v``. With
        `gamma = 1` this is exactly `tf_vrgd.LARS`.

        Args:
            learning_rate: Defaults to 0.1.
            momentum, nesterov, trust_coefficient, weight_decay_rate,
            exclude_from_weight_decay, exclude_from_layer_adaptation: as in
                `tf_vrgd.LARS` (defaults 0.9, False, 0.001, 0.0, None, None).
    {vr_args}"""

    _row_sparse_base_rule = False  # the trust ratio needs the whole gradient

    def __init__(
        self,
        learning_rate: LearningRate = 0.1,
        momentum: float = 0.9,
        nesterov: bool = False,
        trust_coefficient: float = 0.001,
        weight_decay_rate: float = 0.0,
        exclude_from_weight_decay: Patterns = None,
        exclude_from_layer_adaptation: Patterns = None,
        gamma: float = 0.1,
        beta_3: float = 0.0,
        gsnr_epsilon: float = 1e-6,
        jit_update: bool = True,
        track_gsnr_statistics: bool = False,
        gsnr_interval: int = 1,
        **kwargs,
    ) -> None:
        super().__init__(
            learning_rate=learning_rate,
            momentum=momentum,
            nesterov=nesterov,
            trust_coefficient=trust_coefficient,
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


VRLARS.__doc__ = _gsnr.fill_vr_arguments(VRLARS.__doc__, beta_3=0.0)
