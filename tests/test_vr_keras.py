"""The VR family as Keras citizens: fit under MirroredStrategy, saving and
checkpoints, state size, sparse gradients, mixed precision, and the guard on
the private Keras method the moment hook replaces."""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests import references as ref
import tf_vrgd

VR = {
    "VR-SGD": lambda **k: tf_vrgd.VRSGD(0.05, **k),
    "VR-Momentum": lambda **k: tf_vrgd.VRSGD(0.05, momentum=0.9, **k),
    "VR-Adam": lambda **k: tf_vrgd.VRAdam(0.003, **k),
    "VR-LARS": lambda **k: tf_vrgd.VRLARS(
        2.0, trust_coefficient=0.02, weight_decay_rate=1e-4, exclude_from_weight_decay=["bias"], **k
    ),
    "VR-LAMB": lambda **k: tf_vrgd.VRLAMB(
        0.01, weight_decay_rate=1e-3, exclude_from_layer_adaptation=["bias"], **k
    ),
}


def _images(n=512, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n).astype(np.int32)
    x = rng.normal(0, 0.3, (n, 10, 10, 1)).astype(np.float32)
    for label in range(4):  # a bright quadrant per class
        r, c = divmod(label, 2)
        x[y == label, r * 5 : (r + 1) * 5, c * 5 : (c + 1) * 5, 0] += 1.0
    return x, y


def _conv_model():
    return keras.Sequential(
        [
            keras.Input((10, 10, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(4),
        ]
    )


def _assert_trains(model, x, y, **fit_kwargs):
    losses = model.fit(x, y, verbose=0, **fit_kwargs).history["loss"]
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("name", VR)
def test_fit_trains_a_conv_model_under_mirrored_strategy(strategy, name):
    x, y = _images()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = helpers.compile_classifier(_conv_model(), VR[name]())
    _assert_trains(model, x, y, batch_size=128, epochs=5)


def test_fit_with_accumulation_under_mirrored_strategy(strategy):
    x, y = _images()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = helpers.compile_classifier(
            _conv_model(), tf_vrgd.VRAdam(0.003, gradient_accumulation_steps=2)
        )
    _assert_trains(model, x, y, batch_size=64, epochs=4)
    assert int(model.optimizer.iterations.numpy()) == 4 * (512 // 64) // 2


def test_jit_compiled_model_with_accumulation_on_one_device():
    x, y = _images()
    keras.utils.set_random_seed(0)
    model = helpers.compile_classifier(
        _conv_model(), tf_vrgd.VRAdam(0.003, gradient_accumulation_steps=4), jit_compile=True
    )
    _assert_trains(model, x, y, batch_size=32, epochs=3)


@pytest.mark.parametrize("name", VR)
def test_config_round_trip_and_save_load(name, tmp_path):
    optimizer = VR[name](gradient_accumulation_steps=2, gamma=0.2)
    config = optimizer.get_config()
    assert type(optimizer).from_config(config).get_config() == config
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert type(restored) is type(optimizer) and restored.get_config() == config

    x, y = _images(256)
    keras.utils.set_random_seed(0)
    model = helpers.compile_classifier(_conv_model(), optimizer, jit_compile=False)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    # Leave a half-accumulated update behind: accumulators must survive too.
    model.train_on_batch(x[:32], y[:32])
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.get_config()["gamma"] == 0.2
    for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    saved = model.get_weights()
    for model_ in (model, loaded):
        model_.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    label = f"{name} save/load continuation"
    ref.assert_all_close(loaded.get_weights(), model.get_weights(), label, rtol=1e-6, start=saved)


# VR-Adam only: every VR class shares the hook's state handling, and this
# test is among the slowest of the suite.
@pytest.mark.parametrize("name", ["VR-Adam"])
def test_checkpoint_lockstep_under_mirrored_strategy(strategy, name, tmp_path):
    x, y = _images(256)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)

    def make():
        with strategy.scope():
            keras.utils.set_random_seed(0)
            # State handling does not depend on XLA (tested elsewhere).
            return helpers.compile_classifier(
                _conv_model(), VR[name](gradient_accumulation_steps=2, jit_update=False)
            )

    straight = make()
    straight.fit(dataset, epochs=2, verbose=0)
    interrupted = make()
    interrupted.fit(dataset.take(5), epochs=1, verbose=0)  # mid-accumulation
    prefix = tf.train.Checkpoint(model=interrupted, optimizer=interrupted.optimizer).save(
        str(tmp_path / "ckpt")
    )
    resumed = make()
    with strategy.scope():
        resumed.optimizer.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(
        prefix
    ).assert_existing_objects_matched()
    at_checkpoint = interrupted.get_weights()
    resumed.fit(dataset.skip(5), epochs=1, verbose=0)
    resumed.fit(dataset, epochs=1, verbose=0)
    label = f"{name} checkpoint lockstep (4 replicas)"
    ref.assert_all_close(
        resumed.get_weights(), straight.get_weights(), label, rtol=1e-5, start=at_checkpoint
    )


BASE_SLOTS = {"VR-SGD": 0, "VR-Momentum": 1, "VR-Adam": 2, "VR-LARS": 1, "VR-LAMB": 2}


@pytest.mark.parametrize("accumulation", [None, 3])
@pytest.mark.parametrize("name", VR)
def test_state_is_base_plus_gsnr_momentum_plus_squares(name, accumulation):
    model = _conv_model()
    parameters = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    optimizer = VR[name](gradient_accumulation_steps=accumulation)
    optimizer.build(model.trainable_variables)
    state = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in optimizer.variables)
    slots = BASE_SLOTS[name] + (optimizer.beta_3 > 0)
    scalars = 8 + 4  # int64 iteration, float32 learning rate
    # One float32 per row of each variable with rows: the rows' GSNR
    # update counts (beta_3 > 0) and, accumulating, the rows' marks.
    rows = sum(int(v.shape[0]) for v in model.trainable_variables if len(v.shape))
    per_row = int(optimizer.beta_3 > 0)
    if accumulation:
        slots += 2  # Keras' gradient accumulator and the squares
        scalars += 4  # the float32 sample count
        per_row += 1
    expected = 4 * slots * parameters + 4 * per_row * rows + scalars
    assert state == expected, (state, slots, parameters, per_row, rows)


@pytest.mark.parametrize("name", VR)
def test_sparse_gradients_equal_dense(strategy, name):
    rng = np.random.default_rng(5)
    x = rng.integers(0, 12, size=(64, 5)).astype(np.int32)
    y = rng.standard_normal((64, 2)).astype(np.float32)
    results = []
    for densify in (False, True):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential(
                [
                    keras.Input((5,), dtype="int32"),
                    keras.layers.Embedding(12, 4),
                    keras.layers.GlobalAveragePooling1D(),
                    keras.layers.Dense(2),
                ]
            )
            # Densifying happens before the per-variable update; the XLA
            # path is tested elsewhere, and compiling it here doubles the time.
            optimizer = VR[name](jit_update=False)
            optimizer.build(model.trainable_variables)
            initial = model.get_weights()

        @tf.function
        def step(xb, yb):
            def replica_fn(xb, yb):
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.square(model(xb) - yb)) / 64.0
                grads = tape.gradient(loss, model.trainable_variables)
                if densify:
                    grads = [tf.convert_to_tensor(g) for g in grads]
                optimizer.apply(grads, model.trainable_variables)

            strategy.run(replica_fn, args=(xb, yb))

        for _ in range(3):
            for xb, yb in strategy.experimental_distribute_dataset(
                tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
            ):
                step(xb, yb)
        results.append(model.get_weights())
    ref.assert_all_close(*results, f"{name} sparse vs dense (4 replicas)", rtol=1e-5, start=initial)


def test_loss_scale_optimizer_skips_non_finite_steps_and_keeps_all_state(strategy):
    keras.mixed_precision.set_global_policy("mixed_float16")
    with strategy.scope():
        model = _conv_model()
        optimizer = keras.optimizers.LossScaleOptimizer(
            tf_vrgd.VRAdam(0.01, gradient_accumulation_steps=2), initial_scale=8.0
        )
        optimizer.build(model.trainable_variables)

    @tf.function
    def step(value):
        def replica_fn():
            grads = [
                tf.fill(v.shape, value)
                * tf.cast(
                    tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32
                )
                for v in model.trainable_variables
            ]
            optimizer.apply(grads, model.trainable_variables)

        strategy.run(replica_fn)

    for _ in range(3):  # one update and a half-filled accumulator
        step(tf.constant(1.0))
    weights = model.get_weights()
    inner = optimizer.inner_optimizer
    state = [np.stack([c.numpy() for c in v.value.values]) for v in inner.variables]
    step(tf.constant(np.inf))
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, v in zip(state, inner.variables):  # m, v, GSNR momentum, both accumulators, iterations
        np.testing.assert_array_equal(a, np.stack([c.numpy() for c in v.value.values]))
    assert float(optimizer.dynamic_scale.numpy()) == 4.0


@pytest.mark.parametrize("name", ["VR-Adam"])
def test_mixed_bfloat16_trains(strategy, name):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    x, y = _images()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = helpers.compile_classifier(_conv_model(), VR[name]())
    _assert_trains(model, x, y, batch_size=128, epochs=5)


def test_keras_private_update_path_is_unchanged():
    """tf_vrgd._gsnr.GSNRMixin replaces Keras' private
    `BaseOptimizer._backend_apply_gradients(grads, trainable_variables)` and
    relies on `_accumulated_gradients`, `_clip_gradients`, `_iterations` and
    `_update_model_variables_moving_average`. If a Keras upgrade changes
    these, this test fails: re-check the hook before widening the pin."""
    from keras.src.optimizers import base_optimizer

    base = base_optimizer.BaseOptimizer
    assert list(inspect.signature(base._backend_apply_gradients).parameters) == [
        "self",
        "grads",
        "trainable_variables",
    ], "keras BaseOptimizer._backend_apply_gradients changed its signature"
    source = inspect.getsource(base._backend_apply_gradients)
    for name in (
        "_accumulated_gradients",
        "_clip_gradients",
        "_apply_weight_decay",
        "_backend_update_step",
        "_update_model_variables_moving_average",
    ):
        assert name in source, f"keras BaseOptimizer._backend_apply_gradients no longer uses {name}"
    apply_source = inspect.getsource(base.apply)
    assert "self._backend_apply_gradients(grads, trainable_variables)" in apply_source, (
        "keras BaseOptimizer.apply no longer calls _backend_apply_gradients"
    )
    assert "self._iterations.assign_add(1)" in apply_source
