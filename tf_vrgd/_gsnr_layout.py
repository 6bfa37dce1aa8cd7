"""`MessageLayout`: the one place the VR hook's messages are ordered
(docs/hook.md). Made once per `apply` from the variables it updates, it
packs each replica's per-variable tensors into messages, lists them for the
collective with the device each goes to, and unpacks the reduced messages
on each device."""

from typing import NamedTuple

import tensorflow as tf

from tf_vrgd._keras_adapters import tf_variable
from tf_vrgd.statistics import variable_size

# Variables of at most this many elements (64 KiB in float32) travel and
# are updated together as one flat vector (the packed update) instead of
# one by one in the XLA program; docs/algorithms.md §6 gives the
# measurements behind it.
PACKED_MAX_ELEMENTS = 2**14


class Reduced(NamedTuple):
    """The reduced messages of an update, as a device program reads them:
    the large dense variables' sums and squares (lists; squares None
    between GSNR updates), the packed ones' (flat vectors, or None), each
    row-sparse variable's rows (`tf.IndexedSlices`: sums, or sums and
    squares side by side at a GSNR update), and the sample count (None
    without accumulation)."""

    large_sums: list
    large_squares: list | None
    packed_sum: tf.Tensor | None
    packed_square: tf.Tensor | None
    rows: list
    samples: tf.Tensor | None


class MessageLayout:
    """The order of an update's messages.

    `variables` are the Keras variables of the `apply` call, `indices`
    their positions in the optimizer, `sparse` the positions (in
    `variables`) whose gradients arrive row-sparse. They fall in three
    groups: large dense (over `PACKED_MAX_ELEMENTS` elements), one message
    each; row-sparse, one message per bundle of tables whose rows have one
    shape (`row_bundles`); small dense, packed into one flat vector. The
    messages go in that order; the collective carries the dense sums,
    then (at a GSNR update) the dense squares, then the rows, then the
    sample count.
    """

    def __init__(self, variables, indices, sparse):
        self.variables, self.indices = list(variables), list(indices)
        large, packed = [], []
        for j, variable in enumerate(self.variables):
            if j not in sparse:
                (packed if variable_size(variable) <= PACKED_MAX_ELEMENTS else large).append(j)
        self.large, self.sparse, self.packed = tuple(large), tuple(sparse), tuple(packed)
        self.table_shapes = [self.variables[j].shape for j in self.sparse]
        self.bundles = row_bundles(self.table_shapes)
        # The optimizer's indices of each group: what a device program is made for.
        self.key = tuple(tuple(indices[j] for j in group) for group in (large, sparse, packed))

    def pack(self, tensors):
        """Per-position `tensors` (row-sparse ones as `tf.IndexedSlices`)
        as messages: the large dense ones, the row bundles, the flat
        vector of the small ones."""
        rows = bundled_rows([tensors[j] for j in self.sparse], self.bundles)
        out = [tensors[j] for j in self.large] + rows
        if self.packed:
            out.append(flatten([tensors[j] for j in self.packed]))
        return out

    def collective(self, sums, squares, samples, measure):
        """``(value, destination)`` pairs for `batch_reduce_to`, from packed
        `sums` and `squares` (squares read at a GSNR update only; for the
        rows they are the sums and squares side by side)."""
        variables = [tf_variable(v) for v in self.variables]
        firsts = [self.sparse[positions[0]] for positions, _ in self.bundles]
        destinations = [variables[j] for j in self.large + tuple(firsts) + self.packed[:1]]
        dense = list(range(len(self.large))) + ([len(sums) - 1] if self.packed else [])
        rows = range(len(self.large), len(self.large) + len(self.bundles))
        values = [(sums[p], destinations[p]) for p in dense]
        if measure:
            values += [(squares[p], destinations[p]) for p in dense]
        values += [((squares if measure else sums)[p], destinations[p]) for p in rows]
        if samples is not None:
            values.append((samples, variables[0]))
        return values

    def unpack(self, reduced, measure, has_samples):
        """The reduced messages (`collective`'s order) as `Reduced`."""
        dense = len(self.large) + (1 if self.packed else 0)
        sums, rest = reduced[:dense], reduced[dense:]
        squares = None
        if measure:
            squares, rest = rest[:dense], rest[dense:]
        count = len(self.large)
        return Reduced(
            large_sums=sums[:count],
            large_squares=None if squares is None else squares[:count],
            packed_sum=sums[count] if self.packed else None,
            packed_square=squares[count] if self.packed and measure else None,
            rows=unbundled_rows(rest[: len(self.bundles)], self.bundles, self.table_shapes),
            samples=rest[len(self.bundles)] if has_samples else None,
        )


def flatten(tensors):
    """The elements of `tensors`, one after the other, as one vector."""
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)


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
