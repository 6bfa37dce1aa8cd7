"""A non-finite element in one replica's gradient spoils that element only
(as in Keras' own optimizers), not its whole variable through the layer
mean of the GSNR (docs/algorithms.md §2)."""

import keras
import numpy as np
import pytest

from tests import helpers
from tests import references as ref
import tf_vrgd

# A variable of the fused XLA program (over 2^14 elements) and one of the
# packed small ones.
SHAPES = [(150, 120), (7, 5)]
POISONED = [((3, 4), np.nan), ((2, 1), np.inf)]
CASES = {
    "VR-SGD": (lambda: tf_vrgd.VRSGD(0.5), lambda: keras.optimizers.SGD(0.5), ref.sgd(0.5), 0.0),
    "VR-Adam": (
        lambda: tf_vrgd.VRAdam(0.01),
        lambda: keras.optimizers.Adam(0.01),
        ref.adam(0.01),
        0.9,
    ),
}


def _stream():
    """Three updates on 4 replicas; replica 2's gradient at the second
    update holds a NaN in the large variable and an Inf in the small one."""
    stream = helpers.gradient_stream(SHAPES, steps=3, replicas=4, scales=[2.0, 0.3], seed=4)
    for variable, (element, value) in enumerate(POISONED):
        stream[1][2][variable][element] = value
    return stream


def _run(strategy, make_optimizer, stream):
    rng = np.random.default_rng(0)
    initial = [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]
    with strategy.scope():
        variables = [keras.Variable(w) for w in initial]
        optimizer = make_optimizer()
    helpers.apply_stream_mirrored(strategy, optimizer, variables, stream)
    return initial, [v.numpy() for v in variables], optimizer


@pytest.mark.parametrize("name", CASES)
def test_a_non_finite_element_spoils_that_element_only(strategy, name):
    make_vr, make_base, rule, beta_3 = CASES[name]
    stream = _stream()
    initial, got, optimizer = _run(strategy, make_vr, stream)
    _, base, _ = _run(strategy, make_base, stream)
    reference = ref.VRReference(initial, rule, 0.1, beta_3)
    with np.errstate(invalid="ignore", over="ignore"):
        for update in helpers.samples_per_update(stream, 1):
            expected = reference.update(update)
    for variable, (element, _) in enumerate(POISONED):
        spoiled = ~np.isfinite(got[variable])
        # Where Keras' own optimizer leaves the damage: that element alone.
        np.testing.assert_array_equal(spoiled, ~np.isfinite(base[variable]))
        assert spoiled[element] and spoiled.sum() == 1, np.argwhere(spoiled)
        ref.assert_close(
            got[variable][~spoiled],
            expected[variable][~spoiled],
            f"{name} with a non-finite sample, finite elements",
            rtol=1e-4,
            start=initial[variable][~spoiled],
        )
    # The optimizer's state too: at most the poisoned element of each slot.
    for slot in optimizer.variables:
        value = np.asarray(slot.numpy())
        if value.shape in SHAPES:
            assert (~np.isfinite(value)).sum() <= 1, slot.path
