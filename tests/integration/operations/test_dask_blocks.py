"""k-Same blocks as Dask tasks: the block map outside a cluster, and its argument check.

The release on 3 Dask workers equal to a local run is tests/ops/test_remote_dask.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from deid.anonymise.ksame import KSame


def test_map_on_cluster_outside_a_worker_is_the_builtin_map():
    from deid.operations.executors import map_on_cluster

    assert map_on_cluster(pow, [2, 3], [3, 2]) == [8, 9]


def test_map_blocks_must_be_callable():
    from deid.errors import ConfigError

    X = np.random.default_rng(0).normal(size=(12, 3))
    with pytest.raises(ConfigError, match="map_blocks=.*must be None or a callable"):
        KSame(2, map_blocks="dask").fit(X, people=np.arange(12), images=X)
