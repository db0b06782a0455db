"""Bytes on the wire and throughput on rate-limited links: kerasps on the network bench.

Every task runs in its own network namespace of `benchmarks.netbench` (so its interface
counters are exactly its traffic): `kerasps serve` in each worker and ps namespace, the
chief (this script with `--chief`) in its own, TF_CONFIG naming the namespaces' addresses.
Needs root.

`bytes`: the embedding workloads of `benchmarks/embedding_scaling.py`
(Embedding(vocab, 32) in 2 shards over 2 ps tasks, 3 ids per example, Flatten,
Dense(32), Dense(1), 2 workers, per-worker batch 64, steps_per_execution 10), one `fit`
per optimizer on the same cluster: the bytes each task sent and received during a timed
`fit`, per worker-step, against the bound: the touched rows x 32 x 4 B gathered and their
gradient sent, plus the dense weights read and their gradients sent.

`throughput`: worker-steps/s of an unbalanced dense model (one
1024x1024 kernel beside smaller ones, so that round_robin puts most bytes on one ps) at
a given ps link rate and number of workers, against the simulator's prediction.

    sudo python benchmarks/network.py bytes                       # 4 optimizers, ~4 min
    sudo python benchmarks/network.py bytes --optimizers sgd --steps 50
    sudo python benchmarks/network.py throughput --ps-rate 100mbit --ps 2
    sudo python benchmarks/network.py throughput --ps-rate 100mbit --workers 4 --spes 1
    sudo python benchmarks/network.py link --ps-rate 100mbit       # plain TCP, 1/2/4 flows
    sudo python benchmarks/network.py link --ps-rate 100mbit --both-ways   # and as many in
    python benchmarks/network.py --quick    # a smoke run: `predict` on the committed records,
                                            # and a 10-step `throughput` run where root can

`link`: the rate plain TCP flows (`benchmarks.netbench.transfer`, 12.5 MB each) reach out
of one ps task's rate-limited link to 1, 2 and 4 workers at once, with no training: what
the link itself gives, beside what `throughput` gets through it; with `--both-ways`, as
many flows from those workers into the ps task at the same time (reads and gradients).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmarks import netbench  # noqa: E402
from benchmarks.netbench import cluster as netbench_cluster  # noqa: E402

PORT = netbench_cluster.PORT
RESULT = "NETWORK_RESULT "
NUM_WORKERS = 2  # unless --workers says otherwise
BENCH_NAME = "net"
# The committed records `--quick` predicts from: the latest throughput set and the link runs.
RECORDS = os.path.join(ROOT, "benchmarks", "records")
QUICK_THROUGHPUT = "network_throughput_2026-11-26f.jsonl"
QUICK_LINKS = ("network_link_2026-11-26.jsonl", "network_link_2026-11-26e.jsonl")
QUICK_CHIEF = ["throughput", "--placements", "greedy", "--spes", "1", "--steps", "10",
               "--warmup", "4"]


# -- the chief (inside its namespace) --------------------------------------------------------
def _all_counters(spaces):
    return {ns: netbench.counters(ns) for ns in spaces}


def _delta(before, after):
    return {ns: {k: after[ns][k] - before[ns][k] for k in after[ns]} for ns in after}


def _dense_params(model):
    return sum(int(v.shape.num_elements()) for v in model.trainable_variables
               if "embedding" not in v.path)


def warmup_steps(spe: int, minimum: int, workers: int = 1) -> int:
    """Steps of a warm-up `fit` before a timed one: at least `minimum`, and 3 executions
    per worker (see `warm_up`).

    `fit` gives its first and last execution the function that returns logs and the
    executions between another function; a warm-up of 2 executions left that one to the
    timed `fit` to trace and send to each worker (~55 KiB, and the trace's time).
    """
    return max(minimum, 3 * spe * workers)


def warm_up(model, data, spe: int, minimum: int, attempts: int = 5) -> None:
    """Warm-up `fit`s of `warmup_steps(spe, minimum, workers)` steps, until every worker has run
    each function the timed `fit` runs.

    A worker sends its part of a function to each ps task the first time it runs it (one
    message of ~45 KB per ps task for the embedding workload); a worker that first ran
    one in the timed `fit` added that to its bytes. `fit` runs the function that returns
    logs in its first and last execution (in every one when a callback reads batch logs)
    and the other in those between: so a `fit` with a batch-level callback until every
    worker ran an execution, then plain ones until every worker ran 3 (at most 2 of which
    returned logs). Raises `RuntimeError` after `attempts` `fit`s of either kind.
    """
    import collections

    import keras

    import kerasps

    coordinator = kerasps.ClusterCoordinator(model.distribute_strategy)
    reads_logs = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None)
    for callbacks, executions in (([reads_logs], 1), ([], 3)):
        for _ in range(attempts):
            coordinator.start_trace()
            model.fit(data, epochs=1, verbose=0, callbacks=callbacks,
                      steps_per_epoch=warmup_steps(spe, minimum, coordinator.num_workers))
            ran = collections.Counter(event.worker for event in coordinator.stop_trace())
            if all(ran[worker] >= executions for worker in range(coordinator.num_workers)):
                break
        else:
            raise RuntimeError(f"After {attempts} warm-up `fit`s, some worker ran fewer than "
                               f"{executions} executions: {dict(ran)}.")


def chief_bytes(args, spaces):
    import embedding_scaling as es
    import keras

    import kerasps

    for optimizer in args.optimizers:
        strategy = es.kerasps_strategy(kerasps.cluster.from_tf_config(), optimizer, num_ps=2)
        with strategy.scope():
            model = es._compiled_model(keras, args.vocab, optimizer)
        data = kerasps.DatasetCreator(es._dataset_fn(args.vocab))
        warm_up(model, data, es.SPE, args.warmup)
        before, start = _all_counters(spaces), time.perf_counter()
        model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
        seconds = time.perf_counter() - start
        delta = _delta(before, _all_counters(spaces))
        rows = es.rows_per_worker_step(args.vocab) * es.DIM * 4
        dense = _dense_params(model) * 4
        print(RESULT + json.dumps({
            "mode": "bytes", "optimizer": optimizer, "vocab": args.vocab,
            "steps": args.steps, "spe": es.SPE, "steps_per_s": args.steps / seconds,
            "bound_rows_bytes": rows, "bound_dense_bytes": dense,
            "bound": 2 * (rows + dense), "counters": delta,
            "placement": [(r.name, r.bytes, r.ps_task) for r in
                          strategy.placement_report()]}), flush=True)


# Unbalanced: two 512x512 kernels (1 MiB each) with small biases between them; round_robin
# (creation order, kernel and bias alternating) puts both kernels on ps 0, greedy one on each.
UNBALANCED = (512, 512, 512)  # input, dense_1, dense_2 units


def _unbalanced_model(keras):
    layers = keras.layers
    return keras.Sequential([keras.Input(shape=(UNBALANCED[0],)),
                             layers.Dense(UNBALANCED[1], name="dense_1"),
                             layers.Dense(UNBALANCED[2], name="dense_2"),
                             layers.Dense(1, name="out")])


def chief_throughput(args, spaces):
    import keras
    import tensorflow as tf

    import kerasps

    def dataset_fn(input_context):
        x = tf.random.uniform([args.batch, UNBALANCED[0]])
        return tf.data.Dataset.from_tensors((x, tf.zeros([args.batch, 1]))).repeat()

    for placement in args.placements:
        for spe in args.spes:
            strategy = kerasps.ParameterServerStrategy(kerasps.cluster.from_tf_config(),
                                                       placement=placement)
            with strategy.scope():
                model = _unbalanced_model(keras)
                model.compile(keras.optimizers.SGD(0.001), "mse", steps_per_execution=spe)
            data = kerasps.DatasetCreator(dataset_fn)
            warm_up(model, data, spe, args.warmup)
            cpu_before = {ns: netbench.cpu_seconds(ns) for ns in spaces}
            before, start = _all_counters(spaces), time.perf_counter()
            model.fit(data, epochs=1, steps_per_epoch=args.steps, verbose=0)
            seconds = time.perf_counter() - start
            counters = _delta(before, _all_counters(spaces))
            cpu = {ns: netbench.cpu_seconds(ns) - cpu_before[ns] for ns in spaces}
            print(RESULT + json.dumps({
                "mode": "throughput", "placement": placement, "spe": spe,
                "steps": args.steps, "steps_per_s": args.steps / seconds, "seconds": seconds,
                "counters": counters, "cpu_s": cpu, "cpus": os.cpu_count(),
                "variables": [(r.name, r.bytes, r.ps_task)
                              for r in strategy.placement_report()]}), flush=True)


# -- plain TCP through a ps link ---------------------------------------------------------------
LINK_BYTES = 12_500_000
LINK_PORT = 5001


def link_rates(ps_rate, flows=(1, 2, 4), repeats=2, both_ways=False):
    """Rates (bits/s) of `flows` TCP transfers at once out of one ps task's link of
    `ps_rate` to as many workers (their links at 1 Gbit/s), and with `both_ways` as many
    from those workers into the ps task at the same time, as a training step's reads and
    gradients load the link; one record per run. A direction's rate: its bytes over the
    time from its first byte received to its last (the receivers' clocks are one)."""
    command = [sys.executable, "-m", "benchmarks.netbench.transfer"]
    records = []
    for count in flows:
        for _ in range(repeats):
            with netbench.Bench({"worker": count, "ps": 1}, rate="1gbit",
                                rates={"ps": ps_rate}, name=BENCH_NAME) as bench:
                # (direction, receiving task, sending task, port) of each flow
                plan = [("out", ("worker", i), ("ps", 0), LINK_PORT) for i in range(count)]
                if both_ways:
                    plan += [("in", ("ps", 0), ("worker", i), LINK_PORT + 1 + i)
                             for i in range(count)]
                receivers = [bench.popen(*to, [*command, "recv", "--port", str(port), "--bytes",
                                               str(LINK_BYTES)],
                                         stdout=subprocess.PIPE, text=True, cwd=ROOT)
                             for _, to, _, port in plan]
                for receiver in receivers:
                    if receiver.stdout.readline().strip() != "listening":
                        raise RuntimeError("a receiver did not start")
                senders = [bench.popen(*by, [*command, "send", "--host", bench.address(*to),
                                             "--port", str(port), "--bytes", str(LINK_BYTES)],
                                       stdout=subprocess.DEVNULL, cwd=ROOT)
                           for _, to, by, port in plan]
                for process in senders + receivers:
                    process.wait(timeout=120)
                results = [json.loads(r.stdout.read().strip().splitlines()[-1])
                           for r in receivers]
            record = {"mode": "link", "ps_rate": ps_rate, "flows": count,
                      "both_ways": both_ways}
            for direction in ("out", "in") if both_ways else ("out",):
                got = [r for (d, *_), r in zip(plan, results) if d == direction]
                span = max(r["last_at"] for r in got) - min(r["first_at"] for r in got)
                record[f"{direction}_bits_per_s"] = sum(r["bytes"] for r in got) * 8 / span
                record[f"{direction}_flow_bits_per_s"] = [r["bytes"] * 8 / r["seconds"]
                                                          for r in got]
            records.append(record)
            print(f"  {count} flow(s) out" + (f" and {count} in" if both_ways else "") + ": "
                  + ", ".join(f"{d} {record[f'{d}_bits_per_s'] / 1e6:.1f} Mbit/s"
                              for d in ("out", "in") if f"{d}_bits_per_s" in record),
                  flush=True)
    return records


# -- the simulator's prediction ---------------------------------------------------------------
def read_records(paths, mode):
    """The records of `mode` ("throughput", "link", ...) in the JSON-lines files `paths`."""
    records = []
    for path in paths:
        with open(path) as f:
            records += [r for r in map(json.loads, f) if r["mode"] == mode]
    return records


def _config(record):
    """(ps link rate, ps tasks, placement, steps_per_execution, workers) of a record."""
    return (record["ps_rate"] or record["rate"], record["ps"], record["placement"], record["spe"],
            record.get("workers", NUM_WORKERS))


# The link models compared: (name, `[network] duplex`, `[network] sharing`), and with link
# records, `LOADED` (its `duplex_efficiency` measured by `link --both-ways`).
MODELS = (("half duplex", "half", "queue"), ("full duplex", "full", "queue"),
          ("full duplex, fair", "full", "fair"))
LOADED = ("full duplex, loaded both ways", "full", "queue")
# `LOADED` whose workers' own links carry their steps too (`[network] worker_bandwidth`).
WORKER_LINKS = ("loaded both ways, worker links", "full", "queue")


def duplex_efficiencies(link_records):
    """Per ps link rate, the shares of its one-way rate a direction of the link keeps while
    the other direction carries data too, one per `link --both-ways` run: the run's slower
    direction (both carry a step's bytes, so the slower sets the pace) over the median of
    the one-way runs, at most 1, sorted. The simulator draws each transfer's share from
    them. Rates without both kinds of run are left out."""
    efficiencies = {}
    for rate in {r["ps_rate"] for r in link_records}:
        runs = [r for r in link_records if r["ps_rate"] == rate]
        both = [min(r["out_bits_per_s"], r["in_bits_per_s"]) for r in runs if r["both_ways"]]
        one = [r["out_bits_per_s"] for r in runs if not r["both_ways"]]
        if both and one:
            efficiencies[rate] = sorted(min(1.0, b / statistics.median(one)) for b in both)
    return efficiencies


def _scenario(record, step_time, overhead, duplex, sharing="queue", efficiencies=None,
              worker_links=False):
    """The simulator's scenario (a dict) of `record`'s run: its variables (as the placement report
    names them, in creation order) placed by the same policy, its workers of constant step
    time, ps links of the record's rate less the framing `overhead` (wire / variable bytes),
    ps contention, no latency, the link model `duplex` and `sharing`, and with
    `efficiencies` (per rate, `duplex_efficiencies`' shares or one number) the loss of a
    link loaded both ways (none at a rate not measured); with `worker_links`, each
    worker's own link too, at the record's `rate` (the bench gives every link that rate
    but the ps links), which every byte of the worker's step crosses besides a ps link
    (its loss taken as the ps links')."""
    rate = record["ps_rate"] or record["rate"]
    bandwidth = netbench.parse_rate(rate) / 8 / overhead
    efficiency = (efficiencies or {}).get(rate, 1.0)
    if isinstance(efficiency, list):  # each transfer draws its own
        efficiency = {"distribution": "empirical", "samples": efficiency}
    worker = {}
    if worker_links:
        worker = {"worker_bandwidth": netbench.parse_rate(record["rate"]) / 8 / overhead}
    return {
        "name": "netbench", "seed": 0,
        "workers": {"count": record.get("workers", NUM_WORKERS),
                    "step_time": {"distribution": "constant", "value": step_time}},
        "ps": {"count": record["ps"], "contention": True},
        "network": {"bandwidth": bandwidth, "latency": 0.0, "duplex": duplex,
                    "sharing": sharing,
                    "duplex_efficiency": efficiency, **worker},
        "training": {"mode": "async", "steps": 400},
        "model": {"placement": record["placement"],
                  "variables": [{"name": name, "shape": [max(1, nbytes // 4)]}
                                for name, nbytes, _ in record["variables"]]}}


# A scenario's JSON -> the steps/s the simulator ran it at: a calibration's bisection and
# the tables of several record sets run the same scenarios again (seeded: the same result).
_SIMULATED: dict = {}


def _simulate(record, step_time, overhead, duplex, sharing="queue", efficiencies=None,
              worker_links=False):
    import simulator

    scenario = _scenario(record, step_time, overhead, duplex, sharing, efficiencies,
                         worker_links)
    key = json.dumps(scenario, sort_keys=True)
    if key not in _SIMULATED:
        _SIMULATED[key] = simulator.run(
            simulator.Scenario.from_dict(scenario)).steps_per_second
    return _SIMULATED[key]


def _overhead(record):
    """Bytes the ps tasks sent per worker-step over the variable bytes they hold."""
    sent = sum(c["tx_bytes"] for ns, c in record["counters"].items() if "-ps-" in ns)
    return sent / record["steps"] / sum(nbytes for _, nbytes, _ in record["variables"])


def calibrate(record, duplex, sharing="queue", efficiencies=None, worker_links=False):
    """The constant step time (compute and everything off the ps links) for which the
    simulator reproduces `record`'s throughput, with its measured framing overhead."""
    overhead = _overhead(record)
    lo, hi = 1e-5, 10.0
    for _ in range(24):  # throughput falls as the step time grows: bisect (geometrically;
        # 24 halvings of 1e-5..10 s: within a relative 1e-6, far below what a table shows)
        mid = (lo * hi) ** 0.5
        if _simulate(record, mid, overhead, duplex, sharing,
                     efficiencies, worker_links) > record["steps_per_s"]:
            lo = mid
        else:
            hi = mid
    return (lo * hi) ** 0.5, overhead


def cpu_busy(record):
    """The share of the machine's cores that every task of a run kept busy together during
    its timed `fit`, or `None` for a record made before the bench measured CPU."""
    if "cpu_s" not in record:
        return None
    return sum(record["cpu_s"].values()) / record["seconds"] / record["cpus"]


def _merged(records):
    """One record per configuration: the first run's, with the median steps/s of its runs
    (`runs`: each run's steps/s) and `busy`: the median of their `cpu_busy`, or `None`."""
    groups: dict = {}
    for r in records:
        groups.setdefault(_config(r), []).append(r)
    merged = []
    for runs in groups.values():
        rates = [r["steps_per_s"] for r in runs]
        busy = [cpu_busy(r) for r in runs]
        merged.append({**runs[0], "runs": rates, "steps_per_s": statistics.median(rates),
                       "busy": None if None in busy else statistics.median(busy)})
    return sorted(merged, key=lambda r: (-netbench.parse_rate(_config(r)[0]), *_config(r)[1:]))


def predict_table(records, calibration, models=MODELS, links=None):
    """A markdown table of `records`' measured throughput beside the simulator's, for each
    link model of `models`, calibrated on the configuration `calibration` (ps link rate,
    ps tasks, placement, steps_per_execution, workers); with `links` (records of `link`
    runs), also the model `LOADED`, whose links lose what `duplex_efficiencies` measured in
    them, and `WORKER_LINKS`: `LOADED` with each worker's own link carrying its steps'
    bytes too; the last row: each model's largest error over the rows other than the
    calibration's. The last column: how busy the run kept the machine's cores (`cpu_busy`),
    which no model has: a row near 100% is paced by the CPU, not by its links."""
    records = _merged(records)
    base = [r for r in records if _config(r) == calibration]
    if not base:
        raise SystemExit(f"no record of the calibration configuration {calibration}; "
                         f"have {[_config(r) for r in records]}")
    efficiencies = duplex_efficiencies(links) if links else {}
    models = [(*m, None, False) for m in models] + (
        [(*LOADED, efficiencies, False), (*WORKER_LINKS, efficiencies, True)] if links else [])
    fits = {name: calibrate(base[0], duplex, sharing, loss, own)
            for name, duplex, sharing, loss, own in models}
    steps = " / ".join(f"{fits[name][0] * 1000:.1f} ms ({name})" for name, *_ in models)
    measured = "; ".join(f"{rate} links keep {statistics.median(e):.3f} of their rate each "
                         f"way when loaded both ways ({min(e):.2f}-{max(e):.2f} in "
                         f"{len(e)} `link --both-ways` runs, each transfer drawing one)"
                         for rate, e in sorted(efficiencies.items()))
    measured += "; other rates none" if measured else ""
    lines = [f"Calibrated on {calibration[0]}, {calibration[1]} ps, {calibration[2]}, "
             f"spe {calibration[3]}, {calibration[4]} workers: "
             f"framing overhead {fits[models[0][0]][1]:.3f}, "
             f"step time {steps}." + (f" {measured[0].upper()}{measured[1:]}." if measured
                                      else ""), "",
             "| ps link | ps tasks | workers | placement | spe "
             "| bytes out of the busiest ps KiB/step "
             "| measured steps/s (runs) | "
             + " | ".join(f"simulator, {name} | error" for name, *_ in models)
             + " | cores busy |",
             "|---|---:|---:|---|---:|---:|---:|" + "---:|---:|" * len(models) + "---:|"]
    worst = dict.fromkeys(fits, 0.0)
    at_calibration = {}  # each model's prediction of the calibration run
    for r in records:
        rate, num_ps, placement, spe, workers = _config(r)
        is_calibration = _config(r) == calibration
        busiest = max(c["tx_bytes"] for ns, c in r["counters"].items() if "-ps-" in ns)
        cells = []
        for name, duplex, sharing, loss, own in models:
            step_time, overhead = fits[name]
            predicted = _simulate(r, step_time, overhead, duplex, sharing, loss, own)
            error = predicted / r["steps_per_s"] - 1
            if is_calibration:
                at_calibration[name] = predicted
            else:
                worst[name] = max(worst[name], abs(error))
            cells.append(f"{predicted:.2f} | {error:+.0%}")
        mark = " (calibration)" if is_calibration else ""
        runs = ", ".join(f"{x:.2f}" for x in r["runs"])
        busy = "" if r["busy"] is None else f"{r['busy']:.0%}"
        lines.append(f"| {rate} | {num_ps} | {workers} | {placement}{mark} "
                     f"| {spe} | {busiest / r['steps'] / 1024:.0f} "
                     f"| {r['steps_per_s']:.2f} ({runs}) | {' | '.join(cells)} | {busy} |")
    lines.append("| largest error, other rows | | | | | | | "
                 + " | ".join(f" | {worst[name]:.0%}" for name, *_ in models) + " | |")
    for name, *_ in models:
        fastest = at_calibration[name]
        if fastest < 0.99 * base[0]["steps_per_s"]:
            lines.append(f"\n{name}: even with no step time the model gives {fastest:.2f} "
                         f"steps/s, below the calibration run's {base[0]['steps_per_s']:.2f}: "
                         "its links alone are slower than the measured ones.")
    return "\n".join(lines)


# -- the driver ------------------------------------------------------------------------------
def run_cluster(args, chief_args, num_ps, rate, rates=None, during=None):
    """Brings the bench up, starts the servers and the chief; returns the chief's records."""
    env = netbench_cluster.environment()
    tasks = {"chief": 1, "worker": args.workers, "ps": num_ps}
    sysctls = dict(item.split("=", 1) for item in args.sysctl)
    with netbench.Bench(tasks, rate=rate, rates=rates, name=BENCH_NAME,
                        sysctls=sysctls) as bench:
        netbench_cluster.start_servers(bench, PORT)
        spaces = [t.namespace for t in bench.tasks.values()]
        chief = bench.popen("chief", 0, [sys.executable, os.path.abspath(__file__), "--chief",
                                         *chief_args],
                            env={**env, "TF_CONFIG": bench.tf_config("chief", 0, PORT),
                                 "NETBENCH_SPACES": json.dumps(spaces)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if during:
            during(bench)
        records, tail = [], []
        for line in chief.stdout:
            if line.startswith(RESULT):
                records.append(json.loads(line[len(RESULT):]))
                print(f"  {_summary(records[-1])}", flush=True)
            else:
                tail = (tail + [line.rstrip()])[-30:]
        if chief.wait(timeout=args.timeout) != 0:
            raise RuntimeError(f"the chief exited with {chief.returncode}:\n" + "\n".join(tail))
        return records


def _summary(record):
    if record["mode"] == "bytes":
        return (f"{record['optimizer']:9s} {record['steps_per_s']:6.1f} steps/s  "
                f"{_wire_per_step(record) / 1024:6.1f} KiB on the wire per worker-step, "
                f"bound {record['bound'] / 1024:.1f} KiB")
    ps = sorted((ns.rsplit("-", 2)[-2] + ns.rsplit("-", 1)[-1], c)  # "ps0": its counters
                for ns, c in record["counters"].items() if "-ps-" in ns)
    line = (f"{record['placement']:11s} spe={record['spe']:<3d} "
            f"{record['steps_per_s']:7.2f} steps/s  ps tx KiB/step "
            + " ".join(f"{k}={c['tx_bytes'] / record['steps'] / 1024:.0f}" for k, c in ps))
    if all("tcp_out_segs" in c for _, c in ps):  # records from before the TCP counters have none
        line += "  ps TCP segments retransmitted " + " ".join(
            f"{k}={c['tcp_retrans_segs'] / max(1, c['tcp_out_segs']):.2%}" for k, c in ps)
    return line


def _by_kind(record, kind, field):
    return sum(c[field] for ns, c in record["counters"].items()
               if ns.split("-")[2] == kind) / record["steps"]


def _wire_per_step(record):
    """Every byte is counted once, at its sender."""
    return sum(c["tx_bytes"] for c in record["counters"].values()) / record["steps"]


HEADERS = 66  # bytes per packet: Ethernet 14, IPv4 20, TCP 32 (with timestamps)


def _payload_per_step(record):
    """The bytes on the wire less the Ethernet, IP and TCP headers of every packet."""
    return sum(c["tx_bytes"] - HEADERS * c["tx_packets"]
               for c in record["counters"].values()) / record["steps"]


def bytes_table(records):
    lines = ["| optimizer | steps/s | worker rx / tx KiB | ps rx / tx KiB | chief rx / tx KiB "
             "| on the wire KiB | bound KiB (rows + dense, each way) | workers' rx+tx / bound "
             "| on the wire / bound | TCP payload / bound |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        k = {kind: (_by_kind(r, kind, "rx_bytes") / 1024, _by_kind(r, kind, "tx_bytes") / 1024)
             for kind in ("worker", "ps", "chief")}
        bound = r["bound"] / 1024
        lines.append(
            f"| {r['optimizer']} | {r['steps_per_s']:.1f} "
            f"| {k['worker'][0]:.1f} / {k['worker'][1]:.1f} "
            f"| {k['ps'][0]:.1f} / {k['ps'][1]:.1f} | {k['chief'][0]:.2f} / {k['chief'][1]:.2f} "
            f"| {_wire_per_step(r) / 1024:.1f} "
            f"| {bound:.1f} ({r['bound_rows_bytes'] / 1024:.1f} + "
            f"{r['bound_dense_bytes'] / 1024:.1f}) "
            f"| {sum(k['worker']) / bound:.2f} | **{_wire_per_step(r) / 1024 / bound:.2f}** "
            f"| {_payload_per_step(r) / 1024 / bound:.2f} |")
    return "\n".join(lines)


def quick() -> int:
    """`--quick`: the prediction table of the committed records, then a tiny measured run
    where the bench can be built (root, `ip netns`, `tc`)."""
    records = read_records([os.path.join(RECORDS, QUICK_THROUGHPUT)], "throughput")
    links = read_records([os.path.join(RECORDS, name) for name in QUICK_LINKS], "link")
    print(f"# network.py --quick: predict on {QUICK_THROUGHPUT}")
    print(predict_table(records, ("1gbit", 2, "greedy", 1, NUM_WORKERS), links=links))
    reason = netbench.available()
    if reason:
        print(f"\nnetwork.py --quick: no measured run ({reason})")
        return 0
    args = argparse.Namespace(workers=NUM_WORKERS, sysctl=[], timeout=600)
    print(f"\n# network.py --quick: {' '.join(QUICK_CHIEF)} (2 workers, 2 ps, links 1gbit)",
          flush=True)
    measured = run_cluster(args, QUICK_CHIEF, 2, "1gbit")
    print(f"network.py --quick: {len(measured)} throughput record(s), not written")
    return 0 if measured else 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", choices=("bytes", "throughput", "predict", "link"))
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run, no mode: `predict` on the committed records, then "
                             "(with root and `ip netns`) a 10-step `throughput` run of one "
                             "configuration, written nowhere")
    parser.add_argument("--chief", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--optimizers", nargs="+",
                        default=["sgd", "adagrad", "adam", "lazy_adam"])
    parser.add_argument("--vocab", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=None,
                        help="timed worker-steps (default 200 bytes, 60 throughput)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rate", default="1gbit", help="every link's rate")
    parser.add_argument("--ps-rate", default=None, help="the ps links' rate (throughput)")
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=NUM_WORKERS, help="throughput")
    parser.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                        help="a sysctl set in every task's namespace (repeatable)")
    parser.add_argument("--both-ways", action="store_true",
                        help="link: as many flows into the ps task as out of it, at once")
    parser.add_argument("--placements", nargs="+", default=["round_robin", "greedy"])
    parser.add_argument("--spes", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", help="append the records to this file (JSON lines); "
                        "with predict, the throughput records to read")
    parser.add_argument("--links", help="predict: records of `link` runs (JSON lines; "
                        "several files comma-separated), for the models of links loaded "
                        "both ways")
    parser.add_argument("--calibrate", default="1gbit,2,greedy,1",
                        help="predict: the configuration the simulator is calibrated on "
                        "(ps link rate, ps tasks, placement, steps_per_execution[, workers])")
    args = parser.parse_args(argv)
    if args.quick:
        return quick()
    if args.mode is None:
        parser.error("a mode is needed (or --quick)")
    args.steps = args.steps or (200 if args.mode == "bytes" else 60)

    if args.mode == "predict":
        records = read_records(args.json.split(","), "throughput")
        rate, num_ps, placement, spe, *workers = args.calibrate.split(",")
        links = read_records(args.links.split(","), "link") if args.links else None
        print(predict_table(records, (rate, int(num_ps), placement, int(spe),
                                      int(workers[0]) if workers else NUM_WORKERS),
                            links=links))
        return 0
    if args.chief:
        spaces = json.loads(os.environ["NETBENCH_SPACES"])
        (chief_bytes if args.mode == "bytes" else chief_throughput)(args, spaces)
        return 0
    reason = netbench.available()
    if reason:
        print(f"network.py: {reason}", file=sys.stderr)
        return 2
    if args.mode == "link":
        print(f"# network.py link: plain TCP out of{' and into' if args.both_ways else ''} a ps "
              f"link of {args.ps_rate or args.rate}; "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
        records = link_rates(args.ps_rate or args.rate, both_ways=args.both_ways)
        if args.json:
            with open(args.json, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        return 0
    chief_args = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json"]
    if args.json:
        chief_args = [a for a in chief_args if a != args.json]
    num_ps = 2 if args.mode == "bytes" else args.ps
    rates = {"ps": args.ps_rate} if args.ps_rate else None
    print(f"# network.py {args.mode}: {args.workers} workers, {num_ps} ps, links {args.rate}"
          + (f", ps links {args.ps_rate}" if args.ps_rate else "")
          + f"; load average {os.getloadavg()[0]:.1f}", flush=True)
    records = run_cluster(args, chief_args, num_ps, args.rate, rates)
    for r in records:
        r.update(rate=args.rate, ps_rate=args.ps_rate, ps=num_ps, workers=args.workers,
                 load_after=os.getloadavg()[0])
    if args.mode == "bytes":
        print(bytes_table(records))
    if args.json:
        with open(args.json, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
