"""scripts/device_check.py --dry-run: the GPU check's whole path on CPU
logical devices at tiny sizes, so that the first machine with a GPU runs a
script that works."""

import json
import os
import subprocess
import sys

from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_device_check_dry_run_writes_every_step(tmp_path):
    script = os.path.join(ROOT, "scripts", "device_check.py")
    done = subprocess.run(
        [sys.executable, script, str(tmp_path), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=1200,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(tmp_path / "device_check.json") as f:
        report = json.load(f)
    assert report["dry_run"] is True
    environment = report["environment"]
    assert environment["tensorflow"] and environment["keras"] and environment["gpus"] == 0
    (tests,) = report["tests"]
    assert tests["devices"] == "cpus" and tests["exit_code"] == 0
    assert tests["passed"] >= 2 and "failed" not in tests
    rows = report["bench"]["rows"]
    assert report["bench"]["exit_code"] == 0
    assert sorted((row["pair"], row["kind"]) for row in rows) == [
        (pair, kind) for pair in ("Adam", "LAMB", "NoiseScale") for kind in ("train step", "update")
    ]
    for row in rows:
        assert row["base_ms"] > 0 and row["vr_over_base"] > 0 and row["vr_N=16_over_base"] > 0
        # The update's traffic against the copy bandwidth, per candidate.
        traffic = [v for k, v in row.items() if k.endswith("_of_bandwidth")]
        assert (len(traffic) >= 3 and all(v > 0 for v in traffic)) == (row["kind"] == "update")
    assert "own_base_of_bandwidth" in next(
        r for r in rows if r["pair"] == "LAMB" and r["kind"] == "update"
    )
    assert [task["config"] for task in report["tasks"]] == [
        "bert_large_vr_lamb_32k_phase1.yaml",
        "imagenet_resnet50_vr_lars_32k.yaml",
    ]
    for task in report["tasks"]:
        assert task["exit_code"] == 0, task
        assert {run["run"][:3] == "vr_" for run in task["runs"]} == {True, False}
        assert all(run["examples_per_second"] > 0 for run in task["runs"])
        assert task["vr_over_base_examples_per_second"] > 0
    for log in ("tests-cpus.log", "bench.log", "bert_large_phase1.log", "resnet50_imagenet.log"):
        assert (tmp_path / log).stat().st_size > 0


def test_device_check_stops_where_tensorflow_sees_no_gpu(tmp_path, monkeypatch, capsys):
    # A GPU that nvidia-smi lists but TensorFlow cannot use (not installed,
    # or without CUDA): the check stops after the environment, with why.
    check = helpers.load_script("device_check")
    monkeypatch.setattr(check, "_gpu_count", lambda: 1)
    monkeypatch.setattr(check, "environment", lambda args, gpus, budget: {"gpus": gpus})
    assert check.main([str(tmp_path)]) == 3
    assert "TensorFlow (not importable) sees none" in capsys.readouterr().out
    with open(tmp_path / "device_check.json") as f:
        assert set(json.load(f)) == {"dry_run", "started", "environment", "seconds"}
