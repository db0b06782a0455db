"""The command line: `python -m simulator run|sweep|calibrate ...`."""

from __future__ import annotations

import argparse
import json
import sys

from simulator.errors import ScenarioError
from simulator.scenario import load_scenario, parse_value

__all__ = ["main"]


def _overrides(pairs, flag: str) -> dict:
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ScenarioError(f"Invalid value for `{flag}`: expected KEY=VALUE. "
                                f"Received: {flag} {pair}")
        out[key] = value
    return out


def _run(args) -> int:
    from simulator import plots
    from simulator.perfetto import to_perfetto
    from simulator.simulation import run

    scenario = load_scenario(args.scenario)
    overrides = {k: parse_value(v) for k, v in _overrides(args.set, "--set").items()}
    given = [f"--set {pair}" for pair in args.set or []]
    if args.seed is not None:
        overrides["seed"] = args.seed
        given.append(f"--seed {args.seed}")
    if overrides:
        scenario = scenario.with_overrides(overrides, source=" ".join(given))
    result = run(scenario, record_events=args.trace is not None)
    print(result)
    if args.json:
        _wrote(result.to_json, args.json)
    if args.csv:
        _wrote(result.to_csv, args.csv)
    if args.trace:
        _wrote(lambda path: to_perfetto(result, path), args.trace)
    if args.plot:
        _wrote(plots.plot_result(result).savefig, args.plot)
    return 0


def _wrote(write, path) -> None:
    """Writes `path` with `write(path)` and says so: one "wrote PATH" line per file."""
    write(path)
    print(f"wrote {path}")


def _sweep(args) -> int:
    from simulator import plots
    from simulator.metrics import metric_names
    from simulator.sweep import sweep, sweep_csv, sweep_rows, sweep_table

    scenario = load_scenario(args.scenario)
    vary = {k: [parse_value(v) for v in values.split(",")]
            for k, values in _overrides(args.vary, "--vary").items()}
    if not vary:
        raise ScenarioError("Invalid value for `--vary`: give at least one KEY=V1,V2,... "
                            "Received: no --vary")
    num_ps = max([scenario.ps.count] + [v for v in vary.get("ps.count", [])
                                        if isinstance(v, int)])
    names = metric_names(num_ps)
    if args.metric not in names:
        raise ScenarioError(f"Invalid value for `--metric`: expected one of {names}. "
                            f"Received: --metric {args.metric}")
    points = sweep(scenario, vary, repeats=args.repeats, source="--vary")
    rows = sweep_rows(points)
    print(sweep_table(rows, list(vary) + (["seed"] if args.repeats > 1 else []),
                      _sweep_columns(rows)))
    if args.csv:
        _wrote(lambda path: sweep_csv(points, path), args.csv)
    if args.json:
        _wrote(lambda path: _write_json(points, path), args.json)
    if args.plot:
        _wrote(plots.plot_sweep(points, x=list(vary)[0], y=args.metric).figure.savefig,
               args.plot)
    return 0


def _write_json(points, path) -> None:
    with open(path, "w") as f:
        json.dump([{**p.overrides, **json.loads(p.result.to_json())} for p in points], f,
                  indent=2)


def _sweep_columns(rows: list[dict]) -> list[str]:
    """The sweep table's metrics: the headline ones, and those that vary from zero where
    the scenario has them (staleness in async runs, failures, unfinished runs)."""
    columns = ["steps_per_second", "examples_per_second", "goodput", "applied_fraction",
               "global_step_interval.p50", "global_step_interval.p99"]
    if any(not row["finished"] for row in rows):
        columns.insert(0, "finished")
    if any(row["rolled_back_steps"] for row in rows):
        columns.append("rolled_back_steps")
    if any(row["staleness.count"] for row in rows):
        columns.append("staleness.mean")
    return columns


def _calibrate(args) -> int:
    from simulator.calibrate import calibrate, predict_throughput

    cpus = args.cpus if args.cpus in (None, "auto") else int(args.cpus)
    cores = args.cores_per_step if args.cores_per_step == "all" else int(args.cores_per_step)
    model = calibrate(args.trace if len(args.trace) == 1 else args.trace, cpus=cpus,
                      latency=args.latency, cores_per_step=cores)
    print(model.report())
    workers = [int(w) for w in args.predict.split(",")] if args.predict else []
    for w in workers:
        print(f"predicted steps/s with {w} workers: {predict_throughput(model, w):.3f}")
    scenario = model.scenario(args.workers)
    if args.output:
        with open(args.output, "w") as f:
            f.write(scenario.to_toml())
        print(f"wrote {args.output}")
    else:
        print("\n# calibrated scenario\n" + scenario.to_toml())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m simulator",
                                     description="Simulate parameter-server training.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run one scenario")
    p.add_argument("scenario", help="scenario TOML file")
    p.add_argument("--seed", type=int, help="override the scenario's seed")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a key, e.g. --set training.backup_workers=2")
    p.add_argument("--json", help="write the summary as JSON")
    p.add_argument("--csv", help="write the summary as a one-row CSV")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace (JSON)")
    p.add_argument("--plot", help="write a summary figure (PNG, SVG, PDF): progress, a "
                                  "log-scaled step-time histogram, and staleness and ps "
                                  "load where the scenario has them")
    p.set_defaults(func=_run)

    p = sub.add_parser("sweep", help="run a scenario for several values of some keys")
    p.add_argument("scenario", help="scenario TOML file")
    p.add_argument("--vary", action="append", metavar="KEY=V1,V2,...", required=True,
                   help="values of a key; several --vary make a grid")
    p.add_argument("--repeats", type=int, default=1, help="runs per point, seeds seed+i")
    p.add_argument("--csv", help="write one row per run")
    p.add_argument("--json", help="write one object per run")
    p.add_argument("--plot", help="plot --metric against the first --vary key (PNG, SVG, "
                                  "PDF; a line per value of any other --vary key)")
    p.add_argument("--metric", default="steps_per_second",
                   help="metric to plot: a numeric key of the run's flat summary, e.g. "
                        "steps_per_second, goodput, applied_fraction, "
                        "global_step_interval.p99 (checked before anything runs)")
    p.set_defaults(func=_sweep)

    p = sub.add_parser("calibrate", help="fit the step-time model to kerasps traces")
    p.add_argument("trace", nargs="+", help="trace CSV(s) from kerasps; several traces at "
                                            "different worker counts fit the latency too")
    p.add_argument("--cpus", help='cores the workers shared (in-process run), or "auto"; '
                                  "omit for one machine per worker")
    p.add_argument("--latency", type=float, help="fixed off-CPU seconds per step function")
    p.add_argument("--cores-per-step", default="1",
                   help='cores one step function can use at once, or "all" (TensorFlow '
                        'steps use intra-op threads: "all" suits in-process kerasps runs)')
    p.add_argument("--workers", type=int, help="workers in the written scenario")
    p.add_argument("--predict", metavar="W1,W2,...", help="print predicted steps/s")
    p.add_argument("--output", "-o", help="write the calibrated scenario TOML here")
    p.set_defaults(func=_calibrate)
    return parser


def main(argv=None) -> int:
    """Entry point; returns the exit status (2 for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ScenarioError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
