"""The experiment scripts' bookkeeping (no training): the sweep's best-rate
table and resumable results, the linear regression's steps-to-target, and a
minute-sized run of the step-cost benchmark."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(optimizer, batch, multiplier, seed, accuracy, gap=0.01):
    return {
        "optimizer": optimizer,
        "batch": batch,
        "lr_multiplier": multiplier,
        "seed": seed,
        "best_test_accuracy": accuracy,
        "generalization_gap": gap,
    }


def test_sweep_reports_the_best_rate_and_its_seeds(tmp_path):
    sweep = _script("sweep")
    rows = [
        _row("lamb", 8192, 0.5, 0, 0.80),
        _row("lamb", 8192, 1.0, 0, 0.84),
        _row("lamb", 8192, 2.0, 0, 0.82),
        _row("lamb", 8192, 1.0, 1, 0.86),
        _row("vr_lamb", 8192, 1.0, 0, 0.85, gap=-0.002),
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = sweep.load_results(str(path))
    assert len(results) == 5
    best = sweep.best_rows(results)
    assert best[("lamb", 8192)]["lr_multiplier"] == 1.0
    assert best[("lamb", 8192)]["seeds"] == 2
    assert best[("lamb", 8192)]["mean_best_test_accuracy"] == pytest.approx(0.85)
    table = sweep.report(results)
    assert "85.00±1.0" in table and "(x1;-0.2;1)" in table

    args = sweep.parse_args(
        ["--batches", "256", "8192", "--optimizers", "adam", "--lr-multipliers", "1", "2"]
    )
    grid = sweep.grid(args)
    assert len(grid) == 2 * 2 * 2  # batches x {adam, vr_adam} x rates
    assert {sweep._key(r) for r in grid} >= {"vr_adam_b8192_lr2_s0", "adam_b256_lr1_s0"}


def test_linear_regression_steps_to_target():
    linear = _script("linear_regression")
    assert linear.steps_to_reach([5.0, 3.0, 1.0, 0.5], 1.0) == 3
    assert linear.steps_to_reach([5.0, 3.0], 1.0) is None


def test_bench_step_measures_every_kind_with_accumulation():
    from tf_vrgd.experiments import benchmark

    # The one-device set-up only: the mirrored one makes its own strategy
    # over the devices the test session's strategy uses.
    settings = benchmark.Settings(
        setups=["accumulation"],
        models=["mlp"],
        mlp_parameters=20_000,
        pairs=["Adam", "LARC"],
        steps=1,
        repeats=1,
        first_step_rounds=1,
        batch=8,
    )
    lines = []
    rows = benchmark.measure(settings, report=lines.append)
    assert [(row["pair"], row["kind"]) for row in rows] == [
        (pair, kind) for pair in ("Adam", "LARC") for kind in ("first step", "update", "train step")
    ]
    for row in rows:
        candidates = {"base", "vr", "vr no-xla"} if row["pair"] == "Adam" else {"base", "vr"}
        assert set(row["seconds"]) == candidates
        assert all(0 < seconds < 120 for seconds in row["seconds"].values())
        assert ("traffic" in row) == (row["kind"] == "update")
        assert row["variables"] == 8 and row["replicas"] == 1
        line = benchmark.format_row(row)
        ratio = row["seconds"]["vr"] / row["seconds"]["base"]
        assert line.startswith(f"{row['pair']:<9} {row['kind']}") and f"{ratio:5.2f}" in line
    # The first step (trace, compile, run) costs more than a steady step.
    first, _, train = rows[:3]
    assert first["seconds"]["vr"] > train["seconds"]["vr"]
    assert lines[0].startswith("memory copy bandwidth")
