"""The gate on a lineage release (issue 10): absent members' counterfeits, returning people's new photos.

Release 1 is k-Same on seeded synthetic faces; release 2 is planned by :func:`deid.release.lineage_plan.plan_release`
and judged by :func:`deid.evaluation.gate.evaluate` with the republished clusters (:class:`deid.evaluation.gate_types.Republished`):
registered members for the structure, counterfeit rows attacked as released rows of no one.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from deid.evaluation.attacks import attack_all
from deid.evaluation.gate_types import GateConfig, GateInputs, Republished
from deid.evaluation.gate import evaluate
from deid.anonymise.ksame import KSame
from deid.release.lineage import build_release
from deid.release.lineage_plan import plan_release
from deid.release.lineage_state import empty_state
from deid.operations.worker_lineage import republished_for_gate

SHAPE = (24, 20)
KEY = bytes(range(32))
K = 3
ATTACKERS = ("pca-whitened-cosine", "pca-mahalanobis", "lbp-chi2")


def _faces(n_people: int, per_person: int, seed: int, noise: float = 6.0):
    """Smooth random 'faces': one identity pattern per person plus per-image noise."""
    rng = np.random.default_rng(seed)
    h, w = SHAPE
    base = rng.normal(128, 40, (n_people, h // 4, w // 4))
    ident = np.repeat(np.repeat(base, 4, axis=1), 4, axis=2).reshape(n_people, -1)
    who = np.repeat(np.arange(n_people), per_person)
    faces = np.clip(ident[who] + rng.normal(0, noise, (len(who), h * w)), 0, 255).astype(np.uint8)
    return faces, [f"p{p:02d}" for p in who], ident


def _fp(img: np.ndarray) -> str:
    return hashlib.sha256(img.tobytes()).hexdigest()


def _first_release():
    faces, people, ident = _faces(15, 2, seed=3)
    state = empty_state("gate-lineage")
    plan = plan_release(state, people, [_fp(f) for f in faces], key=KEY, k=K)
    model = KSame(K).fit(faces.astype(np.float64), people=people, images=faces)
    images = np.clip(np.rint(model.averages_[model.labels_]), 0, 255).astype(np.uint8)
    rel = build_release(plan, state, release_id="rel-1", method="k-same", new_labels=model.labels_,
                        new_images=images, shape=SHAPE)
    return faces, people, ident, state.with_entry(rel.to_entry())


def _gate(state, faces, people, *, absent="republish", counterfeits=None):
    """Plan drop 2 (returning people only), then the gate's inputs and verdict."""
    plan = plan_release(state, people, [_fp(f) for f in faces], key=KEY, k=K, absent=absent)
    assert not plan.new_records
    rel = build_release(plan, state, release_id="rel-2", method="k-same", new_labels=[],
                        new_images=np.zeros((0, faces.shape[1]), np.uint8), shape=SHAPE)
    rows = rel.released_records(state)
    idx = [i for i, _, _ in rows]
    rep = republished_for_gate(rel, state)
    if counterfeits is not None:
        rep = Republished(members=rep.members, counterfeits=counterfeits(rep), images=rep.images)
    inputs = GateInputs.from_arrays(
        shape=SHAPE, people=[people[i] for i in idx], released=np.array([img for _, _, img in rows]),
        originals=faces[idx], clusters=np.array([c for _, c, _ in rows], dtype=object), records_in=len(people),
        suppressed=len(people) - len(idx), release_columns=("record_id", "image", "cluster_id"), republished=rep)
    config = GateConfig(k=K, method="k-same", attackers=ATTACKERS, modes=("naive", "reverse"))
    return plan, inputs, evaluate(inputs, config)


def _checks(result):
    return {c.name: c for c in result.checks}


def test_absent_members_counterfeits_are_attacked_as_rows_of_no_one():
    faces, people, _, state = _first_release()
    back = [i for i, p in enumerate(people) if p < "p09"]  # 9 of 15 people come back
    plan, inputs, res = _gate(state, faces[back], [people[i] for i in back])
    checks = _checks(res)
    assert plan.n_counterfeit > 0 and res.attack_sample["counterfeits"] == plan.n_counterfeit
    for name in ("min_cluster_size", "min_distinct_people_per_cluster", "max_person_share", "reidentification_rate"):
        assert checks[name].passed, checks[name].detail
    assert res.max_person_share <= 1 / K + 1e-12 and res.exact_bound
    # Identical rows per cluster: every rate, counterfeits included, is at most the row share.
    assert all(r.rate <= 1 / K + 1e-9 for r in res.reidentification), res.reidentification
    assert "counted on their registered members" in checks["min_distinct_people_per_cluster"].detail
    assert "who is in this drop" in checks["max_person_share"].detail
    # The drop's real rows alone (the old measure: counterfeits dropped, gallery of present people):
    # above 1/k, because it conditions on which rows are real -- what the counterfeits hide.
    released, originals = inputs.fetch(np.arange(inputs.n))
    alone = attack_all(originals=originals, original_people=inputs.people, released=released,
                       released_people=inputs.people, shape=SHAPE, modes=("naive",), attackers=ATTACKERS)
    assert max(r["rate"] for r in alone) > 1 / K
    with_them = max(r.rate for r in res.reidentification)  # max_rate is None when every row is short of probes
    print(f"\nabsent members: {plan.n_counterfeit} counterfeits; max rate with them "
          f"{with_them:.3f}, drop rows alone {max(r['rate'] for r in alone):.3f} (1/k = {1 / K:.3f})")


def test_returning_person_with_a_new_photo_is_padded_or_trimmed_to_one_kth():
    faces, people, ident, state = _first_release()
    rng = np.random.default_rng(99)
    new = np.clip(ident[0] + rng.normal(0, 6.0, ident.shape[1]), 0, 255).astype(np.uint8)[None, :]
    faces2, people2 = np.vstack([faces, new]), [*people, "p00"]
    j = len(people2) - 1
    # republish: p00's cluster gets counterfeits until p00 holds at most 1/k of its rows.
    plan, inputs, res = _gate(state, faces2, people2)
    (r,) = [r for r in plan.republish if j in r.records]
    mine = sum(people2[i] == "p00" for i in r.records)
    assert mine >= 2 and r.n_counterfeit == K * mine - len(r.records) > 0 and plan.n_counterfeit == r.n_counterfeit
    checks = _checks(res)
    for name in ("min_distinct_people_per_cluster", "max_person_share", "reidentification_rate"):
        assert checks[name].passed, checks[name].detail
    assert res.max_person_share == pytest.approx(1 / K)
    # The new photo is released as p00's registered image, bit for bit, and attacked with its own original.
    released, originals = inputs.fetch(np.arange(inputs.n))
    row = [n for n, o in enumerate(originals) if np.array_equal(o, faces2[j])]
    assert len(row) == 1 and np.array_equal(released[row[0]], r.cluster.image)
    # Without those counterfeits p00 holds more than 1/k of the released rows: the exact bound fails.
    _, _, bare = _gate(state, faces2, people2, counterfeits=lambda rep: dict.fromkeys(rep.counterfeits, 0))
    share = _checks(bare)["max_person_share"]
    assert not share.passed and share.value == pytest.approx(mine / len(r.records), abs=1e-6)
    # suppress: no counterfeits; p00's surplus (the new photo first) is withheld.
    plan_s, _, res_s = _gate(state, faces2, people2, absent="suppress")
    assert plan_s.n_counterfeit == 0 and [i for i, why in plan_s.suppressed] == [j]
    assert dict(plan_s.suppressed)[j] == "returning_surplus_over_1_k"
    assert _checks(res_s)["max_person_share"].passed and _checks(res_s)["reidentification_rate"].passed
