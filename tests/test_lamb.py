"""LAMB (Model Garden form) against its numpy reference (docs/algorithms.md §4)."""

import keras
import pytest

from tests import helpers
from tests import references as ref
import tf_vrgd

STEPS = 6
SCALES = [1e-2, 2.0, 5e-3, 1.0]
LR = 0.05


def _run(optimizer, stream):
    model = helpers.make_model()
    initial = model.get_weights()
    helpers.apply_stream(optimizer, model.trainable_variables, [[step] for step in stream])
    return initial, model.get_weights()


def _reference(initial, stream, decays, adapts, **hyper):
    return ref.run(initial, ref.lamb(LR, decays, adapts, **hyper), stream)


def _stream():
    shapes = helpers.model_shapes()
    return [step[0] for step in helpers.gradient_stream(shapes, STEPS, scales=SCALES)]


@pytest.mark.parametrize(
    "kwargs, decays, adapts",
    [
        (dict(weight_decay_rate=0.01), [True] * 4, [True] * 4),
        # Model Garden: the adaptation list defaults to the decay list.
        (
            dict(weight_decay_rate=0.01, exclude_from_weight_decay=["bias"]),
            [True, False, True, False],
            [True, False, True, False],
        ),
        (
            dict(
                weight_decay_rate=0.01,
                exclude_from_weight_decay=["bias"],
                exclude_from_layer_adaptation=["head"],
            ),
            [True, False, True, False],
            [True, True, False, False],
        ),
    ],
    ids=["decay", "exclusions", "separate-lists"],
)
def test_lamb_matches_reference(kwargs, decays, adapts):
    stream = _stream()
    initial, got = _run(tf_vrgd.LAMB(LR, **kwargs), stream)
    expected = _reference(
        initial, stream, decays, adapts, weight_decay_rate=kwargs["weight_decay_rate"]
    )
    ref.assert_all_close(got, expected, "LAMB", start=initial)


def test_lamb_without_decay_is_keras_lamb():
    stream = _stream()
    initial, got = _run(tf_vrgd.LAMB(LR), stream)
    # At this LAMB's epsilon, 1e-6 (Keras' Lamb defaults to 1e-7).
    _, keras_lamb = _run(keras.optimizers.Lamb(LR, epsilon=1e-6), stream)
    ref.assert_all_close(got, keras_lamb, "LAMB vs keras.optimizers.Lamb", rtol=2e-6, start=initial)


def test_lamb_config_round_trip():
    optimizer = tf_vrgd.LAMB(0.01, weight_decay_rate=0.1, exclude_from_weight_decay=["bias"])
    config = optimizer.get_config()
    assert tf_vrgd.LAMB.from_config(config).get_config() == config
    assert config["exclude_from_weight_decay"] == ["bias"]
