"""One update of the variables a device program updates together, and
what it leaves in their slots (docs/hook.md): the rule composed once
(`measure`) from the pure pieces of `tf_vrgd.functional`, and its two
stateful steps (`write_back`, `between_updates`), for three views of a
program's tensors: `WholeVariable`, `PackedVariables`, `TableRows`."""

from collections.abc import Sequence
from typing import NamedTuple

import tensorflow as tf

from tf_vrgd import _functional_gsnr as rule_pieces
from tf_vrgd._functional_moments import (
    Scalar,
    TensorLike,
    gradient_moments,
    measured_elements,
    measured_mean_gsnr,
    raw_gsnr,
    sample_moments,
)


class GSNRRule(NamedTuple):
    """The rule's numbers: the clip floor, the variance floor, the GSNR
    momentum."""

    gamma: Scalar
    epsilon: Scalar
    beta_3: Scalar = 0.0

    def constants(self):
        """The rule with each number one float32 constant (one per program,
        not one per variable)."""
        return GSNRRule(*(tf.constant(x, tf.float32) for x in self))

    def in_program(self, step, measure):
        """``(constants(), correction)`` for one program: the momentum's bias
        correction ``1 - beta_3^step`` at a GSNR update (`measure`), None
        between."""
        constants = self.constants()
        if not measure:
            return constants, None
        return constants, rule_pieces.gsnr_momentum_correction(constants.beta_3, step)


class GSNRState(NamedTuple):
    """The rule's state of the variables one program updates, None for a
    kind it does not keep: as slots (a list each, in the program's order;
    `write_back` replaces the first three and adds to the statistics) or
    as a view reads them (`read`): the last scale, the GSNR momentum, and
    per row the GSNR updates it had a sample in (tables with a momentum)."""

    scale: TensorLike | list | None = None
    momentum: TensorLike | list | None = None
    row_updates: TensorLike | list | None = None
    statistics: list | None = None

    def read(self, view):
        return GSNRState(*(view.read(slots) for slots in self[:3]))


class GSNRScale(NamedTuple):
    """What `measure` computes: the factor `applied` to gbar, and the new
    `scale` (r), `momentum` and `row_updates` (None where not kept), and
    the `statistics` rows (`gsnr_statistics` then `noise_sums`, one per
    variable; None unless asked for)."""

    applied: tf.Tensor
    scale: tf.Tensor
    momentum: tf.Tensor | None
    row_updates: tf.Tensor | None
    statistics: tf.Tensor | None


class WholeVariable(NamedTuple):
    """One variable, whole. `layer_mean`: its `measured_mean_gsnr` when the
    caller has it (one program computes every large variable's), else it
    is computed here."""

    layer_mean: tf.Tensor | None = None

    def read(self, slots):
        return None if slots is None else slots[0]

    def write(self, slots, value):
        slots[0].assign(value)

    def normalized(self, gsnr, measured, gamma, gradient_mean, second_moment, epsilon):
        layer_mean = self.layer_mean
        if layer_mean is None:
            layer_mean = measured_mean_gsnr(gradient_mean, second_moment, epsilon)
        return rule_pieces.normalized_clipped_gsnr(gsnr, gamma, layer_mean=layer_mean), None

    def statistics(self, gsnr, scale, applied, gamma, moments, measured, means):
        del means
        rows = [
            rule_pieces.gsnr_statistics(gsnr, scale, applied, gamma, measured),
            rule_pieces.noise_sums(*moments, measured),
        ]
        return tf.concat(rows, 0)[None]


class TableRows(NamedTuple):
    """The `rows` (their numbers) of a table: normalised and summarised as
    one whole variable of those rows, its slots gathered and scattered."""

    rows: tf.Tensor

    def read(self, slots):
        return None if slots is None else tf.gather(slots[0], self.rows)

    def write(self, slots, value):
        slots[0].scatter_update(tf.IndexedSlices(value, self.rows))

    def normalized(self, *moments_and_rule):
        return WholeVariable().normalized(*moments_and_rule)

    def statistics(self, *terms):
        return WholeVariable().statistics(*terms)


class PackedVariables(NamedTuple):
    """Several variables as one flat vector: element i of variable
    ``segment_ids[i]``, variable j of ``sizes[j]`` elements."""

    segment_ids: tf.Tensor
    sizes: Sequence[int]

    def read(self, slots):
        if slots is None:
            return None
        return tf.concat([tf.reshape(slot, [-1]) for slot in slots], 0)

    def write(self, slots, value):
        for slot, piece in zip(slots, tf.split(value, self.sizes)):
            slot.assign(tf.reshape(piece, slot.shape))

    def normalized(self, gsnr, measured, gamma, gradient_mean, second_moment, epsilon):
        del gradient_mean, second_moment, epsilon
        scale, layer_means, counts = rule_pieces.segment_normalized_clipped_gsnr(
            gsnr, self.segment_ids, self.sizes, gamma, measured
        )
        return scale, (layer_means, counts)

    def statistics(self, gsnr, scale, applied, gamma, moments, measured, means):
        del gsnr
        layer_means, counts = means
        ids = self.segment_ids
        rows = [
            rule_pieces.segment_gsnr_statistics(
                layer_means, scale, applied, ids, counts, gamma, measured
            ),
            rule_pieces.segment_noise_sums(*moments, ids, len(self.sizes), measured),
        ]
        return tf.concat(rows, 1)


def measure(view, gradient_mean, second_moment, rule, correction, previous, statistics=False):
    """The GSNR update of `view`'s tensors (docs/algorithms.md §2-3): raw
    GSNR, normalised per layer over the measured elements and clipped to
    [gamma, 1], the `previous` scale kept where nothing is measured, then
    the GSNR momentum with its bias `correction` (``1 - beta_3^t``; per
    row from each row's own count where `previous` has row counts)."""
    gsnr = raw_gsnr(gradient_mean, second_moment, rule.epsilon)
    measured = measured_elements(second_moment)
    scale, means = view.normalized(
        gsnr, measured, rule.gamma, gradient_mean, second_moment, rule.epsilon
    )
    if previous.scale is not None:
        scale = rule_pieces.kept_where_unmeasured(scale, previous.scale, measured)
    applied, momentum, row_updates, rows = scale, None, None, None
    if previous.row_updates is not None:
        row_updates = rule_pieces.row_update_counts(previous.row_updates, measured)
        correction = rule_pieces.gsnr_momentum_correction(
            rule.beta_3, rule_pieces.row_broadcast(row_updates, scale)
        )
    if previous.momentum is not None:
        momentum, applied = rule_pieces.corrected_gsnr_momentum(
            previous.momentum, scale, rule.beta_3, correction, measured
        )
    if statistics:
        moments = (gradient_mean, second_moment)
        rows = view.statistics(gsnr, scale, applied, rule.gamma, moments, measured, means)
    return GSNRScale(applied, scale, momentum, row_updates, rows)


def write_back(view, slots, new):
    """Writes a `measure` result into the `GSNRState` `slots` through
    `view` (statistics added with the update count) and returns the factor
    applied to gbar."""
    for kept, value in zip(slots[:3], (new.scale, new.momentum, new.row_updates)):
        if kept is not None:
            view.write(kept, value)
    if slots.statistics is not None:
        for slot, row in zip(slots.statistics, tf.unstack(new.statistics)):
            slot.assign_add(tf.concat([row, [1.0]], 0))
    return new.applied


def between_updates(view, slots, rule, total, samples, gsnr_updates):
    """``(gbar, factor)`` at an update that does not measure: the last
    scale, or the GSNR momentum over its correction for `gsnr_updates`
    (per row from each row's count where rows are counted)."""
    previous = slots.read(view)
    if previous.row_updates is not None:
        gsnr_updates = rule_pieces.row_broadcast(previous.row_updates, total)
    return rule_pieces.scale_between_gsnr_updates(
        total, samples, previous.scale, previous.momentum, rule.beta_3, gsnr_updates
    )


def scaled_gradient(view, slots, rule, sums, squares, samples, replicas, step, correction):
    """``factor * gbar`` of `view`'s variables from the reduced `sums` and
    `squares`: `measure` and `write_back` at a GSNR update,
    `between_updates` (`squares` None, `step` GSNR updates so far)
    between. `samples`: the accumulated count, or None (Keras-scaled
    gradients of `replicas` replicas)."""
    if squares is None:
        gradient_mean, applied = between_updates(view, slots, rule, sums, samples, step)
        return applied * gradient_mean
    gradient_mean, second_moment = reduced_moments(sums, squares, samples, replicas)
    statistics = slots.statistics is not None
    new = measure(
        view, gradient_mean, second_moment, rule, correction, slots.read(view), statistics
    )
    return write_back(view, slots, new) * gradient_mean


def reduced_moments(sum_of_gradients, sum_of_squares, samples, replicas):
    """``(gbar, s)`` from all-reduced sums: of Keras-scaled replica
    gradients when `samples` is None, else of `samples` accumulated ones."""
    if samples is None:
        return gradient_moments(sum_of_gradients, sum_of_squares, replicas, 1)
    return sample_moments(sum_of_gradients, sum_of_squares, samples)


def rows_shape(variable):
    """The shape of a per-row slot of `variable`, None for a scalar."""
    return (variable.shape[0],) if len(variable.shape) else None
