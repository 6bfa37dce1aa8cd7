"""Gradient accumulation of the non-VR optimizers under MirroredStrategy
(Keras' own fails there: its all-reduce sits in a replica-context cond),
against the numpy references: each update applies the mean over the
micro-steps and replicas."""

import keras
import numpy as np
import pytest

from tests import helpers
from tests import references as ref
import tf_vrgd
from tf_vrgd import config

UPDATES = 3
STEPS = 2
LR = 0.05


def _mean_per_update(stream, steps):
    return [
        [s.mean(axis=0) for s in update] for update in helpers.samples_per_update(stream, steps)
    ]


CASES = {
    "SGD momentum": (
        lambda: tf_vrgd.SGD(LR, momentum=0.9, gradient_accumulation_steps=STEPS),
        ref.sgd(LR, momentum=0.9),
    ),
    "Adam": (lambda: tf_vrgd.Adam(LR, gradient_accumulation_steps=STEPS), ref.adam(LR)),
    "LAMB": (
        lambda: tf_vrgd.LAMB(LR, weight_decay_rate=0.01, gradient_accumulation_steps=STEPS),
        ref.lamb(LR, weight_decay_rate=0.01),
    ),
    # A trust coefficient that moves the weights by some 1e-3 of their
    # size per update (the default 1e-3, by 5e-5: below what float32
    # weights resolve to 1e-4).
    "LARS": (
        lambda: tf_vrgd.LARS(
            LR, trust_coefficient=0.02, weight_decay_rate=1e-3, gradient_accumulation_steps=STEPS
        ),
        ref.lars(LR, trust_coefficient=0.02, weight_decay_rate=1e-3),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_accumulation_matches_reference_on_four_replicas(strategy, case):
    make, rule = CASES[case]
    stream = helpers.gradient_stream(helpers.model_shapes(), UPDATES * STEPS, replicas=4, seed=21)
    initial, got, optimizer = helpers.run_mirrored(strategy, make, stream)
    expected = ref.run(initial, rule, _mean_per_update(stream, STEPS))
    ref.assert_all_close(
        got, expected, f"{case} (4 replicas x {STEPS} micro-steps)", rtol=2e-4, start=initial
    )
    assert int(optimizer.iterations.numpy()) == UPDATES


def test_weight_decay_and_ema_match_keras_accumulation_on_one_device(strategy):
    """Keras' decoupled weight decay (biases excluded by name), its EMA with
    a periodic overwrite, and its rate per update are kept: four replicas
    give the weights of Keras' own SGD accumulating the replicas' mean
    gradient on one device."""
    stream = helpers.gradient_stream(helpers.model_shapes(), UPDATES * STEPS, replicas=4, seed=22)
    kwargs = dict(
        momentum=0.5,
        weight_decay=0.1,
        gradient_accumulation_steps=STEPS,
        use_ema=True,
        ema_momentum=0.9,
        ema_overwrite_frequency=2,
    )

    def excluding_biases(optimizer):
        optimizer.exclude_from_weight_decay(var_names=["bias"])
        return optimizer

    initial, got, _ = helpers.run_mirrored(
        strategy, lambda: excluding_biases(tf_vrgd.SGD(LR, **kwargs)), stream
    )

    model = helpers.make_model()
    means = helpers.mean_over_replicas(stream)
    keras_sgd = excluding_biases(keras.optimizers.SGD(LR, **kwargs))
    helpers.apply_stream(
        keras_sgd,
        model.trainable_variables,
        [[[g.astype(np.float32) for g in step]] for step in means],
        compiled=True,
    )
    label = "SGD weight decay and EMA (4 replicas vs Keras on one device)"
    ref.assert_all_close(got, model.get_weights(), label, rtol=1e-5, start=initial)


def test_fit_with_accumulation_under_mirrored_strategy_for_config_types(strategy):
    """Every non-VR type of `tf_vrgd.config` trains under `fit` with
    accumulation on four replicas, and takes one update per A batches."""
    x = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    y = (x[:, :1] > 0).astype(np.float32)
    for kind in ("sgd", "adam", "adamw", "lamb", "lars"):
        keras.backend.clear_session()
        block = {
            "optimizer": {"type": kind, kind: {"gradient_accumulation_steps": STEPS}},
            "learning_rate": {"type": "constant", "constant": {"learning_rate": 0.01}},
        }
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
            model.compile(optimizer=config.optimizer_from_config(block), loss="mse")
        before = model.get_weights()[0].copy()
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        assert int(model.optimizer.iterations.numpy()) == 4 // STEPS, kind
        assert not np.allclose(model.get_weights()[0], before), kind


def test_mid_accumulation_state_survives_save_and_load(strategy, tmp_path):
    """A `.keras` save between micro-steps keeps the partial sum: the loaded
    optimizer finishes the update as if uninterrupted."""
    stream = helpers.gradient_stream(helpers.model_shapes(), UPDATES * STEPS, replicas=4, seed=23)
    initial, expected, _ = helpers.run_mirrored(strategy, CASES["Adam"][0], stream)

    with strategy.scope():
        model = helpers.make_model()
        model.compile(optimizer=CASES["Adam"][0](), loss="mse")
    helpers.apply_stream_mirrored(strategy, model.optimizer, model.trainable_variables, stream[:3])
    path = str(tmp_path / "mid.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, tf_vrgd.Adam)
    helpers.apply_stream_mirrored(
        strategy, loaded.optimizer, loaded.trainable_variables, stream[3:]
    )
    label = "Adam accumulation across save/load"
    ref.assert_all_close(loaded.get_weights(), expected, label, rtol=1e-5, start=initial)
