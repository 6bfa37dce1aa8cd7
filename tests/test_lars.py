"""LARS against its numpy reference (docs/algorithms.md §4)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests import references as ref
import tf_vrgd

STEPS = 6
# Gradient scales per variable: kernel gradients tiny relative to their
# weights, bias gradients large, so trust ratios are far from 1 both ways.
SCALES = [1e-2, 2.0, 5e-3, 1.0]


def run_lars(stream, compiled=False, configure=None, **kwargs):
    model = helpers.make_model()
    initial = model.get_weights()
    optimizer = tf_vrgd.LARS(**kwargs)
    if configure:
        configure(optimizer, model)
    helpers.apply_stream(optimizer, model.trainable_variables, stream, compiled)
    return initial, model.get_weights()


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize(
    "hyper",
    [
        dict(momentum=0.9, nesterov=False, trust_coefficient=0.001),
        dict(momentum=0.9, nesterov=True, trust_coefficient=0.01),
        dict(momentum=0.0, nesterov=False, trust_coefficient=0.02),
        dict(momentum=0.5, nesterov=False, trust_coefficient=0.001, weight_decay_rate=0.01),
    ],
    ids=["classic", "nesterov", "no-momentum", "coupled-decay"],
)
def test_lars_matches_reference(hyper, compiled):
    shapes = helpers.model_shapes()
    stream = helpers.mean_over_replicas(helpers.gradient_stream(shapes, STEPS, scales=SCALES))
    stream32 = [[[g.astype(np.float32) for g in step]] for step in stream]
    initial, got = run_lars(stream32, compiled, learning_rate=0.5, **hyper)
    expected = ref.run_lars(initial, stream, 0.5, **hyper)
    ref.assert_all_close(got, expected, "LARS", rtol=1e-4, start=initial)


def test_lars_exclusions_regex_and_keras_forms():
    shapes = helpers.model_shapes()
    stream = [[list(step[0])] for step in helpers.gradient_stream(shapes, STEPS, scales=SCALES)]
    # Regex form: biases get no decay; by default also no adaptation.
    initial, got = run_lars(
        stream, learning_rate=0.5, weight_decay_rate=0.05, exclude_from_weight_decay=["bias"]
    )
    decays = [True, False, True, False]
    expected = ref.run_lars(
        initial, [s[0] for s in stream], 0.5, decays=decays, adapts=decays, weight_decay_rate=0.05
    )
    ref.assert_all_close(got, expected, "LARS exclusions", start=initial)

    # Separate adaptation list: .../head/* keeps decay but has trust 1.
    initial, got = run_lars(
        stream,
        learning_rate=0.5,
        weight_decay_rate=0.05,
        exclude_from_weight_decay=["bias"],
        exclude_from_layer_adaptation=["/head/"],
    )
    expected = ref.run_lars(
        initial,
        [s[0] for s in stream],
        0.5,
        decays=decays,
        adapts=[True, True, False, False],
        weight_decay_rate=0.05,
    )
    ref.assert_all_close(got, expected, "LARS exclusions", start=initial)

    # Keras form, by variables and by names; names are then saved.
    def configure(optimizer, model):
        optimizer.exclude_from_weight_decay(var_list=[model.layers[0].bias])
        optimizer.exclude_from_layer_adaptation(var_names=["head/bias"])

    initial, got = run_lars(stream, learning_rate=0.5, weight_decay_rate=0.05, configure=configure)
    expected = ref.run_lars(
        initial,
        [s[0] for s in stream],
        0.5,
        decays=[True, False, True, True],
        adapts=[True, True, True, False],
        weight_decay_rate=0.05,
    )
    ref.assert_all_close(got, expected, "LARS exclusions", start=initial)


def test_exclusion_lists_are_saved_and_keras_names_join_them():
    optimizer = tf_vrgd.LARS(exclude_from_weight_decay=["bias", "layer_norm"])
    optimizer.exclude_from_weight_decay(var_names=["gamma"])
    config = optimizer.get_config()
    assert config["exclude_from_weight_decay"] == ["bias", "layer_norm", "gamma"]
    assert config["exclude_from_layer_adaptation"] is None
    restored = tf_vrgd.LARS.from_config(config)
    assert restored.get_config() == config


def test_exclusion_after_build_raises():
    model = helpers.make_model()
    optimizer = tf_vrgd.LARS()
    optimizer.build(model.trainable_variables)
    with pytest.raises(ValueError, match="before the optimizer is built"):
        optimizer.exclude_from_layer_adaptation(var_names=["bias"])


def test_zero_weights_and_zero_gradients_use_trust_one():
    variable = keras.Variable(np.zeros((3,), np.float32))
    other = keras.Variable(np.ones((3,), np.float32))
    optimizer = tf_vrgd.LARS(learning_rate=0.1, momentum=0.0, trust_coefficient=0.001)
    g = np.array([1.0, -2.0, 0.5], np.float32)
    optimizer.apply([tf.constant(g), tf.zeros((3,))], [variable, other])
    # Zero weights: trust 1, plain SGD step; zero gradient: no movement.
    np.testing.assert_allclose(variable.numpy(), -0.1 * g, rtol=1e-6)
    np.testing.assert_array_equal(other.numpy(), np.ones(3))


def test_none_gradient_leaves_variable_and_slot_untouched():
    model = helpers.make_model()
    before = model.get_weights()
    optimizer = tf_vrgd.LARS(learning_rate=0.5)
    grads = [tf.ones(w.shape) for w in before]
    grads[1] = None
    with pytest.warns(UserWarning, match="Gradients do not exist"):
        optimizer.apply(grads, model.trainable_variables)
    after = model.get_weights()
    np.testing.assert_array_equal(after[1], before[1])
    assert not np.allclose(after[0], before[0])
    np.testing.assert_array_equal(optimizer._velocities[1].numpy(), 0.0)


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(learning_rate=-0.1), "learning_rate"),
        (dict(momentum=1.0), "momentum"),
        (dict(momentum=-0.1), "momentum"),
        (dict(trust_coefficient=0.0), "trust_coefficient"),
        (dict(trust_coefficient=-1.0), "trust_coefficient"),
        (dict(weight_decay_rate=-1e-4), "weight_decay_rate"),
        (dict(nesterov="yes"), "nesterov"),
        (dict(exclude_from_weight_decay="bias"), "exclude_from_weight_decay"),
        (dict(exclude_from_layer_adaptation=["("]), "exclude_from_layer_adaptation"),
    ],
)
def test_bad_hyper_parameters_raise(kwargs, argument):
    with pytest.raises(ValueError, match=argument) as info:
        tf_vrgd.LARS(**kwargs)
    value = next(iter(kwargs.values()))
    assert repr(value) in str(info.value) or str(value) in str(info.value)
