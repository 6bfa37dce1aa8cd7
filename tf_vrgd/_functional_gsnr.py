"""The GSNR rule of the VR optimizers as pure tensor arithmetic
(docs/algorithms.md §2-3 and §7), from the moments and the raw GSNR of
`tf_vrgd._functional_moments`: the normalised, clipped GSNR, its momentum,
the statistics and the noise-scale terms, and the rule between GSNR
updates.

Public through `tf_vrgd.functional`, which re-exports every public name
here; stateless like the rest of it.
"""

from collections.abc import Sequence

import tensorflow as tf

from tf_vrgd._functional_moments import Scalar, TensorLike, mean_where_measured, where_measured


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


def kept_where_unmeasured(new: tf.Tensor, previous: TensorLike, measured: tf.Tensor) -> tf.Tensor:
    """`new` where `measured`, `previous` elsewhere: an element the update
    has no sample of keeps its last scale."""
    return tf.where(measured, new, previous)


def row_update_counts(previous: TensorLike, measured: tf.Tensor) -> tf.Tensor:
    """Each row's count of GSNR updates in which it had a sample: `previous`
    ([rows]) plus 1 for each row with a measured element in this one
    (`measured` is [rows, ...])."""
    sampled = tf.reduce_any(measured, axis=list(range(1, measured.shape.rank)))
    return previous + tf.cast(sampled, tf.float32)


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
