"""Test set-up: four replica devices, and a record of reference errors.

By default the CPU is split before TensorFlow initialises, so that
`MirroredStrategy` tests have four replicas on a machine without
accelerators. `scripts/device_check.py` sets `TF_VRGD_TEST_DEVICES`:
`logical-gpus` splits GPU 0 into four logical GPUs (reduced through one
device: NCCL does not run between logical GPUs of one GPU), `gpus` takes
the first four physical GPUs (NCCL).
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

NUM_LOGICAL_CPUS = 4  # the replicas of the `strategy` fixture, whatever the device
DEVICES = os.environ.get("TF_VRGD_TEST_DEVICES", "cpus")
# Memory of each logical GPU (MiB) in the `logical-gpus` set-up.
LOGICAL_GPU_MEMORY = 4096

if DEVICES == "logical-gpus":
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("GPU")[0],
        [tf.config.LogicalDeviceConfiguration(memory_limit=LOGICAL_GPU_MEMORY)] * NUM_LOGICAL_CPUS,
    )
elif DEVICES == "cpus":
    _cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
    )
elif DEVICES != "gpus":
    raise ValueError(f"TF_VRGD_TEST_DEVICES must be cpus, logical-gpus or gpus: {DEVICES!r}")

import keras  # noqa: E402
import pytest  # noqa: E402

from tests import references  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_keras_state():
    """Each test starts from float32 policy and fresh Keras names."""
    keras.mixed_precision.set_global_policy("float32")
    keras.backend.clear_session()
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(scope="session")
def strategy():
    # One strategy for the whole run: separate MirroredStrategy instances over
    # the same devices reuse collective instance keys, and their all-reduces
    # of different shapes then collide.
    if DEVICES == "cpus":
        return tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(NUM_LOGICAL_CPUS)])
    devices = [f"/gpu:{i}" for i in range(NUM_LOGICAL_CPUS)]
    if DEVICES == "logical-gpus":
        return tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
        )
    return tf.distribute.MirroredStrategy(devices)


def pytest_sessionfinish(session):
    # Under pytest-xdist each worker measures its own tests: it hands its
    # worst errors to the controller, which prints the summary.
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["worst_relative_errors"] = dict(references.WORST_RELATIVE_ERRORS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist, on the controller: a worker has finished."""
    worker_errors = getattr(node, "workeroutput", {}).get("worst_relative_errors", {})
    worst = references.WORST_RELATIVE_ERRORS
    for name, value in worker_errors.items():
        worst[name] = max(worst.get(name, 0.0), value)


def pytest_terminal_summary(terminalreporter):
    errors = references.WORST_RELATIVE_ERRORS
    if not errors:
        return
    terminalreporter.section("worst relative error per reference comparison")
    width = max(len(name) for name in errors)
    for name in sorted(errors):
        terminalreporter.write_line(f"{name:<{width}}  {errors[name]:.3e}")


@pytest.fixture(scope="session")
def strategy_2():
    """Two replicas (the first two devices of `strategy`), reduced through
    one device."""
    kind = "cpu" if DEVICES == "cpus" else "gpu"
    return tf.distribute.MirroredStrategy(
        [f"/{kind}:0", f"/{kind}:1"], cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
