"""Argument checks shared by the constructors and by the config readers
(`tf_vrgd.config` for optimization blocks, `tf_vrgd.experiments.fields`
for the task, trainer and runtime fields).

Every check raises `ValueError` naming the argument and the value received,
at construction time (or when a config is read), never at the first
update. The `check_*` functions check one value; `number`, `integer`,
`string`, `non_empty_string` and `list_of` make checks of the form
``check(name, value) -> value`` for tables of fields.
"""

import math
import numbers


def _is_number(value):
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_number(name, value, *, low=None, high=None, low_open=False, high_open=False):
    """Checks that `value` is a real number in the given interval.

    Args:
        name: The argument's name, as the user wrote it.
        value: The value received.
        low, high: Interval bounds, `None` for unbounded.
        low_open, high_open: Whether the bound itself is excluded.

    Returns:
        `value` as a Python float.
    """
    if not _is_number(value):
        raise ValueError(f"`{name}` must be a real number. Received: {name}={value!r}")
    value = float(value)
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high or value != value:  # value != value: NaN
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        low_text = "-inf" if low is None else f"{low:g}"
        high_text = "inf" if high is None else f"{high:g}"
        raise ValueError(
            f"`{name}` must be in {left}{low_text}, {high_text}{right}. Received: {name}={value!r}"
        )
    return value


def check_learning_rate(value, name="learning_rate"):
    """A float learning rate must be finite and >= 0; schedules and
    callables pass."""
    if _is_number(value):
        check_number(name, value, low=0.0, high=float("inf"), high_open=True)
    return value


# The largest step count accepted: float64 (and so every schedule's
# arithmetic) still counts every step exactly below it.
MAX_STEPS = 2**53


def check_integer(name, value, *, low=None, high=MAX_STEPS):
    """Checks that `value` is a Python (or numpy) integer, not a bool or a
    float with a fractional part silently dropped, in [low, high]."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"`{name}` must be an integer. Received: {name}={value!r}")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        low_text = "-inf" if low is None else str(low)
        high_text = "inf" if high is None else str(high)
        raise ValueError(
            f"`{name}` must be an integer in [{low_text}, {high_text}]. Received: {name}={value!r}"
        )
    return value


def check_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool. Received: {name}={value!r}")
    return value


def check_regex_list(name, value):
    """`None` or a list/tuple of regular-expression strings."""
    import re

    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(
            f"`{name}` must be a list of regular expressions or None. Received: {name}={value!r}"
        )
    for pattern in value:
        if not isinstance(pattern, str):
            raise ValueError(f"`{name}` must hold strings. Received: {name}={value!r}")
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(
                f"`{name}` holds an invalid regular expression {pattern!r} "
                f"({error}). Received: {name}={value!r}"
            ) from None
    return list(value)


def number(low=-math.inf, high=math.inf, low_open=False, high_open=False):
    """A check of a real number in [low, high] (each bound open if asked;
    infinite bounds always are: no field takes an infinite value)."""
    return lambda name, value: check_number(
        name,
        value,
        low=low,
        high=high,
        low_open=low_open or low == -math.inf,
        high_open=high_open or high == math.inf,
    )


def integer(low):
    """A check of an integer >= `low`."""
    return lambda name, value: check_integer(name, value, low=low)


def string(name, value):
    """A string (empty allowed)."""
    if not isinstance(value, str):
        raise ValueError(f"`{name}` must be a string. Received: {name}={value!r}")
    return value


def non_empty_string(name, value):
    """A string that is not empty."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"`{name}` must be a non-empty string. Received: {name}={value!r}")
    return value


def list_of(check, length=None):
    """A check of a non-empty list (or tuple) of values each passing
    `check` (named ``name[i]``), of `length` values if given; returns a
    list."""

    def checked(name, value):
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"`{name}` must be a non-empty list. Received: {name}={value!r}")
        if length is not None and len(value) != length:
            raise ValueError(f"`{name}` must hold {length} values. Received: {name}={value!r}")
        return [check(f"{name}[{i}]", item) for i, item in enumerate(value)]

    return checked


#: A real number > 0.
POSITIVE_NUMBER = number(0.0, low_open=True)
#: A real number >= 0.
NON_NEGATIVE_NUMBER = number(0.0)
#: A real number in [0, 1).
UNIT_INTERVAL = number(0.0, 1.0, high_open=True)
#: An integer >= 1.
POSITIVE_INTEGER = integer(1)
