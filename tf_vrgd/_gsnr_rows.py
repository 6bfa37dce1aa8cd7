"""The VR hook's per-device program for row-sparse variables (embedding
tables), mixed into `tf_vrgd._gsnr_device.DevicePrograms`: the reduced
rows of every replica, their moments and GSNR at a GSNR update or their
last scale between GSNR updates, the slots written at those rows, and the
base rule on the scaled rows (docs/algorithms.md §5)."""

import tensorflow as tf

from tf_vrgd import functional
from tf_vrgd._keras_adapters import tf_variable as _tf_variable


class RowSparsePrograms:
    """The row-sparse part of a device's VR update (`_row_sparse_update`);
    the slots are made by `GSNRMixin.build`, and the base rule is applied
    by `DevicePrograms._apply_base_rule`."""

    def _row_sparse_update(self, indices, measure):
        """The VR update of the variables at `indices` from row-sparse sums,
        on one device, at the cost of the rows: the reduced rows of every
        replica (duplicates across replicas summed), their moments, GSNR
        and momentum (the layer mean over the measured elements: rows no
        sample touched have none), the slots written at those rows, and the
        base rule given the scaled rows as a `tf.IndexedSlices` (as Keras
        applies an embedding's gradient). Between GSNR updates
        (`measure` False) the sums hold gradients alone and the rows' last
        scale is applied. Runs outside XLA: the number of rows is known
        only at run time."""
        targets = []
        for i in indices:
            keras_variable = self._trainable_variables[i]
            targets.append(
                (
                    _tf_variable(keras_variable),
                    self._decays_decoupled(keras_variable),
                    _optional_tf_variable(self._gsnr_scales[i]),
                    _optional_tf_variable(self._gsnr_momentums[i]),
                    _optional_tf_variable(self._gsnr_row_updates[i]),
                    self._gsnr_monitor.value[i],
                )
            )

        shapes = [self._trainable_variables[i].shape for i in indices]
        bundles = row_bundles(shapes)

        def row_update(reduced, samples, learning_rate, step, replicas):
            reduced = unbundled_rows(reduced, bundles, shapes)
            for target, rows_of_replicas in zip(targets, reduced):
                variable, decays, scale_slot, momentum_slot, count_slot, statistics_slot = target
                table_shape = tf.constant(variable.shape.as_list(), tf.int64)
                # Each replica's rows are unique already: only rows from
                # several replicas can repeat. (One replica under XLA must
                # not call `tf.unique` on them either: on the run-time-sized
                # list of accumulated rows it takes XLA's padding for rows.)
                gradient = (
                    functional.sum_duplicate_rows(rows_of_replicas)
                    if replicas > 1
                    else rows_of_replicas
                )
                rows = gradient.indices
                if measure:
                    sums, squares = tf.split(gradient.values, 2, axis=-1)
                    gradient_mean, second_moment = reduced_moments(sums, squares, samples, replicas)
                    applied = self._measured_row_scale(
                        rows,
                        gradient_mean,
                        second_moment,
                        scale_slot=scale_slot,
                        momentum_slot=momentum_slot,
                        count_slot=count_slot,
                        statistics_slot=statistics_slot,
                    )
                else:
                    sums = gradient.values
                    counts = None
                    if momentum_slot is not None:
                        counts = functional.row_broadcast(tf.gather(count_slot, rows), sums)
                    gradient_mean, applied = functional.scale_between_gsnr_updates(
                        sums,
                        samples,
                        _gathered(scale_slot, rows),
                        _gathered(momentum_slot, rows),
                        self.beta_3,
                        counts,
                    )
                scaled = tf.IndexedSlices(applied * gradient_mean, rows, table_shape)
                self._apply_base_rule(variable, decays, scaled, learning_rate)

        return row_update

    def _measured_row_scale(
        self,
        rows,
        gradient_mean,
        second_moment,
        *,
        scale_slot,
        momentum_slot,
        count_slot,
        statistics_slot,
    ):
        """GSNR, clip and momentum of the `rows` of one variable at a GSNR
        update; writes its slots at those rows and returns the applied
        factor."""
        # Each row's bias correction counts the GSNR updates in which it
        # had a sample (docs/algorithms.md §3).
        new = functional.gsnr_scale(
            gradient_mean,
            second_moment,
            self.gamma,
            self.gsnr_epsilon,
            beta_3=self.beta_3,
            previous_scale=_gathered(scale_slot, rows),
            previous_momentum=_gathered(momentum_slot, rows),
            previous_row_updates=_gathered(count_slot if momentum_slot is not None else None, rows),
            statistics=statistics_slot is not None,
        )
        if scale_slot is not None:
            scale_slot.scatter_update(tf.IndexedSlices(new.scale, rows))
        if momentum_slot is not None:
            count_slot.scatter_update(tf.IndexedSlices(new.row_updates, rows))
            momentum_slot.scatter_update(tf.IndexedSlices(new.momentum, rows))
        if statistics_slot is not None:
            statistics_slot.assign_add(tf.concat([new.statistics, [1.0]], 0))
        return new.applied


def row_bundles(shapes):
    """The row-sparse variables of `shapes` (in order) in bundles that
    travel as one message: those whose rows have one shape
    (``shape[1:]``), in the order of their first member. Each bundle is
    ``(positions, starts)``: the variables' positions in `shapes`, and
    where each one's rows start in the bundle's stacked table.

    A message per table costs the collective a conditional and two
    all-gathers per table and device to build (`tf.IndexedSlices` are
    summed by gathering), which for DLRM's 26 tables took seconds of the
    first step's trace; stacked, each bundle costs that once.
    """
    members = {}
    for position, shape in enumerate(shapes):
        members.setdefault(tuple(shape[1:]), []).append(position)
    bundles = []
    for positions in members.values():
        starts = [0]
        for position in positions[:-1]:
            starts.append(starts[-1] + int(shapes[position][0]))
        bundles.append((tuple(positions), tuple(starts)))
    return tuple(bundles)


def bundled_rows(messages, bundles):
    """`messages` (a `tf.IndexedSlices` per row-sparse variable, in
    `row_bundles`' order of `shapes`) as one per bundle: the rows of a
    bundle's tables stacked, table t's row r as row ``starts[t] + r``
    (int64). A bundle of one table is its message as it is."""
    out = []
    for positions, starts in bundles:
        if len(positions) == 1:
            out.append(messages[positions[0]])
            continue
        parts = [messages[p] for p in positions]
        indices = [tf.cast(m.indices, tf.int64) + start for m, start in zip(parts, starts)]
        last = parts[-1]
        rows = starts[-1] + tf.cast(last.dense_shape[0], tf.int64)
        shape = tf.concat([[rows], tf.cast(last.dense_shape[1:], tf.int64)], 0)
        out.append(
            tf.IndexedSlices(tf.concat([m.values for m in parts], 0), tf.concat(indices, 0), shape)
        )
    return out


def unbundled_rows(reduced, bundles, table_shapes):
    """The inverse of `bundled_rows` on the reduced bundles: a
    `tf.IndexedSlices` per variable, in order, of its rows (int64 row
    numbers) in the order they came, with `table_shapes[position]`'s first
    axis and the message's others."""
    out = [None] * sum(len(positions) for positions, _ in bundles)
    for (positions, starts), message in zip(bundles, reduced):
        if len(positions) == 1:
            out[positions[0]] = message
            continue
        rows = tf.cast(message.indices, tf.int64)
        # Which table each row is of: the number of later starts it reaches.
        table = tf.searchsorted(
            tf.constant(starts[1:], tf.int64), rows, side="right", out_type=tf.int32
        )
        values = tf.dynamic_partition(message.values, table, len(positions))
        table_rows = tf.dynamic_partition(rows, table, len(positions))
        for k, (position, start) in enumerate(zip(positions, starts)):
            shape = tf.concat(
                [
                    tf.constant([table_shapes[position][0]], tf.int64),
                    tf.cast(message.dense_shape[1:], tf.int64),
                ],
                0,
            )
            out[position] = tf.IndexedSlices(values[k], table_rows[k] - start, shape)
    return out


def reduced_moments(sum_of_gradients, sum_of_squares, samples, replicas):
    """``(gbar, s)`` from all-reduced sums: from Keras-scaled replica
    gradients when `samples` is None (no accumulation), else from the
    accumulated samples and their count."""
    if samples is None:
        return functional.gradient_moments(sum_of_gradients, sum_of_squares, replicas, 1)
    return functional.sample_moments(sum_of_gradients, sum_of_squares, samples)


def _gathered(slot, rows):
    """The `rows` of a slot, or None for a missing slot."""
    return None if slot is None else tf.gather(slot, rows)


def _optional_tf_variable(slot):
    return None if slot is None else _tf_variable(slot)
