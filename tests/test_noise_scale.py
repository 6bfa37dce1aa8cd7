"""The gradient noise scale (`tf_vrgd.noise_scale`): its estimators against
an independent numpy form, its moving average, and, through `GSNRMonitor`,
a planted answer: linear regression whose noise scale is known in closed
form."""

import keras
import numpy as np
import pytest

import tf_vrgd
from tf_vrgd import noise_scale


def _per_sample_gradients(samples, elements, seed=0):
    rng = np.random.default_rng(seed)
    signal = rng.normal(size=elements)
    return signal + rng.normal(scale=2.0, size=(samples, elements))


@pytest.mark.parametrize("samples", [2, 4, 8])
def test_the_estimates_are_the_sample_variance_and_the_corrected_mean(samples):
    """Written another way: tr(Sigma) per example is B_small times the
    unbiased variance of the samples summed over elements, and |G|^2 is
    |gbar|^2 less the noise a batch of B_big adds, tr(Sigma) / B_big."""
    g = _per_sample_gradients(samples, 50)
    batch = 96
    gbar = g.mean(axis=0)
    trace, squared_norm = noise_scale.estimates(
        np.sum(gbar**2), np.mean(np.sum(g**2, axis=1)), batch, samples
    )
    expected_trace = batch / samples * np.var(g, axis=0, ddof=1).sum()
    np.testing.assert_allclose(trace, expected_trace, rtol=1e-12)
    np.testing.assert_allclose(squared_norm, np.sum(gbar**2) - expected_trace / batch, rtol=1e-12)


def test_the_moving_average_is_bias_corrected_and_its_ratio_nan_without_signal():
    rng = np.random.default_rng(3)
    traces, norms = rng.uniform(1, 2, 6), rng.uniform(-0.5, 1.0, 6)
    moving = noise_scale.MovingNoiseScale(decay=0.8)
    assert np.isnan(moving.value)
    trace = norm = 0.0
    for n, (t, g) in enumerate(zip(traces, norms), start=1):
        moving.update(t, g)
        trace, norm = 0.8 * trace + 0.2 * t, 0.8 * norm + 0.2 * g
        correction = 1 - 0.8**n
        np.testing.assert_allclose(moving.trace, trace / correction, rtol=1e-12)
        expected = trace / norm if norm > 0 else np.nan
        np.testing.assert_allclose(moving.value, expected, rtol=1e-12)
    # Decay 0 keeps the last estimate; per-variable arrays average alike.
    last = noise_scale.MovingNoiseScale()
    last.update([1.0, 2.0], [0.5, -1.0])
    last.update([3.0, 4.0], [1.5, 2.0])
    np.testing.assert_allclose(last.value, [2.0, 2.0])
    np.testing.assert_array_equal(noise_scale.ratio([1.0, 1.0], [0.0, -1.0]), [np.nan, np.nan])


def test_efficiency_is_the_fraction_of_examples_a_small_batch_needs():
    np.testing.assert_allclose(
        noise_scale.efficiency(64, [64.0, 192.0, 0.0, np.nan]), [0.5, 0.75, 0.0, np.nan]
    )


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="samples"):
        noise_scale.estimates(1.0, 2.0, 64, 1)
    with pytest.raises(ValueError, match="batch_size"):
        noise_scale.estimates(1.0, 2.0, 0, 4)
    with pytest.raises(ValueError, match="decay"):
        noise_scale.MovingNoiseScale(decay=1.0)


def _planted_regression(samples, updates, batch, features, delta_norm, sigma, seed=0):
    """Inputs and targets of y = x.w* + sigma * eps, x ~ N(0, I), and the
    model's weights w = w* + delta with |delta| = `delta_norm`."""
    rng = np.random.default_rng(seed)
    w_star = rng.normal(size=(features, 1))
    delta = rng.normal(size=(features, 1))
    delta *= delta_norm / np.linalg.norm(delta)
    x = rng.normal(size=(samples, features))
    y = x @ w_star + sigma * rng.normal(size=(samples, 1))
    return x.astype("float32"), y.astype("float32"), (w_star + delta).astype("float32")


def _numpy_noise_terms(per_example, small, k):
    """(tr(Sigma), |G|^2) of one variable over one epoch of `fit`, in
    float64, from its per-example gradients [examples, ...] in the order
    `fit` takes them: per update, k samples, each the mean of `small`
    examples (a replica's share of a micro-step); tr(Sigma) = B_small times
    the unbiased variance of the samples summed over elements and |G|^2 =
    |gbar|^2 - tr(Sigma) / B_big, each averaged over the updates."""
    per_example = np.asarray(per_example, np.float64)
    samples = per_example.reshape(-1, k, small, int(np.prod(per_example.shape[1:]))).mean(axis=2)
    traces = small * samples.var(axis=1, ddof=1).sum(axis=-1)
    norms = np.sum(samples.mean(axis=1) ** 2, axis=-1) - traces / (small * k)
    return traces.mean(), norms.mean()


def _numpy_noise_scale(x, y, weights, batch, accumulation, replicas):
    """B_simple of the one-kernel regression at fixed `weights`
    (`_numpy_noise_terms` of its mean-squared-error gradients)."""
    x, y, w = (np.asarray(a, np.float64) for a in (x, y, weights))
    trace, norm = _numpy_noise_terms(
        2.0 * (x @ w - y) * x, batch // replicas, replicas * accumulation
    )
    return trace / norm


@pytest.mark.parametrize(
    "make_optimizer, accumulation",
    [
        (lambda: tf_vrgd.VRSGD(0.0, track_gsnr_statistics=True), 1),
        (
            lambda: tf_vrgd.VRSGD(0.0, gradient_accumulation_steps=2, track_gsnr_statistics=True),
            2,
        ),
        (lambda: tf_vrgd.NoiseScale(keras.optimizers.SGD(0.0)), 1),
        (lambda: tf_vrgd.NoiseScale(keras.optimizers.Adam(0.0)), 1),
        # Keras' SGD and Adam with the package's accumulation under
        # MirroredStrategy (Keras' own fails there).
        (lambda: tf_vrgd.NoiseScale(tf_vrgd.SGD(0.0, gradient_accumulation_steps=2)), 2),
        (lambda: tf_vrgd.NoiseScale(tf_vrgd.Adam(0.0, gradient_accumulation_steps=2)), 2),
    ],
    ids=[
        "VRSGD k=4",
        "VRSGD k=8 (4 replicas x 2)",
        "NoiseScale(SGD) k=4",
        "NoiseScale(Adam) k=4",
        "NoiseScale(SGD) k=8 (4 replicas x 2)",
        "NoiseScale(Adam) k=8 (4 replicas x 2)",
    ],
)
def test_the_logged_noise_scale_finds_the_planted_one(strategy, make_optimizer, accumulation):
    """Linear regression with a planted noise scale.

    Per example, y = x.w* + sigma * eps with x ~ N(0, I_d) and eps ~ N(0, 1),
    and the loss (x.w - y)^2 at fixed weights w = w* + delta (learning rate
    0). Its gradient is g = 2 (x.delta - sigma * eps) x, so

        G = E[g] = 2 E[x x^T] delta = 2 delta,
        E[g g^T] = 4 (E[(x.delta)^2 x x^T] + sigma^2 E[x x^T])
                 = 4 (|delta|^2 I + 2 delta delta^T + sigma^2 I)

    (the Gaussian fourth moment E[x_i x_j x_k x_l] gives |delta|^2 I +
    2 delta delta^T; the cross terms have E[eps] = 0). The covariance is
    Sigma = E[g g^T] - G G^T = 4 ((|delta|^2 + sigma^2) I + delta delta^T),
    with trace 4 ((d + 1) |delta|^2 + d sigma^2), so

        B_simple = tr(Sigma) / |G|^2 = ((d + 1) |delta|^2 + d sigma^2) / |delta|^2.

    The factor 2 (the loss' scale c) cancels. Here d = 8, |delta| = 1,
    sigma = 1: B_simple = 17 examples. 200 updates of 128 examples on 4
    replicas (k = 4, and k = 8 with 2 accumulation steps of 64).
    """
    features, delta_norm, sigma, updates, update_examples = 8, 1.0, 1.0, 200, 128
    planted = ((features + 1) * delta_norm**2 + features * sigma**2) / delta_norm**2
    x, y, weights = _planted_regression(
        updates * update_examples, updates, update_examples, features, delta_norm, sigma
    )
    batch = update_examples // accumulation
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((features,)), keras.layers.Dense(1, use_bias=False, name="linear")]
        )
        model.layers[0].kernel.assign(weights)
        model.compile(optimizer=make_optimizer(), loss="mean_squared_error")
    monitor = tf_vrgd.GSNRMonitor(batch_size=batch)
    history = model.fit(
        x, y, batch_size=batch, epochs=1, shuffle=False, callbacks=[monitor], verbose=0
    )
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), weights)  # learning rate 0
    measured = history.history["noise_scale"][0]
    # The same estimate from the same batches in numpy: replica r's sample
    # of a micro-step is the mean-loss gradient of its quarter of the
    # micro-step's batch, in order.
    expected = _numpy_noise_scale(x, y, weights, batch, accumulation, replicas=4)
    assert measured == pytest.approx(expected, rel=2e-4), (measured, expected)
    # And the estimate finds the planted value (without the noise
    # correction of |G|^2 it is about 10% off).
    error = abs(measured / planted - 1)
    assert error < 0.05, (measured, planted)
    # One variable: its own noise scale is the model's.
    assert history.history["noise_scale/sequential/linear/kernel"][0] == pytest.approx(measured)
    print(f"planted noise scale {planted}, logged {measured:.3f} (relative error {error:.3f})")


def test_the_model_wide_noise_scale_pools_the_variables(strategy):
    """Two variables of very different noise scales (a kernel and a bias
    whose offset carries most of |G|^2): the model-wide value is the sum of
    their traces over the sum of their |G|^2, not the mean of their ratios;
    each against numpy from the same batches."""
    features, updates, batch, replicas = 8, 100, 128, 4
    x, y, kernel = _planted_regression(updates * batch, updates, batch, features, 1.0, 1.0)
    bias = np.array([3.0], np.float32)  # y has no intercept: the offset is the error
    with strategy.scope():
        model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(1, name="linear")])
        model.layers[0].kernel.assign(kernel)
        model.layers[0].bias.assign(bias)
        model.compile(
            optimizer=tf_vrgd.VRSGD(0.0, track_gsnr_statistics=True), loss="mean_squared_error"
        )
    history = model.fit(
        x,
        y,
        batch_size=batch,
        epochs=1,
        shuffle=False,
        callbacks=[tf_vrgd.GSNRMonitor(batch_size=batch, per_variable=True)],
        verbose=0,
    )
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    residual = 2.0 * (x64 @ kernel.astype(np.float64) + bias[0] - y64)
    traces, norms = zip(
        *(_numpy_noise_terms(g, batch // replicas, replicas) for g in (residual * x64, residual))
    )
    ratios = np.array(traces) / np.array(norms)
    pooled = sum(traces) / sum(norms)
    assert abs(pooled / ratios.mean() - 1) > 0.5  # the two readings differ here
    logs = {k: v[0] for k, v in history.history.items()}
    assert logs["noise_scale"] == pytest.approx(pooled, rel=2e-4)
    for path, expected in zip(("kernel", "bias"), ratios):
        assert logs[f"noise_scale/sequential/linear/{path}"] == pytest.approx(expected, rel=2e-4)
