"""Argument checks shared by kerasps modules (pure Python: the simulator imports them too)."""

from __future__ import annotations

import numbers


def positive_int(name: str, value, allow_none: bool = False, minimum: int = 1):
    """Returns `value` as an `int`, or raises a `ValueError` naming `name` and `value`.

    Booleans, floats and strings are refused; `None` only when `allow_none`;
    `minimum=0` also accepts zero.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(
            f"Invalid value for argument `{name}`: it must be {kind}. "
            f"Received: {name}={value!r}"
        )
    return int(value)
