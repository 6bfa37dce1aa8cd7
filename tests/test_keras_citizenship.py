"""VR optimizers and LARC as ordinary Keras optimizers: Keras' own options
(EMA, plain `tf.Variable`s, empty variables, attribute changes) behave as
they do on Keras' optimizers."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests import references as ref
import tf_vrgd

EMA = dict(use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=1)


def test_ema_overwrite_on_one_device_matches_keras_adam():
    # gamma = 1, beta_3 = 0: VR-Adam is Adam, so the EMA overwrites must be too.
    stream = helpers.gradient_stream(helpers.model_shapes(), 6, seed=31)
    results = []
    initial = helpers.make_model().get_weights()
    for optimizer in (
        keras.optimizers.Adam(0.05, gradient_accumulation_steps=2, **EMA),
        tf_vrgd.VRAdam(0.05, gamma=1.0, beta_3=0.0, gradient_accumulation_steps=2, **EMA),
    ):
        model = helpers.make_model()
        helpers.apply_stream(optimizer, model.trainable_variables, stream, compiled=True)
        results.append(model.get_weights())
    ref.assert_all_close(
        results[1], results[0], "VRAdam EMA overwrite vs Adam", rtol=1e-5, start=initial
    )


def test_ema_overwrite_under_mirrored_strategy_matches_keras_adam(strategy):
    # Keras' own Adam cannot overwrite under MirroredStrategy (its cond holds
    # a merge_call), so the reference is Keras Adam on one device applying
    # the replicas' mean gradient, which is what VR-Adam at gamma = 1 applies.
    stream = helpers.gradient_stream(helpers.model_shapes(), 3, replicas=4, seed=32)
    model = helpers.make_model()
    mean = [[[g.astype(np.float32) for g in step]] for step in helpers.mean_over_replicas(stream)]
    helpers.apply_stream(
        keras.optimizers.Adam(0.05, **EMA), model.trainable_variables, mean, compiled=True
    )
    initial, vr, _ = helpers.run_mirrored(
        strategy, lambda: tf_vrgd.VRAdam(0.05, gamma=1.0, beta_3=0.0, **EMA), stream
    )
    label = "VRAdam EMA overwrite vs Adam (4 replicas)"
    ref.assert_all_close(vr, model.get_weights(), label, rtol=1e-5, start=initial)


@pytest.mark.parametrize("accumulation", [None, 2])
def test_plain_tf_variables_train_like_keras_variables(strategy, accumulation):
    # Every VR slot kind: GSNR momentum, accumulators (with accumulation) and
    # statistics. Keras' optimizers accept plain tf.Variables; so must these.
    initial = helpers.make_model().get_weights()
    replicas = 1 if accumulation else 4
    stream = helpers.gradient_stream(helpers.model_shapes(), 4, replicas=replicas, seed=33)
    results = []
    for plain in (False, True):
        scope = strategy.scope() if replicas > 1 else tf.distribute.get_strategy().scope()
        with scope:
            variables = (
                [tf.Variable(w, name=f"w{i}") for i, w in enumerate(initial)]
                if plain
                else [keras.Variable(w, name=f"w{i}") for i, w in enumerate(initial)]
            )
            optimizer = tf_vrgd.VRAdam(
                0.05,
                beta_3=0.9,
                gradient_accumulation_steps=accumulation,
                track_gsnr_statistics=True,
            )
        if replicas > 1:
            helpers.apply_stream_mirrored(strategy, optimizer, variables, stream)
        else:
            helpers.apply_stream(optimizer, variables, stream, compiled=True)
        results.append([np.array(v.numpy()) for v in variables])
        statistics = optimizer.gsnr_statistics()
        assert sorted(statistics) == [f"w{i}" for i in range(4)]
        assert all(s["updates"] == 4 // (accumulation or 1) for s in statistics.values())
    label = "VRAdam on tf.Variable vs keras.Variable"
    ref.assert_all_close(results[1], results[0], label, rtol=1e-6, start=initial)


def test_zero_size_variable_with_accumulation_and_statistics():
    # Keras Adam accepts an empty variable under accumulation; so must the
    # VR update, and the empty variable must not turn the model-wide
    # statistics into NaN.
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    empty = keras.Variable(np.zeros((0,), np.float32), name="empty")
    variables = model.trainable_variables + [empty]
    optimizer = tf_vrgd.VRAdam(0.05, gradient_accumulation_steps=2, track_gsnr_statistics=True)
    stream = helpers.gradient_stream([(3, 2), (2,), (0,)], 4, seed=34)
    helpers.apply_stream(optimizer, variables, stream, compiled=True)
    assert int(optimizer.iterations.numpy()) == 2
    assert all(np.all(np.isfinite(v.numpy())) for v in variables)
    model.compile(optimizer=optimizer, loss="mse")
    monitor = tf_vrgd.GSNRMonitor()
    monitor.set_model(model)
    monitor.on_train_begin()
    logs = monitor.statistics_logs(optimizer.gsnr_statistic_sums())
    for key in ("gsnr_mean", "gsnr_at_gamma", "gsnr_at_one"):
        assert np.isfinite(logs[key]), key
    expected = [optimizer.gsnr_statistics()[v.path]["mean_gsnr"] for v in model.trainable_variables]
    np.testing.assert_allclose(
        logs["gsnr_mean"], (6 * expected[0] + 2 * expected[1]) / 8, rtol=1e-6
    )


def test_changing_statistics_tracking_after_build_is_refused():
    model = helpers.make_model()
    optimizer = tf_vrgd.VRSGD(gradient_accumulation_steps=2)
    optimizer.track_gsnr_statistics = True  # before build: allowed
    optimizer.build(model.trainable_variables)
    assert optimizer.gsnr_statistics()
    with pytest.raises(ValueError, match="track_gsnr_statistics cannot change once"):
        optimizer.track_gsnr_statistics = False
    with pytest.raises(ValueError, match="track_gsnr_statistics"):
        optimizer.track_gsnr_statistics = "yes"


def test_larc_weights_and_saved_variables_are_the_inner_state():
    model = helpers.make_model()
    larc = tf_vrgd.LARC(keras.optimizers.SGD(0.1, momentum=0.9))
    stream = helpers.gradient_stream(helpers.model_shapes(), 2, seed=35)
    helpers.apply_stream(larc, model.trainable_variables, stream)
    inner = larc.inner_optimizer
    assert [v.path for v in larc.variables] == [v.path for v in inner.variables]
    weights = [v.numpy() for v in larc.variables]
    assert len(weights) == len(inner.variables) and int(weights[0]) == 2  # iterations
    changed = [w + 1 for w in weights]
    larc.set_weights(changed)
    for got, expected in zip([v.numpy() for v in inner.variables], changed):
        np.testing.assert_array_equal(got, expected)
    store = {}
    larc.save_own_variables(store)
    assert len(store) == len(changed)
    other = tf_vrgd.LARC(keras.optimizers.SGD(0.1, momentum=0.9))
    other.build(helpers.make_model().trainable_variables)
    other.load_own_variables(store)
    for got, expected in zip([v.numpy() for v in other.inner_optimizer.variables], changed):
        np.testing.assert_array_equal(got, expected)


def test_larc_names_are_numbered_like_keras_optimizers():
    names = [tf_vrgd.LARC(keras.optimizers.SGD()).name for _ in range(2)]
    assert names == ["larc", "larc_1"]
    assert tf_vrgd.LARC(keras.optimizers.SGD(), name="outer").name == "outer"


@pytest.mark.parametrize("fmt", ["checkpoint", "keras"])
def test_mid_accumulation_state_restores_under_another_replica_count(strategy, tmp_path, fmt):
    # One micro-step of two on 4 replicas, saved, restored on one device,
    # then the update's micro-step there: the update is VR-SGD on the 5
    # samples actually taken (the sums hold samples, not 1/R-scaled ones).
    shapes = helpers.model_shapes()
    first = helpers.gradient_stream(shapes, 1, replicas=4, seed=37)
    with strategy.scope():
        model = helpers.make_model()
        optimizer = tf_vrgd.VRSGD(0.5, gradient_accumulation_steps=2)
        model.compile(optimizer=optimizer, loss="mse")
    initial = model.get_weights()
    helpers.apply_stream_mirrored(strategy, optimizer, model.trainable_variables, first)
    if fmt == "checkpoint":
        path = tf.train.Checkpoint(model=model, optimizer=optimizer).save(str(tmp_path / "ckpt"))
        restored = helpers.make_model()
        restored_optimizer = tf_vrgd.VRSGD(0.5, gradient_accumulation_steps=2)
        restored_optimizer.build(restored.trainable_variables)
        tf.train.Checkpoint(model=restored, optimizer=restored_optimizer).restore(
            path
        ).assert_existing_objects_matched()
    else:
        model.save(tmp_path / "model.keras")
        restored = keras.models.load_model(tmp_path / "model.keras")
        restored_optimizer = restored.optimizer
    assert float(restored_optimizer._intake.samples.numpy()) == 4.0
    last = helpers.gradient_stream(shapes, 1, seed=38)
    helpers.apply_stream(restored_optimizer, restored.trainable_variables, last, compiled=True)

    samples = [
        np.stack([first[0][r][i] for r in range(4)] + [last[0][0][i]]).astype(np.float64)
        for i in range(len(shapes))
    ]
    expected = ref.VRReference(initial, ref.sgd(0.5), 0.1, 0.0).update(samples)
    label = f"VRSGD resumed mid-accumulation ({fmt})"
    ref.assert_all_close(restored.get_weights(), expected, label, rtol=1e-5, start=initial)


def _float8_model(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(2)])
        model.quantize("float8")
    return model


ACCUMULATING = {
    "Adam": lambda: tf_vrgd.Adam(0.01, gradient_accumulation_steps=2),
    "SGD": lambda: tf_vrgd.SGD(0.01, momentum=0.9, gradient_accumulation_steps=2),
    "LAMB": lambda: tf_vrgd.LAMB(0.01, gradient_accumulation_steps=2),
    "LARS": lambda: tf_vrgd.LARS(0.01, gradient_accumulation_steps=2),
}


@pytest.mark.parametrize("name", ACCUMULATING)
def test_float8_training_with_accumulation(strategy, name):
    """Keras' float8 layers overwrite their scales and amax histories with
    their gradients (accumulated by maximum); the accumulating optimizers
    take them as Keras' do: on one device tf_vrgd.Adam trains to Keras'
    Adam's weights, all four train under MirroredStrategy."""
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 4), np.float32), rng.random((32, 2), np.float32)
    default = tf.distribute.get_strategy()
    results = {}
    for label, make in (("ours", ACCUMULATING[name]), ("keras", None)):
        if make is None and name != "Adam":
            continue
        make = make or (lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=2))
        model = _float8_model(default)
        model.compile(optimizer=make(), loss="mse")
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == 4
        results[label] = [v.numpy() for v in model.variables]
    if "keras" in results:
        overwritten = [v for v in _float8_model(default).variables if v.overwrite_with_gradient]
        assert overwritten  # the scales and amax histories
        for ours, theirs in zip(results["ours"], results["keras"]):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    model = _float8_model(strategy)
    with strategy.scope():
        model.compile(optimizer=ACCUMULATING[name](), loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 4
    assert all(np.all(np.isfinite(v.numpy())) for v in model.variables)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (0, 3, 2)], ids=["rank1", "rank2", "rank3"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: tf_vrgd.Adam(0.05, gradient_accumulation_steps=2),
        lambda: tf_vrgd.LAMB(0.05, gradient_accumulation_steps=2),
        lambda: tf_vrgd.VRAdam(0.05, gradient_accumulation_steps=2),
        lambda: tf_vrgd.VRAdam(0.05, gradient_accumulation_steps=2, jit_update=False),
        lambda: tf_vrgd.VRLAMB(0.05, gradient_accumulation_steps=2),
        lambda: tf_vrgd.VRLARS(0.05, gradient_accumulation_steps=2),
        lambda: tf_vrgd.LARC(tf_vrgd.Adam(0.05, gradient_accumulation_steps=2)),
    ],
    ids=["Adam", "LAMB", "VRAdam", "VRAdam-no-xla", "VRLAMB", "VRLARS", "LARC-Adam"],
)
def test_empty_variables_of_any_rank_with_accumulation(make, shape):
    """Keras' `add` reads a (0, n) operand as a bias; the accumulators must
    not go through it. The other variable trains as without the empty one."""
    stream = helpers.gradient_stream([(3, 2), shape], 4, seed=3)
    weights = {}
    for with_empty in (True, False):
        w = keras.Variable(np.ones((3, 2), np.float32), name="w")
        variables = [w]
        if with_empty:
            variables.append(keras.Variable(np.zeros(shape, np.float32), name="empty"))
        steps = stream if with_empty else [[[g[0]] for g in step] for step in stream]
        helpers.apply_stream(make(), variables, steps, compiled=True)
        weights[with_empty] = w.numpy()
        assert variables[-1].shape == (shape if with_empty else (3, 2))
    np.testing.assert_allclose(weights[True], weights[False], rtol=1e-6)
