"""Property: in every release of a lineage, no person holds more than 1/k of a cluster's released rows.

Random sequences of drops (people arriving, leaving, returning with photos never released before)
through :func:`deid.release.lineage_plan.plan_release`: a republished cluster's rows are this drop's records of it
plus its counterfeits (rows of no one); a new cluster's rows are its records. The gate's
``max_person_share`` (:func:`deid.evaluation.gate_structure.structural_checks`) must hold on them and on the registered
members, whatever the drop.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deid.evaluation.gate_types import GateConfig, GateInputs
from deid.evaluation.gate_structure import structural_checks
from deid.release.lineage_state import empty_state
from deid.operations.worker_lineage import republished_for_gate
from integration.release.test_lineage import SHAPE, World, _release


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), k=st.integers(2, 3), absent=st.sampled_from(["republish", "suppress"]),
       select=st.booleans(), n_drops=st.integers(2, 4))
def test_property_no_person_above_one_kth_of_a_clusters_released_rows(data, k, absent, select, n_drops):
    w = World(n_people=16, photos=3, seed=data.draw(st.integers(0, 3)))
    n = len(w.people)
    state = empty_state("synthetic")
    for r in range(n_drops):
        idx = sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n)))
        plan, rel = _release(w, idx, state, rid=f"rel-{r}", k=k, absent=absent, select=select)
        fakes = {x.key: x.n_counterfeit for x in rel.republished}
        rows: dict[str, Counter] = {}
        for pos, key in enumerate(rel.record_cluster):
            if key is not None:
                rows.setdefault(key, Counter())[w.people[idx[pos]]] += 1
        for key, counts in rows.items():
            total = sum(counts.values()) + fakes.get(key, 0)
            assert k * max(counts.values()) <= total, (key, dict(counts), fakes.get(key, 0))
        if absent == "suppress":
            assert not fakes or not any(fakes.values())
        # The gate's structure, on the records and counterfeits the plan releases.
        released = rel.released_records(state)
        if released:
            pos = [i for i, _, _ in released]
            inputs = GateInputs.from_arrays(
                shape=SHAPE, people=[w.people[idx[i]] for i in pos], released=np.array([img for _, _, img in released]),
                originals=w.images[[idx[i] for i in pos]], clusters=np.array([c for _, c, _ in released], dtype=object),
                records_in=len(pos), release_columns=("record_id", "image", "cluster_id"),
                republished=republished_for_gate(rel, state))
            checks = {c.name: c for c in structural_checks(inputs, GateConfig(k=k, method="k-same-select"))[0]}
            assert checks["max_person_share"].passed, checks["max_person_share"].detail
            assert checks["min_distinct_people_per_cluster"].passed, checks["min_distinct_people_per_cluster"].detail
        state = state.with_entry(rel.to_entry())
