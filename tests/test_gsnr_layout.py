"""`MessageLayout`, the one place the VR hook's messages are ordered:
unpack undoes pack, through the collective's order, for every group."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_vrgd._gsnr_layout import PACKED_MAX_ELEMENTS, MessageLayout

RNG = np.random.default_rng(81)
# Two large kernels, three tables (two of one row shape, bundled), two
# small variables (packed), interleaved.
SHAPES = [(200, 100), (7, 4), (30, 4), (5,), (129, 128), (9, 3), (3, 3)]
SPARSE = (1, 2, 5)


def _rows(shape, count):
    rows = np.sort(RNG.choice(shape[0], count, replace=False)).astype(np.int64)
    values = RNG.standard_normal((count, *shape[1:])).astype(np.float32)
    return tf.IndexedSlices(tf.constant(values), tf.constant(rows), tf.constant(shape, tf.int64))


@pytest.mark.parametrize("measure", [True, False])
def test_unpack_undoes_pack_through_the_collective_order(measure):
    variables = [keras.Variable(np.zeros(shape, np.float32)) for shape in SHAPES]
    layout = MessageLayout(variables, indices=list(range(10, 17)), sparse=SPARSE)
    assert layout.large == (0, 4) and layout.packed == (3, 6)
    assert all(np.prod(SHAPES[j]) > PACKED_MAX_ELEMENTS for j in layout.large)
    assert len(layout.bundles) == 2  # rows of 4, rows of 3
    assert layout.key == ((10, 14), (11, 12, 15), (13, 16))

    def tensors(doubled):
        out = []
        for j, shape in enumerate(SHAPES):
            if j in SPARSE:
                width = (2 if doubled else 1) * shape[-1]
                out.append(_rows((*shape[:-1], width), 3))
            else:
                out.append(tf.constant(RNG.standard_normal(shape), tf.float32))
        return out

    sums, squares = tensors(False), tensors(True)
    samples = tf.constant(8.0)
    values = layout.collective(layout.pack(sums), layout.pack(squares), samples, measure)
    # The collective returns its values in the order given: identity here.
    reduced = layout.unpack([value for value, _ in values], measure, has_samples=True)

    for got, j in zip(reduced.large_sums, layout.large):
        np.testing.assert_array_equal(got, sums[j])
    if measure:
        for got, j in zip(reduced.large_squares, layout.large):
            np.testing.assert_array_equal(got, squares[j])
        packed_squares = np.concatenate([np.reshape(squares[j], -1) for j in layout.packed])
        np.testing.assert_array_equal(reduced.packed_square, packed_squares)
    else:
        assert reduced.large_squares is None and reduced.packed_square is None
    packed = np.concatenate([np.reshape(sums[j], -1) for j in layout.packed])
    np.testing.assert_array_equal(reduced.packed_sum, packed)
    rows_sent = squares if measure else sums
    for got, j in zip(reduced.rows, SPARSE):
        sent = rows_sent[j]
        np.testing.assert_array_equal(got.indices, sent.indices)
        np.testing.assert_array_equal(got.values, sent.values)
        np.testing.assert_array_equal(got.dense_shape, sent.dense_shape)
    assert float(reduced.samples) == 8.0
    # Each message goes to a device of the variable it starts with.
    destinations = [d for _, d in values]
    assert destinations[0] is variables[0].value and destinations[1] is variables[4].value
