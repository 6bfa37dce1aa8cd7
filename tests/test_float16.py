"""VR optimizers on float16 variables (not mixed precision): the GSNR is
measured in float32 from the float32-cast gradients, so what float16 adds
is the base rule's own float16 arithmetic, as in Keras' optimizers on the
same gradient (docs/algorithms.md §1)."""

import keras
import numpy as np
import pytest

from tests import helpers
from tests import references as ref
import tf_vrgd

SHAPE = (3, 5)


def _stream():
    return helpers.gradient_stream([SHAPE], steps=6, replicas=4, seed=2)


def _run(strategy, optimizer, dtype, stream, initial):
    with strategy.scope():
        variables = [keras.Variable(initial.astype(dtype), dtype=dtype)]
    helpers.apply_stream_mirrored(
        strategy, optimizer, variables, [[[g[0].astype(dtype)] for g in s] for s in stream]
    )
    return variables[0].numpy().astype(np.float64)


def test_vr_adam_on_float16_is_keras_adam_on_the_same_scaled_gradient(strategy):
    """The scaled gradient ghat from the numpy reference (float64), given
    to Keras' Adam on a float16 variable, ends where VR-Adam on float16
    ends; the GSNR statistics are float32's."""
    stream, initial = _stream(), np.random.default_rng(0).standard_normal(SHAPE)
    scaled = []
    capture = ref.Rule(lambda i, w, g, slots, t: (scaled.append(g) or w, slots), 0)
    reference = ref.VRReference([initial], capture, 0.1, 0.9)
    for update in helpers.samples_per_update(stream, 1):
        reference.update(update)
    with strategy.scope():
        optimizer = tf_vrgd.VRAdam(0.01, track_gsnr_statistics=True)
    got = _run(strategy, optimizer, "float16", stream, initial)
    with strategy.scope():
        base = keras.optimizers.Adam(0.01)
    expected = _run(strategy, base, "float16", [[[g] * 1] * 4 for g in scaled], initial)
    np.testing.assert_allclose(got, expected, atol=2e-3)

    with strategy.scope():
        float32 = tf_vrgd.VRAdam(0.01, track_gsnr_statistics=True)
    _run(strategy, float32, "float32", stream, initial)
    (half,), (full,) = optimizer.gsnr_statistics().values(), float32.gsnr_statistics().values()
    for key in ("mean_gsnr", "mean_scale"):
        ref.assert_close(half[key], full[key], f"VR-Adam float16 {key}", rtol=1e-3)


# Each replica's gradient reaches the optimizer divided by the 4 replicas
# (Keras scales a replica's loss by 1/R), in float16, and the sums and
# squares are of those values.
def _overflowing(g):
    return g * 2000.0  # over 1024 in most elements: squares of g / 4 over 65504


def _underflowing(g):
    # g / 4 a normal float16 number (over 6.1e-5: TensorFlow flushes
    # subnormal ones to zero on CPU) whose square rounds to 0 (under 3e-8,
    # half its smallest subnormal).
    return 4.5e-4 * np.clip(1.0 + 0.3 * g, 0.65, 1.4)


@pytest.mark.parametrize("values", [_overflowing, _underflowing], ids=["overflow", "underflow"])
def test_the_gsnr_of_float16_gradients_is_measured_in_float32(strategy, values):
    """Gradients representable in float16 whose squares are not: VR-SGD on
    float16 variables measures the GSNR of the same values as on float32
    variables, to float32 round-off; squared in float16 they would be Inf
    or 0."""
    stream = [
        [[values(g[0]).astype(np.float16)] for g in step]
        for step in helpers.gradient_stream([SHAPE], steps=3, replicas=4, seed=3)
    ]
    scaled = np.concatenate([g[0].ravel() for step in stream for g in step]) / np.float16(4)
    assert np.all(np.abs(scaled) >= 6.2e-5) or values is _overflowing
    squares = np.square(scaled)
    assert np.mean(np.isinf(squares)) > 0.5 if values is _overflowing else np.all(squares == 0)
    initial = np.random.default_rng(1).standard_normal(SHAPE)
    statistics = []
    for dtype in ("float16", "float32"):
        with strategy.scope():
            optimizer = tf_vrgd.VRSGD(1e-6, track_gsnr_statistics=True)
        _run(strategy, optimizer, dtype, stream, initial)
        (row,) = optimizer.gsnr_statistics().values()
        statistics.append(row)
    half, full = statistics
    for key in ("mean_gsnr", "mean_scale", "fraction_at_gamma", "fraction_at_one"):
        np.testing.assert_allclose(half[key], full[key], rtol=1e-6, err_msg=key)
