"""Shared fixtures.

In-process TensorFlow servers cannot be stopped, so the whole test session
shares one cluster (2 workers, 2 ps); tests build strategies on it. Several
`ParameterServerStrategy` objects on one cluster work one after the other.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

# Every test's time limit, and a hung test's stacks printed once under xdist.
from tests.timeouts import *  # noqa: E402, F403 (pytest's hooks, found by name)


@pytest.fixture(scope="session")
def cluster():
    import kerasps

    return kerasps.cluster.in_process(num_workers=2, num_ps=2)


@pytest.fixture
def make_strategy(cluster):
    """Builds a `kerasps.ParameterServerStrategy` on the shared cluster."""
    import kerasps

    def make(**kwargs):
        return kerasps.ParameterServerStrategy(cluster, **kwargs)

    return make


@pytest.fixture
def strategy(make_strategy):
    """A strategy that shards any variable of 2+ rows into two shards."""
    import kerasps

    return make_strategy(variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(2))


@pytest.fixture
def results_read(monkeypatch):
    """Counts the scheduled functions' results copied to the coordinator (not None)."""
    from kerasps.backend import _tf

    reads = []
    copy = _tf._ResultOnCoordinator._copy_to_local

    def counted(remote):
        if remote._values is not None:
            reads.append(remote)
        return copy(remote)

    monkeypatch.setattr(_tf._ResultOnCoordinator, "_copy_to_local", counted)
    return reads
