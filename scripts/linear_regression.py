"""The VRGD paper's linear-regression experiments (sections 7.2 and 7.3),
with this package's optimizers.

    python scripts/linear_regression.py --output runs/linreg

Section 7.2: true weights W_i = i (i = 1..10), w initialised to 0, inputs
x ~ N(0, I) (the paper says only "randomly generated"), y = W.x, MSE loss,
100 updates of SGD and VR-SGD at batch 256 split into k samples (k
micro-batches accumulated per update: docs/algorithms.md §1): final test loss
over a rate grid, and curves at one common rate. Outputs: train and
test loss curves, weight trajectories and per-weight GSNR (the analog of
the paper's Figure 5), and the number of VR-SGD updates needed to reach
SGD's test loss after 100 updates (the paper reports about half).

Section 7.3: VR-SGD's test loss after 100 updates over a grid of gamma and
of k at batch 2048 (the analog of Figure 4).

Prints the figures and writes `linear_regression.json` and PNGs to --output.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

DIM = 10
TRUE_W = np.arange(1, DIM + 1, dtype=np.float32)


def make_data(count, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, DIM)).astype(np.float32)
    return x, x @ TRUE_W


def train(optimizer_name, lr, batch, k, steps, seed, gamma=0.1, test=None, track=False):
    """Runs `steps` updates; returns per-update train/test losses, weights
    and (VR only) per-weight raw GSNR of each update."""
    import keras
    import tensorflow as tf

    import tf_vrgd

    keras.utils.set_random_seed(seed)
    w = keras.Variable(np.zeros(DIM, np.float32), name="w")
    if optimizer_name == "sgd":
        optimizer = keras.optimizers.SGD(lr, gradient_accumulation_steps=k if k > 1 else None)
    else:
        optimizer = tf_vrgd.VRSGD(lr, gamma=gamma, gradient_accumulation_steps=k)
    optimizer.build([w])
    micro = batch // k
    x_all, y_all = make_data(steps * batch, seed)
    x_test, y_test = test

    @tf.function
    def update(x, y):
        # One update = k micro-steps on disjoint micro-batches (the k samples).
        for i in tf.range(k):
            xs = x[i * micro : (i + 1) * micro]
            ys = y[i * micro : (i + 1) * micro]
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.linalg.matvec(xs, w.value) - ys))
            optimizer.apply([tape.gradient(loss, w.value)], [w])
        return tf.reduce_mean(tf.square(tf.linalg.matvec(x, w.value) - y))

    history = {"train_loss": [], "test_loss": [], "weights": [], "gsnr": []}
    for step in range(steps):
        x = x_all[step * batch : (step + 1) * batch]
        y = y_all[step * batch : (step + 1) * batch]
        history["train_loss"].append(float(update(x, y)))
        history["test_loss"].append(float(np.mean((x_test @ w.numpy() - y_test) ** 2)))
        if track:
            history["weights"].append(w.numpy().tolist())
            if optimizer_name == "vr_sgd":
                history["gsnr"].append(_per_weight_gsnr(x, y, w.numpy(), k))
    return history


def _per_weight_gsnr(x, y, w, k):
    """Raw GSNR of each weight over the update's k micro-batch gradients
    (the optimizer's statistics are per variable; the figure wants per
    element)."""
    grads = []
    for xs, ys in zip(np.array_split(x, k), np.array_split(y, k)):
        residual = xs @ w - ys
        grads.append(2 * xs.T @ residual / len(ys))
    grads = np.array(grads, np.float64)
    mean, var = grads.mean(0), grads.var(0)
    return (mean**2 / np.maximum(var, 1e-12)).tolist()


def steps_to_reach(curve, target):
    """First update (1-based) whose test loss is at or below `target`."""
    for i, value in enumerate(curve):
        if value <= target:
            return i + 1
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="runs/linear_regression")
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=[0.003, 0.01, 0.03, 0.1, 0.3],
        help="learning-rate grid; each optimizer runs at its best rate "
        "(lowest mean final test loss over the seeds)",
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--k", type=int, default=8, help="samples per update (section 7.2)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=3, help="repetitions (different data)")
    parser.add_argument("--sweep-batch", type=int, default=2048)
    parser.add_argument(
        "--gammas", type=float, nargs="+", default=[0.01, 0.02, 0.04, 0.1, 0.2, 0.4, 1.0]
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument(
        "--lr",
        type=float,
        default=0.01,
        help="the common rate of the curves, the steps-to-target ratio and the "
        "section 7.3 sweep (a rate at which SGD has not reached float32 "
        "round-off after 100 updates)",
    )
    args = parser.parse_args(argv)
    os.makedirs(args.output, exist_ok=True)
    test = make_data(10000, seed=10**6)

    # --- 7.2 -------------------------------------------------------------
    finals = {}
    for name in ("sgd", "vr_sgd"):
        for lr in args.lrs:
            finals[(name, lr)] = np.mean(
                [
                    train(name, lr, args.batch, args.k, args.steps, seed, test=test)["test_loss"][
                        -1
                    ]
                    for seed in range(args.seeds)
                ]
            )
            print(f"{name:<7} lr {lr:<6g} mean final test loss {finals[(name, lr)]:.4g}")
    best_lr = {name: min(args.lrs, key=lambda lr: finals[(name, lr)]) for name in ("sgd", "vr_sgd")}
    print(f"best rates: {best_lr}; curves and ratios below at the common rate {args.lr:g}")
    runs = {}
    for seed in range(args.seeds):
        for name in ("sgd", "vr_sgd"):
            runs[(name, seed)] = train(
                name, args.lr, args.batch, args.k, args.steps, seed, test=test, track=(seed == 0)
            )
    ratios = []
    for seed in range(args.seeds):
        target = runs[("sgd", seed)]["test_loss"][-1]
        reached = steps_to_reach(runs[("vr_sgd", seed)]["test_loss"], target)
        ratios.append(reached / args.steps if reached else None)
        print(
            f"seed {seed}: SGD test loss after {args.steps} updates {target:.4g}; "
            f"VR-SGD reaches it after {reached} updates "
            f"(final VR-SGD test loss {runs[('vr_sgd', seed)]['test_loss'][-1]:.4g})"
        )
    found = [r for r in ratios if r is not None]
    print(
        f"steps-to-target ratio VR-SGD / SGD: "
        f"{', '.join(f'{r:.2f}' if r else 'not reached' for r in ratios)}"
        + (f" (mean {np.mean(found):.2f})" if found else "")
    )

    # --- 7.3 -------------------------------------------------------------
    sweep = {"gamma": {}, "k": {}}
    for gamma in args.gammas:
        losses = [
            train("vr_sgd", args.lr, args.sweep_batch, 64, args.steps, s, gamma=gamma, test=test)[
                "test_loss"
            ][-1]
            for s in range(args.seeds)
        ]
        sweep["gamma"][gamma] = float(np.mean(losses))
        print(f"gamma {gamma:<5g} (k = 64): VR-SGD test loss {np.mean(losses):.4g}")
    for k in args.ks:
        losses = [
            train("vr_sgd", args.lr, args.sweep_batch, k, args.steps, s, test=test)["test_loss"][-1]
            for s in range(args.seeds)
        ]
        sweep["k"][k] = float(np.mean(losses))
        print(f"k {k:<5d} (gamma = 0.1): VR-SGD test loss {np.mean(losses):.4g}")
    sgd_sweep = np.mean(
        [
            train("sgd", args.lr, args.sweep_batch, 1, args.steps, s, test=test)["test_loss"][-1]
            for s in range(args.seeds)
        ]
    )
    print(f"SGD at batch {args.sweep_batch}: test loss {sgd_sweep:.4g}")

    result = {
        "args": vars(args),
        "final_test_loss_by_rate": {f"{n}@{lr:g}": v for (n, lr), v in finals.items()},
        "best_rates": best_lr,
        "steps_to_target_ratio": ratios,
        "curves": {f"{n}_seed{s}": {k: v for k, v in h.items() if v} for (n, s), h in runs.items()},
        "sweep": {"gamma": sweep["gamma"], "k": sweep["k"], "sgd_test_loss": float(sgd_sweep)},
    }
    with open(os.path.join(args.output, "linear_regression.json"), "w") as f:
        json.dump(result, f)
    _plot(runs, sweep, sgd_sweep, args)
    return 0


def _plot(runs, sweep, sgd_sweep, args):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tf_vrgd.experiments import reporting

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    steps = np.arange(1, args.steps + 1)
    for name, style in (("sgd", "-"), ("vr_sgd", "--")):
        h = runs[(name, 0)]
        axes[0].semilogy(steps, h["train_loss"], style, label=f"{name} train")
        axes[0].semilogy(steps, h["test_loss"], style, label=f"{name} test")
        weights = np.array(h["weights"])
        for i in range(DIM):
            axes[1].plot(
                steps,
                weights[:, i],
                style,
                color=f"C{i}",
                label=f"w{i + 1}" if name == "sgd" else None,
            )
    gsnr = np.array(runs[("vr_sgd", 0)]["gsnr"])
    for i in range(DIM):
        axes[2].semilogy(steps, gsnr[:, i], color=f"C{i}", label=f"w{i + 1}")
    axes[0].set_title("loss (a)")
    axes[1].set_title("weights: SGD solid, VR-SGD dashed (b)")
    axes[2].set_title("VR-SGD raw GSNR per weight (c)")
    reporting.label_axes(axes, "update")
    axes[0].legend()
    axes[1].legend(fontsize=7, ncol=2)
    axes[2].legend(fontsize=7, ncol=2)
    reporting.save_figure(fig, os.path.join(args.output, "linear_regression_fig5.png"))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    gammas = sorted(sweep["gamma"])
    axes[0].semilogx(gammas, [sweep["gamma"][g] for g in gammas], "o-", label="VR-SGD")
    axes[0].axhline(sgd_sweep, color="gray", ls=":", label="SGD")
    axes[0].set_xlabel("gamma (k = 64)")
    ks = sorted(sweep["k"])
    axes[1].semilogx(ks, [sweep["k"][k] for k in ks], "o-", base=2, label="VR-SGD")
    axes[1].axhline(sgd_sweep, color="gray", ls=":", label="SGD")
    axes[1].set_xlabel("k (gamma = 0.1)")
    for ax in axes:
        ax.set_ylabel(f"test loss after {args.steps} updates, batch {args.sweep_batch}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.output, "linear_regression_fig4.png"), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
