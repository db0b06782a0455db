"""Step-time distributions of workers.

Each distribution is a frozen dataclass with a `mean`, a vectorised
`sample(rng, size)` (the simulator draws step times in NumPy batches, which
keeps one simulated step at about one simpy event) and a `to_dict` that
round-trips through a scenario table such as
`step_time = { distribution = "shifted_exponential", shift = 0.05, rate = 20.0 }`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os

import numpy as np

from simulator.tables import Table

__all__ = [
    "Kind",
    "Distribution",
    "Constant",
    "Exponential",
    "ShiftedExponential",
    "LogNormal",
    "Empirical",
    "from_table",
]


class Kind(enum.Enum):
    """Names of the step-time distributions in scenario files."""

    CONSTANT = "constant"
    EXPONENTIAL = "exponential"
    SHIFTED_EXPONENTIAL = "shifted_exponential"
    LOGNORMAL = "lognormal"
    EMPIRICAL = "empirical"


class Distribution:
    """Base class of step-time distributions (in seconds)."""

    kind: Kind

    @property
    def mean(self) -> float:
        raise NotImplementedError

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        raise NotImplementedError

    def to_dict(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {"distribution": self.kind.value, **fields}


@dataclasses.dataclass(frozen=True)
class Constant(Distribution):
    """Every step takes `value` seconds."""

    value: float
    kind = Kind.CONSTANT

    @property
    def mean(self):
        return self.value

    def sample(self, rng, size):
        return np.full(size, self.value)


@dataclasses.dataclass(frozen=True)
class Exponential(Distribution):
    """Exponential step times with `rate` steps per second (mean `1 / rate`)."""

    rate: float
    kind = Kind.EXPONENTIAL

    @property
    def mean(self):
        return 1.0 / self.rate

    def sample(self, rng, size):
        return rng.exponential(1.0 / self.rate, size)


@dataclasses.dataclass(frozen=True)
class ShiftedExponential(Distribution):
    """A fixed `shift` plus an exponential part with `rate` (mean `shift + 1 / rate`)."""

    shift: float
    rate: float
    kind = Kind.SHIFTED_EXPONENTIAL

    @property
    def mean(self):
        return self.shift + 1.0 / self.rate

    def sample(self, rng, size):
        return self.shift + rng.exponential(1.0 / self.rate, size)


@dataclasses.dataclass(frozen=True)
class LogNormal(Distribution):
    """Log-normal step times with the given `mean` and `sigma` of the logarithm."""

    mean_value: float
    sigma: float
    kind = Kind.LOGNORMAL

    @property
    def mean(self):
        return self.mean_value

    def sample(self, rng, size):
        mu = math.log(self.mean_value) - self.sigma**2 / 2
        return rng.lognormal(mu, self.sigma, size)

    def to_dict(self):
        return {"distribution": self.kind.value, "mean": self.mean_value, "sigma": self.sigma}


@dataclasses.dataclass(frozen=True)
class Empirical(Distribution):
    """Resamples measured step times (for example the durations of a kerasps trace)."""

    samples: tuple[float, ...]
    kind = Kind.EMPIRICAL

    @property
    def mean(self):
        return float(np.mean(self.samples))

    def sample(self, rng, size):
        return rng.choice(np.asarray(self.samples), size)

    def to_dict(self):
        return {"distribution": self.kind.value, "samples": list(self.samples)}


def _empirical_from_trace(t: Table, base_dir: str | None) -> Empirical:
    from kerasps.policy import trace as trace_lib  # pure Python, no TensorFlow

    path = t.string("trace")
    worker = t.integer("worker", None, minimum=0)
    full = path if os.path.isabs(path) or base_dir is None else os.path.join(base_dir, path)
    try:
        events = trace_lib.read_trace(full)
    except (OSError, ValueError) as e:
        raise t.error("trace", path, f"the trace cannot be read ({e})") from None
    durations = [
        e.duration / e.steps for e in events
        if e.kind == "train" and (worker is None or e.worker == worker)
    ]
    if not durations:
        raise t.error("trace", path, "the trace has no train steps for this worker")
    return Empirical(tuple(durations))


def from_table(t: Table, base_dir: str | None = None) -> Distribution:
    """Parses a distribution table and validates its parameters.

    Args:
        t: the table, e.g. `{distribution = "exponential", rate = 10.0}`.
        base_dir: directory that relative trace paths are resolved against.

    Raises:
        ScenarioError: naming the key and the value received.
    """
    kind = t.choice("distribution", Kind)
    if kind is Kind.CONSTANT:
        dist = Constant(t.number("value", non_negative=True))
    elif kind is Kind.EXPONENTIAL:
        dist = Exponential(t.number("rate", positive=True))
    elif kind is Kind.SHIFTED_EXPONENTIAL:
        dist = ShiftedExponential(t.number("shift", non_negative=True),
                                  t.number("rate", positive=True))
    elif kind is Kind.LOGNORMAL:
        dist = LogNormal(t.number("mean", positive=True), t.number("sigma", non_negative=True))
    elif t.has("samples"):
        samples = t.raw("samples")
        if (not isinstance(samples, list) or not samples or any(
                isinstance(s, bool) or not isinstance(s, (int, float)) or not s >= 0
                for s in samples)):
            raise t.error("samples", samples, "it must be a non-empty list of "
                                              "non-negative numbers")
        dist = Empirical(tuple(float(s) for s in samples))
    else:
        dist = _empirical_from_trace(t, base_dir)
    t.finish()
    return dist
