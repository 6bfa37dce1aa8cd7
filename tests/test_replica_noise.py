"""Random layers draw their own masks on each replica after
`independent_replica_noise` (Keras 3 draws one mask for all of them)."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_vrgd


def _dropout_model(seed=7):
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(16, kernel_initializer="ones")(inputs)
    outputs = keras.layers.Dropout(0.5, seed=seed)(hidden)
    return keras.Model(inputs, keras.layers.Dense(1, kernel_initializer="ones")(outputs))


def _replica_outputs(strategy, model, x):
    @tf.function
    def run():
        return strategy.run(lambda: model(x, training=True))

    return [t.numpy() for t in strategy.experimental_local_results(run())]


def _replica_gradients(strategy, model, x):
    """Each replica's gradient of the sum of outputs on the same `x`."""

    @tf.function
    def run():
        def grads():
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(model(x, training=True))
            return tape.gradient(loss, model.trainable_variables)

        return strategy.run(grads)

    per_variable = run()
    return [[t.numpy() for t in strategy.experimental_local_results(g)] for g in per_variable]


def test_keras_draws_one_mask_for_every_replica(strategy):
    """The behaviour the helper exists for; if a Keras release changes it,
    this fails and the helper's note needs revisiting."""
    with strategy.scope():
        model = _dropout_model()
    outputs = _replica_outputs(strategy, model, tf.ones((8, 64)))
    for other in outputs[1:]:
        np.testing.assert_array_equal(outputs[0], other)


def test_each_replica_draws_its_own_mask(strategy):
    x = tf.ones((8, 64))
    with strategy.scope():
        model = _dropout_model()
        twin = _dropout_model()
    assert tf_vrgd.independent_replica_noise(model) == 1
    assert tf_vrgd.independent_replica_noise(model) == 1  # again: no change
    first = _replica_outputs(strategy, model, x)
    reference = _replica_outputs(strategy, twin, x)
    np.testing.assert_array_equal(first[0], reference[0])  # replica 0 as before
    for i in range(len(first)):
        for j in range(i):
            assert not np.array_equal(first[i], first[j])
    # Masks keep about half the units: outputs are 2 x 64 x kept units.
    kept = np.concatenate(first) / (2 * 64)
    assert 0.35 < kept.mean() / 16 < 0.65
    second = _replica_outputs(strategy, model, x)
    assert not np.array_equal(first[0], second[0])  # the stream moves on


def test_identical_examples_give_distinct_replica_gradients(strategy):
    """With the same examples on every replica, the per-replica gradients
    (the VR optimizers' samples) differ only through the dropout noise: 0
    variance before, > 0 after."""
    x = tf.random.stateless_normal((8, 64), [1, 2])
    with strategy.scope():
        model = _dropout_model()
    before = _replica_gradients(strategy, model, x)
    assert all(np.var(np.stack(g), axis=0).max() == 0 for g in before)
    tf_vrgd.independent_replica_noise(model)
    after = _replica_gradients(strategy, model, x)
    kernel = np.stack(after[0])
    assert np.var(kernel, axis=0).mean() > 0


def test_outside_a_strategy_nothing_changes():
    x = tf.ones((4, 64))
    model, twin = _dropout_model(), _dropout_model()
    tf_vrgd.independent_replica_noise(model)
    for _ in range(2):
        np.testing.assert_array_equal(model(x, training=True), twin(x, training=True))


def test_gsnr_monitor_warns_of_shared_masks(strategy):
    x = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
    y = x.sum(axis=1, keepdims=True)
    with strategy.scope():
        model = _dropout_model()
        model.compile(
            optimizer=tf_vrgd.VRSGD(1e-4, track_gsnr_statistics=True), loss="mean_squared_error"
        )
    fit = dict(batch_size=32, epochs=1, verbose=0, callbacks=[tf_vrgd.GSNRMonitor()])
    with pytest.warns(UserWarning, match="1 random layer.*independent_replica_noise"):
        model.fit(x, y, **fit)
    tf_vrgd.independent_replica_noise(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(x, y, **fit)
