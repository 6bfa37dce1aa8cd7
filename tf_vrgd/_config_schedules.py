"""The learning-rate and warm-up types of `tf_vrgd.config` (Model Garden's
`LR_CLS` and `WARMUP_CLS`, and the package's `delayed_polynomial`), and the
schedule an optimization block describes (`tf_vrgd.config` re-exports
`LEARNING_RATE_TYPES`, `WARMUP_TYPES` and `learning_rate_from_config`)."""

import dataclasses

import keras

from tf_vrgd import schedules
from tf_vrgd._config_fields import checked_fields as _fields
from tf_vrgd._config_fields import one_of as _one_of
from tf_vrgd._config_fields import require as _required

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
