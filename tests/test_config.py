"""Model Garden `optimization` blocks -> Keras 3 optimizers and schedules,
checked against the formulas of Model Garden's sources (numpy)."""

import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests import references as ref
import tf_vrgd
from tf_vrgd import config
from tf_vrgd.experiments import twins

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Blocks copied unmodified from tensorflow/models (Model Garden):
# trainer.optimizer_config of official/nlp/configs/experiments/wiki_books_pretrain.yaml
BERT_PRETRAINING = """
    learning_rate:
      polynomial:
        cycle: false
        decay_steps: 1000000
        end_learning_rate: 0.0
        initial_learning_rate: 0.0001
        power: 1.0
      type: polynomial
    optimizer:
      type: adamw
    warmup:
      polynomial:
        power: 1
        warmup_steps: 10000
      type: polynomial
"""
# optimizer.optimizer of official/projects/edgetpu/nlp/experiments/mobilebert_baseline.yaml
# (that file keeps its learning rate outside the block; a constant is added).
MOBILEBERT_LAMB = """
optimizer:
    lamb:
      beta_1: 0.9
      beta_2: 0.999
      clipnorm: 1.0
      epsilon: 1.0e-06
      exclude_from_layer_adaptation: null
      exclude_from_weight_decay: ['LayerNorm', 'bias', 'norm']
      global_clipnorm: null
      name: LAMB
      weight_decay_rate: 0.01
    type: lamb
learning_rate: {type: constant, constant: {learning_rate: 0.0015}}
"""
# trainer.optimizer_config of
# official/vision/configs/experiments/image_classification/imagenet_resnet50_gpu.yaml
RESNET_SGD = """
    optimizer:
      type: 'sgd'
      sgd:
        momentum: 0.9
    learning_rate:
      type: 'stepwise'
      stepwise:
        boundaries: [18750, 37500, 50000]
        values: [0.8, 0.08, 0.008, 0.0008]
    warmup:
      type: 'linear'
      linear:
        warmup_steps: 3125
"""


def _schedule(optimizer):
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    return optimizer._learning_rate


def _values(schedule, steps):
    return np.array([float(schedule(s)) for s in steps])


def _to_twin(text, kind):
    return (
        text.replace(f"type: '{kind}'", f"type: 'vr_{kind}'")
        .replace(f"type: {kind}", f"type: vr_{kind}")
        .replace(f"{kind}:", f"vr_{kind}:")
    )


def test_bert_adamw_block_builds_with_model_garden_schedule():
    optimizer = config.optimizer_from_config(BERT_PRETRAINING)
    assert isinstance(optimizer, tf_vrgd.AdamWeightDecay)
    assert optimizer.global_clipnorm == 1.0  # Model Garden's gradient_clip_norm default
    steps = [0, 1, 5000, 9999, 10000, 500000, 1000000]
    # PolynomialWarmUp: after(warmup) * (max(step, 1) / warmup)^power, then
    # PolynomialDecay(1e-4 -> 0 over 1e6 steps) at the global step.
    after = lambda s: 1e-4 * (1 - min(s, 1e6) / 1e6)
    expected = [after(10000) * max(s, 1) / 10000 if s < 10000 else after(s) for s in steps]
    ref.assert_close(_values(_schedule(optimizer), steps), expected, "config schedules", rtol=1e-5)


@pytest.mark.parametrize("twin", [False, True])
def test_mobilebert_lamb_block_and_its_twin(twin):
    text = _to_twin(MOBILEBERT_LAMB, "lamb") if twin else MOBILEBERT_LAMB
    optimizer = config.optimizer_from_config(text)
    assert type(optimizer) is (tf_vrgd.VRLAMB if twin else tf_vrgd.LAMB)
    assert optimizer.weight_decay_rate == 0.01 and optimizer.clipnorm == 1.0
    assert optimizer.get_config()["exclude_from_weight_decay"] == ["LayerNorm", "bias", "norm"]
    assert optimizer.epsilon == 1e-6


@pytest.mark.parametrize("twin", [False, True])
def test_resnet_sgd_block_and_its_twin(twin):
    text = _to_twin(RESNET_SGD, "sgd") if twin else RESNET_SGD
    optimizer = config.optimizer_from_config(text)
    assert type(optimizer) is (tf_vrgd.VRSGD if twin else tf_vrgd.SGD)
    assert optimizer.momentum == 0.9
    steps = [0, 1000, 3124, 3125, 18749, 18751, 40000, 56000]
    # LinearWarmup from 0 to after(3125) = 0.8, then the piecewise values.
    piecewise = lambda s: [0.8, 0.08, 0.008, 0.0008][np.searchsorted([18750, 37500, 50000], s)]
    expected = [s / 3125 * 0.8 if s < 3125 else piecewise(s) for s in steps]
    ref.assert_close(_values(_schedule(optimizer), steps), expected, "config schedules", rtol=1e-6)


@pytest.mark.parametrize(
    "block, formula",
    [
        ({"type": "constant", "constant": {"learning_rate": 0.3}}, lambda s: 0.3),
        (
            {
                "type": "exponential",
                "exponential": {
                    "initial_learning_rate": 0.5,
                    "decay_steps": 10,
                    "decay_rate": 0.5,
                    "offset": 4,
                },
            },
            lambda s: 0.5 * 0.5 ** ((s - 4) / 10),
        ),
        (
            {
                "type": "exponential",
                "exponential": {
                    "initial_learning_rate": 0.5,
                    "decay_steps": 10,
                    "decay_rate": 0.5,
                    "staircase": True,
                },
            },
            lambda s: 0.5 * 0.5 ** (s // 10),
        ),
        (
            {
                "type": "cosine",
                "cosine": {"initial_learning_rate": 2.0, "decay_steps": 40, "alpha": 0.1},
            },
            lambda s: 2.0 * ((1 - 0.1) * 0.5 * (1 + np.cos(np.pi * min(s, 40) / 40)) + 0.1),
        ),
        (
            {
                "type": "polynomial",
                "polynomial": {"initial_learning_rate": 1.0, "decay_steps": 30, "power": 2.0},
            },
            lambda s: (1.0 - 1e-4) * (1 - min(s, 30) / 30) ** 2 + 1e-4,
        ),
        (
            {
                "type": "polynomial",
                "polynomial": {"initial_learning_rate": 1.0, "decay_steps": 10, "cycle": True},
            },
            # Keras' cycle: decay_steps grows to the next multiple past the step.
            lambda s: (1.0 - 1e-4) * (1 - s / (10 * max(np.ceil(s / 10), 1))) + 1e-4,
        ),
        (
            {
                "type": "delayed_polynomial",
                "delayed_polynomial": {
                    "initial_learning_rate": 1.0,
                    "decay_start_steps": 12,
                    "decay_steps": 20,
                    "end_learning_rate": 0.1,
                    "power": 2.0,
                },
            },
            lambda s: 1.0 if s < 12 else (1.0 - 0.1) * (1 - min(s - 12, 20) / 20) ** 2 + 0.1,
        ),
    ],
    ids=[
        "constant",
        "exponential-offset",
        "exponential-staircase",
        "cosine",
        "polynomial",
        "polynomial-cycle",
        "delayed_polynomial",
    ],
)
def test_learning_rate_types_follow_model_garden(block, formula):
    warm = {"type": "linear", "linear": {"warmup_steps": 5, "warmup_learning_rate": 0.01}}
    steps = [4, 5, 7, 13, 29, 35, 50]
    for warmup in (None, warm):
        cfg = {"optimizer": {"type": "sgd"}, "learning_rate": block}
        if warmup:
            cfg["warmup"] = warmup
        schedule = _schedule(config.optimizer_from_config(cfg))
        expected = [
            0.01 + s / 5 * (formula(5) - 0.01) if warmup and s < 5 else formula(s) for s in steps
        ]
        ref.assert_close(_values(schedule, steps), expected, "config schedules", rtol=1e-5)


def test_optimizer_and_schedule_survive_serialization():
    cfg = config.load(RESNET_SGD)
    cfg["optimizer"] = {
        "type": "larc",
        "larc": {"trust_coefficient": 0.01, "optimizer": cfg["optimizer"]},
    }
    cfg["ema"] = {"average_decay": 0.999, "dynamic_decay": False}
    optimizer = config.optimizer_from_config(cfg)
    assert optimizer.inner_optimizer.use_ema and optimizer.inner_optimizer.ema_momentum == 0.999
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    steps = [0, 100, 3125, 20000]
    np.testing.assert_array_equal(
        _values(_schedule(restored), steps), _values(_schedule(optimizer), steps)
    )
    assert restored.trust_coefficient == 0.01

    adamw = config.optimizer_from_config(
        BERT_PRETRAINING.replace(
            "type: adamw",
            "type: adamw\n      adamw: {weight_decay_rate: 0.01, "
            "exclude_from_weight_decay: ['bias$']}",
        )
    )
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(adamw))
    assert restored.get_config() == adamw.get_config()


def test_adamw_decays_all_but_excluded_variables_like_model_garden():
    lr, rate = 0.01, 0.1
    optimizer = config.optimizer_from_config(
        {
            "optimizer": {
                "type": "adamw",
                "adamw": {
                    "weight_decay_rate": rate,
                    "gradient_clip_norm": 0.0,
                    "exclude_from_weight_decay": ["bias"],
                    "include_in_weight_decay": ["head/bias"],
                },
            },
            "learning_rate": {"type": "constant", "constant": {"learning_rate": lr}},
        }
    )
    model = helpers.make_model()
    initial = model.get_weights()
    grads = list(helpers.gradient_stream([w.shape for w in initial], 1)[0][0])
    optimizer.apply(grads, model.trainable_variables)
    # w <- w - lr * rate * w, then Adam; dense/bias excluded, head/bias re-included.
    for w, g, got, decays in zip(initial, grads, model.get_weights(), [True, False, True, True]):
        w = w.astype(np.float64)
        decayed = w - lr * rate * w if decays else w
        expected, _, _ = ref.keras_adam_step(decayed, g, np.zeros_like(w), np.zeros_like(w), 1, lr)
        ref.assert_close(got, expected, "config AdamW")


@pytest.mark.parametrize(
    "cfg, message",
    [
        (
            {"optimizer": {"type": "adagrad"}},
            r"Unknown optimizer type 'adagrad'. Accepted: \['adam'",
        ),
        (
            {"optimizer": {"type": "sgd", "sgd": {"momentun": 0.9}}},
            r"Unknown field\(s\) \['momentun'\] in optimizer.sgd",
        ),
        ({"optimizer": {"type": "sgd", "adam": {}}}, r"besides `type` and `sgd`"),
        ({"optimizer": {"type": "sgd", "sgd": {"decay": 1e-4}}}, "time-based"),
        ({"optimizer": {"type": "lars", "lars": {"classic_momentum": False}}}, "classic_momentum"),
        (
            {
                "optimizer": {
                    "type": "vr_lars",
                    "vr_lars": {"eeta": 0.01, "trust_coefficient": 0.01},
                }
            },
            "not both",
        ),
        ({"optimizer": {"type": "vr_adam", "vr_adam": {"gamma": 0.0}}}, "gamma"),
        (
            {
                "optimizer": {"type": "sgd"},
                "learning_rate": {
                    "type": "stepwise",
                    "stepwise": {"boundaries": [10, 10], "values": [0.3, 0.2, 0.1]},
                },
            },
            "increasing `boundaries`",
        ),
        ({"optimizer": {"type": "larc", "larc": {}}}, "inner `optimizer`"),
        (
            {
                "optimizer": {"type": "sgd"},
                "learning_rate": {"type": "cosine", "cosine": {"decay_steps": 5}},
            },
            r"needs \['initial_learning_rate'\]",
        ),
        (
            {"optimizer": {"type": "sgd"}, "learning_rate": {"type": "cyclic"}},
            "Unknown learning_rate type",
        ),
        (
            {
                "optimizer": {"type": "sgd"},
                "warmup": {"type": "linear", "linear": {"warmup_steps": 0}},
            },
            "warmup_steps",
        ),
        ({"optimizer": {"type": "sgd"}, "ema": {"average_decay": 0.9}}, "dynamic_decay"),
        (
            {"optimizer": {"type": "sgd"}, "gradient_clipping": 1.0},
            r"Unknown key\(s\) \['gradient_clipping'\]",
        ),
        ("optimizer: !!python/object/apply:os.system ['true']", "Invalid YAML"),
    ],
)
def test_bad_blocks_raise_naming_the_problem(cfg, message):
    if isinstance(cfg, dict):
        cfg.setdefault("learning_rate", {"type": "constant", "constant": {"learning_rate": 0.1}})
    with pytest.raises(ValueError, match=message):
        config.optimizer_from_config(cfg)


@pytest.mark.parametrize("kind", ["lars", "vr_lars"])
def test_lars_eeta_is_the_trust_coefficient(kind):
    # Model Garden's name for LARS' eta; unset, Model Garden's 0.001.
    block = {"learning_rate": {"type": "constant", "constant": {"learning_rate": 0.1}}}
    given = config.optimizer_from_config(
        {**block, "optimizer": {"type": kind, kind: {"eeta": 0.02}}}
    )
    unset = config.optimizer_from_config({**block, "optimizer": {"type": kind}})
    assert (given.trust_coefficient, unset.trust_coefficient) == (0.02, 0.001)


def test_twin_block_switches_type_and_back():
    block = config.load(MOBILEBERT_LAMB)
    twin = twins.twin_block(block)
    assert twin["optimizer"]["type"] == "vr_lamb"
    assert twin["optimizer"]["vr_lamb"] == block["optimizer"]["lamb"]
    back = twins.twin_block(
        {
            **twin,
            "optimizer": {
                "type": "vr_lamb",
                "vr_lamb": {**twin["optimizer"]["vr_lamb"], "gamma": 0.2},
            },
        }
    )
    assert back["optimizer"] == block["optimizer"]
    with pytest.raises(ValueError, match="no VR twin"):
        twins.twin_block(config.load(BERT_PRETRAINING))


def test_every_config_in_the_repository_builds():
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True))
    assert paths, "no configs found"
    for path in paths:
        optimizer = config.optimizer_from_config(path)
        assert isinstance(_schedule(optimizer), keras.optimizers.schedules.LearningRateSchedule), (
            path
        )


def test_committed_configs_are_what_the_generator_writes(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_configs", os.path.join(ROOT, "scripts", "make_configs.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    written = module.write_all(str(tmp_path))
    # configs/model_garden holds hand-written experiments of Model Garden's trainer.
    committed = sorted(
        path
        for folder in ("paper", "fashion_mnist")
        for path in glob.glob(os.path.join(ROOT, "configs", folder, "*.yaml"))
    )
    assert sorted(os.path.relpath(p, tmp_path) for p in written) == sorted(
        os.path.relpath(p, ROOT) for p in committed
    )
    for path in written:
        with open(path) as a, open(os.path.join(ROOT, os.path.relpath(path, tmp_path))) as b:
            assert a.read() == b.read(), path


def test_paper_configs_carry_the_tables_values():
    # Spot checks against the paper's tables (values typed from the PDF).
    bert = config.load(os.path.join(ROOT, "configs/paper/bert_large_vr_lamb_64k-32k_phase2.yaml"))
    block = bert["trainer"]["optimizer_config"]
    # k = 32 samples per update: 8 replicas x 4 micro-steps.
    assert block["optimizer"]["vr_lamb"]["gradient_accumulation_steps"] == 4
    assert bert["runtime"]["num_gpus"] == 8
    assert block["learning_rate"]["polynomial"]["initial_learning_rate"] == 0.0045
    assert block["warmup"]["linear"]["warmup_steps"] == 200
    # The last 10% of Table 8's 8599 steps, at sequence length 512.
    assert bert["trainer"]["train_steps"] == 860
    assert bert["task"]["train_data"]["seq_length"] == 512
    k12 = config.load(os.path.join(ROOT, "configs/paper/bert_large_vr_lamb_96k_phase1.yaml"))
    fields = k12["trainer"]["optimizer_config"]["optimizer"]["vr_lamb"]
    assert k12["runtime"]["num_gpus"] * fields["gradient_accumulation_steps"] == 12
    # DLRM at 64k: NVIDIA's schedule, peak until 48,000, decay over 24,000.
    dlrm = config.load(os.path.join(ROOT, "configs/paper/dlrm_sgd_64k.yaml"))
    decay = dlrm["trainer"]["optimizer_config"]["learning_rate"]["delayed_polynomial"]
    assert (decay["decay_start_steps"], decay["decay_steps"]) == (48000, 24000)
    imagenet = config.optimizer_from_config(
        os.path.join(ROOT, "configs/paper/imagenet_resnet50_vr_lars_16k.yaml")
    )
    assert isinstance(imagenet, tf_vrgd.VRLARS) and imagenet.gamma == 0.1
    assert float(imagenet._learning_rate(10**6)) == 0.0  # cosine to 0
    cifar = config.load(os.path.join(ROOT, "configs/paper/cifar10_resnet56_vr_adam_8k.yaml"))
    lr = cifar["trainer"]["optimizer_config"]["learning_rate"]["cosine"]["initial_learning_rate"]
    assert lr == pytest.approx(192 / (2**-1 * 1e4))


@pytest.mark.parametrize(
    "path", sorted(glob.glob(os.path.join(ROOT, "configs/paper/dlrm_*.yaml"))), ids=os.path.basename
)
def test_the_dlrm_configs_hold_the_peak_until_the_decay_starts(path):
    """NVIDIA's DLRM schedule (the paper's): linear warm-up to the peak,
    the peak held until the decay starts, then (1 - t / decay_steps)^2 to
    0; never above the peak. (Model Garden's `polynomial` with an `offset`
    rose to 7.1 times the peak at the warm-up's end of the 64k file.)"""
    cfg = config.load(path)
    block = cfg["trainer"]["optimizer_config"]
    fields = block["learning_rate"]["delayed_polynomial"]
    peak, start, length = (
        fields["initial_learning_rate"],
        fields["decay_start_steps"],
        fields["decay_steps"],
    )
    warmup = block["warmup"]["linear"]["warmup_steps"]
    steps = np.unique(np.linspace(0, cfg["trainer"]["train_steps"], 101).astype(int))
    steps = np.concatenate([steps, [warmup, start - 1, start, start + length // 2]])
    expected = np.where(
        steps < warmup,
        peak * steps / warmup,
        np.where(steps < start, peak, peak * (1 - np.minimum(steps - start, length) / length) ** 2),
    )
    values = _values(config.learning_rate_from_config(block), steps)
    ref.assert_close(values, expected, "DLRM schedule", rtol=1e-5)
    assert max(values) <= peak * (1 + 1e-6)


@pytest.mark.parametrize("kind", ["sgd", "vr_sgd"])
def test_schedules_count_updates_under_accumulation(kind):
    # Stepwise rates 1, 2, 3, 4 after steps 1, 2, 3 (Keras' boundaries are
    # inclusive). With A = 4 micro-steps per update, the update u must use
    # the rate of step u, as the same optimizer without accumulation does.
    fields = {"gradient_accumulation_steps": 4}
    if kind == "vr_sgd":
        fields["gamma"] = 1.0  # ghat = gbar: the weight moves by -rate
    block = {
        "optimizer": {"type": kind, kind: fields},
        "learning_rate": {
            "type": "stepwise",
            "stepwise": {"boundaries": [1, 2, 3], "values": [1.0, 2.0, 3.0, 4.0]},
        },
    }
    optimizer = config.optimizer_from_config(block)
    variable = keras.Variable(np.zeros((2,), np.float32), name="w")
    rng = np.random.default_rng(36)
    rates = []
    for _ in range(5):
        before = variable.numpy().copy()
        # Gradients 1 +- noise, mean exactly 1 over the 4 micro-steps.
        noise = rng.standard_normal((4, 2)).astype(np.float32) * 0.1
        noise -= noise.mean(0)
        for g in 1.0 + noise:
            optimizer.apply([tf.constant(g)], [variable])
        rates.append(float(np.mean(before - variable.numpy())))
    np.testing.assert_allclose(rates, [1.0, 1.0, 2.0, 3.0, 4.0], rtol=1e-5)
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert isinstance(restored._learning_rate, tf_vrgd.schedules.PerUpdate)


def test_empty_layer_adaptation_list_means_the_weight_decay_list():
    # Model Garden's LAMB and LARS read `if exclude_from_layer_adaptation:`.
    for kind in ("lamb", "vr_lamb", "lars", "vr_lars"):
        block = {
            "optimizer": {
                "type": kind,
                kind: {
                    "weight_decay_rate": 0.01,
                    "exclude_from_weight_decay": ["bias"],
                    "exclude_from_layer_adaptation": [],
                },
            },
            "learning_rate": {"type": "constant"},
        }
        optimizer = config.optimizer_from_config(block)
        model = helpers.make_model()
        optimizer.build(model.trainable_variables)
        adapts = [
            optimizer._adapts[optimizer._get_variable_index(v)] for v in model.trainable_variables
        ]
        assert adapts == [True, False, True, False], kind


def test_empty_layer_adaptation_list_to_a_constructor_adapts_everything():
    # The constructors' documented meaning: [] excludes nothing, None means
    # the weight-decay list.
    for cls in (tf_vrgd.LAMB, tf_vrgd.VRLAMB, tf_vrgd.LARS, tf_vrgd.VRLARS):
        for given, expected in (([], [True] * 4), (None, [True, False, True, False])):
            optimizer = cls(exclude_from_weight_decay=["bias"], exclude_from_layer_adaptation=given)
            model = helpers.make_model()
            optimizer.build(model.trainable_variables)
            adapts = [
                optimizer._adapts[optimizer._get_variable_index(v)]
                for v in model.trainable_variables
            ]
            assert adapts == expected, (cls.__name__, given)
    for cls in (tf_vrgd.LAMB, tf_vrgd.LARS):  # the VR classes refer to them
        assert "An empty list excludes nothing" in " ".join(cls.__doc__.split())


def _block(optimizer=None, learning_rate=None, warmup=None):
    block = {
        "optimizer": optimizer or {"type": "sgd"},
        "learning_rate": learning_rate or {"type": "constant"},
    }
    if warmup is not None:
        block["warmup"] = warmup
    return block


def _polynomial(**fields):
    return {
        "type": "polynomial",
        "polynomial": {"initial_learning_rate": 0.1, "decay_steps": 100, **fields},
    }


@pytest.mark.parametrize(
    "block,field",
    [
        # Learning rates: negative, NaN, infinite, quoted.
        (
            _block(learning_rate={"type": "constant", "constant": {"learning_rate": -0.1}}),
            "learning_rate.constant.learning_rate",
        ),
        (
            _block(learning_rate=_polynomial(initial_learning_rate=float("nan"))),
            "learning_rate.polynomial.initial_learning_rate",
        ),
        (
            _block(learning_rate=_polynomial(initial_learning_rate=float("inf"))),
            "learning_rate.polynomial.initial_learning_rate",
        ),
        (
            _block(learning_rate=_polynomial(initial_learning_rate="0.1")),
            "learning_rate.polynomial.initial_learning_rate",
        ),
        (
            _block(
                learning_rate={
                    "type": "stepwise",
                    "stepwise": {"boundaries": [10], "values": [0.1, -1.0]},
                }
            ),
            r"learning_rate.stepwise.values\[1\]",
        ),
        # Quoted booleans.
        (
            _block(optimizer={"type": "adam", "adam": {"amsgrad": "false"}}),
            "optimizer.adam.amsgrad",
        ),
        (_block(optimizer={"type": "sgd", "sgd": {"nesterov": "false"}}), "optimizer.sgd.nesterov"),
        (
            _block(
                learning_rate={
                    "type": "exponential",
                    "exponential": {
                        "initial_learning_rate": 0.1,
                        "decay_steps": 10,
                        "decay_rate": 0.5,
                        "staircase": "false",
                    },
                }
            ),
            "learning_rate.exponential.staircase",
        ),
        (_block(learning_rate=_polynomial(cycle="false")), "learning_rate.polynomial.cycle"),
        # Step counts: strings, fractions, negatives, overflow.
        (
            _block(learning_rate=_polynomial(decay_steps="1000")),
            "learning_rate.polynomial.decay_steps",
        ),
        (
            _block(learning_rate=_polynomial(decay_steps=10**30)),
            "learning_rate.polynomial.decay_steps",
        ),
        (
            _block(warmup={"type": "linear", "linear": {"warmup_steps": 0.5}}),
            "warmup.linear.warmup_steps",
        ),
        (
            _block(warmup={"type": "linear", "linear": {"warmup_steps": 2.7}}),
            "warmup.linear.warmup_steps",
        ),
        (
            _block(warmup={"type": "polynomial", "polynomial": {"warmup_steps": -5}}),
            "warmup.polynomial.warmup_steps",
        ),
        (_block(warmup="linear"), "warmup"),
        # Base types refuse what their VR twins refuse.
        (_block(optimizer={"type": "adam", "adam": {"beta_1": 2.0}}), "optimizer.adam.beta_1"),
        (_block(optimizer={"type": "sgd", "sgd": {"clipnorm": -1}}), "optimizer.sgd.clipnorm"),
        (
            _block(optimizer={"type": "lamb", "lamb": {"gradient_accumulation_steps": 0}}),
            "optimizer.lamb.gradient_accumulation_steps",
        ),
    ],
)
def test_bad_fields_raise_naming_field_and_value(block, field):
    with pytest.raises(ValueError, match=field):
        config.optimizer_from_config(block)


def test_missing_config_file_says_so(tmp_path):
    for path in (str(tmp_path / "nothing.yaml"), tmp_path / "nothing.yaml", "configs/nothing/x"):
        with pytest.raises(ValueError, match="does not exist"):
            config.optimizer_from_config(path)


def test_accumulation_steps_reads_larc_inner_optimizer():
    # A LARC block's micro-steps are its inner optimizer's: LARC rescales the
    # inner optimizer's accumulated gradient.
    inner = {"type": "vr_lamb", "vr_lamb": {"gradient_accumulation_steps": 4}}
    larc = {"type": "larc", "larc": {"trust_coefficient": 0.01, "optimizer": inner}}
    assert config.accumulation_steps(_block(optimizer=inner)) == 4
    assert config.accumulation_steps(_block(optimizer=larc)) == 4
    assert config.accumulation_steps({"trainer": {"optimizer_config": _block(larc)}}) == 4
    assert config.accumulation_steps(_block(optimizer={"type": "lamb"})) == 1
    assert isinstance(config.optimizer_from_config(_block(larc)).inner_optimizer, tf_vrgd.VRLAMB)
    assert (
        config.optimizer_from_config(_block(larc)).inner_optimizer.gradient_accumulation_steps == 4
    )
    with pytest.raises(ValueError, match=r"optimizer\.larc needs an inner `optimizer` block"):
        config.accumulation_steps(_block(optimizer={"type": "larc", "larc": {}}))
    with pytest.raises(ValueError, match=r"Unknown optimizer\.larc\.optimizer type 'nadam'"):
        config.accumulation_steps(
            _block(optimizer={"type": "larc", "larc": {"optimizer": {"type": "nadam"}}})
        )


@pytest.mark.parametrize("form", ["list", "dict", "self"])
def test_a_yaml_alias_bomb_is_refused_quickly(form, tmp_path):
    """A few hundred bytes of aliases of aliases load at once (YAML shares
    the aliased block) but expand to 9^9 values in any walk of the config;
    a block containing itself expands forever."""
    import time

    if form == "self":
        text = "task: &a\n  model: [*a]\n"
    else:
        one = "[1, 1, 1, 1, 1, 1, 1, 1, 1]" if form == "list" else "{a: 1, b: 1, c: 1}"
        lines = [f"l0: &l0 {one}"]
        for i in range(1, 10):
            items = ", ".join([f"*l{i - 1}"] * 9)
            if form == "list":
                lines.append(f"l{i}: &l{i} [{items}]")
            else:
                keys = ", ".join(f"k{j}: *l{i - 1}" for j in range(9))
                lines.append(f"l{i}: &l{i} {{{keys}}}")
        text = "\n".join(lines) + "\n"
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    assert len(text) < 2048
    start = time.perf_counter()
    with pytest.raises(ValueError, match="aliases"):
        config.load(str(path))
    assert time.perf_counter() - start < 5.0


def test_a_rescaled_schedule_moves_the_decay_start_with_the_other_step_counts():
    """`--train-steps` rescales every step count of a schedule: the DLRM
    files' `decay_start_steps` too (else a shortened run would never reach
    its decay)."""
    from tf_vrgd.experiments import experiment_config

    block = config.optimization_block(os.path.join(ROOT, "configs/paper/dlrm_sgd_64k.yaml"))
    rescaled = experiment_config.rescale_schedule(block, 0.01, 1.0)
    fields = rescaled["learning_rate"]["delayed_polynomial"]
    assert (fields["decay_start_steps"], fields["decay_steps"]) == (480, 240)
    assert rescaled["warmup"]["linear"]["warmup_steps"] == 80


def test_a_noise_scale_block_wraps_its_inner_optimizer():
    inner = {"type": "adam", "adam": {"gradient_accumulation_steps": 2, "beta_1": 0.8}}
    block = _block(
        optimizer={"type": "noise_scale", "noise_scale": {"interval": 4, "optimizer": inner}}
    )
    optimizer = config.optimizer_from_config(block)
    assert isinstance(optimizer, tf_vrgd.NoiseScale) and optimizer.interval == 4
    assert isinstance(optimizer.inner_optimizer, tf_vrgd.Adam)
    assert optimizer.inner_optimizer.beta_1 == 0.8
    assert config.accumulation_steps(block) == 2
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert restored.interval == 4 and restored.inner_optimizer.beta_1 == 0.8
    bad = {"type": "noise_scale", "noise_scale": {"interval": 0, "optimizer": inner}}
    with pytest.raises(ValueError, match=r"optimizer\.noise_scale\.interval` must be an integer"):
        config.optimizer_from_config(_block(optimizer=bad))
    with pytest.raises(ValueError, match=r"optimizer\.noise_scale needs an inner `optimizer`"):
        config.optimizer_from_config(_block(optimizer={"type": "noise_scale", "noise_scale": {}}))
