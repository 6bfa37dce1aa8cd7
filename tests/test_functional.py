"""Each pure piece of tf_vrgd.functional against its numpy reference."""

import zlib

import numpy as np
import pytest
import tensorflow as tf

from tests import references as ref
from tf_vrgd import functional

RNG = np.random.default_rng(0)  # reseeded for each test (below)


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """Each test's data from a seed of its own name: the same whichever
    tests ran before it, and in whatever order."""
    global RNG
    RNG = np.random.default_rng(zlib.crc32(request.node.name.encode()))


def _tensor(shape, scale):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("w_scale,u_scale", [(5.0, 1e-3), (1e-3, 5.0), (1.0, 1.0)])
def test_trust_ratio_matches_numpy(w_scale, u_scale):
    w, u = _tensor((7, 5), w_scale), _tensor((7, 5), u_scale)
    got = functional.trust_ratio(functional.l2_norm(w), functional.l2_norm(u), 0.01)
    ref.assert_close(got, 0.01 * ref.norm(w) / ref.norm(u), "functional.trust_ratio")


def test_trust_ratio_is_one_on_zero_norms():
    zero, positive = tf.constant(0.0), tf.constant(3.0)
    for w_norm, u_norm in [(zero, positive), (positive, zero), (zero, zero)]:
        assert float(functional.trust_ratio(w_norm, u_norm, 0.01)) == 1.0


def test_l2_norm_matches_numpy():
    x = _tensor((3, 4, 5), 2.0)
    ref.assert_close(functional.l2_norm(x), ref.norm(x), "functional.l2_norm")


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("g_scale", [1e-3, 10.0])
def test_larc_gradient_matches_numpy(clip, weight_decay, g_scale):
    w, g = _tensor((6, 3), 2.0), _tensor((6, 3), g_scale)
    got = functional.larc_gradient(
        tf.constant(g), tf.constant(w), 0.1, 0.02, 1e-8, weight_decay, clip
    )
    expected = ref.larc_gradient(w, g, 0.1, 0.02, clip, 1e-8, weight_decay)
    ref.assert_close(got, expected, "functional.larc_gradient")


def test_larc_factor_clip_is_active_only_when_rate_exceeds_adaptive_rate():
    w_norm, lr = tf.constant(10.0), 0.1
    # a = 0.02 * 10 / 1 = 0.2 > lr: clip inactive, factor 1.
    factor, active = functional.larc_factor(w_norm, tf.constant(1.0), lr, 0.02, 0.0, 0.0, True)
    assert bool(active) and float(factor) == 1.0
    # a = 0.02 * 10 / 100 = 0.002 < lr: factor a / lr = 0.02.
    factor, _ = functional.larc_factor(w_norm, tf.constant(100.0), lr, 0.02, 0.0, 0.0, True)
    np.testing.assert_allclose(float(factor), 0.02, rtol=1e-6)


def test_larc_gradient_leaves_zero_norm_variables_unchanged():
    g = _tensor((4,), 1.0)
    zero = np.zeros((4,), np.float32)
    # Zero weights: gradient passes unscaled and undecayed (Apex policy).
    np.testing.assert_array_equal(
        functional.larc_gradient(tf.constant(g), tf.constant(zero), 0.1, 0.02, 1e-8, 0.5, True), g
    )
    # Zero gradient: stays zero, no decay term added.
    np.testing.assert_array_equal(
        functional.larc_gradient(tf.constant(zero), tf.constant(g), 0.1, 0.02, 1e-8, 0.5, True),
        zero,
    )


def test_larc_gradient_with_zero_learning_rate_is_finite():
    g, w = _tensor((4,), 1.0), _tensor((4,), 1.0)
    got = functional.larc_gradient(tf.constant(g), tf.constant(w), 0.0, 0.02, 1e-8, 0.0, True)
    np.testing.assert_allclose(got, g, rtol=1e-6)


@pytest.mark.parametrize("adapt", [True, False])
@pytest.mark.parametrize("weight_decay_rate", [0.0, 0.05])
def test_layerwise_direction_matches_numpy(adapt, weight_decay_rate):
    w, g = _tensor((5, 5), 3.0), _tensor((5, 5), 1e-2)
    got = functional.layerwise_direction(
        tf.constant(g), tf.constant(w), weight_decay_rate, 0.001, adapt
    )
    u = g.astype(np.float64) + weight_decay_rate * w
    trust = 0.001 * ref.norm(w) / ref.norm(u) if adapt else 1.0
    ref.assert_close(got, trust * u, "functional.layerwise_direction")


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_step_matches_numpy(nesterov):
    v, update = _tensor((6,), 1.0), _tensor((6,), 0.5)
    new_v, step = functional.momentum_step(tf.constant(v), tf.constant(update), 0.9, nesterov)
    expected_v = 0.9 * v.astype(np.float64) + update
    expected_step = 0.9 * expected_v + update if nesterov else expected_v
    ref.assert_close(new_v, expected_v, "functional.momentum_step")
    ref.assert_close(step, expected_step, "functional.momentum_step")


@pytest.mark.parametrize("replicas,steps", [(4, 1), (2, 3), (1, 5)])
def test_gradient_moments_undo_keras_scaling(replicas, steps):
    samples = RNG.standard_normal((replicas * steps, 6)).astype(np.float32)
    scaled = samples / replicas  # what each replica's gradient holds
    gbar, s = functional.gradient_moments(
        tf.constant(scaled.sum(0)), tf.constant(np.square(scaled).sum(0)), replicas, steps
    )
    ref.assert_close(gbar, samples.astype(np.float64).mean(0), "functional.gradient_moments")
    ref.assert_close(
        s, np.square(samples.astype(np.float64)).mean(0), "functional.gradient_moments"
    )


def _gsnr_scale(gradient_mean, second_moment, gamma, epsilon):
    """The factor r of docs/algorithms.md §2, as the optimizers compute it
    (without GSNR momentum)."""
    return functional.gsnr_scale(gradient_mean, second_moment, gamma, epsilon).applied


def _moments(samples):
    samples = np.asarray(samples, np.float64)
    return (
        tf.constant(samples.mean(0), tf.float32),
        tf.constant(np.square(samples).mean(0), tf.float32),
    )


def test_gsnr_scale_of_packed_variables_with_momentum_matches_numpy():
    # Three variables packed flat, as the optimizers update their small ones;
    # a few elements without any sample keep their scale and momentum, and
    # the third variable's samples cancel (gbar = 0, s > 0): its layer mean
    # is 0, so its scale is 1 everywhere (docs/algorithms.md §2).
    beta_3, gamma, t = 0.9, 0.2, 3
    cancelling = np.array([1.5, -1.5, 0.5, -0.5, 2.0, -2.0, 1.0, -1.0])[:, None] * [1.0, 2.0, 3.0]
    samples = [RNG.standard_normal((8, 5, 7)) + 0.7, RNG.standard_normal((8, 4)) - 0.3, cancelling]
    samples[0][:, 1, 2:5] = 0.0
    samples[1][:, 3] = 0.0
    previous_scale = [RNG.uniform(0.2, 1.0, x.shape[1:]) for x in samples]
    previous_momentum = [RNG.uniform(0.0, 0.5, x.shape[1:]) for x in samples]
    moments = [_moments(x) for x in samples]
    flat = lambda tensors: tf.concat([tf.reshape(tf.cast(x, tf.float32), [-1]) for x in tensors], 0)
    sizes = [35, 4, 3]
    got = functional.gsnr_scale(
        flat([m for m, _ in moments]),
        flat([s for _, s in moments]),
        gamma,
        1e-6,
        beta_3=beta_3,
        correction=functional.gsnr_momentum_correction(beta_3, t),
        previous_scale=flat(previous_scale),
        previous_momentum=flat(previous_momentum),
        segments=(tf.constant(np.repeat([0, 1, 2], sizes)), sizes),
        statistics=True,
    )
    expected = {"scale": [], "momentum": [], "applied": []}
    statistics = []
    for x, scale, momentum in zip(samples, previous_scale, previous_momentum):
        r, _ = ref.gsnr_scale(x, gamma)
        has = ref.measured(x)
        r = np.where(has, r, scale)
        p = np.where(has, beta_3 * momentum + (1 - beta_3) * r, momentum)
        for name, value in (("scale", r), ("momentum", p), ("applied", p / (1 - beta_3**t))):
            expected[name].append(value.reshape(-1))
        statistics.append(ref.gsnr_statistics(x, gamma, p / (1 - beta_3**t)))
    np.testing.assert_array_equal(expected["scale"][2], 1.0)
    for name, values in expected.items():
        ref.assert_close(getattr(got, name), np.concatenate(values), f"gsnr_scale {name}")
    # Statistics: each column of each variable's row, over its measured
    # elements (the inputs put elements at both bounds).
    statistics = np.array(statistics)
    assert np.all(statistics[:2, 1:3] > 0), statistics
    for column in range(statistics.shape[1]):
        ref.assert_close(
            got.statistics[:, column], statistics[:, column], "gsnr_scale statistics", rtol=2e-6
        )


def test_segment_normalized_clipped_gsnr_of_every_element_matches_numpy():
    # Without a `measured` mask, every element counts: variable j's mean is
    # over all its sizes[j] elements, zeros included.
    gamma, sizes = 0.3, [6, 3, 4]
    gsnr = [RNG.uniform(0.0, 2.0, n) for n in sizes]
    gsnr[1][:] = 0.0
    gsnr[2][:2] = 0.0
    ids = tf.constant(np.repeat(np.arange(len(sizes)), sizes))
    scale, means, counts = functional.segment_normalized_clipped_gsnr(
        tf.constant(np.concatenate(gsnr), tf.float32), ids, sizes, gamma
    )
    expected_means = [x.mean() for x in gsnr]
    expected = [
        np.clip(x / m, gamma, 1.0) if m > 0 else np.ones_like(x)
        for x, m in zip(gsnr, expected_means)
    ]
    np.testing.assert_array_equal(counts, sizes)
    ref.assert_close(means, expected_means, "segment layer means")
    ref.assert_close(scale, np.concatenate(expected), "segment normalised GSNR")


def test_gsnr_scale_of_table_rows_counts_each_rows_updates():
    # Rows of a table: each row's bias correction counts the GSNR updates in
    # which it had a sample (docs/algorithms.md §3); row 2 has none now.
    beta_3, gamma = 0.9, 0.1
    samples = RNG.standard_normal((4, 5, 3)) + 0.5
    samples[:, 2] = 0.0
    previous_counts = np.array([0.0, 1.0, 2.0, 0.0, 5.0])
    previous_momentum = RNG.uniform(0.0, 0.5, (5, 3)) * (previous_counts > 0)[:, None]
    got = functional.gsnr_scale(
        *_moments(samples),
        gamma,
        1e-6,
        beta_3=beta_3,
        previous_momentum=tf.constant(previous_momentum, tf.float32),
        previous_row_updates=tf.constant(previous_counts, tf.float32),
    )
    r, _ = ref.gsnr_scale(samples, gamma)
    has = ref.measured(samples)
    counts = previous_counts + has.any(axis=1)
    p = np.where(has, beta_3 * previous_momentum + (1 - beta_3) * r, previous_momentum)
    ref.assert_close(got.row_updates, counts, "gsnr_scale row counts")
    ref.assert_close(got.momentum, p, "gsnr_scale row momentum")
    sampled = counts > 0
    ref.assert_close(
        tf.boolean_mask(got.applied, sampled),
        (p / (1 - beta_3 ** counts[:, None]))[sampled],
        "gsnr_scale row factor",
    )


@pytest.mark.parametrize("gamma", [0.1, 0.5, 1.0])
def test_gsnr_scale_matches_numpy(gamma):
    samples = RNG.standard_normal((8, 5, 7)) + RNG.standard_normal((5, 7)) * 1.5
    samples[:, 0, 0] = 0.0  # s == 0: no GSNR, out of the layer mean; clipped to gamma
    mean, second = samples.mean(0), np.square(samples).mean(0)
    new = functional.gsnr_scale(
        tf.constant(mean, tf.float32), tf.constant(second, tf.float32), gamma, 1e-6, statistics=True
    )
    expected, _ = ref.gsnr_scale(samples, gamma)
    ref.assert_close(new.applied, expected, "functional GSNR scale", rtol=5e-5)
    # The statistics row, column by column (with gamma = 1 every measured
    # element is at both bounds).
    statistics = ref.gsnr_statistics(samples, gamma, expected)
    for column, value in enumerate(statistics):
        ref.assert_close(new.statistics[column], value, "functional GSNR statistics", rtol=2e-6)
    assert float(new.applied[0, 0]) == np.float32(gamma)
    if gamma < 1:  # the inputs exercise both clip bounds
        assert np.any(expected == gamma) and np.any(expected == 1.0)


@pytest.mark.parametrize("unmeasured", ["none", "zero", "square overflow", "inf", "nan"])
@pytest.mark.parametrize("compiled", ["eager", "graph", "xla"])
def test_measured_mean_gsnr_is_the_mean_over_the_measured_elements(unmeasured, compiled):
    samples = RNG.standard_normal((4, 6, 5)) + 0.7
    mean = samples.mean(0).astype(np.float32)
    second = np.square(samples).mean(0).astype(np.float32)
    if unmeasured == "zero":
        mean[1, 2], second[1, 2] = 0.0, 0.0
        mean[4, 0], second[4, 0] = 0.0, 0.0
    elif unmeasured == "square overflow":  # samples +-1e20: mean 0, s = Inf in float32
        mean[2, 3], second[2, 3] = 0.0, np.inf
    elif unmeasured == "inf":
        mean[0, 1], second[0, 1] = np.inf, np.inf
    elif unmeasured == "nan":
        mean[3, 3], second[3, 3] = np.nan, np.nan
    # numpy: raw GSNR over the finite s > 0, in float64.
    with np.errstate(invalid="ignore"):
        measured = (second > 0) & np.isfinite(second)
    m, s = mean[measured].astype(np.float64), second[measured].astype(np.float64)
    expected = np.mean(m**2 / np.maximum(s - m**2, 1e-6 * s))
    assert measured.sum() == 30 - {"none": 0, "zero": 2}.get(unmeasured, 1)

    function = functional.measured_mean_gsnr
    if compiled != "eager":
        function = tf.function(function, jit_compile=compiled == "xla")
    got = function(tf.constant(mean), tf.constant(second), 1e-6)
    ref.assert_close(got, expected, f"measured_mean_gsnr ({unmeasured}, {compiled})", rtol=1e-5)


@pytest.mark.parametrize("compiled", ["graph", "xla"])
@pytest.mark.parametrize("spoiled", [None, 1])
@pytest.mark.parametrize("in_branch", [False, True], ids=["moments", "moments_in_branch"])
def test_measured_mean_gsnrs_give_each_variable_its_own_mean(compiled, spoiled, in_branch):
    """Several variables under one conditional: whether or not one of them
    has an unmeasured element (which sends all to the masked branch), each
    mean is that variable's own over its measured elements. With
    `moments_in_branch` the masked branch makes the pairs again from what
    they were made of (here s = 4 * S2, as `gradient_moments` does)."""
    shapes = [(7,), (3, 4), (2, 2, 5)]
    moments, expected = [], []
    for v, shape in enumerate(shapes):
        samples = RNG.standard_normal((4, *shape)) + 0.5
        mean = samples.mean(0).astype(np.float32)
        second = np.square(samples).mean(0).astype(np.float32)
        if v == spoiled:
            mean.flat[2], second.flat[2] = np.nan, np.nan
            mean.flat[5], second.flat[5] = 0.0, 0.0
        with np.errstate(invalid="ignore"):
            measured = (second > 0) & np.isfinite(second)
        m, s = mean[measured].astype(np.float64), second[measured].astype(np.float64)
        expected.append(np.mean(m**2 / np.maximum(s - m**2, 1e-6 * s)))
        moments.append((tf.constant(mean), tf.constant(second)))

    def means(pairs):
        if not in_branch:
            return functional.measured_mean_gsnrs(pairs, 1e-6)

        def from_sums():
            return [(mean, 4.0 * quarter) for mean, quarter in pairs]

        return functional.measured_mean_gsnrs(from_sums(), 1e-6, moments_in_branch=from_sums)

    if in_branch:  # the inputs hold S2 = s / 4
        moments = [(mean, second / 4.0) for mean, second in moments]
    got = tf.function(means, jit_compile=compiled == "xla")(moments)
    assert len(got) == len(shapes)
    for v, (value, want) in enumerate(zip(got, expected)):
        ref.assert_close(value, want, f"variable {v} (spoiled {spoiled}, {compiled})", rtol=1e-5)


def test_measured_mean_gsnr_of_nothing_measured_is_zero():
    zeros = tf.zeros((3, 2))
    assert float(functional.measured_mean_gsnr(zeros, zeros, 1e-6)) == 0.0
    empty = tf.zeros((0, 4))
    assert float(functional.measured_mean_gsnr(empty, empty, 1e-6)) == 0.0


def test_where_measured_selects_and_its_mean_ignores_nan_outside():
    # NaN and Inf outside the measured elements must not leak into the
    # result (a product by the mask would give NaN * 0 = NaN).
    values = np.array([[1.5, np.nan, -2.0], [np.inf, 4.0, 0.5]], np.float32)
    measured = np.isfinite(values) & (values != 0.5)
    got = functional.where_measured(tf.constant(measured), tf.constant(values))
    np.testing.assert_array_equal(got, np.where(measured, values, 0.0))
    mean = functional.mean_where_measured(tf.constant(measured), tf.constant(values))
    np.testing.assert_allclose(float(mean), values[measured].mean(), rtol=1e-6)
    nothing = tf.zeros((2, 3), tf.bool)
    assert float(functional.mean_where_measured(nothing, tf.constant(values))) == 0.0


def test_gsnr_of_identical_samples_is_one_and_finite():
    sample = RNG.standard_normal((4, 3)).astype(np.float32)
    mean = tf.constant(sample)
    second = tf.square(mean)  # k identical samples: var = 0 up to round-off
    got = _gsnr_scale(mean, second, 0.1, 1e-6)
    np.testing.assert_allclose(got, np.ones((4, 3)), rtol=1e-6)


def test_gsnr_is_invariant_to_scaling_all_samples():
    samples = RNG.standard_normal((6, 10)) + 0.5
    base = ref.gsnr_scale(samples, 0.1)[0]
    for c in (1e-3, 7.0):
        scaled = samples * c
        got = _gsnr_scale(
            tf.constant(scaled.mean(0), tf.float32),
            tf.constant(np.square(scaled).mean(0), tf.float32),
            0.1,
            1e-6,
        )
        ref.assert_close(got, base, "functional GSNR scale invariance", rtol=5e-5)


def test_zero_gradient_layer_gives_scale_one():
    zeros = tf.zeros((3, 3))
    # docs/algorithms.md §2: raw GSNR 0 everywhere, layer mean 0, r_n = 1.
    np.testing.assert_array_equal(_gsnr_scale(zeros, zeros, 0.1, 1e-6), np.ones((3, 3)))


@pytest.mark.parametrize("beta_3", [0.0, 0.9])
def test_gsnr_momentum_matches_numpy(beta_3):
    p = np.zeros(5)
    p_tf = tf.zeros(5)
    for t in range(1, 5):
        r = RNG.uniform(0.1, 1.0, 5)
        p = beta_3 * p + (1 - beta_3) * r
        p_tf, phat = functional.gsnr_momentum(p_tf, tf.constant(r, tf.float32), beta_3, t)
        ref.assert_close(phat, p / (1 - beta_3**t), "functional.gsnr_momentum")


def test_adam_direction_matches_numpy():
    m, v, g = np.zeros(6), np.zeros(6), RNG.standard_normal(6)
    _, _, direction = functional.adam_direction(
        tf.zeros(6), tf.zeros(6), tf.constant(g, tf.float32), 0.9, 0.999, 1e-6, 1.0
    )
    m = 0.1 * g
    v = 0.001 * g * g
    expected = (m / 0.1) / (np.sqrt(v / 0.001) + 1e-6)
    ref.assert_close(direction, expected, "functional.adam_direction")
