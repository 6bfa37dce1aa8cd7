"""Pure update-rule arithmetic shared by every optimizer in the package.

Each function here is stateless: tensors in, tensors out, no variables, no
distribution logic. The optimizer classes call these pieces in the order the
rules in ``docs/algorithms.md`` give them, and each piece has its own numpy
reference test in ``tests/test_functional.py``.

All statistics are computed in float32 whatever the variable dtype; callers
cast the result back to the variable dtype when they assign it.
"""

from collections.abc import Sequence

import tensorflow as tf

from tf_vrgd._functional_gsnr import corrected_gsnr_momentum as corrected_gsnr_momentum
from tf_vrgd._functional_gsnr import gsnr_momentum as gsnr_momentum
from tf_vrgd._functional_gsnr import gsnr_momentum_correction as gsnr_momentum_correction
from tf_vrgd._functional_gsnr import gsnr_statistics as gsnr_statistics
from tf_vrgd._functional_gsnr import kept_where_unmeasured as kept_where_unmeasured
from tf_vrgd._functional_gsnr import noise_sums as noise_sums
from tf_vrgd._functional_gsnr import normalized_clipped_gsnr as normalized_clipped_gsnr
from tf_vrgd._functional_gsnr import row_broadcast as row_broadcast
from tf_vrgd._functional_gsnr import row_update_counts as row_update_counts
from tf_vrgd._functional_gsnr import scale_between_gsnr_updates as scale_between_gsnr_updates
from tf_vrgd._functional_gsnr import segment_gsnr_statistics as segment_gsnr_statistics
from tf_vrgd._functional_gsnr import segment_noise_sums as segment_noise_sums
from tf_vrgd._functional_gsnr import (
    segment_normalized_clipped_gsnr as segment_normalized_clipped_gsnr,
)

# The GSNR rule (docs/algorithms.md §1-3, §7): its pieces; `gsnr_scale` below
# is their composition (`tf_vrgd._gsnr_slots.measure`) in one call.
from tf_vrgd._functional_moments import Scalar as Scalar
from tf_vrgd._functional_moments import TensorLike as TensorLike
from tf_vrgd._functional_moments import gradient_moments as gradient_moments
from tf_vrgd._functional_moments import gsnr_element_sums as gsnr_element_sums
from tf_vrgd._functional_moments import masked_gsnr_totals as masked_gsnr_totals
from tf_vrgd._functional_moments import masked_mean_gsnrs as masked_mean_gsnrs
from tf_vrgd._functional_moments import mean_gsnrs_of_element_sums as mean_gsnrs_of_element_sums
from tf_vrgd._functional_moments import mean_where_measured as mean_where_measured
from tf_vrgd._functional_moments import measured_count as measured_count
from tf_vrgd._functional_moments import measured_elements as measured_elements
from tf_vrgd._functional_moments import measured_mean_gsnr as measured_mean_gsnr
from tf_vrgd._functional_moments import measured_mean_gsnrs as measured_mean_gsnrs
from tf_vrgd._functional_moments import raw_gsnr as raw_gsnr
from tf_vrgd._functional_moments import sample_moments as sample_moments
from tf_vrgd._functional_moments import where_measured as where_measured
from tf_vrgd._gsnr_slots import GSNRRule, GSNRState, PackedVariables, WholeVariable, measure
from tf_vrgd._gsnr_slots import GSNRScale as GSNRScale


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
    """`measure` in one call, the view and state named by keywords: one
    variable (its `layer_mean` if known), several packed flat (`segments =
    (segment_ids, sizes)`), or rows of a table (`previous_row_updates`);
    `beta_3` and `correction` (``1 - beta_3^t``) for `previous_momentum`;
    the statistics rows if `statistics` (1-D for one variable)."""
    view = WholeVariable(layer_mean) if segments is None else PackedVariables(*segments)
    previous = GSNRState(previous_scale, previous_momentum, previous_row_updates)
    rule = GSNRRule(gamma, epsilon, beta_3)
    new = measure(view, gradient_mean, second_moment, rule, correction, previous, statistics)
    if statistics and segments is None:
        new = new._replace(statistics=new.statistics[0])
    return new


def as_float32(value: TensorLike) -> tf.Tensor:
    """Returns `value` as a dense float32 tensor.

    `tf.IndexedSlices` (sparse gradients from `Embedding` layers) are
    densified; duplicate indices are summed, which is what the gradient
    means.
    """
    if isinstance(value, tf.IndexedSlices):
        value = tf.convert_to_tensor(value)
    return tf.cast(value, tf.float32)


def as_float32_slices(value: TensorLike) -> tf.Tensor | tf.IndexedSlices:
    """`as_float32`, except that `tf.IndexedSlices` stay row-sparse (their
    values in float32)."""
    if isinstance(value, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(value.values, tf.float32), value.indices, value.dense_shape)
    return tf.cast(value, tf.float32)


def l2_norm(tensor: TensorLike) -> tf.Tensor:
    """Euclidean norm of all elements of `tensor`, as a float32 scalar."""
    tensor = tf.cast(tensor, tf.float32)
    return tf.sqrt(tf.reduce_sum(tf.square(tensor)))


def trust_ratio(
    weight_norm: tf.Tensor, update_norm: tf.Tensor, trust_coefficient: Scalar = 1.0
) -> tf.Tensor:
    """Layer-wise trust ratio of LARS and LAMB.

    Returns ``trust_coefficient * weight_norm / update_norm`` where both norms
    are positive and ``1`` otherwise (You et al. 2017, 2020; the Model Garden
    LARS and LAMB convention: a zero norm disables the adaptation rather than
    zeroing the step).

    Args:
        weight_norm: Float32 scalar, the norm of the variable.
        update_norm: Float32 scalar, the norm of the update direction.
        trust_coefficient: Python float or scalar. Defaults to 1.0 (LAMB).
    """
    both_positive = tf.logical_and(weight_norm > 0.0, update_norm > 0.0)
    # The where-on-the-denominator keeps the unused branch finite, so that no
    # NaN or Inf is ever produced, eagerly or under XLA.
    safe_update_norm = tf.where(both_positive, update_norm, 1.0)
    return tf.where(both_positive, trust_coefficient * weight_norm / safe_update_norm, 1.0)


def larc_factor(
    weight_norm: tf.Tensor,
    gradient_norm: tf.Tensor,
    learning_rate: Scalar,
    trust_coefficient: float,
    epsilon: float,
    weight_decay: float,
    clip: bool,
) -> tuple[tf.Tensor, tf.Tensor]:
    """LARC's per-variable gradient multiplier (Apex semantics).

    ``a = trust_coefficient * ||w|| / (||g|| + weight_decay * ||w|| + epsilon)``;
    in clipping mode the factor is ``min(a / learning_rate, 1)`` (effective
    SGD rate ``min(a, learning_rate)``), in scaling mode it is ``a``.

    Returns:
        A pair ``(factor, active)``: float32 scalars; `active` is False where
        either norm is zero, in which case Apex leaves the gradient unchanged
        (no decay either) and `factor` is 1.
    """
    active = tf.logical_and(weight_norm > 0.0, gradient_norm > 0.0)
    adaptive_rate = (
        trust_coefficient * weight_norm / (gradient_norm + weight_decay * weight_norm + epsilon)
    )
    if clip:
        learning_rate = tf.cast(learning_rate, tf.float32)
        # a / 0 is +Inf for a > 0, so a zero learning rate gives factor 1,
        # the limit of min(a / lr, 1) as lr -> 0.
        factor = tf.minimum(tf.math.divide(adaptive_rate, learning_rate), 1.0)
    else:
        factor = adaptive_rate
    factor = tf.where(active, factor, 1.0)
    return factor, active


def larc_gradient(
    gradient: tf.Tensor,
    weight: tf.Tensor,
    learning_rate: Scalar,
    trust_coefficient: float,
    epsilon: float,
    weight_decay: float,
    clip: bool,
) -> tf.Tensor:
    """The gradient LARC hands to the wrapped optimizer.

    ``(g + weight_decay * w) * factor`` where both norms are positive, ``g``
    unchanged otherwise. Inputs and output are float32.
    """
    factor, active = larc_factor(
        l2_norm(weight),
        l2_norm(gradient),
        learning_rate,
        trust_coefficient,
        epsilon,
        weight_decay,
        clip,
    )
    decayed = gradient + weight_decay * weight if weight_decay else gradient
    return tf.where(active, decayed * factor, gradient)


def layerwise_update(
    update: tf.Tensor,
    weight: tf.Tensor,
    weight_decay_rate: float,
    trust_coefficient: float,
    adapt: bool,
) -> tuple[tf.Tensor, tf.Tensor]:
    """The layer-wise block LARS and LAMB share, as ``(u, ratio)``: the
    direction is ``ratio * u``.

    ``u = update + weight_decay_rate * w``, ``ratio = trust_ratio(||w||,
    ||u||, trust_coefficient)`` when `adapt`, else 1 (optax's
    ``add_decayed_weights`` then ``scale_by_trust_ratio``). LARS passes the
    gradient and its `eta`, LAMB the Adam direction and 1.
    `weight_decay_rate` and `adapt` are Python values, decided per variable
    from the exclusion lists at trace time. The ratio is returned apart so
    that a caller multiplies it into its other scalars (the learning rate)
    before it touches the tensor: one pass over `u` instead of two.
    """
    u = update + weight_decay_rate * weight if weight_decay_rate else update
    if not adapt:
        return u, tf.constant(1.0, tf.float32)
    return u, trust_ratio(l2_norm(weight), l2_norm(u), trust_coefficient)


def layerwise_direction(
    update: tf.Tensor,
    weight: tf.Tensor,
    weight_decay_rate: float,
    trust_coefficient: float,
    adapt: bool,
) -> tf.Tensor:
    """``ratio * u`` of `layerwise_update`."""
    u, ratio = layerwise_update(update, weight, weight_decay_rate, trust_coefficient, adapt)
    return ratio * u


def momentum_step(
    velocity: tf.Tensor, scaled_update: tf.Tensor, momentum: float, nesterov: bool
) -> tuple[tf.Tensor, tf.Tensor]:
    """Classic (heavy-ball) momentum of LARS, Model Garden form.

    ``v' = momentum * v + scaled_update``; the step subtracted from the
    weights is ``v'``, or ``momentum * v' + scaled_update`` with Nesterov.

    Returns:
        ``(new_velocity, step)``.
    """
    new_velocity = momentum * velocity + scaled_update
    if nesterov:
        return new_velocity, momentum * new_velocity + scaled_update
    return new_velocity, new_velocity


def sum_duplicate_rows(gradient: tf.IndexedSlices) -> tf.IndexedSlices:
    """The same gradient with each row index once: the values of repeated
    indices (an `Embedding` looked up twice in a batch) summed, rows in
    order of first appearance. Its cost is that of the rows, not of the
    table."""
    rows, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(gradient.values, positions, tf.shape(rows)[0])
    return tf.IndexedSlices(values, rows, gradient.dense_shape)


def adam_direction(
    m: tf.Tensor,
    v: tf.Tensor,
    gradient: tf.Tensor,
    beta_1: float,
    beta_2: float,
    epsilon: float,
    step: Scalar,
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Bias-corrected Adam direction ``mhat / (sqrt(vhat) + epsilon)`` of
    LAMB (Model Garden / You et al. 2020 form).

    Returns:
        ``(new_m, new_v, direction)``.
    """
    new_m = beta_1 * m + (1.0 - beta_1) * gradient
    new_v = beta_2 * v + (1.0 - beta_2) * tf.square(gradient)
    return new_m, new_v, bias_corrected_direction(new_m, new_v, beta_1, beta_2, epsilon, step)


def bias_corrected_direction(
    m: tf.Tensor, v: tf.Tensor, beta_1: float, beta_2: float, epsilon: float, step: Scalar
) -> tf.Tensor:
    """``mhat / (sqrt(vhat) + epsilon)`` from the moments after `step`
    updates, ``mhat = m / (1 - beta_1^step)``, ``vhat = v / (1 - beta_2^step)``.

    Computed as ``m * (sqrt(c2) / c1) / (sqrt(v) + epsilon * sqrt(c2))``
    with ``c1 = 1 - beta_1^step``, ``c2 = 1 - beta_2^step``: the same value,
    with the corrections on scalars rather than on two whole tensors.
    """
    step = tf.cast(step, tf.float32)
    c1 = 1.0 - tf.pow(tf.constant(beta_1, tf.float32), step)
    root_c2 = tf.sqrt(1.0 - tf.pow(tf.constant(beta_2, tf.float32), step))
    return (m * (root_c2 / c1)) / (tf.sqrt(v) + epsilon * root_c2)
