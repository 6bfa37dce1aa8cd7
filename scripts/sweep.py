"""The Fashion-MNIST large-batch study (the analog of the paper's Table 11).

    python scripts/sweep.py --output runs/sweep               # the whole grid
    python scripts/sweep.py --batches 2048 8192 --lr-multipliers 1 --output runs/sweep

Grid: batch sizes x {Momentum, Adam, LAMB, LARS} x {base, VR twin} x a
learning-rate grid (multipliers of each config's square-root-scaled rate),
all for the same number of epochs; at the largest batches the best rate of
each optimizer is rerun with more seeds. Every run is one config of
configs/fashion_mnist/ trained by `vrgd-train`'s code in this process, on 4
replicas. Results go to `results.jsonl` one line per run, as each finishes:
an interrupted sweep resumes where it stopped (finished runs are skipped,
an unfinished one resumes from its last epoch checkpoint). At the end (and
with --report) it prints the table: best test accuracy per optimizer and
batch (over the rate grid, as the paper reports), and the generalization
gap of that run.

Sizing: at the defaults (5 batch sizes, 3 rates, 4 epochs) the grid is 120
runs plus 16 extra-seed runs. On 2 CPU cores a run took 67-95 s at batches
1024-8192 and about 2.2 min at 256 when first run (3 to 4 hours in all);
a later batch-256 grid took about 50 s a run (docs/RESULTS.md).
"""

import argparse
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs", "fashion_mnist")
OPTIMIZERS = ["momentum", "adam", "lamb", "lars"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="runs/sweep")
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192])
    parser.add_argument("--optimizers", nargs="+", default=OPTIMIZERS, choices=OPTIMIZERS)
    parser.add_argument("--lr-multipliers", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--seeds", type=int, default=1, help="seeds of every grid point")
    parser.add_argument(
        "--extra-seeds",
        type=int,
        default=1,
        help="more seeds for the best rate at the two largest batches",
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument(
        "--report", action="store_true", help="print the table of results.jsonl and exit"
    )
    parser.add_argument(
        "--noise-scale",
        action="store_true",
        help="wrap each base optimizer in tf_vrgd.NoiseScale (the same updates), so that every "
        "run logs B_simple per epoch (the twins log it anyway); the report adds a table of it",
    )
    return parser.parse_args(argv)


def _key(run):
    return f"{run['optimizer']}_b{run['batch']}_lr{run['lr_multiplier']:g}_s{run['seed']}"


def experiment_for(run, args):
    from tf_vrgd.experiments import grids

    return grids.experiment_of_run(CONFIGS, run, args, noise_scale=args.noise_scale)


def grid(args):
    runs = []
    for batch in args.batches:
        for base in args.optimizers:
            for name in (base, f"vr_{base}"):
                for multiplier in args.lr_multipliers:
                    for seed in range(args.seeds):
                        runs.append(
                            {
                                "optimizer": name,
                                "batch": batch,
                                "lr_multiplier": multiplier,
                                "seed": seed,
                            }
                        )
    return runs


def best_rows(results):
    """Best run per (optimizer, batch) over the rate grid (seed 0), with the
    mean and spread over the seeds run at that rate."""
    best = {}
    for row in results.values():
        if row["seed"] != 0:
            continue
        key = (row["optimizer"], row["batch"])
        if key not in best or row["best_test_accuracy"] > best[key]["best_test_accuracy"]:
            best[key] = row
    table = {}
    for key, row in best.items():
        seeds = [
            r
            for r in results.values()
            if (r["optimizer"], r["batch"]) == key and r["lr_multiplier"] == row["lr_multiplier"]
        ]
        accs = [r["best_test_accuracy"] for r in seeds]
        table[key] = {
            **row,
            "seeds": len(seeds),
            "mean_best_test_accuracy": sum(accs) / len(accs),
            "min_best": min(accs),
            "max_best": max(accs),
        }
    return table


def report(results):
    table = best_rows(results)
    batches = sorted({b for _, b in table})
    lines = ["best test accuracy % (rate multiplier; generalization gap in points; seeds)", ""]
    header = f"{'optimizer':<12}" + "".join(f"{b:>24}" for b in batches)
    lines += [header, "-" * len(header)]
    for base in OPTIMIZERS:
        for name in (base, f"vr_{base}"):
            if not any(k[0] == name for k in table):
                continue
            cells = []
            for b in batches:
                row = table.get((name, b))
                if row is None:
                    cells.append(f"{'-':>24}")
                    continue
                spread = (
                    f"±{(row['max_best'] - row['min_best']) * 50:.1f}" if row["seeds"] > 1 else ""
                )
                cells.append(
                    f"{row['mean_best_test_accuracy'] * 100:6.2f}{spread:<5} "
                    f"(x{row['lr_multiplier']:g};{row['generalization_gap'] * 100:+.1f};"
                    f"{row['seeds']})".rjust(24)
                )
            lines.append(f"{name:<12}" + "".join(cells))
    return "\n".join(lines + _noise_scale_lines(table, batches))


def _noise_scale_lines(table, batches):
    """B_simple (examples) after the first and the last epoch of each best
    run that logged it, per optimizer and batch."""
    lines = []
    for name in [n for base in OPTIMIZERS for n in (base, f"vr_{base}")]:
        cells = []
        for b in batches:
            per_epoch = (table.get((name, b)) or {}).get("noise_scale_per_epoch")
            cells.append(
                f"{per_epoch[0]:>8.0f} -> {per_epoch[-1]:<8.0f}" if per_epoch else f"{'-':>20}"
            )
        if any(c.strip() != "-" for c in cells):
            lines.append(f"{name:<12}" + "".join(f"{c:>24}" for c in cells))
    if not lines:
        return []
    header = f"{'optimizer':<12}" + "".join(f"{b:>24}" for b in batches)
    return [
        "",
        "gradient noise scale B_simple, examples: after the first epoch -> after the last",
        "",
        header,
        "-" * len(header),
        *lines,
    ]


def main(argv=None):
    args = parse_args(argv)
    from tf_vrgd.experiments import grids

    runs = grids.Grid(args.output, _key)
    results = runs.results
    if args.report:
        print(report(results))
        return 0

    strategy, arrays = grids.fashion_setup(args.replicas, args.data_dir, args.cache_dir)

    def run_all(chosen):
        runs.run_missing(
            chosen,
            lambda run: grids.train(
                run, experiment_for(run, args), strategy, arrays, runs.run_dir(run)
            ),
            lambda run_key, row: (
                f"{run_key:<32} best test acc {row['best_test_accuracy']:.4f} "
                f"gap {row['generalization_gap']:+.4f} ({row['seconds']:.0f} s)"
            ),
        )

    run_all(grid(args))
    # More seeds at the two largest batches, for each optimizer's best rate.
    largest = sorted(args.batches)[-2:]
    extra = []
    for (name, batch), row in best_rows(results).items():
        if batch in largest:
            for seed in range(args.seeds, args.seeds + args.extra_seeds):
                extra.append(
                    {
                        "optimizer": name,
                        "batch": batch,
                        "lr_multiplier": row["lr_multiplier"],
                        "seed": seed,
                    }
                )
    run_all(extra)
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
