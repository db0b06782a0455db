"""Words and units for the keys of `Result.flat_summary()` and of scenarios.

The sweep table's header and the axes of `plots.plot_sweep` use them, so that a
column or an axis reads "throughput (steps/s)" instead of `steps_per_second`.
Keys not listed here have no unit (`None`) and keep their own name as label.
"""

from __future__ import annotations

import re

__all__ = ["metric_label", "metric_unit", "metric_words", "parameter_unit", "with_unit"]

# Metric keys of the flat summary: (words, unit).
_METRICS = {
    "num_workers": ("workers at the start", "workers"),
    "elapsed": ("simulated time", "s"),
    "steps": ("global steps kept", "steps"),
    "steps_per_second": ("throughput", "steps/s"),
    "examples_per_second": ("throughput", "examples/s"),
    "step_time": ("mean global step time", "s"),
    "worker_steps": ("worker steps", "steps"),
    "gradients_applied": ("gradients applied", "gradients"),
    "gradients_dropped": ("gradients dropped", "gradients"),
    "gradients_lost": ("gradients lost", "gradients"),
    "row_updates": ("row updates applied", "updates"),
    "goodput": ("goodput", "fraction"),
    "applied_fraction": ("applied fraction", "fraction"),
    "rolled_back_steps": ("global steps rolled back", "steps"),
    "downtime": ("downtime", "s"),
    "num_failures": ("failures", "failures"),
    "num_checkpoints": ("checkpoints", "checkpoints"),
    "ended_by.time": ("time the job ended", "s"),
    "ended_by.restarts": ("restarts of the task that ended the job", "restarts"),
    "table.steps": ("table: worker steps replayed", "steps"),
    "table.ids_per_step": ("table: ids per worker step", "ids"),
    "table.unique_per_step": ("table: distinct ids per worker step", "ids"),
    "table.hit_rate": ("table: hit rate", "fraction"),
    "table.admitted_per_step": ("table: rows admitted per worker step", "rows"),
    "table.evicted_per_step": ("table: rows evicted per worker step", "rows"),
    "table.rows_used": ("table: rows used", "rows"),
}

# Families of keys `<prefix>.<statistic>` (from `metrics.describe`): words, unit.
_DESCRIBED = {
    "worker_step_time": ("worker step time", "s"),
    "global_step_interval": ("global step interval", "s"),
    "staleness": ("staleness", "updates"),
}
_COUNTS = {  # `<prefix>.count`, and `worker_step_time.dropped`
    "worker_step_time.count": ("worker steps timed", "steps"),
    "worker_step_time.dropped": ("worker steps dropped by backup workers, timed", "steps"),
    "global_step_interval.count": ("global step intervals", "intervals"),
    "staleness.count": ("gradients applied, with their staleness", "gradients"),
}
_STATISTICS = {"mean": "mean", "std": "std. dev.", "p50": "p50", "p90": "p90", "p99": "p99",
               "max": "max"}
_PS = {"bytes": ("bytes placed on ps {}", "bytes"),
       "traffic_bytes": ("traffic of ps {}", "bytes"),
       "utilization": ("utilization of ps {}", "fraction")}

# Scenario keys (what `--set` and `--vary` name): their unit.
_PARAMETERS = {
    "seed": None,
    "workers.count": "workers",
    "workers.batch_size": "examples",
    "workers.embedding_time": "s",
    "stragglers.count": "workers",
    "stragglers.slowdown": None,
    "stragglers.tail_probability": None,
    "stragglers.tail_slowdown": None,
    "stragglers.tail_alpha": None,
    "stragglers.input_delay": "s",
    "ps.count": "ps tasks",
    "ps.service_rate": "bytes/s",
    "network.bandwidth": "bytes/s",
    "network.worker_bandwidth": "bytes/s",
    "network.latency": "s",
    "network.duplex_efficiency": "fraction",
    "training.steps": "steps",
    "training.backup_workers": "workers",
    "training.max_staleness": "updates",
    "training.max_time": "s",
    "training.apply_time": "s",
    "checkpoint.every": "steps",
    "checkpoint.duration": "s",
    "checkpoint.restore_time": "s",
    "failures.worker_mtbf": "s",
    "failures.worker_restart_time": "s",
    "failures.worker_loss_probability": None,
    "failures.ps_mtbf": "s",
    "failures.ps_restart_time": "s",
    "failures.coordinator_mtbf": "s",
    "failures.coordinator_restart_time": "s",
    "failures.max_restarts": "restarts",
    "elastic.min_workers": "workers",
    "elastic.max_workers": "workers",
    "elastic.join_rate": "workers/s",
    "elastic.leave_rate": "workers/s",
    "host.cpus": "cores",
    "machine.cores": "cores",
    "machine.background": "cores",
    "model.partitioner.num_shards": "shards",
    "model.partitioner.max_shards": "shards",
    "model.partitioner.min_shard_bytes": "bytes",
    "model.partitioner.max_shard_bytes": "bytes",
    "model.partitioner.bytes_per_string": "bytes",
    "table.capacity": "rows",
    "table.min_count": "occurrences",
    "table.probability": None,
    "table.steps_to_live": "steps",
    "table.optimizer_slots": "slots",
    "table.ids_per_step": "ids",
    "table.warmup_steps": "steps",
    "table.ids.examples": "ids",
    "table.ids.distinct": "ids",
    "table.ids.window": "ids",
}
# Parameters of a step-time distribution (`workers.step_time.rate`, `host.cpu_time.mean`).
_DISTRIBUTION = {"value": "s", "rate": "1/s", "shift": "s", "mean": "s", "sigma": None}


def _metric(key: str) -> tuple[str, str | None]:
    if key in _METRICS:
        return _METRICS[key]
    if key in _COUNTS:
        return _COUNTS[key]
    prefix, _, stat = key.rpartition(".")
    if prefix in _DESCRIBED and stat in _STATISTICS:
        words, unit = _DESCRIBED[prefix]
        return f"{words} {_STATISTICS[stat]}", unit
    match = re.fullmatch(r"ps\.(\d+)\.(\w+)", key)
    if match and match[2] in _PS:
        words, unit = _PS[match[2]]
        return words.format(match[1]), unit
    match = re.fullmatch(r"table\.bytes_per_step\.(\d+)", key)
    if match:
        return f"table: bytes per worker step on ps {match[1]}", "bytes"
    if key.startswith("restarts."):
        return f"restarts of {key.split('.', 1)[1]}", "restarts"
    return key, None


def metric_unit(key: str) -> str | None:
    """The unit of a key of `Result.flat_summary()` ("steps/s", "s", "fraction"...), or
    `None` when it has none or is unknown."""
    return _metric(key)[1]


def metric_words(key: str) -> str:
    """A metric in words, without its unit ("throughput"); an unknown key as it is."""
    return _metric(key)[0]


def metric_label(key: str) -> str:
    """A metric in words with its unit, for an axis: "throughput (steps/s)",
    "global step interval p99 (s)"; an unknown key is returned as it is."""
    return with_unit(*_metric(key))


def parameter_unit(key: str) -> str | None:
    """The unit of a scenario key ("training.backup_workers": "workers",
    "network.latency": "s"), or `None` when it has none or is unknown."""
    if key in _PARAMETERS:
        return _PARAMETERS[key]
    section, _, name = key.rpartition(".")
    if section in ("workers.step_time", "host.cpu_time"):
        return _DISTRIBUTION.get(name)
    return None


def with_unit(words: str, unit: str | None) -> str:
    """`words (unit)`; just `words` without a unit, or where the words already end with
    it ("global steps kept" is not followed by "(steps)")."""
    if not unit or unit in words.split():
        return words
    return f"{words} ({unit})"
