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
`adam`, `adamw`, `lamb`, `lars`); this package adds the wrappers `larc`,
`noise_scale` and `adascale` (fields of `tf_vrgd.LARC`, `tf_vrgd.NoiseScale`
or `tf_vrgd.AdaScale` plus an inner `optimizer` block) and `vr_sgd`, `vr_adam`,
`vr_lamb`, `vr_lars`, whose fields are their constructors' arguments and
also the fields of their base type, so that renaming `lamb` to `vr_lamb`
switches a published block to its VR twin.

Unknown types and fields raise `ValueError` naming them and listing what is
accepted; a field this package cannot honour raises too. YAML is read with
a `yaml.SafeLoader` (no arbitrary objects).

The optimizer types are here; the field checks (`FIELD_CHECKS`), the
learning-rate and warm-up types (`LEARNING_RATE_TYPES`, `WARMUP_TYPES`,
`learning_rate_from_config`) and the reading of files (`load`,
`optimization_block`) live in `_config_fields`, `_config_schedules` and
`_config_files`, and are this module's names too.
"""

from collections.abc import Callable
import dataclasses
import inspect
import os

import keras

from tf_vrgd import schedules
from tf_vrgd._config_fields import FIELD_CHECKS as FIELD_CHECKS
from tf_vrgd._config_fields import checked_fields as _fields
from tf_vrgd._config_fields import one_of as _one_of
from tf_vrgd._config_files import MAX_CONFIG_VALUES as MAX_CONFIG_VALUES
from tf_vrgd._config_files import load as load
from tf_vrgd._config_files import optimization_block as optimization_block
from tf_vrgd._config_schedules import LEARNING_RATE_TYPES as LEARNING_RATE_TYPES
from tf_vrgd._config_schedules import WARMUP_TYPES as WARMUP_TYPES
from tf_vrgd._config_schedules import learning_rate_from_config as learning_rate_from_config
from tf_vrgd._gsnr import GSNRMixin
from tf_vrgd.adam import Adam
from tf_vrgd.adamw import AdamWeightDecay
from tf_vrgd.adascale import AdaScale
from tf_vrgd.lamb import LAMB
from tf_vrgd.larc import LARC
from tf_vrgd.lars import LARS
from tf_vrgd.noise_scale_optimizer import NoiseScale
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
NOISE_SCALE_FIELDS = {
    **_constructor_fields(NoiseScale, exclude=("optimizer",)),
    "optimizer": None,
}
ADASCALE_FIELDS = {**_constructor_fields(AdaScale, exclude=("optimizer",)), "optimizer": None}
# The wrapper types: the class and its fields, one of which is the inner
# `optimizer` block.
WRAPPER_TYPES = {
    "larc": (LARC, LARC_FIELDS),
    "noise_scale": (NoiseScale, NOISE_SCALE_FIELDS),
    "adascale": (AdaScale, ADASCALE_FIELDS),
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


def accumulation_steps(cfg: dict | str | os.PathLike) -> int:
    """The micro-steps per update A that the `optimizer` block of `cfg` (an
    optimization block or a whole experiment) asks for: its
    `gradient_accumulation_steps`, or for a wrapper block (`larc`,
    `noise_scale`, `adascale`) its inner optimizer's (the wrapper applies through the inner
    optimizer's accumulation). 1 when unset. The block is checked as
    `optimizer_from_config` checks it.
    """
    parsed = _parse_optimizer("optimizer", _optimizer_block(optimization_block(cfg)))
    while parsed.inner is not None:
        parsed = parsed.inner
    return int(parsed.fields.get("gradient_accumulation_steps") or 1)


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
    fields (defaults filled in) and, for a wrapper type, the inner
    optimizer."""

    kind: str
    fields: dict
    inner: "_ParsedOptimizer | None" = None


def _optimizer_block(block):
    if "optimizer" not in block:
        raise ValueError("The optimization block has no `optimizer`.")
    return block["optimizer"]


def _parse_optimizer(what, cfg):
    kind, given = _one_of(what, cfg, {**OPTIMIZER_TYPES, **WRAPPER_TYPES})
    what = f"{what}.{kind}"
    if kind in WRAPPER_TYPES:
        f = _fields(what, given, WRAPPER_TYPES[kind][1])
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
        wrapper = WRAPPER_TYPES[parsed.kind][0]
        return wrapper(_build_optimizer(parsed.inner, learning_rate, extra), **parsed.fields)
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

    `kind` is a type of `OPTIMIZER_TYPES`, or of `WRAPPER_TYPES`, whose
    fields hold the inner ``optimizer`` block. Model Garden's factory builds its optimizers
    this way, from a config dataclass' fields; `tf_vrgd.model_garden`
    registers it. Raises ValueError for an unknown type or field, or a bad
    value.
    """
    parsed = _parse_optimizer("optimizer", {"type": kind, kind: dict(fields)})
    return _build_optimizer(parsed, learning_rate, {})
