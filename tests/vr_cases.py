"""The VR optimizers under test with their numpy references (`CASES`),
the per-variable gradient scales of their streams, and the fixture that
picks the update path (fused XLA program, packed small variables, or both)
that the tests of `test_vr` and `test_gsnr_interval` run on."""

from collections.abc import Callable
import dataclasses

import pytest

from tests import references as ref
import tf_vrgd
from tf_vrgd import _gsnr_layout

SCALES = [1e-2, 1.0, 5e-2, 0.3]
# Size limits of the packed update path (tf_vrgd._gsnr_layout.PACKED_MAX_ELEMENTS)
# on the test model's variables of 48, 6, 18 and 3 elements.
PACKING = {"packed": 2**14, "mixed": 10, "fused": -1}


@pytest.fixture(autouse=True)
def update_path(request, monkeypatch):
    """Both update paths in every test here: the kernels (48 and 18
    elements) in the fused XLA program, the biases packed; tests
    parametrized on `path` choose."""
    path = (
        request.node.callspec.params.get("path", "mixed")
        if hasattr(request.node, "callspec")
        else "mixed"
    )
    monkeypatch.setattr(_gsnr_layout, "PACKED_MAX_ELEMENTS", PACKING[path])
    return path


@dataclasses.dataclass(frozen=True)
class Case:
    """A VR optimizer under test and its numpy reference: `make(**extra)`
    builds the optimizer; `rule` is the base rule applied to ghat."""

    make: Callable
    rule: ref.Rule
    beta_3: float
    gamma: float = 0.1


EXCLUDE_BIASES = [True, False, True, False]  # kernels decay and adapt, biases not
CASES = {
    "VR-SGD": Case(lambda **k: tf_vrgd.VRSGD(0.5, **k), ref.sgd(0.5), beta_3=0.0),
    "VR-Momentum": Case(lambda **k: tf_vrgd.VRSGD(0.5, momentum=0.9, **k), ref.sgd(0.5, 0.9), 0.0),
    # With Keras' decoupled weight decay, which the base rule applies.
    "VR-Momentum nesterov beta_3 weight_decay": Case(
        lambda **k: tf_vrgd.VRSGD(
            0.5, momentum=0.9, nesterov=True, beta_3=0.5, weight_decay=0.01, **k
        ),
        ref.sgd(0.5, 0.9, nesterov=True, weight_decay=0.01),
        beta_3=0.5,
    ),
    "VR-Adam": Case(lambda **k: tf_vrgd.VRAdam(0.05, **k), ref.adam(0.05), beta_3=0.9),
    "VR-LARS": Case(
        lambda **k: tf_vrgd.VRLARS(
            2.0,
            trust_coefficient=0.01,
            weight_decay_rate=0.01,
            exclude_from_weight_decay=["bias"],
            **k,
        ),
        ref.lars(2.0, decays=EXCLUDE_BIASES, trust_coefficient=0.01, weight_decay_rate=0.01),
        beta_3=0.0,
    ),
    "VR-LAMB": Case(
        lambda **k: tf_vrgd.VRLAMB(
            0.05, weight_decay_rate=0.01, exclude_from_weight_decay=["bias"], **k
        ),
        ref.lamb(0.05, decays=EXCLUDE_BIASES, weight_decay_rate=0.01),
        beta_3=0.9,
    ),
}
