"""What the VR family's gains are made of: the large-batch study of
docs/RESULTS.md ("What the VR gains are made of").

    python scripts/study.py --output runs/study            # all parts, resumable
    python scripts/study.py --output runs/study --report   # the tables only

On Fashion-MNIST (the CNN of configs/fashion_mnist at the width given), for
the Momentum, Adam, LARS and LAMB pairs (`--pairs`; LARS and LAMB sweep the
learning rate at the configs' trust coefficient eeta = 0.001 and LAMB's
fixed trust ratio) at global batches 4096 and 8192, every run the
same number of epochs (default 30) with the config's schedule (warm-up,
cosine decay) stretched to it, in four parts:

1. `grid`: each optimizer at rate multipliers 0.125 to 4 of the config's
   square-root-scaled rate, seed 0. Where a best rate sits at the grid's
   edge, widen it for that pair (`--pairs adam --lr-multipliers 8 16
   --parts grid`); tables and best rates take every grid rate run.
2. `seeds`: each optimizer's best rate of part 1 again with seeds 1 to
   `--seeds` - 1 (default 2 seeds in all); the report pairs each twin with
   its base by seed (the same initial weights and data order) and gives
   the mean difference with its 95% t interval. An optimizer whose grid
   ran into another output takes its best rate from `--at` (`--at
   momentum=0.5 vr_momentum=1`) and runs seeds 0 to `--seeds` - 1 here.
3. `effective`: each base at its twin's effective rate, the twin's best
   rate x the twin's mean applied GSNR scale over its run (the
   `gsnr_scale` statistic), seeds 0 and 1: does the twin beat its base run
   at the rate the twin actually applied?
4. `samples`: each twin at its best rate with k = 4, 8, 16, 32 gradient
   samples per update at the same global batch (replicas x accumulation;
   schedules count updates, so every k takes the same number of updates),
   seeds 0 to `--samples-seeds` - 1 (default: seed 0 only).

Part `interval`, run only when named (`--parts interval`), trains each twin
at its best grid rate (or the rate `--at vr_adam=4` gives) with
gsnr_interval = N for each of `--gsnr-intervals` (default 1 4 16), seeds 0
to `--seeds` - 1: what measuring the GSNR every N updates costs in
accuracy. Its runs with N > 1 take no part in the other parts and plots.

Parts 1 to 3 use k = `--replicas` x `--accumulation` (default 4 x 2 = 8, the
paper's 8 GPUs) for the twins; the bases take the same global batch in one
step per update, which is the same update (k means nothing to them).
Results go to `results.jsonl`, one line per run as each finishes; a rerun
skips finished runs and resumes an unfinished one from its last epoch
checkpoint. The learning-rate multiplier of an `effective` run is
not on the grid: its key records the twin it follows.
"""

import argparse
import math
import os
import statistics as stats
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs", "fashion_mnist")
PAIRS = ("momentum", "adam", "lars", "lamb")
PARTS = ("grid", "seeds", "effective", "samples")
# Asked for by name only (`--parts interval`): the GSNR interval's cost.
EXTRA_PARTS = ("interval",)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="runs/study")
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=PAIRS)
    parser.add_argument("--batches", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument(
        "--lr-multipliers", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0, 2.0, 4.0]
    )
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--width", type=int, default=8, help="CNN width (configs: 16)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--samples", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument(
        "--samples-batch", type=int, default=None, help="batch of part 4 (default: the largest)"
    )
    parser.add_argument(
        "--seeds", type=int, default=2, help="seeds 0..N-1 at the best rates (part 2)"
    )
    parser.add_argument(
        "--samples-seeds", type=int, default=1, help="seeds 0..N-1 at each k (part 4)"
    )
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS + EXTRA_PARTS)
    parser.add_argument(
        "--gsnr-intervals",
        type=int,
        nargs="+",
        default=[1, 4, 16],
        help="part `interval`: each twin at these gsnr_interval values",
    )
    parser.add_argument(
        "--at",
        nargs="+",
        default=[],
        metavar="NAME=MULTIPLIER",
        help="parts `interval` and `seeds`: an optimizer's rate multiplier where no grid "
        "run of this output gives its best (the seeds part then runs seed 0 too)",
    )
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--report", action="store_true", help="print the tables and exit")
    parser.add_argument(
        "--plots", default=None, help="with --report: write the study's PNG plots to this folder"
    )
    return parser.parse_args(argv)


def key(run):
    text = f"{run['optimizer']}_b{run['batch']}_k{run['k']}_lr{run['lr_multiplier']:.6g}"
    if run.get("gsnr_interval", 1) > 1:
        text += f"_n{run['gsnr_interval']}"
    if run.get("follows"):
        text += f"_at_{run['follows']}"
    return f"{text}_s{run['seed']}"


def experiment_for(run, args):
    """The `fashion_mnist.Experiment` of one run: the batch's config with the
    study's width and epochs, a twin's k samples as replicas x accumulation,
    the rate scaled by the multiplier."""
    from tf_vrgd.experiments import grids

    name = run["optimizer"]
    accumulation = run["k"] // args.replicas
    if accumulation * args.replicas != run["k"] or run["batch"] % (accumulation * args.replicas):
        raise ValueError(f"k = {run['k']} does not fit {args.replicas} replicas and the batch.")
    fields = {}
    if run.get("gsnr_interval", 1) > 1:
        fields["gsnr_interval"] = run["gsnr_interval"]
    # A base takes the whole batch in one step: the same update as
    # accumulating it (the CNN has no batch statistics), and Keras'
    # accumulation does not run under MirroredStrategy (a collective inside
    # its tf.cond).
    return grids.experiment_of_run(
        CONFIGS,
        run,
        args,
        name=name,
        width=args.width,
        accumulation=accumulation if name.startswith("vr_") else 1,
        optimizer_fields=fields,
    )


# --- the parts ----------------------------------------------------------------


def grid(results, args):
    k = args.replicas * args.accumulation
    return [
        {"optimizer": name, "batch": batch, "k": k, "lr_multiplier": m, "seed": 0}
        for batch in args.batches
        for pair in args.pairs
        for name in (pair, f"vr_{pair}")
        for m in args.lr_multipliers
    ]


def grid_multipliers(results, args):
    """The rate multipliers of the grid: --lr-multipliers, and those of
    grid runs added with other --lr-multipliers (a grid widened where an
    optimizer's best rate was at its edge)."""
    k = args.replicas * args.accumulation
    found = {
        r["lr_multiplier"]
        for r in results.values()
        if not r["seed"] and r["k"] == k and not r.get("follows")
    }
    # The effective-rate runs are not grid points; the k runs have another k.
    return sorted(set(args.lr_multipliers) | found)


def best_grid_rows(results, args):
    """{(optimizer, batch): the seed-0 grid row of highest final test
    accuracy, over every grid rate run}, for the batches of `args`."""
    k = args.replicas * args.accumulation
    best = {}
    for row in results.values():
        if row["seed"] or row["k"] != k or row.get("follows"):
            continue
        if row["batch"] not in args.batches:
            continue
        if row["optimizer"].removeprefix("vr_") not in args.pairs:
            continue
        slot = (row["optimizer"], row["batch"])
        if slot not in best or _score(row) > _score(best[slot]):
            best[slot] = row
    return best


def _diverged(row):
    """A non-finite loss (the row's `diverged`) or accuracy."""
    return row["diverged"] or not math.isfinite(row["final_test_accuracy"])


def _score(row):
    return -1.0 if _diverged(row) else row["final_test_accuracy"]


def seeds(results, args):
    """Seeds 1 to `--seeds` - 1 at each best grid rate; for an optimizer of
    `--at` that has no grid row in this output (its grid ran elsewhere),
    seeds 0 to `--seeds` - 1 at the rate given."""
    best = best_grid_rows(results, args)
    runs = [
        {**_run_fields(row), "seed": seed} for row in best.values() for seed in range(1, args.seeds)
    ]
    k = args.replicas * args.accumulation
    for name, rate in given_rates(args).items():
        if name.removeprefix("vr_") not in args.pairs:
            continue
        for batch in args.batches:
            if (name, batch) in best:
                continue  # the grid of this output decides
            run = {"optimizer": name, "batch": batch, "k": k, "lr_multiplier": rate}
            runs += [{**run, "seed": seed} for seed in range(args.seeds)]
    return runs


def given_rates(args):
    """{optimizer: rate multiplier} of `--at NAME=MULTIPLIER`."""
    given = {}
    for item in args.at:
        name, _, multiplier = item.partition("=")
        try:
            rate = float(multiplier)
        except ValueError:
            rate = None
        if name.removeprefix("vr_") not in PAIRS or rate is None or not rate > 0:
            raise SystemExit(f"--at takes OPTIMIZER=MULTIPLIER (e.g. vr_adam=4), not {item!r}.")
        given[name] = rate
    return given


def effective(results, args):
    runs = []
    for (name, batch), row in sorted(best_grid_rows(results, args).items()):
        if not name.startswith("vr_") or "mean_gsnr_scale" not in row:
            continue
        multiplier = row["lr_multiplier"] * row["mean_gsnr_scale"]
        for seed in (0, 1):
            runs.append(
                {
                    "optimizer": name.removeprefix("vr_"),
                    "batch": batch,
                    "k": row["k"],
                    "lr_multiplier": round(multiplier, 6),
                    "seed": seed,
                    "follows": key(row),
                }
            )
    return runs


def samples(results, args):
    batch = args.samples_batch or max(args.batches)
    runs = []
    for (name, b), row in sorted(best_grid_rows(results, args).items()):
        if b != batch or not name.startswith("vr_"):
            continue
        for k in args.samples:
            for seed in range(args.samples_seeds):
                runs.append({**_run_fields(row), "k": k, "seed": seed})
    return runs


def interval(results, args):
    """Each twin of `args.pairs` at its best grid rate (or the `--at` one),
    at every `--gsnr-intervals` N, seeds 0 to `--seeds` - 1."""
    k = args.replicas * args.accumulation
    given = given_rates(args)
    best = best_grid_rows(plain(results), args)
    runs = []
    for batch in args.batches:
        for pair in args.pairs:
            name = f"vr_{pair}"
            if name in given:
                rate = given[name]
            elif (name, batch) in best:
                rate = best[(name, batch)]["lr_multiplier"]
            else:
                continue
            for n in args.gsnr_intervals:
                for seed in range(args.seeds):
                    run = {"optimizer": name, "batch": batch, "k": k, "lr_multiplier": rate}
                    runs.append({**run, "seed": seed, "gsnr_interval": n})
    return runs


def _interval_lines(results, args):
    measured = [
        r
        for r in results.values()
        if r["optimizer"].startswith("vr_") and "gsnr_interval" in r and r["batch"] in args.batches
    ]
    groups = _seed_groups(
        measured, lambda r: (r["optimizer"], r["batch"], r["lr_multiplier"], r["gsnr_interval"])
    )
    return [
        _summary_line(f"{name} b{batch} x{rate:g} N={n}", group)
        for (name, batch, rate, n), group in groups
    ]


def _seed_groups(rows, key):
    """The `rows` grouped by `key(row)`: ``[(key, rows in seed order)]`` in
    the keys' order."""
    groups = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    return [(k, sorted(group, key=lambda r: r["seed"])) for k, group in sorted(groups.items())]


def _run_fields(row):
    return {f: row[f] for f in ("optimizer", "batch", "k", "lr_multiplier", "seed")}


# --- report ---------------------------------------------------------------------


def _pct(value):
    return f"{value * 100:.2f}" if math.isfinite(value) else "nan"


def report(results, args):
    everything, results = results, plain(results)
    k = args.replicas * args.accumulation
    names = [n for pair in args.pairs for n in (pair, f"vr_{pair}")]
    lines = [
        f"1. final test accuracy % by rate multiplier (seed 0, k = {k}, "
        f"{args.epochs} epochs); * marks the best",
        "",
    ]
    best = best_grid_rows(results, args)
    for batch in args.batches:
        multipliers = grid_multipliers(results, args)
        header = f"batch {batch:<6}" + "".join(f"{m:>9g}" for m in multipliers)
        lines += [header, "-" * len(header)]
        for name in names:
            cells = []
            for m in multipliers:
                row = results.get(
                    key({"optimizer": name, "batch": batch, "k": k, "lr_multiplier": m, "seed": 0})
                )
                mark = "*" if row is not None and best.get((name, batch)) is row else " "
                cells.append(f"{(_pct(row['final_test_accuracy']) if row else '-') + mark:>9}")
            lines.append(f"{name:<12}" + "".join(cells))
        lines.append("")

    lines += [
        "2. at the best rate, every seed run: final test accuracy % (mean, each seed), "
        "train accuracy %, gap in points; twins: mean applied scale, fraction at gamma",
        "",
    ]
    for (name, batch), row in sorted(best.items(), key=lambda x: (x[0][1], names.index(x[0][0]))):
        rows = [
            r
            for r in results.values()
            if _run_fields(r) == {**_run_fields(row), "seed": r["seed"]} and not r.get("follows")
        ]
        rows.sort(key=lambda r: r["seed"])
        lines.append(_summary_line(f"{name} b{batch} x{row['lr_multiplier']:g}", rows))
    lines.append("")

    lines += ["3. each base at its twin's effective rate (twin's rate x mean applied scale)", ""]
    followers = [r for r in results.values() if r.get("follows")]
    for (twin, multiplier), rows in _seed_groups(
        followers, lambda r: (r["follows"], r["lr_multiplier"])
    ):
        lines.append(_summary_line(f"{rows[0]['optimizer']} x{multiplier:.3g} (at {twin})", rows))
    lines.append("")

    lines += ["4. twins at their best rate, k samples per update at a fixed global batch", ""]
    other_k = [r for r in results.values() if r["k"] != k and not r.get("follows")]
    for (name, batch, samples_k, _), rows in _seed_groups(
        other_k, lambda r: (r["optimizer"], r["batch"], r["k"], r["lr_multiplier"])
    ):
        lines.append(_summary_line(f"{name} b{batch} k={samples_k}", rows))
    for (name, batch), row in sorted(best.items()):
        if name.startswith("vr_") and batch == (args.samples_batch or max(args.batches)):
            lines.append(_summary_line(f"{name} b{batch} k={k} (part 1)", [row]))
    lines += [
        "",
        "5. twin minus base at their best rates, paired by seed (same initial weights and "
        "data order): mean, sample standard deviation and 95% t interval, in points",
        "",
    ]
    for batch in args.batches:
        for pair in args.pairs:
            text = _paired_line(results, best, pair, batch)
            if text:
                lines.append(text)
    lines.append("")

    measured = _interval_lines(everything, args)
    if measured:
        lines += [
            "6. twins measuring the GSNR every N updates (gsnr_interval = N), at their rates",
            "",
            *measured,
            "",
        ]
    return "\n".join(lines)


def plain(results):
    """The runs that measure the GSNR at every update (parts 1 to 5 and the
    plots read these; part `interval` adds the others)."""
    return {key: r for key, r in results.items() if r.get("gsnr_interval", 1) == 1}


# Two-sided 95% quantiles of Student's t by degrees of freedom (1 to 9).
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262)


def paired_difference(twin, base):
    """(mean, sample sd, 95% half-width) of twin - base over the seeds both
    have, from {seed: accuracy} mappings; sd and half-width are nan for
    fewer than 2 seeds."""
    seeds = sorted(set(twin) & set(base))
    diffs = [twin[s] - base[s] for s in seeds]
    if not diffs:
        return None
    mean = stats.fmean(diffs)
    if len(diffs) < 2:
        return mean, math.nan, math.nan, seeds
    sd = stats.stdev(diffs)
    return mean, sd, T_975[len(diffs) - 2] * sd / math.sqrt(len(diffs)), seeds


# Fashion-MNIST has 10 balanced classes: a run that ends within a point of
# 10% test accuracy has collapsed (its loss sits at ln 10, finite, so the
# row's `diverged`, which marks a non-finite loss, stays false).
CHANCE = 0.11


def failed(row):
    """Whether a run diverged (non-finite loss) or collapsed to chance."""
    return _diverged(row) or row["final_test_accuracy"] <= CHANCE


def _seed_rows(results, row):
    return {
        r["seed"]: r
        for r in results.values()
        if _run_fields(r) == {**_run_fields(row), "seed": r["seed"]} and not r.get("follows")
    }


def _paired_line(results, best, pair, batch):
    """The paired difference's line; where a seed failed on either side, a
    second line for the seeds where both trained."""
    if (pair, batch) not in best or (f"vr_{pair}", batch) not in best:
        return None
    base = _seed_rows(results, best[(pair, batch)])
    twin = _seed_rows(results, best[(f"vr_{pair}", batch)])
    label = f"vr_{pair} - {pair} b{batch}"
    text = _difference_text(label, twin, base)
    lost = sorted(s for s in set(twin) & set(base) if failed(twin[s]) or failed(base[s]))
    if lost:
        kept = set(twin) - set(lost)
        text += "\n" + _difference_text("  where both trained", {s: twin[s] for s in kept}, base)
    return text


def _difference_text(label, twin, base):
    result = paired_difference(
        {s: r["final_test_accuracy"] for s, r in twin.items()},
        {s: r["final_test_accuracy"] for s, r in base.items()},
    )
    if result is None:
        return f"{label:<44} no seed in common"
    mean, sd, half, seeds = result
    label = f"{label} (seeds {', '.join(map(str, seeds))})".ljust(44)
    if not math.isfinite(half):
        return f"{label} {mean * 100:+.2f} (one seed: no interval)"
    verdict = "inside the noise" if abs(mean) <= half else "outside the noise"
    return (
        f"{label} {mean * 100:+.2f} sd {sd * 100:.2f} 95% [{(mean - half) * 100:+.2f}, "
        f"{(mean + half) * 100:+.2f}]  {verdict}"
    )


def _summary_line(label, rows):
    accs = [r["final_test_accuracy"] for r in rows]
    text = (
        f"{label:<44} test {_pct(stats.fmean(accs)):>6} "
        f"({', '.join(_pct(a) for a in accs)}) "
        f"train {_pct(stats.fmean(r['final_train_accuracy'] for r in rows)):>6} "
        f"gap {stats.fmean(r['generalization_gap'] for r in rows) * 100:+.2f}"
    )
    if "mean_gsnr_scale" in rows[0]:
        text += (
            f"  scale {stats.fmean(r['mean_gsnr_scale'] for r in rows):.3f}"
            f" at-gamma {stats.fmean(r['mean_gsnr_at_gamma'] for r in rows):.2f}"
        )
    return text


def plot(results, args, folder):
    """rates.png (final test accuracy against the rate, per batch),
    scale.png (the twins' applied scale and fraction at gamma per epoch, at
    their best rates) and samples.png (test accuracy against k)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tf_vrgd.experiments import reporting

    os.makedirs(folder, exist_ok=True)
    k = args.replicas * args.accumulation
    names = [n for pair in args.pairs for n in (pair, f"vr_{pair}")]
    paths = []

    # One row of panels per pair (base and twin), one column per batch.
    fig, axes = plt.subplots(
        len(args.pairs),
        len(args.batches),
        figsize=(6 * len(args.batches), 3.5 * len(args.pairs)),
        squeeze=False,
    )
    for pair, row_axes in zip(args.pairs, axes):
        for ax, batch in zip(row_axes, args.batches):
            for name in (pair, f"vr_{pair}"):
                points = _accuracy_points(
                    results, "lr_multiplier", optimizer=name, batch=batch, k=k, seed=0
                )
                if points:
                    style = "o-" if name.startswith("vr_") else "s--"
                    ax.plot(*zip(*points), style, label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("learning-rate multiplier")
            ax.set_ylabel("final test accuracy")
            ax.set_ylim(0.7, 0.92)
            ax.set_title(f"{pair}, batch {batch}, {args.epochs} epochs, k = {k}")
            ax.grid(alpha=0.3)
    paths.append(_save(fig, folder, "rates.png"))

    # A row of panels per batch: each twin at its best rate, the lowest seed
    # whose run folder (per-epoch metrics) this output holds.
    best = best_grid_rows(results, args)
    fig, axes = plt.subplots(
        len(args.batches), 2, figsize=(12, 4 * len(args.batches)), squeeze=False
    )
    for batch, (scale_ax, gamma_ax) in zip(args.batches, axes):
        for (name, row_batch), row in sorted(best.items()):
            if not name.startswith("vr_") or row_batch != batch:
                continue
            found = _first_metrics(results, row, args.output)
            if found is None:
                continue
            seed, metrics = found
            with open(metrics) as f:
                records = [json.loads(line) for line in f]
            epochs = [r["epoch"] + 1 for r in records]
            label = f"{name} x{row['lr_multiplier']:g}" + (f" (seed {seed})" if seed else "")
            scale_ax.plot(epochs, [r["gsnr_scale"] for r in records], label=label)
            gamma_ax.plot(epochs, [r["gsnr_at_gamma"] for r in records], label=label)
        scale_ax.set_ylabel("mean applied scale (effective rate multiplier)")
        gamma_ax.set_ylabel("fraction of elements at gamma")
        scale_ax.set_title(f"batch {batch}")
        gamma_ax.set_title(f"batch {batch}")
    reporting.label_axes(axes.ravel(), "epoch")
    paths.append(_save(fig, folder, "scale.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    batch = args.samples_batch or max(args.batches)
    for name in names:
        if not name.startswith("vr_") or (name, batch) not in best:
            continue
        rate = best[(name, batch)]["lr_multiplier"]
        points = _accuracy_points(
            results, "k", optimizer=name, batch=batch, lr_multiplier=rate, seed=0
        )
        if points:
            ax.plot(*zip(*points), "o-", label=f"{name} x{rate:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (gradient samples per update)")
    ax.set_ylabel("final test accuracy")
    ax.set_title(f"batch {batch}: the same updates, k samples each")
    ax.grid(alpha=0.3)
    paths.append(_save(fig, folder, "samples.png"))
    return paths


def _first_metrics(results, row, output):
    """(seed, path) of the per-epoch metrics of `row`'s run at the lowest
    seed whose run folder `output` holds, or None."""
    for seed in sorted(_seed_rows(results, row)):
        path = os.path.join(output, "runs", key({**row, "seed": seed}), "metrics.jsonl")
        if os.path.exists(path):
            return seed, path
    return None


def _accuracy_points(results, x, **fields):
    """Sorted (row[x], final test accuracy) of the rows with these `fields`
    (effective-rate runs left out)."""
    return sorted(
        (r[x], r["final_test_accuracy"])
        for r in results.values()
        if all(r[f] == v for f, v in fields.items()) and not r.get("follows")
    )


def _save(fig, folder, name):
    from tf_vrgd.experiments import reporting

    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    return reporting.save_figure(fig, os.path.join(folder, name), dpi=90)


def main(argv=None):
    args = parse_args(argv)
    from tf_vrgd.experiments import grids

    runs = grids.Grid(args.output, key)
    results = runs.results
    if args.report:
        print(report(results, args))
        if args.plots:
            print("plots:", ", ".join(plot(plain(results), args, args.plots)))
        return 0

    strategy, arrays = grids.fashion_setup(args.replicas, args.data_dir, args.cache_dir)

    def train_one(run):
        return grids.train(run, experiment_for(run, args), strategy, arrays, runs.run_dir(run))

    def describe(run_key, row):
        return (
            f"{run_key:<48} test {row['final_test_accuracy']:.4f} "
            f"gap {row['generalization_gap']:+.4f} ({row['seconds']:.0f} s)"
        )

    parts = {
        "grid": grid,
        "seeds": seeds,
        "effective": effective,
        "samples": samples,
        "interval": interval,
    }
    for part in PARTS + EXTRA_PARTS:
        if part in args.parts:
            chosen = parts[part](results if part == "interval" else plain(results), args)
            runs.run_missing(chosen, train_one, describe)
    print(report(results, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
