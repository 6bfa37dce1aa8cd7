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


def _apply_face(strategy, face, variables, stream):
    """Each replica applies its own gradient (scaled by 1/R, as Model
    Garden's train_step scales the loss) through `apply_gradients`."""
    replicas = strategy.num_replicas_in_sync

    @tf.function
    def step(stacked):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            grads = [tf.gather(g, replica) / replicas for g in stacked]
            face.apply_gradients(zip(grads, variables))

        strategy.run(replica_fn)

    for grads in stream:
        step([tf.constant(np.stack([r[i] for r in grads])) for i in range(len(grads[0]))])


def _run_face(strategy, name, stream, arguments=None):
    with strategy.scope():
        variables = [tf.Variable(w) for w in _initial()]
        face = optimizers.FACES[name](**(arguments or ARGUMENTS[name]))
    _apply_face(strategy, face, variables, stream)
    return [v.numpy() for v in variables], face


@pytest.mark.parametrize("name", ARGUMENTS)
def test_each_face_updates_as_its_keras_3_twin(strategy, name):
    stream = helpers.gradient_stream(SHAPES, steps=4, replicas=4, scales=[1, 0.1, 2, 0.5])
    got, face = _run_face(strategy, name, stream)
    with strategy.scope():
        variables = [keras.Variable(w) for w in _initial()]
        twin = getattr(tf_vrgd, name)(**ARGUMENTS[name])
    helpers.apply_stream_mirrored(strategy, twin, variables, stream)
    for g, e in zip(got, variables):
        ref.assert_close(g, e.numpy(), f"{name} tf_keras face vs Keras 3 twin, 4 replicas")
    assert int(face.iterations.numpy()) == 4


def test_the_vr_adam_face_matches_the_numpy_reference(strategy):
    stream = helpers.gradient_stream(SHAPES, steps=4, replicas=4, scales=[1, 0.1, 2, 0.5])
    got, _ = _run_face(strategy, "VRAdam", stream)
    reference = ref.VRReference(_initial(), ref.adam(0.05), 0.1, 0.9)
    for update in helpers.samples_per_update(stream, 1):
        expected = reference.update(update)
    for g, e in zip(got, expected):
        ref.assert_close(g, e, "VRAdam tf_keras face vs numpy reference", rtol=1e-4)


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
    for g, e in zip(got, expected):
        ref.assert_close(g, e, "VRSGD face with a tf_keras schedule", rtol=1e-4)


def test_the_whole_state_goes_through_a_checkpoint(strategy, tmp_path):
    """Saved after two updates, restored into a new face before its first
    update: two more updates end where four uninterrupted ones do."""
    stream = helpers.gradient_stream(SHAPES, steps=4, replicas=4)
    uninterrupted, _ = _run_face(strategy, "VRLAMB", stream)
    with strategy.scope():
        variables = [tf.Variable(w) for w in _initial()]
        face = optimizers.VRLAMB(**ARGUMENTS["VRLAMB"])
    _apply_face(strategy, face, variables, stream[:2])
    path = tf.train.Checkpoint(variables=variables, optimizer=face).save(str(tmp_path / "ck"))
    with strategy.scope():
        restored = [tf.Variable(np.zeros(s, np.float32)) for s in SHAPES]
        new_face = optimizers.VRLAMB(**ARGUMENTS["VRLAMB"])
    tf.train.Checkpoint(variables=restored, optimizer=new_face).restore(path)
    _apply_face(strategy, new_face, restored, stream[2:])
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
    _apply_face(strategy, restored, variables, stream[:1])
    for slot in restored.keras_optimizer.variables:
        copies = [c.numpy() for c in getattr(slot.value, "values", [slot.value])]
        assert len(copies) in (1, 4)
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
    with strategy.scope():
        variables = [tf.Variable(w) for w in _initial()]
        face = _larc_face()
    _apply_face(strategy, face, variables, stream)
    with strategy.scope():
        twin_variables = [keras.Variable(w) for w in _initial()]
        twin = tf_vrgd.LARC(tf_vrgd.VRSGD(0.5, momentum=0.9), trust_coefficient=0.05)
    helpers.apply_stream_mirrored(strategy, twin, twin_variables, stream)
    for g, e in zip(variables, twin_variables):
        ref.assert_close(g.numpy(), e.numpy(), "LARC(VRSGD) tf_keras face vs Keras 3 twin")
    assert int(face.iterations.numpy()) == 4


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
    expected, _ = _run_face(strategy, "VRAdam", stream)
    with strategy.scope():
        variables = [tf.Variable(w) for w in _initial()]
        wrapped = tf_keras.mixed_precision.LossScaleOptimizer(
            optimizers.VRAdam(**ARGUMENTS["VRAdam"])
        )
    _apply_face(strategy, wrapped, variables, stream)
    for g, e in zip(variables, expected):
        ref.assert_close(g.numpy(), e, "VRAdam face in a LossScaleOptimizer")
    scale = float(wrapped.loss_scale.numpy())
    overflow = helpers.gradient_stream(SHAPES, steps=1, replicas=4, seed=9)
    overflow[0][2][0][1, 1] = np.inf
    before = [v.numpy() for v in variables]
    _apply_face(strategy, wrapped, variables, overflow)
    for b, v in zip(before, variables):
        for copy in v.values:
            np.testing.assert_array_equal(copy.numpy(), b)
    # tf_keras counts a skipped step (Model Garden's global step does too).
    assert int(wrapped.inner_optimizer.iterations.numpy()) == 4
    assert float(wrapped.loss_scale.numpy()) == scale / 2


@pytest.mark.parametrize("name", ["VRAdam", "VRLAMB"])
def test_a_face_with_accumulation_updates_as_its_twin(strategy, name):
    """k = 4 replicas x 2 micro-steps: each `apply_gradients` call of Model
    Garden's step is a micro-step; the twin accumulates and updates every
    second call."""
    arguments = {**ARGUMENTS[name], "gradient_accumulation_steps": 2}
    stream = helpers.gradient_stream(SHAPES, steps=6, replicas=4, scales=[1, 0.1, 2, 0.5])
    got, face = _run_face(strategy, name, stream, arguments)
    with strategy.scope():
        variables = [keras.Variable(w) for w in _initial()]
        twin = getattr(tf_vrgd, name)(**arguments)
    helpers.apply_stream_mirrored(strategy, twin, variables, stream)
    for g, e in zip(got, variables):
        ref.assert_close(g, e.numpy(), f"{name} face vs twin, 4 replicas x 2 micro-steps")
    assert int(face.iterations.numpy()) == 3
