"""Free ports for the tasks of a cluster: picked outside the kernel's ephemeral range, and
claimed on this machine until their task has had time to bind them.

A task's port is picked seconds before its server binds it (a launched chief binds its port
only once it has imported TensorFlow and connects). `portpicker.pick_unused_port` asks the
kernel for a port (`bind` to port 0), so the port it returns is one the kernel hands out
again, to the next `bind` to port 0 or as the local port of an outgoing connection, of any
process: beside another job (or another test process) making gRPC connections, the task
then fails with TensorFlow's "Could not start gRPC server". Here a port is drawn at random
below the ephemeral range, where the kernel assigns nothing, and claimed with a file in a
directory that every process of this machine picking ports this way reads, so two of them
never hand out the same port within `CLAIM_S`. Where a portpicker port server is set
(`PORTSERVER_ADDRESS`), it decides, as it does for every other program using portpicker.
"""

import os
import random
import sys
import tempfile
import time

import portpicker

try:
    import fcntl
except ImportError:  # Windows: claims without the lock
    fcntl = None

# How long a port handed out stays claimed: ample for its task to start and bind it.
CLAIM_S = 600.0
# Ports drawn from, when the kernel's ephemeral range cannot be read or leaves no room.
DEFAULT_RANGE = (15000, 24999)  # portpicker's port server's default pool
_TRIES = 200
_CLAIMS_DIR = os.path.join(tempfile.gettempdir(), f"kerasps-ports-{os.getuid()}"
                           if hasattr(os, "getuid") else "kerasps-ports")


def pick_port() -> int:
    """A free TCP and UDP port of this machine that no other caller of `pick_port` on it
    was given in the last `CLAIM_S` seconds.

    Raises:
        portpicker.NoFreePortFoundError: none found in `_TRIES` draws.
    """
    if os.environ.get("PORTSERVER_ADDRESS"):
        return portpicker.pick_unused_port()
    low, high = port_range()
    rng = random.Random()
    for _ in range(_TRIES):
        port = rng.randint(low, high)
        if _claim(port) and portpicker.is_port_free(port):
            return port
    raise portpicker.NoFreePortFoundError(
        f"No free port found in {_TRIES} draws from {low}-{high}.")


def port_range() -> tuple[int, int]:
    """The ports `pick_port` draws from: below the kernel's ephemeral range on Linux (at
    most 10,000 of them), else `DEFAULT_RANGE`."""
    ephemeral = _ephemeral_range()
    if ephemeral is None or ephemeral[0] <= 2048:
        return DEFAULT_RANGE
    high = ephemeral[0] - 1
    return max(1024, high - 9999), high


def _ephemeral_range():
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(part) for part in f.read().split())
    except (OSError, ValueError):
        return None
    return low, high


def _claim(port: int) -> bool:
    """Claims `port` for `CLAIM_S` seconds; False where another caller holds it."""
    os.makedirs(_CLAIMS_DIR, exist_ok=True)
    path = os.path.join(_CLAIMS_DIR, str(port))
    with open(os.path.join(_CLAIMS_DIR, "lock"), "a") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
        try:
            if time.time() - os.stat(path).st_mtime < CLAIM_S:
                return False
        except FileNotFoundError:
            pass
        with open(path, "w"):
            pass  # a new claim, or a stale one renewed: its time is now
    return True
