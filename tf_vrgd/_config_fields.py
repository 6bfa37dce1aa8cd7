"""The field checks of `tf_vrgd.config`: one check per field name, whichever
block holds it, and the one-of and required-field rules of Model Garden's
blocks (`tf_vrgd.config` re-exports `FIELD_CHECKS`)."""

from tf_vrgd import validation

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
    "interval": validation.integer(1),
    "jit_update": validation.check_bool,
    "track_gsnr_statistics": validation.check_bool,
    "decay": validation.NON_NEGATIVE_NUMBER,
    # ema
    "average_decay": validation.number(0.0, 1.0),
    "dynamic_decay": validation.check_bool,
    "trainable_weights_only": validation.check_bool,
    "start_step": validation.integer(0),
}


def checked_fields(what, given, accepted):
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


def one_of(what, block, types):
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


def require(what, fields, *names):
    missing = [n for n in names if fields.get(n) is None]
    if missing:
        raise ValueError(f"{what} needs {missing}.")
