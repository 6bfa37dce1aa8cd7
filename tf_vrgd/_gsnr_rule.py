"""The GSNR rule of the VR optimizers as pure tensor arithmetic
(docs/algorithms.md §2-3 and §7), from the moments and the raw GSNR of
`tf_vrgd._gsnr_moments`: the normalised, clipped GSNR, its momentum, the
statistics and the noise-scale terms, and the rule between GSNR updates.

Public through `tf_vrgd.functional`, which re-exports every public name
here; stateless like the rest of it.
"""

from collections.abc import Sequence
from typing import NamedTuple

import tensorflow as tf

from tf_vrgd._gsnr_moments import (
    Scalar,
    TensorLike,
    mean_where_measured,
    measured_elements,
    measured_mean_gsnr,
    raw_gsnr,
    where_measured,
)


def normalized_clipped_gsnr(
    gsnr: tf.Tensor,
    gamma: Scalar,
    measured: tf.Tensor | None = None,
    layer_mean: tf.Tensor | None = None,
) -> tf.Tensor:
    """Divides by the layer (variable) mean and clips to [gamma, 1].

    Eq. 8 and 9 of the paper. The mean is over the `measured` elements
    (`measured_elements`; all of them if None), or `layer_mean` when given
    (`measured_mean_gsnr`). Where the layer mean is 0 (no signal at all)
    the normalised ratio is 1 everywhere: `divide_no_nan` gives 0 there,
    and the lower clip is then 1 instead of gamma.
    """
    if layer_mean is None and measured is None:
        layer_mean = tf.reduce_mean(gsnr)
    elif layer_mean is None:
        layer_mean = mean_where_measured(measured, gsnr)
    floor = tf.where(layer_mean > 0.0, tf.cast(gamma, tf.float32), 1.0)
    return tf.clip_by_value(tf.math.divide_no_nan(gsnr, layer_mean), floor, 1.0)


def segment_normalized_clipped_gsnr(
    gsnr: tf.Tensor,
    segment_ids: tf.Tensor,
    sizes: Sequence[int],
    gamma: Scalar,
    measured: tf.Tensor | None = None,
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """`normalized_clipped_gsnr` of several variables packed into one flat
    vector: element i belongs to variable ``segment_ids[i]``, variable j has
    ``sizes[j]`` elements (Python ints, in order).

    The layer means are summed in float64, so that they do not depend on how
    many elements a variable has beyond float32 round-off.

    Returns:
        ``(scale, layer_means, counts)``: the flat factor in [gamma, 1], the
        float32 mean GSNR of each variable over its measured elements (0
        for a variable without any) and the float32 number of measured
        elements of each.
    """
    if measured is not None:
        gsnr = where_measured(measured, gsnr)
    totals = tf.math.unsorted_segment_sum(
        tf.cast(gsnr, tf.float64), segment_ids, num_segments=len(sizes)
    )
    if measured is None:
        counts = tf.constant(sizes, tf.float64)
    else:
        counts = tf.math.unsorted_segment_sum(
            tf.cast(measured, tf.float64), segment_ids, num_segments=len(sizes)
        )
    layer_means = tf.cast(tf.math.divide_no_nan(totals, counts), tf.float32)
    floors = tf.where(layer_means > 0.0, tf.cast(gamma, tf.float32), 1.0)
    normalized = tf.math.divide_no_nan(gsnr, tf.gather(layer_means, segment_ids))
    scale = tf.clip_by_value(normalized, tf.gather(floors, segment_ids), 1.0)
    return scale, layer_means, tf.cast(counts, tf.float32)


def segment_gsnr_statistics(
    layer_means: tf.Tensor,
    scale: tf.Tensor,
    applied: tf.Tensor,
    segment_ids: tf.Tensor,
    counts: tf.Tensor,
    gamma: float,
    measured: tf.Tensor | None = None,
) -> tf.Tensor:
    """`gsnr_statistics` of each variable of a packed vector (see
    `segment_normalized_clipped_gsnr`, which gives `counts`): float32
    ``[variables, 4]`` rows over each variable's measured elements;
    fractions and the applied mean are 0 for a variable without any."""
    columns = tf.stack(
        [tf.cast(scale <= gamma, tf.float32), tf.cast(scale >= 1.0, tf.float32), applied], axis=1
    )
    if measured is not None:
        columns = where_measured(measured[:, None], columns)
    sums = tf.math.unsorted_segment_sum(columns, segment_ids, tf.shape(counts)[0])
    return tf.concat([layer_means[:, None], tf.math.divide_no_nan(sums, counts[:, None])], axis=1)


def gsnr_statistics(
    gsnr: tf.Tensor,
    scale: tf.Tensor,
    applied: tf.Tensor,
    gamma: float,
    measured: tf.Tensor | None = None,
) -> tf.Tensor:
    """Summary of one variable's GSNR for monitoring, in the order of
    `tf_vrgd.statistics.NAMES`.

    Args:
        gsnr: the raw element-wise GSNR (`raw_gsnr`).
        scale: the normalised, clipped factor r (`normalized_clipped_gsnr`).
        applied: the factor applied to gbar (r, or phat with GSNR momentum).
        gamma: the lower clip.
        measured: the elements to summarise (`measured_elements`), or None
            for all.

    Returns:
        float32 ``[mean raw GSNR, fraction of elements at gamma, fraction at
        1, mean applied factor]`` over the measured elements (0 if there
        are none). With ``gamma = 1`` every element is at both bounds.
    """
    columns = [gsnr, tf.cast(scale <= gamma, tf.float32), tf.cast(scale >= 1.0, tf.float32)]
    columns.append(tf.broadcast_to(applied, tf.shape(gsnr)))
    if measured is None:
        return tf.stack([tf.reduce_mean(c) for c in columns])
    count = tf.reduce_sum(tf.cast(measured, tf.float32))
    return tf.stack(
        [tf.math.divide_no_nan(tf.reduce_sum(where_measured(measured, c)), count) for c in columns]
    )


def noise_sums(
    gradient_mean: tf.Tensor, second_moment: tf.Tensor, measured: tf.Tensor | None = None
) -> tf.Tensor:
    """The terms of the gradient noise scale (`tf_vrgd.noise_scale`) for one
    variable, in the order of `tf_vrgd.statistics.NOISE_NAMES`: float32
    ``[sum(gbar^2), sum(s)]`` over the measured elements (all if
    `measured` is None), the squared norm of the samples' mean (|G_big|^2)
    and the mean of their squared norms (|G_small|^2)."""
    columns = [tf.square(gradient_mean), second_moment]
    if measured is not None:
        columns = [where_measured(measured, c) for c in columns]
    return tf.stack([tf.reduce_sum(c) for c in columns])


def segment_noise_sums(
    gradient_mean: tf.Tensor,
    second_moment: tf.Tensor,
    segment_ids: tf.Tensor,
    variables: int,
    measured: tf.Tensor | None = None,
) -> tf.Tensor:
    """`noise_sums` of each variable of a packed vector: ``[variables, 2]``."""
    columns = tf.stack([tf.square(gradient_mean), second_moment], axis=1)
    if measured is not None:
        columns = where_measured(measured[:, None], columns)
    return tf.math.unsorted_segment_sum(columns, segment_ids, variables)


def gsnr_momentum(
    previous: TensorLike, gsnr: tf.Tensor, beta_3: float, step: Scalar
) -> tuple[tf.Tensor, tf.Tensor]:
    """Bias-corrected momentum of the GSNR (Algorithm 3).

    ``p_t = beta_3 * p_{t-1} + (1 - beta_3) * r_t``,
    ``phat = p_t / (1 - beta_3^t)`` with `step` = t counted from 1.

    Returns:
        ``(p_t, phat)``.
    """
    return corrected_gsnr_momentum(previous, gsnr, beta_3, gsnr_momentum_correction(beta_3, step))


def corrected_gsnr_momentum(
    previous: TensorLike,
    gsnr: tf.Tensor,
    beta_3: Scalar,
    correction: Scalar,
    measured: tf.Tensor | None = None,
) -> tuple[tf.Tensor, tf.Tensor]:
    """`gsnr_momentum` with its bias correction ``1 - beta_3^t`` given, so
    that one scalar serves every variable of an update (or, for the rows
    of an embedding table, a tensor that broadcasts against `gsnr`: each
    row's own count; 0 for a row never measured gives phat = 0).

    Elements not `measured` (`measured_elements`) keep their momentum.

    Returns:
        ``(p_t, p_t / correction)``.
    """
    new = beta_3 * previous + (1.0 - beta_3) * gsnr
    if measured is not None:
        new = tf.where(measured, new, previous)
    return new, tf.math.divide_no_nan(new, correction)


def gsnr_momentum_correction(beta_3: float, step: Scalar) -> tf.Tensor:
    """The bias correction ``1 - beta_3^t`` of `gsnr_momentum`: a scalar
    shared by every variable of an update, or element-wise for a tensor of
    per-row counts (0 where a row was never measured)."""
    return 1.0 - tf.pow(tf.cast(beta_3, tf.float32), tf.cast(step, tf.float32))


class GSNRScale(NamedTuple):
    """What one GSNR update computes (`gsnr_scale`): ``applied``, the factor
    of gbar; ``scale``, the clipped ratio r (the `gsnr_scale` slot's new
    value); ``momentum``, the GSNR momentum's new value (None without one);
    ``row_updates``, each row's new count of measured updates (None unless
    asked for); ``statistics``, the rows of `gsnr_statistics` followed by
    `noise_sums` (one row, or one per segment; None unless asked for)."""

    applied: tf.Tensor
    scale: tf.Tensor
    momentum: tf.Tensor | None
    row_updates: tf.Tensor | None
    statistics: tf.Tensor | None


def gsnr_scale(
    gradient_mean: tf.Tensor,
    second_moment: tf.Tensor,
    gamma: Scalar,
    epsilon: Scalar,
    *,
    beta_3: Scalar = 0.0,
    correction: Scalar | None = None,
    previous_scale: TensorLike | None = None,
    previous_momentum: TensorLike | None = None,
    previous_row_updates: TensorLike | None = None,
    segments: tuple[tf.Tensor, Sequence[int]] | None = None,
    statistics: bool = False,
    layer_mean: tf.Tensor | None = None,
) -> GSNRScale:
    """The VR rule from the moments to the factor applied to gbar, for one
    variable, for several packed into one flat vector, or for the rows of a
    table (docs/algorithms.md §2-3): raw GSNR, layer mean over the measured
    elements, clip to [gamma, 1], then the GSNR momentum.

    Args:
        gradient_mean, second_moment: gbar and s (`gradient_moments`).
        gamma, epsilon: the lower clip and the variance floor.
        beta_3, correction: the GSNR momentum and its bias correction
            ``1 - beta_3^t`` (`gsnr_momentum_correction`), used with
            `previous_momentum`.
        previous_scale: the last scale, kept where nothing is measured (None
            where the caller keeps no scale).
        previous_momentum: p_{t-1}, or None for no GSNR momentum (the factor
            is then r).
        previous_row_updates: for the rows of a table (`gradient_mean` is
            [rows, ...]): each row's count of GSNR updates in which it had a
            sample, before this one. Each row's correction then counts its
            own updates, and `correction` is not used.
        segments: ``(segment_ids, sizes)`` when the tensors are several
            variables packed flat (`segment_normalized_clipped_gsnr`).
        statistics: also return the statistics rows: `gsnr_statistics`
            followed by `noise_sums` (per variable when packed).
        layer_mean: the variable's `measured_mean_gsnr`, when the caller
            has it already (`measured_mean_gsnrs` of several variables);
            not with `segments`.
    """
    gsnr = raw_gsnr(gradient_mean, second_moment, epsilon)
    measured = measured_elements(second_moment)
    if segments is None:
        if layer_mean is None:
            layer_mean = measured_mean_gsnr(gradient_mean, second_moment, epsilon)
        scale = normalized_clipped_gsnr(gsnr, gamma, layer_mean=layer_mean)
    else:
        scale, layer_means, counts = segment_normalized_clipped_gsnr(
            gsnr, *segments, gamma, measured
        )
    if previous_scale is not None:
        scale = tf.where(measured, scale, previous_scale)
    applied, momentum, row_updates, rows = scale, None, None, None
    if previous_row_updates is not None:
        sampled = tf.reduce_any(measured, axis=list(range(1, measured.shape.rank)))
        row_updates = previous_row_updates + tf.cast(sampled, tf.float32)
        correction = gsnr_momentum_correction(beta_3, row_broadcast(row_updates, scale))
    if previous_momentum is not None:
        momentum, applied = corrected_gsnr_momentum(
            previous_momentum, scale, beta_3, correction, measured
        )
    if statistics and segments is None:
        rows = tf.concat(
            [
                gsnr_statistics(gsnr, scale, applied, gamma, measured),
                noise_sums(gradient_mean, second_moment, measured),
            ],
            0,
        )
    elif statistics:
        segment_ids, sizes = segments
        rows = tf.concat(
            [
                segment_gsnr_statistics(
                    layer_means, scale, applied, segment_ids, counts, gamma, measured
                ),
                segment_noise_sums(gradient_mean, second_moment, segment_ids, len(sizes), measured),
            ],
            1,
        )
    return GSNRScale(applied, scale, momentum, row_updates, rows)


def scale_between_gsnr_updates(
    total: tf.Tensor,
    samples: Scalar | None,
    previous_scale: TensorLike | None,
    previous_momentum: TensorLike | None,
    beta_3: Scalar,
    gsnr_updates: TensorLike,
) -> tuple[tf.Tensor, tf.Tensor]:
    """The rule at an update that does not measure the GSNR
    (`gsnr_interval` > 1, docs/algorithms.md §7): ``(gbar, factor)``.

    Args:
        total: the reduced gradient sum: Keras-scaled replica gradients
            (their sum is gbar) when `samples` is None, else the sum of the
            accumulated samples.
        samples: the count of accumulated samples, or None.
        previous_scale: the scale of the last GSNR update (the factor when
            there is no GSNR momentum).
        previous_momentum: the GSNR momentum, or None; the factor is then
            the momentum over its bias correction.
        beta_3: the GSNR momentum's decay.
        gsnr_updates: the GSNR updates the correction counts: a scalar (at
            least 1: the first update measures), or per row of a table
            broadcast against `total`, where 0 (a row never measured) gives
            the factor 1, the base rule.
    """
    gradient_mean = total if samples is None else total / samples
    if previous_momentum is None:
        return gradient_mean, previous_scale
    correction = gsnr_momentum_correction(beta_3, gsnr_updates)
    applied = previous_momentum / correction
    if correction.shape.rank:
        applied = tf.where(gsnr_updates > 0.0, applied, 1.0)
    return gradient_mean, applied


def row_broadcast(per_row: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """`per_row` ([rows]) reshaped to broadcast against `like` ([rows, ...])."""
    return tf.reshape(per_row, [-1] + [1] * (like.shape.rank - 1))
