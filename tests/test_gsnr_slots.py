"""The VR rule's stateful steps (`tf_vrgd._gsnr_slots`) through each view
of a program's slots, and the rule's new pieces, against numpy."""

import numpy as np
import pytest
import tensorflow as tf

from tests import references as ref
from tf_vrgd import _gsnr_slots as slots_
from tf_vrgd import functional

RNG = np.random.default_rng(71)


def test_kept_where_unmeasured_keeps_the_previous_value_there():
    new, previous = RNG.standard_normal((2, 4, 3)).astype(np.float32)
    measured = RNG.uniform(size=(4, 3)) > 0.4
    got = functional.kept_where_unmeasured(tf.constant(new), tf.constant(previous), measured)
    np.testing.assert_array_equal(got, np.where(measured, new, previous))


def test_row_update_counts_add_one_for_each_row_with_a_measured_element():
    previous = np.array([0.0, 2.0, 5.0, 1.0], np.float32)
    measured = np.zeros((4, 3), bool)
    measured[1, 2] = measured[3] = True
    got = functional.row_update_counts(tf.constant(previous), tf.constant(measured))
    np.testing.assert_array_equal(got, previous + measured.any(axis=1))


def _slots(shapes, value=None):
    return [
        tf.Variable(RNG.standard_normal(shape).astype(np.float32) if value is None else value)
        for shape in shapes
    ]


def test_each_view_reads_and_writes_its_slots():
    # Whole: the one slot. Packed: the slots' elements one after the other.
    # Rows: the slot's rows given, in their order.
    whole = _slots([(3, 4)])
    view = slots_.WholeVariable()
    np.testing.assert_array_equal(view.read(whole), whole[0].numpy())
    value = RNG.standard_normal((3, 4)).astype(np.float32)
    view.write(whole, value)
    np.testing.assert_array_equal(whole[0].numpy(), value)

    packed = _slots([(2, 3), (4,), (1, 1)])
    sizes = [6, 4, 1]
    view = slots_.PackedVariables(tf.constant(np.repeat([0, 1, 2], sizes)), sizes)
    flat = np.concatenate([s.numpy().reshape(-1) for s in packed])
    np.testing.assert_array_equal(view.read(packed), flat)
    value = RNG.standard_normal(11).astype(np.float32)
    view.write(packed, value)
    for slot, piece in zip(packed, np.split(value, np.cumsum(sizes)[:-1])):
        np.testing.assert_array_equal(slot.numpy(), piece.reshape(slot.shape))

    table = _slots([(6, 2)])
    before = table[0].numpy()
    rows = np.array([4, 0, 2])
    view = slots_.TableRows(tf.constant(rows))
    np.testing.assert_array_equal(view.read(table), before[rows])
    value = RNG.standard_normal((3, 2)).astype(np.float32)
    view.write(table, value)
    expected = before.copy()
    expected[rows] = value
    np.testing.assert_array_equal(table[0].numpy(), expected)
    assert view.read(None) is None


@pytest.mark.parametrize("kept", ["scale", "momentum"])
def test_a_measured_update_writes_back_what_numpy_gives(kept):
    # Rows 1 and 4 of a table have samples: they are measured, written
    # back at those rows (scale, or momentum and row counts), and their
    # statistics summed with the update count; the other rows keep theirs.
    beta_3, gamma, table_rows = 0.9, 0.2, 6
    rows = np.array([4, 1])
    samples = RNG.standard_normal((4, 2, 3)) + 0.6
    samples[:, 1, 0] = 0.0  # an element of row 1 without a sample
    momentum = kept == "momentum"
    slots = slots_.GSNRState(
        scale=None if momentum else _slots([(table_rows, 3)]),
        momentum=_slots([(table_rows, 3)]) if momentum else None,
        row_updates=[tf.Variable(np.array([0, 2, 0, 0, 1, 0], np.float32))] if momentum else None,
        statistics=[tf.Variable(np.zeros(7, np.float32))],
    )
    before = {name: [s.numpy() for s in kept] for name, kept in slots._asdict().items() if kept}
    view = slots_.TableRows(tf.constant(rows))
    mean = tf.constant(samples.mean(0), tf.float32)
    second = tf.constant(np.square(samples).mean(0), tf.float32)
    rule = slots_.GSNRRule(gamma, 1e-6, beta_3 if momentum else 0.0)
    new = slots_.measure(view, mean, second, rule, None, slots.read(view), True)
    applied = slots_.write_back(view, slots, new)

    r, _ = ref.gsnr_scale(samples, gamma)
    has = ref.measured(samples)
    if momentum:
        previous = before["momentum"][0][rows]
        p = np.where(has, beta_3 * previous + (1 - beta_3) * r, previous)
        counts = before["row_updates"][0][rows] + has.any(axis=1)
        expected_applied = p / (1 - beta_3 ** counts[:, None])
        expected_table = before["momentum"][0].copy()
        expected_table[rows] = p
        got_table = slots.momentum[0].numpy()
        expected_counts = before["row_updates"][0].copy()
        expected_counts[rows] = counts
        np.testing.assert_array_equal(slots.row_updates[0].numpy(), expected_counts)
    else:
        expected_applied = np.where(has, r, before["scale"][0][rows])
        expected_table = before["scale"][0].copy()
        expected_table[rows] = expected_applied
        got_table = slots.scale[0].numpy()
    ref.assert_close(applied, expected_applied, f"write_back applied ({kept})")
    ref.assert_close(got_table, expected_table, f"write_back table ({kept})")
    statistics = slots.statistics[0].numpy()
    assert statistics[-1] == 1.0  # the update count
    raw = ref.raw_gsnr(samples)[0][has]
    ref.assert_close(statistics[0], raw.mean(), f"write_back statistics ({kept})", rtol=1e-4)


def test_between_updates_apply_the_last_scale_or_each_rows_corrected_momentum():
    total = tf.constant(RNG.standard_normal((3, 2)), tf.float32)
    rows = np.array([0, 2, 3])
    rule = slots_.GSNRRule(0.1, 1e-6, 0.9)
    # With a momentum and row counts: each row's own correction; a row
    # never measured (count 0) takes the base rule's factor, 1.
    momentum = _slots([(5, 2)])
    counts = np.array([3, 1, 0, 2, 4], np.float32)
    slots = slots_.GSNRState(momentum=momentum, row_updates=[tf.Variable(counts)])
    gradient_mean, applied = slots_.between_updates(
        slots_.TableRows(tf.constant(rows)), slots, rule, total, 4.0, None
    )
    np.testing.assert_allclose(gradient_mean, total.numpy() / 4.0, rtol=1e-6)
    c = counts[rows][:, None]
    expected = np.where(c > 0, momentum[0].numpy()[rows] / (1 - 0.9**c), 1.0)
    ref.assert_close(applied, expected, "between_updates per-row correction", rtol=1e-6)
    # With the last scale and no momentum: that scale, whatever the step.
    scale = _slots([(3, 2)])
    slots = slots_.GSNRState(scale=scale)
    _, applied = slots_.between_updates(slots_.WholeVariable(), slots, rule, total, None, 7.0)
    np.testing.assert_array_equal(applied, scale[0].numpy())
