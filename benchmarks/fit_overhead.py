"""Where the CPU time of a kerasps `fit` step goes, one feature switched off at a time.

`fit_throughput.py`'s model and cluster (2 workers, 2 ps, in-process), CPU time
of the whole process per step (the coordinator, workers and ps tasks all run
in it), and per thread group from `/proc/self/task/*/schedstat`. Each
variant runs in its own process: a warm-up `fit`, then `--fits` timed `fit`s
of `--steps` steps; the median over those fits is reported. Variants switch
one thing off by monkeypatching (they measure; they are not supported modes):

* ``kerasps``: `fit`, `verbose=0`, as in `fit_throughput.py`;
* ``callback``: plus a batch-level callback (logs come back every function);
* ``no_staleness``: the strategy's `measure_staleness=False` (no staleness counter);
* ``no_loss_metric``: the loss tracker (a `Mean` on a ps task) is not updated;
* ``unrolled``: Keras' `unrolled_steps_per_execution = steps_per_execution`;
* ``schedule_loop``: no `fit`: the same traced function scheduled in a Python
  loop (`ClusterCoordinator.schedule`, one `join`), what `fit`'s own Python adds
  is the difference to ``kerasps``;
* ``empty_function``: an empty `tf.function` scheduled as often: the cost of
  dispatching a function (coordinator, closure thread, RPC to the worker);
* ``keras3``: single-process Keras 3, the same model and batch (no cluster).

    python benchmarks/fit_overhead.py                       # every variant, spe 1 and 10
    python benchmarks/fit_overhead.py --one kerasps --spe 10  # one JSON line
    python benchmarks/fit_overhead.py --paired base,no_staleness,unrolled --spe 10
    python benchmarks/fit_overhead.py --quick    # a smoke run: kerasps and keras3, spe 1

`--paired` compares variants of the scheduled training function in one
process, alternating them run by run (load on a shared machine drifts too much
between processes for differences under 1 ms): each variant is traced once,
then scheduled in a Python loop of `--steps` steps per run, `--fits` runs each.
Variants: `base` (no logs), `logs` (returns its logs, fetched on the
coordinator), `logs_unpacked` (the logs as separate tensors, as before they
were packed into one), `no_staleness`, `no_loss_metric`, `unrolled`,
`gradients_apart` (each gradient crosses to its ps task on its own, as before the
small ones of a ps task were sent in one tensor).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fit_throughput as ft  # noqa: E402

VARIANTS = ("kerasps", "callback", "no_staleness", "no_loss_metric", "unrolled",
            "schedule_loop", "empty_function", "keras3")
PREFIX = "FIT_OVERHEAD_RESULT "


def _thread_cpu():
    """CPU seconds per thread of this process, keyed by (tid, group)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        tid = int(tid)
        if tid == main:
            group = "coordinator (main thread)"
        elif tid in names:
            name = names[tid]
            group = ("TF closure threads" if "Closure" in name or "Worker" in name
                     else f"python: {name.split('-')[0]}")
        elif comm.startswith("tf_"):
            group = "TF executors (tf_*)"
        elif "grpc" in comm.lower() or "event_engine" in comm.lower():
            group = "gRPC"
        else:
            group = "other native threads"  # unnamed: kernels' intra-op pool, RPC handlers
        out[(tid, group)] = ns / 1e9
    return out


def _by_group(before, after):
    groups = {}
    for key, seconds in after.items():
        groups[key[1]] = groups.get(key[1], 0.0) + seconds - before.get(key, 0.0)
    return groups


def _cpu():
    return time.process_time()


def _measure(run, steps, fits):
    records = []
    for _ in range(fits):
        threads = _thread_cpu()
        cpu, wall = _cpu(), time.perf_counter()
        run()
        wall, cpu = time.perf_counter() - wall, _cpu() - cpu
        groups = _by_group(threads, _thread_cpu())
        records.append({"cpu_ms": 1000 * cpu / steps, "wall_ms": 1000 * wall / steps,
                        "groups": {k: 1000 * v / steps for k, v in groups.items()}})
    keys = sorted({k for r in records for k in r["groups"]})
    return {"cpu_ms_per_step": statistics.median(r["cpu_ms"] for r in records),
            "wall_ms_per_step": statistics.median(r["wall_ms"] for r in records),
            "cpu_ms_runs": [round(r["cpu_ms"], 2) for r in records],
            "groups": {k: round(statistics.median(r["groups"].get(k, 0.0) for r in records), 3)
                       for k in keys}}


def _sharded_model(spe, **strategy_kwargs):
    """`fit_throughput.py`'s cluster, strategy (with `strategy_kwargs`) and compiled model."""
    import keras

    import kerasps

    resolver = kerasps.cluster.in_process(num_workers=ft.NUM_WORKERS, num_ps=ft.NUM_PS)
    strategy = kerasps.ParameterServerStrategy(
        resolver, variable_partitioner=kerasps.partitioners.MinSizePartitioner(
            min_shard_bytes=ft.MIN_SHARD_BYTES, max_shards=ft.MAX_SHARDS), **strategy_kwargs)
    with strategy.scope():
        model = ft._build_model(keras)
        model.compile(keras.optimizers.Adam(), "mse", steps_per_execution=spe)
    return strategy, model


def run_variant(variant, spe, steps, fits):
    import gc

    import keras

    if variant == "keras3":
        model = ft._build_model(keras)
        model.compile(keras.optimizers.Adam(), "mse", steps_per_execution=spe)
        data = ft._dataset_fn()
        model.fit(data, epochs=1, steps_per_epoch=max(20, 4 * spe), verbose=0)
        gc.collect()
        return _measure(lambda: model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0),
                        steps, fits)

    import tensorflow as tf

    import kerasps
    from kerasps.keras.trainer import steps as steps_lib

    strategy, model = _sharded_model(spe, measure_staleness=variant != "no_staleness")
    if variant == "unrolled":
        model.unrolled_steps_per_execution = spe
    if variant == "no_loss_metric":
        object.__setattr__(model._loss_tracker, "update_state", lambda *a, **k: None)
    data = kerasps.DatasetCreator(ft._dataset_fn)
    callbacks = [ft._batch_counter(keras.callbacks.Callback)] if variant == "callback" else []
    model.fit(data, epochs=1, steps_per_epoch=max(20, 4 * spe), verbose=0)
    gc.collect()
    if variant in ("schedule_loop", "empty_function"):
        coordinator = kerasps.ClusterCoordinator(strategy)
        (pipelines,) = coordinator._dataset_cache.values()
        iterator = pipelines["train"].persistent_iterator()
        if variant == "schedule_loop":
            function = steps_lib.make_train_function(model, with_logs=False)
            args = steps_lib.train_arguments(model, iterator, spe)
        else:
            function = tf.function(lambda: None)
            args = ()

        def run():
            for _ in range(steps // spe):
                coordinator.schedule(function, args=args)
            coordinator.join()

        run()
        return _measure(run, steps, fits)
    return _measure(lambda: model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0,
                                      callbacks=callbacks), steps, fits)


def paired(spe, steps, fits, variants):
    """CPU ms per step of each training-function variant, alternated in one process."""
    import contextlib
    import gc

    import kerasps
    from kerasps.backend import _keras
    from kerasps.keras.trainer import staleness
    from kerasps.keras.trainer import steps as steps_lib

    strategy, model = _sharded_model(spe)
    data = kerasps.DatasetCreator(ft._dataset_fn)  # kept: the coordinator caches by it, weakly
    model.fit(data, epochs=1, steps_per_epoch=max(20, 4 * spe), verbose=0)
    coordinator = kerasps.ClusterCoordinator(strategy)
    (pipelines,) = coordinator._dataset_cache.values()
    iterator = pipelines["train"].persistent_iterator()
    measured, packed = staleness.measured, steps_lib._packed
    packed_gradient_bytes = _keras.PACKED_GRADIENT_BYTES

    @contextlib.contextmanager
    def variant(name):
        if name == "no_staleness":
            steps_lib.staleness.measured = lambda model, train_step, cache: train_step
        elif name == "no_loss_metric":
            object.__setattr__(model._loss_tracker, "update_state", lambda *a, **k: None)
        elif name == "unrolled":
            model.unrolled_steps_per_execution = spe
        elif name == "logs_unpacked":
            steps_lib._packed = lambda outputs, cache: outputs
        elif name == "gradients_apart":
            _keras.PACKED_GRADIENT_BYTES = 0
        try:
            yield
        finally:
            steps_lib.staleness.measured, steps_lib._packed = measured, packed
            model.unrolled_steps_per_execution = 1
            _keras.PACKED_GRADIENT_BYTES = packed_gradient_bytes
            if name == "no_loss_metric":
                object.__delattr__(model._loss_tracker, "update_state")

    functions = {}  # name -> (function, its arguments)
    for name in variants:
        steps_lib.forget_step_functions(model)
        with variant(name):
            functions[name] = (steps_lib.make_train_function(
                model, with_logs=name.startswith("logs")),
                steps_lib.train_arguments(model, iterator, spe))
            coordinator.schedule(functions[name][0], args=functions[name][1])
            coordinator.join()

    def run(name):
        function, args = functions[name]
        results = [coordinator.schedule(function, args=args)
                   for _ in range(steps // spe)]
        coordinator.join()
        for result in results:
            result.fetch()

    cpu = {name: [] for name in variants}
    for round_ in range(fits):
        for name in (variants if round_ % 2 == 0 else variants[::-1]):
            gc.collect()
            start = time.process_time()
            run(name)
            cpu[name].append(1000 * (time.process_time() - start) / steps)
    return {name: {"cpu_ms_per_step": statistics.median(runs),
                   "cpu_ms_runs": [round(r, 2) for r in runs]} for name, runs in cpu.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", choices=VARIANTS)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=None,
                        help="default all (kerasps and keras3 with --quick)")
    parser.add_argument("--spe", type=int, nargs="+", default=None,
                        help="default 1 10 (1 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="default 200 (20 with --quick)")
    parser.add_argument("--fits", type=int, default=None,
                        help="timed fits per process (default 5; 1 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: kerasps and keras3, spe 1, one timed fit of 20 steps")
    parser.add_argument("--repeats", type=int, default=1, help="processes per variant")
    parser.add_argument("--paired", help="comma-separated training-function variants")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.variants = args.variants or (["kerasps", "keras3"] if args.quick else list(VARIANTS))
    args.spe = args.spe or ([1] if args.quick else [1, 10])
    args.steps = args.steps or (20 if args.quick else 200)
    args.fits = args.fits or (1 if args.quick else 5)
    if args.paired:
        for spe in args.spe:
            for name, record in paired(spe, args.steps, args.fits,
                                       args.paired.split(",")).items():
                print(f"spe={spe:<3d} {name:15s} cpu {record['cpu_ms_per_step']:6.2f} ms/step "
                      f"{record['cpu_ms_runs']}", flush=True)
        print(f"load average {os.getloadavg()[0]:.2f}")
        return 0
    if args.one:
        record = run_variant(args.one, args.spe[0], args.steps, args.fits)
        print(PREFIX + json.dumps({"variant": args.one, "spe": args.spe[0], **record}),
              flush=True)
        return 0
    results, failed = [], 0
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    for repeat in range(args.repeats):
        for spe in args.spe:
            for variant in (args.variants if repeat % 2 == 0 else args.variants[::-1]):
                cmd = [sys.executable, os.path.abspath(__file__), "--one", variant, "--spe",
                       str(spe), "--steps", str(args.steps), "--fits", str(args.fits)]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                lines = [line for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
                if not lines:
                    print(f"{variant} spe={spe} FAILED:\n{proc.stderr[-2000:]}", flush=True)
                    failed += 1
                    continue
                record = json.loads(lines[-1][len(PREFIX):])
                results.append(record)
                print(f"{variant:15s} spe={spe:<3d} cpu {record['cpu_ms_per_step']:6.2f} "
                      f"ms/step {record['cpu_ms_runs']}  wall "
                      f"{record['wall_ms_per_step']:6.2f}  "
                      + ", ".join(f"{k} {v:.2f}" for k, v in record["groups"].items()
                                  if v >= 0.05), flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
