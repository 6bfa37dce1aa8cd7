"""Keras 3 optimizers from TF Model Garden `optimization` blocks.

A block has the layout of Model Garden's `OptimizationConfig`
(`official/modeling/optimization/configs/`, checked against the 2023
tensorflow/models sources)::

    optimizer:
      type: lamb                      # one-of: the key below names the type
      lamb: {weight_decay_rate: 0.01, exclude_from_weight_decay: [bias]}
    learning_rate:
      type: polynomial
      polynomial: {initial_learning_rate: 0.001, decay_steps: 10000}
    warmup:                           # optional
      type: linear
      linear: {warmup_steps: 1000}
    ema:                              # optional
      average_decay: 0.999
      dynamic_decay: false

Model Garden's own types keep their field names and defaults (`sgd`,
`adam`, `adamw`, `lamb`, `lars`); this package adds `larc` (fields of
`tf_vrgd.LARC` plus an inner `optimizer` block) and `vr_sgd`, `vr_adam`,
`vr_lamb`, `vr_lars`, whose fields are their constructors' arguments and
also the fields of their base type, so that renaming `lamb` to `vr_lamb`
switches a published block to its VR twin.

Unknown types and fields raise `ValueError` naming them and listing what is
accepted; a field this package cannot honour raises too. YAML is read with
a `yaml.SafeLoader` (no arbitrary objects).
"""

from collections.abc import Callable
import dataclasses
import inspect
import os
import re

import keras
import yaml

from tf_vrgd import schedules, validation
from tf_vrgd._gsnr import GSNRMixin
from tf_vrgd.adam import Adam
from tf_vrgd.adamw import AdamWeightDecay
from tf_vrgd.lamb import LAMB
from tf_vrgd.larc import LARC
from tf_vrgd.lars import LARS
from tf_vrgd.sgd import SGD
from tf_vrgd.vr_adam import VRAdam
from tf_vrgd.vr_lamb import VRLAMB
from tf_vrgd.vr_lars import VRLARS
from tf_vrgd.vr_sgd import VRSGD

# Model Garden's BaseOptimizerConfig fields, the same in Keras 3.
_CLIP_FIELDS = {"clipnorm": None, "clipvalue": None, "global_clipnorm": None}
# Keras base arguments every type takes besides Model Garden's fields.
_KERAS_FIELDS = {"gradient_accumulation_steps": None}


@dataclasses.dataclass(frozen=True)
class OptimizerType:
    """One optimizer type of `OPTIMIZER_TYPES`: its fields with their
    defaults, and its builder, taking (learning rate, fields, Keras
    arguments from the `ema` block) and returning a Keras optimizer."""

    fields: dict
    build: callable


def _keras_kwargs(fields, extra):
    """Model Garden's base fields (which Keras takes as they are) and the
    Keras arguments `extra` (from the `ema` block)."""
    names = ("name", *_CLIP_FIELDS, *_KERAS_FIELDS)
    return {**{k: fields[k] for k in names if fields.get(k) is not None}, **extra}


def _without(fields, *names):
    return {k: v for k, v in fields.items() if k not in names}


def _sgd_without_decay(fields):
    if fields.get("decay"):
        raise ValueError(
            "`decay` (Keras 2's time-based learning-rate decay) has no Keras 3 "
            "equivalent; use a `learning_rate` schedule. Received: "
            f"decay={fields['decay']}"
        )
    return _without(fields, "decay")


def _lars_to_tf_vrgd(fields):
    """Model Garden `lars` names -> `tf_vrgd.LARS` arguments."""
    if not fields.get("classic_momentum", True):
        raise ValueError(
            "`classic_momentum: false` (LARS 'popular' momentum, learning rate "
            "applied after the momentum) is not implemented; tf_vrgd.LARS uses "
            "classic momentum (docs/algorithms.md §4). Received: classic_momentum=False"
        )
    out = _without(fields, "eeta", "classic_momentum")
    if fields.get("eeta") is not None:
        out["trust_coefficient"] = fields["eeta"]
    return out


def _constructor_fields(cls, exclude=("learning_rate",)):
    """A class's named constructor arguments with their defaults."""
    parameters = inspect.signature(cls.__init__).parameters
    return {
        name: p.default
        for name, p in parameters.items()
        if name not in ("self", *exclude) and p.kind is p.POSITIONAL_OR_KEYWORD
    }


_SGD = {
    **_KERAS_FIELDS,
    "name": "SGD",
    **_CLIP_FIELDS,
    "decay": 0.0,
    "nesterov": False,
    "momentum": 0.0,
}
_ADAM = {
    **_KERAS_FIELDS,
    "name": "Adam",
    **_CLIP_FIELDS,
    "beta_1": 0.9,
    "beta_2": 0.999,
    "epsilon": 1e-7,
    "amsgrad": False,
}
_LAMB = {
    **_KERAS_FIELDS,
    "name": "LAMB",
    **_CLIP_FIELDS,
    "beta_1": 0.9,
    "beta_2": 0.999,
    "epsilon": 1e-6,
    "weight_decay_rate": 0.0,
    "exclude_from_weight_decay": None,
    "exclude_from_layer_adaptation": None,
}
# `eeta` (Model Garden's trust coefficient) defaults to 0.001 when unset.
_LARS = {
    **_KERAS_FIELDS,
    "name": "LARS",
    **_CLIP_FIELDS,
    "momentum": 0.9,
    "eeta": None,
    "weight_decay_rate": 0.0,
    "nesterov": False,
    "classic_momentum": True,
    "exclude_from_weight_decay": None,
    "exclude_from_layer_adaptation": None,
}
_ADAMW = {
    **_KERAS_FIELDS,
    "name": "AdamWeightDecay",
    **_CLIP_FIELDS,
    "beta_1": 0.9,
    "beta_2": 0.999,
    "epsilon": 1e-7,
    "amsgrad": False,
    "weight_decay_rate": 0.0,
    "include_in_weight_decay": None,
    "exclude_from_weight_decay": None,
    "gradient_clip_norm": 1.0,
}


def _build_sgd(lr, f, extra):
    f = _sgd_without_decay(f)
    return SGD(lr, momentum=f["momentum"], nesterov=f["nesterov"], **_keras_kwargs(f, extra))


def _build_adam(lr, f, extra):
    return Adam(
        lr,
        beta_1=f["beta_1"],
        beta_2=f["beta_2"],
        epsilon=f["epsilon"],
        amsgrad=f["amsgrad"],
        **_keras_kwargs(f, extra),
    )


def _build_adamw(lr, f, extra):
    kwargs = _keras_kwargs(f, extra)
    # Model Garden clips by global norm when gradient_clip_norm > 0.
    if f["gradient_clip_norm"] and f["gradient_clip_norm"] > 0:
        if kwargs.get("global_clipnorm") is not None:
            raise ValueError("Give `gradient_clip_norm` or `global_clipnorm`, not both.")
        kwargs["global_clipnorm"] = f["gradient_clip_norm"]
    return AdamWeightDecay(
        learning_rate=lr,
        beta_1=f["beta_1"],
        beta_2=f["beta_2"],
        epsilon=f["epsilon"],
        amsgrad=f["amsgrad"],
        weight_decay=f["weight_decay_rate"],
        include_in_weight_decay=f["include_in_weight_decay"],
        exclude_from_weight_decay=f["exclude_from_weight_decay"],
        **kwargs,
    )


def _build_with(cls, translate=None):
    """A builder passing every field to `cls` (after `translate`)."""

    def build(lr, f, extra):
        f = translate(f) if translate else f
        return cls(
            lr, **_without(f, "name", *_CLIP_FIELDS, *_KERAS_FIELDS), **_keras_kwargs(f, extra)
        )

    return build


def _vr_type(cls, base_fields, translate=None):
    """A VR type: the base type's fields, the arguments of the class'
    constructor (the nearest `__init__` below `GSNRMixin`'s) and the VR
    ones, and the Keras arguments that matter for it."""
    own = next(c for c in cls.__mro__ if "__init__" in vars(c) and c is not GSNRMixin)
    fields = {
        **base_fields,
        **_constructor_fields(own),
        **cls.vr_arguments(),
        "name": None,
        "weight_decay": None,
    }
    return OptimizerType(fields, _build_with(cls, translate))


OPTIMIZER_TYPES = {
    "sgd": OptimizerType(_SGD, _build_sgd),
    "adam": OptimizerType(_ADAM, _build_adam),
    "adamw": OptimizerType(_ADAMW, _build_adamw),
    "lamb": OptimizerType(_LAMB, _build_with(LAMB)),
    "lars": OptimizerType(_LARS, _build_with(LARS, _lars_to_tf_vrgd)),
    "vr_sgd": _vr_type(VRSGD, _SGD, _sgd_without_decay),
    "vr_adam": _vr_type(VRAdam, _ADAM),
    "vr_lamb": _vr_type(VRLAMB, _LAMB),
    "vr_lars": _vr_type(VRLARS, _LARS, _lars_to_tf_vrgd),
}
LARC_FIELDS = {**_constructor_fields(LARC, exclude=("optimizer",)), "optimizer": None}


_S = keras.optimizers.schedules


def _build_stepwise(what, f):
    if len(f["values"]) != len(f["boundaries"]) + 1 or any(
        b >= c for b, c in zip(f["boundaries"], f["boundaries"][1:])
    ):
        raise ValueError(
            f"{what} needs increasing `boundaries` and one more value than "
            f"boundaries. Received: boundaries={f['boundaries']}, values={f['values']}"
        )
    return _S.PiecewiseConstantDecay(list(f["boundaries"]), list(f["values"]))


def _build_linear_warmup(what, schedule, w):
    if w["warmup_steps"] <= 0:
        raise ValueError(f"{what}.warmup_steps must be > 0. Received: {w['warmup_steps']}")
    return schedules.LinearWarmup(schedule, w["warmup_steps"], w["warmup_learning_rate"])


@dataclasses.dataclass(frozen=True)
class _ScheduleType:
    """One learning-rate or warm-up type: its fields with Model Garden's
    defaults, the ones it requires, and a builder taking (where, fields) for
    a learning rate or (where, schedule, fields) for a warm-up."""

    fields: dict
    required: tuple
    build: callable


# Model Garden's LR_CLS: every type of Model Garden's also takes `offset`
# (schedule(step - offset)).
LEARNING_RATE_TYPES = {
    "constant": _ScheduleType(
        {"name": "Constant", "learning_rate": 0.1},
        (),
        lambda what, f: schedules.Constant(f["learning_rate"]),
    ),
    "stepwise": _ScheduleType(
        {"name": "PiecewiseConstantDecay", "boundaries": None, "values": None, "offset": 0},
        ("boundaries", "values"),
        _build_stepwise,
    ),
    "exponential": _ScheduleType(
        {
            "name": "ExponentialDecay",
            "initial_learning_rate": None,
            "decay_steps": None,
            "decay_rate": None,
            "staircase": False,
            "offset": 0,
        },
        ("initial_learning_rate", "decay_steps", "decay_rate"),
        lambda what, f: _S.ExponentialDecay(
            f["initial_learning_rate"], f["decay_steps"], f["decay_rate"], staircase=f["staircase"]
        ),
    ),
    "polynomial": _ScheduleType(
        {
            "name": "PolynomialDecay",
            "initial_learning_rate": None,
            "decay_steps": None,
            "end_learning_rate": 0.0001,
            "power": 1.0,
            "cycle": False,
            "offset": 0,
        },
        ("initial_learning_rate", "decay_steps"),
        lambda what, f: _S.PolynomialDecay(
            f["initial_learning_rate"],
            f["decay_steps"],
            f["end_learning_rate"],
            f["power"],
            cycle=f["cycle"],
        ),
    ),
    # The package's own type (Model Garden's factory gets it from
    # tf_vrgd.model_garden): hold, then decay, as the paper's DLRM runs do.
    "delayed_polynomial": _ScheduleType(
        {
            "name": "DelayedPolynomialDecay",
            "initial_learning_rate": None,
            "decay_start_steps": None,
            "decay_steps": None,
            "end_learning_rate": 0.0001,
            "power": 1.0,
        },
        ("initial_learning_rate", "decay_start_steps", "decay_steps"),
        lambda what, f: schedules.DelayedPolynomialDecay(
            f["initial_learning_rate"],
            f["decay_start_steps"],
            f["decay_steps"],
            f["end_learning_rate"],
            f["power"],
        ),
    ),
    "cosine": _ScheduleType(
        {
            "name": "CosineDecay",
            "initial_learning_rate": None,
            "decay_steps": None,
            "alpha": 0.0,
            "offset": 0,
        },
        ("initial_learning_rate", "decay_steps"),
        lambda what, f: _S.CosineDecay(
            f["initial_learning_rate"], f["decay_steps"], alpha=f["alpha"]
        ),
    ),
}
# Model Garden's WARMUP_CLS.
WARMUP_TYPES = {
    "linear": _ScheduleType(
        {"name": "linear", "warmup_learning_rate": 0.0, "warmup_steps": None},
        ("warmup_steps",),
        _build_linear_warmup,
    ),
    "polynomial": _ScheduleType(
        {"name": "polynomial", "power": 1.0, "warmup_steps": None},
        ("warmup_steps",),
        lambda what, schedule, w: schedules.PolynomialWarmup(
            schedule, w["warmup_steps"], w["power"]
        ),
    ),
}
EMA_FIELDS = {
    "name": "ExponentialMovingAverage",
    **_CLIP_FIELDS,
    "trainable_weights_only": True,
    "average_decay": 0.99,
    "start_step": 0,
    "dynamic_decay": True,
}
BLOCK_KEYS = ("optimizer", "learning_rate", "warmup", "ema")


class _SafeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that also reads ``1e-4`` (no dot) as a float, as
    Model Garden's loader does (YAML 1.1 would make it a string)."""


_SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load(cfg: dict | str | os.PathLike) -> dict:
    """A dict from a dict, a YAML string or a path to a YAML file (safe
    loader only)."""
    if isinstance(cfg, dict):
        return cfg
    if isinstance(cfg, os.PathLike) or (
        isinstance(cfg, str)
        and "\n" not in cfg
        and (os.path.exists(cfg) or cfg.endswith((".yaml", ".yml")))
    ):
        if not os.path.isfile(cfg):
            raise ValueError(f"The config file {os.fspath(cfg)!r} does not exist.")
        with open(cfg) as f:
            cfg = f.read()
    if not isinstance(cfg, str):
        raise ValueError(f"Expected a dict, a YAML string or a path. Received: {cfg!r}")
    try:
        loaded = yaml.load(cfg, Loader=_SafeLoader)
    except yaml.YAMLError as error:
        raise ValueError(f"Invalid YAML: {error}") from error
    if not isinstance(loaded, dict):
        if isinstance(loaded, str) and " " not in loaded and os.sep in loaded:
            raise ValueError(f"The config file {cfg!r} does not exist.")
        raise ValueError(f"The YAML does not hold a mapping. Received: {cfg[:200]!r}")
    _check_expanded_size(loaded)
    return loaded


# The values a config may hold once YAML's aliases are expanded: a whole
# experiment holds a few hundred.
MAX_CONFIG_VALUES = 100_000


def _check_expanded_size(loaded):
    """Raises ValueError if `loaded` holds more than `MAX_CONFIG_VALUES`
    values with its aliases expanded. YAML shares an aliased block instead
    of copying it, so a few lines of aliases of aliases load at once but
    expand exponentially (or forever, for a block that contains itself) in
    any later walk of the config. Counts by walking, stopping at the bound:
    its cost is the bound's, whatever the config."""
    count, stack = 0, [loaded]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ValueError(
                f"The config holds more than {MAX_CONFIG_VALUES:,} values once its YAML "
                "aliases are expanded (aliases of aliases repeat a block exponentially): "
                "refused. Write the repeated values out, or use fewer aliases."
            )
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def optimization_block(cfg: dict | str | os.PathLike) -> dict:
    """The `optimization` block of `cfg`: the block itself, or a Model Garden
    experiment's `trainer.optimizer_config`."""
    cfg = load(cfg)
    if "trainer" in cfg:
        trainer = cfg["trainer"] or {}
        if "optimizer_config" not in trainer:
            raise ValueError("The experiment's `trainer` has no `optimizer_config`.")
        return trainer["optimizer_config"]
    return cfg


def accumulation_steps(cfg: dict | str | os.PathLike) -> int:
    """The micro-steps per update A that the `optimizer` block of `cfg` (an
    optimization block or a whole experiment) asks for: its
    `gradient_accumulation_steps`, or for a `larc` block its inner
    optimizer's (LARC applies on the inner optimizer's accumulated
    gradient). 1 when unset. The block is checked as
    `optimizer_from_config` checks it.
    """
    parsed = _parse_optimizer("optimizer", _optimizer_block(optimization_block(cfg)))
    while parsed.inner is not None:
        parsed = parsed.inner
    return int(parsed.fields.get("gradient_accumulation_steps") or 1)


# Learning rates and the values of rate schedules.
_RATE = validation.NON_NEGATIVE_NUMBER
# One check per field name, whichever block holds it: the same rule as the
# constructors' (tf_vrgd.validation), applied when the block is read, so
# that a bad value is named with its place in the block.
FIELD_CHECKS = {
    # learning rates and schedules
    "learning_rate": _RATE,
    "initial_learning_rate": _RATE,
    "end_learning_rate": _RATE,
    "warmup_learning_rate": _RATE,
    "values": validation.list_of(_RATE),
    "decay_steps": validation.integer(1),
    "warmup_steps": validation.integer(0),
    "offset": validation.integer(0),
    "decay_start_steps": validation.integer(0),
    "boundaries": validation.list_of(validation.integer(0)),
    "decay_rate": validation.POSITIVE_NUMBER,
    "power": validation.number(),
    "alpha": validation.number(0.0, 1.0),
    "staircase": validation.check_bool,
    "cycle": validation.check_bool,
    # optimizers
    "name": validation.string,
    "momentum": validation.UNIT_INTERVAL,
    "nesterov": validation.check_bool,
    "beta_1": validation.UNIT_INTERVAL,
    "beta_2": validation.UNIT_INTERVAL,
    "epsilon": validation.NON_NEGATIVE_NUMBER,
    "amsgrad": validation.check_bool,
    "weight_decay_rate": validation.NON_NEGATIVE_NUMBER,
    "weight_decay": validation.NON_NEGATIVE_NUMBER,
    "eeta": validation.POSITIVE_NUMBER,
    "trust_coefficient": validation.POSITIVE_NUMBER,
    "classic_momentum": validation.check_bool,
    "clip": validation.check_bool,
    "clipnorm": validation.POSITIVE_NUMBER,
    "clipvalue": validation.POSITIVE_NUMBER,
    "global_clipnorm": validation.POSITIVE_NUMBER,
    "gradient_clip_norm": validation.NON_NEGATIVE_NUMBER,
    "gradient_accumulation_steps": validation.integer(1),
    "exclude_from_weight_decay": validation.check_regex_list,
    "exclude_from_layer_adaptation": validation.check_regex_list,
    "include_in_weight_decay": validation.check_regex_list,
    "gamma": validation.number(0.0, 1.0, low_open=True),
    "beta_3": validation.UNIT_INTERVAL,
    "gsnr_epsilon": validation.POSITIVE_NUMBER,
    "gsnr_interval": validation.integer(1),
    "jit_update": validation.check_bool,
    "track_gsnr_statistics": validation.check_bool,
    "decay": validation.NON_NEGATIVE_NUMBER,
    # ema
    "average_decay": validation.number(0.0, 1.0),
    "dynamic_decay": validation.check_bool,
    "trainable_weights_only": validation.check_bool,
    "start_step": validation.integer(0),
}


def _fields(what, given, accepted):
    """`accepted` (defaults) updated with `given`; unknown fields raise, and
    each given value is checked (`FIELD_CHECKS`, `None` meaning unset)."""
    if given is not None and not isinstance(given, dict):
        raise ValueError(f"`{what}` must be a mapping of fields. Received: {given!r}")
    given = dict(given or {})
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        raise ValueError(f"Unknown field(s) {unknown} in {what}. Accepted: {sorted(accepted)}")
    for name, value in given.items():
        if value is not None and name in FIELD_CHECKS:
            given[name] = FIELD_CHECKS[name](f"{what}.{name}", value)
    return {**accepted, **given}


def _one_of(what, block, types):
    """Model Garden's one-of: ``{type: t, t: {...}}`` -> (t, fields)."""
    if not isinstance(block, dict):
        raise ValueError(f"`{what}` must be a mapping. Received: {block!r}")
    kind = block.get("type")
    if kind not in types:
        raise ValueError(f"Unknown {what} type {kind!r}. Accepted: {sorted(types)}")
    extra = sorted(set(block) - {"type", kind})
    if extra:
        raise ValueError(
            f"`{what}` has key(s) {extra} besides `type` and `{kind}`; a one-of "
            "block holds only the chosen type's fields."
        )
    return kind, block.get(kind) or {}


def _required(what, fields, *names):
    missing = [n for n in names if fields.get(n) is None]
    if missing:
        raise ValueError(f"{what} needs {missing}.")


def learning_rate_from_config(block: dict) -> keras.optimizers.schedules.LearningRateSchedule:
    """A Keras 3 `LearningRateSchedule` from `learning_rate` (+ `warmup`)."""
    cfg = block.get("learning_rate")
    if cfg is None:
        raise ValueError(
            "The optimization block has no `learning_rate`. Accepted types: "
            f"{sorted(LEARNING_RATE_TYPES)}"
        )
    kind, given = _one_of("learning_rate", cfg, LEARNING_RATE_TYPES)
    what = f"learning_rate.{kind}"
    kind = LEARNING_RATE_TYPES[kind]
    f = _fields(what, given, kind.fields)
    _required(what, f, *kind.required)
    schedule = kind.build(what, f)
    if f.get("offset"):
        schedule = schedules.Offset(schedule, f["offset"])

    warmup = block.get("warmup")
    if warmup is not None and not isinstance(warmup, dict):
        raise ValueError(
            "`warmup` must be a mapping such as {type: linear, linear: {warmup_steps: "
            f"1000}}. Received: warmup={warmup!r}"
        )
    if warmup is not None and warmup.get("type") is not None:
        kind, given = _one_of("warmup", warmup, WARMUP_TYPES)
        what = f"warmup.{kind}"
        kind = WARMUP_TYPES[kind]
        w = _fields(what, given, kind.fields)
        _required(what, w, *kind.required)
        schedule = kind.build(what, schedule, w)
    return schedule


def _ema_kwargs(block):
    cfg = block.get("ema")
    if cfg is None:
        return {}
    f = _fields("ema", cfg, EMA_FIELDS)
    refused = {
        "dynamic_decay": (f["dynamic_decay"], False),
        "start_step": (f["start_step"], 0),
        "trainable_weights_only": (f["trainable_weights_only"], True),
    }
    for name, (value, supported) in refused.items():
        if value != supported:
            raise ValueError(
                f"ema.{name}={value!r} has no Keras 3 equivalent (Keras' EMA "
                f"averages trainable weights from step 0 at a fixed decay); set "
                f"`{name}: {str(supported).lower()}` explicitly."
            )
    if any(f[k] is not None for k in _CLIP_FIELDS):
        raise ValueError("Clip gradients in the `optimizer` block, not in `ema`.")
    return {"use_ema": True, "ema_momentum": f["average_decay"]}


@dataclasses.dataclass(frozen=True)
class _ParsedOptimizer:
    """An `optimizer` one-of block, read and checked once: its type, its
    fields (defaults filled in) and, for `larc`, the inner optimizer."""

    kind: str
    fields: dict
    inner: "_ParsedOptimizer | None" = None


def _optimizer_block(block):
    if "optimizer" not in block:
        raise ValueError("The optimization block has no `optimizer`.")
    return block["optimizer"]


def _parse_optimizer(what, cfg):
    kind, given = _one_of(what, cfg, {**OPTIMIZER_TYPES, "larc": None})
    what = f"{what}.{kind}"
    if kind == "larc":
        f = _fields(what, given, LARC_FIELDS)
        if f["optimizer"] is None:
            raise ValueError(f"{what} needs an inner `optimizer` block.")
        inner = _parse_optimizer(f"{what}.optimizer", f.pop("optimizer"))
        return _ParsedOptimizer(kind, f, inner)
    if "eeta" in given and "trust_coefficient" in given:
        raise ValueError(f"{what}: give `eeta` or `trust_coefficient`, not both.")
    f = _fields(what, given, OPTIMIZER_TYPES[kind].fields)
    if "exclude_from_layer_adaptation" in f and not f["exclude_from_layer_adaptation"]:
        # Model Garden: `if exclude_from_layer_adaptation:` else the
        # weight-decay list, so an empty list means that list too.
        f["exclude_from_layer_adaptation"] = None
    return _ParsedOptimizer(kind, f)


def _build_optimizer(parsed, learning_rate, extra):
    if parsed.inner is not None:
        return LARC(_build_optimizer(parsed.inner, learning_rate, extra), **parsed.fields)
    accumulation = parsed.fields.get("gradient_accumulation_steps")
    if accumulation and accumulation > 1 and not _reads_its_own_step(learning_rate):
        # The block's step counts are updates (see schedules.PerUpdate).
        learning_rate = schedules.PerUpdate(learning_rate, accumulation)
    return OPTIMIZER_TYPES[parsed.kind].build(learning_rate, parsed.fields, extra)


def _reads_its_own_step(learning_rate):
    """A callable of no arguments (not a schedule of the step): it counts
    updates itself."""
    return callable(learning_rate) and not isinstance(
        learning_rate, keras.optimizers.schedules.LearningRateSchedule
    )


def optimizer_from_config(cfg: dict | str | os.PathLike) -> keras.optimizers.Optimizer:
    """A Keras 3 optimizer from a Model Garden `optimization` block.

    Args:
        cfg: a dict, a YAML string, or a path to a YAML file, holding the
            block (`optimizer`, `learning_rate`, optional `warmup` and `ema`)
            or a whole experiment (its `trainer.optimizer_config`).

    Returns:
        The optimizer; its learning rate is a serializable
        `keras.optimizers.schedules.LearningRateSchedule`.
    """
    block = optimization_block(cfg)
    unknown = sorted(set(block) - set(BLOCK_KEYS))
    if unknown:
        raise ValueError(
            f"Unknown key(s) {unknown} in the optimization block. Accepted: {list(BLOCK_KEYS)}"
        )
    # Model Garden's factory order: the optimizer's type and fields, then
    # the learning rate, then the optimizer.
    parsed = _parse_optimizer("optimizer", _optimizer_block(block))
    learning_rate = learning_rate_from_config(block)
    return _build_optimizer(parsed, learning_rate, _ema_kwargs(block))


def optimizer_from_fields(
    kind: str, fields: dict, learning_rate: float | Callable = 0.001
) -> keras.optimizers.Optimizer:
    """A Keras 3 optimizer from one `optimizer` type's fields, as a config's
    ``optimizer.<kind>`` block holds them (Model Garden's names; checked,
    defaults filled in), with `learning_rate`: a float or a schedule (whose
    steps count updates, as the block's do), or a callable of no arguments
    (which counts updates itself under gradient accumulation).

    `kind` is a type of `OPTIMIZER_TYPES`, or `larc`, whose fields hold the
    inner ``optimizer`` block. Model Garden's factory builds its optimizers
    this way, from a config dataclass' fields; `tf_vrgd.model_garden`
    registers it. Raises ValueError for an unknown type or field, or a bad
    value.
    """
    parsed = _parse_optimizer("optimizer", {"type": kind, kind: dict(fields)})
    return _build_optimizer(parsed, learning_rate, {})
