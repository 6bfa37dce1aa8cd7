"""`import tf_vrgd.model_garden` registers the VR types in Model Garden's
optimizer factory: the optimization block of every shipped VR config, built
by Model Garden's own `OptimizerFactory`, is the optimizer that
`tf_vrgd.config.optimizer_from_config` builds from it (the same arguments
and the same learning rate along the schedule)."""

import glob
import os

import numpy as np
import pytest

pytest.importorskip("tf_keras")
pytest.importorskip("official")

from official.modeling.optimization import optimizer_factory
import tensorflow as tf

from tests import helpers
from tests import references as ref
import tf_vrgd
from tf_vrgd import config
import tf_vrgd.model_garden as model_garden

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VR_CONFIGS = sorted(
    path
    for path in glob.glob(os.path.join(ROOT, "configs", "*", "*.yaml"))
    if config.optimization_block(path)["optimizer"]["type"] in model_garden.VR_TYPES
)


def _model_garden_optimizer(block):
    factory = optimizer_factory.OptimizerFactory(model_garden.OptimizationConfig(block))
    return factory.build_optimizer(factory.build_learning_rate())


def test_every_vr_type_is_registered_and_the_configs_use_them():
    for kind in model_garden.VR_TYPES:
        assert optimizer_factory.LEGACY_OPTIMIZERS_CLS[kind].__module__.startswith("tf_vrgd")
    # lars and lamb stay Model Garden's own.
    assert not optimizer_factory.LEGACY_OPTIMIZERS_CLS["lars"].__module__.startswith("tf_vrgd")
    assert len(VR_CONFIGS) > 40


@pytest.mark.parametrize("path", VR_CONFIGS, ids=os.path.basename)
def test_a_shipped_vr_config_builds_the_same_optimizer_in_model_garden(path):
    block = config.optimization_block(path)
    face = _model_garden_optimizer(block)
    ours = config.optimizer_from_config(block)
    got, expected = face.keras_optimizer.get_config(), ours.get_config()
    for key in ("learning_rate", "name"):
        got.pop(key), expected.pop(key)
    assert got == expected
    # The rate along the schedule: Model Garden's tf_keras schedule read at
    # the face's update count, ours at the Keras 3 optimizer's.
    accumulation = ours.gradient_accumulation_steps or 1
    total = int(config.load(path)["trainer"]["train_steps"])
    for update in np.linspace(0, total, 7).astype(int):
        for optimizer in (face.keras_optimizer, ours):
            counter = next(v for v in optimizer.variables if v.path.endswith("/iteration"))
            counter.assign(update * accumulation)  # micro-steps
        np.testing.assert_allclose(
            float(face.keras_optimizer.learning_rate),
            float(ours.learning_rate),
            rtol=1e-5,
            atol=1e-9,
            err_msg=f"update {update}",
        )


@pytest.mark.parametrize("inner", ["vr_sgd", "sgd", "lamb"])
def test_a_larc_block_builds_the_same_optimizer_in_model_garden(inner):
    """`larc` around a VR type or one of Model Garden's own types (built by
    the package as `tf_vrgd.config` reads them)."""
    fields = {"momentum": 0.9} if "sgd" in inner else {"weight_decay_rate": 0.01}
    block = {
        "optimizer": {
            "type": "larc",
            "larc": {
                "trust_coefficient": 0.01,
                "clip": False,
                "optimizer": {"type": inner, inner: fields},
            },
        },
        "learning_rate": {"type": "constant", "constant": {"learning_rate": 0.1}},
    }
    face = _model_garden_optimizer(block)
    ours = config.optimizer_from_config(block)
    got, expected = face.keras_optimizer.get_config(), ours.get_config()
    got_inner, expected_inner = got.pop("optimizer"), expected.pop("optimizer")
    got.pop("name"), expected.pop("name")
    assert got == expected
    assert got_inner["class_name"] == expected_inner["class_name"]
    got_inner, expected_inner = got_inner["config"], expected_inner["config"]
    for key in ("learning_rate", "name"):
        got_inner.pop(key), expected_inner.pop(key)
    assert got_inner == expected_inner
    assert float(face.keras_optimizer.learning_rate) == pytest.approx(0.1)


def test_delayed_polynomial_is_a_model_garden_schedule():
    """The package's `delayed_polynomial` (the DLRM files' schedule) built
    by Model Garden's factory under its own linear warm-up: NVIDIA's DLRM
    schedule, against numpy."""
    path = os.path.join(ROOT, "configs", "paper", "dlrm_sgd_64k.yaml")
    block = config.optimization_block(path)
    table = optimizer_factory.LR_CLS
    assert (
        table["delayed_polynomial"] is model_garden.registration.ModelGardenDelayedPolynomialDecay
    )
    schedule = optimizer_factory.OptimizerFactory(
        model_garden.OptimizationConfig(block)
    ).build_learning_rate()
    steps = np.array([0, 1, 4001, 8002, 20000, 47999, 48000, 54000, 60000, 64014, 80000])
    peak = 16.0
    expected = np.where(
        steps < 8002,
        peak * steps / 8002,
        peak * (1 - np.clip(steps - 48000, 0, 24000) / 24000) ** 2,
    )
    np.testing.assert_allclose([float(schedule(s)) for s in steps], expected, rtol=1e-5, atol=1e-9)
    fields = schedule.get_config()["after_warmup_lr_sched"]
    assert fields["decay_start_steps"] == 48000 and fields["power"] == 2.0


def test_an_adascale_block_trains_in_model_garden_as_the_package_builds_it(strategy):
    """`adascale` around Model Garden's `sgd`, under a stepwise schedule:
    the face reads Model Garden's tf_keras schedule at floor(tau), as the
    package's Keras 3 AdaScale reads its own (against numpy in
    tests/test_adascale.py); the same updates on 4 replicas."""
    block = {
        "optimizer": {
            "type": "adascale",
            "adascale": {"decay": 0.5, "optimizer": {"type": "sgd", "sgd": {"momentum": 0.9}}},
        },
        "learning_rate": {
            "type": "stepwise",
            "stepwise": {"boundaries": [3, 7], "values": [0.1, 0.05, 0.02]},
        },
    }
    stream = helpers.model_stream(10, 4, [1e-2, 1.0, 5e-2, 0.3], seed=71)
    with strategy.scope():
        face = _model_garden_optimizer(block)
        variables = [tf.Variable(w) for w in helpers.make_model().get_weights()]
    assert isinstance(face.keras_optimizer, tf_vrgd.AdaScale)
    helpers.apply_gradients_mirrored(strategy, face, variables, stream)
    initial, expected, ours = helpers.run_mirrored(
        strategy, lambda: config.optimizer_from_config(block), stream
    )
    # The gains took tau past both boundaries well before update 7.
    assert ours.scale_invariant_steps > 14
    ref.assert_all_close(
        [v.numpy() for v in variables], expected, "adascale in Model Garden", start=initial
    )
    assert face.keras_optimizer.scale_invariant_steps == pytest.approx(ours.scale_invariant_steps)


def test_an_adascale_block_under_tf_keras_loss_scaling_skips_an_overflow_everywhere(strategy):
    """The `adascale` face in tf_keras' LossScaleOptimizer (Model Garden's
    trainer under float16): finite gradients update as the face alone, with
    the same tau; an Inf in one replica's gradient skips the update on every
    replica and moves neither the weights nor any of AdaScale's state (the
    gain, tau, the averages, the inner momentum)."""
    block = {
        "optimizer": {
            "type": "adascale",
            "adascale": {"decay": 0.5, "optimizer": {"type": "sgd", "sgd": {"momentum": 0.9}}},
        },
        "learning_rate": {"type": "constant", "constant": {"learning_rate": 0.05}},
    }
    stream = helpers.model_stream(4, 4, [1e-2, 1.0, 5e-2, 0.3], seed=72)
    alone = []

    def make():
        alone.append(_model_garden_optimizer(block))
        return alone[-1]

    def state(wrapped):
        # tf_keras counts a skipped step (as Model Garden's global step
        # does): every other variable must hold still.
        variables = wrapped.inner_optimizer.keras_optimizer.variables
        kept = [v.value for v in variables if not v.path.endswith("/iteration")]
        assert len(kept) == len(variables) - 1
        return kept

    wrapped = helpers.assert_tf_keras_loss_scale_skips_an_overflow(
        strategy,
        make,
        helpers.make_model().get_weights(),
        stream,
        "adascale face in a LossScaleOptimizer",
        held=state,
    )
    adascale = wrapped.inner_optimizer.keras_optimizer
    assert adascale.gain > 1.0
    assert adascale.scale_invariant_steps == pytest.approx(
        alone[0].keras_optimizer.scale_invariant_steps, rel=1e-6
    )
    assert int(wrapped.inner_optimizer.iterations.numpy()) == 5
