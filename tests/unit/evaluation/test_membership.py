"""Membership disclosure (deid.evaluation.membership): AUC controls on small synthetic arrays, the check's rule."""
import numpy as np
import pytest
from unit.evaluation.test_gate import BLUR_FACES

from deid.evaluation.attacks import ATTACKERS
from deid.evaluation.membership import auc, measure_membership, membership_check, tpr_at_fpr

SHAPE = (8, 8)


def _faces(n_people=40, per=2, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.uniform(40, 215, size=(n_people, SHAPE[0] * SHAPE[1]))
    faces = np.repeat(base, per, axis=0) + rng.normal(0, 6, size=(n_people * per, base.shape[1]))
    return np.clip(faces, 0, 255).astype(np.uint8), np.repeat(np.arange(n_people), per).astype(object)


ATT = {a: ATTACKERS[a] for a in ("pca-whitened-cosine", "pca-mahalanobis")}


def test_auc_credits_ties_one_half_and_ranks():
    assert auc(np.array([3.0, 4.0]), np.array([1.0, 2.0])) == 1.0
    assert auc(np.array([1.0, 2.0]), np.array([3.0, 4.0])) == 0.0
    assert auc(np.array([1.0, 1.0]), np.array([1.0])) == 0.5  # all tied: a coin, never credited by position
    assert auc(np.array([2.0, 0.0]), np.array([1.0])) == 0.5


def test_tpr_at_fpr_threshold_above_non_members():
    non = np.arange(100, dtype=float)  # 1% of 100: the one highest non-member may be flagged
    assert tpr_at_fpr(np.array([98.5, 99.5, 10.0, 200.0]), non) == 0.75
    assert tpr_at_fpr(np.array([5.0, 5.0]), np.array([5.0] * 10)) == 0.0  # ties with a non-member buy nothing


def test_release_of_the_originals_gives_auc_near_one():
    faces, people = _faces()
    out = measure_membership(originals=faces, people=people, shape=SHAPE, attackers=ATT, seed=1,
                             deidentify=lambda x, **kw: x.copy())
    assert out["status"] == "measured" and out["members"] == 20 and out["non_members"] == 20
    assert out["auc"] > 0.95 and out["auc_interval"][0] > 0.85
    assert out["advantage"] == pytest.approx(2 * out["auc"] - 1, abs=1e-6)
    assert out["tpr_at_fpr"] > 0.9
    assert {r["attacker"] for r in out["attackers"]} == set(ATT)


def test_random_noise_release_gives_auc_near_half():
    faces, people = _faces(n_people=60, seed=2)
    rng = np.random.default_rng(3)
    out = measure_membership(originals=faces, people=people, shape=SHAPE, attackers=ATT, seed=4,
                             deidentify=lambda x, **kw: rng.integers(0, 256, size=x.shape).astype(np.uint8))
    assert out["status"] == "measured"
    lo, hi = out["auc_interval"]
    # The strongest of two attackers on 30 vs 30 people: near a coin, the interval covering 0.5.
    assert out["members"] == 30 and 0.3 < out["auc"] < 0.7 and lo < 0.5 < hi
    assert out["tpr_at_fpr"] < 0.2


def test_too_few_people_is_not_applicable():
    faces, people = _faces(n_people=6)
    out = measure_membership(originals=faces, people=people, shape=SHAPE, attackers=ATT,
                             deidentify=lambda x, **kw: x)
    assert out["status"] == "not_applicable" and "at least 8" in out["reason"]
    c = membership_check(out, 0.1)
    assert c.passed and c.status == "not_applicable"


def _figures(adv_lo, adv_hi):
    return {"status": "measured", "attacker": "a", "auc": 0.7, "auc_interval": [0.6, 0.8], "advantage": 0.4,
            "advantage_interval": [adv_lo, adv_hi], "tpr_at_fpr": 0.1, "tpr_interval": [0.0, 0.2], "fpr": 0.01,
            "members": 30, "non_members": 30}


def test_check_reports_only_when_unset_and_decides_from_bounds():
    c = membership_check(_figures(0.2, 0.6), None)
    assert c.passed and c.status == "not_applicable" and c.threshold is None and c.n == 60
    assert c.interval == (0.2, 0.6) and "report only" in c.detail
    assert membership_check(_figures(0.2, 0.6), 0.1).status == "fail"
    assert not membership_check(_figures(0.2, 0.6), 0.1).passed
    assert membership_check(_figures(0.2, 0.6), 0.7).status == "pass"
    inc = membership_check(_figures(0.2, 0.6), 0.4)
    assert inc.status == "inconclusive" and inc.passed


def test_bootstrap_replicates_match_the_direct_statistics():
    from deid.evaluation.membership import bootstrap_figures

    rng = np.random.default_rng(0)
    m, n = rng.normal(1, 1, 15).round(1), rng.normal(0, 1, 120).round(1)  # rounded: ties happen
    aucs, tprs = bootstrap_figures(m, n, fpr=0.01, seed=7, resamples=50)
    r = np.random.default_rng(7)
    im, jn = r.integers(0, len(m), (50, len(m))), r.integers(0, len(n), (50, len(n)))
    assert np.allclose(aucs, [auc(m[a], n[b]) for a, b in zip(im, jn)])
    assert np.allclose(tprs, [tpr_at_fpr(m[a], n[b], 0.01) for a, b in zip(im, jn)])


def test_report_html_and_card_state_membership_beside_one_over_k():
    from integration.test_consumer import _report

    from deid.evaluation.membership import SCOPE
    from deid.reporting.html_report import _membership
    import jsonschema

    from deid.reporting.report import Privacy, load_schema
    from deid.release.card import DatasetCard, split_card

    report = _report("rel-0123456789abcdef", 12)
    figures = {**_figures(0.2, 0.6), "attacker": "pca-whitened-cosine", "status": "measured",
               "interval_method": "percentile bootstrap", "records": 60}
    report["privacy"].update(membership=figures, scope=dict(SCOPE))
    schema = load_schema()["properties"]["privacy"]["properties"]
    jsonschema.validate(figures, schema["membership"])  # the report schema takes them as the gate writes them
    jsonschema.validate(dict(SCOPE), schema["scope"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**figures, "subject_ids": ["001"]}, schema["membership"])
    html = _membership(Privacy(bound=report["privacy"]["bound"], membership=figures, scope=dict(SCOPE)))
    assert "AUC 0.700 [0.600, 0.800]" in html and "30 members vs 30 non-members" in html
    assert "k-Same protects" in html and "does not protect" in html
    _, body = split_card(DatasetCard.from_report(report).render())
    assert "membership AUC, not bounded by k" in body and "[0.600, 0.800], 30 members and 30 non-members" in body
    assert "## What k-Same protects and what it does not" in body and "- Not protected: Membership" in body


def test_the_setting_reaches_the_gate_once(monkeypatch):
    from deid.errors import ConfigError
    from deid.evaluation.gate_types import GATE_SETTINGS, GateConfig
    from deid.settings import Settings

    assert GATE_SETTINGS["membership_max_advantage"] == "membership_max_advantage"
    assert GateConfig.from_settings(Settings(), k=5, method="k-same").membership_max_advantage is None
    monkeypatch.setenv("DEID_MEMBERSHIP_MAX_ADVANTAGE", "0.3")
    assert GateConfig.from_settings(Settings(), k=5, method="k-same").membership_max_advantage == 0.3
    with pytest.raises(ConfigError, match="DEID_MEMBERSHIP_MAX_ADVANTAGE"):
        GateConfig(k=5, method="k-same", membership_max_advantage=1.5)


@BLUR_FACES  # the faces test_gate.py's blur test gates: their descriptors are in this process's cache then
def test_the_gate_reports_membership_and_decides_only_when_set():
    from dataclasses import replace

    from unit.evaluation.test_gate import SHAPE as GSHAPE
    from unit.evaluation.test_gate import _faces as gate_faces
    from unit.evaluation.test_gate import _fast, _inputs

    from deid.anonymise.methods import deidentify, method_runner
    from deid.evaluation.gate import evaluate

    faces, people = gate_faces(40, per_person=2)
    released = deidentify(faces, shape=GSHAPE, people=people, method="blur", sigma=1.0)[0]
    inputs = _inputs(released, faces, people, np.arange(len(people)).astype(object),
                     deidentify=method_runner("blur", shape=GSHAPE, sigma=1.0))
    res = evaluate(inputs, _fast(method="blur"))
    check = {c.name: c for c in res.checks}["membership_advantage"]
    assert res.membership["status"] == "measured" and res.membership["members"] == 20
    assert check.status == "not_applicable" and check.passed and check.n == 40  # report only by default
    # A lightly blurred face is its own photo's nearest: members stand out, and a set bound fails on it.
    assert res.membership["advantage_interval"][0] > 0.5
    strict = evaluate(inputs, replace(_fast(method="blur"), membership_max_advantage=0.2))
    check = {c.name: c for c in strict.checks}["membership_advantage"]
    assert check.status == "fail" and not check.passed
    assert any(r.startswith("membership_advantage:") for r in strict.reasons)
