"""The gradient noise scale: how large a batch still pays.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training",
appendix A.1): with G the true gradient and Sigma the covariance of one
example's gradient, the simple noise scale

    B_simple = tr(Sigma) / |G|^2

lies near the critical batch, where doubling the batch stops halving the
steps. A gradient over b examples has E|G_b|^2 = |G|^2 + tr(Sigma) / b, so
measurements at two batch sizes give unbiased estimates of both terms:

    |G|^2      ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma)  ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

Data-parallel training has both at every update: each of the k gradient
samples (one replica's micro-step) at B_small = B_big / k examples, and
their mean at B_big, the examples of the update. A VR optimizer that
tracks its statistics sums, per variable and per GSNR update, |G_big|^2 =
sum(gbar^2) and |G_small|^2 = sum(s) (s the mean of the squared samples)
over the variable's measured elements (the `tf_vrgd.statistics.NOISE_NAMES`
columns of its rows): no extra collective. Both terms are sums over
elements, so a model's are the sums of its variables'.

`MovingNoiseScale` smooths the two terms separately, by bias-corrected
moving averages, before their ratio, as FairScale's AdaScale and
gpt-neox's noise-scale logger do; `efficiency` reads what the estimate
implies for a batch.
"""

from collections.abc import Sequence

import numpy as np

from tf_vrgd import validation


def estimates(
    squared_norm_of_mean: float | np.ndarray,
    mean_squared_norm: float | np.ndarray,
    batch_size: float,
    samples: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Unbiased ``(tr(Sigma), |G|^2)`` from one update's squared norms.

    Args:
        squared_norm_of_mean: |G_big|^2, the squared norm of the mean of
            the k samples (a number, or one per variable).
        mean_squared_norm: |G_small|^2, the mean over the samples of their
            squared norms.
        batch_size: B_big, the examples behind the mean (the update's).
        samples: k >= 2, the gradient samples of the update (replicas x
            accumulation steps): B_small = batch_size / k.

    Returns:
        float64 arrays ``(trace, squared_norm)``, the estimates of tr(Sigma)
        (per example) and |G|^2.
    """
    samples = validation.check_integer("samples", samples, low=2)
    big = float(validation.check_number("batch_size", batch_size, low=0.0, low_open=True))
    small = big / samples
    big_norm = np.asarray(squared_norm_of_mean, np.float64)
    small_norm = np.asarray(mean_squared_norm, np.float64)
    squared_norm = (big * big_norm - small * small_norm) / (big - small)
    trace = (small_norm - big_norm) / (1.0 / small - 1.0 / big)
    return trace, squared_norm


def ratio(trace: float | np.ndarray, squared_norm: float | np.ndarray) -> np.ndarray:
    """``trace / squared_norm``, NaN where `squared_norm` is not positive
    (the gradient's norm is not yet resolved from the noise)."""
    trace = np.asarray(trace, np.float64)
    squared_norm = np.asarray(squared_norm, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(squared_norm > 0.0, trace / squared_norm, np.nan)


def efficiency(batch_size: float, noise_scale: float | np.ndarray) -> np.ndarray:
    """``1 / (1 + B / B_simple)``: the fraction of a batch of `batch_size`
    examples that a small batch would have needed for the same progress
    (McCandlish et al.'s E_min / E), by the same model. NaN where the noise
    scale is NaN; 0 where it is not positive (no noise resolved: examples
    beyond the first add nothing)."""
    noise_scale = np.asarray(noise_scale, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = np.where(noise_scale > 0.0, 1.0 / (1.0 + batch_size / noise_scale), 0.0)
    return np.where(np.isnan(noise_scale), np.nan, value)


class MovingNoiseScale:
    """Bias-corrected moving averages of tr(Sigma) and |G|^2 (one each,
    or one per variable) and the noise scale from their ratio.

    Args:
        decay: the averages' decay in [0, 1): ``avg = decay * avg + (1 -
            decay) * new``, divided by ``1 - decay^n`` after n updates.
            0 keeps the last estimate alone.
    """

    def __init__(self, decay: float = 0.0) -> None:
        self.decay = validation.check_number("decay", decay, low=0.0, high=1.0, high_open=True)
        self.count = 0
        self._trace = 0.0
        self._squared_norm = 0.0

    def update(
        self, trace: float | Sequence[float] | np.ndarray, squared_norm: float | np.ndarray
    ) -> None:
        """Adds one estimate of each term (`estimates`)."""
        keep = self.decay
        self._trace = keep * self._trace + (1.0 - keep) * np.asarray(trace, np.float64)
        self._squared_norm = keep * self._squared_norm + (1.0 - keep) * np.asarray(
            squared_norm, np.float64
        )
        self.count += 1

    @property
    def trace(self) -> np.ndarray:
        """The bias-corrected average of tr(Sigma); NaN before any update."""
        return self._corrected(self._trace)

    @property
    def squared_norm(self) -> np.ndarray:
        """The bias-corrected average of |G|^2; NaN before any update."""
        return self._corrected(self._squared_norm)

    @property
    def value(self) -> np.ndarray:
        """B_simple in examples: the averages' ratio (`ratio`)."""
        return ratio(self.trace, self.squared_norm)

    def _corrected(self, average):
        if self.count == 0:
            return np.asarray(np.nan)
        return np.asarray(average) / (1.0 - self.decay**self.count)
