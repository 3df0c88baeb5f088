"""Each method beyond pixel k-Same on the London aligned faces at k=5: the structure it claims."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import load_london_aligned
from method_checks import check_claimed_structure

from deid.anonymise.methods import REGISTRY, deidentify, guarantee

K = 5
NEW = ("k-same-eigen", "k-same-m", "multi-factor", "selective-mean", "attribute-preserving")


@pytest.fixture(scope="module")
def london():
    x, people, gender, expression = load_london_aligned()
    return x, np.asarray(people), {"gender": gender, "expression": expression}


@pytest.mark.slow
@pytest.mark.london
@pytest.mark.parametrize("method", NEW)
def test_method_on_london_keeps_its_structure(london, method):
    x, people, labels = london
    spec = REGISTRY[method]
    parts = list(zip(labels["gender"], labels["expression"])) if spec.partitions_by_labels else None
    released, clusters = deidentify(x, shape=(92, 81), people=people, method=method, k=K, labels=labels,
                                    partitions=parts)
    assert guarantee(method, K).startswith("formal" if spec.identical_within_cluster else "no formal guarantee")
    assert released.shape == x.shape and released.dtype == np.uint8
    assert not (released == x).all(axis=1).any()  # no face released unchanged
    check_claimed_structure(method, released, clusters, people, K, parts)
    if not spec.clustered:  # a set of >= k people behind every face instead
        from deid.anonymise.methods_attribute import AttributePreserving
        from deid.anonymise.methods_selective import SelectiveMean
        if method == "selective-mean":  # the face and k - 1 others: k people
            sets = SelectiveMean(K).fit(x, people=people, labels=labels).sets_
        else:  # k donors of k people other than the face's own
            donors = AttributePreserving(K).fit(x, people=people, labels=labels).donors_
            assert not (people[donors] == people[:, None]).any()
            sets = np.c_[np.arange(len(x)), donors]
        assert all(len(set(people[row])) >= K for row in sets)
