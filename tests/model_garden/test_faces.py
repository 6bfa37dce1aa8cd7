"""The tf_keras faces (`tf_vrgd.model_garden.optimizers`) against their
Keras 3 twins: the same initial weights and per-replica gradients on 4
replicas, several updates, the same weights to float32 round-off; VR-Adam
against the numpy reference too; state through `tf.train.Checkpoint`; config
round trips."""

import keras
import numpy as np
import pytest
import tensorflow as tf

tf_keras = pytest.importorskip("tf_keras")

from tests import helpers  # noqa: E402
from tests import references as ref  # noqa: E402
import tf_vrgd  # noqa: E402
from tf_vrgd.model_garden import optimizers  # noqa: E402

SHAPES = [(8, 6), (6,), (6, 3), (3,)]
ARGUMENTS = {
    "LARS": dict(learning_rate=0.5, weight_decay_rate=0.01),
    "LAMB": dict(learning_rate=0.05, weight_decay_rate=0.01),
    "AdamWeightDecay": dict(learning_rate=0.05, weight_decay=0.01),
    "VRSGD": dict(learning_rate=0.5, momentum=0.9),
    "VRAdam": dict(learning_rate=0.05),
    "VRLARS": dict(learning_rate=0.5, weight_decay_rate=0.01),
    "VRLAMB": dict(learning_rate=0.05, weight_decay_rate=0.01),
}


def _initial():
    rng = np.random.default_rng(0)
    return [
        (rng.standard_normal(s) * c).astype(np.float32) for s, c in zip(SHAPES, (3, 0.5, 0.2, 0.05))
    ]


def _run(strategy, make, stream):
    """The tf_keras optimizer `make()` from `_initial()` over `stream`: the
    final weights and the optimizer."""
    with strategy.scope():
        variables = [tf.Variable(w) for w in _initial()]
        optimizer = make()
    helpers.apply_gradients_mirrored(strategy, optimizer, variables, stream)
    return [v.numpy() for v in variables], optimizer


def _run_face(strategy, name, stream, arguments=None):
    return _run(strategy, lambda: optimizers.FACES[name](**(arguments or ARGUMENTS[name])), stream)


def _run_twin(strategy, make, stream):
    """The Keras 3 optimizer `make()` from the same start over the same
    stream: its final weights."""
    with strategy.scope():
        variables = [keras.Variable(w) for w in _initial()]
        twin = make()
    helpers.apply_stream_mirrored(strategy, twin, variables, stream)
    return [v.numpy() for v in variables]


def _assert_face_updates_as_twin(strategy, name, arguments, steps):
    """The face `name` and its Keras 3 twin, both built with `arguments`,
    over the same `steps` calls on 4 replicas end at the same weights; the
    face is returned."""
    stream = helpers.gradient_stream(SHAPES, steps=steps, replicas=4, scales=[1, 0.1, 2, 0.5])
    got, face = _run_face(strategy, name, stream, arguments)
    expected = _run_twin(strategy, lambda: getattr(tf_vrgd, name)(**arguments), stream)
    ref.assert_all_close(
        got, expected, f"{name} tf_keras face vs Keras 3 twin {arguments}", start=_initial()
    )
    return face


@pytest.mark.parametrize("name", ARGUMENTS)
def test_each_face_updates_as_its_keras_3_twin(strategy, name):
    face = _assert_face_updates_as_twin(strategy, name, ARGUMENTS[name], steps=4)
    assert int(face.iterations.numpy()) == 4


def test_the_vr_adam_face_matches_the_numpy_reference(strategy):
    stream = helpers.gradient_stream(SHAPES, steps=4, replicas=4, scales=[1, 0.1, 2, 0.5])
    got, _ = _run_face(strategy, "VRAdam", stream)
    reference = ref.VRReference(_initial(), ref.adam(0.05), 0.1, 0.9)
    for update in helpers.samples_per_update(stream, 1):
        expected = reference.update(update)
    ref.assert_all_close(
        got, expected, "VRAdam tf_keras face vs numpy reference", rtol=1e-4, start=_initial()
    )


def test_a_schedule_is_read_at_the_update_count(strategy):
    """A tf_keras schedule (Model Garden's factory passes one): the rate of
    update t is schedule(t - 1), as in tf_keras' own optimizers."""
    schedule = tf_keras.optimizers.schedules.PiecewiseConstantDecay([0, 1], [0.5, 0.0, 0.25])
    stream = helpers.gradient_stream(SHAPES, steps=3, replicas=4)
    got, _ = _run_face(strategy, "VRSGD", stream, dict(learning_rate=schedule))
    reference = ref.VRReference(_initial(), ref.sgd(1.0), 0.1, 0.0)
    rates = [0.5, 0.0, 0.25]
    expected = [w.astype(np.float64) for w in _initial()]
    for rate, update in zip(rates, helpers.samples_per_update(stream, 1)):
        before = [w.copy() for w in reference.weights]
        after = reference.update(update)
        expected = [e + rate * (a - b) for e, a, b in zip(expected, after, before)]
    ref.assert_all_close(
        got, expected, "VRSGD face with a tf_keras schedule", rtol=1e-4, start=_initial()
    )


def test_the_whole_state_goes_through_a_checkpoint(strategy, tmp_path):
    """Saved after two updates, restored into a new face before its first
    update: two more updates end where four uninterrupted ones do."""
    stream = helpers.gradient_stream(SHAPES, steps=4, replicas=4)
    uninterrupted, _ = _run_face(strategy, "VRLAMB", stream)
    with strategy.scope():
        variables = [tf.Variable(w) for w in _initial()]
        face = optimizers.VRLAMB(**ARGUMENTS["VRLAMB"])
    helpers.apply_gradients_mirrored(strategy, face, variables, stream[:2])
    path = tf.train.Checkpoint(variables=variables, optimizer=face).save(str(tmp_path / "ck"))
    with strategy.scope():
        restored = [tf.Variable(np.zeros(s, np.float32)) for s in SHAPES]
        new_face = optimizers.VRLAMB(**ARGUMENTS["VRLAMB"])
    tf.train.Checkpoint(variables=restored, optimizer=new_face).restore(path)
    helpers.apply_gradients_mirrored(strategy, new_face, restored, stream[2:])
    assert int(new_face.iterations.numpy()) == 4
    for g, e in zip(restored, uninterrupted):
        np.testing.assert_allclose(g.numpy(), e, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ARGUMENTS)
def test_config_round_trips_with_the_twins_arguments(name):
    face = optimizers.FACES[name](**ARGUMENTS[name])
    config = face.get_config()
    twin = getattr(tf_vrgd, name)(**ARGUMENTS[name]).get_config()
    # Keras 3 keeps the rate in a float32 variable, and numbers the default
    # names of a class' second instance on.
    assert config.pop("learning_rate") == pytest.approx(twin.pop("learning_rate"), rel=1e-7)
    assert config.pop("name").split("_")[0] == twin.pop("name").split("_")[0]
    assert config == twin
    config["name"] = "renamed"
    config["learning_rate"] = ARGUMENTS[name]["learning_rate"]
    again = optimizers.FACES[name].from_config(config)
    assert again.get_config() == config


def test_tf_keras_only_arguments_are_refused():
    with pytest.raises(ValueError, match="gradient_transformers"):
        optimizers.VRAdam(gradient_transformers=[lambda gv: gv])


def test_a_restore_before_the_first_update_reaches_every_device(strategy, tmp_path):
    """Model Garden restores its checkpoint before the first step, when the
    twin has no slots yet: each device's copy of each slot must get the
    saved value (built in one replica's thread, only the first did)."""
    stream = helpers.gradient_stream(SHAPES, steps=2, replicas=4)
    _, face = _run_face(strategy, "VRLAMB", stream)
    path = tf.train.Checkpoint(optimizer=face).save(str(tmp_path / "ck"))
    with strategy.scope():
        variables = [tf.Variable(w) for w in _initial()]
        restored = optimizers.VRLAMB(**ARGUMENTS["VRLAMB"])
    tf.train.Checkpoint(optimizer=restored).restore(path)
    helpers.apply_gradients_mirrored(strategy, restored, variables, stream[:1])
    for slot in restored.keras_optimizer.variables:
        copies = [c.numpy() for c in getattr(slot.value, "values", [slot.value])]
        assert len(copies) == strategy.num_replicas_in_sync, slot.path
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0], err_msg=slot.path)
    saved = tf.train.load_checkpoint(path)
    momentum = next(s for s in restored.keras_optimizer.variables if "gsnr_momentum" in s.path)
    # One update after the restore: p = beta_3 p_saved + (1 - beta_3) r, r in [gamma, 1].
    index = [s.path for s in restored.keras_optimizer.variables].index(momentum.path)
    before = saved.get_tensor(
        f"optimizer/keras_optimizer/_variables/{index}/.ATTRIBUTES/VARIABLE_VALUE"
    )
    fresh = momentum.numpy() - 0.9 * before
    assert np.all(fresh >= 0.1 * 0.1 - 1e-6) and np.all(fresh <= 0.1 + 1e-6)


def _larc_face():
    return optimizers.LARC(optimizers.VRSGD(0.5, momentum=0.9), trust_coefficient=0.05)


def test_the_larc_face_updates_as_its_keras_3_twin(strategy):
    stream = helpers.gradient_stream(SHAPES, steps=4, replicas=4, scales=[1, 0.1, 2, 0.5])
    got, face = _run(strategy, _larc_face, stream)
    expected = _run_twin(
        strategy,
        lambda: tf_vrgd.LARC(tf_vrgd.VRSGD(0.5, momentum=0.9), trust_coefficient=0.05),
        stream,
    )
    ref.assert_all_close(
        got,
        expected,
        "LARC(VRSGD) tf_keras face vs Keras 3 twin",
        start=_initial(),
    )
    assert int(face.iterations.numpy()) == 4


def test_either_kind_of_larc_is_a_larc_and_saves_as_one():
    """LARC around a face and around tf_keras' own SGD: both `LARC`s,
    serialized under the class name LARC, rebuilt as the same kind."""
    for wrapped, kind in (
        (_larc_face(), optimizers.FaceLARC),
        (optimizers.LARC(tf_keras.optimizers.legacy.SGD(0.1)), optimizers.TFKerasLARC),
    ):
        assert isinstance(wrapped, optimizers.LARC) and isinstance(wrapped, kind)
        saved = tf_keras.optimizers.serialize(wrapped, use_legacy_format=True)
        assert saved["class_name"] == "LARC"
        again = tf_keras.optimizers.deserialize(
            saved, custom_objects=optimizers.FACES, use_legacy_format=True
        )
        assert type(again) is kind and again.get_config() == {
            **wrapped.get_config(),
            "name": again.get_config()["name"],
        }


def test_the_larc_face_config_round_trips():
    config = _larc_face().get_config()
    assert config["trust_coefficient"] == 0.05 and config["optimizer"]["class_name"] == "VRSGD"
    again = optimizers.LARC.from_config(config)
    assert again.get_config() == {**config, "name": again.get_config()["name"]}
    with pytest.raises(ValueError, match=r"face of tf_vrgd\.model_garden\.optimizers"):
        optimizers.LARC(tf_vrgd.VRSGD(0.1))


def test_a_loss_scale_optimizer_around_a_face(strategy):
    """tf_keras' LossScaleOptimizer (Model Garden's under float16) around a
    face: finite gradients update as the face alone; an overflow on one
    replica only skips the update on every replica and halves the scale."""
    stream = helpers.gradient_stream(SHAPES, steps=3, replicas=4)
    wrapped = helpers.assert_tf_keras_loss_scale_skips_an_overflow(
        strategy,
        lambda: optimizers.VRAdam(**ARGUMENTS["VRAdam"]),
        _initial(),
        stream,
        "VRAdam face in a LossScaleOptimizer",
    )
    # tf_keras counts a skipped step (Model Garden's global step does too).
    assert int(wrapped.inner_optimizer.iterations.numpy()) == 4


@pytest.mark.parametrize("name", ["VRAdam", "VRLAMB"])
def test_a_face_with_accumulation_updates_as_its_twin(strategy, name):
    """k = 4 replicas x 2 micro-steps: each `apply_gradients` call of Model
    Garden's step is a micro-step; the twin accumulates and updates every
    second call."""
    arguments = {**ARGUMENTS[name], "gradient_accumulation_steps": 2}
    face = _assert_face_updates_as_twin(strategy, name, arguments, steps=6)
    assert int(face.iterations.numpy()) == 3


def _tf_keras_larc(inner="SGD"):
    rule = {
        "SGD": lambda: tf_keras.optimizers.legacy.SGD(0.5, momentum=0.9),
        "Adam": lambda: tf_keras.optimizers.legacy.Adam(0.05),
    }[inner]()
    return optimizers.LARC(rule, trust_coefficient=0.05, weight_decay=0.01)


def test_larc_around_a_tf_keras_optimizer_matches_the_numpy_reference(strategy):
    """LARC around tf_keras' own SGD with momentum: the rule on the mean of
    the 4 replicas' gradients, then momentum SGD, as numpy computes it."""
    stream = helpers.gradient_stream(SHAPES, steps=4, replicas=4, scales=[1, 0.1, 2, 0.5])
    got, wrapped = _run(strategy, _tf_keras_larc, stream)
    assert isinstance(wrapped, optimizers.LARC) and isinstance(wrapped, optimizers.TFKerasLARC)
    means = [[np.mean([r[i] for r in step], axis=0) for i in range(len(SHAPES))] for step in stream]
    expected = ref.run_larc_sgd(
        _initial(), means, 0.5, momentum=0.9, trust_coefficient=0.05, weight_decay=0.01
    )
    ref.assert_all_close(
        got,
        expected,
        "LARC(tf_keras SGD) vs numpy reference",
        rtol=1e-5,
        start=_initial(),
    )
    assert int(wrapped.iterations.numpy()) == 4


def test_larc_around_tf_keras_adam_updates_as_keras_3_larc_around_adam(strategy):
    stream = helpers.gradient_stream(SHAPES, steps=4, replicas=4, scales=[1, 0.1, 2, 0.5])
    got, _ = _run(strategy, lambda: _tf_keras_larc("Adam"), stream)
    expected = _run_twin(
        strategy,
        lambda: tf_vrgd.LARC(
            keras.optimizers.Adam(0.05), trust_coefficient=0.05, weight_decay=0.01
        ),
        stream,
    )
    ref.assert_all_close(
        got,
        expected,
        "LARC(tf_keras Adam) vs Keras 3 LARC(Adam)",
        start=_initial(),
    )


def test_larc_around_a_tf_keras_optimizer_saves_and_restores(strategy, tmp_path):
    """Its config rebuilds it; a checkpoint carries the inner optimizer's
    slots and step, so two updates after a restore end where four do."""
    stream = helpers.gradient_stream(SHAPES, steps=4, replicas=4)
    with strategy.scope():
        uninterrupted = [tf.Variable(w) for w in _initial()]
        wrapped = _tf_keras_larc()
    helpers.apply_gradients_mirrored(strategy, wrapped, uninterrupted, stream)
    config = wrapped.get_config()
    assert config["trust_coefficient"] == 0.05 and config["optimizer"]["class_name"] == "SGD"
    with strategy.scope():
        variables = [tf.Variable(w) for w in _initial()]
        first = optimizers.TFKerasLARC.from_config(config)
    assert first.get_config() == config
    helpers.apply_gradients_mirrored(strategy, first, variables, stream[:2])
    path = tf.train.Checkpoint(variables=variables, optimizer=first).save(str(tmp_path / "ck"))
    with strategy.scope():
        restored = [tf.Variable(np.zeros(s, np.float32)) for s in SHAPES]
        second = optimizers.TFKerasLARC.from_config(config)
    tf.train.Checkpoint(variables=restored, optimizer=second).restore(path)
    helpers.apply_gradients_mirrored(strategy, second, restored, stream[2:])
    assert int(second.iterations.numpy()) == 4
    for g, e in zip(restored, uninterrupted):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-6, atol=1e-7)


def test_larc_around_a_tf_keras_optimizer_refuses_what_it_cannot_wrap():
    inner = tf_keras.optimizers.legacy.SGD(0.1)
    optimizers.LARC(inner)
    with pytest.raises(ValueError, match="already wrapped"):
        optimizers.LARC(inner)
    with pytest.raises(ValueError, match="trust_coefficient"):
        optimizers.LARC(tf_keras.optimizers.legacy.SGD(0.1), trust_coefficient=0.0)
    with pytest.raises(ValueError, match="LossScaleOptimizer"):
        optimizers.TFKerasLARC(
            tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.legacy.SGD(0.1))
        )


def test_a_loss_scale_optimizer_around_larc_around_a_tf_keras_optimizer(strategy):
    """Finite gradients: as LARC alone; an overflow on one replica: skipped."""
    stream = helpers.gradient_stream(SHAPES, steps=3, replicas=4)
    helpers.assert_tf_keras_loss_scale_skips_an_overflow(
        strategy, _tf_keras_larc, _initial(), stream, "LARC(SGD) in a LossScaleOptimizer"
    )


def test_larc_around_tf_keras_sgd_clips_the_reduced_gradient_before_larc(strategy):
    """tf_keras clips the cross-replica sum (Keras 3 clips each replica's
    part before the sum): LARC then sees the clipped mean gradient."""
    stream = helpers.gradient_stream(SHAPES, steps=3, replicas=4, scales=[1, 0.1, 2, 0.5])
    got, _ = _run(
        strategy,
        lambda: optimizers.LARC(
            tf_keras.optimizers.legacy.SGD(0.5, momentum=0.9, clipnorm=0.3), trust_coefficient=0.05
        ),
        stream,
    )
    clipped = []
    for step in stream:
        means = [np.mean([r[i] for r in step], axis=0).astype(np.float64) for i in range(4)]
        clipped.append([g * min(1.0, 0.3 / np.linalg.norm(g)) for g in means])
    assert any(np.linalg.norm(g) > 0.3 for step in stream for g in step[0])
    expected = ref.run_larc_sgd(_initial(), clipped, 0.5, momentum=0.9, trust_coefficient=0.05)
    ref.assert_all_close(
        got,
        expected,
        "LARC(tf_keras SGD, clipnorm) vs numpy",
        rtol=1e-5,
        start=_initial(),
    )


def test_larc_around_a_tf_keras_optimizer_takes_a_row_sparse_gradient_as_dense():
    rows = np.random.default_rng(3).standard_normal((5, 3)).astype(np.float32)
    values = np.array([[1.0, 2.0, 0.5], [0.1, -1.0, 3.0], [2.0, 0.0, 1.0]], np.float32)
    indices = np.array([4, 1, 4])
    dense = np.zeros_like(rows)
    np.add.at(dense, indices, values)
    results = []
    for gradient in (tf.IndexedSlices(values, indices, [5, 3]), tf.constant(dense)):
        variable = tf.Variable(rows)
        wrapped = optimizers.LARC(tf_keras.optimizers.legacy.SGD(0.5), trust_coefficient=0.05)
        wrapped.apply_gradients([(gradient, variable)])
        results.append(variable.numpy())
    expected = ref.run_larc_sgd([rows], [[dense]], 0.5, trust_coefficient=0.05)[0]
    for got in results:
        ref.assert_close(got, expected, "LARC(tf_keras SGD) on a row-sparse gradient", start=rows)


def test_a_face_reads_its_schedule_at_updates_under_accumulation(strategy):
    """VR-SGD's face with a tf_keras schedule and 4 replicas x 2 micro-steps:
    update t (from 1) applies the schedule at step t - 1 (updates, not
    micro-steps), against the numpy reference."""
    schedule = tf_keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
    stream = helpers.gradient_stream(SHAPES, steps=6, replicas=4, scales=[1, 0.1, 2, 0.5])
    got, face = _run_face(
        strategy, "VRSGD", stream, {"learning_rate": schedule, "gradient_accumulation_steps": 2}
    )
    assert int(face.iterations.numpy()) == 3

    def rate(t):
        return 0.5 * 0.5 ** (t - 1)

    rule = ref.Rule(lambda i, w, g, slots, t: (w - rate(t) * g, slots), 0)
    reference = ref.VRReference(_initial(), rule, 0.1, 0.0)
    for samples in helpers.samples_per_update(stream, 2):
        expected = reference.update(samples)
    ref.assert_all_close(
        got, expected, "VRSGD face, schedule, 4 replicas x 2", rtol=1e-4, start=_initial()
    )


@pytest.mark.parametrize(
    "argument",
    [
        {"decay": 0.1},
        {"gradient_aggregator": lambda grads_and_vars: grads_and_vars},
        {"gradient_transformers": [lambda grads_and_vars: grads_and_vars]},
    ],
    ids=["decay", "gradient_aggregator", "gradient_transformers"],
)
def test_a_face_refuses_tf_keras_arguments_it_would_ignore(argument):
    (name,) = argument
    for make in (
        lambda: optimizers.VRAdam(0.01, **argument),
        lambda: optimizers.LARC(optimizers.VRSGD(0.1), **argument),
        lambda: optimizers.LARC(tf_keras.optimizers.legacy.SGD(0.1), **argument),
    ):
        with pytest.raises(ValueError, match=f"does not take tf_keras' `{name}`"):
            make()
    # Unset (what Model Garden's factory may pass), they are accepted.
    optimizers.VRAdam(0.01, **{name: None})


def test_a_loss_scale_optimizer_refuses_a_face_that_accumulates(strategy):
    """tf_keras' LossScaleOptimizer counts a skipped micro-step as an
    update: a face with accumulation inside it is refused at its first
    step, saying what to do instead."""
    stream = helpers.gradient_stream(SHAPES, steps=1, replicas=4)
    with strategy.scope():
        variables = [tf.Variable(w) for w in _initial()]
        wrapped = tf_keras.mixed_precision.LossScaleOptimizer(
            optimizers.VRAdam(0.05, gradient_accumulation_steps=2)
        )
    with pytest.raises(ValueError, match="accumulate in float32 or bfloat16"):
        helpers.apply_gradients_mirrored(strategy, wrapped, variables, stream)


def test_an_overflow_in_one_replicas_rows_skips_every_replica(strategy):
    """A table whose gradient arrives as rows (`tf.IndexedSlices`), under
    tf_keras' LossScaleOptimizer: an Inf in one replica's rows makes every
    replica's rows NaN (the face's `_aggregate_gradients`), so the wrapper,
    which reads the first replica's, skips the update everywhere."""
    rng = np.random.default_rng(4)
    table = rng.standard_normal((10, 3)).astype(np.float32)
    rows = tf.constant([1, 4, 7])
    with strategy.scope():
        variable = tf.Variable(table)
        wrapped = tf_keras.mixed_precision.LossScaleOptimizer(optimizers.VRAdam(0.05))

    @tf.function
    def step(values):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            gradient = tf.IndexedSlices(tf.gather(values, replica), rows, tf.constant([10, 3]))
            wrapped.apply_gradients([(gradient, variable)])

        strategy.run(replica_fn)

    values = rng.standard_normal((4, 3, 3)).astype(np.float32)
    step(tf.constant(values))
    moved = variable.numpy()
    assert not np.array_equal(moved[[1, 4, 7]], table[[1, 4, 7]])
    scale = float(wrapped.loss_scale.numpy())
    values[2, 1, 0] = np.inf
    step(tf.constant(values))
    for copy in variable.values:
        np.testing.assert_array_equal(copy.numpy(), moved)
    assert float(wrapped.loss_scale.numpy()) == scale / 2
