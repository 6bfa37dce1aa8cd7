"""Writes the experiment configs under configs/ from the tables below.

    python scripts/make_configs.py            # rewrites configs/paper and configs/fashion_mnist

configs/paper/: one file per row of Tables 8-11 of "Accelerating Large Batch
Training via Gradient Signal to Noise Ratio" (the VRGD paper) whose
optimizer the table fully specifies; each file says which row it reproduces
and how the choices the paper leaves open were made. They are for GPU
clusters: `tf_vrgd.config.optimizer_from_config` builds their optimizers.

configs/fashion_mnist/: the CPU-scale study that runs here with
`vrgd-train`. `tests/test_config.py::test_committed_configs_are_what_the_generator_writes`
checks that the files are what this script writes.
"""

import math
import os
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K = 1024  # the paper's "16k" batch is 16 x 1024 samples

# Section 6 of the paper: gamma = 0.1, beta_1 = beta_3 = 0.9, beta_2 = 0.999
# "by default" in all experiments, and k >= 8 samples.
VR_DEFAULTS = {"gamma": 0.1, "beta_3": 0.9}
# Said in the header of every VR-SGD/Momentum/LARS config, whose classes
# default to Algorithm 1's beta_3 = 0.
BETA_3_NOTE = [
    "beta_3 = 0.9 (GSNR momentum): section 6 sets beta_1 = beta_3 = 0.9 by default",
    "in all experiments. Algorithm 1 (VR-SGD) is written without it, and VRSGD and",
    "VRLARS default to beta_3 = 0 (Algorithm 1) when built directly.",
]
# NVIDIA's DLRM defaults at batch 64k (one epoch is about 64,000 steps):
# warm-up 8,000 steps, the peak held until step 48,000, then polynomial
# (power 2) decay over 24,000 steps. Other batches keep these fractions of
# the epoch.
NVIDIA_DLRM_BATCH = 64 * K
NVIDIA_DLRM_DECAY_START = 48_000
NVIDIA_DLRM_DECAY_STEPS = 24_000

# --- Table 8: BERT-large pretraining with VR-LAMB ---------------------------
# (batch phase 1, batch phase 2, total steps, warmup 1, lr 1, k 1, warmup 2, lr 2, k 2, F1)
TABLE_8 = [
    ("16k", 16 * K, 16 * K, 31250, 2800, 0.0035, 8, 280, 0.0035, 32, 91.42),
    ("32k", 32 * K, 32 * K, 15625, 2800, 0.0053, 8, 280, 0.0053, 32, 91.58),
    ("64k-32k", 64 * K, 32 * K, 8599, 2000, 0.007, 8, 200, 0.0045, 32, 91.49),
    ("64k", 64 * K, 64 * K, 7820, 2000, 0.007, 8, 200, 0.0055, 64, 91.30),
    ("96k-32k", 96 * K, 32 * K, 6256, 1870, 0.007, 12, 200, 0.00575, 32, 91.23),
    ("96k", 96 * K, 96 * K, 5214, 1870, 0.007, 12, 187, 0.0055, 96, 90.70),
    ("128k-64k", 128 * K, 64 * K, 4301, 1760, 0.007, 16, 200, 0.00575, 64, 90.85),
]
# Section 6: "First 90% steps use a sequence length of 128 (phase-1) and
# last 10% use a sequence length of 512 (phase-2)".
PHASE_2_FRACTION = 0.1
# The paper's k (Table 8's "Acc-steps (k)") is the number of gradient
# samples per update; here k = replicas x gradient_accumulation_steps, so a
# node of 8 GPUs accumulates k / 8 micro-steps (4 GPUs where 8 does not
# divide k).
BERT_GPUS = 8

# --- Table 9: ImageNet ResNet-50 with VR-LARS --------------------------------
# (batch, warmup epochs, lr, k devices, top-1)
TABLE_9 = [
    ("2k", 2 * K, 0.625, 7 * 2**0, 8, 77.14),
    ("4k", 4 * K, 1.25, 7 * 2**0.5, 8, 77.23),
    ("8k", 8 * K, 2.5, 7 * 2**1, 16, 77.36),
    ("16k", 16 * K, 5, 7 * 2**1.5, 32, 77.27),
    ("32k", 32 * K, 14, 7 * 2**2, 64, 76.81),
    ("64k", 64 * K, 40, 37, 128, 75.86),
    ("96k", 96 * K, 41, 38, 192, 74.82),
]
IMAGENET_TRAIN = 1_281_167
IMAGENET_EPOCHS = 90  # the paper's ResNet-50 comparison (Table 7) is at 90 epochs

# --- Table 10: DLRM on Criteo Terabyte with SGD and VR-SGD ------------------
# (batch, warmup epochs, lr, AUC SGD, AUC VR-SGD)
TABLE_10 = [
    ("32k", 32 * K, 1 / 2**4, 2**3.5, 0.8014, 0.8026),
    ("64k", 64 * K, 1 / 2**3, 2**4, 0.8025, 0.8048),
    ("128k", 128 * K, 1 / 2**2, 2**4.5, 0.8021, 0.8042),
    ("256k", 256 * K, 1 / 2, 2**5, 0.7827, 0.8023),
    ("512k", 512 * K, 3 / 4, 2**5.5, 0.7787, 0.8013),
]
CRITEO_TRAIN = 4_195_197_692  # MLPerf DLRM training samples (one epoch)

# --- Table 11: CIFAR-10 ResNet-56 ---------------------------------------------
# batch label, samples, warmup epochs (2^x), and per optimizer the lr
# exponent x of the table's formula and the test accuracies (base, VR).
CIFAR_BATCHES = [
    ("256", 256, 2),
    ("512", 512, 2.5),
    ("1k", K, 3),
    ("2k", 2 * K, 3.5),
    ("4k", 4 * K, 4),
    ("8k", 8 * K, 5),
]
TABLE_11_RATES = {
    # name: (the rate's formula as the table prints it, the same as a
    # function of x, x per batch)
    "momentum": ("128 / (2^x * 100)", lambda x: 128 / (2**x * 100), [2, 1.5, 1, 0.5, 0, -0.5]),
    "adam": ("192 / (2^x * 1e4)", lambda x: 192 / (2**x * 1e4), [3, 2.5, 2, 1, 0, -1]),
    "lamb": ("64 / (2^x * 1e3)", lambda x: 64 / (2**x * 1e3), [4, 3.5, 3, 2, 1, 1]),
    "lars": ("896 / (2^x * 100)", lambda x: 896 / (2**x * 100), [2, 1.5, 1, 0.5, 0, -0.5]),
}
# The test accuracies (%) per batch, of the base optimizer and of its VR twin.
TABLE_11_BASE_ACCURACY = {
    "momentum": [93.68, 93.56, 93.17, 92.19, 17.40, 14.57],
    "adam": [91.88, 92.24, 92.02, 91.98, 59.38, 20.74],
    "lamb": [92.08, 92.03, 91.90, 92.13, 58.35, 15.13],
    "lars": [92.30, 92.29, 92.34, 82.39, 27.50, 12.21],
}
TABLE_11_VR_ACCURACY = {
    "momentum": [93.79, 93.71, 93.50, 93.28, 92.70, 90.57],
    "adam": [92.46, 92.40, 92.43, 92.10, 91.74, 90.86],
    "lamb": [92.29, 92.34, 92.05, 92.43, 92.04, 91.07],
    "lars": [92.35, 92.53, 92.44, 92.79, 92.35, 91.86],
}
CIFAR_TRAIN = 50_000
CIFAR_EPOCHS = 182  # TF's official CIFAR ResNet recipe (LR drops at epochs 91 and 136, Figure 3)

# --- Fashion-MNIST, CPU scale ------------------------------------------------
FASHION_BATCHES = [256, 1024, 2048, 4096, 8192]
FASHION_EPOCHS = 10
FASHION_REPLICAS = 4
FASHION_WIDTH = 16
# Learning rates at batch 256, scaled by sqrt(batch / 256) (the paper's
# square-root rule): common values for these optimizers on small CNNs, not
# tuned; scripts/sweep.py searches a grid around them.
FASHION_BASE = {
    "momentum": ("sgd", {"momentum": 0.9}, 0.05),
    "adam": ("adam", {}, 0.002),
    "lamb": ("lamb", {"weight_decay_rate": 0.0001, "exclude_from_weight_decay": ["bias"]}, 0.005),
    "lars": (
        "lars",
        {
            "momentum": 0.9,
            "eeta": 0.001,
            "weight_decay_rate": 0.0001,
            "exclude_from_weight_decay": ["bias"],
        },
        1.0,
    ),
}


def _optimizer(kind, fields, vr):
    """An optimizer block: `kind` or its VR twin (same fields + VR_DEFAULTS)."""
    if vr:
        kind = f"vr_{kind}"
        fields = {**fields, **VR_DEFAULTS}
    return {"type": kind, kind: fields}


def _warmup(steps):
    return {"type": "linear", "linear": {"warmup_steps": int(steps)}}


def _rates_as_floats(tree):
    """`tree` with every `*learning_rate` value a float: Model Garden's
    trainer keeps a YAML integer (a rate of 16) as an integer, and its
    tf_keras schedules then fail to compute in int32."""
    if isinstance(tree, dict):
        return {
            k: float(v)
            if k.endswith("learning_rate") and isinstance(v, int)
            else _rates_as_floats(v)
            for k, v in tree.items()
        }
    return tree


def _write(path, header, cfg):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("".join(f"# {line}\n" if line else "#\n" for line in header))
        yaml.safe_dump(
            _rates_as_floats(cfg), f, sort_keys=False, default_flow_style=None, width=100
        )
    return path


def bert_configs(out):
    paths = []
    for label, b1, b2, steps, w1, lr1, k1, w2, lr2, k2, f1 in TABLE_8:
        phase_2_steps = round(PHASE_2_FRACTION * steps)
        phases = {
            1: (b1, steps - phase_2_steps, w1, lr1, k1, 128, 20),
            2: (b2, phase_2_steps, w2, lr2, k2, 512, 80),
        }
        for phase, (batch, phase_steps, warmup, lr, k, seq, predictions) in phases.items():
            gpus = BERT_GPUS if k % BERT_GPUS == 0 else BERT_GPUS // 2
            accumulation = k // gpus
            header = [
                f"BERT-large pretraining, VR-LAMB, batch {label}, phase {phase} of 2.",
                f"VRGD paper Table 8, row '{label}': {steps} steps in all, phase {phase}: "
                f"warm-up {warmup} steps, LR {lr}, k = {k}; SQuAD F1 {f1}.",
                "From the paper's text: phase 1 is the first 90% of the steps at sequence",
                "length 128, phase 2 the last 10% at 512 (mixed-batch rows change the batch",
                "with the phase).",
                "",
                f"k = replicas x gradient_accumulation_steps = {gpus} x {accumulation} = {k}, the",
                "paper's k (gradient samples per update, docs/algorithms.md §1). An update",
                f"takes global_batch_size = {batch} sequences: {accumulation} micro-step(s) of",
                f"{batch // accumulation} over all replicas, {batch // k} per GPU; train_steps "
                "and the",
                "schedule count updates. A GPU that cannot hold its share needs more",
                "accumulation, which raises k (another GSNR estimate than the paper's).",
                "",
                "Left open by the paper, chosen here: 20 / 80 masked tokens (BERT's two",
                "phases); LAMB decay 0.01 without LayerNorm and bias (BERT's setting),",
                "linear warm-up then polynomial (power 1) decay to 0 over the phase.",
            ]
            cfg = {
                "task": {
                    "model": {
                        "type": "bert",
                        "encoder": {
                            "type": "bert",
                            "bert": {
                                "num_layers": 24,
                                "hidden_size": 1024,
                                "num_attention_heads": 16,
                                "intermediate_size": 4096,
                            },
                        },
                    },
                    "train_data": {
                        "global_batch_size": batch,
                        "seq_length": seq,
                        "max_predictions_per_seq": predictions,
                    },
                },
                "trainer": {
                    "train_steps": phase_steps,
                    "optimizer_config": {
                        "optimizer": _optimizer(
                            "lamb",
                            {
                                "beta_1": 0.9,
                                "beta_2": 0.999,
                                "epsilon": 1e-6,
                                "weight_decay_rate": 0.01,
                                "exclude_from_weight_decay": ["LayerNorm", "layer_norm", "bias"],
                                **(
                                    {"gradient_accumulation_steps": accumulation}
                                    if accumulation > 1
                                    else {}
                                ),
                            },
                            vr=True,
                        ),
                        "learning_rate": {
                            "type": "polynomial",
                            "polynomial": {
                                "initial_learning_rate": lr,
                                "decay_steps": phase_steps,
                                "end_learning_rate": 0.0,
                                "power": 1.0,
                            },
                        },
                        "warmup": _warmup(warmup),
                    },
                },
                "runtime": {"distribution_strategy": "mirrored", "num_gpus": gpus},
            }
            paths.append(
                _write(
                    os.path.join(out, f"bert_large_vr_lamb_{label}_phase{phase}.yaml"), header, cfg
                )
            )
    return paths


def imagenet_configs(out):
    paths = []
    for label, batch, warmup_epochs, lr, k, top1 in TABLE_9:
        per_epoch = IMAGENET_TRAIN / batch
        steps = round(IMAGENET_EPOCHS * per_epoch)
        header = [
            f"ImageNet ResNet-50 v1.5, VR-LARS, batch {label}.",
            f"VRGD paper Table 9, row '{label}': warm-up {warmup_epochs} epochs, LR {lr:.4g}, "
            f"k = {k} devices; top-1 {top1}%.",
            "",
            "From the paper's text: linear warm-up, cosine decay to 0, label smoothing,",
            f"{IMAGENET_EPOCHS} epochs. Left open, chosen here: LARS trust coefficient 0.001",
            "(Model Garden's eeta), momentum 0.9, weight decay 1e-4 (Model Garden's",
            "ResNet-50 value) without batch-norm and bias variables, label smoothing 0.1.",
            f"k = {k} replicas of 8 GPUs per node.",
            "",
            *BETA_3_NOTE,
        ]
        cfg = {
            "task": {
                "model": {"type": "resnet", "resnet": {"model_id": 50}, "num_classes": 1001},
                "losses": {"label_smoothing": 0.1, "one_hot": True},
                "train_data": {"global_batch_size": batch},
            },
            "trainer": {
                "train_steps": steps,
                "optimizer_config": {
                    "optimizer": _optimizer(
                        "lars",
                        {
                            "momentum": 0.9,
                            "eeta": 0.001,
                            "weight_decay_rate": 1e-4,
                            "exclude_from_weight_decay": ["batch_normalization", "bias"],
                        },
                        vr=True,
                    ),
                    "learning_rate": {
                        "type": "cosine",
                        "cosine": {"initial_learning_rate": round(lr, 6), "decay_steps": steps},
                    },
                    "warmup": _warmup(round(warmup_epochs * per_epoch)),
                },
            },
            "runtime": {
                "distribution_strategy": "multi_worker_mirrored" if k > 8 else "mirrored",
                "num_gpus": min(k, 8),
            },
        }
        paths.append(
            _write(os.path.join(out, f"imagenet_resnet50_vr_lars_{label}.yaml"), header, cfg)
        )
    return paths


def dlrm_configs(out):
    paths = []
    for label, batch, warmup_epochs, lr, auc_sgd, auc_vr in TABLE_10:
        steps = math.ceil(CRITEO_TRAIN / batch)
        warmup = round(warmup_epochs * steps)
        scale = NVIDIA_DLRM_BATCH / batch
        decay_start = max(warmup, round(NVIDIA_DLRM_DECAY_START * scale))
        decay_steps = round(NVIDIA_DLRM_DECAY_STEPS * scale)
        for vr in (False, True):
            name = "vr_sgd" if vr else "sgd"
            header = [
                f"DLRM on Criteo Terabyte, {'VR-SGD' if vr else 'SGD'}, batch {label}.",
                f"VRGD paper Table 10, row '{label}': warm-up {warmup_epochs:g} epochs, "
                f"LR 2^{math.log2(lr):g}; test AUC {auc_vr if vr else auc_sgd}.",
                "",
                "From the paper's text: one epoch, linear warm-up, polynomial decay, NVIDIA's",
                "DLRM defaults otherwise: at batch 64k the peak holds until step 48,000,",
                "then decays with power 2 over 24,000 steps (to 0 only after the epoch's",
                "end); here the same fractions of the epoch: the peak held until update",
                f"{decay_start}, then decay over {decay_steps} updates (never before the warm-up",
                "ends). `delayed_polynomial` holds the peak; Model Garden's `polynomial`",
                "with an `offset` would not (its polynomial of a negative step exceeds the",
                "peak).",
                "Left open, chosen here: plain SGD, no momentum (Algorithm 1); 8 GPUs",
                "(the paper's k >= 8).",
                *(["", *BETA_3_NOTE] if vr else []),
            ]
            cfg = {
                "task": {"model": {"type": "dlrm"}, "train_data": {"global_batch_size": batch}},
                "trainer": {
                    "train_steps": steps,
                    "optimizer_config": {
                        "optimizer": _optimizer("sgd", {"momentum": 0.0}, vr=vr),
                        "learning_rate": {
                            "type": "delayed_polynomial",
                            "delayed_polynomial": {
                                "initial_learning_rate": round(lr, 6),
                                "decay_start_steps": decay_start,
                                "decay_steps": decay_steps,
                                "end_learning_rate": 0.0,
                                "power": 2.0,
                            },
                        },
                        "warmup": _warmup(warmup),
                    },
                },
                "runtime": {"distribution_strategy": "mirrored", "num_gpus": 8},
            }
            paths.append(_write(os.path.join(out, f"dlrm_{name}_{label}.yaml"), header, cfg))
    return paths


def cifar_configs(out):
    paths = []
    fields = {
        "momentum": ("sgd", {"momentum": 0.9}),
        "adam": ("adam", {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}),
        "lamb": ("lamb", {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-6}),
        "lars": ("lars", {"momentum": 0.9, "eeta": 0.001}),
    }
    for name, (formula, lr_of, exponents) in TABLE_11_RATES.items():
        base_acc, vr_acc = TABLE_11_BASE_ACCURACY[name], TABLE_11_VR_ACCURACY[name]
        for (label, batch, warmup_exp), x, acc, acc_vr in zip(
            CIFAR_BATCHES, exponents, base_acc, vr_acc
        ):
            per_epoch = CIFAR_TRAIN / batch
            steps = round(CIFAR_EPOCHS * per_epoch)
            for vr in (False, True):
                title = {"momentum": "Momentum", "adam": "Adam", "lamb": "LAMB", "lars": "LARS"}[
                    name
                ]
                header = [
                    f"CIFAR-10 ResNet-56, {'VR-' if vr else ''}{title}, batch {label}.",
                    f"VRGD paper Table 11, row '{label}': warm-up 2^{warmup_exp:g} epochs, "
                    f"LR {formula} with x = {x:g}; test accuracy {acc_vr if vr else acc}%.",
                    "",
                    "From the paper's text: TF's official CIFAR-10 ResNet recipe plus linear",
                    "warm-up, label smoothing and cosine decay to 0. Left open, chosen here:",
                    f"{CIFAR_EPOCHS} epochs (that recipe's length), L2 2e-4 in the loss (the",
                    "recipe's) and no optimizer decay, label smoothing 0.1, 8 GPUs (k >= 8).",
                    "",
                    "resnet.model_id 56 extends Model Garden's ResNet spec (ImageNet depths):",
                    "depths 6n + 2 build the CIFAR ResNet of He et al. (2016), three stages of",
                    "n basic blocks (tf_vrgd.experiments.resnet.cifar_resnet).",
                    *(["", *BETA_3_NOTE] if vr and name in ("momentum", "lars") else []),
                ]
                kind, opt_fields = fields[name]
                cfg = {
                    "task": {
                        "model": {"type": "resnet", "resnet": {"model_id": 56}, "num_classes": 10},
                        "losses": {"label_smoothing": 0.1, "l2_weight_decay": 2e-4},
                        "train_data": {"global_batch_size": batch},
                    },
                    "trainer": {
                        "train_steps": steps,
                        "optimizer_config": {
                            "optimizer": _optimizer(kind, opt_fields, vr=vr),
                            "learning_rate": {
                                "type": "cosine",
                                "cosine": {
                                    "initial_learning_rate": round(lr_of(x), 8),
                                    "decay_steps": steps,
                                },
                            },
                            "warmup": _warmup(round(2**warmup_exp * per_epoch)),
                        },
                    },
                    "runtime": {"distribution_strategy": "mirrored", "num_gpus": 8},
                }
                prefix = "vr_" if vr else ""
                paths.append(
                    _write(
                        os.path.join(out, f"cifar10_resnet56_{prefix}{name}_{label}.yaml"),
                        header,
                        cfg,
                    )
                )
    return paths


def fashion_mnist_configs(out):
    paths = []
    for name, (kind, fields, base_lr) in FASHION_BASE.items():
        for batch in FASHION_BATCHES:
            per_epoch = 60000 // batch
            steps = FASHION_EPOCHS * per_epoch
            lr = base_lr * math.sqrt(batch / 256)
            for vr in (False, True):
                header = [
                    f"Fashion-MNIST CNN (width {FASHION_WIDTH}), {'VR-' if vr else ''}{name}, "
                    f"batch {batch}, {FASHION_REPLICAS} replicas.",
                    f"The CPU-scale analog of the paper's Table 11: LR {base_lr:g} at batch 256",
                    f"scaled by sqrt(batch / 256) = {math.sqrt(batch / 256):.4g}, "
                    "linear warm-up over",
                    f"the first epoch, cosine decay to 0, {FASHION_EPOCHS} epochs "
                    "at every batch size.",
                    "Run: vrgd-train --config THIS_FILE --compare --output runs/NAME",
                ]
                cfg = {
                    "task": {
                        "model": {"type": "fashion_mnist_cnn", "width": FASHION_WIDTH},
                        "train_data": {
                            "tfds_name": "fashion_mnist",
                            "tfds_split": "train",
                            "global_batch_size": batch,
                        },
                        "validation_data": {
                            "tfds_name": "fashion_mnist",
                            "tfds_split": "test",
                            "global_batch_size": batch,
                        },
                    },
                    "trainer": {
                        "train_steps": steps,
                        "optimizer_config": {
                            "optimizer": _optimizer(kind, dict(fields), vr=vr),
                            "learning_rate": {
                                "type": "cosine",
                                "cosine": {
                                    "initial_learning_rate": round(lr, 6),
                                    "decay_steps": steps,
                                },
                            },
                            "warmup": _warmup(per_epoch),
                        },
                    },
                    "runtime": {
                        "distribution_strategy": "mirrored",
                        "num_gpus": FASHION_REPLICAS,
                        "seed": 0,
                    },
                }
                prefix = "vr_" if vr else ""
                paths.append(
                    _write(os.path.join(out, f"{prefix}{name}_b{batch}.yaml"), header, cfg)
                )
    return paths


def write_all(root=ROOT):
    paper = os.path.join(root, "configs", "paper")
    fashion = os.path.join(root, "configs", "fashion_mnist")
    return (
        bert_configs(paper)
        + imagenet_configs(paper)
        + dlrm_configs(paper)
        + cifar_configs(paper)
        + fashion_mnist_configs(fashion)
    )


if __name__ == "__main__":
    written = write_all(sys.argv[1] if len(sys.argv) > 1 else ROOT)
    print(f"wrote {len(written)} configs")
