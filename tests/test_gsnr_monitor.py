"""GSNR diagnostics: the optimizer's per-variable statistics against numpy,
and `GSNRMonitor` writing them into History, batch logs and TensorBoard."""

import glob

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests import references as ref
import tf_vrgd


def _reference_statistics(samples_per_update, gamma, beta_3=0.0):
    """Per variable: [mean raw GSNR, fraction at gamma, fraction at 1, mean
    applied factor (r, or phat with GSNR momentum)], averaged over updates."""
    rows = []
    for i in range(len(samples_per_update[0])):
        per_update = []
        momentum = 0.0
        for t, samples in enumerate(samples_per_update, start=1):
            raw, _ = ref.raw_gsnr(samples[i])
            r, _ = ref.gsnr_scale(samples[i], gamma)
            applied = r
            if beta_3:
                momentum = beta_3 * momentum + (1 - beta_3) * r
                applied = momentum / (1 - beta_3**t)
            per_update.append(
                [raw.mean(), np.mean(r <= gamma), np.mean(r >= 1.0), np.mean(applied)]
            )
        rows.append(np.mean(per_update, axis=0))
    return rows


def _assert_statistics_match(optimizer, shapes, samples, gamma, name, beta_3=0.0):
    statistics = optimizer.gsnr_statistics()
    paths = [v.path for v in optimizer._trainable_variables]
    assert list(statistics) == paths
    references = _reference_statistics(samples, gamma, beta_3)
    for path, shape, expected in zip(paths, shapes, references):
        got = statistics[path]
        assert got["updates"] == len(samples)
        ref.assert_close(got["mean_gsnr"], expected[0], f"{name} mean GSNR", rtol=1e-4)
        ref.assert_close(got["mean_scale"], expected[3], f"{name} mean applied scale", rtol=1e-4)
        # A fraction may differ by one element that float32 puts on the
        # other side of a clip bound.
        one_element = 1.0 / (np.prod(shape) * len(samples))
        for key, value in zip(("fraction_at_gamma", "fraction_at_one"), expected[1:]):
            assert abs(got[key] - value) <= one_element + 1e-7, (path, key, got[key], value)


def _vr_sgd_on_four_replicas(strategy, accumulation, **arguments):
    """VR-SGD tracking its statistics after 3 updates of a gradient stream
    on 4 replicas: (optimizer, the variables' shapes, the samples of each
    update)."""
    steps = accumulation or 1
    shapes = helpers.model_shapes()
    stream = helpers.gradient_stream(shapes, 3 * steps, replicas=4, scales=[1.0, 0.1, 3.0, 0.01])
    _, _, optimizer = helpers.run_mirrored(
        strategy,
        lambda: tf_vrgd.VRSGD(
            0.01,
            gradient_accumulation_steps=accumulation,
            track_gsnr_statistics=True,
            **arguments,
        ),
        stream,
    )
    return optimizer, shapes, helpers.samples_per_update(stream, steps)


@pytest.mark.parametrize("beta_3", [0.0, 0.5])
@pytest.mark.parametrize("accumulation", [None, 2])
def test_statistics_match_numpy_on_four_replicas(strategy, accumulation, beta_3):
    gamma = 0.3
    optimizer, shapes, samples = _vr_sgd_on_four_replicas(
        strategy, accumulation, momentum=0.9, gamma=gamma, beta_3=beta_3
    )
    _assert_statistics_match(optimizer, shapes, samples, gamma, "GSNR statistics", beta_3)
    # Some elements sit at each bound, so the fractions are not trivially 0 or 1.
    sums = optimizer.gsnr_statistic_sums()
    # 4 statistics, the 2 noise-scale terms, the update count.
    assert sums.shape == (len(shapes), 7)
    # Columns 1 and 2 sum the fractions at gamma and at 1 over the updates,
    # the last column counts the updates: neither fraction 0 or 1 everywhere.
    for column in (1, 2):
        assert 0 < sums[:, column].sum() < sums[:, -1].sum(), (column, sums)

    optimizer.reset_gsnr_statistics()
    np.testing.assert_array_equal(optimizer.gsnr_statistic_sums(), 0.0)
    stats = optimizer.gsnr_statistics()
    assert all(np.isnan(s["mean_gsnr"]) and s["updates"] == 0 for s in stats.values())


@pytest.mark.parametrize("path", ["packed", "fused"])
@pytest.mark.parametrize("accumulation", [None, 2])
def test_noise_terms_match_numpy_on_four_replicas(strategy, accumulation, path, monkeypatch):
    """The noise scale's terms in each variable's row: per update, the
    squared norm of the samples' mean and the mean of their squared norms
    (`tf_vrgd.noise_scale`), averaged over the updates, on both dense
    update paths (small variables packed into one vector, or each in the
    XLA program)."""
    from tf_vrgd import _gsnr_layout, statistics

    if path == "fused":
        monkeypatch.setattr(_gsnr_layout, "PACKED_MAX_ELEMENTS", -1)
    optimizer, shapes, updates = _vr_sgd_on_four_replicas(strategy, accumulation)
    big, small = statistics.noise_terms(optimizer.gsnr_statistic_sums())
    for i in range(len(shapes)):
        expected_big = np.mean([np.sum(update[i].mean(axis=0) ** 2) for update in updates])
        expected_small = np.mean(
            [
                np.mean(np.sum(update[i] ** 2, axis=tuple(range(1, update[i].ndim))))
                for update in updates
            ]
        )
        ref.assert_close(big[i], expected_big, "noise term |G_big|^2", rtol=1e-5)
        ref.assert_close(small[i], expected_small, "noise term |G_small|^2", rtol=1e-5)


def test_statistics_are_not_optimizer_state(tmp_path):
    model = helpers.make_model()
    optimizer = tf_vrgd.VRAdam(gradient_accumulation_steps=2, track_gsnr_statistics=True)
    optimizer.build(model.trainable_variables)
    assert not any("gsnr_statistics" in v.path for v in optimizer.variables)
    path = tf.train.Checkpoint(optimizer=optimizer).write(str(tmp_path / "ckpt"))
    names = [name for name, _ in tf.train.list_variables(path)]
    assert names and not any("gsnr_statistics" in name for name in names)


def _fit_data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 3)) + 0.3 * rng.normal(size=(n, 3))).astype(np.float32)
    return x, y


class _BatchLogs(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        if "gsnr_mean" in logs:
            self.batches.append(batch)


def test_monitor_logs_into_history_batches_and_tensorboard(strategy, tmp_path):
    pytest.importorskip("tensorboard")
    x, y = _fit_data()
    with strategy.scope():
        model = helpers.make_model()
        model.compile(
            optimizer=tf_vrgd.VRAdam(0.01, gamma=0.2, track_gsnr_statistics=True), loss="mse"
        )
    batch_logs = _BatchLogs()
    history = model.fit(
        x,
        y,
        batch_size=64,
        epochs=2,
        verbose=0,
        callbacks=[
            tf_vrgd.GSNRMonitor(update_freq=2),
            batch_logs,
            keras.callbacks.TensorBoard(str(tmp_path)),
        ],
    )
    # 4 batches per epoch, logged at batches 1 and 3 of each epoch.
    assert batch_logs.batches == [1, 3, 1, 3]
    # The epoch entries average the epoch's updates: the optimizer's own
    # statistics after fit cover exactly the last epoch (reset at its start).
    statistics = model.optimizer.gsnr_statistics()
    sizes = {v.path: np.prod(v.shape) for v in model.trainable_variables}
    for path, stats in statistics.items():
        assert stats["updates"] == 4
        for key, log_key in (
            ("mean_gsnr", "gsnr_mean"),
            ("fraction_at_gamma", "gsnr_at_gamma"),
            ("fraction_at_one", "gsnr_at_one"),
            ("mean_scale", "gsnr_scale"),
        ):
            values = history.history[f"{log_key}/{path}"]
            assert len(values) == 2 and values[-1] == pytest.approx(stats[key])
    at_one = sum(sizes[p] * s["fraction_at_one"] for p, s in statistics.items()) / sum(
        sizes.values()
    )
    assert history.history["gsnr_at_one"][-1] == pytest.approx(at_one)
    scale = sum(sizes[p] * s["mean_scale"] for p, s in statistics.items()) / sum(sizes.values())
    assert history.history["gsnr_scale"][-1] == pytest.approx(scale)
    assert 0.2 <= scale <= 1.0  # VR-Adam's phat lies in [gamma, 1] like r

    events = glob.glob(str(tmp_path / "train" / "events.out.tfevents.*"))
    assert events
    tags = {
        value.tag
        for event_file in events
        for record in tf.data.TFRecordDataset(event_file)
        for value in tf.compat.v1.Event.FromString(record.numpy()).summary.value
    }
    assert {
        "epoch_gsnr_mean",
        "epoch_gsnr_at_gamma",
        "epoch_gsnr_at_one",
        "epoch_gsnr_mean/sequential/dense/kernel",
    } <= tags


def test_monitor_finds_a_wrapped_vr_optimizer_and_refuses_others():
    x, y = _fit_data(64)
    model = helpers.make_model()
    model.compile(
        optimizer=tf_vrgd.LARC(
            tf_vrgd.VRSGD(0.01, gradient_accumulation_steps=2, track_gsnr_statistics=True)
        ),
        loss="mse",
    )
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        verbose=0,
        callbacks=[tf_vrgd.GSNRMonitor(per_variable=False)],
    )
    assert set(history.history) == {
        "loss",
        "gsnr_mean",
        "gsnr_at_gamma",
        "gsnr_at_one",
        "gsnr_scale",
    }
    assert np.isfinite(history.history["gsnr_mean"][0])

    model = helpers.make_model()
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    with pytest.raises(ValueError, match="GSNRMonitor needs a VR optimizer"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[tf_vrgd.GSNRMonitor()])


def test_statistics_are_off_by_default_and_say_how_to_turn_them_on():
    x, y = _fit_data(64)
    model = helpers.make_model()
    optimizer = tf_vrgd.VRSGD(0.01, gradient_accumulation_steps=2)
    assert tf_vrgd.VRSGD.from_config(optimizer.get_config()).track_gsnr_statistics is False
    model.compile(optimizer=optimizer, loss="mse")
    with pytest.raises(ValueError, match="track_gsnr_statistics=True"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[tf_vrgd.GSNRMonitor()])
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    for method in ("gsnr_statistics", "gsnr_statistic_sums", "reset_gsnr_statistics"):
        with pytest.raises(ValueError, match=f"{method}\\(\\) needs .*track_gsnr_statistics=True"):
            getattr(optimizer, method)()
    on = tf_vrgd.VRSGD(0.01, track_gsnr_statistics=True)
    assert tf_vrgd.VRSGD.from_config(on.get_config()).track_gsnr_statistics is True
    with pytest.raises(ValueError, match="track_gsnr_statistics"):
        tf_vrgd.VRSGD(0.01, track_gsnr_statistics="yes")


@pytest.mark.parametrize("update_freq", [0, -1, 1.5, True, "batch"])
def test_monitor_rejects_bad_update_freq(update_freq):
    with pytest.raises(ValueError, match="update_freq"):
        tf_vrgd.GSNRMonitor(update_freq=update_freq)


def test_batch_logs_between_gsnr_updates_hold_no_gsnr_entries():
    """gsnr_interval = 3: batch logs (update_freq=1) carry the statistics
    after a GSNR update only, never NaN; the epoch's are finite."""

    class Logs(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.batches = []

        def on_train_batch_end(self, batch, logs=None):
            values = [v for k, v in logs.items() if k.startswith("gsnr_")]
            assert all(np.isfinite(values)), (batch, logs)
            if values:
                self.batches.append(batch)

    x, y = _fit_data(16 * 12)
    model = helpers.make_model()
    # One device: k = 2 from two micro-steps; updates end on odd batches.
    model.compile(
        optimizer=tf_vrgd.VRSGD(
            0.01, gradient_accumulation_steps=2, gsnr_interval=3, track_gsnr_statistics=True
        ),
        loss="mse",
    )
    logs = Logs()
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        verbose=0,
        callbacks=[tf_vrgd.GSNRMonitor(update_freq=1), logs],
    )
    # Updates 1, 4 (GSNR updates 1, N + 1) end at batches 1 and 7.
    assert logs.batches == [1, 7]
    assert np.isfinite(history.history["gsnr_mean"][0])
