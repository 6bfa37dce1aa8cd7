"""LARC against its numpy reference (docs/algorithms.md §5, Apex semantics)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests import references as ref
import tf_vrgd

STEPS = 6
LR = 0.1
# dense/kernel: ||w|| ~ 20, ||g|| ~ 0.07: a >> lr, clip inactive (f = 1).
# dense/bias: ||w|| ~ 1.2, ||g|| ~ 12: a ~ 0.002 << lr, clip active.
# head/*: in between; the trust ratio moves across lr over the steps.
SCALES = [1e-2, 5.0, 0.05, 0.3]


def reference_larc_adam(weights, stream, lr, **larc):
    return ref.run(weights, ref.larc(ref.adam(lr), lr, **larc), stream)


def _run(optimizer, stream, compiled=False):
    model = helpers.make_model()
    initial = model.get_weights()
    helpers.apply_stream(optimizer, model.trainable_variables, [[s] for s in stream], compiled)
    return initial, model.get_weights()


def _stream(seed=1):
    return [
        s[0]
        for s in helpers.gradient_stream(helpers.model_shapes(), STEPS, scales=SCALES, seed=seed)
    ]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize(
    "larc,sgd",
    [
        (dict(clip=True), dict(momentum=0.0)),
        (dict(clip=True, trust_coefficient=0.002), dict(momentum=0.9)),
        (dict(clip=False), dict(momentum=0.9, nesterov=True)),
        (dict(clip=True, weight_decay=0.01), dict(momentum=0.9)),
        (dict(clip=False, weight_decay=0.01, epsilon=0.0), dict(momentum=0.0)),
        # Gradient norms of 0.06 to 8: epsilon moves every factor, by up
        # to 14%.
        (dict(clip=False, epsilon=0.01), dict(momentum=0.9)),
    ],
    ids=["clip", "clip-momentum", "scaling-nesterov", "clip-decay", "scaling-decay", "epsilon"],
)
def test_larc_sgd_matches_reference(larc, sgd, compiled):
    stream = _stream()
    optimizer = tf_vrgd.LARC(keras.optimizers.SGD(LR, **sgd), **larc)
    initial, got = _run(optimizer, stream, compiled)
    expected = ref.run_larc_sgd(initial, stream, LR, **sgd, **larc)
    # Updates of up to 1e-3 of the weights: float32 round-off of the
    # weights is up to 6e-5 of the update.
    ref.assert_all_close(got, expected, "LARC(SGD)", rtol=2e-4, start=initial)


def test_clip_is_active_on_some_variables_and_inactive_on_others():
    # Guards the reference tests above against inputs where the rule is inert.
    w = helpers.make_model().get_weights()
    g = _stream()[0]
    factors = [min(0.02 * ref.norm(wi) / (ref.norm(gi) + 1e-8) / LR, 1.0) for wi, gi in zip(w, g)]
    assert factors[0] == 1.0 and factors[1] < 0.1


def test_larc_adam_matches_reference():
    stream = _stream()
    optimizer = tf_vrgd.LARC(keras.optimizers.Adam(LR), trust_coefficient=0.01)
    initial, got = _run(optimizer, stream)
    expected = reference_larc_adam(initial, stream, LR, trust_coefficient=0.01)
    ref.assert_all_close(got, expected, "LARC(Adam)", start=initial)


def test_larc_uses_the_inner_learning_rate_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(LR, decay_steps=1, decay_rate=0.5)
    stream = _stream()
    optimizer = tf_vrgd.LARC(keras.optimizers.SGD(schedule))
    model = helpers.make_model()
    # Update t (from 1) runs at the schedule's step t - 1.
    rate = lambda t: LR * 0.5 ** (t - 1)
    rule = ref.Rule(lambda i, w, g, slots, t: (w - rate(t) * g, slots), 0)
    initial = model.get_weights()
    weights = ref.run(initial, ref.larc(rule, rate), stream)
    helpers.apply_stream(optimizer, model.trainable_variables, [[s] for s in stream])
    ref.assert_all_close(
        model.get_weights(), weights, "LARC(SGD) schedule", rtol=4e-4, start=initial
    )


def test_larc_wraps_lars():
    """LARS' trust ratio cancels a scalar factor of its gradient unless it
    decays the weights: with decay, ``(f g + d w) / |f g + d w|`` depends on
    LARC's factor f, so the updates show it."""
    stream = _stream()
    lars = dict(momentum=0.9, trust_coefficient=0.01, weight_decay_rate=0.5)
    optimizer = tf_vrgd.LARC(tf_vrgd.LARS(LR, **lars))
    initial, got = _run(optimizer, stream)
    weights = ref.run(initial, ref.larc(ref.lars(LR, **lars), LR), stream)
    ref.assert_all_close(got, weights, "LARC(LARS)", start=initial)
    # The same LARS without LARC ends elsewhere (by more than the tolerance).
    alone = ref.run(initial, ref.lars(LR, **lars), stream)
    assert max(ref.relative_error(a - w, e - w) for a, e, w in zip(alone, weights, initial)) > 0.01


def test_zero_norm_policies_and_none_gradients():
    zero_w = keras.Variable(np.zeros((3,), np.float32))
    zero_g = keras.Variable(np.full((3,), 2.0, np.float32))
    missing = keras.Variable(np.ones((3,), np.float32))
    optimizer = tf_vrgd.LARC(keras.optimizers.SGD(LR), weight_decay=0.5)
    g = np.array([1.0, -2.0, 0.5], np.float32)
    with pytest.warns(UserWarning, match="Gradients do not exist"):
        optimizer.apply([tf.constant(g), tf.zeros((3,)), None], [zero_w, zero_g, missing])
    # Zero weights: unscaled gradient, no decay term.
    np.testing.assert_allclose(zero_w.numpy(), -LR * g, rtol=1e-6)
    # Zero gradient: no decay either, weights stay.
    np.testing.assert_array_equal(zero_g.numpy(), np.full(3, 2.0))
    np.testing.assert_array_equal(missing.numpy(), np.ones(3))


def test_larc_exposes_the_inner_optimizer_state():
    inner = keras.optimizers.SGD(0.05, momentum=0.9)
    optimizer = tf_vrgd.LARC(inner)
    model = helpers.make_model()
    optimizer.build(model.trainable_variables)
    assert optimizer.inner_optimizer is inner
    assert [v.path for v in optimizer.variables] == [v.path for v in inner.variables]
    assert len(optimizer.variables) == 2 + 4  # iteration, learning rate, 4 momenta
    np.testing.assert_allclose(float(optimizer.learning_rate), 0.05)
    optimizer.learning_rate = 0.01
    np.testing.assert_allclose(float(inner.learning_rate), 0.01)
    helpers.apply_stream(optimizer, model.trainable_variables, [[s] for s in _stream()[:3]])
    assert int(optimizer.iterations) == 3 == int(inner.iterations)


@pytest.mark.parametrize(
    "make,argument",
    [
        (lambda: tf_vrgd.LARC("sgd"), "optimizer"),
        (lambda: tf_vrgd.LARC(keras.optimizers.SGD(), trust_coefficient=0.0), "trust_coefficient"),
        (lambda: tf_vrgd.LARC(keras.optimizers.SGD(), epsilon=-1e-8), "epsilon"),
        (lambda: tf_vrgd.LARC(keras.optimizers.SGD(), weight_decay=-0.1), "weight_decay"),
        (lambda: tf_vrgd.LARC(keras.optimizers.SGD(), clip=1), "clip"),
        (lambda: tf_vrgd.LARC(tf_vrgd.LARC(keras.optimizers.SGD())), "optimizer"),
        (
            lambda: tf_vrgd.LARC(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())),
            "optimizer",
        ),
    ],
)
def test_bad_arguments_raise(make, argument):
    with pytest.raises(ValueError, match=f"`{argument}`.*Received: {argument}="):
        make()
