"""`tf_vrgd.NoiseScale` around other optimizers: the inner update is the
unwrapped one bit for bit, the running sums are the squared norms of the
samples' mean and of each sample (numpy), at measured updates only, and
bad inputs are refused by name. (Its noise scale against a planted answer:
`tests/test_noise_scale.py`; saving and restoring:
`tests/test_keras_integration.py`.)"""

import keras
import numpy as np
import pytest

from tests import helpers
from tests import references as ref
import tf_vrgd

SCALES = [1e-2, 1.0, 5e-2, 0.3]
BASES = {
    "Keras Adam": lambda: keras.optimizers.Adam(0.01),
    "Keras SGD": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "LAMB": lambda: tf_vrgd.LAMB(0.01, weight_decay_rate=0.01),
    "Adam, 2 micro-steps": lambda: tf_vrgd.Adam(0.01, gradient_accumulation_steps=2),
}


def _steps(name):
    return 2 if "micro-steps" in name else 1


@pytest.mark.parametrize("name", BASES)
def test_the_inner_update_is_the_unwrapped_one_bit_for_bit(strategy, name):
    stream = helpers.model_stream(5 * _steps(name), 4, SCALES, seed=41)
    _, alone, _ = helpers.run_mirrored(strategy, BASES[name], stream)
    _, wrapped, optimizer = helpers.run_mirrored(
        strategy, lambda: tf_vrgd.NoiseScale(BASES[name]()), stream
    )
    for a, b in zip(alone, wrapped):
        np.testing.assert_array_equal(a, b)
    assert int(optimizer.iterations.numpy()) == 5


@pytest.mark.parametrize("name", ["Keras Adam", "Adam, 2 micro-steps"])
def test_the_sums_are_the_squared_norms_of_the_measured_updates(strategy, name):
    steps, updates, interval = _steps(name), 7, 3
    stream = helpers.model_stream(updates * steps, 4, SCALES, seed=42)
    _, _, optimizer = helpers.run_mirrored(
        strategy, lambda: tf_vrgd.NoiseScale(BASES[name](), interval=interval), stream
    )
    # numpy: the k = 4 x steps samples of updates 1, 4 and 7.
    expected = ref.noise_scale_sums(helpers.samples_per_update(stream, steps), interval)
    got = optimizer.noise_scale_sums()
    np.testing.assert_array_equal(got[:, 2], 3.0)
    np.testing.assert_allclose(got, expected, rtol=2e-5)
    optimizer.reset_noise_scale_sums()
    assert not optimizer.noise_scale_sums().any()


def test_one_replica_without_accumulation_measures_nothing():
    model = helpers.make_model()
    optimizer = tf_vrgd.NoiseScale(keras.optimizers.SGD(0.1))
    stream = helpers.model_stream(2, 1, SCALES, 43)
    helpers.apply_stream(optimizer, model.trainable_variables, stream)
    assert not optimizer.noise_scale_sums().any()


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda: tf_vrgd.NoiseScale(tf_vrgd.VRAdam()), "VR optimizer"),
        (lambda: tf_vrgd.NoiseScale(tf_vrgd.LARC(keras.optimizers.SGD())), "LARC"),
        (
            lambda: tf_vrgd.NoiseScale(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())),
            "LossScaleOptimizer",
        ),
        (
            lambda: tf_vrgd.NoiseScale(keras.optimizers.SGD(gradient_accumulation_steps=2)),
            "Keras' own accumulation",
        ),
        (lambda: tf_vrgd.NoiseScale(keras.optimizers.SGD(), interval=0), "interval"),
        (lambda: tf_vrgd.NoiseScale("adam"), "Keras 3 optimizer"),
    ],
)
def test_bad_arguments_are_refused_by_name(make, said):
    with pytest.raises(ValueError, match=said):
        make()


@pytest.mark.parametrize(
    "first, second",
    [
        ("NoiseScale", "NoiseScale"),
        ("NoiseScale", "AdaScale"),
        ("AdaScale", "NoiseScale"),
        ("AdaScale", "AdaScale"),
        ("LARC", "LARC"),
    ],
)
def test_an_optimizer_is_wrapped_once(first, second):
    """A wrapper that rewrites its optimizer's all-reduce (or, for LARC,
    its per-variable update) refuses an optimizer another already holds,
    naming that one."""
    inner = keras.optimizers.SGD()
    getattr(tf_vrgd, first)(inner)
    with pytest.raises(ValueError, match=f"already wrapped by (a|another) {first}"):
        getattr(tf_vrgd, second)(inner)


def test_the_monitor_needs_a_batch_size():
    model = helpers.make_model()
    model.compile(optimizer=tf_vrgd.NoiseScale(keras.optimizers.SGD()), loss="mse")
    x = np.zeros((8, *model.input_shape[1:]), np.float32)
    y = np.zeros((8, *model.output_shape[1:]), np.float32)
    with pytest.raises(ValueError, match="batch_size"):
        model.fit(x, y, callbacks=[tf_vrgd.GSNRMonitor()], verbose=0)
