"""No decision from thin evidence (issue 26): attack rows short of distinct probes, attack samples."""
from __future__ import annotations

import numpy as np

from deid.anonymise.methods import deidentify
from deid.evaluation.checks import INSUFFICIENT
from deid.evaluation.gate_rows import AttackRow
from deid.evaluation.gate_types import GateConfig, GateInputs
from deid.evaluation.gate_privacy import attack_sample, privacy_checks
from deid.evaluation.gate import evaluate

SHAPE = (24, 20)


def _faces(n_people: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    base = rng.normal(128, 40, (n_people, SHAPE[0] // 4, SHAPE[1] // 4))
    ident = np.repeat(np.repeat(base, 4, axis=1), 4, axis=2).reshape(n_people, -1)
    faces = np.clip(ident + rng.normal(0, 6, ident.shape), 0, 255).astype(np.uint8)
    return faces, np.asarray([f"p{i}" for i in range(n_people)], dtype=object)


def _release(n_people: int = 40, k: int = 5):
    faces, people = _faces(n_people)
    released, clusters = deidentify(faces, shape=SHAPE, people=people, method="k-same", k=k, n_components=10)
    return faces, people, released, clusters.astype(object)


def _gate(released, faces, people, clusters, **kw):
    inputs = GateInputs.from_arrays(shape=SHAPE, people=people, released=released, originals=faces,
                                    clusters=clusters, records_in=len(people),
                                    release_columns=("record_id", "image", "cluster_id"))
    config = GateConfig(k=5, method="k-same", attackers=("pca-whitened-cosine",), modes=("naive", "reverse"), **kw)
    return evaluate(inputs, config)


def test_a_probe_starved_row_is_insufficient_evidence_and_never_the_headline():
    faces, people, released, clusters = _release()
    res = _gate(released, faces, people, clusters)  # min_probes 20: naive has 8 distinct released images
    rows = {r.mode: r for r in res.reidentification}
    assert rows["naive"].n_probes == 8 and rows["naive"].status == INSUFFICIENT
    assert 0 <= rows["naive"].lower <= rows["naive"].upper <= 1  # kept with its n and interval
    assert rows["reverse"].n_probes == 40 and rows["reverse"].status in ("pass", "fail")
    assert res.max_rate == rows["reverse"].rate
    check = next(c for c in res.checks if c.name == "reidentification_rate")
    assert check.n == 40 and "insufficient evidence" in check.detail
    assert res.attack_sample["min_probes"] == 20 and res.attack_sample["insufficient"] == 1
    # With the minimum at 8 the same row is evidence again, and may be the headline.
    res8 = _gate(released, faces, people, clusters, min_probes=8)
    assert all(r.status != INSUFFICIENT for r in res8.reidentification)
    assert res8.max_rate == max(r.rate for r in res8.reidentification)


def test_the_headline_ignores_a_high_rate_from_one_probe():
    # The case: a headline 0.167 from one distinct probe. Rows as attack_rows gives them.
    faces, people, released, clusters = _release()
    inputs = GateInputs.from_arrays(shape=SHAPE, people=people, released=released, originals=faces, clusters=clusters)
    rows = [AttackRow("a", "naive", rate=1.0, n_probes=1), AttackRow("a", "reverse", rate=0.1, n_probes=100),
            AttackRow("b", "naive", rate=0.15, n_probes=20)]
    for exact in (True, False):
        checks, out, max_rate, _ = privacy_checks(inputs, GateConfig(k=5, method="k-same"), exact=exact,
                                                  rows=rows)
        assert [r.status for r in out][0] == INSUFFICIENT and out[0].upper == 1.0
        assert all(r.status is None for r in rows)  # scored rows are new rows: the input is left as it was
        assert max_rate == 0.15 and checks[0].value == 0.15 and checks[0].n == 20  # 20 probes: just enough
        # The one-probe rate (1.0 > 1/k) would fail on its own; it decides nothing.
        assert checks[0].passed == (out[1].status == out[2].status == "pass")


def test_when_no_rate_has_enough_probes_the_exact_checks_decide():
    faces, people, released, clusters = _release()
    res = _gate(released, faces, people, clusters, min_probes=50)  # the whole release has 40 records
    assert res.max_rate is None and all(r.status == INSUFFICIENT for r in res.reidentification)
    check = next(c for c in res.checks if c.name == "reidentification_rate")
    assert check.status == "inconclusive" and check.passed and check.value is None
    assert "exact structural checks" in check.detail
    assert res.exact_bound and next(c for c in res.checks if c.name == "max_person_share").passed
    assert any(w.startswith("reidentification_rate: insufficient evidence") for w in res.warnings)
    # Not identical copies: nothing bounds re-identification, so the same thin evidence blocks the release.
    noisy = np.clip(released.astype(int) + np.random.default_rng(1).integers(-1, 2, released.shape), 0, 255)
    res = _gate(noisy.astype(np.uint8), faces, people, clusters, min_probes=50)
    check = next(c for c in res.checks if c.name == "reidentification_rate")
    assert not res.exact_bound and check.status == "inconclusive" and not check.passed and not res.passed


def test_attack_sample_takes_at_least_min_units_whole_clusters():
    n = 400
    people = np.asarray([f"p{i}" for i in range(n)], object)
    clusters = np.asarray([f"c{i // 10}" for i in range(n)], object)  # 40 clusters of 10
    inputs = GateInputs.from_arrays(shape=SHAPE, people=people, released=np.zeros((n, 1), np.uint8),
                                    originals=np.zeros((n, 1), np.uint8), clusters=clusters)
    small = attack_sample(inputs, max_records=100, seed=3)
    grown = attack_sample(inputs, max_records=100, seed=3, min_units=25)
    assert len(set(clusters[small])) == 10 and len(set(clusters[grown])) == 25 and len(grown) == 250
    assert set(small) <= set(grown)  # the next clusters of the same seeded order: the sample only grows
    assert len(attack_sample(inputs, max_records=100, seed=3, min_units=99)) == n  # fewer units than asked: all


def test_a_release_that_loses_its_label_fails_the_gate_even_when_inconclusive_is_released():
    from deid.evaluation.gate_utility import cross_fit_checks

    rng = np.random.default_rng(7)
    n_people = 100
    people = np.repeat(np.arange(n_people), 2)
    y = (people % 4 != 0).astype(int)  # majority rate 0.75
    faces = np.clip(rng.uniform(60, 190, (n_people, 480))[people] + rng.normal(0, 8, (200, 480)), 0, 255)
    faces[:, :40] = np.clip(faces[:, :40] + np.where(y[:, None] == 1, 40, -40), 0, 255)
    faces = faces.astype(np.uint8)

    def collapse(images, *, people, partitions=None, labels=None):  # every face the same average
        images = np.asarray(images, dtype=float)
        return np.tile(np.rint(images.mean(axis=0)), (len(images), 1)).astype(np.uint8), None

    released = collapse(faces, people=people)[0]
    inputs = GateInputs.from_arrays(shape=SHAPE, people=people.astype(str).astype(object), released=released,
                                    originals=faces, labels={"g": y}, partitions=np.asarray([f"g={v}" for v in y], dtype=object),
                                    deidentify=collapse)
    config = GateConfig(k=5, method="k-same-select", labels=("g",), utility_inconclusive="release", repeats=1,
                        n_components=10)
    checks, rows = cross_fit_checks(inputs, config)
    assert checks[0].status == "fail" and not checks[0].passed and "loses g" in checks[0].detail
    assert rows[0].evidence["label_lost"] and rows[0].evidence["gate_status"] == "fail"
