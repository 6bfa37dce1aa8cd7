"""The training stream of the paper's tasks (`records.training_records`): it
goes on from checkpoint interval to interval instead of starting over, it
holds every record once per pass, and a stream started after n records is
the uninterrupted one less its first n (what a resumed run reads). Checked
on the tasks' real file formats, written here."""

import json

import numpy as np
import pytest
import tensorflow as tf

from tests import task_data
from tf_vrgd.experiments import records, tasks
from tf_vrgd.experiments.task_runs import TaskExperiment


def _numbered_files(folder, counts):
    """Text files of `counts[i]` lines each, the lines numbered on across files."""
    paths, number = [], 0
    for i, count in enumerate(counts):
        path = folder / f"part_{i}.txt"
        path.write_text("".join(f"{number + j}\n" for j in range(count)))
        paths.append(str(path))
        number += count
    return paths


def _numbers(ds, count):
    return [int(x) for x in ds.take(count).as_numpy_iterator()]


@pytest.mark.parametrize("shard", [None, (2, 0), (2, 1), (5, 3)])
def test_records_start_anywhere_and_hold_each_record_once_per_pass(shard, tmp_path):
    """Files of 7, 3, 11 and 5 records (26), blocks of 4: each pass is a new
    order of all of a pipeline's records; started at any record (within a
    block, at a file's end, past a pass) the stream continues the one from 0."""
    files = _numbered_files(tmp_path, [7, 3, 11, 5])
    stream = lambda start: records.training_records(
        files, tf.data.TextLineDataset, seed=5, start=start, shard=shard, block=4
    )
    full = _numbers(stream(0), 90)
    if shard is None:
        mine = set(range(26))
    elif shard == (5, 3):  # fewer files than pipelines: every 5th record of a pass
        mine = None
    else:  # every other file
        index = shard[1]
        mine = {n for i, f in enumerate(files) if i % 2 == index for n in _file_numbers(f)}
    per_pass = len(mine) if mine is not None else len(range(3, 26, 5))
    passes = [full[i : i + per_pass] for i in range(0, 3 * per_pass, per_pass)]
    for one in passes:
        assert len(set(one)) == per_pass
        if mine is not None:
            assert set(one) == mine
    assert passes[0] != passes[1] != passes[2]
    assert passes[0] != sorted(passes[0])
    for start in (1, 3, 4, 5, 7, 10, per_pass - 1, per_pass, per_pass + 6, 2 * per_pass + 1):
        assert _numbers(stream(start), 20) == full[start : start + 20], start


def _file_numbers(path):
    with open(path) as f:
        return [int(line) for line in f]


def test_another_seed_gives_another_stream(tmp_path):
    files = _numbered_files(tmp_path, [30])
    one, two = (
        _numbers(records.training_records(files, tf.data.TextLineDataset, seed, block=8), 30)
        for seed in (0, 1)
    )
    assert sorted(one) == sorted(two) == list(range(30))
    assert one != two


def _criteo_lines(path, count):
    """Criteo lines whose first integer feature is the line's number."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for n in range(count):
            cats = [f"{int(v):08x}" for v in rng.integers(0, 2**32, 26)]
            f.write("\t".join(["0", str(n), *["1"] * 12, *cats]) + "\n")


def test_dlrm_intervals_read_on_through_the_file(tmp_path):
    """100 checkpoint intervals of 2 updates of 64 examples over a
    30,000-line Criteo file read 12,800 different lines, as one continuous
    stream does, and reach past the first shuffle block; the input a
    resumed run makes at each interval's start is the stream read on."""
    path = tmp_path / "day_0.tsv"
    _criteo_lines(path, 30000)
    cfg = task_data.paper_config(
        "dlrm_sgd_64k.yaml",
        {
            **task_data.TINY_DLRM,
            "task.train_data.global_batch_size": 64,
            "task.train_data.input_path": str(path),
            "trainer.checkpoint_interval": 2,
        },
    )
    experiment = TaskExperiment(cfg, train_steps=200, replicas=1)
    line = lambda batch: np.rint(np.expm1(batch[0]["dense_features"][:, 0])).astype(int)
    stream = iter(experiment.dataset("train"))
    read = [line(next(stream)) for _ in range(200)]
    seen = np.concatenate(read)
    assert len(np.unique(seen)) == 12800
    assert seen.max() > 12000
    for interval in (1, 2, 37, 99):
        resumed = iter(experiment.dataset("train", updates=2 * interval))
        for update in range(2):
            np.testing.assert_array_equal(line(next(resumed)), read[2 * interval + update])


def _task_files(kind, tmp_path):
    """A task on written files in its real format: (task, batch size)."""
    if kind == "bert":
        paths = [str(tmp_path / f"bert_{i}.tfrecord") for i in range(2)]
        for i, path in enumerate(paths):
            task_data.write_bert_records(path, 9 + 4 * i, 16, 4, 200, seed=i)
        name, overrides, path = (
            "bert_large_vr_lamb_32k_phase1.yaml",
            task_data.TINY_BERT,
            ",".join(paths),
        )
    elif kind in ("cifar", "cifar-python"):
        path = str(tmp_path)
        task_data.write_cifar(path, 3, python=kind == "cifar-python")
        name, overrides = "cifar10_resnet56_momentum_1k.yaml", task_data.TINY_CIFAR
    elif kind == "imagenet":
        path = str(tmp_path / "train-*")
        for i in range(2):
            task_data.write_imagenet_records(str(tmp_path / f"train-{i}"), 6 + i, seed=i)
        name, overrides = (
            "imagenet_resnet50_vr_lars_32k.yaml",
            {"task.model.input_size": [24, 24, 3]},
        )
    else:
        path = str(tmp_path / "day_*.tsv")
        for i in range(3):
            task_data.write_criteo(str(tmp_path / f"day_{i}.tsv"), 5 + i, seed=i)
        name, overrides = "dlrm_sgd_64k.yaml", task_data.TINY_DLRM
    cfg = task_data.paper_config(name, {**overrides, "task.train_data.input_path": path})
    return tasks.from_config(cfg)


@pytest.mark.parametrize("kind", ["bert", "cifar", "cifar-python", "imagenet", "dlrm"])
def test_each_task_resumes_its_stream_where_it_stopped(kind, tmp_path):
    """A task's training input started after n batches (crops and flips
    included) is the batches the uninterrupted input reads from there, past
    the end of the first pass, from several files."""
    task = _task_files(kind, tmp_path)
    full = [task_data.flat(b) for b in task.dataset("train", 3, seed=7).take(14)]
    for batches in (1, 5, 9):
        resumed = task.dataset("train", 3, seed=7, start=3 * batches).take(14 - batches)
        for got, want in zip(resumed, full[batches:], strict=True):
            for x, y in zip(task_data.flat(got), want, strict=True):
                np.testing.assert_array_equal(x, y)


def test_a_resumed_run_reads_on_from_its_checkpoint(tmp_path):
    """vrgd-train itself: the training examples of a run with a resume are
    the uninterrupted run's, and they do not repeat within a pass: the
    run's examples, read back from what `fit` was given, are each line of
    the file once."""
    from tf_vrgd.experiments import task_runs

    path = tmp_path / "day_0.tsv"
    _criteo_lines(path, 96)
    cfg = task_data.paper_config(
        "dlrm_sgd_64k.yaml",
        {
            **task_data.TINY_DLRM,
            "task.train_data.input_path": str(path),
            "trainer.checkpoint_interval": 2,
            "trainer.max_to_keep": 2,
        },
    )
    experiment = TaskExperiment(cfg, train_steps=6, replicas=1)
    given = []

    class Recording(TaskExperiment):
        def input(self, strategy, split, updates=0):
            ds = super().input(strategy, split, updates)
            if split == "train":
                given.append(updates)
            return ds

    experiment.__class__ = Recording
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    run_dir = tmp_path / "run"
    block = experiment.block
    task_runs.train_task_run("sgd", block, experiment, strategy, str(run_dir), verbose=0)
    assert given == [0]  # one stream for the whole run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["updates"] for r in records] == [2, 4, 6]
    assert [r["includes_startup"] for r in records] == [True, False, False]
    (run_dir / "checkpoint-epoch3.keras").unlink()
    given.clear()
    task_runs.train_task_run("sgd", block, experiment, strategy, str(run_dir), verbose=0)
    assert given == [4]  # the resumed run starts after the 4 updates done
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["includes_startup"] for r in records] == [True, False, True]
    numbers = lambda b: np.rint(np.expm1(b[0]["dense_features"][:, 0])).astype(int)
    read = np.concatenate([numbers(b) for b in experiment.dataset("train").take(6)])
    assert sorted(read.tolist()) == list(range(96))  # 6 updates of 16: one pass


def test_throughput_leaves_out_every_process_start():
    """The summary's examples per second leave out each interval that
    paid a process's tracing (the first, and the first after a resume)."""
    from tf_vrgd.experiments import task_runs

    records = [
        {"updates": 2, "seconds": 50.0, "examples_per_second": 2.0, "includes_startup": True},
        {"updates": 4, "seconds": 1.0, "examples_per_second": 100.0, "includes_startup": False},
        {"updates": 6, "seconds": 40.0, "examples_per_second": 2.5, "includes_startup": True},
        {"updates": 8, "seconds": 3.0, "examples_per_second": 100.0 / 3, "includes_startup": False},
    ]
    experiment = type("E", (), {"replicas": 1, "global_batch": 16})()
    (row,) = task_runs.summarize({"run": records}, experiment)
    assert row["examples_per_second"] == pytest.approx(200.0 / 4.0)
    assert row["first_interval_seconds"] == 50.0
