"""Test set-up: four logical CPU devices, and a record of reference errors.

The CPU is split before TensorFlow initialises, so that `MirroredStrategy`
tests have four replicas on a machine without accelerators.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

NUM_LOGICAL_CPUS = 4

_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(
    _cpus[0], [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
)

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
    devices = [f"/cpu:{i}" for i in range(NUM_LOGICAL_CPUS)]
    return tf.distribute.MirroredStrategy(devices)


def pytest_terminal_summary(terminalreporter):
    errors = references.WORST_RELATIVE_ERRORS
    if not errors:
        return
    terminalreporter.section("worst relative error per reference comparison")
    width = max(len(name) for name in errors)
    for name in sorted(errors):
        terminalreporter.write_line(f"{name:<{width}}  {errors[name]:.3e}")
