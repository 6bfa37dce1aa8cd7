"""MirroredStrategy over four logical CPUs, different data on each replica.

The references are computed on the mean of the per-replica gradients: an
implementation that took norms on a replica's partial gradient (before the
all-reduce) fails these tests.
"""

import keras
import numpy as np
import pytest

from tests import helpers
from tests import references as ref
import tf_vrgd

STEPS = 5
SCALES = [1e-2, 5.0, 0.05, 0.3]


def _stream(replicas):
    shapes = helpers.model_shapes()
    return helpers.gradient_stream(shapes, STEPS, replicas=replicas, scales=SCALES, seed=7)


def test_lars_under_mirrored_strategy_uses_reduced_gradient(strategy):
    stream = _stream(strategy.num_replicas_in_sync)
    hyper = dict(momentum=0.9, trust_coefficient=0.01, weight_decay_rate=0.01)
    initial, got, optimizer = helpers.run_mirrored(
        strategy, lambda: tf_vrgd.LARS(0.5, exclude_from_weight_decay=["bias"], **hyper), stream
    )
    decays = [True, False, True, False]
    expected = ref.run_lars(
        initial, helpers.mean_over_replicas(stream), 0.5, decays=decays, adapts=decays, **hyper
    )
    ref.assert_all_close(got, expected, "LARS (4 replicas)", start=initial)
    assert int(optimizer.iterations.numpy()) == STEPS


@pytest.mark.parametrize("clip", [True, False])
def test_larc_under_mirrored_strategy_uses_reduced_gradient(strategy, clip):
    stream = _stream(strategy.num_replicas_in_sync)
    larc = dict(clip=clip, weight_decay=0.01)
    initial, got, optimizer = helpers.run_mirrored(
        strategy, lambda: tf_vrgd.LARC(keras.optimizers.SGD(0.1, momentum=0.9), **larc), stream
    )
    expected = ref.run_larc_sgd(
        initial, helpers.mean_over_replicas(stream), 0.1, momentum=0.9, **larc
    )
    ref.assert_all_close(got, expected, "LARC(SGD) (4 replicas)", start=initial)
    assert int(optimizer.iterations.numpy()) == STEPS


def test_partial_gradient_norms_would_differ(strategy):
    # The check above is only meaningful if norms of the per-replica partial
    # gradients g_d / R give another LARC factor than the reduced gradient.
    stream = _stream(strategy.num_replicas_in_sync)
    w = helpers.make_model().get_weights()
    replicas = strategy.num_replicas_in_sync
    errors = []
    for i, wi in enumerate(w):
        reduced = ref.larc_gradient(wi, np.mean([r[i] for r in stream[0]], axis=0), 0.1)
        partial = sum(ref.larc_gradient(wi, r[i] / replicas, 0.1) for r in stream[0])
        errors.append(ref.relative_error(partial, reduced))
    assert max(errors) > 0.1, errors


def _classification_data(n=512, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int32) + (x[:, 2] > 1).astype(np.int32)
    return x, y


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda: tf_vrgd.LARS(1.0, momentum=0.9, trust_coefficient=0.02),
        lambda: tf_vrgd.LARC(keras.optimizers.SGD(0.5, momentum=0.9)),
    ],
    ids=["LARS", "LARC(SGD)"],
)
def test_fit_under_mirrored_strategy_trains(strategy, make_optimizer):
    x, y = _classification_data()
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)]
        )
        model.compile(
            optimizer=make_optimizer(),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    history = model.fit(x, y, batch_size=64, epochs=6, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.8 * losses[0], losses
