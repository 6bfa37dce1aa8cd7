"""The experiment scripts' bookkeeping (no training): the sweep's best-rate
table and resumable results, the linear regression's steps-to-target, and a
minute-sized run of the step-cost benchmark."""

import argparse
import json
import os

import numpy as np
import pytest

from tests import helpers
from tf_vrgd.experiments import grids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    sweep = helpers.load_script("sweep")
    rows = [
        _row("lamb", 8192, 0.5, 0, 0.80),
        _row("lamb", 8192, 1.0, 0, 0.84),
        _row("lamb", 8192, 2.0, 0, 0.82),
        _row("lamb", 8192, 1.0, 1, 0.86),
        _row("vr_lamb", 8192, 1.0, 0, 0.85, gap=-0.002),
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = grids.load_results(str(path), sweep._key)
    assert len(results) == 5
    best = sweep.best_rows(results)
    assert best[("lamb", 8192)]["lr_multiplier"] == 1.0
    assert best[("lamb", 8192)]["seeds"] == 2
    assert best[("lamb", 8192)]["mean_best_test_accuracy"] == pytest.approx(0.85)
    table = sweep.report(results)
    assert "85.00±1.0" in table and "(x1;-0.2;1)" in table
    assert "noise scale" not in table
    # Runs that logged B_simple add its table: first -> last epoch.
    results[sweep._key(rows[1])]["noise_scale_per_epoch"] = [120.4, 300.0, 2048.6]
    table = sweep.report(results)
    assert "gradient noise scale B_simple" in table
    assert "120 -> 2049" in table.splitlines()[-1] and table.splitlines()[-1].startswith("lamb")

    args = sweep.parse_args(
        ["--batches", "256", "8192", "--optimizers", "adam", "--lr-multipliers", "1", "2"]
    )
    grid = sweep.grid(args)
    assert len(grid) == 2 * 2 * 2  # batches x {adam, vr_adam} x rates
    assert {sweep._key(r) for r in grid} >= {"vr_adam_b8192_lr2_s0", "adam_b256_lr1_s0"}
    # --noise-scale wraps the base's block, not the twin's.
    args = sweep.parse_args(["--noise-scale", "--replicas", "4"])
    blocks = {
        name: sweep.experiment_for(
            {"optimizer": name, "batch": 1024, "lr_multiplier": 1.0, "seed": 0}, args
        ).cfg["trainer"]["optimizer_config"]["optimizer"]
        for name in ("adam", "vr_adam")
    }
    assert blocks["adam"]["type"] == "noise_scale"
    assert blocks["adam"]["noise_scale"]["optimizer"]["type"] == "adam"
    assert blocks["vr_adam"]["type"] == "vr_adam"


def _study_row(optimizer, batch, multiplier, seed, accuracy, k=8, scale=None, **extra):
    row = {
        "optimizer": optimizer,
        "batch": batch,
        "k": k,
        "lr_multiplier": multiplier,
        "seed": seed,
        "final_test_accuracy": accuracy,
        "final_train_accuracy": accuracy + 0.01,
        "generalization_gap": 0.01,
        "diverged": False,
        **extra,
    }
    if scale is not None:
        row.update(mean_gsnr_scale=scale, mean_gsnr_at_gamma=0.5, mean_gsnr_at_one=0.1)
    return row


def test_study_parts_follow_the_grid(tmp_path):
    study = helpers.load_script("study")
    args = study.parse_args(["--batches", "4096", "--pairs", "momentum"])
    grid = study.grid({}, args)
    assert len(grid) == 2 * 6  # {momentum, vr_momentum} x rates
    rows = [
        _study_row("momentum", 4096, 0.5, 0, 0.83),
        _study_row("momentum", 4096, 1.0, 0, 0.82),
        _study_row("momentum", 4096, 2.0, 0, float("nan"), diverged=True),
        _study_row("vr_momentum", 4096, 0.5, 0, 0.84, scale=0.5),
        _study_row("vr_momentum", 4096, 1.0, 0, 0.86, scale=0.375),
    ]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = grids.load_results(str(path), study.key)
    best = study.best_grid_rows(results, args)
    assert best[("momentum", 4096)]["lr_multiplier"] == 0.5
    assert best[("vr_momentum", 4096)]["lr_multiplier"] == 1.0
    assert {r["seed"] for r in study.seeds(results, args)} == {1}
    # The base at the twin's best rate x its mean applied scale, 2 seeds.
    effective = study.effective(results, args)
    assert [(r["optimizer"], r["lr_multiplier"], r["seed"]) for r in effective] == [
        ("momentum", 0.375, 0),
        ("momentum", 0.375, 1),
    ]
    assert effective[0]["follows"] == "vr_momentum_b4096_k8_lr1_s0"
    samples = study.samples(results, args)
    assert [r["k"] for r in samples] == [4, 8, 16, 32]
    assert all(r["lr_multiplier"] == 1.0 for r in samples)
    # k = replicas x accumulation, at the same global batch per update.
    experiment = study.experiment_for(samples[3], args)
    assert experiment.batch_size == 4096 // 8
    fields = experiment.block["optimizer"]["vr_sgd"]
    assert fields["gradient_accumulation_steps"] == 8
    table = study.report(results, args)
    assert "86.00*" in table and "scale 0.375" in table
    # --samples-seeds N: seeds 0..N-1 at each k; the report's part 4 gives
    # each k's seeds on one line.
    args = study.parse_args(["--batches", "4096", "--pairs", "momentum", "--samples-seeds", "2"])
    samples = study.samples(results, args)
    assert [(r["k"], r["seed"]) for r in samples] == [
        (k, seed) for k in (4, 8, 16, 32) for seed in (0, 1)
    ]
    for seed, accuracy in ((1, 0.10), (0, 0.80)):
        row = _study_row("vr_momentum", 4096, 1.0, seed, accuracy, k=16, scale=0.25 + seed / 4)
        results[study.key(row)] = row
    table = study.report(results, args)
    assert "vr_momentum b4096 k=16".ljust(44) + " test  45.00 (80.00, 10.00)" in table
    line = next(x for x in table.splitlines() if x.startswith("vr_momentum b4096 k=16"))
    assert line.endswith("scale 0.375 at-gamma 0.50")


def test_linear_regression_steps_to_target():
    linear = helpers.load_script("linear_regression")
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
    # The first step (trace, compile, run) costs more than a steady step,
    # and its trace is a part of it.
    first, _, train = rows[:3]
    assert first["seconds"]["vr"] > train["seconds"]["vr"]
    assert set(first["trace_seconds"]) == set(first["seconds"])
    assert all(0 < first["trace_seconds"][k] < first["seconds"][k] for k in first["seconds"])
    assert lines[0].startswith("memory copy bandwidth")


def _one_update_at_intervals_1_and_4(pair, **options):
    """`bench_step`'s update row of `pair` on a small MLP, one device with
    accumulation, at N = 1 and 4: (its settings, the row)."""
    from tf_vrgd.experiments import benchmark

    settings = benchmark.Settings(
        setups=["accumulation"],
        models=["mlp"],
        mlp_parameters=20_000,
        pairs=[pair],
        kinds=["update"],
        steps=1,
        repeats=1,
        batch=8,
        gsnr_intervals=[1, 4],
        **options,
    )
    (row,) = benchmark.measure(settings, report=lambda row: None)
    return settings, row


def test_bench_step_times_each_gsnr_interval_and_the_own_base_rule():
    import keras

    import tf_vrgd
    from tf_vrgd.experiments import benchmark

    settings, row = _one_update_at_intervals_1_and_4("LAMB", own_base=True)
    names = {"base", "own base", "vr", "vr no-xla", "vr N=4", "vr N=4 no-xla"}
    assert set(row["seconds"]) == names
    assert all(seconds > 0 for seconds in row["seconds"].values())
    line = benchmark.format_row(row)
    assert "own-base/base" in line and "vr N=4/base" in line and "vr N=4 no-xla/base" in line
    # An update's all-reduce: the gradient, and the squares one update in N.
    assert benchmark.collective_bytes(keras.optimizers.Adam(), 1000) == 4000
    assert benchmark.collective_bytes(tf_vrgd.VRAdam(), 1000) == 8000
    assert benchmark.collective_bytes(tf_vrgd.VRAdam(gsnr_interval=4), 1000) == 5000
    # Every candidate's traffic, from the bytes of docs/algorithms.md §6:
    # VR-LAMB at N = 4 moves Lamb's 28 B, plus at its GSNR update the sums'
    # mean pass (8), the squares (4) and the momentum (8), and the momentum
    # (4) at each of the three others: 28 + (20 + 12) / 4 = 36; each of the
    # A micro-steps 12 B (20 at a GSNR update's).
    assert set(row["traffic"]) == names and all(v > 0 for v in row["traffic"].values())
    moved, a = row["bytes_per_parameter"], settings.accumulation
    assert (moved["base"], moved["own base"]) == (28 + 12 * a, 28 + 12 * a)
    assert (moved["vr"], moved["vr N=4"]) == (48 + 20 * a, 36 + a * (12 + 8 / 4))


def test_timing_gives_each_candidate_each_place_in_the_order():
    from tf_vrgd.experiments import timing

    calls = []

    class Recorded:
        def __init__(self, name, seconds):
            self.name, self.seconds = name, seconds

        def time(self, kind, steps):
            calls.append((self.name, steps))
            return self.seconds

    candidates = [Recorded("a", 1.0), Recorded("b", 2.0), Recorded("c", 3.0)]
    medians = timing.compare(candidates, "update", steps=5, repeats=3, warmup=2)
    assert medians == {"a": 1.0, "b": 2.0, "c": 3.0}
    # The warm-up in order, then rounds starting at a, b, c.
    assert [name for name, steps in calls if steps == 2] == ["a", "b", "c"]
    timed = [name for name, steps in calls if steps == 5]
    assert timed == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert timing.rotated([], 3) == [] and timing.rotated("xy", 3) == ["y", "x"]


def test_update_bytes_follow_the_table_of_the_algorithms_document():
    from tf_vrgd.experiments.benchmark import update_bytes

    assert update_bytes("Adam") == 28
    assert update_bytes("Adam", accumulation_steps=2) == 28 + 2 * 12
    assert update_bytes("Adam", vr=True, beta_3=0.9, gsnr_interval=16) == 28 + (20 + 15 * 4) / 16
    # VR-SGD (beta_3 = 0): no slot at N = 1; the last scale written at a
    # GSNR update and read at the others when N > 1.
    assert update_bytes("SGD", vr=True) == 20 + 12
    assert update_bytes("SGD", vr=True, gsnr_interval=4) == 20 + (16 + 3 * 4) / 4
    # Micro-steps: both sums at the GSNR update's, the gradient's alone else.
    assert update_bytes("Lamb", vr=True, beta_3=0.9, accumulation_steps=2) == 48 + 2 * 20
    assert update_bytes("Lamb", vr=True, beta_3=0.9, gsnr_interval=4, accumulation_steps=2) == (
        36 + 2 * (12 + 8 / 4)
    )


def test_study_pairs_twin_and_base_by_seed():
    study = helpers.load_script("study")
    twin = {0: 0.86, 1: 0.84, 2: 0.87, 3: 0.85}
    base = {0: 0.84, 1: 0.845, 2: 0.83, 3: 0.84, 4: 0.9}  # seed 4 has no twin
    mean, sd, half, seeds = study.paired_difference(twin, base)
    diffs = np.array([0.02, -0.005, 0.04, 0.01])
    assert seeds == [0, 1, 2, 3]
    assert mean == pytest.approx(diffs.mean())
    assert sd == pytest.approx(diffs.std(ddof=1))
    assert half == pytest.approx(3.182 * diffs.std(ddof=1) / 2.0)
    one = study.paired_difference({0: 0.8}, {0: 0.7})
    assert one[0] == pytest.approx(0.1) and np.isnan(one[1]) and np.isnan(one[2])
    # Part 2 runs seeds 1..N-1 at the best rates of the pairs asked for only.
    args = study.parse_args(["--batches", "4096", "--pairs", "lars", "--seeds", "4"])
    rows = [
        _study_row("lars", 4096, 1.0, 0, 0.80),
        _study_row("lars", 4096, 2.0, 0, 0.78),
        _study_row("vr_lars", 4096, 2.0, 0, 0.82),
        _study_row("momentum", 4096, 1.0, 0, 0.83),
    ]
    results = {study.key(r): r for r in rows}
    runs = study.seeds(results, args)
    assert sorted((r["optimizer"], r["lr_multiplier"], r["seed"]) for r in runs) == [
        (name, rate, seed) for name, rate in (("lars", 1.0), ("vr_lars", 2.0)) for seed in (1, 2, 3)
    ]
    # `--at` gives a rate where this output has no grid row: seeds 0..N-1
    # there; the grid's best wins where it has one; other pairs stay out.
    args = study.parse_args(
        ["--batches", "4096", "--pairs", "lars", "momentum", "--seeds", "3"]
        + ["--at", "momentum=0.5", "vr_lars=4", "lamb=2"]
    )
    results = {study.key(r): r for r in rows[:3]}
    runs = study.seeds(results, args)
    assert sorted((r["optimizer"], r["lr_multiplier"], r["seed"]) for r in runs) == [
        ("lars", 1.0, 1),
        ("lars", 1.0, 2),
        ("momentum", 0.5, 0),
        ("momentum", 0.5, 1),
        ("momentum", 0.5, 2),
        ("vr_lars", 2.0, 1),
        ("vr_lars", 2.0, 2),
    ]
    for bad in ("momentum", "sgd=1", "adam=x", "adam=0"):
        with pytest.raises(SystemExit, match="--at takes"):
            study.seeds(results, study.parse_args(["--pairs", "adam", "--at", bad]))


def test_study_report_and_plots_cover_each_pair(tmp_path):
    import matplotlib.image

    study = helpers.load_script("study")
    args = study.parse_args(
        ["--output", str(tmp_path), "--batches", "4096", "8192", "--pairs", "lars", "lamb"]
    )
    rows = [
        _study_row(name, batch, rate, seed, accuracy, scale=0.4 if name.startswith("vr_") else None)
        for name, rate, accuracies in (
            ("lars", 1.0, (0.80, 0.79, 0.81)),
            ("vr_lars", 1.0, (0.82, 0.81, 0.84)),
            ("lamb", 2.0, (0.89, 0.88, 0.90)),
            ("vr_lamb", 1.0, (0.88, 0.89, 0.87)),
        )
        for batch in (4096, 8192)
        for seed, accuracy in enumerate(accuracies)
    ]
    results = {study.key(r): r for r in rows}
    text = study.report(results, args)
    # Paired by seed, in points: vr_lars - lars is 2, 2, 3 (outside the noise:
    # mean > t(2) x sd / sqrt(3)); vr_lamb - lamb is -1, +1, -3 (inside).
    diffs = np.array([2.0, 2.0, 3.0])
    mean, sd = diffs.mean(), diffs.std(ddof=1)
    half = 4.303 * sd / np.sqrt(3.0)
    line = f"{mean:+.2f} sd {sd:.2f} 95% [{mean - half:+.2f}, {mean + half:+.2f}]"
    label = "vr_lars - lars b4096 (seeds 0, 1, 2)".ljust(44)
    assert f"{label} {line}  outside the noise" in text
    assert "vr_lamb - lamb b8192 (seeds 0, 1, 2)" in text
    assert text.count("inside the noise") == 2 and text.count("outside the noise") == 2
    one_seed = {k: r for k, r in results.items() if r["seed"] == 0}
    label = "vr_lamb - lamb b4096 (seeds 0)".ljust(44)
    assert f"{label} -1.00 (one seed: no interval)" in study.report(one_seed, args)
    # A seed that collapsed to chance (finite loss, `diverged` false) or
    # diverged on either side: a second line for the seeds where both trained.
    results[study.key({**rows[9], "seed": 1})]["final_test_accuracy"] = 0.10  # vr_lars b8192
    results[study.key({**rows[12], "seed": 2})]["diverged"] = True  # lamb b4096
    text = study.report(results, args)
    for label, diffs in (
        ("vr_lars - lars b8192 (seeds 0, 1, 2)", [2.0, 10.0 - 79.0, 3.0]),
        ("  where both trained (seeds 0, 2)", [2.0, 3.0]),
        ("vr_lamb - lamb b4096 (seeds 0, 1, 2)", [-1.0, 1.0, -3.0]),
        ("  where both trained (seeds 0, 1)", [-1.0, 1.0]),
    ):
        diffs = np.array(diffs)
        mean, sd = diffs.mean(), diffs.std(ddof=1)
        half = {2: 12.706, 3: 4.303}[len(diffs)] * sd / np.sqrt(len(diffs))
        assert f"{label.ljust(44)} {mean:+.2f} sd {sd:.2f} 95% [{mean - half:+.2f}, " in text
    assert text.count("where both trained") == 2
    # The scale's per-epoch curve: from the lowest seed with a run folder.
    vr_lars = next(r for r in rows if r["optimizer"] == "vr_lars" and r["seed"] == 0)
    assert study._first_metrics(results, vr_lars, str(tmp_path)) is None
    for seed in (1, 2):
        folder = tmp_path / "runs" / study.key({**vr_lars, "seed": seed})
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text(
            json.dumps({"epoch": 0, "gsnr_scale": 0.4, "gsnr_at_gamma": 0.3}) + "\n"
        )
    assert study._first_metrics(results, vr_lars, str(tmp_path)) == (
        1,
        str(tmp_path / "runs" / study.key({**vr_lars, "seed": 1}) / "metrics.jsonl"),
    )
    paths = study.plot(results, args, str(tmp_path / "plots"))
    assert [os.path.basename(p) for p in paths] == ["rates.png", "scale.png", "samples.png"]
    # rates.png: a row of panels per pair, a column per batch; scale.png: a
    # row per batch.
    height, width = matplotlib.image.imread(paths[0]).shape[:2]
    assert (width, height) == (2 * 6 * 90, 2 * 3.5 * 90)
    height, width = matplotlib.image.imread(paths[1]).shape[:2]
    assert (width, height) == (12 * 90, 2 * 4 * 90)


def test_study_interval_part_runs_each_n_at_the_twins_rates():
    study = helpers.load_script("study")
    args = study.parse_args(
        ["--batches", "4096", "--pairs", "momentum", "adam", "--parts", "interval"]
        + ["--gsnr-intervals", "1", "4", "--at", "vr_adam=4"]
    )
    results = {
        study.key(r): r
        for r in (
            _study_row("vr_momentum", 4096, 1.0, 0, 0.86, scale=0.4),
            _study_row("vr_momentum", 4096, 2.0, 0, 0.83, scale=0.4),
        )
    }
    runs = study.interval(results, args)
    assert sorted(
        (r["optimizer"], r["lr_multiplier"], r["gsnr_interval"], r["seed"]) for r in runs
    ) == [
        (name, rate, n, seed)
        for name, rate in (("vr_adam", 4.0), ("vr_momentum", 1.0))
        for n in (1, 4)
        for seed in (0, 1)
    ]
    # N > 1 runs have keys of their own and stay out of the grid's best.
    row = _study_row("vr_momentum", 4096, 2.0, 0, 0.99, scale=0.4, gsnr_interval=4)
    assert study.key(row).endswith("_lr2_n4_s0")
    results[study.key(row)] = row
    assert (
        study.best_grid_rows(study.plain(results), args)[("vr_momentum", 4096)][
            "final_test_accuracy"
        ]
        == 0.86
    )
    text = study.report(results, args)
    assert "6. twins measuring the GSNR every N updates" in text
    assert "vr_momentum b4096 x2 N=4" in text


def test_click_study_auc_counts_ordered_pairs():
    """The click study's AUC against the fraction of (positive, negative)
    pairs ranked right, ties counting one half."""
    click = helpers.load_script("click_study")
    rng = np.random.default_rng(0)
    labels = rng.random(300) < 0.3
    scores = np.round(rng.random(300) + 0.4 * labels, 1)  # with ties
    positives, negatives = scores[labels], scores[~labels]
    pairs = (positives[:, None] > negatives[None, :]) + 0.5 * (
        positives[:, None] == negatives[None, :]
    )
    assert click.auc(labels, scores) == pytest.approx(pairs.mean(), abs=1e-12)


def test_click_study_ids_follow_the_zipf_law():
    click = helpers.load_script("click_study")
    args = click.parse_args(["--output", "unused", "--rows", "50", "--zipf", "1.2"])
    inputs = click.make_inputs(args, 200_000, np.random.default_rng(1))
    assert inputs["sparse_features"].shape == (200_000, 26)
    assert inputs["dense_features"].shape == (200_000, 13)
    counts = np.sort(np.bincount(inputs["sparse_features"][:, 0], minlength=50))[::-1]
    expected = np.arange(1, 51) ** -1.2
    np.testing.assert_allclose(counts / counts.sum(), expected / expected.sum(), atol=3e-3)


def test_click_study_rows_record_every_setting_of_the_task():
    """A result row is matched on resume by all the settings that shape
    the task and its training (not a subset): each flag but the output,
    seeds and optimizers is one."""
    click = helpers.load_script("click_study")
    args = click.parse_args(["--output", "unused", "--zipf", "1.3", "--test-examples", "7"])
    settings = click.settings_of(args)
    flags = set(vars(args)) - {"output", "seeds", "optimizers"}
    assert set(settings) == flags
    assert (settings["zipf"], settings["test_examples"], settings["batch"]) == (1.3, 7, 8_192)


def test_grid_experiment_is_derived_from_the_config():
    folder = os.path.join(ROOT, "configs", "fashion_mnist")
    # Adam at batch 4096 (config: 0.008, 140 updates of 4096 = 10 epochs),
    # 30 epochs at twice the rate: 14 updates an epoch.
    adam = grids.experiment(folder, "adam", 4096, epochs=30, seed=1, replicas=4, lr_multiplier=2)
    cosine = adam.block["learning_rate"]["cosine"]
    assert cosine["initial_learning_rate"] == pytest.approx(0.016)
    assert cosine["decay_steps"] == 30 * (60000 // 4096)
    assert (adam.batch_size, adam.seed, adam.replicas) == (4096, 1, 4)
    # VR-Adam with k = 4 x 2: updates of 2 steps of 2048, 29 steps an
    # epoch; the rate stays batch 4096's, times the multiplier. (A grid
    # run's fields and a script's arguments, as the scripts give them.)
    run = {"optimizer": "vr_adam", "batch": 4096, "seed": 0, "lr_multiplier": 0.5}
    script_args = argparse.Namespace(epochs=30, replicas=4)
    fields = {"gsnr_interval": 4}
    twin = grids.experiment_of_run(
        folder, run, script_args, width=8, accumulation=2, optimizer_fields=fields
    )
    cosine = twin.block["learning_rate"]["cosine"]
    assert cosine["initial_learning_rate"] == pytest.approx(0.004)
    assert cosine["decay_steps"] == 30 * (60000 // 2048) // 2
    assert twin.batch_size == 2048 and twin.model_width == 8
    assert twin.block["optimizer"]["vr_adam"] == {
        "gamma": 0.1,
        "beta_3": 0.9,
        "gradient_accumulation_steps": 2,
        "gsnr_interval": 4,
    }
    with pytest.raises(ValueError, match="does not split"):
        grids.experiment(folder, "vr_adam", 4096, epochs=1, seed=0, replicas=4, accumulation=3)


def test_grid_result_row_summarises_the_records():
    nan = float("nan")
    records = [
        {"test_accuracy": 0.8, "train_accuracy": 0.79, "generalization_gap": -0.01,
         "train_loss": 0.6, "test_loss": 0.62, "seconds": 10.0, "gsnr_scale": 0.5,
         "gsnr_at_gamma": 0.2, "gsnr_at_one": 0.1},
        {"test_accuracy": 0.85, "train_accuracy": 0.9, "generalization_gap": 0.05,
         "train_loss": 0.3, "test_loss": 0.4, "seconds": 12.0, "gsnr_scale": nan,
         "gsnr_at_gamma": nan, "gsnr_at_one": nan},
        {"test_accuracy": 0.84, "train_accuracy": 0.92, "generalization_gap": 0.08,
         "train_loss": 0.25, "test_loss": 0.45, "seconds": 11.0, "gsnr_scale": 0.25,
         "gsnr_at_gamma": 0.4, "gsnr_at_one": 0.0},
    ]  # fmt: skip
    run = {"optimizer": "vr_adam", "batch": 4096, "seed": 0}
    row = grids.result_row(run, records)
    assert row["optimizer"] == "vr_adam" and row["epochs"] == 3
    assert row["best_test_accuracy"] == 0.85 and row["final_test_accuracy"] == 0.84
    assert row["final_train_loss"] == 0.25 and row["seconds"] == 33.0
    assert not row["diverged"]
    # The epoch without a GSNR update (NaN) is left out of the means.
    assert row["mean_gsnr_scale"] == pytest.approx(0.375)
    assert row["mean_gsnr_at_gamma"] == pytest.approx(0.3)
    records[1]["train_loss"] = nan
    assert grids.result_row(run, records)["diverged"]
    base = [{k: v for k, v in r.items() if not k.startswith("gsnr")} for r in records]
    assert "mean_gsnr_scale" not in grids.result_row(run, base)


def test_grid_keeps_rows_and_skips_what_is_done(tmp_path, capsys):
    grid = grids.Grid(str(tmp_path / "out"), lambda run: f"r{run['i']}")
    trained = []

    def train_one(run):
        trained.append(run["i"])
        return {**run, "score": run["i"] * 10}

    grid.run_missing([{"i": 1}, {"i": 2}], train_one, lambda key, row: f"{key} {row['score']}")
    again = grids.Grid(str(tmp_path / "out"), lambda run: f"r{run['i']}")
    again.run_missing([{"i": 2}, {"i": 3}], train_one, lambda key, row: f"{key} {row['score']}")
    assert trained == [1, 2, 3]
    assert sorted(again.results) == ["r1", "r2", "r3"] and again.results["r3"]["score"] == 30
    assert capsys.readouterr().out.split("\n")[:3] == ["r1 10", "r2 20", "r3 30"]
    assert again.run_dir({"i": 3}) == str(tmp_path / "out" / "runs" / "r3")


def test_bench_versions_imports_a_commit_beside_this_checkout(tmp_path):
    import tf_vrgd

    versions = helpers.load_script("bench_versions")
    old = versions.import_at("HEAD", str(tmp_path))
    assert old.__name__ == "tf_vrgd_at_commit" and old.VRAdam is not tf_vrgd.VRAdam
    assert os.path.dirname(old.__file__) == str(tmp_path / "tf_vrgd_at_commit")
    # Its modules import each other, not this checkout's.
    assert old.vr_adam.GSNRMixin.__module__ == "tf_vrgd_at_commit._gsnr"
    assert old.VRAdam(1e-3).get_config()["gamma"] == tf_vrgd.VRAdam(1e-3).get_config()["gamma"]
    # The flags that time an interval's path; the thin model's variables.
    args = versions.parse_args(
        ["--commit", "HEAD", "--models", "thin_mlp", "--gsnr-interval", "16", "--no-xla"]
    )
    assert (args.gsnr_interval, args.no_xla, args.kind) == (16, True, "update")
    assert not args.control
    assert versions.parse_args(["--commit", "HEAD", "--control"]).control
    first = versions.parse_args(["--commit", "HEAD", "--kind", "first step", "--repeats", "3"])
    assert (first.kind, first.repeats) == ("first step", 3)
    with pytest.raises(SystemExit):
        versions.parse_args(["--commit", "HEAD", "--gsnr-interval", "0"])
    from tf_vrgd.experiments import bench_models

    model = bench_models.thin_mlp()
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
    assert len(sizes) == 214 and max(sizes) == 256 and sum(sizes) == 106 * 272 + 170
    x, y = bench_models.make_batch("thin_mlp", 8, np.random.default_rng(0))
    assert x.shape == (8, 16) and y.shape == (8,)


def test_bench_step_times_the_noise_scale_wrapper_at_each_interval():

    from tf_vrgd.experiments import benchmark

    settings, row = _one_update_at_intervals_1_and_4("NoiseScale", control=True)
    # The control: a second copy of the base, whose ratio is the noise floor.
    assert set(row["seconds"]) == {"base", "base again", "vr", "vr N=4"}
    assert all(seconds > 0 for seconds in row["seconds"].values())
    assert "base-again/base" in benchmark.format_row(row)
    # Adam's 28 B and 12 B a micro-step; the wrapper reads the gradient
    # twice more (its squared norm, the reduced one's) at measured updates.
    a = settings.accumulation
    moved = row["bytes_per_parameter"]
    assert (moved["base"], moved["vr"], moved["vr N=4"]) == (28 + 12 * a, 36 + 12 * a, 30 + 12 * a)
    assert moved["base again"] == moved["base"]


def test_bench_step_pairs_adascale_with_its_inner_adam():
    import tf_vrgd
    from tf_vrgd.experiments import benchmark

    base, twin, rule = benchmark.pairs()["AdaScale"]
    wrapped = twin()
    assert isinstance(wrapped, tf_vrgd.AdaScale) and type(wrapped.inner_optimizer) is type(base())
    assert "AdaScale" in benchmark.WRAPPER_PAIRS and rule == "Adam"
    # Adam's 28 B, and the two reads of the gradient for the squared norms
    # at every update.
    assert benchmark._candidate_bytes("AdaScale", wrapped) == 36
    assert benchmark._candidate_bytes("AdaScale", base()) == 28


def test_the_update_kind_gives_embedding_tables_rows(strategy):
    """`timing.Candidate`'s update feeds an embedding table a row-sparse
    gradient (one row per example and replica, as the training step does),
    every other variable a dense one: after one step of SGD(1), each table
    moved by minus the mean over replicas of its rows scattered (numpy)."""
    import keras

    from tf_vrgd.experiments import bench_models, timing

    replicas = strategy.num_replicas_in_sync
    batch = (np.zeros((2 * replicas, 2), np.int32), np.zeros(2 * replicas, np.int32))
    candidate = timing.Candidate(
        "sgd",
        lambda: keras.optimizers.SGD(1.0),
        lambda: bench_models.tables(count=2, rows=40, width=3),
        strategy,
        batch,
    )
    variables = candidate.model.trainable_variables
    before = [v.numpy().copy() for v in variables]
    candidate.functions["update"]()
    tables = 0
    for variable, start, gradient in zip(variables, before, candidate._gradients):
        if isinstance(gradient, tuple):
            tables += 1
            values, ids, _ = (np.asarray(part) for part in gradient)
            assert ids.shape == (replicas, 2)  # the local batch: 2 examples
            expected = start.astype(np.float64).copy()
            for r in range(replicas):
                np.add.at(expected, ids[r], -values[r].astype(np.float64) / replicas)
        else:
            expected = start - np.asarray(gradient, np.float64).mean(axis=0)
        np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-5, atol=1e-7)
    assert tables == 2


def test_the_adascale_study_arms_read_as_vrgd_train_reads_them():
    """Each arm's config and overrides as `vrgd-train` applies them: the
    linear rule at S x the rate over 10 epochs, AdaScale on the base's own
    schedule (not rescaled) for whole epochs of at least its 2340 updates."""
    import tf_vrgd
    from tf_vrgd import config
    from tf_vrgd.experiments import experiment_config, fashion_mnist

    study = helpers.load_script("adascale_study")
    for scale in (8, 32):
        arms = {}
        for arm in ("base", "linear", "adascale", "vr_momentum"):
            path, overrides = study.arm_overrides(arm, scale)
            cfg = experiment_config.apply_overrides(
                config.load(path), [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
            )
            arms[arm] = fashion_mnist.Experiment(cfg)
        assert arms["base"].batch_size == 256 and arms["base"].epochs == 10
        for arm in ("linear", "adascale", "vr_momentum"):
            assert arms[arm].batch_size == 256 * scale and not arms[arm].rescaled, arm
        base_rate = config.learning_rate_from_config(arms["base"].block)
        linear = config.learning_rate_from_config(arms["linear"].block)
        # At the end of the one-epoch warm-up: S times the base's peak.
        per_epoch = 60000 // (256 * scale)
        assert float(linear(per_epoch)) == pytest.approx(scale * float(base_rate(234)), rel=1e-2)
        adascale = arms["adascale"]
        assert (
            adascale.epochs * adascale.steps_per_epoch
            >= 2340
            > ((adascale.epochs - 1) * adascale.steps_per_epoch)
        )
        optimizer = config.optimizer_from_config(adascale.block)
        assert isinstance(optimizer, tf_vrgd.AdaScale) and optimizer.scale == scale
        schedule = config.learning_rate_from_config(adascale.block)
        for step in (0, 100, 234, 1000, 2339):
            assert float(schedule(step)) == float(base_rate(step))
