"""VR-LAMB (Algorithm 5 of "Accelerating Large Batch Training via Gradient
Signal to Noise Ratio"), on LAMB in its TF Model Garden form (You et al.
2020, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes")."""

import keras

from tf_vrgd._gsnr import GSNRMixin
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

    default_beta_3 = 0.9

    _row_sparse_base_rule = False  # the trust ratio needs the whole gradient
