"""VR optimizers on float16 variables (not mixed precision): the GSNR is
measured in float32 from the float32-cast gradients, so what float16 adds
is the base rule's own float16 arithmetic, as in Keras' optimizers on the
same gradient (docs/algorithms.md §1)."""

import keras
import numpy as np

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
