"""`tf_vrgd.LossScaleOptimizer`: an overflow on one replica of four makes
every replica skip the step and halves the scale (Keras' own wrapper
applies it); finite gradients update as the inner optimizer alone."""

import keras
import numpy as np
import pytest

from tests import helpers
from tests import references as ref
import tf_vrgd

SCALE = 2.0**15  # the initial loss scale: a power of two, unscaling is exact


def _scaled(stream):
    return [[[g * SCALE for g in replica] for replica in step] for step in stream]


@pytest.mark.parametrize(
    "make",
    [
        lambda: tf_vrgd.VRAdam(0.01),
        lambda: keras.optimizers.Adam(0.01),
        # SGD's step is linear in the gradient: a gradient left scaled, or
        # unscaled by the wrong factor, shows in it (Adam's hardly moves).
        lambda: tf_vrgd.VRSGD(0.01),
        lambda: keras.optimizers.SGD(0.01),
    ],
    ids=["VRAdam", "Adam", "VRSGD", "SGD"],
)
def test_an_overflow_on_one_replica_skips_the_step_everywhere(strategy, make):
    stream = helpers.gradient_stream(helpers.model_shapes(), steps=3, replicas=4)
    initial, expected, _ = helpers.run_mirrored(strategy, make, stream)
    with strategy.scope():
        model = helpers.make_model()
        wrapped = tf_vrgd.LossScaleOptimizer(make(), initial_scale=SCALE)
    helpers.apply_stream_mirrored(strategy, wrapped, model.trainable_variables, _scaled(stream))
    label = "LossScaleOptimizer(finite steps) vs the inner optimizer"
    ref.assert_all_close(model.get_weights(), expected, label, start=initial)

    overflow = helpers.gradient_stream(helpers.model_shapes(), steps=1, replicas=4, seed=9)
    overflow[0][2][0][1, 1] = np.inf
    before = model.get_weights()
    helpers.apply_stream_mirrored(strategy, wrapped, model.trainable_variables, overflow)
    for variable, value in zip(model.trainable_variables, before):
        for copy in variable.value.values:
            np.testing.assert_array_equal(copy.numpy(), value)
    assert int(wrapped.inner_optimizer.iterations.numpy()) == 3
    assert float(wrapped.dynamic_scale.numpy()) == SCALE / 2

    # Keras' own wrapper reads the first replica's check: it applies the step.
    with strategy.scope():
        model = helpers.make_model()
        keras_wrapped = keras.optimizers.LossScaleOptimizer(make(), initial_scale=SCALE)
    helpers.apply_stream_mirrored(strategy, keras_wrapped, model.trainable_variables, overflow)
    assert not all(np.isfinite(w).all() for w in model.get_weights())


def test_it_saves_and_loads_as_itself():
    optimizer = tf_vrgd.LossScaleOptimizer(tf_vrgd.VRAdam(0.01), initial_scale=8.0)
    again = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert type(again) is tf_vrgd.LossScaleOptimizer
    assert type(again.inner_optimizer) is tf_vrgd.VRAdam
    assert again.get_config() == optimizer.get_config()
