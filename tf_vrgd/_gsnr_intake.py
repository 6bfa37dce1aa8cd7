"""`ReplicaIntake`: what each replica does with its gradients before the
one collective (docs/hook.md), and the state it keeps for that.

Without accumulation a replica's messages are its gradients and, at a
GSNR update, their squares. With `gradient_accumulation_steps`, each
replica adds each micro-step's samples and their squares to running sums
of its own (on-read slots, no communication), marks the rows row-sparse
micro-steps touch, and at the update hands on the sums (the marked rows
of a table) and the sample count; the sums are zeroed after the update.
"""

import functools

import tensorflow as tf

from tf_vrgd import functional
from tf_vrgd._gsnr_slots import rows_shape
from tf_vrgd._keras_adapters import tf_variable


class ReplicaIntake:
    """The replica side of the VR hook.

    `make_slots(name, **options)` makes one float32 slot per trainable
    variable of the optimizer and `make_scalar(name, **options)` one scalar
    (the face's, so that names, tracking and checkpoints are the
    optimizer's); `cadence` is the GSNR cadence (`tf_vrgd._cadence.Cadence`);
    `accumulation_steps` the micro-steps of an update (None: no
    accumulation); `jit` compiles the micro-step sums with XLA.
    """

    def __init__(self, make_slots, cadence, accumulation_steps, jit, make_scalar):
        self.cadence = cadence
        self.accumulates = bool(accumulation_steps)
        self._jit = jit
        self._programs = {}
        if not self.accumulates:
            return
        # On-read SUM slots keep one value per replica; checkpoints and
        # `model.save` store their cross-replica sum (restored as sum / R
        # per replica): totals in units that do not depend on R, so a
        # restore under another replica count resumes into the mean over
        # the samples actually taken.
        on_read = dict(synchronization="on_read", aggregation="sum")
        self.sums = make_slots("gradient_accumulator", **on_read)
        self.squares = make_slots("squared_gradient_accumulator", **on_read)
        # Rows with a sample in the micro-steps so far (> 0), for the
        # variables whose gradients arrive row-sparse.
        self.rows = make_slots("accumulated_rows", shape=rows_shape, **on_read)
        self.samples = make_scalar("gsnr_sample_count", **on_read)

    def messages(self, grads, layout, iterations, is_update_step):
        """This replica's messages (`layout.pack`ed sums and squares, and
        the sample count) for the update in progress, and a function to
        call once the collective has read them (the accumulators' reset).

        Whether the update measures is decided once, here: squares are
        taken (and read) at a GSNR update only, empty stand-ins between; a
        row-sparse variable's are its rows' sums and squares side by side
        (`side_by_side`)."""
        if not self.accumulates:
            sums = layout.pack(grads)
            squares = self.cadence.choose(
                iterations,
                lambda: square_messages(sums),
                lambda: [empty_like(g, doubled=True) for g in sums],
            )
            for square, gradient in zip(squares, sums):
                if not isinstance(gradient, tf.IndexedSlices):
                    square.set_shape(gradient.shape)
            return sums, squares, None, lambda: None
        sums, squares, marked = self.cadence.choose(
            iterations,
            lambda: self._accumulate(grads, layout, is_update_step, measure=True),
            lambda: self._accumulate(grads, layout, is_update_step, measure=False),
        )
        samples = self.samples.value.read_value()
        reset = functools.partial(self._reset, layout, marked, iterations)
        return sums, squares, samples, lambda: tf.cond(is_update_step, reset, lambda: None)

    def _accumulate(self, grads, layout, is_update_step, measure):
        """Adds this micro-step's samples (and, if `measure`, their squares)
        to the replica's sums; returns the packed sums, the packed squares
        (stand-ins unless `measure`) and the rows each table's sums hold."""
        indices, sparse = layout.indices, layout.sparse
        dense = tuple(indices[j] for j in range(len(grads)) if j not in sparse)
        self._accumulation(dense, squares=measure)(
            [g for j, g in enumerate(grads) if j not in sparse]
        )
        self._add_rows([indices[j] for j in sparse], [grads[j] for j in sparse], measure)
        sums, squares, marked = [], [], []
        for j, i in enumerate(indices):
            if j in sparse:
                rows, row_sums, moments = self._gathered_rows(i, grads[j], is_update_step, measure)
                marked.append(rows)
                sums.append(row_sums)
                squares.append(moments)
            else:
                sums.append(self.sums[i].value.read_value())
                squares.append(self.squares[i].value.read_value())
        return layout.pack(sums), layout.pack(squares), marked

    def _accumulation(self, indices, squares):
        """``sums += g_d; squares += g_d^2; samples += 1`` for the variables
        at `indices` (without the squares unless `squares`), with ``g_d = R
        * g`` (Keras scales a replica's loss by 1/R), made once per set of
        variables. The slots are captured, not passed: a captured on-read
        slot is this replica's copy, and a trace is made per replica
        device. (Passed as arguments, distributed slots are bound at trace
        time too, so a function shared by several optimizers writes to the
        slots it was first traced with.)"""
        if (indices, squares) in self._programs:
            return self._programs[(indices, squares)]
        sum_slots = [self.sums[i] for i in indices]
        square_slots = [self.squares[i] for i in indices]
        samples = self.samples

        def accumulate(grads):
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            for gradient, sum_slot, square_slot in zip(grads, sum_slots, square_slots):
                sample = gradient * float(replicas) if replicas > 1 else gradient
                # On the tf.Variables: Keras' `assign_add` fails on (0, n) ones.
                tf_variable(sum_slot).assign_add(sample)
                if squares:
                    tf_variable(square_slot).assign_add(tf.square(sample))
            samples.assign_add(1.0)

        if self._jit:
            accumulate = tf.function(accumulate, jit_compile=True)
        self._programs[(indices, squares)] = accumulate
        return accumulate

    def _add_rows(self, indices, grads, squares):
        """Adds row-sparse micro-step samples (`g_d = R * g`) and, if
        `squares`, their squares at their rows, and marks the rows."""
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        for i, gradient in zip(indices, grads):
            sample = gradient.values * float(replicas) if replicas > 1 else gradient.values
            rows = gradient.indices
            replica_copy(self.sums[i]).scatter_add(tf.IndexedSlices(sample, rows))
            if squares:
                replica_copy(self.squares[i]).scatter_add(tf.IndexedSlices(tf.square(sample), rows))
            replica_copy(self.rows[i]).scatter_update(
                tf.IndexedSlices(tf.ones_like(rows, tf.float32), rows)
            )

    def _gathered_rows(self, index, gradient, is_update_step, measure):
        """At an update step, this replica's marked rows of variable `index`
        and its sums there: ``(rows, sums, moments)``, moments as
        `side_by_side` if `measure` (an empty stand-in if not); empty at
        other micro-steps."""
        marks = replica_copy(self.rows[index])
        sum_slot = replica_copy(self.sums[index])
        square_slot = replica_copy(self.squares[index])

        def gather():
            rows = tf.cast(tf.where(marks.read_value() > 0.0)[:, 0], gradient.indices.dtype)
            rows = at_least_one_row(tf.IndexedSlices(rows[:, None], rows)).indices
            sums = tf.IndexedSlices(sum_slot.sparse_read(rows), rows, gradient.dense_shape)
            if measure:
                return rows, sums, side_by_side(sums.values, square_slot.sparse_read(rows), sums)
            return rows, sums, empty_like(gradient, doubled=True)

        def none():
            empty = empty_like(gradient)
            return empty.indices, empty, empty_like(gradient, doubled=True)

        return tf.cond(is_update_step, gather, none)

    def _reset(self, layout, marked, iterations):
        indices, sparse = layout.indices, layout.sparse

        def reset(slots):
            for slot in slots:
                slot.assign(tf.zeros(slot.shape, slot.dtype))

        dense = [i for j, i in enumerate(indices) if j not in sparse]
        reset(self.sums[i] for i in dense)
        squares = [self.squares[i] for i in dense]
        # The squares hold sums at GSNR updates only.
        self.cadence.choose(iterations, lambda: reset(squares), lambda: None)
        # Row-sparse sums: zeros at the rows they hold, at the cost of the rows.
        for j, rows in zip(sparse, marked):
            i = indices[j]
            for slots in (self.sums, self.squares):
                slot = replica_copy(slots[i])
                zeros = tf.zeros(tf.concat([tf.shape(rows), slot.shape[1:]], 0), slot.dtype)
                slot.scatter_update(tf.IndexedSlices(zeros, rows))
            replica_copy(self.rows[i]).scatter_update(
                tf.IndexedSlices(tf.zeros_like(rows, tf.float32), rows)
            )
        self.samples.assign(0.0)


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
    variable = tf_variable(slot)
    local = getattr(variable, "_get_on_device_or_primary", None)
    return local() if local is not None else variable


def square_messages(grads):
    """What a GSNR update reduces beside the gradient sums: the squares of
    dense gradients, and for row-sparse ones the rows' values and their
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
