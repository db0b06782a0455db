"""Strict reading of TOML tables: every key is known, every value is checked.

A `Table` wraps one (sub)table of a scenario. Each accessor marks its key as
used and validates the value; `Table.finish` then rejects keys nobody asked
for, so a typo such as `workers.cnt` is an error naming the key instead of a
silently ignored setting.
"""

from __future__ import annotations

import enum
import math
import numbers

from simulator.errors import close_key, invalid_value, unknown_key

__all__ = ["Table", "MISSING"]


class _Missing:
    def __repr__(self):
        return "MISSING"


MISSING = _Missing()


class Table:
    """A TOML table being read under the dotted `prefix`.

    Args:
        data: the table, a `dict`.
        prefix: dotted key of the table (`""` for the top level).
        source: file name used in error messages.
    """

    def __init__(self, data, prefix: str = "", source: str | None = None):
        if not isinstance(data, dict):
            raise invalid_value(prefix or "<scenario>", data, "it must be a table", source)
        self.data = data
        self.prefix = prefix
        self.source = source
        self._used: set[str] = set()

    def key(self, name: str) -> str:
        """The dotted key of `name` in this table."""
        return f"{self.prefix}.{name}" if self.prefix else name

    def error(self, name: str, value, reason: str):
        """A `ScenarioError` for the value of `name`."""
        return invalid_value(self.key(name), value, reason, self.source)

    def has(self, name: str) -> bool:
        return name in self.data

    def raw(self, name: str, default=MISSING):
        """The unchecked value of `name`; raises if it is required and absent (naming the
        key it was probably misspelt as, if the table has one)."""
        self._used.add(name)
        if name in self.data:
            return self.data[name]
        if default is MISSING:
            typo = close_key(name, [k for k in self.data if k not in self._used])
            if typo is not None:
                raise unknown_key(self.key(typo), self.data[typo], source=self.source,
                                  guess=name)
            raise invalid_value(self.key(name), None, "this key is required", self.source)
        return default

    def integer(self, name: str, default=MISSING, minimum: int | None = None):
        value = self.raw(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise self.error(name, value, "it must be an integer")
        if minimum is not None and value < minimum:
            reason = "it must be positive" if minimum == 1 else f"it must be at least {minimum}"
            reason = "it must not be negative" if minimum == 0 else reason
            raise self.error(name, value, reason)
        return int(value)

    def number(self, name: str, default=MISSING, *, positive: bool = False,
               non_negative: bool = False, maximum: float | None = None,
               allow_inf: bool = False):
        value = self.raw(name, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise self.error(name, value, "it must be a number")
        value = float(value)
        if math.isnan(value):
            raise self.error(name, value, "it must not be NaN")
        if math.isinf(value) and not allow_inf:
            raise self.error(name, value, "it must be finite")
        if positive and not value > 0:
            raise self.error(name, value, "it must be positive")
        if non_negative and value < 0:
            raise self.error(name, value, "it must not be negative")
        if maximum is not None and value > maximum:
            raise self.error(name, value, f"it must be at most {maximum}")
        return value

    def boolean(self, name: str, default=MISSING) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise self.error(name, value, "it must be true or false")
        return value

    def string(self, name: str, default=MISSING):
        value = self.raw(name, default)
        if value is None and default is None:
            return None
        if not isinstance(value, str):
            raise self.error(name, value, "it must be a string")
        return value

    def choice(self, name: str, enum_type: type[enum.Enum], default=MISSING):
        value = self.raw(name, default)
        if isinstance(value, enum_type):
            return value
        try:
            return enum_type(value)
        except ValueError:
            options = [m.value for m in enum_type]
            raise self.error(name, value, f"expected one of {options}") from None

    def table(self, name: str, default=MISSING) -> Table | None:
        value = self.raw(name, default)
        if value is None and default is None:
            return None
        if value is default and isinstance(default, dict):
            return Table(dict(default), self.key(name), self.source)
        if not isinstance(value, dict):
            raise self.error(name, value, "it must be a table")
        return Table(value, self.key(name), self.source)

    def tables(self, name: str) -> list[Table]:
        """An array of tables (`[[name]]`), empty if absent."""
        value = self.raw(name, [])
        if not isinstance(value, list):
            raise self.error(name, value, "it must be an array of tables")
        out = []
        for i, item in enumerate(value):
            if not isinstance(item, dict):
                raise self.error(f"{name}[{i}]", item, "it must be a table")
            out.append(Table(item, f"{self.key(name)}[{i}]", self.source))
        return out

    def finish(self) -> None:
        """Raises on keys of this table that no accessor read."""
        for name in self.data:
            if name not in self._used:
                raise unknown_key(self.key(name), self.data[name], self._used, self.source)
