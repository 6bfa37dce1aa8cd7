"""A face's state through tf_keras' own `model.save` and
`tf_keras.models.load_model`, in each of its formats, against what tf_keras
does for its own legacy optimizer (`legacy.Adam`) in the same format: where
Adam's state comes back (HDF5), every slot of the face's comes back with the
saved values and the update count goes on; where Adam's does not (`.keras`
and SavedModel in tf_keras 2.21), neither does the face's."""

import numpy as np
import pytest

tf_keras = pytest.importorskip("tf_keras")

from tf_vrgd.model_garden import optimizers  # noqa: E402

FORMATS = {"hdf5": "model.h5", "keras": "model.keras", "savedmodel": "saved_model"}
OPTIMIZERS = {
    "tf_keras Adam": lambda: tf_keras.optimizers.legacy.Adam(0.01),
    "VRAdam": lambda: optimizers.VRAdam(0.01),
    "LAMB": lambda: optimizers.LAMB(0.01, weight_decay_rate=0.01),
    "LARC(VRSGD)": lambda: optimizers.LARC(optimizers.VRSGD(0.1, momentum=0.9)),
    "LARC(tf_keras SGD)": lambda: optimizers.LARC(
        tf_keras.optimizers.legacy.SGD(0.1, momentum=0.9), trust_coefficient=0.05
    ),
}
# 4 updates of 4 replicas x 2 examples before the save and 4 after.
BATCH, UPDATES = 8, 4


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH * UPDATES, 3)).astype(np.float32)
    return x, x @ np.array([[1.0], [-2.0], [0.5]], np.float32)


def _save_and_resume(strategy, make_optimizer, path):
    """Trains, saves, loads; returns the saved optimizer weights, those of
    the loaded optimizer before it trains, and its update count after 4
    more updates."""
    x, y = _data()
    with strategy.scope():
        model = tf_keras.Sequential(
            [tf_keras.layers.Dense(4, input_shape=(3,)), tf_keras.layers.Dense(1)]
        )
        model.compile(optimizer=make_optimizer(), loss="mse")
    model.fit(x, y, batch_size=BATCH, verbose=0)
    saved = [w.numpy() for w in model.optimizer.weights]
    assert len(saved) > 1 and int(model.optimizer.iterations.numpy()) == UPDATES
    model.save(path)
    with strategy.scope():
        loaded = tf_keras.models.load_model(path, custom_objects=optimizers.FACES)
    restored = [w.numpy() for w in loaded.optimizer.weights]
    loaded.fit(x, y, batch_size=BATCH, verbose=0)
    return saved, restored, int(loaded.optimizer.iterations.numpy()), loaded.optimizer


def _kept(saved, restored):
    """Whether every weight came back with its saved value."""
    return len(restored) == len(saved) and all(
        np.array_equal(s, r) for s, r in zip(saved, restored)
    )


_ADAM = {}


def _adam(strategy, fmt, tmp_path_factory):
    """tf_keras' own legacy Adam in format `fmt`: (state kept, update count)."""
    if fmt not in _ADAM:
        path = str(tmp_path_factory.mktemp("adam") / FORMATS[fmt])
        saved, restored, count, _ = _save_and_resume(strategy, OPTIMIZERS["tf_keras Adam"], path)
        _ADAM[fmt] = (_kept(saved, restored), count)
    return _ADAM[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n != "tf_keras Adam"])
def test_a_face_keeps_its_state_where_tf_keras_keeps_its_own(
    strategy, tmp_path, tmp_path_factory, name, fmt
):
    adam_kept, adam_count = _adam(strategy, fmt, tmp_path_factory)
    saved, restored, count, loaded = _save_and_resume(
        strategy, OPTIMIZERS[name], str(tmp_path / FORMATS[fmt])
    )
    assert isinstance(loaded, optimizers.FACES[name.split("(")[0]])
    assert _kept(saved, restored) == adam_kept, (name, fmt, len(saved), len(restored))
    assert count == adam_count
    if fmt == "hdf5":
        # What tf_keras' own optimizer does there: the whole state resumes.
        assert adam_kept and count == 2 * UPDATES
