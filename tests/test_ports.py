"""The tasks' ports: out of the kernel's way, and never handed to two processes at once."""

import os
import socket
import subprocess
import sys
import time

import pytest

from kerasps.runtime import ports


@pytest.fixture(autouse=True)
def claims(tmp_path, monkeypatch):
    monkeypatch.delenv("PORTSERVER_ADDRESS", raising=False)
    monkeypatch.setattr(ports, "_CLAIMS_DIR", str(tmp_path))
    return tmp_path


def draws(monkeypatch, *sequence):
    """Makes `pick_port` draw `sequence`, then whatever it would have drawn."""
    queue = list(sequence)
    real = ports.random.Random.randint
    monkeypatch.setattr(ports.random.Random, "randint",
                        lambda self, a, b: queue.pop(0) if queue else real(self, a, b))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's port range")
def test_a_picked_port_is_not_one_the_kernel_hands_to_connections():
    # CI's failure: a launched chief's port, picked by asking the kernel (bind to port 0),
    # went to another process before the chief bound it ("Could not start gRPC server").
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(part) for part in f.read().split())
    picked = [ports.pick_port() for _ in range(50)]
    assert not [port for port in picked if low <= port <= high], (low, high, picked)
    assert len(set(picked)) == len(picked)


def test_a_port_another_process_was_given_is_not_given_again(claims, monkeypatch):
    other = subprocess.run(
        [sys.executable, "-c", "import sys; from kerasps.runtime import ports; "
         "ports._CLAIMS_DIR = sys.argv[1]; print(ports.pick_port())", str(claims)],
        capture_output=True, text=True, check=True)
    theirs = int(other.stdout)
    draws(monkeypatch, theirs, theirs)
    assert ports.pick_port() != theirs


def test_a_claim_older_than_its_time_is_given_again(claims, monkeypatch):
    low, _ = ports.port_range()
    port = next(p for p in range(low, low + 1000) if ports.portpicker.is_port_free(p))
    (claims / str(port)).touch()
    draws(monkeypatch, port)
    assert ports.pick_port() != port
    old = time.time() - ports.CLAIM_S - 1
    os.utime(claims / str(port), (old, old))
    draws(monkeypatch, port)
    assert ports.pick_port() == port


def test_a_port_in_use_is_not_picked(monkeypatch):
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen(1)
        taken = holder.getsockname()[1]
        draws(monkeypatch, taken)
        assert ports.pick_port() != taken


def test_a_port_server_decides_where_one_is_set(monkeypatch):
    monkeypatch.setenv("PORTSERVER_ADDRESS", "@portserver")
    monkeypatch.setattr(ports.portpicker, "pick_unused_port", lambda: 12345)
    assert ports.pick_port() == 12345


def test_no_free_port_names_the_range(monkeypatch):
    monkeypatch.setattr(ports.portpicker, "is_port_free", lambda port: False)
    with pytest.raises(ports.portpicker.NoFreePortFoundError, match=r"draws from \d+-\d+"):
        ports.pick_port()
