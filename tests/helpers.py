"""Shared test fixtures: small models with scaled weights, gradient streams,
and drivers that apply them eagerly, in `tf.function` or per replica."""

import importlib.util
import os
import socket

import keras
import numpy as np
import tensorflow as tf

from tests import references as ref


def make_model(seed=0, weight_scales=(3.0, 0.5, 0.2, 0.05)):
    """Two Dense layers (paths sequential/dense/kernel, .../dense/bias,
    .../head/kernel, .../head/bias) with weights whose norms differ by
    orders of magnitude."""
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(6, name="dense"),
            keras.layers.Dense(3, name="head"),
        ]
    )
    rng = np.random.default_rng(seed)
    model.set_weights(
        [
            (rng.standard_normal(w.shape) * scale).astype(np.float32)
            for w, scale in zip(model.get_weights(), weight_scales)
        ]
    )
    return model


def model_shapes():
    """The shapes of `make_model()`'s variables, in order."""
    return [w.shape for w in make_model().get_weights()]


def gradient_stream(shapes, steps, replicas=1, scales=None, seed=1):
    """Random gradients, shape [steps][replicas][variable]; per-variable
    scales make some layers' gradients large and others small."""
    rng = np.random.default_rng(seed)
    scales = scales or [1.0] * len(shapes)
    return [
        [
            [(rng.standard_normal(s) * c).astype(np.float32) for s, c in zip(shapes, scales)]
            for _ in range(replicas)
        ]
        for _ in range(steps)
    ]


def mean_over_replicas(stream):
    """[steps][replicas][var] -> [steps][var], the gradient Keras applies."""
    return [
        [
            np.mean([replica[i] for replica in step], axis=0, dtype=np.float64)
            for i in range(len(step[0]))
        ]
        for step in stream
    ]


def model_stream(micro_steps, replicas, scales, seed):
    """`gradient_stream` over `make_model()`'s variables."""
    return gradient_stream(model_shapes(), micro_steps, replicas=replicas, scales=scales, seed=seed)


def samples_per_update(stream, accumulation_steps):
    """[micro-steps][replicas][var] -> [updates][var] arrays [k, *shape]."""
    updates = []
    for u in range(len(stream) // accumulation_steps):
        micro = stream[u * accumulation_steps : (u + 1) * accumulation_steps]
        updates.append(
            [
                np.stack([replica[i] for step in micro for replica in step]).astype(np.float64)
                for i in range(len(micro[0][0]))
            ]
        )
    return updates


def apply_stream(optimizer, variables, stream, compiled=False):
    """Applies replica-0 gradients of each step on one device."""

    def step(grads):
        optimizer.apply(grads, variables)

    if compiled:
        step = tf.function(step)
    for grads in stream:
        step([tf.constant(g) for g in grads[0]])


def apply_stream_mirrored(strategy, optimizer, variables, stream):
    """Each replica applies its own gradient, scaled by 1/R as Keras scales a
    replica's loss, so that Keras' all-reduce SUM yields the mean."""
    replicas = strategy.num_replicas_in_sync
    assert len(stream[0]) == replicas
    # As Keras' fit does: variables are created before the step is traced.
    with strategy.scope():
        optimizer.build(variables)

    @tf.function
    def step(stacked):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            grads = [tf.gather(g, replica) / replicas for g in stacked]
            optimizer.apply(grads, variables)

        strategy.run(replica_fn)

    for grads in stream:
        stacked = [
            tf.constant(np.stack([replica[i] for replica in grads])) for i in range(len(grads[0]))
        ]
        step(stacked)


def run_mirrored(strategy, make_optimizer, stream):
    """Builds `make_model()` and `make_optimizer()` under `strategy`, applies
    the per-replica stream; returns (initial weights, final weights,
    optimizer)."""
    with strategy.scope():
        model = make_model()
        optimizer = make_optimizer()
    initial = model.get_weights()
    apply_stream_mirrored(strategy, optimizer, model.trainable_variables, stream)
    return initial, model.get_weights(), optimizer


def run_mirrored_against(strategy, make_optimizer, stream, steps, reference, label):
    """`run_mirrored`, then the final weights asserted against
    `reference(initial weights, samples_per_update(stream, steps))`;
    returns what `run_mirrored` does."""
    initial, got, optimizer = run_mirrored(strategy, make_optimizer, stream)
    expected = reference(initial, samples_per_update(stream, steps))
    ref.assert_all_close(got, expected, label, rtol=1e-4, start=initial)
    return initial, got, optimizer


def apply_gradients_mirrored(strategy, face, variables, stream):
    """Each replica applies its own gradient (scaled by 1/R, as Model
    Garden's train_step scales the loss) through `face.apply_gradients` (a
    tf_keras optimizer's)."""
    replicas = strategy.num_replicas_in_sync

    @tf.function
    def step(stacked):
        def replica_fn():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            grads = [tf.gather(g, replica) / replicas for g in stacked]
            face.apply_gradients(zip(grads, variables))

        strategy.run(replica_fn)

    for grads in stream:
        step([tf.constant(np.stack([r[i] for r in grads])) for i in range(len(grads[0]))])


def assert_tf_keras_loss_scale_skips_an_overflow(
    strategy, make, start, stream, label, held=lambda wrapped: ()
):
    """tf_keras' LossScaleOptimizer (Model Garden's under float16) around the
    tf_keras optimizer `make()`: over `stream`, from weights `start`, it
    updates as `make()` alone; then a step whose gradient holds an Inf on
    one replica only leaves every device's copy of the weights, and of the
    variables `held(wrapper)`, as it was, and halves the loss scale.
    Returns the wrapper."""
    import tf_keras

    with strategy.scope():
        expected = [tf.Variable(w) for w in start]
        alone = make()
        variables = [tf.Variable(w) for w in start]
        wrapped = tf_keras.mixed_precision.LossScaleOptimizer(make())
    apply_gradients_mirrored(strategy, alone, expected, stream)
    apply_gradients_mirrored(strategy, wrapped, variables, stream)
    got = [v.numpy() for v in variables]
    ref.assert_all_close(got, [e.numpy() for e in expected], label, start=start)
    scale = float(wrapped.loss_scale.numpy())
    held = [*variables, *held(wrapped)]
    before = [[c.numpy() for c in getattr(v, "values", [v])] for v in held]
    shapes = [w.shape for w in start]
    overflow = gradient_stream(shapes, steps=1, replicas=strategy.num_replicas_in_sync, seed=9)
    overflow[0][-1][0].flat[0] = np.inf
    apply_gradients_mirrored(strategy, wrapped, variables, overflow)
    for copies, variable in zip(before, held):
        after = [c.numpy() for c in getattr(variable, "values", [variable])]
        assert len(after) == len(copies) >= 1
        for b, a in zip(copies, after):
            np.testing.assert_array_equal(a, b, err_msg=getattr(variable, "path", variable.name))
    assert float(wrapped.loss_scale.numpy()) == scale / 2
    return wrapped


def free_ports(count):
    """`count` free TCP ports on 127.0.0.1 (for local multi-worker clusters)."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def compile_classifier(model, optimizer, **kwargs):
    """`model` compiled with `optimizer` and a sparse cross-entropy on logits."""
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **kwargs,
    )
    return model


def model_garden_command(experiment, config_file, model_dir, overrides, cpu_replicas=2):
    """`python -m tf_vrgd.model_garden.train --mode=train` (Model Garden's
    trainer) on `config_file` with `overrides` ({dotted key: value}, Model
    Garden's `--params_override`); `cpu_replicas=0` leaves the strategy to
    the config."""
    import sys

    override = ",".join(f"{key}={value}" for key, value in overrides.items())
    return [
        sys.executable,
        "-m",
        "tf_vrgd.model_garden.train",
        f"--experiment={experiment}",
        f"--config_file={config_file}",
        "--mode=train",
        f"--model_dir={model_dir}",
        f"--cpu_replicas={cpu_replicas}",
        f"--params_override={override}",
    ]


def model_garden_env(**variables):
    """This process' environment with the repository on the path, plus
    `variables`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        **variables,
    }


def model_garden_train(*args, **kwargs):
    """Runs `model_garden_command(*args, **kwargs)`; returns what it printed
    (the trainer prints each `train | step:` record and logs it again),
    or fails the test with its output."""
    import subprocess

    done = subprocess.run(
        model_garden_command(*args, **kwargs),
        env=model_garden_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout


def model_garden_logs(output, key):
    """The values Model Garden's trainer printed for `key` at each
    `train | step:` line, in order."""
    import re

    return [
        float(match) for match in re.findall(rf"'{re.escape(key)}': np\.float32\(([^)]+)\)", output)
    ]


def checkpoint_values(path):
    """{name: array} of a TF checkpoint's every tensor."""
    reader = tf.train.load_checkpoint(str(path))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def load_script(name):
    """The module of scripts/<name>.py (the scripts are no package)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
