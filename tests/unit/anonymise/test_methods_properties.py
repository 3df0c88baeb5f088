"""Properties of the new methods on random small data: the structure each one claims."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from method_checks import check_claimed_structure

from deid.anonymise.methods import REGISTRY, deidentify

SHAPE = (12, 10)
NEW = ("k-same-eigen", "k-same-m", "k-same-aam", "multi-factor", "selective-mean", "attribute-preserving")


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n_people=st.integers(4, 9), k=st.integers(2, 3),
       method=st.sampled_from(NEW), two_parts=st.booleans())
def test_every_face_is_hidden_among_k_people(seed, n_people, k, method, two_parts):
    rng = np.random.default_rng(seed)
    per = rng.integers(1, 4, size=n_people)
    people = np.repeat(np.arange(n_people), per)
    x = rng.integers(0, 256, size=(len(people), SHAPE[0] * SHAPE[1]), dtype=np.uint8)
    expr = rng.choice(["neutral", "smiling"], size=len(people))
    labels = {"expression": list(expr), "gender": list(np.where(people % 2 == 0, "f", "m"))}
    spec = REGISTRY[method]
    # Partitions (where the method uses them): two halves of the people, each with >= k people.
    parts = list(np.where(people < n_people // 2, "a", "b")) if two_parts and spec.partitions_by_labels else None
    if parts is not None and min(n_people // 2, n_people - n_people // 2) < k:
        parts = None
    if method == "attribute-preserving" and n_people < k + 1:
        return
    from deid.anonymise.ksame import DominantPersonError

    try:
        released, clusters = deidentify(x, shape=SHAPE, people=people, method=method, k=k, n_components=5,
                                        seed=seed % 7, labels=labels, partitions=parts)
    except DominantPersonError:
        # Only allowed when some person holds more than 1/k of a partition's images: then no
        # grouping can keep their share of every cluster <= 1/k (deid.anonymise.ksame).
        groups = [np.asarray(parts) == p for p in set(parts)] if parts is not None else [np.ones(len(people), bool)]
        assert any(np.bincount(people[g]).max() * k > g.sum() for g in groups)
        return
    assert released.shape == x.shape and released.dtype == np.uint8
    check_claimed_structure(method, released, clusters, people, k, parts)
