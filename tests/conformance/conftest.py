"""Fixtures of the conformance tests: the parent's shared in-process cluster, plus a few
strategies and helpers built on it (no test starts a cluster of its own)."""

import pytest


@pytest.fixture
def coordinator(strategy):
    """The `kerasps.ClusterCoordinator` of the 2-shard `strategy` fixture."""
    import kerasps

    return kerasps.ClusterCoordinator(strategy)


@pytest.fixture
def shards(make_strategy):
    """`shards(n)`: a strategy splitting every variable of 2+ rows into `n` shards, or
    None (no strategy: single-process Keras) for `n == 1`."""
    import kerasps

    def make(n):
        if n == 1:
            return None
        return make_strategy(variable_partitioner=kerasps.partitioners.FixedShardsPartitioner(n))

    return make
