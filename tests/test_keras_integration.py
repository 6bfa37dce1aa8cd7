"""Keras citizenship: serialization, save/load, checkpoints, XLA, mixed
precision and sparse gradients, for LARS, LARC and the measuring wrappers."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests import references as ref
import tf_vrgd

OPTIMIZERS = {
    "LARS": lambda: tf_vrgd.LARS(
        0.5,
        momentum=0.9,
        nesterov=True,
        trust_coefficient=0.01,
        weight_decay_rate=1e-3,
        exclude_from_weight_decay=["bias"],
        exclude_from_layer_adaptation=["head"],
        clipnorm=5.0,
    ),
    "LARC(SGD)": lambda: tf_vrgd.LARC(
        keras.optimizers.SGD(0.2, momentum=0.9), trust_coefficient=0.01, weight_decay=1e-3
    ),
    "LARC(Adam)": lambda: tf_vrgd.LARC(
        keras.optimizers.Adam(0.01), trust_coefficient=0.05, clip=False, epsilon=1e-6
    ),
    "LARC(LARS)": lambda: tf_vrgd.LARC(tf_vrgd.LARS(0.3, exclude_from_weight_decay=["bias"])),
    "NoiseScale(SGD)": lambda: tf_vrgd.NoiseScale(
        keras.optimizers.SGD(0.05, momentum=0.9), interval=3
    ),
    # Two micro-steps: two samples per update, so one device measures.
    "AdaScale(SGD)": lambda: tf_vrgd.AdaScale(
        tf_vrgd.SGD(0.05, momentum=0.9, gradient_accumulation_steps=2), scale=4, decay=0.9
    ),
}


def _data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    y = ((x[:, 0] - x[:, 3]) > 0).astype(np.int32) + (x[:, 1] > 0.5).astype(np.int32)
    return x, y


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", name="body"),
            keras.layers.Dense(3, name="head"),
        ]
    )


def _strip_names(config):
    """Configs compared across instances: auto-generated names differ."""
    if isinstance(config, dict):
        return {k: _strip_names(v) for k, v in config.items() if k != "name"}
    return config


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_get_config_round_trip_and_registration(name):
    optimizer = OPTIMIZERS[name]()
    config = optimizer.get_config()
    assert type(optimizer).from_config(config).get_config() == config
    serialized = keras.optimizers.serialize(optimizer)
    assert serialized["registered_name"] == f"tf_vrgd>{type(optimizer).__name__}"
    restored = keras.optimizers.deserialize(serialized)
    assert type(restored) is type(optimizer)
    assert restored.get_config() == config
    if isinstance(optimizer, tf_vrgd.LARC):
        assert type(restored.inner_optimizer) is type(optimizer.inner_optimizer)
        assert {"trust_coefficient", "clip", "epsilon", "weight_decay"} <= set(config)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_model_save_and_load_restore_optimizer_and_state(name, tmp_path):
    x, y = _data()
    model = helpers.compile_classifier(_model(), OPTIMIZERS[name]())
    model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)

    assert type(loaded.optimizer) is type(model.optimizer)
    assert _strip_names(loaded.optimizer.get_config()) == _strip_names(model.optimizer.get_config())
    saved_state = [v.numpy() for v in model.optimizer.variables]
    loaded_state = [v.numpy() for v in loaded.optimizer.variables]
    assert len(saved_state) == len(loaded_state) > 2
    for a, b in zip(saved_state, loaded_state):
        np.testing.assert_array_equal(a, b)

    # Both continue identically: hyper-parameters and state were all kept.
    saved = model.get_weights()
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    loaded.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    label = f"{name} save/load continuation"
    ref.assert_all_close(loaded.get_weights(), model.get_weights(), label, rtol=1e-6, start=saved)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_checkpoint_lockstep(name, tmp_path):
    x, y = _data()
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, 256, 32)]
    first, rest = batches[:5], batches[5:]

    straight = helpers.compile_classifier(_model(), OPTIMIZERS[name]())
    for xb, yb in batches:
        straight.train_on_batch(xb, yb)

    interrupted = helpers.compile_classifier(_model(), OPTIMIZERS[name]())
    for xb, yb in first:
        interrupted.train_on_batch(xb, yb)
    prefix = tf.train.Checkpoint(model=interrupted, optimizer=interrupted.optimizer).save(
        str(tmp_path / "ckpt")
    )
    at_checkpoint = interrupted.get_weights()

    resumed = helpers.compile_classifier(_model(seed=123), OPTIMIZERS[name]())
    resumed.optimizer.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(
        prefix
    ).assert_existing_objects_matched()
    applying = getattr(resumed.optimizer, "inner_optimizer", resumed.optimizer)
    updates = len(first) // (applying.gradient_accumulation_steps or 1)
    assert int(resumed.optimizer.iterations.numpy()) == updates
    for xb, yb in rest:
        resumed.train_on_batch(xb, yb)
    label = f"{name} checkpoint lockstep"
    ref.assert_all_close(
        resumed.get_weights(), straight.get_weights(), label, rtol=1e-6, start=at_checkpoint
    )


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_xla_equals_non_xla_on_one_device(name):
    x, y = _data()
    runs = []
    initial = _model().get_weights()
    for jit in (False, True):
        model = helpers.compile_classifier(_model(), OPTIMIZERS[name](), jit_compile=jit)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        runs.append(model.get_weights())
    ref.assert_all_close(runs[1], runs[0], f"{name} XLA vs non-XLA", rtol=1e-4, start=initial)


# --- Mixed precision ---------------------------------------------------------


@pytest.mark.parametrize("name", ["LARS", "LARC(SGD)"])
def test_mixed_float16_with_loss_scale_optimizer_trains(name):
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _data(512)
    model = _model()
    optimizer = keras.optimizers.LossScaleOptimizer(OPTIMIZERS[name]())
    helpers.compile_classifier(model, optimizer)
    history = model.fit(x, y, batch_size=64, epochs=5, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.85 * losses[0], losses
    assert model.layers[0].kernel.dtype == "float32"


@pytest.mark.parametrize("name", ["LARS", "LARC(SGD)"])
def test_mixed_float16_is_wrapped_by_keras_automatically(name):
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _data()
    model = helpers.compile_classifier(_model(), OPTIMIZERS[name]())
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0)
    assert np.all([np.all(np.isfinite(w)) for w in model.get_weights()])


@pytest.mark.parametrize("name", ["LARS", "LARC(SGD)"])
def test_loss_scale_optimizer_skips_non_finite_steps(name):
    model = _model()
    optimizer = keras.optimizers.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=8.0)
    optimizer.build(model.trainable_variables)
    finite = [tf.ones_like(v) for v in model.trainable_variables]
    optimizer.apply(finite, model.trainable_variables)
    weights = model.get_weights()
    inner_state = [v.numpy() for v in optimizer.inner_optimizer.variables]
    scale = float(optimizer.dynamic_scale.numpy())

    broken = list(finite)
    broken[0] = tf.fill(finite[0].shape, np.inf)
    optimizer.apply(broken, model.trainable_variables)

    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # Slots, inner iterations and learning rate all untouched.
    for a, b in zip(inner_state, [v.numpy() for v in optimizer.inner_optimizer.variables]):
        np.testing.assert_array_equal(a, b)
    assert int(optimizer.iterations.numpy()) == 1
    assert float(optimizer.dynamic_scale.numpy()) == scale / 2


@pytest.mark.parametrize("name", ["LARS", "LARC(SGD)"])
def test_mixed_bfloat16_trains(name):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    x, y = _data(512)
    model = helpers.compile_classifier(_model(), OPTIMIZERS[name]())
    history = model.fit(x, y, batch_size=64, epochs=5, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.85 * losses[0], losses


# --- Sparse gradients ----------------------------------------------------------


def _embedding_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(20, 4, name="embedding"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2, name="head"),
        ]
    )


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sparse_gradients_equal_dense(name):
    rng = np.random.default_rng(3)
    # Repeated ids in a batch: the IndexedSlices carry duplicate indices.
    batches = [
        (
            rng.integers(0, 8, size=(16, 5)).astype(np.int32),
            rng.standard_normal((16, 2)).astype(np.float32),
        )
        for _ in range(4)
    ]
    results = []
    initial = _embedding_model().get_weights()
    for densify in (False, True):
        model = _embedding_model()
        optimizer = OPTIMIZERS[name]()
        for xb, yb in batches:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(xb) - yb))
            grads = tape.gradient(loss, model.trainable_variables)
            if densify:
                grads = [tf.convert_to_tensor(g) for g in grads]
            else:
                assert isinstance(grads[0], tf.IndexedSlices)
            optimizer.apply(grads, model.trainable_variables)
        results.append(model.get_weights())
    ref.assert_all_close(*results, f"{name} sparse vs dense", rtol=1e-5, start=initial)


@pytest.mark.parametrize("name", ["LARS", "LARC(SGD)"])
def test_embedding_trains_with_fit_under_mirrored_strategy(name, strategy):
    rng = np.random.default_rng(4)
    x = rng.integers(0, 20, size=(512, 5)).astype(np.int32)
    y = (x.sum(axis=1) % 2).astype(np.int32)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((5,), dtype="int32"),
                keras.layers.Embedding(20, 8),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(2),
            ]
        )
        helpers.compile_classifier(model, OPTIMIZERS[name]())
    history = model.fit(x, y, batch_size=64, epochs=5, verbose=0)
    losses = history.history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
