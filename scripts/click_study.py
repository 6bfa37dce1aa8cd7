"""SGD against VR-SGD on a click task with a planted answer (docs/RESULTS.md,
"Embedding tables").

    python scripts/click_study.py --output /tmp/click        # the RESULTS run
    python scripts/click_study.py --output /tmp/c --examples 200000 --seeds 0  # a quick one

The task: Criteo-shaped inputs (13 dense features, 26 categorical ids, each
id drawn from a Zipf law over its table's rows, the popular rows placed at
random), labelled by a fixed random DLRM, the "teacher": its logits,
standardised and multiplied by `--signal`, plus the bias that gives a click
rate of 25%, are the log-odds of a click, and each label is drawn from
them. The teacher's own probabilities reach the best AUC any learner can
(the Bayes AUC, printed), so each optimizer's AUC reads against a known
ceiling. A student DLRM of the teacher's shape, freshly initialised per
seed, trains one pass over the training examples at batch `--batch` on
`--replicas` replicas (linear warm-up over `--warmup` of the updates, then
cosine decay to 0) with:

- `sgd`: Keras SGD (the base rule);
- `vr_sgd`: VR-SGD (the package's rule: row-sparse, the layer mean over the
  elements with a sample).

docs/RESULTS.md also gives the rows of VR-SGD's former rule (tables made
dense, every element in the layer mean), measured by an earlier version
of this script; it is not reproduced here, since that rule is no longer
the library's and could only be had by patching it.

Each run appends a JSON line to OUTPUT/results.jsonl (runs already there
are skipped, so an interrupted study resumes); the table at the end reads
that file. Same seed: same initial weights and data order for every
optimizer.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

OPTIMIZERS = ("sgd", "vr_sgd")
NUM_DENSE = 13
NUM_TABLES = 26


# The study's settings: each is a flag (`--test-examples`), is written into
# every result row, and a row in OUTPUT/results.jsonl counts as done only
# under the same settings, all of them.
SETTINGS = (
    ("rows", int, 5_000, "rows of each table"),
    ("embedding_dim", int, 16, "width of each table"),
    ("examples", int, 1_000_000, "training examples"),
    ("test_examples", int, 100_000, "test examples"),
    ("batch", int, 8_192, "global batch"),
    ("replicas", int, 4, "replicas (logical CPU devices)"),
    ("learning_rate", float, 1.0, "peak learning rate"),
    ("zipf", float, 1.1, "the ids' Zipf exponent"),
    ("signal", float, 2.0, "teacher logit scale"),
    (
        "teacher_scale",
        float,
        0.05,
        "standard deviation of the teacher's embeddings (the student's init: 0.05 uniform)",
    ),
    ("warmup", float, 0.1, "fraction of the updates of linear warm-up (then cosine decay to 0)"),
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="folder for results.jsonl")
    for name, kind, default, text in SETTINGS:
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=text)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    return parser.parse_args(argv)


def settings_of(args):
    return {name: getattr(args, name) for name, *_ in SETTINGS}


def auc(labels, scores):
    """Area under the ROC curve by ranks (ties share their mean rank)."""
    labels = np.asarray(labels, bool)
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = np.asarray(scores)[order]
    # Mean rank of each run of equal scores.
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_scores)) + 1]
    ends = np.r_[starts[1:], len(scores)]
    for start, end in zip(starts, ends):
        ranks[order[start:end]] = (start + end + 1) / 2.0
    positives = labels.sum()
    negatives = len(labels) - positives
    return float((ranks[labels].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def dlrm_task(args):
    from tf_vrgd.experiments import dlrm_task

    cfg = {
        "task": {
            "model": {
                "type": "dlrm",
                "vocab_sizes": [args.rows] * NUM_TABLES,
                "embedding_dim": args.embedding_dim,
                "bottom_mlp": [64, args.embedding_dim],
                "top_mlp": [64, 1],
            }
        }
    }
    return dlrm_task.Dlrm(cfg)


def make_inputs(args, count, rng):
    """Dense features and Zipf ids, as the DLRM model reads them."""
    dense = np.log1p(rng.uniform(0.0, 100.0, (count, NUM_DENSE))).astype(np.float32)
    ranks = np.arange(1, args.rows + 1, dtype=np.float64)
    probabilities = ranks**-args.zipf
    cdf = np.cumsum(probabilities / probabilities.sum())
    sparse = np.empty((count, NUM_TABLES), np.int32)
    for table in range(NUM_TABLES):
        popular = rng.permutation(args.rows)  # where each popularity rank lives
        drawn = np.minimum(np.searchsorted(cdf, rng.uniform(size=count)), args.rows - 1)
        sparse[:, table] = popular[drawn]
    return {"dense_features": dense, "sparse_features": sparse}


def planted_task(args):
    """(train inputs, train labels, test inputs, test labels, Bayes AUC)."""
    import keras

    rng = np.random.default_rng(2026)
    keras.utils.set_random_seed(2026)
    teacher = dlrm_task(args).build_model()
    for variable in teacher.trainable_variables:
        if "embedding" in variable.path:
            values = args.teacher_scale * rng.standard_normal(variable.shape)
            variable.assign(values.astype(np.float32))
    total = args.examples + args.test_examples
    inputs = make_inputs(args, total, rng)
    logits = teacher.predict(inputs, batch_size=65_536, verbose=0)[:, 0].astype(np.float64)
    logits = args.signal * (logits - logits.mean()) / logits.std()
    low, high = -20.0, 20.0  # the bias that gives a 25% click rate
    for _ in range(60):
        bias = (low + high) / 2
        rate = np.mean(1.0 / (1.0 + np.exp(-(logits + bias))))
        low, high = (bias, high) if rate < 0.25 else (low, bias)
    probabilities = 1.0 / (1.0 + np.exp(-(logits + bias)))
    labels = (rng.uniform(size=total) < probabilities).astype(np.float32)[:, None]
    split = args.examples

    def part(x, start, stop):
        return {key: value[start:stop] for key, value in x.items()}

    bayes = auc(labels[split:, 0], probabilities[split:])
    return (
        part(inputs, 0, split),
        labels[:split],
        part(inputs, split, total),
        labels[split:],
        bayes,
    )


def make_optimizer(name, args):
    import keras

    import tf_vrgd

    updates = int(np.ceil(args.examples / args.batch))
    warmup = max(1, int(args.warmup * updates))
    rate = keras.optimizers.schedules.CosineDecay(
        0.0,
        decay_steps=max(1, updates - warmup),
        warmup_target=args.learning_rate,
        warmup_steps=warmup,
    )
    if name == "sgd":
        return keras.optimizers.SGD(rate)
    return tf_vrgd.VRSGD(rate)


def train_one(name, seed, data, strategy, args):
    import keras

    train_x, train_y, test_x, test_y, _ = data
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = dlrm_task(args).build_model()
        model.compile(
            optimizer=make_optimizer(name, args),
            loss=keras.losses.BinaryCrossentropy(from_logits=True),
        )
    # The same order for every optimizer of a seed.
    order = np.random.default_rng(seed).permutation(args.examples)
    shuffled = {key: value[order] for key, value in train_x.items()}
    start = time.perf_counter()
    history = model.fit(
        shuffled, train_y[order], batch_size=args.batch, epochs=1, shuffle=False, verbose=0
    )
    seconds = time.perf_counter() - start
    scores = model.predict(test_x, batch_size=65_536, verbose=0)[:, 0]
    return {
        "optimizer": name,
        "seed": seed,
        **settings_of(args),
        "updates": int(np.ceil(args.examples / args.batch)),
        "train_loss": float(history.history["loss"][-1]),
        "test_auc": auc(test_y[:, 0], scores),
        "seconds": seconds,
    }


def main(argv=None):
    args = parse_args(argv)
    from tf_vrgd.experiments import distribution

    devices = distribution.setup_devices(args.replicas)
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy(devices)
    os.makedirs(args.output, exist_ok=True)
    path = os.path.join(args.output, "results.jsonl")
    done = []
    if os.path.exists(path):
        with open(path) as f:
            done = [json.loads(line) for line in f if line.strip()]
    settings = settings_of(args)

    def same(row):
        # Rows written before a setting was recorded do not match.
        return all(row.get(key) == value for key, value in settings.items())

    data = planted_task(args)
    print(f"planted task: Bayes AUC {data[4]:.4f} (the teacher's own probabilities)", flush=True)
    for seed in args.seeds:
        for name in args.optimizers:
            if any(same(r) and (r["optimizer"], r["seed"]) == (name, seed) for r in done):
                continue
            row = {**train_one(name, seed, data, strategy, args), "bayes_auc": data[4]}
            done.append(row)
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"{name:<18} seed {seed}: test AUC {row['test_auc']:.4f} "
                f"(train loss {row['train_loss']:.4f}, {row['seconds']:.0f} s)",
                flush=True,
            )
    print(f"\n{'optimizer':<18} {'AUC mean':>9} {'per seed':>22}   (Bayes {data[4]:.4f})")
    for name in args.optimizers:
        rows = [r for r in done if same(r) and r["optimizer"] == name and r["seed"] in args.seeds]
        if rows:
            values = [r["test_auc"] for r in sorted(rows, key=lambda r: r["seed"])]
            per_seed = " ".join(f"{v:.4f}" for v in values)
            print(f"{name:<18} {statistics.fmean(values):>9.4f} {per_seed:>22}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
