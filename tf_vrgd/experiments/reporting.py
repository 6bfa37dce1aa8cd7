"""The Fashion-MNIST runs' summary table and plots, and the figure helpers
the experiment scripts share."""

import os


def summarize(runs, experiment):
    """One row per run: final and best figures."""
    rows = []
    for name, records in runs.items():
        if not records:
            continue
        last = records[-1]
        rows.append(
            {
                "run": name,
                "batch": experiment.batch_size,
                # The gradient noise scale (VR runs), after the first and last epochs.
                "noise_scale_start": records[0].get("noise_scale", float("nan")),
                "noise_scale_end": last.get("noise_scale", float("nan")),
                "replicas": experiment.replicas,
                "epochs": len(records),
                "train_acc": last["train_accuracy"],
                "test_acc": last["test_accuracy"],
                "best_test_acc": max(r["test_accuracy"] for r in records),
                "gap": last["generalization_gap"],
                "train_loss": last["train_loss"],
                "test_loss": last["test_loss"],
                "s_per_epoch": sum(r["seconds"] for r in records) / len(records),
            }
        )
    return rows


def format_table(rows):
    columns = [
        ("run", "{}"),
        ("batch", "{}"),
        ("noise_scale_start", "{:.4g}"),
        ("noise_scale_end", "{:.4g}"),
        ("replicas", "{}"),
        ("epochs", "{}"),
        ("train_acc", "{:.4f}"),
        ("test_acc", "{:.4f}"),
        ("best_test_acc", "{:.4f}"),
        ("gap", "{:+.4f}"),
        ("train_loss", "{:.4f}"),
        ("test_loss", "{:.4f}"),
        ("s_per_epoch", "{:.1f}"),
    ]
    cells = [[name for name, _ in columns]] + [
        [fmt.format(row[name]) for name, fmt in columns] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(runs, output, batch=None):
    """accuracy.png, loss.png (all runs), gsnr_<run>.png (per layer) and,
    where runs logged it, noise_scale.png (per epoch, with the `batch` as a
    horizontal line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for metric in ("accuracy", "loss"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, records in runs.items():
            epochs = [r["epoch"] + 1 for r in records]
            for split, style in (("train", "--"), ("test", "-")):
                ax.plot(
                    epochs,
                    [r[f"{split}_{metric}"] for r in records],
                    style,
                    label=f"{name} {split}",
                )
        ax.set_ylabel(metric)
        ax.legend()
        label_axes([ax], "epoch")
        paths.append(save_figure(fig, os.path.join(output, f"{metric}.png")))
    for name, records in runs.items():
        keys = sorted({k for r in records for k in r if k.startswith("gsnr_mean/")})
        if not keys:
            continue
        fig, axes = plt.subplots(1, 3, figsize=(16, 4))
        for key in keys:
            layer = key.split("/", 1)[1]
            epochs = [r["epoch"] + 1 for r in records]
            axes[0].plot(epochs, [r.get(key) for r in records], label=layer)
            axes[1].plot(epochs, [r.get("gsnr_at_gamma/" + layer) for r in records], label=layer)
            axes[2].plot(epochs, [r.get("gsnr_scale/" + layer) for r in records], label=layer)
        axes[0].set_yscale("log")
        axes[0].set_ylabel("mean raw GSNR")
        axes[1].set_ylabel("fraction clipped to gamma")
        axes[2].set_ylabel("mean applied scale (effective rate multiplier)")
        label_axes(axes, "epoch")
        axes[2].legend(fontsize=7)
        fig.suptitle(f"GSNR per layer: {name}")
        paths.append(save_figure(fig, os.path.join(output, f"gsnr_{name}.png")))
    noisy = {
        name: records for name, records in runs.items() if records and "noise_scale" in records[0]
    }
    if noisy:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, records in noisy.items():
            ax.plot(
                [r["epoch"] + 1 for r in records], [r["noise_scale"] for r in records], label=name
            )
        if batch is not None:
            ax.axhline(batch, color="gray", linestyle="--", label=f"batch {batch}")
        ax.set_yscale("log")
        ax.set_ylabel("gradient noise scale B_simple (examples)")
        ax.legend()
        label_axes([ax], "epoch")
        paths.append(save_figure(fig, os.path.join(output, "noise_scale.png")))
    return paths


def label_axes(axes, xlabel):
    """Each of `axes` with `xlabel` on x and a light grid."""
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)


def save_figure(fig, path, dpi=100):
    """Lays out `fig`, writes it to `path` and closes it; returns `path`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
