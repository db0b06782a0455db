"""A plain TCP transfer, to measure a bench link: `recv` in one namespace, `send` in another.

    python -m benchmarks.netbench.transfer recv --port 5001 --bytes 12500000
    python -m benchmarks.netbench.transfer send --host 10.77.0.2 --port 5001 --bytes 12500000

`recv` prints `listening` once it accepts connections, `first-byte` when data starts, and
at the end one JSON line: `{"bytes": ..., "seconds": ..., "first_at": ..., "last_at": ...}`,
the seconds from the first byte received to the last (the link's steady rate, not the
connection's setup) and those two instants (`time.time()`: the bench's namespaces share the
clock, so flows received in several of them can be put on one time line).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

CHUNK = 1 << 16


def recv(port: int, nbytes: int, timeout: float) -> dict:
    with socket.create_server(("0.0.0.0", port)) as server:
        server.settimeout(timeout)
        print("listening", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout)
            got, first, last = 0, None, None
            while got < nbytes:
                data = conn.recv(CHUNK)
                if not data:
                    break
                last = time.time()
                if first is None:
                    first = last
                    print("first-byte", flush=True)
                got += len(data)
    return {"bytes": got, "seconds": (last - first) if first is not None else 0.0,
            "first_at": first, "last_at": last}


def send(host: str, port: int, nbytes: int, timeout: float) -> dict:
    payload = b"\0" * CHUNK
    start = time.perf_counter()
    with socket.create_connection((host, port), timeout=timeout) as conn:
        sent = 0
        while sent < nbytes:
            sent += conn.send(payload[:min(CHUNK, nbytes - sent)])
    return {"bytes": sent, "seconds": time.perf_counter() - start}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("recv", "send"))
    parser.add_argument("--host", default="")
    parser.add_argument("--port", type=int, default=5001)
    parser.add_argument("--bytes", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    if args.mode == "recv":
        result = recv(args.port, args.bytes, args.timeout)
    else:
        result = send(args.host, args.port, args.bytes, args.timeout)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
