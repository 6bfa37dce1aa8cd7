"""The first half of the GSNR rule of the VR optimizers as pure tensor
arithmetic (docs/algorithms.md §1-2): the moments of the gradient samples,
the raw element-wise GSNR, the elements where it exists, and its layer
mean over them. The rest of the rule is `tf_vrgd._functional_gsnr`.

Public through `tf_vrgd.functional`, which re-exports every public name
here; stateless like the rest of it.
"""

from collections.abc import Callable, Sequence

import tensorflow as tf

# A tensor, a variable, an IndexedSlices or anything tf.convert_to_tensor takes.
TensorLike = tf.Tensor | tf.Variable | tf.IndexedSlices | float
# A Python number or a scalar tensor.
Scalar = float | tf.Tensor


def gradient_moments(
    sum_of_gradients: tf.Tensor,
    sum_of_squares: tf.Tensor,
    replicas: int,
    accumulation_steps: int,
) -> tuple[tf.Tensor, tf.Tensor]:
    """Mean and second moment of the k = replicas x accumulation_steps
    gradient samples from the all-reduced sums of Keras-scaled ones.

    Keras scales each replica's loss by 1/R, so a replica contributes
    ``g_d / R`` for each of its A micro-steps; with ``S1 = sum(g_d / R)``
    and ``S2 = sum((g_d / R)^2)`` over the k samples, ``gbar = S1 / A`` and
    ``s = R * S2 / A``. (With accumulation the VR hook undoes the scaling
    on each sample instead: `sample_moments`.) `replicas` and
    `accumulation_steps` are Python numbers.
    """
    steps = float(accumulation_steps)
    gradient_mean = sum_of_gradients if steps == 1.0 else sum_of_gradients / steps
    second_moment = sum_of_squares * (float(replicas) / steps)
    return gradient_mean, second_moment


def sample_moments(
    sum_of_samples: tf.Tensor, sum_of_squares: tf.Tensor, count: Scalar
) -> tuple[tf.Tensor, tf.Tensor]:
    """Mean and second moment ``(S1 / n, S2 / n)`` of n gradient samples
    from their sums (accumulated samples, Keras' 1/R scaling undone)."""
    return sum_of_samples / count, sum_of_squares / count


def raw_gsnr(gradient_mean: tf.Tensor, second_moment: tf.Tensor, epsilon: Scalar) -> tf.Tensor:
    """Element-wise GSNR ``gbar^2 / max(var, epsilon * s)``, 0 where s == 0.

    ``var = max(s - gbar^2, 0)`` is the samples' population variance (eq. 7
    of the paper). The floor ``epsilon * s`` lies above float32
    cancellation noise in ``s - gbar^2`` (samples equal to round-off get
    one value) and caps the ratio near ``1 / epsilon``; where s == 0 the
    denominator is 0 and `divide_no_nan` gives the 0 the rule asks for.
    """
    squared_mean, denominator = _gsnr_terms(gradient_mean, second_moment, epsilon)
    return tf.math.divide_no_nan(squared_mean, denominator)


def _gsnr_terms(gradient_mean, second_moment, epsilon):
    """``(gbar^2, max(s - gbar^2, epsilon * s))``: `raw_gsnr`'s numerator
    and floored denominator."""
    squared_mean = tf.square(gradient_mean)
    return squared_mean, tf.maximum(second_moment - squared_mean, epsilon * second_moment)


def measured_elements(second_moment: tf.Tensor) -> tf.Tensor:
    """Where the GSNR exists: the elements with a finite s > 0 (some sample
    non-zero, none Inf or NaN; docs/algorithms.md §2). The others (a row no
    sample looked up, a dead unit, a non-finite sample) take no part in the
    layer mean and keep their GSNR momentum, so that a non-finite sample
    spoils its own element's update only, as in Keras' optimizers."""
    return tf.logical_and(second_moment > 0.0, second_moment < float("inf"))


def measured_mean_gsnr(
    gradient_mean: tf.Tensor, second_moment: tf.Tensor, epsilon: Scalar
) -> tf.Tensor:
    """The mean of `raw_gsnr` over the `measured_elements` of one variable
    (0 if there are none): the layer mean of eq. 8. One variable's
    `measured_mean_gsnrs`."""
    return measured_mean_gsnrs([(gradient_mean, second_moment)], epsilon)[0]


def measured_mean_gsnrs(
    moments: Sequence[tuple[tf.Tensor, tf.Tensor]],
    epsilon: Scalar,
    moments_in_branch: Callable[[], Sequence[tuple[tf.Tensor, tf.Tensor]]] | None = None,
) -> list[tf.Tensor]:
    """`measured_mean_gsnr` of each ``(gbar, s)`` pair of `moments`, with
    one conditional for all (`mean_gsnrs_of_element_sums` of their
    `gsnr_element_sums`, the masked branch `masked_mean_gsnrs`).

    `moments_in_branch`, if given, makes the pairs again inside the masked
    branch: under XLA a conditional's inputs are stored whole before it
    runs, so derived moments would cost a write and a read each update.
    """
    moments = list(moments)
    return mean_gsnrs_of_element_sums(
        gsnr_element_sums(moments, epsilon),
        [tf.size(second_moment) for _, second_moment in moments],
        lambda: masked_mean_gsnrs(
            moments if moments_in_branch is None else moments_in_branch(), epsilon
        ),
    )


def gsnr_element_sums(
    moments: Sequence[tuple[tf.Tensor, tf.Tensor]], epsilon: Scalar
) -> list[tf.Tensor]:
    """Per ``(gbar, s)`` pair of `moments`, the sum over every element of
    ``(gbar^2 + (s - s)) / max(s - gbar^2, epsilon * s)``: the sum of its
    raw GSNR where every element is measured, and not finite where one is
    not (``s - s`` is NaN for an Inf or NaN s; where s == 0 the quotient
    is 0 / 0). One reduction per variable, with no select and no count."""
    totals = []
    for gradient_mean, second_moment in moments:
        squared_mean, denominator = _gsnr_terms(gradient_mean, second_moment, epsilon)
        totals.append(tf.reduce_sum((squared_mean + (second_moment - second_moment)) / denominator))
    return totals


def masked_mean_gsnrs(
    moments: Sequence[tuple[tf.Tensor, tf.Tensor]], epsilon: Scalar
) -> list[tf.Tensor]:
    """Per ``(gbar, s)`` pair of `moments`, the mean of `raw_gsnr` over its
    `measured_elements` (0 if there are none), by selects and a count."""
    totals, counts = masked_gsnr_totals(moments, epsilon)
    return [tf.math.divide_no_nan(total, count) for total, count in zip(totals, counts)]


def masked_gsnr_totals(
    moments: Sequence[tuple[tf.Tensor, tf.Tensor]], epsilon: Scalar
) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    """Per ``(gbar, s)`` pair of `moments`, the sum of `raw_gsnr` over its
    `measured_elements` and their float32 count: ``(totals, counts)``, the
    terms of `masked_mean_gsnrs`. A count equal to the pair's size says that
    every element was measured."""
    totals, counts = [], []
    for gradient_mean, second_moment in moments:
        measured = measured_elements(second_moment)
        gsnr = raw_gsnr(gradient_mean, second_moment, epsilon)
        totals.append(tf.reduce_sum(where_measured(measured, gsnr)))
        counts.append(measured_count(measured))
    return totals, counts


def mean_gsnrs_of_element_sums(
    element_sums: Sequence[tf.Tensor],
    sizes: Sequence[int | tf.Tensor],
    masked_means: Callable[[], Sequence[tf.Tensor]],
) -> list[tf.Tensor]:
    """The layer means of eq. 8 from `gsnr_element_sums` of variables of
    `sizes` elements: each sum over its size when every sum is finite (all
    elements measured, the usual case), else `masked_means()` (the
    `masked_mean_gsnrs` of the same variables) for all of them.

    One conditional for all the variables (docs/RESULTS.md: selects at
    every update made the dense update 1.3x dearer; a conditional per
    variable made ResNet-50's trace and compilation dearer). `masked_means`
    may call a program of its own, never compiled where it never runs.
    """
    element_sums = list(element_sums)
    if not element_sums:
        return []
    finite = tf.reduce_all(tf.math.is_finite(tf.stack(element_sums)))

    def over_every_element():
        return [
            tf.math.divide_no_nan(total, tf.cast(size, tf.float32))
            for total, size in zip(element_sums, sizes)
        ]

    return tf.cond(finite, over_every_element, lambda: list(masked_means()))


def mean_where_measured(measured: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
    """The mean of `values` over the `measured` elements, 0 if none is.

    The count is a sum of selected ones, not of the cast mask: the same
    number, and under XLA on CPU the cast made ResNet-50's masked layer
    means 1.35x dearer (27.7 against 20.6 ms for its 46 large variables;
    docs/RESULTS.md, "The masked layer mean")."""
    return tf.math.divide_no_nan(
        tf.reduce_sum(where_measured(measured, values)), measured_count(measured)
    )


def measured_count(measured: tf.Tensor) -> tf.Tensor:
    """The number of `measured` elements, in float32 (a sum of selected
    ones; see `mean_where_measured`)."""
    return tf.reduce_sum(tf.where(measured, 1.0, 0.0))


def where_measured(measured: tf.Tensor, values: tf.Tensor) -> tf.Tensor:
    """`values` where `measured`, 0 elsewhere (a select, not a product:
    an unmeasured element may hold NaN, and NaN * 0 is NaN)."""
    return tf.where(measured, values, tf.zeros_like(values))
