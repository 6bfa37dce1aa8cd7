"""Input files with a bad record somewhere: the error names the file and
the line or record, before training where that is cheap (CIFAR-10, the
first record of every split, a validation split of less than a batch) and
otherwise when the pipeline fails; labels out of range stop the pipeline
instead of training on zeros."""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from tests import task_data
from tf_vrgd.experiments import image_task, tasks


def _criteo(path, count=12, edit=None):
    """Criteo lines; `edit(number, fields)` may change line `number` (from 1)."""
    task_data.write_criteo(str(path), count)
    lines = path.read_text().splitlines()
    out = []
    for number, line in enumerate(lines, start=1):
        fields = line.split("\t")
        if edit:
            fields = edit(number, fields)
        out.append("\t".join(fields))
    path.write_text("\n".join(out) + "\n")
    return str(path)


def _dlrm(path):
    return tasks.from_config(
        task_data.paper_config(
            "dlrm_sgd_64k.yaml", {**task_data.TINY_DLRM, "task.train_data.input_path": path}
        )
    )


@pytest.mark.parametrize(
    "edit, said",
    [
        (
            lambda n, f: f[:-1] if n == 5 else f,
            "line 5: 39 tab-separated fields; the config expects 40",
        ),
        (
            lambda n, f: f[:3] + ["abc"] + f[4:] if n == 5 else f,
            "line 5: integer feature 3 is 'abc'",
        ),
        (lambda n, f: ["7"] + f[1:] if n == 9 else f, "line 9: label '7', not 0 or 1"),
    ],
    ids=["fields", "dense", "label"],
)
def test_criteo_problems_are_found_by_file_and_line(edit, said, tmp_path):
    good = _criteo(tmp_path / "day_0.tsv")
    bad = _criteo(tmp_path / "day_1.tsv", edit=edit)
    task = _dlrm(f"{good},{bad}")
    assert task.find_record_problem("train").startswith(f"{bad}: {said}")


def test_a_criteo_label_out_of_range_stops_the_pipeline(tmp_path):
    path = _criteo(tmp_path / "day_0.tsv", edit=lambda n, f: ["7"] + f[1:] if n == 2 else f)
    with pytest.raises(tf.errors.InvalidArgumentError, match="Criteo labels must be 0 or 1"):
        list(_dlrm(path).dataset("train", 4, seed=0).take(3))


def _bert(paths):
    cfg = task_data.paper_config(
        "bert_large_vr_lamb_32k_phase1.yaml",
        {**task_data.TINY_BERT, "task.train_data.input_path": ",".join(paths)},
    )
    return tasks.from_config(cfg)


def test_a_bert_record_of_another_length_is_found(tmp_path):
    good, bad = str(tmp_path / "a.tfrecord"), str(tmp_path / "b.tfrecord")
    task_data.write_bert_records(good, 4, 16, 4, 200)
    # Records 0-1 of seq_length 16, then one of 24: the third in the file.
    task_data.write_bert_records(bad + ".1", 2, 16, 4, 200, seed=1)
    task_data.write_bert_records(bad + ".2", 1, 24, 4, 200, seed=2)
    with tf.io.TFRecordWriter(bad) as writer:
        for part in (bad + ".1", bad + ".2"):
            for record in tf.data.TFRecordDataset([part]).as_numpy_iterator():
                writer.write(record)
    problem = _bert([good, bad]).find_record_problem("train")
    assert problem.startswith(f"{bad}: record 2: input_ids holds 24 int64_list values")


def test_a_truncated_tfrecord_is_found(tmp_path):
    path = str(tmp_path / "a.tfrecord")
    task_data.write_bert_records(path, 5, 16, 4, 200)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) - 40])
    problem = _bert([path]).find_record_problem("train")
    assert problem.startswith(f"{path}: the record after record 3 does not read")


def test_bert_ids_out_of_the_vocabulary_are_found_and_stop_the_pipeline(tmp_path):
    path = str(tmp_path / "a.tfrecord")
    task_data.write_bert_records(path, 3, 16, 4, 400)  # ids up to 399, vocabulary 200
    task = _bert([path])
    assert "outside [0, 200) (task.model.encoder.bert.vocab_size)" in task.find_record_problem(
        "train"
    )
    with pytest.raises(tf.errors.InvalidArgumentError, match="out of range"):
        list(task.dataset("train", 2, seed=0).take(3))


def _cifar_task(folder):
    cfg = task_data.paper_config(
        "cifar10_resnet56_momentum_1k.yaml",
        {**task_data.TINY_CIFAR, "task.train_data.input_path": folder},
    )
    return tasks.from_config(cfg)


@pytest.mark.parametrize("python", [False, True], ids=["binary", "python"])
def test_cifar_labels_out_of_range_are_found_before_training(python, tmp_path):
    task_data.write_cifar(str(tmp_path), 4, python=python)
    name = "data_batch_3" + ("" if python else ".bin")
    path = tmp_path / name
    if python:
        import pickle

        batch = pickle.loads(path.read_bytes())
        batch[b"labels"][2] = 200
        path.write_bytes(pickle.dumps(batch))
    else:
        data = bytearray(path.read_bytes())
        data[2 * image_task.CIFAR_RECORD_BYTES] = 200
        path.write_bytes(bytes(data))
    task = _cifar_task(str(tmp_path))
    with pytest.raises(ValueError, match=rf"task.train_data: .*{name}: record 2: label 200"):
        task.check_input("train")
    with pytest.raises(tf.errors.InvalidArgumentError, match="label out of range"):
        list(task.dataset("train", 4, seed=0).take(5))


def test_a_cifar_file_cut_short_is_found_before_training(tmp_path):
    task_data.write_cifar(str(tmp_path), 4)
    path = tmp_path / "data_batch_2.bin"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"data_batch_2\.bin: 12192 bytes, not a whole number"):
        _cifar_task(str(tmp_path)).check_input("train")


def test_an_imagenet_label_out_of_range_is_found(tmp_path):
    path = str(tmp_path / "train-0")
    task_data.write_imagenet_records(path, 3, num_classes=1001)
    cfg = task_data.paper_config(
        "imagenet_resnet50_vr_lars_32k.yaml",
        {
            "task.model.input_size": [24, 24, 3],
            "task.model.num_classes": 1001,
            "task.train_data.input_path": path,
        },
    )
    task = tasks.from_config(cfg)
    assert task.find_record_problem("train") == ""
    cfg["task"]["model"]["num_classes"] = 10
    labels = list(task_data.write_imagenet_records(path, 3, num_classes=1001))
    first_bad = next(i for i, label in enumerate(labels) if label >= 10)
    assert f"record {first_bad}: image/class/label" in tasks.from_config(cfg).find_record_problem(
        "train"
    )


def _train_fails(config, output, overrides):
    command = [sys.executable, "-m", "tf_vrgd.experiments.train", "--config"]
    command += [os.path.join(task_data.PAPER, config), "--output", str(output), "--replicas", "2"]
    command += ["--verbose", "0", "--train-steps", "4"]
    for key, value in overrides.items():
        command += ["--override", f"{key}={json.dumps(value)}"]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([task_data.ROOT, os.environ.get("PYTHONPATH", "")])
    )
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    return done.stdout + done.stderr


def test_vrgd_train_names_a_bad_line_found_in_training(tmp_path):
    # Line 30 of 64 has 39 fields: not the first record, so training starts
    # and the pipeline fails; the command then names the file and the line.
    path = _criteo(tmp_path / "day_0.tsv", 64, edit=lambda n, f: f[:-1] if n == 30 else f)
    text = _train_fails(
        "dlrm_sgd_64k.yaml",
        tmp_path / "run",
        {**task_data.TINY_DLRM, "task.train_data.input_path": path},
    )
    assert (
        f"vrgd-train: the input cannot be read: task.train_data: {path}: line 30: "
        "39 tab-separated fields"
    ) in text
    assert "Traceback" not in text


def test_vrgd_train_refuses_a_validation_split_smaller_than_a_batch(tmp_path):
    train = _criteo(tmp_path / "day_0.tsv", 64)
    validation = _criteo(tmp_path / "day_1.tsv", 10)
    text = _train_fails(
        "dlrm_sgd_64k.yaml",
        tmp_path / "run",
        {
            **task_data.TINY_DLRM,
            "task.train_data.input_path": train,
            "task.validation_data.input_path": validation,
        },
    )
    assert (
        f"task.validation_data: {validation} holds fewer records than one validation batch of 16"
    ) in text
    assert not (tmp_path / "run" / "sgd" / "metrics.jsonl").exists()
