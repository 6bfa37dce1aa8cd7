"""The replica side of the VR hook (`tf_vrgd._gsnr`): what each replica
does with its gradients before the one collective, and the cadence of GSNR
updates.

- `ReplicaIntake`, mixed into `GSNRMixin`: with
  `gradient_accumulation_steps`, each replica's running sums of its
  micro-step samples and their squares (on-read slots, no communication),
  the rows a row-sparse variable's micro-steps touched, and their reset
  after the update; `_on_cadence`, the GSNR cadence (`tf_vrgd._cadence`,
  shared with `NoiseScale`).
- Functions on the gradients of one replica: the three groups of an
  update (large dense, row-sparse, small dense packed into one vector),
  the messages that go into the collective beside the sums (squares, or
  rows' sums and squares side by side), and the stand-ins of the branches
  that do not measure.
"""

import functools

import tensorflow as tf

from tf_vrgd import functional
from tf_vrgd._cadence import Cadence
from tf_vrgd._keras_adapters import is_update_step
from tf_vrgd._keras_adapters import tf_variable as _tf_variable
from tf_vrgd.statistics import variable_size

# Variables of at most this many elements (64 KiB in float32) are updated
# together by the packed update (`DevicePrograms._packed_update`) instead
# of one by one in the XLA program; docs/algorithms.md §6 gives the
# measurements behind it.
PACKED_MAX_ELEMENTS = 2**14


class ReplicaIntake:
    """Replica-side accumulation and the GSNR cadence of `GSNRMixin` (the
    slots are made by its `build`)."""

    # -- cadence ------------------------------------------------------------

    def _is_update_step(self):
        return is_update_step(self)

    def _on_cadence(self, gsnr_update, between):
        """`gsnr_update()` at an update that measures the GSNR, `between()`
        at one that does not (`Cadence.choose` at `gsnr_interval`)."""
        return Cadence(self.gsnr_interval).choose(self.iterations, gsnr_update, between)

    def _gsnr_update_count(self):
        """GSNR updates up to and including the update in progress (the
        GSNR momentum's bias correction counts them)."""
        return Cadence(self.gsnr_interval).measured_updates(self.iterations)

    # -- accumulation ---------------------------------------------------------

    def _accumulate(self, grads, indices, sparse, is_update_step):
        """Adds this micro-step's gradients and their squares to the
        replica's running sums, in place, and returns the new sums (and,
        for row-sparse gradients, the rows they hold).

        One pass over memory (reads g and both sums, writes both sums: 20
        B/param in fp32) in one XLA call for all dense variables, unless
        `jit_update` is False. Row-sparse gradients add their rows (at the
        cost of the rows) and mark them; at the update, each replica
        gathers the rows it marked.
        """
        dense = tuple(indices[j] for j in range(len(grads)) if j not in sparse)
        dense_grads = [g for j, g in enumerate(grads) if j not in sparse]
        accumulate = self._moment_accumulation(dense, squares=True)
        add_rows = functools.partial(self._accumulate_rows, [indices[j] for j in sparse])
        sparse_grads = [grads[j] for j in sparse]

        def add(measure):
            if measure:
                accumulate(dense_grads)
            else:
                self._moment_accumulation(dense, squares=False)(dense_grads)
            add_rows(sparse_grads, measure)

        # No square is taken for an update that does not measure the GSNR.
        self._on_cadence(lambda: add(True), lambda: add(False))
        sums, squares, rows = [], [], []
        for j, i in enumerate(indices):
            if j in sparse:
                gathered = self._gathered_rows(i, grads[j], is_update_step)
                rows.append(gathered[0])
                sums.append(gathered[1])
                squares.append(gathered[2])
            else:
                sums.append(self._accumulated_gradients[i].value.read_value())
                squares.append(self._accumulated_squares[i].value.read_value())
        return sums, squares, self._accumulated_samples.value.read_value(), rows

    def _accumulate_rows(self, indices, grads, squares):
        """Adds row-sparse micro-step gradients (`g_d = R * g`) and, if
        `squares`, their squares to the replica's sums at their rows, and
        marks the rows."""
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        for i, gradient in zip(indices, grads):
            sample = gradient.values * float(replicas) if replicas > 1 else gradient.values
            rows = gradient.indices
            replica_copy(self._accumulated_gradients[i]).scatter_add(tf.IndexedSlices(sample, rows))
            if squares:
                replica_copy(self._accumulated_squares[i]).scatter_add(
                    tf.IndexedSlices(tf.square(sample), rows)
                )
            replica_copy(self._accumulated_rows[i]).scatter_update(
                tf.IndexedSlices(tf.ones_like(rows, tf.float32), rows)
            )

    def _gathered_rows(self, index, gradient, is_update_step):
        """At an update step, this replica's marked rows of variable
        `index` and its sums there: ``(rows, sums, sums and squares side
        by side)`` (`square_messages`' layout; an empty stand-in for the last
        between GSNR updates); empty otherwise."""
        marks = replica_copy(self._accumulated_rows[index])
        sum_slot = replica_copy(self._accumulated_gradients[index])
        square_slot = replica_copy(self._accumulated_squares[index])
        shape = gradient.dense_shape

        def gather(measure):
            rows = tf.cast(tf.where(marks.read_value() > 0.0)[:, 0], gradient.indices.dtype)
            rows = at_least_one_row(tf.IndexedSlices(rows[:, None], rows)).indices
            sums = tf.IndexedSlices(sum_slot.sparse_read(rows), rows, shape)
            if measure:
                moments = side_by_side(sums.values, square_slot.sparse_read(rows), sums)
            else:
                moments = empty_like(gradient, doubled=True)
            return rows, sums, moments

        def none():
            empty = empty_like(gradient)
            return empty.indices, empty, empty_like(gradient, doubled=True)

        def at_update():
            return self._on_cadence(lambda: gather(True), lambda: gather(False))

        return tf.cond(is_update_step, at_update, none)

    def _moment_accumulation(self, indices, squares):
        """``sum += g_d; squares += g_d^2; samples += 1`` for the variables
        at `indices` (without the squares unless `squares`), with ``g_d = R *
        g`` (Keras scales a replica's loss by 1/R), made once per set of
        variables like `DevicePrograms._device_update`.

        The slots are captured, not passed: a captured on-read slot is this
        replica's copy, and a trace is made per replica device. (Passed as
        arguments, distributed slots are bound at trace time too, so a
        function shared by several optimizers writes to the slots it was
        first traced with.)
        """
        if (indices, squares) in self._moment_accumulations:
            return self._moment_accumulations[(indices, squares)]
        sum_slots = [self._accumulated_gradients[i] for i in indices]
        square_slots = [self._accumulated_squares[i] for i in indices]
        samples = self._accumulated_samples

        def accumulate(grads):
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            for gradient, sum_slot, square_slot in zip(grads, sum_slots, square_slots):
                sample = gradient * float(replicas) if replicas > 1 else gradient
                # On the tf.Variables (see `ReplicaAccumulationMixin`: Keras'
                # `assign_add` fails on (0, n) variables).
                _tf_variable(sum_slot).assign_add(sample)
                if squares:
                    _tf_variable(square_slot).assign_add(tf.square(sample))
            samples.assign_add(1.0)

        if self.jit_update:
            accumulate = tf.function(accumulate, jit_compile=True)
        self._moment_accumulations[(indices, squares)] = accumulate
        return accumulate

    def _reset_accumulators(self, indices, sparse, rows):
        def reset(slots):
            for slot in slots:
                slot.assign(tf.zeros(slot.shape, slot.dtype))

        dense = [i for j, i in enumerate(indices) if j not in sparse]
        reset(self._accumulated_gradients[i] for i in dense)
        squares = [self._accumulated_squares[i] for i in dense]
        # The squares hold sums at GSNR updates only.
        self._on_cadence(lambda: reset(squares), lambda: None)
        # Row-sparse sums: zeros at the rows they hold, at the cost of the rows.
        for j, marked in zip(sparse, rows):
            i = indices[j]
            for slots in (self._accumulated_gradients, self._accumulated_squares):
                slot = replica_copy(slots[i])
                zeros = tf.zeros(tf.concat([tf.shape(marked), slot.shape[1:]], 0), slot.dtype)
                slot.scatter_update(tf.IndexedSlices(zeros, marked))
            replica_copy(self._accumulated_rows[i]).scatter_update(
                tf.IndexedSlices(tf.zeros_like(marked, tf.float32), marked)
            )
        self._accumulated_samples.assign(0.0)


def float32_rows_or_dense(gradient):
    """`gradient` in float32: row-sparse if it is a `tf.IndexedSlices` of a
    table of rank 2 or more (an embedding), dense otherwise. A rank-1
    table's rows are single numbers (a per-item bias looked up by id), and
    the row path lays a row's sum and square side by side along its last
    axis, which such rows do not have; made dense, it costs one number per
    row of the table."""
    if isinstance(gradient, tf.IndexedSlices) and gradient.values.shape.rank == 1:
        return functional.as_float32(gradient)
    return functional.as_float32_slices(gradient)


def at_least_one_row(slices):
    """`slices`, or row 0 with zeros where it has no rows: a zero row
    changes no sum, and with TensorFlow 2.21's collectives on CPU, rows
    made by `tf.unique` of nothing on every replica and then all-gathered
    end the process (a segmentation fault; so do Keras' own optimizers
    given an empty `tf.IndexedSlices` on every replica)."""
    missing = tf.cast(tf.equal(tf.size(slices.indices), 0), tf.int32)
    padding = tf.zeros(tf.concat([[missing], tf.shape(slices.values)[1:]], 0), slices.values.dtype)
    return tf.IndexedSlices(
        tf.concat([slices.values, padding], 0),
        tf.concat([slices.indices, tf.zeros([missing], slices.indices.dtype)], 0),
        slices.dense_shape,
    )


def replica_copy(slot):
    """This replica's own copy of an on-read slot, in replica context: the
    distributed variable takes no scatter (TensorFlow's
    `_get_on_device_or_primary`, which its own reads use; a plain variable
    outside a strategy is its own copy)."""
    variable = _tf_variable(slot)
    local = getattr(variable, "_get_on_device_or_primary", None)
    return local() if local is not None else variable


def update_groups(variables, sparse):
    """Positions of `variables` in three groups: large dense (over
    `PACKED_MAX_ELEMENTS` elements), row-sparse (`sparse`), small dense."""
    large, packed = [], []
    for j, variable in enumerate(variables):
        if j not in sparse:
            (packed if variable_size(variable) <= PACKED_MAX_ELEMENTS else large).append(j)
    return tuple(large), tuple(sparse), tuple(packed)


def grouped(tensors, groups):
    """`tensors` (one per position) in the order of `groups`: the large
    dense ones, the row-sparse ones, then the small dense ones concatenated
    into one flat vector (one message in the collective, one pass on each
    device)."""
    large, sparse, packed = groups
    out = [tensors[j] for j in large + sparse]
    if packed:
        out.append(flatten([tensors[j] for j in packed]))
    return out


def flatten(tensors):
    """The elements of `tensors`, one after the other, as one vector."""
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)


def square_messages(grads):
    """What the GSNR update reduces beside the gradient sums: the squares
    of dense gradients, and for row-sparse ones the rows' values and their
    squares side by side (one gathered message per variable)."""
    out = []
    for g in grads:
        if isinstance(g, tf.IndexedSlices):
            out.append(side_by_side(g.values, tf.square(g.values), g))
        else:
            out.append(tf.square(g))
    return out


def side_by_side(sums, squares, like):
    """Row sums and squares as one `tf.IndexedSlices` (the last axis
    doubled, in its values and its dense shape) at the rows of `like`."""
    shape = tf.cast(like.dense_shape, tf.int64)
    shape = tf.concat([shape[:-1], 2 * shape[-1:]], 0)
    return tf.IndexedSlices(tf.concat([sums, squares], -1), like.indices, shape)


def empty_like(gradient, doubled=False):
    """An empty stand-in of the kind of `gradient` (for a `tf.cond` branch
    whose value is not read); of `side_by_side`'s kind if `doubled`."""
    if isinstance(gradient, tf.IndexedSlices):
        values = tf.zeros([0, *gradient.values.shape[1:]], gradient.values.dtype)
        empty = tf.IndexedSlices(
            values, tf.zeros([0], gradient.indices.dtype), gradient.dense_shape
        )
        return side_by_side(values, values, empty) if doubled else empty
    return tf.zeros([0])
