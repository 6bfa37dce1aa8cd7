"""The paper's tasks: their input pipelines decode the real file formats
(files written here, compared with numpy), and `vrgd-train` trains each
task, from files and `--synthetic`, with its VR twin, on 2 replicas."""

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import tensorflow as tf

from tests import helpers, task_data
from tf_vrgd.experiments import experiment_config, image_task, run_folder, tasks, train

ROOT, PAPER = task_data.ROOT, task_data.PAPER
TINY_BERT, TINY_CIFAR, TINY_DLRM = task_data.TINY_BERT, task_data.TINY_CIFAR, task_data.TINY_DLRM
_cfg = task_data.paper_config


def test_both_experiments_are_what_vrgd_train_reads():
    from tf_vrgd import config
    from tf_vrgd.experiments import fashion_mnist, task_runs

    fashion = fashion_mnist.Experiment(
        config.load(os.path.join(ROOT, "configs", "fashion_mnist", "vr_adam_b4096.yaml"))
    )
    task = task_runs.TaskExperiment(_cfg("dlrm_vr_sgd_64k.yaml", TINY_DLRM), synthetic=True)
    for experiment in (fashion, task):
        assert isinstance(experiment, experiment_config.Experiment)
        assert [name for name, _ in experiment.runs(True)][1:] in (["adam"], ["sgd"])
        assert experiment.settings(True)["compare"] is True


# --- input pipelines --------------------------------------------------------------


def test_bert_records_decode_to_the_written_features(tmp_path):
    path = str(tmp_path / "bert.tfrecord")
    written = task_data.write_bert_records(path, 6, 16, 4, 200)
    cfg = _cfg(
        "bert_large_vr_lamb_32k_phase1.yaml", {**TINY_BERT, "task.train_data.input_path": path}
    )
    task = tasks.from_config(cfg)
    assert task.dataset("validation", 6, seed=0) is None  # no validation files named
    # The first batch of the shuffled train split: all six, in some order.
    x, y, weights = next(iter(task.dataset("train", 6, seed=0)))
    got = sorted(map(tuple, x["token_ids"].numpy().tolist()))
    assert got == sorted(tuple(e["input_ids"].tolist()) for e in written)
    by_ids = {tuple(e["input_ids"].tolist()): e for e in written}
    for i in range(6):
        e = by_ids[tuple(x["token_ids"][i].numpy().tolist())]
        np.testing.assert_array_equal(x["padding_mask"][i], e["input_mask"])
        np.testing.assert_array_equal(x["segment_ids"][i], e["segment_ids"])
        np.testing.assert_array_equal(x["mask_positions"][i], e["masked_lm_positions"])
        np.testing.assert_array_equal(y["mlm"][i], e["masked_lm_ids"])
        np.testing.assert_array_equal(weights["mlm"][i], e["masked_lm_weights"])
        assert int(y["nsp"][i]) == int(e["next_sentence_labels"][0])


@pytest.mark.parametrize("python", [False, True], ids=["binary", "python"])
def test_cifar_batches_decode_to_the_written_images(tmp_path, python):
    written = task_data.write_cifar(str(tmp_path), 3, python=python)
    cfg = _cfg(
        "cifar10_resnet56_momentum_1k.yaml",
        {"task.validation_data.input_path": str(tmp_path)},
    )
    task = tasks.from_config(cfg)

    def decoded(training):
        files, reader, decode = task._cifar(str(tmp_path), training=training)
        return next(iter(reader(files).map(decode).batch(100)))

    images, labels = decoded(training=False)
    np.testing.assert_array_equal(images.numpy(), written["test"][0])
    np.testing.assert_array_equal(labels.numpy(), written["test"][1])
    images, labels = decoded(training=True)
    np.testing.assert_array_equal(images.numpy(), written["train"][0])
    # Evaluation input: standardised per channel, labels one-hot.
    x, y = next(iter(task.dataset("validation", 2, seed=0)))
    expected = (
        written["test"][0][:2].astype(np.float64) - image_task.CIFAR_MEAN
    ) / image_task.CIFAR_STD
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.argmax(y.numpy(), 1), written["test"][1][:2])


def test_cifar_folder_without_batches_is_named(tmp_path):
    cfg = _cfg("cifar10_resnet56_momentum_1k.yaml", {"task.train_data.input_path": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match=r"data_batch_1\.bin"):
        tasks.from_config(cfg).dataset("train", 4, seed=0)


def test_imagenet_records_decode_crop_and_resize(tmp_path):
    path = str(tmp_path / "train.tfrecord")
    labels = task_data.write_imagenet_records(path, 4, size=(48, 64))
    cfg = _cfg(
        "imagenet_resnet50_vr_lars_32k.yaml",
        {
            "task.model.input_size": [24, 24, 3],
            "task.train_data.input_path": path,
            "task.validation_data.input_path": path,
        },
    )
    task = tasks.from_config(cfg)
    x, y = next(iter(task.dataset("validation", 4, seed=0)))
    assert x.shape == (4, 24, 24, 3)
    assert y.shape == (4, 1001)
    np.testing.assert_array_equal(np.argmax(y.numpy(), 1), labels)
    # Standardised: ImageNet's mean maps near 0 (random pixels average 127.5).
    assert abs(float(tf.reduce_mean(x))) < 0.5
    x, _ = next(iter(task.dataset("train", 4, seed=0)))
    assert x.shape == (4, 24, 24, 3)


def test_criteo_lines_parse_to_log_dense_and_hashed_categories(tmp_path):
    path = str(tmp_path / "day_0.tsv")
    labels, dense = task_data.write_criteo(path, 10)
    cfg = _cfg("dlrm_sgd_64k.yaml", {**TINY_DLRM, "task.validation_data.input_path": path})
    features, y = next(iter(tasks.from_config(cfg).dataset("validation", 10, seed=0)))
    np.testing.assert_array_equal(y.numpy()[:, 0], labels)
    expected = np.log1p(np.maximum(np.nan_to_num(dense, nan=0.0), 0.0))
    np.testing.assert_allclose(features["dense_features"].numpy(), expected, rtol=1e-6)
    sparse = features["sparse_features"].numpy()
    assert sparse.shape == (10, 26)
    assert sparse.min() >= 0 and sparse.max() < 40


def _training_dataset(kind, tmp_path):
    """A task's training dataset over 12 written examples (CIFAR: 10), 4 a batch."""
    if kind == "bert":
        path = str(tmp_path / "bert.tfrecord")
        task_data.write_bert_records(path, 12, 16, 4, 200)
        name, overrides = "bert_large_vr_lamb_32k_phase1.yaml", TINY_BERT
    elif kind == "cifar":
        path = str(tmp_path)
        task_data.write_cifar(path, 2)  # 5 files x 2
        name, overrides = "cifar10_resnet56_momentum_1k.yaml", {}
    elif kind == "imagenet":
        path = str(tmp_path / "train.tfrecord")
        task_data.write_imagenet_records(path, 12, size=(48, 64))
        name, overrides = (
            "imagenet_resnet50_vr_lars_32k.yaml",
            {"task.model.input_size": [24, 24, 3]},
        )
    else:
        path = str(tmp_path / "day_0.tsv")
        task_data.write_criteo(path, 12)
        name, overrides = "dlrm_sgd_64k.yaml", TINY_DLRM
    task = tasks.from_config(_cfg(name, {**overrides, "task.train_data.input_path": path}))
    return lambda seed: task.dataset("train", 4, seed=seed)


@pytest.mark.parametrize("kind", ["bert", "cifar", "imagenet", "dlrm"])
def test_training_stream_is_the_same_in_every_iterator(kind, tmp_path):
    """Keras' fit reads a batch from one iterator to build its metrics, then
    trains from a second: both must read the stream the seed fixes, however
    far ahead the first read (here past the end of the first pass), or a
    resumed run sees other examples, crops and flips than the uninterrupted
    one. Each pass is reshuffled; another seed gives another stream."""
    dataset = _training_dataset(kind, tmp_path)
    ds = dataset(seed=3)
    first = iter(ds)
    ahead = [task_data.flat(next(first)) for _ in range(7)]
    second = [task_data.flat(b) for b in ds.take(7)]
    for a, b in zip(ahead, second, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
    # The second pass (batches 3..5) is another order of the same examples.
    key = 0 if kind != "dlrm" else 1  # an array that tells the examples apart
    one = np.concatenate([b[key] for b in ahead[:3]]).reshape(12, -1)
    two = np.concatenate([b[key] for b in ahead[3:6]]).reshape(12, -1)
    if kind not in ("cifar", "imagenet"):  # images: crops differ between passes
        assert sorted(map(tuple, one.tolist())) == sorted(map(tuple, two.tolist()))
    assert not np.array_equal(one, two)
    other = task_data.flat(next(iter(dataset(seed=4))))
    assert any(not np.array_equal(x, y) for x, y in zip(ahead[0], other, strict=True))


@pytest.mark.parametrize("files", [1, 2])
def test_input_pipelines_of_workers_split_the_records(files, tmp_path):
    """Each worker of a multi-worker run reads its own part: every n-th
    file where there are files enough, else every n-th record; together
    the parts hold each record once."""
    lines = []
    for i in range(files):
        path = str(tmp_path / f"day_{i}.tsv")
        task_data.write_criteo(path, 6, seed=i)
        with open(path) as f:
            lines += f.read().splitlines()
    pattern = str(tmp_path / "day_*.tsv")
    task = tasks.from_config(
        _cfg("dlrm_sgd_64k.yaml", {**TINY_DLRM, "task.validation_data.input_path": pattern})
    )
    parts = []
    for index in range(2):
        ds = task.dataset("validation", 1, seed=0, shard=(2, index))
        parts.append([float(labels[0, 0]) for _, labels in ds])
    written = [float(line.split("\t")[0]) for line in lines]
    if files == 2:  # a file each
        assert parts == [written[:6], written[6:]]
    else:  # every other record
        assert parts == [written[0::2], written[1::2]]


@pytest.mark.parametrize(
    "kind, overrides, message",
    [
        (
            "bert",
            {"task.train_data.seq_length": 32},
            r"input_ids holds 16 int64_list values where the config expects "
            r"task.train_data.seq_length 32",
        ),
        (
            "bert",
            {"task.train_data.max_predictions_per_seq": 6},
            r"masked_lm_positions holds 4 .*\.max_predictions_per_seq 6",
        ),
        ("imagenet", {"task.model.num_classes": 10}, r"not one label in \[0, 10\)"),
        (
            "dlrm",
            {"task.model.vocab_sizes": [40] * 20},
            r"has 40 tab-separated fields; the config expects 34",
        ),
    ],
)
def test_files_that_do_not_match_the_config_are_named_before_training(
    kind, overrides, message, tmp_path
):
    """Records of another layout than the config's stop the run at once,
    with the file and the field, not with a parse error inside `fit`."""
    from tf_vrgd.experiments import task_runs

    if kind == "bert":
        path = str(tmp_path / "bert.tfrecord")
        task_data.write_bert_records(path, 4, 16, 4, 200)
        name, base = "bert_large_vr_lamb_32k_phase1.yaml", TINY_BERT
    elif kind == "imagenet":
        path = str(tmp_path / "train.tfrecord")
        task_data.write_imagenet_records(path, 4, size=(8, 8))
        name, base = "imagenet_resnet50_vr_lars_32k.yaml", {}
    else:
        path = str(tmp_path / "day_0.tsv")
        task_data.write_criteo(path, 4)
        name, base = "dlrm_vr_sgd_64k.yaml", TINY_DLRM
    cfg = _cfg(name, {**base, "task.train_data.input_path": path})
    task_runs.TaskExperiment(cfg, replicas=2).check_input()  # as written: no complaint
    cfg = _cfg(name, {**base, **overrides, "task.train_data.input_path": path})
    with pytest.raises(ValueError, match=message) as error:
        task_runs.TaskExperiment(cfg, replicas=2).check_input()
    assert str(error.value).startswith(f"task.train_data: {path}: ")


def test_overrides_set_nested_fields_as_yaml():
    cfg = experiment_config.apply_overrides(
        {"task": {"model": {"type": "dlrm"}}},
        ["task.model.vocab_sizes=[3, 4]", "task.train_data.input_path=/x/*.tsv", "a.b=0.5"],
    )
    assert cfg["task"]["model"]["vocab_sizes"] == [3, 4]
    assert cfg["task"]["train_data"]["input_path"] == "/x/*.tsv"
    assert cfg["a"]["b"] == 0.5
    with pytest.raises(ValueError, match="is a value, not a block"):
        experiment_config.apply_overrides(cfg, ["task.model.type.x=1"])
    with pytest.raises(ValueError, match=r"DOTTED\.KEY=VALUE"):
        experiment_config.apply_overrides(cfg, ["task.model.type"])


def test_a_larc_block_counts_its_inner_optimizers_micro_steps():
    from tf_vrgd.experiments import experiment_config, task_runs

    inner = {"type": "vr_lars", "vr_lars": {"gradient_accumulation_steps": 4}}
    larc = {"type": "larc", "larc": {"trust_coefficient": 0.001, "optimizer": inner}}
    cfg = _cfg(
        "imagenet_resnet50_vr_lars_32k.yaml",
        {"trainer.optimizer_config.optimizer": larc, "task.train_data.global_batch_size": 64},
    )
    experiment = task_runs.TaskExperiment(cfg, replicas=2)
    # One Keras batch is a micro-step: 64 examples per update in 4 of 16.
    assert (experiment.accumulation, experiment.step_batch) == (4, 16)
    with pytest.raises(ValueError, match="does not split into 4 accumulation steps over 2"):
        task_runs.TaskExperiment(
            experiment_config.apply_overrides(cfg, ["task.train_data.global_batch_size=36"]),
            replicas=2,
        )


def test_every_paper_config_builds_its_task():
    names = sorted(os.listdir(PAPER))
    kinds = set()
    for name in names:
        task = tasks.from_config(_cfg(name, {}))
        kinds.add(task.name)
    assert kinds == {"bert", "image_classification", "dlrm"}


@pytest.mark.parametrize("depth", [8, 20])
def test_cifar_resnet_has_the_depth_it_is_named_for(depth):
    # He et al.'s count: the first convolution, two per basic block (3
    # stages of n), the classifier; the 1x1 projections are not counted.
    cfg = _cfg("cifar10_resnet56_momentum_1k.yaml", {"task.model.resnet.model_id": depth})
    model = tasks.from_config(cfg).build_model()
    counted = [
        layer
        for layer in model.layers
        if isinstance(layer, tf.keras.layers.Dense)
        or (isinstance(layer, tf.keras.layers.Conv2D) and layer.kernel_size == (3, 3))
    ]
    assert len(counted) == depth


@pytest.mark.parametrize("depth", [50, 101, 152])
def test_imagenet_depths_name_the_imagenet_resnet(depth):
    # 50 and 152 are of the form 6n + 2 too: the ImageNet ResNet wins.
    cfg = _cfg("imagenet_resnet50_vr_lars_32k.yaml", {"task.model.resnet.model_id": depth})
    assert not tasks.from_config(cfg).cifar


@pytest.mark.parametrize("depth", [2, 21, 34])
def test_cifar_resnet_depths_other_than_6n_plus_2_are_refused(depth):
    cfg = _cfg("cifar10_resnet56_momentum_1k.yaml", {"task.model.resnet.model_id": depth})
    with pytest.raises(ValueError, match=rf"6n \+ 2 .*Received: {depth}"):
        tasks.from_config(cfg)


# --- vrgd-train ---------------------------------------------------------------------


def _train(config, output, overrides, *extra):
    command = [
        sys.executable,
        "-m",
        "tf_vrgd.experiments.train",
        "--config",
        os.path.join(PAPER, config),
        "--output",
        str(output),
        "--replicas",
        "2",
        "--verbose",
        "0",
        "--deterministic",
        *extra,
    ]
    for key, value in overrides.items():
        command += ["--override", f"{key}={json.dumps(value)}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# Each task once from files (with its twin, and with a resume) and once
# synthetic. Rates are raised so that a few updates move the loss.
TASK_RUNS = {
    "bert": (
        "bert_large_vr_lamb_32k_phase1.yaml",
        {
            **TINY_BERT,
            "trainer.optimizer_config.learning_rate.polynomial.initial_learning_rate": 0.05,
        },
        "bert.tfrecord",
    ),
    "resnet": (
        "cifar10_resnet56_vr_momentum_1k.yaml",
        {**TINY_CIFAR, "trainer.optimizer_config.learning_rate.cosine.initial_learning_rate": 0.05},
        "cifar",
    ),
    "dlrm": (
        "dlrm_vr_sgd_64k.yaml",
        {
            **TINY_DLRM,
            "trainer.optimizer_config.learning_rate.delayed_polynomial.initial_learning_rate": 0.5,
        },
        "criteo.tsv",
    ),
}


def _write(kind, path):
    # One label throughout: the loss' mean gradient stands out of the
    # noise of 3 updates of a few examples, so the noise scale is resolved.
    if kind == "bert":
        task_data.write_bert_records(path, 32, 16, 4, 200)
    elif kind == "resnet":
        task_data.write_cifar(path, 16, label=3)
    else:
        task_data.write_criteo(path, 64, label=1)


@pytest.mark.parametrize("kind", TASK_RUNS)
def test_task_trains_from_files_with_its_twin_and_resumes(kind, tmp_path):
    config, overrides, data = TASK_RUNS[kind]
    path = str(tmp_path / data)
    _write(kind, path)
    overrides = {
        **overrides,
        "task.train_data.input_path": path,
        "task.validation_data.input_path": path,
        "trainer.checkpoint_interval": 3,
        "trainer.validation_steps": 1,
        "trainer.max_to_keep": 2,
    }
    output = tmp_path / "run"
    _train(config, output, overrides, "--train-steps", "6", "--compare")
    summary = json.loads((output / "summary.json").read_text())
    runs = {row["run"]: row for row in summary["runs"]}
    vr = next(name for name in runs if name.startswith("vr_"))
    base = vr.removeprefix("vr_")
    assert set(runs) == {vr, base}
    # The VR run's gradient noise scale at its first and last interval,
    # the last interval's record; none for the base optimizer.
    noise_scale_end = runs[vr]["noise_scale_end"]
    assert np.isfinite(noise_scale_end) and noise_scale_end > 0, noise_scale_end
    assert noise_scale_end == _records(output / vr)[-1]["train_noise_scale"]
    assert np.isnan(runs[base]["noise_scale_end"])
    for name in (vr, base):
        records = _records(output / name)
        assert [r["updates"] for r in records] == [3, 6]
        assert all(np.isfinite(r["train_loss"]) for r in records)
        assert all(r["examples_per_second"] > 0 for r in records)
        assert any(k.startswith("validation_") for k in records[-1])
    assert any(k.startswith("gsnr_scale/") for k in _records(output / vr)[-1])

    # Resume: drop the last checkpoint of the twin (DLRM's: cut it short, so
    # that the rerun must name it and skip it) and rerun the command; the
    # optimizer state and the input order come back, so the weights are the
    # uninterrupted run's.
    _check_resume(
        output / vr,
        lambda: _train(config, output, overrides, "--train-steps", "6", "--compare"),
        [3, 6],
        rtol=1e-4,
        truncate=kind == "dlrm",
    )


def test_unreadable_checkpoints_are_named_and_left_out(tmp_path, capsys):
    good = tmp_path / "checkpoint-epoch1.keras"
    with zipfile.ZipFile(good, "w") as archive:
        archive.writestr("config.json", "{}")
    (tmp_path / "checkpoint-epoch2.keras").write_bytes(good.read_bytes()[:-10])
    (tmp_path / "checkpoint-epoch3.keras").write_bytes(b"")
    assert run_folder.resumable_checkpoints(str(tmp_path), "run") == {1: str(good)}
    said = capsys.readouterr().out
    assert f"[run] {tmp_path / 'checkpoint-epoch3.keras'} is unreadable (BadZipFile" in said
    assert f"[run] {tmp_path / 'checkpoint-epoch2.keras'} is unreadable" in said
    assert run_folder.resumable_checkpoints(str(tmp_path / "none"), "run") == {}


def _check_resume(run_dir, rerun, updates, rtol, truncate=False):
    """Removes the run's last checkpoint (after 2 intervals), or with
    `truncate` cuts it to half its bytes, reruns its command (`rerun()`
    returns the output) and checks it resumed after interval 1 (naming a
    truncated checkpoint as unreadable) to the uninterrupted run's records
    and final weights."""
    uninterrupted = _weights(run_dir / "final.weights.h5")
    newest = run_dir / "checkpoint-epoch2.keras"
    if truncate:
        content = newest.read_bytes()
        newest.write_bytes(content[: len(content) // 2])
    else:
        os.remove(newest)
    first = _records(run_dir)[0]
    text = rerun()
    assert f"[{run_dir.name}] resuming after interval 1" in text
    assert (f"{newest} is unreadable" in text) == truncate
    records = _records(run_dir)
    assert [r["updates"] for r in records] == updates
    assert records[0] == first
    resumed = _weights(run_dir / "final.weights.h5")
    assert resumed.keys() == uninterrupted.keys()
    for key in uninterrupted:
        np.testing.assert_allclose(resumed[key], uninterrupted[key], rtol=rtol, atol=rtol / 100)


def _run_workers(config, outputs, overrides, *extra):
    """`vrgd-train` as one process per entry of `outputs` (its --output),
    with TF_CONFIG on 127.0.0.1 ports; returns their exit codes and output."""

    cluster = {"worker": [f"127.0.0.1:{port}" for port in helpers.free_ports(len(outputs))]}
    processes = []
    for index, output in enumerate(outputs):
        command = [sys.executable, "-m", "tf_vrgd.experiments.train", "--config"]
        command += [os.path.join(PAPER, config), "--output", str(output), "--verbose", "0"]
        command += ["--deterministic", *extra]
        for key, value in overrides.items():
            command += ["--override", f"{key}={json.dumps(value)}"]
        task = {"type": "worker", "index": index}
        env = dict(
            os.environ,
            TF_CONFIG=json.dumps({"cluster": cluster, "task": task}),
            PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
        )
        processes.append(
            subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    try:
        texts = [p.communicate(timeout=600)[0].decode() for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in processes], texts


def _train_on_workers(config, output, overrides, *extra, workers=2):
    """Two workers (by default) sharing `output`; returns the chief's output."""
    codes, texts = _run_workers(config, [output] * workers, overrides, *extra)
    assert codes == [0] * workers, "\n".join(t[-3000:] for t in texts)
    return texts[0]


@pytest.mark.parametrize(
    "tf_config, flags, message",
    [
        (
            '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {}}',
            ["--replicas", "2"],
            "--replicas is for one machine",
        ),
        (
            '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {}}',
            ["--restart"],
            "must clear --output",
        ),
        ("not json", [], "TF_CONFIG must be JSON"),
        ('{"cluster": {"worker": ["127.0.0.1:1"]}}', [], "TF_CONFIG must be JSON"),
        (
            '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 1}}',
            [],
            r"task index 1 is out of range: cluster\['worker'\] has 1 address",
        ),
        (
            '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "ps", "index": 0}}',
            [],
            r"task type 'ps' is not in the cluster \(worker\)",
        ),
        (
            '{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {}}',
            [],
            r"'task' must be",
        ),
        ('{"cluster": {"ps": ["127.0.0.1:1"]}, "task": {}}', [], "'ps' is not chief"),
    ],
)
def test_multi_worker_flags_are_checked(monkeypatch, tmp_path, tf_config, flags, message):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    config = os.path.join(PAPER, "dlrm_vr_sgd_64k.yaml")
    with pytest.raises(SystemExit, match=message):
        train.main(["--config", config, "--output", str(tmp_path), "--synthetic", *flags])


def _lone_worker(tmp_path, *flags):
    """A worker of a two-worker cluster whose other worker never starts."""

    ports = helpers.free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in ports]}
    command = [sys.executable, "-m", "tf_vrgd.experiments.train", "--config"]
    command += [os.path.join(PAPER, "dlrm_vr_sgd_64k.yaml"), "--output", str(tmp_path)]
    command += ["--synthetic", "--train-steps", "2", *flags]
    for key, value in TINY_DLRM.items():
        command += ["--override", f"{key}={json.dumps(value)}"]
    env = dict(
        os.environ,
        TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}}),
        PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    )
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return process, f"worker 1 (127.0.0.1:{ports[1]})"


def test_a_worker_alone_says_what_it_waits_for_and_gives_up(tmp_path):
    process, other = _lone_worker(tmp_path, "--worker-timeout", "5")
    try:
        text, _ = process.communicate(timeout=300)
    finally:
        process.kill()
    assert f"worker 0 waiting for {other} to connect (up to 5 s" in text
    assert (
        f"vrgd-train: not every task of TF_CONFIG's cluster connected within 5 s "
        f"(waiting for {other})"
    ) in text
    assert process.returncode == 1


def test_a_waiting_worker_ends_on_sigterm(tmp_path):
    import signal
    import time

    process, other = _lone_worker(tmp_path)
    try:
        lines = []
        start = time.monotonic()
        for line in process.stdout:  # until it says it waits
            lines.append(line)
            if "waiting for" in line or time.monotonic() - start > 240:
                break
        time.sleep(3)  # inside TensorFlow's wait by now
        process.send_signal(signal.SIGTERM)
        text, _ = process.communicate(timeout=60)
    finally:
        process.kill()
    assert f"vrgd-train: SIGTERM while waiting for {other}." in "".join(lines) + text
    assert process.returncode == 1


def test_task_trains_on_two_workers_and_resumes(tmp_path):
    """With TF_CONFIG, vrgd-train runs MultiWorkerMirroredStrategy: two
    worker processes (one CPU replica each, so k = 2), each reading its own
    file. The chief writes the run; the other worker's files go to a
    scratch folder it removes. Rerun after the last checkpoint is lost,
    both resume from the chief's checkpoint to the uninterrupted weights."""
    config, overrides, _ = TASK_RUNS["dlrm"]
    for i in range(2):
        task_data.write_criteo(str(tmp_path / f"day_{i}.tsv"), 32, seed=i)
    pattern = str(tmp_path / "day_*.tsv")
    overrides = {
        **overrides,
        "task.train_data.input_path": pattern,
        "task.validation_data.input_path": pattern,
        "trainer.checkpoint_interval": 2,
        "trainer.validation_steps": 1,
        "trainer.max_to_keep": 2,
    }
    output = tmp_path / "run"
    stdout = _train_on_workers(config, output, overrides, "--train-steps", "4")
    assert "on 2 replica(s)" in stdout and "on 2 workers, this one worker 0" in stdout
    run_dir = output / "vr_sgd"
    records = _records(run_dir)
    assert [r["updates"] for r in records] == [2, 4]
    assert all(np.isfinite(r["train_loss"]) for r in records)
    assert "validation_auc" in records[-1]
    assert any(k.startswith("gsnr_scale/") for k in records[-1])
    summary = json.loads((output / "summary.json").read_text())
    assert [row["replicas"] for row in summary["runs"]] == [2]
    assert not (output / ".workers").exists()

    _check_resume(
        run_dir,
        lambda: _train_on_workers(config, output, overrides, "--train-steps", "4"),
        [2, 4],
        rtol=1e-5,
    )

    # An --output that the workers do not share: the chief would resume, the
    # other worker start afresh. Both stop and say why.
    codes, texts = _run_workers(
        config, [output, tmp_path / "other"], overrides, "--train-steps", "4"
    )
    assert codes == [1, 1]
    assert all("--output must be one folder that every worker sees" in t for t in texts)


def _weights(path):
    import h5py

    arrays = {}
    with h5py.File(path, "r") as f:
        f.visititems(
            lambda name, obj: (
                arrays.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None
            )
        )
    return arrays


def test_init_checkpoint_starts_from_the_given_weights(tmp_path):
    """BERT's phase 2 starts from phase 1's weights: task.init_checkpoint
    loads them before the first update (0 updates of change at LR 0).

    Phase 1's weights file is written here, by Keras' `save_weights` of the
    task's model built with another seed than phase 2's, as `vrgd-train`
    writes its `final.weights.h5` (reading that file back is the resume
    tests' part)."""
    import keras

    config, overrides, _ = TASK_RUNS["bert"]
    keras.utils.set_random_seed(7)
    model = tasks.from_config(_cfg(config, overrides)).build_model()
    weights = tmp_path / "phase1.weights.h5"
    model.save_weights(weights)
    second = tmp_path / "phase2"
    rate = "trainer.optimizer_config.learning_rate.polynomial.initial_learning_rate"
    _train(
        "bert_large_vr_lamb_32k_phase2.yaml",
        second,
        {**overrides, rate: 0.0, "task.init_checkpoint": str(weights)},
        "--train-steps",
        "1",
        "--synthetic",
        "--seed",
        "1",  # another initialisation than phase 1's: only the loaded weights match
    )
    before, after = _weights(weights), _weights(second / "vr_lamb" / "final.weights.h5")
    # The model's weights (phase 2's optimizer has slots of its own).
    before = {k: v for k, v in before.items() if not k.startswith("optimizer")}
    assert before and before.keys() <= after.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("runtime.mixed_precision_dtype", "float8", "must be one of"),
        ("runtime.loss_scale", 128, "has no fixed scale"),
    ],
)
def test_runtime_precision_fields_are_checked(tmp_path, field, value, message):
    config = os.path.join(PAPER, "dlrm_vr_sgd_64k.yaml")
    with pytest.raises(SystemExit, match=message):
        train.main(
            ["--config", config, "--output", str(tmp_path), "--synthetic"]
            + ["--override", f"{field}={json.dumps(value)}"]
        )


@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_mixed_precision_runs_train(precision, tmp_path):
    """runtime.mixed_precision_dtype sets Keras' dtype policy (float16: with
    the loss scaled dynamically); BERT trains on synthetic inputs, float32
    weights, the VR run's GSNR read through the wrapper. With float16 its
    twin too (both wrapped for the loss scale); bfloat16 needs no wrapper,
    so the VR run alone. (BERT's loss falling is asserted here, not in
    `test_synthetic_task_loss_falls`.)"""
    config, overrides, _ = TASK_RUNS["bert"]
    output = tmp_path / "run"
    overrides = {
        **overrides,
        "runtime.mixed_precision_dtype": precision,
        "trainer.checkpoint_interval": 3,
    }
    twin = precision == "float16"
    compare = ["--compare"] if twin else []
    stdout = _train(config, output, overrides, "--train-steps", "6", "--synthetic", *compare)
    assert f"mixed_{precision}" in stdout
    for name in ("vr_lamb", "lamb") if twin else ("vr_lamb",):
        with zipfile.ZipFile(output / name / "checkpoint-epoch2.keras") as saved:
            saved_config = saved.read("config.json").decode()
        assert f'"mixed_{precision}"' in saved_config
        # float16: the package's loss scaling (every replica's overflow counted).
        assert ("tf_vrgd>LossScaleOptimizer" in saved_config) == (precision == "float16")
        records = _records(output / name)
        assert [r["updates"] for r in records] == [3, 6]
        assert all(np.isfinite(r["train_loss"]) for r in records)
        assert records[-1]["train_loss"] < records[0]["train_loss"]
        weights = _weights(output / name / "final.weights.h5")
        assert {w.dtype for k, w in weights.items() if k.startswith("layers")} == {
            np.dtype("float32")
        }
    assert any(k.startswith("gsnr_scale/") for k in _records(output / "vr_lamb")[-1])


# BERT's: `test_mixed_precision_runs_train`.
@pytest.mark.parametrize("kind", ["resnet", "dlrm"])
def test_synthetic_task_loss_falls(kind, tmp_path):
    config, overrides, _ = TASK_RUNS[kind]
    output = tmp_path / "run"
    _train(
        config,
        output,
        {**overrides, "trainer.checkpoint_interval": 4},
        "--train-steps",
        "12",
        "--synthetic",
    )
    name = json.loads((output / "summary.json").read_text())["runs"][0]["run"]
    records = _records(output / name)
    assert len(records) == 3
    assert records[-1]["train_loss"] < records[0]["train_loss"]


def test_a_resume_over_other_input_files_is_refused_naming_them(tmp_path, capsys):
    """The settings keep the files a glob matched (and their sizes), not the
    glob: removing, adding or changing a matching file between two starts
    is named, and resumes only with --accept-input-change."""
    data = tmp_path / "data"
    data.mkdir()
    for day in range(3):
        task_data.write_criteo(str(data / f"day_{day}.tsv"), 16 + day)
    output = str(tmp_path / "run")

    def start(*flags):
        argv = ["--config", os.path.join(PAPER, "dlrm_vr_sgd_64k.yaml"), "--output", output]
        args = train.parse_args([*argv, *flags])
        cfg = _cfg(
            "dlrm_vr_sgd_64k.yaml",
            {**TINY_DLRM, "task.train_data.input_path": str(data / "day_*.tsv")},
        )
        from tf_vrgd.experiments import task_runs

        train.prepare_output(args, task_runs.TaskExperiment(cfg, replicas=2))

    start()
    start()  # the same files: resumes
    os.remove(data / "day_1.tsv")
    task_data.write_criteo(str(data / "day_3.tsv"), 16)
    task_data.write_criteo(str(data / "day_2.tsv"), 40)
    with pytest.raises(SystemExit) as refused:
        start()
    message = str(refused.value)
    assert f"task.train_data: {data / 'day_1.tsv'} removed" in message
    assert f"task.train_data: {data / 'day_3.tsv'} added" in message
    assert f"{data / 'day_2.tsv'} " in message and " bytes now" in message
    assert "--accept-input-change" in message
    assert str(data / "day_0.tsv") not in message
    start("--accept-input-change")
    assert "resuming on changed input files" in capsys.readouterr().out
    start()  # the new files are the recorded ones now
    with open(os.path.join(output, run_folder.SETTINGS_FILE)) as f:
        recorded = json.load(f)[run_folder.INPUT_FILES]["train"]
    assert sorted(recorded) == [str(data / f"day_{d}.tsv") for d in (0, 2, 3)]
    assert recorded[str(data / "day_2.tsv")] == os.path.getsize(data / "day_2.tsv")


def test_an_adascale_run_logs_its_gain_and_ends_when_tau_reaches_the_train_steps(tmp_path):
    """vrgd-train with an `adascale` block: the gain and tau in the records,
    and training stops once tau reaches `train_steps`, the base schedule's
    length, before that many updates (the gain is above 1 on 2 replicas)."""
    path = str(tmp_path / "cifar")
    task_data.write_cifar(path, 16)
    block = {
        "type": "adascale",
        "adascale": {"optimizer": {"type": "sgd", "sgd": {"momentum": 0.9}}},
    }
    overrides = {
        **TINY_CIFAR,
        "task.train_data.input_path": path,
        "task.validation_data.input_path": path,
        "trainer.optimizer_config.optimizer": block,
        "trainer.checkpoint_interval": 2,
        "trainer.validation_steps": 1,
    }
    output = tmp_path / "run"
    _train("cifar10_resnet56_momentum_1k.yaml", output, overrides, "--train-steps", "8")
    (run_dir,) = [p for p in output.iterdir() if (p / "metrics.jsonl").exists()]
    records = _records(run_dir)
    last = records[-1]
    assert last["train_scale_invariant_steps"] >= 8 > last["updates"]
    assert 1.0 < last["train_adascale_gain"] <= 2.0
    # A gain over 1 needs both averages positive: a noise scale too.
    assert last["train_noise_scale"] > 0
    # It ended before the last interval; run again: a resume adds nothing.
    assert len(records) < 4
    _train("cifar10_resnet56_momentum_1k.yaml", output, overrides, "--train-steps", "8")
    assert _records(run_dir) == records
