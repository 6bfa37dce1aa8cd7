"""Pure update-rule arithmetic shared by every optimizer in the package.

Each function here is stateless: tensors in, tensors out, no variables, no
distribution logic. The optimizer classes call these pieces in the order the
rules in ``ALGORITHMS.md`` give them, and each piece has its own numpy
reference test in ``tests/test_functional.py``.

All statistics are computed in float32 whatever the variable dtype; callers
cast the result back to the variable dtype when they assign it.
"""

import tensorflow as tf


def as_float32(value):
    """Returns `value` as a dense float32 tensor.

    `tf.IndexedSlices` (sparse gradients from `Embedding` layers) are
    densified; duplicate indices are summed, which is what the gradient
    means.
    """
    if isinstance(value, tf.IndexedSlices):
        value = tf.convert_to_tensor(value)
    return tf.cast(value, tf.float32)


def l2_norm(tensor):
    """Euclidean norm of all elements of `tensor`, as a float32 scalar."""
    tensor = tf.cast(tensor, tf.float32)
    return tf.sqrt(tf.reduce_sum(tf.square(tensor)))


def trust_ratio(weight_norm, update_norm, trust_coefficient=1.0):
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
    return tf.where(
        both_positive, trust_coefficient * weight_norm / safe_update_norm, 1.0
    )


def larc_factor(
    weight_norm,
    gradient_norm,
    learning_rate,
    trust_coefficient,
    epsilon,
    weight_decay,
    clip,
):
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
        trust_coefficient
        * weight_norm
        / (gradient_norm + weight_decay * weight_norm + epsilon)
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
    gradient,
    weight,
    learning_rate,
    trust_coefficient,
    epsilon,
    weight_decay,
    clip,
):
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


def lars_direction(gradient, weight, weight_decay_rate, trust_coefficient,
                   adapt):
    """The LARS step direction before the learning rate and momentum.

    ``u = g + weight_decay_rate * w``; returns ``trust * u`` with
    ``trust = trust_ratio(||w||, ||u||, trust_coefficient)`` when `adapt`,
    else ``u``. `weight_decay_rate` and `adapt` are Python values (decided per
    variable from the exclusion lists, at trace time).
    """
    update = gradient + weight_decay_rate * weight if weight_decay_rate else gradient
    if not adapt:
        return update
    trust = trust_ratio(l2_norm(weight), l2_norm(update), trust_coefficient)
    return trust * update


def momentum_step(velocity, scaled_update, momentum, nesterov):
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
