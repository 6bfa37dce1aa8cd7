"""The offline Fashion-MNIST pipeline and `vrgd-train`: verification of the
decoded data, resumable data order, and a kill -9 mid-run that resumes to
the weights of an uninterrupted run.

The data are synthetic IDX files with Fashion-MNIST's layout (60000/10000
examples, 28x28, ten balanced classes), built once per session through the
same tensorflow-datasets path as the real files.
"""

import gzip
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from tf_vrgd.experiments import data, experiment_config, fashion_mnist, run_folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write_idx(path, array):
    """IDX: magic (0, 0, 0x08 = uint8, ndim), big-endian dims, data."""
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(struct.pack(">BBBB", 0, 0, 8, array.ndim))
        f.write(struct.pack(f">{array.ndim}I", *array.shape))
        f.write(array.astype(np.uint8).tobytes())


def _synthetic_split(count, seed):
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(count) % 10).astype(np.uint8)
    images = np.zeros((count, 28, 28), np.uint8)
    for label in range(10):  # a bright horizontal band per class, plus noise
        images[labels == label, 2 * label + 4 : 2 * label + 8, 4:24] = 200
    noise = rng.integers(0, 60, size=(count, 28, 28), dtype=np.uint8)
    return images | (noise & 0b00110000), labels


@pytest.fixture(scope="session")
def fashion(tmp_path_factory):
    """(IDX folder, prepared tfds cache folder) of a synthetic Fashion-MNIST."""
    idx = tmp_path_factory.mktemp("fashion_idx")
    for prefix, count, seed in (("train", 60000, 0), ("t10k", 10000, 1)):
        images, labels = _synthetic_split(count, seed)
        _write_idx(idx / f"{prefix}-images-idx3-ubyte.gz", images)
        _write_idx(idx / f"{prefix}-labels-idx1-ubyte.gz", labels)
    cache = tmp_path_factory.mktemp("tfds")
    data.load(str(idx), str(cache))
    return str(idx), str(cache)


def test_load_decodes_and_verifies_through_tfds(fashion):
    (x, y), (xt, yt) = data.load(*fashion)
    assert x.shape == (60000, 28, 28, 1) and xt.shape == (10000, 28, 28, 1)
    assert np.bincount(y).tolist() == [6000] * 10 and np.bincount(yt).tolist() == [1000] * 10
    # The bands were written per class: the decoded images carry them.
    assert np.all(x[y == 3][:, 12, 10, 0] >= 200)
    assert os.path.exists(
        os.path.join(fashion[1], "fashion_mnist", "3.0.1", "fashion_mnist_arrays.npz")
    )


def test_truncated_file_is_named_and_leaves_nothing_prepared(fashion, tmp_path):
    idx = tmp_path / "idx"
    shutil.copytree(fashion[0], idx)
    path = idx / "train-images-idx3-ubyte.gz"
    with gzip.open(path, "rb") as f:
        content = f.read()
    with gzip.open(path, "wb") as f:  # a valid gzip whose IDX payload is cut short
        f.write(content[: 16 + 99984])
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte\.gz.*truncated"):
        data.load(str(idx), str(cache))
    # Nothing that a later run with good files would trip on.
    assert not (cache / "fashion_mnist" / "3.0.1").exists()
    checksums = cache / "fashion_mnist_local_checksums.tsv"
    assert not checksums.exists() or "train-images" not in checksums.read_text()


def test_missing_files_say_how_to_get_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        data.load(str(tmp_path), str(tmp_path / "cache"))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x, y: (x[:-1], y[:-1]), "expected \\(60000, 28, 28, 1\\)"),
        (lambda x, y: (x, np.where(y == 3, 4, y)), "class counts"),
        (lambda x, y: (np.zeros_like(x), y), "blank"),
    ],
)
def test_verification_rejects_wrong_content(change, message):
    images, labels = _synthetic_split(60000, 0)
    x, y = change(images[..., None], labels.astype(np.int64))
    with pytest.raises(ValueError, match=message):
        data.verify(x, y, "train")


def test_epoch_order_depends_only_on_seed_and_epoch():
    x = np.arange(40, dtype=np.uint8).reshape(40, 1, 1, 1).repeat(28, 1).repeat(28, 2)
    y = np.arange(40) % 10

    def labels(ds):
        return [b[1].numpy().tolist() for b in ds]

    full = labels(data.dataset(x, y, 8, seed=3, epochs=3))
    resumed = labels(data.dataset(x, y, 8, seed=3, epochs=3, initial_epoch=1))
    assert len(full) == 15 and resumed == full[5:]
    assert full[:5] != full[5:10]  # reshuffled every epoch
    assert sorted(label for batch in full[:5] for label in batch) == sorted(y.tolist())


def _command(fashion, output, epochs, compare=False):
    idx, cache = fashion
    return [
        sys.executable,
        "-m",
        "tf_vrgd.experiments.train",
        "--config",
        os.path.join(ROOT, "configs", "fashion_mnist", "vr_lamb_b256.yaml"),
        "--output",
        str(output),
        "--data-dir",
        idx,
        "--cache-dir",
        cache,
        "--train-examples",
        "2048",
        "--batch-size",
        "512",
        "--epochs",
        str(epochs),
        "--replicas",
        "2",
        "--deterministic",
        "--verbose",
        "0",
    ] + (["--compare"] if compare else [])


def _run_to_end(command):
    return subprocess.run(
        command, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))


def _final_weights(run_dir):
    with h5py.File(os.path.join(run_dir, "final.weights.h5"), "r") as f:
        arrays = {}
        f.visititems(
            lambda name, obj: (
                arrays.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None
            )
        )
    return arrays


def test_kill_9_mid_run_resumes_to_the_uninterrupted_weights(fashion, tmp_path):
    epochs = 2
    straight = tmp_path / "straight"
    done = _run_to_end(_command(fashion, straight, epochs))
    assert done.returncode == 0, done.stderr[-3000:]

    # VR-LAMB (the config), killed once its first epoch is checkpointed.
    interrupted = tmp_path / "interrupted"
    process = subprocess.Popen(
        _command(fashion, interrupted, epochs, compare=True),
        env=_env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    first = interrupted / "vr_lamb" / "checkpoint-epoch1.keras"
    deadline = time.time() + 300
    while not first.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert first.exists() and not (interrupted / "vr_lamb" / "final.weights.h5").exists()

    # The same command resumes it, then trains the twin (LAMB) and reports both.
    resumed = _run_to_end(_command(fashion, interrupted, epochs, compare=True))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming after epoch" in resumed.stdout
    expected, got = _final_weights(straight / "vr_lamb"), _final_weights(interrupted / "vr_lamb")
    assert expected.keys() == got.keys() and expected
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    with open(interrupted / "vr_lamb" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["epoch"] for r in records] == list(range(epochs))
    assert all(0 <= r["gsnr_at_gamma/conv1/kernel"] <= 1 for r in records)

    table = resumed.stdout[resumed.stdout.index("test_acc") :]
    assert "vr_lamb" in table and "\n   lamb" in table
    files = ("accuracy.png", "loss.png", "gsnr_vr_lamb.png", "noise_scale.png", "summary.json")
    for name in (*files, "summary.txt"):
        assert (interrupted / name).exists(), name
    # The gradient noise scale of the VR run at its first and last epoch
    # (a finite positive number here), none for LAMB.
    rows = {
        row["run"]: row for row in json.loads((interrupted / "summary.json").read_text())["runs"]
    }
    vr_start, vr_end = rows["vr_lamb"]["noise_scale_start"], rows["vr_lamb"]["noise_scale_end"]
    assert all(np.isfinite(v) and v > 0 for v in (vr_start, vr_end)), (vr_start, vr_end)
    assert vr_end == records[-1]["noise_scale"]
    assert np.isnan(rows["lamb"]["noise_scale_start"])
    assert "noise_scale_start" in resumed.stdout


def test_overrides_rescale_the_schedule_and_the_rate():
    from tf_vrgd import config
    from tf_vrgd.experiments import train

    path = os.path.join(ROOT, "configs", "fashion_mnist", "lamb_b8192.yaml")
    cfg = config.load(path)
    args = train.parse_args(
        ["--config", path, "--output", "unused", "--batch-size", "2048", "--epochs", "2"]
    )
    experiment = fashion_mnist.Experiment.from_args(cfg, args)
    assert (experiment.batch_size, experiment.epochs, experiment.steps_per_epoch) == (2048, 2, 29)
    lr = experiment.block["learning_rate"]["cosine"]
    original = cfg["trainer"]["optimizer_config"]["learning_rate"]["cosine"]
    assert lr["initial_learning_rate"] == pytest.approx(original["initial_learning_rate"] * 0.5)
    assert lr["decay_steps"] == 58  # 2 epochs x 29 steps
    assert experiment.block["warmup"]["linear"]["warmup_steps"] == round(7 * 58 / 70)
    assert "rescaled from 70 to 58 steps" in experiment.note
    with pytest.raises(SystemExit):
        train.parse_args(["--config", path, "--output", "x", "--epochs", "0"])
    with pytest.raises(ValueError, match="does not split over 3 replicas"):
        fashion_mnist.Experiment(cfg, replicas=3)


def _experiment(argv):
    from tf_vrgd import config
    from tf_vrgd.experiments import train

    args = train.parse_args(argv)
    return fashion_mnist.Experiment.from_args(config.load(args.config), args), args


def test_resume_with_other_settings_is_refused_until_restart(tmp_path):

    config_path = os.path.join(ROOT, "configs", "fashion_mnist", "lamb_b8192.yaml")
    base = ["--config", config_path, "--output", str(tmp_path)]
    experiment, args = _experiment(base + ["--epochs", "1"])
    run_folder.check_settings(str(tmp_path), experiment.settings(args.compare), restart=False)
    run_dir = tmp_path / "lamb"
    run_dir.mkdir()
    (run_dir / "checkpoint-epoch1.keras").write_text("")
    (run_dir / "metrics.jsonl").write_text("")
    # The same command resumes.
    run_folder.check_settings(str(tmp_path), experiment.settings(args.compare), restart=False)
    for change, said in (
        (["--epochs", "2"], "epochs: 1 then, 2 now"),
        (["--epochs", "1", "--seed", "5"], "seed: 0 then, 5 now"),
        (["--epochs", "1", "--batch-size", "4096"], "batch_size"),
        (["--epochs", "1", "--compare"], "compare"),
    ):
        experiment, args = _experiment(base + change)
        with pytest.raises(SystemExit, match=f"{said}.*--restart"):
            run_folder.check_settings(
                str(tmp_path), experiment.settings(args.compare), restart=False
            )
    other = os.path.join(ROOT, "configs", "fashion_mnist", "adam_b8192.yaml")
    experiment, args = _experiment(["--config", other, "--output", str(tmp_path), "--epochs", "1"])
    with pytest.raises(SystemExit, match="config"):
        run_folder.check_settings(str(tmp_path), experiment.settings(args.compare), restart=False)
    # --restart discards the old run and records the new settings.
    run_folder.check_settings(str(tmp_path), experiment.settings(args.compare), restart=True)
    assert not run_dir.exists()
    run_folder.check_settings(str(tmp_path), experiment.settings(args.compare), restart=False)


def test_settings_mismatch_names_the_changed_fields(tmp_path):
    """A change deep in the config shows as its dotted path with both values
    (the whole config was cut to one 77-character prefix on both sides)."""

    settings = {
        "config": {
            "task": {"model": {"type": "dlrm", "embedding_dim": 128}},
            "trainer": {"optimizer_config": {"optimizer": {"type": "vr_sgd"}}},
        },
        "seed": 0,
    }
    run_folder.check_settings(str(tmp_path), settings, restart=False)
    changed = json.loads(json.dumps(settings))
    changed["config"]["trainer"]["optimizer_config"]["optimizer"]["type"] = "sgd"
    changed["config"]["task"]["train_data"] = {"input_path": "/data/day_*"}
    with pytest.raises(SystemExit) as raised:
        run_folder.check_settings(str(tmp_path), changed, restart=False)
    message = str(raised.value)
    assert 'config.trainer.optimizer_config.optimizer.type: "vr_sgd" then, "sgd" now' in message
    assert 'config.task.train_data.input_path: "(unset)" then, "/data/day_*" now' in message
    assert "embedding_dim" not in message and "seed" not in message


def test_partial_checkpoints_are_removed(tmp_path):

    for name in ("tmp1234.keras", "tmp99.keras", "checkpoint-epoch2.keras", "notes.txt"):
        (tmp_path / name).write_text("")
    run_folder.remove_partial_checkpoints(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-epoch2.keras", "notes.txt"]


def test_compare_checks_every_run_before_training(tmp_path):

    config_path = os.path.join(ROOT, "configs", "fashion_mnist", "lamb_b8192.yaml")
    experiment, _ = _experiment(
        ["--config", config_path, "--output", str(tmp_path), "--replicas", "1", "--compare"]
    )
    experiment_config.check_runs(experiment, compare=False)  # LAMB alone trains on one replica
    with pytest.raises(SystemExit, match=r"'vr_lamb' cannot train.*k >= 2"):
        experiment_config.check_runs(experiment, compare=True)


def test_a_larc_block_counts_its_inner_optimizers_micro_steps():
    from tf_vrgd import config

    path = os.path.join(ROOT, "configs", "fashion_mnist", "lamb_b8192.yaml")
    cfg = config.load(path)
    block = cfg["trainer"]["optimizer_config"]
    inner = {
        "type": "lamb",
        "lamb": {**block["optimizer"]["lamb"], "gradient_accumulation_steps": 2},
    }
    block["optimizer"] = {"type": "larc", "larc": {"optimizer": inner}}
    experiment = fashion_mnist.Experiment(cfg, batch_size=2048, epochs=2)
    # 2 epochs of 29 batches of 2048 are 29 updates of 2 micro-steps.
    assert experiment.steps_per_epoch == 29
    assert experiment.block["learning_rate"]["cosine"]["decay_steps"] == 29


def test_an_output_that_cannot_be_a_folder_is_named(tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("")
    for output, cause in (
        (taken, "a file of that name exists"),
        (taken / "sub", "Not a directory"),
    ):
        with pytest.raises(SystemExit) as raised:
            run_folder.prepare_folder(str(output))
        assert str(raised.value) == (
            f"vrgd-train: --output {output} cannot be used as the run's folder ({cause})."
        )


def test_a_failed_checkpoint_write_leaves_no_partial_file_and_names_the_path(tmp_path):
    import errno

    class FullDisk:
        def save(self, path):
            with open(path, "w") as f:
                f.write("half a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    (tmp_path / "checkpoint-epoch1.keras").write_text("intact")
    with pytest.raises(SystemExit) as raised:
        run_folder.save_checkpoint(FullDisk(), str(tmp_path), 2)
    message = str(raised.value)
    assert str(tmp_path / "checkpoint-epoch2.keras") in message
    assert "No space left on device" in message and "resume" in message
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-epoch1.keras"]


def test_a_second_run_on_a_live_folder_is_refused_until_the_first_ends(tmp_path):
    """The lock is the system's: a killed holder leaves nothing stuck."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from tf_vrgd.experiments import run_folder; "
            "run_folder.lock_folder(sys.argv[1]); print('held', flush=True); time.sleep(120)",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit, match=rf"in use by another run \(process {holder.pid}\)"):
            run_folder.lock_folder(str(tmp_path))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    run_folder.lock_folder(str(tmp_path))  # taken now
    run_folder.lock_folder(str(tmp_path))  # and again in the same process


def test_an_adascale_run_ends_when_tau_reaches_its_updates_and_stays_ended(fashion, tmp_path):
    """vrgd-train with an `adascale` block: the gain, tau and the updates in
    each epoch's record; the run ends once tau reaches the planned updates
    (8 epochs of 8), before the last epoch (k = 2 samples, S = 4); running
    it again adds nothing."""
    command = _command(fashion, tmp_path / "out", 8)
    for flag, value in (
        ("--config", os.path.join(ROOT, "configs", "fashion_mnist", "momentum_b256.yaml")),
        ("--batch-size", "16"),  # 8 examples a sample: a noisy gradient, a gain well over 1
        ("--train-examples", "128"),
    ):
        command[command.index(flag) + 1] = value
    inner = {"type": "sgd", "sgd": {}}
    block = {"type": "adascale", "adascale": {"scale": 4, "optimizer": inner}}
    command += ["--override", f"trainer.optimizer_config.optimizer={json.dumps(block)}"]
    # A constant base rate: the recorded rate is then the gain times it.
    constant = {"type": "constant", "constant": {"learning_rate": 0.05}}
    command += ["--override", f"trainer.optimizer_config.learning_rate={json.dumps(constant)}"]
    command += ["--override", "trainer.optimizer_config.warmup={}"]
    done = _run_to_end(command)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run_dir,) = [p for p in (tmp_path / "out").iterdir() if (p / "metrics.jsonl").exists()]
    records = run_folder.read_records(str(run_dir / "metrics.jsonl"), 8)
    last = records[-1]
    assert last["scale_invariant_steps"] >= 32 > last["updates"]
    assert len(records) < 8 and 1.0 < last["adascale_gain"] <= 4.0
    # The rate applied at the epoch's last update, not the base rate (0.05
    # scaled by sqrt(16 / 256) for the batch).
    for record in records:
        expected = 0.05 * (16 / 256) ** 0.5 * record["adascale_gain"]
        assert record["learning_rate"] == pytest.approx(expected, rel=1e-6)
    # The noise scale from the same averages: with rho = B_simple / B0 (B0
    # = 16 / 4 examples), the gain is (rho + 1) / (rho / S + 1).
    rho = last["noise_scale"] / 4
    assert last["adascale_gain"] == pytest.approx((rho + 1) / (rho / 4 + 1), rel=1e-5)
    again = _run_to_end(command)
    assert again.returncode == 0, again.stderr[-2000:]
    assert run_folder.read_records(str(run_dir / "metrics.jsonl"), 8) == records
