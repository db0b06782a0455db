"""Simulator speed: simulated worker-steps per wall-clock second.

    python benchmarks/simulator_speed.py [--quick]

Runs async and sync training with exponential step times at 10, 100 and 1000
workers, 1000 worker-steps per worker (1e6 worker-steps at 1000 workers),
prints a table, and checks that cost is linear in worker-steps: the wall time
per worker-step at 1000 workers is within 2x of that at 10 workers. Target:
the 1000-worker runs take under 30 s each.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import simulator  # noqa: E402

TARGET_SECONDS = 30.0
LINEARITY = 2.0


def scenario(mode: str, workers: int, steps_per_worker: int) -> simulator.Scenario:
    steps = workers * steps_per_worker if mode == "async" else steps_per_worker
    return simulator.Scenario.from_dict({
        "name": f"{mode}-{workers}",
        "workers": {"count": workers, "step_time": {"distribution": "exponential", "rate": 1.0}},
        "training": {"mode": mode, "steps": steps}})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 100 steps per worker, targets not checked")
    args = parser.parse_args(argv)
    steps_per_worker = 100 if args.quick else 1000
    print(f"{'mode':<6} {'workers':>8} {'worker-steps':>13} {'wall s':>8} "
          f"{'worker-steps/s':>15} {'us/worker-step':>15}")
    simulator.run(scenario("sync", 10, 10))  # warm up imports and caches
    cost, ok = {}, True
    for mode in ("async", "sync"):
        for workers in (10, 100, 1000):
            s = scenario(mode, workers, steps_per_worker)
            start = time.perf_counter()
            result = simulator.run(s)
            wall = time.perf_counter() - start
            cost[mode, workers] = wall / result.worker_steps
            print(f"{mode:<6} {workers:>8} {result.worker_steps:>13,} {wall:>8.2f} "
                  f"{result.worker_steps / wall:>15,.0f} {1e6 * cost[mode, workers]:>15.2f}")
            if workers == 1000 and not args.quick and wall > TARGET_SECONDS:
                print(f"  FAIL: over the {TARGET_SECONDS:.0f} s target")
                ok = False
    for mode in ("async", "sync"):
        ratio = cost[mode, 1000] / cost[mode, 10]
        verdict = "ok" if ratio < LINEARITY else "NOT LINEAR"
        print(f"{mode}: cost per worker-step at 1000 vs 10 workers: {ratio:.2f}x ({verdict})")
        ok &= ratio < LINEARITY
    if args.quick:  # runs of a few milliseconds: too short to time, the targets not checked
        print("quick run: targets not checked")
        return 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
