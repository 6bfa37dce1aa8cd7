"""`tf_vrgd.AdamWeightDecay` takes its arguments as Keras' AdamW does: the
learning rate first, the weight-decay lists by keyword, checked."""

import keras
import numpy as np
import pytest

import tf_vrgd


def _step(optimizer, w0, g):
    variable = keras.Variable(np.array(w0, np.float32), name="kernel")
    optimizer.apply([keras.ops.convert_to_tensor(np.array(g, np.float32))], [variable])
    return variable.numpy()


def test_learning_rate_is_the_first_argument():
    optimizer = tf_vrgd.AdamWeightDecay(1e-3)
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(1e-3)
    # A zero rate moves nothing (the first Adam step is lr * sign(g)).
    assert np.array_equal(_step(tf_vrgd.AdamWeightDecay(0.0), [1.0, -2.0], [0.5, 0.5]), [1, -2])
    moved = _step(tf_vrgd.AdamWeightDecay(0.1, 0.0), [1.0, -2.0], [0.5, 0.5])
    np.testing.assert_allclose(moved, [0.9, -2.1], rtol=1e-5)
    # The second positional argument is Keras AdamW's: weight_decay.
    assert tf_vrgd.AdamWeightDecay(0.1, 0.25).weight_decay == 0.25


@pytest.mark.parametrize("value", ["bias", [1], ["("]])
def test_include_list_is_checked(value):
    with pytest.raises(ValueError, match="include_in_weight_decay"):
        tf_vrgd.AdamWeightDecay(include_in_weight_decay=value)


def test_lists_are_saved():
    optimizer = tf_vrgd.AdamWeightDecay(
        2e-3, include_in_weight_decay=["kernel"], exclude_from_weight_decay=["bias"]
    )
    again = tf_vrgd.AdamWeightDecay.from_config(optimizer.get_config())
    assert again.get_config()["include_in_weight_decay"] == ["kernel"]
    assert again.get_config()["exclude_from_weight_decay"] == ["bias"]
    assert float(again.learning_rate.numpy()) == pytest.approx(2e-3)


def test_an_included_variable_decays_although_an_exclusion_matches_it():
    # Keras' AdamW at its first step, in numpy: the decoupled decay
    # w * lr * wd, then lr * sqrt(1 - b2) g / (sqrt(1 - b2) |g| + eps).
    lr, wd, eps = 0.1, 0.5, 1e-7
    optimizer = tf_vrgd.AdamWeightDecay(
        lr,
        wd,
        epsilon=eps,
        include_in_weight_decay=["head_bias"],
        exclude_from_weight_decay=["bias"],
    )
    names = ["kernel", "bias", "head_bias"]
    w0 = np.array([[1.0, -2.0], [3.0, 0.5], [-1.5, 2.5]], np.float32)
    g = np.array([[0.5, -0.25], [1.0, 2.0], [-0.5, 0.125]], np.float32)
    variables = [keras.Variable(w, name=name) for w, name in zip(w0, names)]
    optimizer.apply([keras.ops.convert_to_tensor(x) for x in g], variables)
    root = np.sqrt(1.0 - 0.999)
    adam_step = lr * root * g / (root * np.abs(g) + eps)
    decays = np.array([[1.0], [0.0], [1.0]], np.float32)
    expected = -decays * lr * wd * w0 - adam_step
    got = np.stack([v.numpy() for v in variables]) - w0
    np.testing.assert_allclose(got, expected, rtol=1e-5)
