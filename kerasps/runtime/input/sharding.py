"""Shard-policy arithmetic: which part of a dataset each worker reads."""

from __future__ import annotations

import tensorflow as tf

from kerasps.backend import _tf


def shard(dataset, policy: str, num_workers: int, index: int):
    """Worker `index`'s part of `dataset` under shard policy `policy`, as
    `resolve_shard_policy` gave it (`"file"`, `"data"` or `"off"`).

    `"off"` (and a single worker) keeps the whole dataset; `"data"` keeps every
    `num_workers`-th element the pipeline yields; `"file"` is TensorFlow's
    auto-shard rewrite, which gives the worker every `num_workers`-th file.
    """
    if policy == "off" or num_workers == 1:
        return dataset
    if policy == "data":
        return dataset.shard(num_workers, index)
    return _tf.shard_files(dataset, num_workers, index)


def resolve_shard_policy(dataset, policy: str, num_workers: int) -> str:
    """The policy `shard` applies to `dataset` for `shard_policy=policy`: `"auto"`
    becomes `"file"` when the dataset reads at least `num_workers` files and
    `"data"` otherwise, as TensorFlow's AUTO does. Raises for `"file"` that
    cannot give each worker a file. Runs eagerly (it reads file names)."""
    if policy in ("off", "data") or num_workers == 1:
        return policy
    with tf.init_scope():
        files = _tf.file_count(dataset)
    if policy == "auto":
        return "file" if files is not None and files >= num_workers else "data"
    if files is None:
        raise ValueError(
            "Invalid value for argument `shard_policy`: 'file' shards by the files a "
            "dataset reads, and this one reads none that can be counted (use 'data' or "
            f"'auto'). Received: shard_policy='file' for {dataset!r:.200}")
    if files < num_workers:
        raise ValueError(
            f"Invalid value for argument `shard_policy`: 'file' gives each of the "
            f"{num_workers} workers whole files, and the dataset reads {files} file(s): "
            f"{num_workers - files} worker(s) would get no data. Use more files, 'data' "
            "or 'auto'. Received: shard_policy='file'")
    return "file"
