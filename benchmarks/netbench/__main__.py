"""`python -m benchmarks.netbench up|down|status|cut`: the network bench from a shell.

    python -m benchmarks.netbench up --tasks chief=1,worker=2,ps=2 --rate 100mbit
    ip netns exec kps-nb-ps-0 env TF_CONFIG=... kerasps serve      # run tasks inside
    python -m benchmarks.netbench status
    python -m benchmarks.netbench cut worker 0 --seconds 5
    python -m benchmarks.netbench down          # also cleans a crashed run's leftovers
    python -m benchmarks.netbench down --all    # every kps-* namespace

`up --hold` keeps the bench up until Ctrl-C or SIGTERM, then tears it down.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

from benchmarks import netbench


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.netbench",
                                     description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="create the namespaces, the bridge and the links")
    up.add_argument("--tasks", default="chief=1,worker=2,ps=2")
    up.add_argument("--rate", default="1gbit", help="every link's rate ('none': no limit)")
    up.add_argument("--ps-rate", help="the ps tasks' links' rate, when not --rate")
    up.add_argument("--hold", action="store_true",
                    help="stay up until Ctrl-C or SIGTERM, then tear everything down")
    down = commands.add_parser("down", help="end the processes inside, delete the namespaces")
    down.add_argument("--all", action="store_true", help="every kps-* namespace, any bench")
    cut = commands.add_parser("cut", help="take a task's link down for a while")
    cut.add_argument("kind")
    cut.add_argument("index", type=int)
    cut.add_argument("--seconds", type=float, default=5.0)
    status = commands.add_parser("status", help="the bench's namespaces and counters")
    for sub in (up, down, cut, status):
        sub.add_argument("--name", default=netbench.DEFAULT_NAME)
    args = parser.parse_args(argv)

    if args.command == "down":
        gone = netbench.down(None if args.all else args.name)
        print(f"netbench: deleted {len(gone)} namespaces" + (f": {' '.join(gone)}" if gone
                                                              else ""))
        return 0
    if args.command == "status":
        spaces = netbench.leftovers(args.name)
        for ns in spaces:
            if ns.endswith("-br"):
                print(f"{ns:24s} bridge")
                continue
            try:
                print(f"{ns:24s} {json.dumps(netbench.counters(ns))}")
            except Exception as e:  # noqa: BLE001 - a half-built leftover
                print(f"{ns:24s} ({e})")
        if not spaces:
            print(f"netbench: bench {args.name!r} is not up")
        return 0 if spaces else 1

    reason = netbench.available()
    if reason:
        print(f"netbench: {reason}", file=sys.stderr)
        return 2
    if args.command == "cut":
        tasks = {}
        for ns in netbench.leftovers(args.name):
            parts = ns[len(netbench.PREFIX) + len(args.name) + 1:].rsplit("-", 1)
            if len(parts) == 2 and parts[1].isdigit():
                tasks[parts[0]] = max(tasks.get(parts[0], 0), int(parts[1]) + 1)
        if not tasks:
            print(f"netbench: bench {args.name!r} is not up", file=sys.stderr)
            return 1
        bench = netbench.Bench(tasks, name=args.name)  # names only: it is already up
        bench.cut(args.kind, args.index, args.seconds)
        print(f"netbench: {args.kind} {args.index}'s link was down {args.seconds:g} s")
        return 0

    rates = {"ps": args.ps_rate} if args.ps_rate else None
    bench = netbench.Bench(args.tasks, rate=args.rate, rates=rates, name=args.name)
    if not args.hold:
        try:
            bench.up()
        except RuntimeError as e:
            bench.down()
            print(f"netbench: {e}", file=sys.stderr)
            return 1
        except BaseException:
            bench.down()
            raise
        print("\n".join(bench.describe()))
        print(f"netbench: up; `python -m benchmarks.netbench down --name {args.name}` "
              "tears it down")
        return 0
    with bench:
        print("\n".join(bench.describe()))
        print("netbench: up; Ctrl-C or SIGTERM tears it down", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    print("netbench: down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
