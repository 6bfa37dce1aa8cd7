"""VR-Adam (Algorithm 3 of "Accelerating Large Batch Training via Gradient
Signal to Noise Ratio")."""

import keras

from tf_vrgd import validation
from tf_vrgd._gsnr import GSNRMixin
from tf_vrgd._types import LearningRate


@keras.saving.register_keras_serializable(package="tf_vrgd")
class VRAdam(GSNRMixin, keras.optimizers.Adam):
    """VR-Adam (Algorithm 3): Adam on the GSNR-scaled mean gradient.

        ``ghat = phat * gbar`` as in `tf_vrgd.VRSGD` (GSNR of the k >= 2 samples,
        normalised per variable, clipped to [gamma, 1], bias-corrected momentum
        beta_3), then Keras' Adam on ghat, its epsilon convention included:
        ``m <- b1 m + (1-b1) ghat; v <- b2 v + (1-b2) ghat^2;
        w <- w - lr sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + epsilon)``.
        The GSNR scales the gradient before the moment estimates, as the paper
        argues (scaling the final step would bias m and v). With `gamma = 1` this
        is exactly `keras.optimizers.Adam`.

        Args:
            learning_rate: Float >= 0, schedule or callable. Defaults to 0.001.
            beta_1: Float in [0, 1). Defaults to 0.9.
            beta_2: Float in [0, 1). Defaults to 0.999.
            epsilon: Float >= 0. Defaults to 1e-7 (Keras).
    {vr_args}"""

    default_beta_3 = 0.9

    def __init__(
        self,
        learning_rate: LearningRate = 0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        **kwargs,
    ) -> None:
        validation.check_learning_rate(learning_rate)
        for name, value in (("beta_1", beta_1), ("beta_2", beta_2)):
            validation.check_number(name, value, low=0.0, high=1.0, high_open=True)
        validation.check_number("epsilon", epsilon, low=0.0)
        super().__init__(
            learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon, **kwargs
        )
