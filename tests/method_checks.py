"""The structure a de-identification method claims in deid.anonymise.methods.REGISTRY, checked on its output."""
from __future__ import annotations

import numpy as np

from deid.anonymise.methods import REGISTRY


def check_claimed_structure(method, released, clusters, people, k, partitions=None) -> None:
    """Clusters of >= k people (identical images, one partition each, where claimed); no clusters otherwise."""
    spec = REGISTRY[method]
    people = np.asarray(people)
    if not spec.clustered:
        assert clusters is None
        return
    assert clusters is not None and len(clusters) == len(released)
    for c in np.unique(clusters):
        members = clusters == c
        assert len(set(people[members])) >= k
        if spec.identical_within_cluster:
            assert (released[members] == released[members][0]).all()
        if partitions is not None:
            assert len({partitions[i] for i in np.flatnonzero(members)}) == 1
