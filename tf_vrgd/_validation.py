"""Hyper-parameter checks shared by the constructors.

Every check raises `ValueError` naming the argument and the value received,
at construction time, never at the first update.
"""

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
