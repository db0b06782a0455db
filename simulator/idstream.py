"""Id streams whose vocabulary keeps growing: what a dynamic embedding table sees.

A `ZipfStream` draws `examples` ids, `chunk` at a time, in order. At any
moment `window` ids are alive: a window that slides over ids
`0 .. distinct - 1` from the first chunk to the last, so new ids keep
arriving and old ones stop being seen. Each id has a fixed popularity,
`rank ** -exponent` with its rank in `1 .. window` drawn by hashing the id,
and each chunk draws from the live ids in proportion to it. Each id also has
a hidden score (a standard normal times `score_scale`, by hashing); a click
label is `score + noise > 0` with standard normal noise.

Shared by `benchmarks/dynamic_embedding.py`, the tutorial and the table model
(`simulator.table`), which predicts a table's hit rate and churn on it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from kerasps.policy import tables

__all__ = ["ZipfStream"]


def _uniform(keys, salt: int) -> np.ndarray:
    """A uniform in (0, 1) per key, by hashing `(key, salt)`."""
    with np.errstate(over="ignore"):
        bits = tables.mix64((np.asarray(keys, np.int64).astype(np.uint64)
                             + np.uint64(salt)).astype(np.int64))
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


@dataclasses.dataclass(frozen=True)
class ZipfStream:
    """A click stream over a growing vocabulary (see the module docstring).

    Attributes:
        examples: ids drawn in all.
        distinct: ids the vocabulary grows to (ids `0 .. distinct - 1`).
        window: ids alive at a time.
        exponent: Zipf exponent of the popularity.
        chunk: ids drawn per chunk (the window moves once per chunk).
        score_scale: standard deviation of the hidden scores.
        seed: seed of the draws.
    """

    examples: int
    distinct: int
    window: int
    exponent: float = 1.1
    chunk: int = 8192
    score_scale: float = 2.0
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.window <= self.distinct:
            raise ValueError("Invalid value for argument `window`: it must be in "
                             f"(0, distinct={self.distinct}]. Received: window={self.window!r}")

    @property
    def num_chunks(self) -> int:
        return -(-self.examples // self.chunk)

    def window_start(self, chunk_index: int) -> int:
        """The first live id while chunk `chunk_index` is drawn."""
        if self.num_chunks == 1:
            return 0
        return round(chunk_index * (self.distinct - self.window) / (self.num_chunks - 1))

    def popularity(self, ids) -> np.ndarray:
        """Each id's (unnormalized) popularity."""
        rank = np.floor(_uniform(ids, 0x5EED + self.seed) * self.window) + 1
        return rank ** -self.exponent

    def scores(self, ids) -> np.ndarray:
        """Each id's hidden score."""
        return self.score_scale * _probit(_uniform(ids, 0x5C0E + self.seed))

    def chunks(self) -> Iterator[np.ndarray]:
        """The ids of each chunk, in order (int64).

        An id's popularity is fixed, so only the ids that joined the window since the
        last chunk are weighed (hashing the whole window again would cost most of the
        time of a large window); the weights, and so the draws, are the same.
        """
        rng = np.random.default_rng(self.seed)
        first, weights = 0, np.empty(0)  # the live ids' weights from id `first` on
        for c in range(self.num_chunks):
            start = self.window_start(c)
            live = np.arange(start, start + self.window, dtype=np.int64)
            kept = weights[start - first:]
            first, weights = start, np.concatenate((kept, self.popularity(live[len(kept):])))
            size = min(self.chunk, self.examples - c * self.chunk)
            yield rng.choice(live, size=size, p=weights / weights.sum())

    def labels(self, ids, chunk_index: int = 0) -> np.ndarray:
        """Click labels (float32) of `ids`: score plus standard normal noise above 0."""
        rng = np.random.default_rng((self.seed, 7, chunk_index))
        return (self.scores(ids) + rng.standard_normal(len(ids)) > 0).astype(np.float32)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The whole stream: ids `[examples]` and labels `[examples]`."""
        ids, labels = [], []
        for c, chunk in enumerate(self.chunks()):
            ids.append(chunk)
            labels.append(self.labels(chunk, c))
        return np.concatenate(ids), np.concatenate(labels)


def _probit(u: np.ndarray) -> np.ndarray:
    """The standard normal quantile of `u` (Acklam's rational approximation, relative
    error below 1.2e-9)."""
    a = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
         1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00)
    b = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
         6.680131188771972e+01, -1.328068155288572e+01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
         -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
         3.754408661907416e+00)
    u = np.asarray(u, np.float64)
    out = np.empty_like(u)
    low, high = u < 0.02425, u > 1 - 0.02425
    mid = ~(low | high)
    q = u[mid] - 0.5
    r = q * q
    out[mid] = ((((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q
                / (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1))
    for mask, sign, values in ((low, 1, u[low]), (high, -1, 1 - u[high])):
        q = np.sqrt(-2 * np.log(values))
        out[mask] = sign * ((((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5])
                            / ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1))
    return out
