"""`model.fit` throughput: kerasps against tf_keras with TF's ParameterServerStrategy.

The same model and synthetic data on the same in-process cluster shape
(2 workers, 2 ps, the embedding sharded over both ps tasks), in steps per
second (training steps of one worker batch, summed over workers):

* ``tf_keras``: `tf_keras` `model.fit` with `tf.distribute.experimental.
  ParameterServerStrategy` and `tf_keras.utils.experimental.DatasetCreator`,
  the anchor (what users would run without kerasps);
* ``kerasps``: Keras 3 `model.fit` with `kerasps.ParameterServerStrategy` and
  `kerasps.DatasetCreator`, `verbose=0`;
* ``kerasps+progbar``: the same with `verbose=1` (a live progress bar; stdout
  goes to /dev/null while timing);
* ``kerasps+callback``: the same with `verbose=0` and a trivial batch-level
  callback (counts `on_train_batch_end` calls);
* ``kerasps+unrolled``: `verbose=0` with Keras' `model.unrolled_steps_per_execution
  = steps_per_execution` (no `tf.while_loop` in the scheduled function);
* ``keras3``: single-process Keras 3 `model.fit`, no strategy, same batch;
* ``tf_keras+auto``: tf_keras with its default `verbose="auto"`, what its users
  get: one line per epoch (under ParameterServerStrategy tf_keras makes "auto" 2
  and refuses `verbose=1`, "for performance reasons");
* ``keras3+progbar``: single-process Keras 3 with `verbose=1`, the live bar its
  users see by default in a terminal or a notebook.

each at `steps_per_execution` 1 and 10. Every configuration runs in its own
subprocess (in-process TF servers cannot be shut down, and tf_keras and
Keras 3 should not share a process); the whole set is repeated `--repeats`
times in alternating order so that machine noise hits every configuration,
and the median is reported. A run is one warm-up `fit` (tracing) followed by
one timed `fit` of `--steps` steps; steps/s is `steps / wall time of fit`.

    pip install -e .[bench]
    python benchmarks/fit_throughput.py            # full run, prints a Markdown table
    python benchmarks/fit_throughput.py --quick    # smoke run: spe 1, tf_keras, kerasps, +callback
    python benchmarks/fit_throughput.py --one kerasps --spe 10   # one JSON line

Targets, at both settings: kerasps / tf_keras >= 1.0 on whole `fit`
calls and >= 1.2 on the training loop alone (`on_train_begin` to
`on_train_end`), with `verbose=0` and with the bar (default against default);
the bar and a batch callback at >= 0.9 of kerasps' `verbose=0` steps/s; CPU ms
per step at spe 10 within 1.3x single-process Keras 3's, with `verbose=0` and
with the bar. Each is printed with its measured value.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

NUM_WORKERS = 2
NUM_PS = 2
VOCAB = 100_000
EMBED_DIM = 16
IDS_PER_EXAMPLE = 10
BATCH = 64  # per worker
MIN_SHARD_BYTES = 256 << 10
MAX_SHARDS = 2

CONFIGS = ("tf_keras", "tf_keras+auto", "kerasps", "kerasps+progbar", "kerasps+callback",
           "kerasps+unrolled", "keras3", "keras3+progbar")
ANCHOR = "tf_keras"
BASELINE = "kerasps"  # callback rows are also compared to this
RESULT_PREFIX = "FIT_THROUGHPUT_RESULT "
TARGETS = {"steps_per_s": 1.0, "loop_steps_per_s": 1.2}  # kerasps / tf_keras
# What users run by default: (label, numerator, denominator, measure, spe or None for
# every spe, the bound, whether the ratio must be at least (True) or at most the bound).
DEFAULT_TARGETS = (
    ("default fit, kerasps bar / tf_keras default", "kerasps+progbar", "tf_keras+auto",
     "steps_per_s", None, 1.0, True),
    ("bar cost, kerasps bar / verbose=0", "kerasps+progbar", "kerasps", "steps_per_s", None,
     0.9, True),
    ("batch callback cost, callback / verbose=0", "kerasps+callback", "kerasps", "steps_per_s",
     None, 0.9, True),
    ("CPU per step, kerasps / keras3 (verbose=0)", "kerasps", "keras3", "cpu_ms_per_step", 10,
     1.3, False),
    ("CPU per step, kerasps bar / keras3 bar", "kerasps+progbar", "keras3+progbar",
     "cpu_ms_per_step", 10, 1.3, False),
)


# -- the workload ---------------------------------------------------------------------
def _dataset_fn(input_context=None):
    """Endless synthetic batches of random ids and random labels (one worker's input)."""
    import tensorflow as tf

    seed = 0 if input_context is None else input_context.input_pipeline_id

    def make_batch(_):
        ids = tf.random.uniform([BATCH, IDS_PER_EXAMPLE], maxval=VOCAB, dtype=tf.int64,
                                seed=seed + 1)
        labels = tf.random.uniform([BATCH, 1], seed=seed + 2)
        return ids, labels

    return tf.data.Dataset.from_tensors(0).repeat().map(make_batch).prefetch(2)


def _build_model(keras_module):
    """Embedding(1e5, 16) -> mean over ids -> Dense(32, relu) -> Dense(1)."""
    layers = keras_module.layers
    return keras_module.Sequential([
        keras_module.Input(shape=(IDS_PER_EXAMPLE,), dtype="int64"),
        layers.Embedding(VOCAB, EMBED_DIM),
        layers.GlobalAveragePooling1D(),
        layers.Dense(32, activation="relu"),
        layers.Dense(1),
    ])


def _batch_counter(base_class):
    class BatchCounter(base_class):
        """A trivial batch-level callback: counts `on_train_batch_end` calls."""

        def __init__(self):
            super().__init__()
            self.calls = 0

        def on_train_batch_end(self, batch, logs=None):
            self.calls += 1

    return BatchCounter()


def _cpu_seconds():
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _loop_timer(base_class):
    class LoopTimer(base_class):
        """Times `on_train_begin` -> `on_train_end` (no batch-level hooks, so tf_keras
        under PSS accepts it): the training loop without per-`fit` input setup."""

        def on_train_begin(self, logs=None):
            self.begin = time.perf_counter()

        def on_train_end(self, logs=None):
            self.end = time.perf_counter()

    return LoopTimer()


def _timed_fit(model, data, steps, warmup, callback_base, verbose=0, callbacks=()):
    """One warm-up `fit` (traces), then one timed `fit` of `steps` steps."""
    import gc

    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=warmup, verbose=0)
    warmup_seconds = time.perf_counter() - start  # mostly tracing and instantiating
    timer = _loop_timer(callback_base)
    gc.collect()  # free the warm-up fit's functions and iterators before timing
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        cpu_start = _cpu_seconds()
        start = time.perf_counter()
        history = model.fit(data, epochs=1, steps_per_epoch=steps, verbose=verbose,
                            callbacks=[*callbacks, timer])
        seconds = time.perf_counter() - start
        cpu = _cpu_seconds() - cpu_start
    # The whole cluster (coordinator, workers, ps) runs in this process, so its CPU
    # time per step is the work a step costs, much less sensitive to machine load.
    return {"seconds": seconds, "steps_per_s": steps / seconds,
            "warmup_seconds": warmup_seconds,
            "cpu_ms_per_step": 1000 * cpu / steps,
            "loop_seconds": timer.end - timer.begin,
            "loop_steps_per_s": steps / (timer.end - timer.begin),
            "loss": float(history.history["loss"][-1])}


# -- the configurations (each in its own process) ---------------------------------------
def _run_kerasps(spe, steps, warmup, variant):
    import keras

    import kerasps

    resolver = kerasps.cluster.in_process(num_workers=NUM_WORKERS, num_ps=NUM_PS)
    strategy = kerasps.ParameterServerStrategy(
        resolver,
        variable_partitioner=kerasps.partitioners.MinSizePartitioner(
            min_shard_bytes=MIN_SHARD_BYTES, max_shards=MAX_SHARDS))
    with strategy.scope():
        model = _build_model(keras)
        model.compile(keras.optimizers.Adam(), "mse", steps_per_execution=spe)
    if variant == "unrolled":
        model.unrolled_steps_per_execution = spe
    extra = {"embedding_shards_on_ps": sorted(
        {r.ps_task for r in strategy.placement_report() if "/part_" in r.name})}
    fit_kwargs = {}
    if variant == "progbar":
        fit_kwargs["verbose"] = 1
    elif variant == "callback":
        counter = _batch_counter(keras.callbacks.Callback)
        fit_kwargs["callbacks"] = [counter]
    data = kerasps.DatasetCreator(_dataset_fn)
    result = _timed_fit(model, data, steps, warmup, keras.callbacks.Callback, **fit_kwargs)
    if variant == "callback":
        extra["on_train_batch_end_calls"] = counter.calls
    return {**result, **extra}


def _run_tf_keras(spe, steps, warmup, variant=None):
    # The TensorFlow tutorial's in-process cluster ("Parameter server training
    # with ParameterServerStrategy"): workers get num_workers + 1 inter-op threads.
    os.environ["GRPC_FAIL_FAST"] = "use_caller"
    import tensorflow as tf
    import tf_keras

    from kerasps.runtime.ports import pick_port

    cluster = {
        "worker": [f"localhost:{pick_port()}" for _ in range(NUM_WORKERS)],
        "ps": [f"localhost:{pick_port()}" for _ in range(NUM_PS)],
    }
    spec = tf.train.ClusterSpec(cluster)
    worker_config = tf.compat.v1.ConfigProto()
    worker_config.inter_op_parallelism_threads = NUM_WORKERS + 1
    servers = []
    for i in range(NUM_WORKERS):
        servers.append(tf.distribute.Server(spec, job_name="worker", task_index=i,
                                            config=worker_config, protocol="grpc"))
    for i in range(NUM_PS):
        servers.append(tf.distribute.Server(spec, job_name="ps", task_index=i,
                                            protocol="grpc"))
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver,
        variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
            min_shard_bytes=MIN_SHARD_BYTES, max_shards=MAX_SHARDS))
    with strategy.scope():
        model = _build_model(tf_keras)
        model.compile(tf_keras.optimizers.Adam(), "mse", steps_per_execution=spe)
    embedding = model.layers[0].embeddings
    extra = {"embedding_shards_on_ps": sorted(
        {tf.DeviceSpec.from_string(v.device).task for v in getattr(embedding, "variables",
                                                                    [embedding])})}
    data = tf_keras.utils.experimental.DatasetCreator(_dataset_fn)
    result = _timed_fit(model, data, steps, warmup, tf_keras.callbacks.Callback,
                        verbose="auto" if variant == "auto" else 0)
    return {**result, **extra}


def _run_keras3(spe, steps, warmup, variant=None):
    import keras

    model = _build_model(keras)
    model.compile(keras.optimizers.Adam(), "mse", steps_per_execution=spe)
    return _timed_fit(model, _dataset_fn(), steps, warmup, keras.callbacks.Callback,
                      verbose=1 if variant == "progbar" else 0)


def run_one(config, spe, steps, warmup):
    """Runs one configuration in this process; returns its result record."""
    if config not in CONFIGS:
        raise ValueError(f"Invalid value for argument `--one`: expected one of "
                         f"{list(CONFIGS)}. Received: {config!r}")
    name, _, variant = config.partition("+")
    run = {"tf_keras": _run_tf_keras, "keras3": _run_keras3, "kerasps": _run_kerasps}[name]
    result = run(spe, steps, warmup, variant or None)
    return {"config": config, "spe": spe, "steps": steps, "warmup": warmup, **result}


# -- orchestration ----------------------------------------------------------------------
def _versions():
    versions = {}
    for dist in ("tensorflow", "keras", "tf-keras", "kerasps"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def _nproc():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def _loadavg():
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _child(config, spe, steps, warmup, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--one", config, "--spe", str(spe),
           "--steps", str(steps), "--warmup", str(warmup)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"config": config, "spe": spe, "error": f"timed out after {timeout}s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
    return {"config": config, "spe": spe, "error": f"exit {proc.returncode}:\n{tail}"}


def _fmt(x, digits=2):
    return "n/a" if x is None else f"{x:.{digits}f}"


def _median(results, config, spe, key):
    values = [r[key] for r in results
              if r["config"] == config and r["spe"] == spe and key in r]
    return (statistics.median(values) if values else None), sorted(values)


def summarize(results, configs, spes):
    """Median steps/s per (config, spe) and the ratios; returns (rows, verdicts).

    `verdicts[spe][key]` is kerasps / tf_keras for each key of `TARGETS`.
    """
    rows = []
    verdicts = {}
    for spe in spes:
        anchor, _ = _median(results, ANCHOR, spe, "steps_per_s")
        base, _ = _median(results, BASELINE, spe, "steps_per_s")
        anchor_loop, _ = _median(results, ANCHOR, spe, "loop_steps_per_s")
        anchor_cpu, _ = _median(results, ANCHOR, spe, "cpu_ms_per_step")
        for config in configs:
            value, runs = _median(results, config, spe, "steps_per_s")
            loop, _ = _median(results, config, spe, "loop_steps_per_s")
            cpu, _ = _median(results, config, spe, "cpu_ms_per_step")
            warmup_s, _ = _median(results, config, spe, "warmup_seconds")
            rows.append({
                "config": config, "spe": spe, "steps_per_s": value, "runs": runs,
                "vs_tf_keras": value / anchor if value and anchor else None,
                "vs_kerasps": (value / base if value and base and config.startswith(BASELINE + "+")
                               else None),
                "loop_steps_per_s": loop,
                "loop_vs_tf_keras": loop / anchor_loop if loop and anchor_loop else None,
                "cpu_ms_per_step": cpu,
                # > 1 means cheaper than tf_keras (less CPU per step).
                "cpu_vs_tf_keras": anchor_cpu / cpu if cpu and anchor_cpu else None,
                "warmup_seconds": warmup_s,
            })
        verdicts[spe] = {}
        for key in TARGETS:
            ours, theirs = (_median(results, c, spe, key)[0] for c in (BASELINE, ANCHOR))
            verdicts[spe][key] = ours / theirs if ours and theirs else None
    return rows, verdicts


def default_targets(results, spes) -> list[dict]:
    """Each of `DEFAULT_TARGETS` at each spe it applies to, with its measured ratio
    (None where a configuration did not run) and whether it is met."""
    out = []
    for label, top, bottom, measure, only_spe, bound, at_least in DEFAULT_TARGETS:
        for spe in spes:
            if only_spe is not None and spe != only_spe:
                continue
            a, b = (_median(results, c, spe, measure)[0] for c in (top, bottom))
            ratio = a / b if a and b else None
            met = None if ratio is None else (ratio >= bound if at_least else ratio <= bound)
            out.append({"target": label, "spe": spe, "ratio": ratio, "bound": bound,
                        "at_least": at_least, "met": met})
    return out


def default_targets_lines(targets) -> list[str]:
    lines = []
    for t in targets:
        if t["ratio"] is None:
            continue
        sign = ">=" if t["at_least"] else "<="
        verdict = "meets" if t["met"] else (
            f"MISSES by {abs(t['ratio'] - t['bound']) / t['bound']:.0%}")
        lines.append(f"- {t['target']}, spe {t['spe']}: {t['ratio']:.2f} (target {sign} "
                     f"{t['bound']}: {verdict})")
    return lines


def markdown(rows, verdicts, meta):
    lines = [
        "| config | spe | steps/s | ratio to tf_keras | ratio to kerasps verbose=0 "
        "| runs (steps/s) | loop steps/s | loop ratio to tf_keras | CPU ms/step "
        "| tf_keras CPU / CPU | warm-up fit s |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        runs = ", ".join(f"{v:.1f}" for v in row["runs"]) or "failed"
        vs_base = _fmt(row["vs_kerasps"]) if row["vs_kerasps"] else ""
        lines.append(
            f"| {row['config']} | {row['spe']} | {_fmt(row['steps_per_s'], 1)} "
            f"| {_fmt(row['vs_tf_keras'])} | {vs_base} | {runs} "
            f"| {_fmt(row['loop_steps_per_s'], 1)} | {_fmt(row['loop_vs_tf_keras'])} "
            f"| {_fmt(row['cpu_ms_per_step'], 1)} | {_fmt(row['cpu_vs_tf_keras'])} "
            f"| {_fmt(row.get('warmup_seconds'), 1)} |")
    verdict = "; ".join(
        f"{'loop' if key.startswith('loop') else 'fit'} spe={spe}: {_fmt(v)} "
        f"({'meets' if v is not None and v >= TARGETS[key] else 'MISSES'} {TARGETS[key]})"
        for key in TARGETS for spe, by_key in verdicts.items() for v in [by_key[key]])
    v = meta["versions"]
    lines += [
        "",
        f"Targets kerasps/tf_keras (medians; fit >= {TARGETS['steps_per_s']}, loop >= "
        f"{TARGETS['loop_steps_per_s']}): {verdict}.",
        "",
        *(["Targets for what users run by default (medians):",
              *meta["default_targets"], ""] if meta.get("default_targets") else []),
        f"steps/s: `--steps` / wall time of one `fit` (after a warm-up `fit`); loop steps/s: "
        f"the same steps / time from `on_train_begin` to `on_train_end` (excludes per-`fit` "
        f"input setup); warm-up fit s: the untimed first `fit` (tracing, instantiating on the "
        f"workers, and its steps); CPU ms/step: CPU time of the whole process (coordinator, "
        f"workers and ps run in it) during the timed `fit` / steps, the figure least "
        f"disturbed by other load on the machine. Median of {meta['repeats']} interleaved repeats, "
        f"{meta['steps']} timed steps, warm-up {meta['warmup']} steps. tensorflow "
        f"{v['tensorflow']}, keras {v['keras']}, tf_keras {v['tf-keras']}, kerasps "
        f"{v['kerasps']}, python "
        f"{meta['python']}; nproc {meta['nproc']}; load average {meta['load_before']} -> "
        f"{meta['load_after']}.",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", choices=CONFIGS,
                        help="run one configuration in this process and print a JSON line")
    parser.add_argument("--spe", type=int, nargs="+", default=None,
                        help="steps_per_execution values (default: 1 10; 1 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 200)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up steps (default: max(20, 4 * spe))")
    parser.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=None,
                        help="default all (tf_keras, kerasps, kerasps+callback with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 20 steps, 1 repeat, spe 1, three configurations")
    parser.add_argument("--no-anchor", action="store_true",
                        help="no tf_keras row (the default when tf_keras is not installed)")
    parser.add_argument("--timeout", type=float, default=600, help="per-run timeout (s)")
    parser.add_argument("--json", help="also write all results and medians to this file")
    parser.add_argument("--report", metavar="JSON",
                        help="print the table of a run saved with --json, without running")
    args = parser.parse_args(argv)

    steps = args.steps or (20 if args.quick else 200)
    repeats = args.repeats or (1 if args.quick else 3)
    args.spe = args.spe or ([1] if args.quick else [1, 10])
    args.configs = args.configs or (["tf_keras", "kerasps", "kerasps+callback"] if args.quick
                                    else list(CONFIGS))
    if args.no_anchor or importlib.util.find_spec("tf_keras") is None:
        args.configs = [c for c in args.configs if c.partition("+")[0] != ANCHOR]

    if args.one:
        if len(args.spe) != 1:
            parser.error("--one takes a single --spe value")
        spe = args.spe[0]
        warmup = args.warmup or (10 if args.quick else max(20, 4 * spe))
        record = run_one(args.one, spe, steps, warmup)
        print(RESULT_PREFIX + json.dumps(record), flush=True)
        return 0

    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        configs = list(dict.fromkeys(r["config"] for r in saved["results"]))
        spes = sorted({r["spe"] for r in saved["results"]})
        saved["meta"]["default_targets"] = default_targets_lines(
            default_targets(saved["results"], spes))
        print(markdown(*summarize(saved["results"], configs, spes), saved["meta"]))
        return 0

    meta = {"versions": _versions(), "nproc": _nproc(), "steps": steps, "repeats": repeats,
            "warmup": args.warmup or (10 if args.quick else "max(20, 4*spe)"),
            "python": sys.version.split()[0],
            "load_before": _loadavg()}
    print(f"# fit_throughput: {NUM_WORKERS} workers, {NUM_PS} ps; versions {meta['versions']}; "
          f"nproc {meta['nproc']}", flush=True)
    plan = [(c, s) for s in args.spe for c in args.configs]
    results = []
    for repeat in range(repeats):
        order = plan if repeat % 2 == 0 else plan[::-1]
        for config, spe in order:
            warmup = args.warmup or (10 if args.quick else max(20, 4 * spe))
            record = _child(config, spe, steps, warmup, args.timeout)
            record["repeat"] = repeat
            results.append(record)
            if "error" in record:
                print(f"  [{repeat}] {config:17s} spe={spe:<3d} FAILED: {record['error']}",
                      flush=True)
            else:
                print(f"  [{repeat}] {config:17s} spe={spe:<3d} {record['steps_per_s']:8.1f} "
                      f"steps/s  (fit {record['seconds']:.2f}s, loop "
                      f"{record['loop_steps_per_s']:.1f} steps/s, loss {record['loss']:.4f})",
                      flush=True)
    meta["load_after"] = _loadavg()
    rows, verdicts = summarize(results, args.configs, args.spe)
    targets = default_targets(results, args.spe)
    meta["default_targets"] = default_targets_lines(targets)
    print()
    print(markdown(rows, verdicts, meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results, "rows": rows,
                       "verdicts": {str(k): v for k, v in verdicts.items()},
                       "default_targets": targets}, f, indent=1)
    failed = [r for r in results if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
