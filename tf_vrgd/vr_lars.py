"""VR-LARS: LARS on the GSNR-scaled gradient ("Accelerating Large Batch
Training via Gradient Signal to Noise Ratio", section 4.2; no algorithm box
there)."""

import keras

from tf_vrgd._gsnr import GSNRMixin
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
