"""VR-SGD and VR-Momentum (Algorithm 1 of "Accelerating Large Batch Training
via Gradient Signal to Noise Ratio"; VR-Momentum is described there without
an algorithm box)."""

import keras

from tf_vrgd import validation
from tf_vrgd._gsnr import GSNRMixin
from tf_vrgd._types import LearningRate


@keras.saving.register_keras_serializable(package="tf_vrgd")
class VRSGD(GSNRMixin, keras.optimizers.SGD):
    """VR-SGD (Algorithm 1), and VR-Momentum when `momentum > 0`.

        Per update, from k >= 2 gradient samples g_d (k = replicas x
        gradient_accumulation_steps), element-wise:

            gbar = mean_d g_d,   s = mean_d g_d^2,   var = max(s - gbar^2, 0)
            r    = clip(GSNR / mean_layer(GSNR), gamma, 1),
                   GSNR = gbar^2 / max(var, gsnr_epsilon * s)
            p    = beta_3 * p + (1 - beta_3) * r;  phat = p / (1 - beta_3^t)
                   (beta_3 = 0: phat = r, as in Algorithm 1)
            ghat = phat * gbar

        then Keras' SGD rule on ghat: ``m <- momentum * m - lr * ghat;
        w <- w + m`` (Nesterov: ``w <- w + momentum * m - lr * ghat``).
        Where the paper divides by the raw variance, this package floors it at
        `gsnr_epsilon * s`, so identical samples give r = 1 instead of NaN.
        With `gamma = 1` this is exactly `keras.optimizers.SGD`.

        Args:
            learning_rate: Float >= 0, schedule or callable. Defaults to 0.01.
            momentum: Float in [0, 1). Defaults to 0.0 (VR-SGD).
            nesterov: Bool. Defaults to False.
    {vr_args}"""

    def __init__(
        self,
        learning_rate: LearningRate = 0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        **kwargs,
    ) -> None:
        validation.check_learning_rate(learning_rate)
        validation.check_number("momentum", momentum, low=0.0, high=1.0, high_open=True)
        validation.check_bool("nesterov", nesterov)
        super().__init__(
            learning_rate=learning_rate, momentum=momentum, nesterov=nesterov, **kwargs
        )
