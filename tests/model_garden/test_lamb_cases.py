"""Model Garden's own LAMB test cases (`official/modeling/optimization/
lamb_test.py`) on the package's LAMB face, against Model Garden's numpy
reference `lamb_update_numpy`. Where a case reads tf_keras internals
(`_get_hyper`, `_do_use_weight_decay`) or takes tf_keras' `decay`
argument, the same numbers are checked through the public behaviour: the
decay as the `InverseTimeDecay` schedule it is, the exclusions by the
updates they produce."""

import numpy as np
import pytest
import tensorflow as tf

tf_keras = pytest.importorskip("tf_keras")
lamb_test = pytest.importorskip("official.modeling.optimization.lamb_test")

from tf_vrgd.model_garden import optimizers  # noqa: E402

reference = lamb_test.lamb_update_numpy


def test_sparse():
    var0_np = np.array([1.0, 1.0, 2.0], np.float32)
    var1_np = np.array([3.0, 3.0, 4.0], np.float32)
    grads0_np = np.array([0.1, 0.0, 0.1], np.float32)
    grads1_np = np.array([0.01, 0.0, 0.01], np.float32)
    var0, var1 = tf.Variable(var0_np), tf.Variable(var1_np)
    rows = np.array([0, 2], np.int32)

    def rows_of(grads):
        return tf.IndexedSlices(tf.constant(grads[rows]), tf.constant(rows), tf.constant([3]))

    opt = optimizers.LAMB()
    m0 = v0 = m1 = v1 = 0.0
    for t in range(3):
        opt.apply_gradients(zip([rows_of(grads0_np), rows_of(grads1_np)], [var0, var1]))
        var0_np, m0, v0 = reference(var0_np, grads0_np, t, m0, v0)
        var1_np, m1, v1 = reference(var1_np, grads1_np, t, m1, v1)
        np.testing.assert_allclose(var0.numpy(), var0_np, rtol=1e-6)
        np.testing.assert_allclose(var1.numpy(), var1_np, rtol=1e-6)


def test_basic_with_learning_rate_decay():
    """tf_keras' `decay = 0.5` is lr / (1 + 0.5 t): InverseTimeDecay."""
    var0_np = np.array([1.0, 2.0], np.float32)
    var1_np = np.array([3.0, 4.0], np.float32)
    grads0_np = np.array([0.1, 0.1], np.float32)
    grads1_np = np.array([0.01, 0.01], np.float32)
    var0, var1 = tf.Variable(var0_np, name="var0"), tf.Variable(var1_np, name="var1")
    learning_rate, decay, lamb_wd = 0.001, 0.5, 0.01
    opt = optimizers.LAMB(
        learning_rate=tf_keras.optimizers.schedules.InverseTimeDecay(learning_rate, 1, decay),
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-7,
        weight_decay_rate=lamb_wd,
    )
    m0 = v0 = m1 = v1 = 0.0
    for t in range(3):
        opt.apply_gradients(zip([tf.constant(grads0_np), tf.constant(grads1_np)], [var0, var1]))
        lr_np = learning_rate / (1 + decay * t)
        var0_np, m0, v0 = reference(
            var0_np, grads0_np, t, m0, v0, lr=lr_np, lamb_wd=lamb_wd, epsilon=1e-7
        )
        var1_np, m1, v1 = reference(
            var1_np, grads1_np, t, m1, v1, lr=lr_np, lamb_wd=lamb_wd, epsilon=1e-7
        )
        np.testing.assert_allclose(var0.numpy(), var0_np, rtol=1e-6)
        np.testing.assert_allclose(var1.numpy(), var1_np, rtol=1e-6)


def _one_step(opt):
    var0 = tf.Variable([1.0, 2.0], name="var0")
    var1 = tf.Variable([3.0, 4.0], name="var1_weight")
    opt.apply_gradients(zip([tf.constant([0.1, 0.2]), tf.constant([0.3, -0.1])], [var0, var1]))
    return var0.numpy(), var1.numpy()


def test_exclude_weight_decay():
    var0, var1 = _one_step(
        optimizers.LAMB(0.01, weight_decay_rate=0.01, exclude_from_weight_decay=["var1"])
    )
    np.testing.assert_allclose(
        var0,
        reference(np.array([1.0, 2.0]), np.array([0.1, 0.2]), 0, 0, 0, 0.01, 0.01)[0],
        rtol=1e-6,
    )
    # var1_weight: no decay (the pattern matches), and no layer adaptation
    # either: Model Garden's adaptation list defaults to the decay list.
    np.testing.assert_allclose(var1, _unadapted_step([3.0, 4.0], [0.3, -0.1]), rtol=1e-6)


def test_exclude_layer_adaptation():
    var0, var1 = _one_step(optimizers.LAMB(0.01, exclude_from_layer_adaptation=["var1"]))
    np.testing.assert_allclose(
        var0, reference(np.array([1.0, 2.0]), np.array([0.1, 0.2]), 0, 0, 0, 0.01)[0], rtol=1e-6
    )
    np.testing.assert_allclose(var1, _unadapted_step([3.0, 4.0], [0.3, -0.1]), rtol=1e-6)


def _unadapted_step(w, g):
    """LAMB's first step at a trust ratio of 1, without decay: mhat = g and
    vhat = g^2, so w - lr * g / (|g| + epsilon)."""
    w, g = np.array(w), np.array(g)
    return w - 0.01 * g / (np.abs(g) + 1e-6)


def test_serialization():
    optimizer = optimizers.LAMB(1e-4)
    config = tf_keras.optimizers.serialize(optimizer, use_legacy_format=True)
    new_optimizer = tf_keras.optimizers.deserialize(
        config, use_legacy_format=True, custom_objects={"LAMB": optimizers.LAMB}
    )
    assert new_optimizer.get_config() == optimizer.get_config()
