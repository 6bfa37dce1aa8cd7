"""`gsnr_interval = N` (docs/algorithms.md §7) against the numpy reference:
the GSNR measured at updates 1, N + 1, ... only, the last scale applied in
between, with and without accumulation, on 4 replicas and one device, both
update paths; the collective carries the squares at GSNR updates only; a
restore between GSNR updates resumes exactly; statistics count GSNR
updates."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests import references as ref
from tests.vr_cases import (  # the fixture: `path` picks
    CASES,
    SCALES,
    update_path,  # noqa: F401
)
import tf_vrgd
from tf_vrgd import config

INTERVAL = 3
UPDATES = 8  # GSNR updates at 1, 4, 7


def _reference(case, initial, samples_per_update, interval=INTERVAL):
    case = CASES[case]
    reference = ref.VRReference(initial, case.rule, case.gamma, case.beta_3, gsnr_interval=interval)
    for samples in samples_per_update:
        weights = reference.update(samples)
    return weights


@pytest.mark.parametrize("path", ["packed", "mixed", "fused"])
@pytest.mark.parametrize("case", CASES)
def test_interval_matches_reference_on_four_replicas(strategy, case, path):
    stream = helpers.model_stream(UPDATES, 4, SCALES, seed=31)
    initial, got, optimizer = helpers.run_mirrored_against(
        strategy,
        lambda: CASES[case].make(gsnr_interval=INTERVAL),
        stream,
        1,
        functools.partial(_reference, case),
        f"{case} gsnr_interval=3 (4 replicas)",
    )
    # Not the rule measured at every update: the interval changes the result.
    every = _reference(case, initial, helpers.samples_per_update(stream, 1), interval=1)
    assert max(ref.relative_error(g, e) for g, e in zip(got, every)) > 1e-3
    assert int(optimizer.iterations.numpy()) == UPDATES


@pytest.mark.parametrize("case", ["VR-Momentum", "VR-Adam", "VR-LARS"])
def test_interval_with_accumulation_on_four_replicas(strategy, case):
    steps = 2
    stream = helpers.model_stream(UPDATES * steps, 4, SCALES, seed=32)
    _, _, optimizer = helpers.run_mirrored_against(
        strategy,
        lambda: CASES[case].make(gsnr_interval=INTERVAL, gradient_accumulation_steps=steps),
        stream,
        steps,
        functools.partial(_reference, case),
        f"{case} gsnr_interval=3 (4 replicas x 2)",
    )
    # Squares are summed in GSNR updates only: after the last update (8, not
    # a GSNR update) every accumulator is back at zero.
    for slot in optimizer._intake.squares:
        for value in strategy.experimental_local_results(slot.value):
            assert not np.any(value.numpy())


@pytest.mark.parametrize("case", ["VR-SGD", "VR-LAMB"])
def test_interval_with_accumulation_on_one_device(case):
    steps = 3
    stream = helpers.model_stream(UPDATES * steps, 1, SCALES, seed=33)
    model = helpers.make_model()
    initial = model.get_weights()
    optimizer = CASES[case].make(gsnr_interval=INTERVAL, gradient_accumulation_steps=steps)
    helpers.apply_stream(optimizer, model.trainable_variables, stream, compiled=True)
    expected = _reference(case, initial, helpers.samples_per_update(stream, steps))
    for g, e, w0 in zip(model.get_weights(), expected, initial):
        ref.assert_close(g, e, f"{case} gsnr_interval=3 (1 device x 3)", rtol=1e-4, start=w0)


def test_squares_are_reduced_at_gsnr_updates_only(strategy, monkeypatch):
    """The collective's tensors per update: gradients and squares at GSNR
    updates, gradients alone between them, in packs that close past 1 MiB
    on the CPUs of one process."""
    reduced, packs = [], []
    extended = type(strategy.extended)
    original = extended.batch_reduce_to

    def counting(self, reduce_op, value_destination_pairs, options=None):
        reduced.append(len(value_destination_pairs))
        packs.append(options.bytes_per_pack)
        return original(self, reduce_op, value_destination_pairs, options)

    monkeypatch.setattr(extended, "batch_reduce_to", counting)
    stream = helpers.gradient_stream(helpers.model_shapes(), 2, replicas=4, seed=34)
    helpers.run_mirrored(strategy, lambda: tf_vrgd.VRSGD(0.5, gsnr_interval=2), stream)
    # Both branches are traced once in the step: 6 tensors for the GSNR
    # branch (the two kernels, the two biases as one flat message, and the
    # squares of each), 3 for the other.
    assert sorted(set(reduced)) == [3, 6]
    assert set(packs) == {1 << 20}


@pytest.mark.parametrize("beta_3", [0.0, 0.9])
def test_restore_between_gsnr_updates_resumes_exactly(strategy, beta_3, tmp_path):
    stream = helpers.model_stream(UPDATES, 4, SCALES, seed=35)
    make = lambda: tf_vrgd.VRSGD(0.5, momentum=0.9, beta_3=beta_3, gsnr_interval=INTERVAL)
    _, uninterrupted, _ = helpers.run_mirrored(strategy, make, stream)

    with strategy.scope():
        model = helpers.make_model()
        optimizer = make()
    helpers.apply_stream_mirrored(strategy, optimizer, model.trainable_variables, stream[:5])
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    saved = checkpoint.write(str(tmp_path / "ckpt"))
    with strategy.scope():
        restored_model = helpers.make_model(seed=9)
        restored = make()
        restored.build(restored_model.trainable_variables)
    tf.train.Checkpoint(model=restored_model, optimizer=restored).read(saved).assert_consumed()
    assert int(restored.iterations.numpy()) == 5  # between GSNR updates 4 and 7
    helpers.apply_stream_mirrored(
        strategy, restored, restored_model.trainable_variables, stream[5:]
    )
    for g, e in zip(restored_model.get_weights(), uninterrupted):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7)


def test_statistics_describe_gsnr_updates(strategy):
    stream = helpers.model_stream(UPDATES, 4, SCALES, seed=36)
    _, _, optimizer = helpers.run_mirrored(
        strategy,
        lambda: tf_vrgd.VRAdam(0.05, gsnr_interval=INTERVAL, track_gsnr_statistics=True),
        stream,
    )
    counts = {s["updates"] for s in optimizer.gsnr_statistics().values()}
    assert counts == {3.0}  # updates 1, 4 and 7


@pytest.mark.parametrize("cls", [tf_vrgd.VRSGD, tf_vrgd.VRAdam, tf_vrgd.VRLARS, tf_vrgd.VRLAMB])
def test_interval_is_checked_saved_and_read_from_configs(cls):
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="gsnr_interval"):
            cls(gsnr_interval=bad)
    optimizer = cls(gsnr_interval=16)
    assert optimizer.get_config()["gsnr_interval"] == 16
    again = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert type(again) is cls and again.gsnr_interval == 16
    kind = {
        tf_vrgd.VRSGD: "vr_sgd",
        tf_vrgd.VRAdam: "vr_adam",
        tf_vrgd.VRLARS: "vr_lars",
        tf_vrgd.VRLAMB: "vr_lamb",
    }[cls]
    block = {
        "optimizer": {"type": kind, kind: {"gsnr_interval": 4}},
        "learning_rate": {"type": "constant", "constant": {"learning_rate": 0.1}},
    }
    assert config.optimizer_from_config(block).gsnr_interval == 4
    block["optimizer"][kind]["gsnr_interval"] = 0
    with pytest.raises(ValueError, match="gsnr_interval"):
        config.optimizer_from_config(block)


def test_scale_slot_only_where_needed():
    model = helpers.make_model()
    for kwargs, has_slot in (
        (dict(gsnr_interval=1), False),
        (dict(gsnr_interval=4), True),
        (dict(gsnr_interval=4, beta_3=0.9), False),  # the momentum serves
    ):
        optimizer = tf_vrgd.VRSGD(gradient_accumulation_steps=2, **kwargs)
        optimizer.build(model.trainable_variables)
        names = [v.path for v in optimizer.variables]
        assert any("gsnr_scale" in n for n in names) == has_slot, kwargs


def test_one_cadence_for_the_gsnr_and_the_noise_scale():
    """Updates t = iterations + 1 = 1, N + 1, 2N + 1, ... measure; the count
    of measuring updates includes the one in progress."""
    from tf_vrgd._cadence import Cadence

    iterations = tf.range(7, dtype=tf.int64)
    assert Cadence(3).measures(iterations).numpy().tolist() == [1, 0, 0, 1, 0, 0, 1]
    np.testing.assert_array_equal(
        Cadence(3).measured_updates(iterations).numpy(), [1, 1, 1, 2, 2, 2, 3]
    )
    one = Cadence(1).choose(tf.constant(5, tf.int64), lambda: 1, lambda: 2)
    two = Cadence(2).choose(
        tf.constant(5, tf.int64), lambda: tf.constant(1), lambda: tf.constant(2)
    )
    assert one == 1 and int(two) == 2
