"""Errors raised for bad scenarios, in the Keras style: name the key and the value."""

from __future__ import annotations

import difflib

__all__ = ["ScenarioError", "invalid_value", "unknown_key"]


class ScenarioError(ValueError):
    """A scenario file or dictionary has a bad key or value."""


def _where(source: str | None) -> str:
    return f" in {source}" if source else ""


def invalid_value(key: str, value, reason: str, source: str | None = None) -> ScenarioError:
    """Returns a `ScenarioError` for `key` holding `value`.

    Example message: "Invalid value for `workers.count` in scenario.toml: it
    must be positive. Received: workers.count=-3".
    """
    return ScenarioError(
        f"Invalid value for `{key}`{_where(source)}: {reason}. Received: {key}={value!r}"
    )


def close_key(name: str, candidates) -> str | None:
    """The one of `candidates` that `name` is most likely a misspelling of, or `None`."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.75)
    return matches[0] if matches else None


def unknown_key(key: str, value, expected=None, source: str | None = None, *,
                guess: str | None = None) -> ScenarioError:
    """Returns a `ScenarioError` for a key the scenario format does not define.

    Example message: "Unknown key `workers.cont` in scenario.toml: did you mean `count`?
    Expected one of ['batch_size', 'count', 'step_time']. Received: workers.cont=3".

    Args:
        key: the dotted key.
        value: its value.
        expected: the keys its table defines, or `None` when they are not all known yet
            (then `guess` is given).
        source: where it was read.
        guess: the key it was probably meant to be; by default the closest of `expected`.
    """
    if guess is None and expected is not None:
        guess = close_key(key.rpartition(".")[2], expected)
    hint = f"did you mean `{guess}`?" if guess else ""
    if expected is not None:
        hint += (" Expected" if guess else "expected") + f" one of {sorted(expected)}."
    return ScenarioError(f"Unknown key `{key}`{_where(source)}: {hint} Received: {key}={value!r}")
