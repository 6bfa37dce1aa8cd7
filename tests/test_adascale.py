"""`tf_vrgd.AdaScale`: the gain against its closed form on a planted linear
regression, the gain, tau and the applied updates against numpy, the
schedule read at tau, loss-scale skips, save/restore mid-run, the stop
callback, the monitor's entries, the config type and refusals by name.
(Serialization and the Keras citizenship tests: `test_keras_integration`.)"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests import references as ref
import tf_vrgd
from tf_vrgd import config

SCALES = [1e-2, 1.0, 5e-2, 0.3]


def _schedule():
    return keras.optimizers.schedules.PiecewiseConstantDecay([3, 7], [0.1, 0.05, 0.02])


def _numpy_rate(step):
    return 0.1 if step <= 3 else (0.05 if step <= 7 else 0.02)


def _adamw(rate):
    # Keras' AdamW: the decoupled decay at the applied rate, then Adam's step.
    def step(i, w, g, slots, t):
        w = w - w * 0.1 * rate
        w, m, v = ref.keras_adam_step(w, g, slots[0], slots[1], t, rate)
        return w, [m, v]

    return ref.Rule(step, 2)


# name: (inner optimizer, AdaScale's arguments, micro-steps, the numpy rule
# at a rate, the base rate at a step)
CASES = {
    "Keras SGD, schedule": (
        lambda: keras.optimizers.SGD(_schedule()),
        {"decay": 0.5},
        1,
        ref.sgd,
        _numpy_rate,
    ),
    "Keras AdamW": (
        lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
        {},  # the default decay, max(1 - k / 1000, 0) = 0.996
        1,
        _adamw,
        lambda step: 0.01,
    ),
    "SGD momentum, 2 micro-steps, S = 16": (
        lambda: tf_vrgd.SGD(0.05, momentum=0.9, gradient_accumulation_steps=2),
        {"scale": 16, "decay": 0.9},
        2,
        lambda rate: ref.sgd(rate, momentum=0.9),
        lambda step: 0.05,
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_gain_tau_and_updates_match_numpy(strategy, name):
    make, arguments, steps, rule_at, base_rate = CASES[name]
    stream = helpers.model_stream(10 * steps, 4, SCALES, seed=61)
    initial, got, optimizer = helpers.run_mirrored(
        strategy, lambda: tf_vrgd.AdaScale(make(), **arguments), stream
    )
    updates = helpers.samples_per_update(stream, steps)
    gains = ref.adascale_gains(updates, arguments.get("scale"), arguments.get("decay", 0.996))
    # The gains vary: the test would see a rate applied without them.
    assert max(g for g, _ in gains) > 1.2 * min(g for g, _ in gains)
    last_gain, last_tau = gains[-1]
    np.testing.assert_allclose(optimizer.gain, last_gain, rtol=2e-5)
    np.testing.assert_allclose(optimizer.scale_invariant_steps, last_tau + last_gain, rtol=2e-5)
    np.testing.assert_allclose(
        optimizer.applied_learning_rate, last_gain * base_rate(int(np.floor(last_tau))), rtol=2e-5
    )
    decay = arguments.get("decay", 0.996)
    np.testing.assert_allclose(
        optimizer.noise_scale(640), ref.adascale_noise_scale(updates, 640, decay), rtol=5e-6
    )
    expected = ref.adascale_weights(initial, updates, gains, rule_at, base_rate)
    # float32 weights of norm ~3 under updates ~1e-3: rounding alone is ~2e-4.
    ref.assert_all_close(got, expected, f"AdaScale {name}", rtol=6e-4, start=initial)


def _regression(seed, updates, global_batch, noise=2.875, dims=8):
    """A planted linear regression y = x . w* + noise, x ~ N(0, I), with the
    model's weights at w* + delta, |delta| = 1: a per-example gradient of
    the squared error has |grad F|^2 = 4 |delta|^2 and tr(Sigma) = 4 ((d +
    1) |delta|^2 + d noise^2), so B_simple = d + 1 + d noise^2."""
    rng = np.random.default_rng(seed)
    w_star = rng.standard_normal((dims, 1))
    delta = rng.standard_normal((dims, 1))
    delta /= np.linalg.norm(delta)
    n = updates * global_batch
    x = rng.standard_normal((n, dims)).astype(np.float32)
    y = (x @ w_star + np.sqrt(noise) * rng.standard_normal((n, 1))).astype(np.float32)
    return x, y, (w_star + delta).astype(np.float32), dims + 1 + dims * noise


@pytest.mark.parametrize("steps, scale, replica_batch, updates", [(1, 4, 16, 600), (4, 16, 8, 400)])
def test_the_gain_is_the_closed_form_on_a_planted_regression(
    strategy, steps, scale, replica_batch, updates
):
    micro_batch = 4 * replica_batch
    x, y, start, b_simple = _regression(5, updates * steps, micro_batch)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1, use_bias=False)])
        model.set_weights([start])
        inner = (
            keras.optimizers.SGD(1e-7)  # the weights held still
            if steps == 1
            else tf_vrgd.SGD(1e-7, gradient_accumulation_steps=steps)
        )
        model.compile(optimizer=tf_vrgd.AdaScale(inner, scale=scale, decay=0.998), loss="mse")
    monitor = tf_vrgd.GSNRMonitor(batch_size=micro_batch)
    history = model.fit(x, y, batch_size=micro_batch, shuffle=False, verbose=0, callbacks=[monitor])
    base_batch = micro_batch * steps / scale
    expected = (b_simple / base_batch + 1) / (b_simple / (scale * base_batch) + 1)
    assert 1.5 < expected < scale - 1
    np.testing.assert_allclose(model.optimizer.gain, expected, rtol=0.05)
    # The noise scale from the same averages, in examples.
    np.testing.assert_allclose(history.history["noise_scale"][-1], b_simple, rtol=0.1)


def test_one_sample_per_update_is_the_inner_optimizer_on_its_schedule():
    model = helpers.make_model()
    initial = model.get_weights()
    stream = helpers.model_stream(9, 1, SCALES, 62)
    optimizer = tf_vrgd.AdaScale(keras.optimizers.SGD(_schedule()))
    helpers.apply_stream(optimizer, model.trainable_variables, stream, compiled=True)
    alone = helpers.make_model()
    helpers.apply_stream(keras.optimizers.SGD(_schedule()), alone.trainable_variables, stream)
    ref.assert_all_close(
        model.get_weights(), alone.get_weights(), "AdaScale, one sample", start=initial
    )
    assert optimizer.gain == 1.0 and optimizer.scale_invariant_steps == 9.0


def test_a_skipped_step_moves_neither_tau_nor_the_averages(strategy):
    stream = helpers.model_stream(4, 4, SCALES, seed=63)
    stream[2][1][0] = np.full_like(stream[2][1][0], np.inf)  # replica 1 overflows
    initial, got, optimizer = helpers.run_mirrored(
        strategy,
        lambda: tf_vrgd.LossScaleOptimizer(
            # The rate x 1/64 makes updates of the other tests' size.
            tf_vrgd.AdaScale(keras.optimizers.SGD(6.4), decay=0.5),
            initial_scale=64.0,
        ),
        stream,
    )
    # The gains of the three applied updates, from the gradients unscaled
    # by 64, 64 and then 32 (the skip halved the loss scale).
    applied = [
        [[g / scale for g in replica] for replica in stream[i]]
        for i, scale in ((0, 64.0), (1, 64.0), (3, 32.0))
    ]
    updates = helpers.samples_per_update(applied, 1)
    gains = ref.adascale_gains(updates, decay=0.5)
    expected = ref.adascale_weights(initial, updates, gains, ref.sgd, lambda step: 6.4)
    ref.assert_all_close(got, expected, "AdaScale under loss scaling", rtol=6e-4, start=initial)
    adascale = optimizer.inner_optimizer
    np.testing.assert_allclose(adascale.gain, gains[-1][0], rtol=2e-5)
    np.testing.assert_allclose(adascale.scale_invariant_steps, sum(g for g, _ in gains), rtol=2e-5)
    assert int(adascale.iterations.numpy()) == 3


def _fit_data(n=512, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    y = ((x[:, 0] - x[:, 3]) > 0).astype(np.int32) + (x[:, 1] > 0.5).astype(np.int32)
    return x, y


def _classifier(strategy, seed=0):
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
        )
        inner = keras.optimizers.SGD(_schedule(), momentum=0.9)
        return helpers.compile_classifier(model, tf_vrgd.AdaScale(inner, decay=0.9))


def test_save_and_restore_mid_run_equals_an_uninterrupted_run(strategy, tmp_path):
    x, y = _fit_data()
    straight = _classifier(strategy)
    straight.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)

    first = _classifier(strategy)
    first.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    at_save = first.get_weights()
    path = str(tmp_path / "model.keras")
    first.save(path)
    with strategy.scope():
        resumed = keras.models.load_model(path)
    assert resumed.optimizer.scale_invariant_steps == first.optimizer.scale_invariant_steps > 8
    resumed.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    ref.assert_all_close(
        resumed.get_weights(), straight.get_weights(), "AdaScale resumed", rtol=1e-5, start=at_save
    )
    np.testing.assert_allclose(resumed.optimizer.gain, straight.optimizer.gain, rtol=1e-6)
    np.testing.assert_allclose(
        resumed.optimizer.scale_invariant_steps, straight.optimizer.scale_invariant_steps, rtol=1e-4
    )


def test_a_checkpoint_restores_gain_tau_and_averages(strategy, tmp_path):
    x, y = _fit_data()
    model = _classifier(strategy)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    prefix = tf.train.Checkpoint(optimizer=model.optimizer).save(str(tmp_path / "ckpt"))
    restored = _classifier(strategy, seed=1)
    with strategy.scope():
        restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(optimizer=restored.optimizer).restore(
        prefix
    ).assert_existing_objects_matched()
    own = [v.numpy() for v in model.optimizer.variables[-4:]]
    assert [v.numpy() for v in restored.optimizer.variables[-4:]] == own
    assert own[0] > 1.0 and own[1] > 8  # the gain, and tau after eight updates


def test_scale_invariant_stop_ends_fit_at_the_base_schedule_length(strategy):
    x, y = _fit_data(2048)
    model = _classifier(strategy)
    stop = tf_vrgd.ScaleInvariantStop(20)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[stop])
    updates = int(model.optimizer.iterations.numpy())
    tau = model.optimizer.scale_invariant_steps
    assert tau >= 20 > tau - model.optimizer.gain
    assert updates < 20 < 2048 // 64


def test_scale_invariant_stop_ends_fit_at_the_update_where_tau_reaches_the_length():
    # One sample per update: the gain is 1 and tau counts updates, so the
    # stop comes at the update where tau equals the length, not one later.
    x, y = _fit_data(2048)
    model = _classifier(tf.distribute.get_strategy())
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[tf_vrgd.ScaleInvariantStop(5)])
    assert int(model.optimizer.iterations.numpy()) == 5
    assert model.optimizer.scale_invariant_steps == 5.0


def test_the_monitor_logs_the_gain_the_applied_rate_and_tau(strategy):
    x, y = _fit_data()
    model = _classifier(strategy)
    history = model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[tf_vrgd.GSNRMonitor()])
    gain = model.optimizer.gain
    assert history.history["adascale_gain"][-1] == pytest.approx(gain)
    # The last update's rate: the gain times the schedule at tau before it.
    tau = model.optimizer.scale_invariant_steps - gain
    assert history.history["adascale_learning_rate"][-1] == pytest.approx(
        gain * _numpy_rate(int(np.floor(tau))), rel=1e-6
    )
    assert history.history["scale_invariant_steps"][-1] == pytest.approx(
        model.optimizer.scale_invariant_steps
    )


def test_a_config_block_builds_adascale():
    block = {
        "optimizer": {
            "type": "adascale",
            "adascale": {"scale": 8, "optimizer": {"type": "sgd", "sgd": {"momentum": 0.9}}},
        },
        "learning_rate": {"type": "constant", "constant": {"learning_rate": 0.1}},
    }
    optimizer = config.optimizer_from_config(block)
    assert isinstance(optimizer, tf_vrgd.AdaScale) and optimizer.scale == 8.0
    assert optimizer.inner_optimizer.momentum == 0.9


def _sgd():
    return keras.optimizers.SGD()


# What the error names -> the wrapped optimizer or the arguments refused.
REFUSED = {
    "VR optimizer": (tf_vrgd.VRAdam, {}),
    "LARC": (lambda: tf_vrgd.LARC(_sgd()), {}),
    "NoiseScale": (lambda: tf_vrgd.NoiseScale(_sgd()), {}),
    "LossScaleOptimizer": (lambda: tf_vrgd.LossScaleOptimizer(_sgd()), {}),
    "Keras' own accumulation": (lambda: keras.optimizers.SGD(gradient_accumulation_steps=2), {}),
    "scale": (_sgd, {"scale": 1}),
    "decay": (_sgd, {"decay": 1.0}),
}


@pytest.mark.parametrize("said", REFUSED)
def test_bad_arguments_are_refused_by_name(said):
    inner, arguments = REFUSED[said]
    with pytest.raises(ValueError, match=said):
        tf_vrgd.AdaScale(inner(), **arguments)
    with pytest.raises(ValueError, match="steps"):
        tf_vrgd.ScaleInvariantStop(0)
