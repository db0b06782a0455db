"""A network test bench: every task in its own Linux network namespace, rate-limited links.

Each task (`chief`, `worker`, `ps`, ...) gets a namespace `kps-<name>-<type>-<index>`
holding a loopback and one interface, `eth0`, with a private address of
`10.77.0.0/24`; its veth peer sits in the bench's bridge namespace `kps-<name>-br`,
enslaved to one bridge that connects only the bench's own namespaces: no uplink, no
route out of them (a task's only route is the bench's subnet), no address outside it.
Each link is rate-limited with the `tbf` queueing discipline on the egress of both veth
ends (the task's upload on `eth0`, its download on the bridge side), so a task has a
full-duplex link of the given rate. IPv6 is off in every namespace: nothing but the
tasks' own traffic crosses a link, so the interface counters are the tasks' bytes.

    with netbench.Bench({"chief": 1, "worker": 2, "ps": 2}, rate="100mbit") as bench:
        bench.address("ps", 0)                  # "10.77.0.4"
        bench.tf_config("worker", 0, port=2222)  # TF_CONFIG with the namespaces' addresses
        proc = bench.popen("worker", 0, ["python", "-m", "kerasps.cli", "serve"], env=...)
        bench.counters("worker", 0)              # {"tx_bytes": ..., "rx_bytes": ...}
        bench.cut("worker", 0, seconds=5)        # the link down 5 s, then up again

Leaving the block (normally, by an exception, or by SIGTERM, which the bench turns
into `SystemExit` while it is up in the main thread) kills the processes left in its
namespaces and deletes them. `python -m benchmarks.netbench up|down|status` does the
same from a shell; `down` also cleans the leftovers of a crashed run (every namespace
named `kps-<name>-*`, or `kps-*` with `--all`).

Needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and `ip` / `tc` from iproute2; the
kernel needs veth, bridge and the `tbf` qdisc (no `netem`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time

__all__ = ["Bench", "available", "counters", "down", "leftovers", "parse_rate",
           "parse_tasks", "PREFIX", "SUBNET"]

PREFIX = "kps-"
SUBNET = ipaddress.ip_network("10.77.0.0/24")
IFNAME = "eth0"
BRIDGE = "br0"
DEFAULT_NAME = "nb"
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(|k|m|g)(bit|bps)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}
_NAME = re.compile(r"^[a-z0-9]{1,12}$")


def parse_rate(rate) -> float | None:
    """Bits per second of `rate`: a number, or text like `"100mbit"`, `"1gbit"`, `"12.5mbps"`
    (bytes); `None`, `"none"` or `"unlimited"` for no limit."""
    if rate is None or (isinstance(rate, str) and rate.strip().lower() in ("none", "unlimited")):
        return None
    if isinstance(rate, int | float) and not isinstance(rate, bool):
        bits = float(rate)
    else:
        match = _RATE.match(str(rate))
        if not match:
            raise ValueError("Invalid value for argument `rate`: expected bits per second "
                             f"such as '100mbit' or '1gbit'. Received: rate={rate!r}")
        bits = float(match.group(1)) * _UNITS[match.group(2).lower()]
        if (match.group(3) or "").lower() == "bps":
            bits *= 8
    if not bits > 0:
        raise ValueError(f"Invalid value for argument `rate`: must be positive. Received: "
                         f"rate={rate!r}")
    return bits


def parse_tasks(tasks) -> dict[str, int]:
    """`{"chief": 1, "worker": 2, "ps": 2}` from that dict or from `"chief=1,worker=2,ps=2"`."""
    if isinstance(tasks, str):
        parsed = {}
        for part in filter(None, (p.strip() for p in tasks.split(","))):
            kind, _, count = part.partition("=")
            try:
                parsed[kind.strip()] = int(count) if count else 1
            except ValueError:
                raise ValueError("Invalid value for argument `tasks`: expected "
                                 f"'chief=1,worker=2,ps=2'. Received: tasks={tasks!r}") from None
        tasks = parsed
    tasks = dict(tasks)
    for kind, count in tasks.items():
        if not re.fullmatch(r"[a-z]{1,10}", kind) or not isinstance(count, int) or count < 0:
            raise ValueError("Invalid value for argument `tasks`: task types are lowercase "
                             f"words, counts non-negative. Received: tasks={tasks!r}")
    if not 0 < sum(tasks.values()) <= SUBNET.num_addresses - 2:
        raise ValueError(f"Invalid value for argument `tasks`: 1 to "
                         f"{SUBNET.num_addresses - 2} tasks. Received: tasks={tasks!r}")
    return tasks


def _run(*args, check=True, timeout=30) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=timeout)


def available() -> str | None:
    """`None` when this process can build a bench, else why not (for a test's skip)."""
    if os.geteuid() != 0:
        return "the network bench needs root (ip netns, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the network bench needs `{tool}` (iproute2)"
    probe = f"{PREFIX}probe{os.getpid()}"
    try:
        _run("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"`ip netns add` fails here: {getattr(e, 'stderr', '') or e}".strip()
    try:
        _run("ip", "-n", probe, "link", "add", "name", "kpsa", "type", "veth", "peer", "name",
             "kpsb")
        _run("tc", "-n", probe, "qdisc", "add", "dev", "kpsa", "root", "tbf", "rate", "1mbit",
             "burst", "16kb", "latency", "50ms")
        _run("ip", "-n", probe, "link", "add", "name", "kpsbr", "type", "bridge")
    except subprocess.CalledProcessError as e:
        return f"veth, bridge or tbf is missing: {e.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def namespaces() -> list[str]:
    """Every network namespace `ip netns` names."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def leftovers(name: str | None = DEFAULT_NAME) -> list[str]:
    """Namespaces of bench `name` (every `kps-` namespace when `name` is `None`)."""
    prefix = PREFIX if name is None else f"{PREFIX}{name}-"
    return [ns for ns in namespaces() if ns.startswith(prefix)]


def _pids(namespace: str) -> list[int]:
    out = _run("ip", "netns", "pids", namespace, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_namespace_processes(spaces, grace: float = 5.0):
    """SIGTERM, then after `grace` seconds SIGKILL, every process inside `spaces`: each one
    a bench started (only the bench makes `kps-` namespaces)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = [p for ns in spaces for p in _pids(ns) if p != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_pids(ns) for ns in spaces):
            time.sleep(0.05)  # polling a condition, with a deadline


def down(name: str | None = DEFAULT_NAME) -> list[str]:
    """Deletes bench `name`'s namespaces (every `kps-` one when `None`), after ending the
    processes inside them; returns the names deleted. Safe to call when nothing is up."""
    spaces = leftovers(name)
    _kill_namespace_processes(spaces)
    for ns in spaces:
        _run("ip", "netns", "del", ns, check=False)
    return spaces


def counters(namespace: str, ifname: str = IFNAME) -> dict[str, int]:
    """`tx_bytes`, `rx_bytes`, `tx_packets`, `rx_packets` of `ifname` in `namespace`, and
    the namespace's TCP segments sent (`tcp_out_segs`, retransmissions excluded, as the
    kernel counts them) and retransmitted (`tcp_retrans_segs`)."""
    out = _run("ip", "-j", "-s", "-n", namespace, "link", "show", "dev", ifname).stdout
    stats = json.loads(out)[0]["stats64"]
    tcp = tcp_counters(_run("ip", "netns", "exec", namespace, "cat", "/proc/net/snmp").stdout)
    return {"tx_bytes": stats["tx"]["bytes"], "rx_bytes": stats["rx"]["bytes"],
            "tx_packets": stats["tx"]["packets"], "rx_packets": stats["rx"]["packets"],
            "tcp_out_segs": tcp["OutSegs"], "tcp_retrans_segs": tcp["RetransSegs"]}


def cpu_seconds(namespace: str) -> float:
    """CPU seconds (user and system, every thread) used so far by the processes now in
    `namespace` (a process that ended is no longer counted)."""
    total = 0
    for pid in _run("ip", "netns", "pids", namespace).stdout.split():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name
        except OSError:  # ended since it was listed
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


def tcp_counters(snmp: str) -> dict[str, int]:
    """The `Tcp:` counters of a `/proc/net/snmp` text (a line of names, then one of values)."""
    names, values = [line.split()[1:] for line in snmp.splitlines() if line.startswith("Tcp:")]
    return dict(zip(names, map(int, values)))


@dataclasses.dataclass(frozen=True)
class Task:
    """One task's namespace, address, and its link's name on the bridge."""

    type: str
    index: int
    namespace: str
    address: str
    port_name: str  # its veth peer in the bridge namespace
    rate: float | None  # bits per second, both directions


class Bench:
    """A bench of network namespaces joined by rate-limited links; a context manager.

    Args:
        tasks: task counts, `{"chief": 1, "worker": 2, "ps": 2}` or `"chief=1,worker=2,ps=2"`.
        rate: every link's rate in both directions (`"100mbit"`, `"1gbit"`, bits per
            second, or `None` for no limit); `rates` overrides it per task type.
        rates: per task type, e.g. `{"ps": "100mbit"}`.
        name: the bench's name in its namespaces' names (`kps-<name>-...`), lowercase
            letters and digits, so that benches can coexist.
        sysctls: per-namespace sysctls set in every task's namespace, e.g.
            `{"net.ipv4.tcp_slow_start_after_idle": 0}`.
    """

    def __init__(self, tasks, rate=None, rates=None, name: str = DEFAULT_NAME,
                 sysctls=None):
        if not _NAME.match(name):
            raise ValueError("Invalid value for argument `name`: 1 to 12 lowercase letters "
                             f"or digits. Received: name={name!r}")
        self.name = name
        counts = parse_tasks(tasks)
        rates = {kind: parse_rate(r) for kind, r in (rates or {}).items()}
        default = parse_rate(rate)
        hosts = SUBNET.hosts()
        self.tasks: dict[tuple[str, int], Task] = {}
        for kind, count in counts.items():
            for i in range(count):
                self.tasks[kind, i] = Task(kind, i, f"{PREFIX}{name}-{kind}-{i}",
                                           str(next(hosts)), f"{kind[:8]}{i}",
                                           rates.get(kind, default))
        self.bridge_namespace = f"{PREFIX}{name}-br"
        self.sysctls = dict(sysctls or {})
        self._processes: list[subprocess.Popen] = []
        self._previous_sigterm = None
        self._up = False

    # -- setup and teardown ----------------------------------------------------------------
    def __enter__(self) -> Bench:
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
        try:
            self.up()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc_info):
        try:
            self.down()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None
        return False

    def up(self):
        """Creates the namespaces, links and rate limits. Raises `RuntimeError` when the
        bench's namespaces already exist (`down(name)` removes a crashed run's)."""
        if leftovers(self.name):
            raise RuntimeError(f"Network bench {self.name!r} is already up (or a crashed run "
                               f"left it): run `python -m benchmarks.netbench down --name "
                               f"{self.name}` first. Found: {leftovers(self.name)}")
        self._up = True
        br = self.bridge_namespace
        self._netns(br)
        _run("ip", "-n", br, "link", "add", "name", BRIDGE, "type", "bridge")
        _run("ip", "-n", br, "link", "set", BRIDGE, "up")
        for task in self.tasks.values():
            ns = task.namespace
            self._netns(ns)
            for key, value in self.sysctls.items():
                _run("ip", "netns", "exec", ns, "sysctl", "-qw", f"{key}={value}")
            _run("ip", "-n", ns, "link", "add", "name", IFNAME, "type", "veth", "peer", "name",
                 task.port_name, "netns", br)
            _run("ip", "-n", br, "link", "set", task.port_name, "master", BRIDGE)
            _run("ip", "-n", ns, "addr", "add", f"{task.address}/{SUBNET.prefixlen}",
                 "dev", IFNAME)
            if task.rate is not None:
                _tbf(ns, IFNAME, task.rate)
                _tbf(br, task.port_name, task.rate)
            _run("ip", "-n", br, "link", "set", task.port_name, "up")
            _run("ip", "-n", ns, "link", "set", IFNAME, "up")
        for task in self.tasks.values():  # the links carry traffic before anything starts
            self._wait_link(task)

    def _netns(self, ns):
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        for key in ("all", "default"):  # no IPv6 chatter (router and neighbour solicitations)
            _run("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1",
                 check=False)

    def _wait_link(self, task, timeout=10.0):
        deadline = time.monotonic() + timeout
        while True:
            out = _run("ip", "-j", "-n", task.namespace, "link", "show", "dev", IFNAME).stdout
            if json.loads(out)[0].get("operstate") == "UP":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the link of {task.namespace} did not come up in "
                                   f"{timeout}s")
            time.sleep(0.02)  # polling a condition, with a deadline

    def down(self):
        """Ends the processes `popen` started and any other left in the bench's namespaces,
        then deletes the namespaces (their veth links go with them); does nothing to
        namespaces this object did not create (see the module's `down` for leftovers)."""
        for proc in self._processes:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._processes:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._processes.clear()
        if self._up:  # never another bench's namespaces (an `up` refused as already up)
            down(self.name)
        self._up = False

    # -- use -------------------------------------------------------------------------------
    def task(self, kind: str, index: int = 0) -> Task:
        try:
            return self.tasks[kind, index]
        except KeyError:
            raise ValueError(f"Invalid value for arguments `kind`, `index`: the bench has "
                             f"{sorted(self.tasks)}. Received: {kind!r}, {index!r}") from None

    def address(self, kind: str, index: int = 0) -> str:
        """The task's IPv4 address."""
        return self.task(kind, index).address

    def cluster(self, port: int = 2222, kinds=("chief", "worker", "ps")) -> dict:
        """The TF_CONFIG `cluster`: `{"chief": ["10.77.0.1:2222"], ...}` for `kinds`."""
        cluster: dict[str, list[str]] = {}
        for (kind, _), task in sorted(self.tasks.items(), key=lambda kv: kv[0]):
            if kind in kinds:
                cluster.setdefault(kind, []).append(f"{task.address}:{port}")
        return cluster

    def tf_config(self, kind: str, index: int = 0, port: int = 2222, kinds=("chief", "worker",
                                                                             "ps")) -> str:
        """The TF_CONFIG JSON text of task (`kind`, `index`) in this bench's cluster."""
        self.task(kind, index)
        return json.dumps({"cluster": self.cluster(port, kinds),
                           "task": {"type": kind, "index": index}})

    def command(self, kind: str, index: int, argv) -> list[str]:
        """`argv` prefixed to run inside the task's namespace (`ip netns exec`)."""
        return ["ip", "netns", "exec", self.task(kind, index).namespace, *argv]

    def popen(self, kind: str, index: int, argv, **kwargs) -> subprocess.Popen:
        """Starts `argv` inside the task's namespace; `down` ends it."""
        proc = subprocess.Popen(self.command(kind, index, argv), **kwargs)
        self._processes.append(proc)
        return proc

    def counters(self, kind: str, index: int = 0) -> dict[str, int]:
        """The task's interface counters (bytes and packets sent and received)."""
        return counters(self.task(kind, index).namespace)

    def set_link(self, kind: str, index: int, up: bool):
        """Takes the task's link down (as a cut cable: its interface loses carrier) or up."""
        task = self.task(kind, index)
        _run("ip", "-n", self.bridge_namespace, "link", "set", task.port_name,
             "up" if up else "down")
        if up:
            self._wait_link(task)

    def cut(self, kind: str, index: int = 0, seconds: float = 5.0):
        """The task's link down for `seconds`, then up again (blocks)."""
        self.set_link(kind, index, False)
        try:
            time.sleep(seconds)  # the cut's duration is the point, not a synchronisation
        finally:
            self.set_link(kind, index, True)

    def cut_later(self, kind: str, index: int = 0, after: float = 0.0,
                  seconds: float = 5.0) -> threading.Thread:
        """`cut` in a thread, `after` seconds from now; returns the started thread."""
        def run():
            time.sleep(after)
            self.cut(kind, index, seconds)

        thread = threading.Thread(target=run, daemon=True, name=f"cut-{kind}-{index}")
        thread.start()
        return thread

    def describe(self) -> list[str]:
        return [f"{t.namespace:24s} {t.address:12s} "
                f"{'unlimited' if t.rate is None else _format_rate(t.rate)}"
                for t in self.tasks.values()]


def _format_rate(bits: float) -> str:
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits:g}bit"


def _tbf(namespace: str, dev: str, bits: float):
    """A token bucket of `bits` per second on `dev`'s egress: a burst of 4 ms of the rate
    (at least 16 KiB, so that a packet always fits) and a queue of 50 ms."""
    burst = max(16 << 10, int(bits / 8 * 0.004))
    _run("tc", "-n", namespace, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
         f"{int(bits)}bit", "burst", str(burst), "latency", "50ms")


def _raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)
