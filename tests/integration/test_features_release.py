"""Feature drops released: k-Same on vectors, the feature-space attackers, duplicates, the release and its report."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers import assert_nothing_published
from hypothesis import given, settings as hsettings, strategies as st

from deid.anonymise.features import deidentify_vectors, vector_method_runner
from deid.errors import ConfigError, DataError
from deid.evaluation.attacks import FEATURE_ATTACKERS, attack_all
from deid.evaluation.feature_attackers import EuclideanAttacker, IdentityClassifierAttacker
from deid.evaluation.scoring import rank_credit
from deid.intake.features import read_feature_drop, write_feature_drop
from deid.intake.synth_features import make_feature_drop, synthetic_features
from deid.operations.features import resolve_feature_people
from deid.operations.runner import run_release
from deid.release.linkage import load_linkage_key, read_linkage
from deid.release.vectors import read_vector_release
from deid.reporting.verify import verify_report
from deid.run_config import RunConfig
from deid.settings import Settings

K = 5
BOUND = 1.0 / K
PEOPLE, PER_PERSON = 150, 2


@pytest.fixture(scope="module")
def synth_drop(tmp_path_factory) -> Path:
    """150 people x 2 records, 32-d, person label gender and record label expression (seeded).

    300 records of 150 people rather than 100 x 3: the utility intervals are bounded by people (at 100 their
    floor alone is 0.030, so a gender loss of ~0.01 passed tolerance 0.05 in 18 of 20 gate seeds with the records
    in input order, 14 of 20 in the gate's canonical order: the verdict asserted below was a draw of the folds;
    at 150 people 20 of 20 and 60 of 60 (seeds 0-59), issue 32), at the same cost.
    """
    return make_feature_drop(tmp_path_factory.mktemp("fdrop") / "synth", people=PEOPLE, per_person=PER_PERSON,
                             dim=32, seed=3)


def _release(drop: Path, root: Path, **kw) -> SimpleNamespace:
    """The drop released by the runner (no Prefect), its result as :meth:`RunResult.summary`'s JSON-ready fields."""
    settings = Settings(project_dir=root, signing_key=None, linkage_key=None, dask_address=None, seed=None)
    res = run_release(drop, RunConfig.resolve(settings, kind="features", **{"k": K, **kw}))
    return SimpleNamespace(**res.summary())


@pytest.fixture(scope="module")
def released(synth_drop, tmp_path_factory):
    """The synthetic drop released at k=5 with k-Same-Select (once for the module)."""
    root = tmp_path_factory.mktemp("released")
    return root, _release(synth_drop, root, method="k-same-select")


def test_synthetic_feature_drop_released_at_k5_within_1_over_k(released):
    _, res = released
    assert res.verdict == "released", res.reasons
    priv = res.privacy
    # Every attacker x mode, each with its interval and sample size; k-Same's exact bound decides.
    rows = priv["reidentification"]
    assert {(r["attacker"], r["mode"]) for r in rows} == {(a, m) for a in FEATURE_ATTACKERS
                                                          for m in ("naive", "reverse", "parrot")}
    for r in rows:
        assert r["rate"] <= BOUND + 1e-9 and r["lower"] <= r["rate"] <= r["upper"] and r["n_probes"] > 0
        assert r["records"] == 300
    assert priv["exact_bound"] and priv["max_person_share"] <= BOUND + 1e-12
    assert priv["min_distinct_people_per_cluster"] >= K and priv["max_rate"] <= BOUND + 1e-9
    report = json.loads(Path(res.report).read_text())
    check = {c["name"]: c for c in report["checks"]}
    assert check["reidentification_rate"]["n"] > 0 and len(check["reidentification_rate"]["interval"]) == 2
    assert check["no_near_copies"]["passed"] and check["no_forbidden_columns"]["passed"]
    cross = [u for u in res.utility if u.get("protocol") == "cross-fit"]
    assert {u["label"]: u["gate_status"] for u in cross} == {"gender": "pass", "expression": "pass"}
    assert report["configuration"]["kind"] == "features" and report["configuration"]["feature_dim"] == 32
    assert report["lineage"]["applied"] is True and report["lineage"]["registered"] is True
    assert "Released feature vectors" in (Path(res.report_dir) / "report.html").read_text()


def test_feature_release_holds_cluster_means_without_ids_or_order(released, synth_drop):
    root, res = released
    rel = Path(res.release_dir)
    # Every release has its file manifest (the same listing as an image release): here it lists no image.
    assert sorted(p.name for p in rel.iterdir()) == ["ATTESTATION.json", "ATTESTATION.json.sig", "MANIFEST.sha256",
                                                     "README.md", "metadata.csv", "release.parquet"]
    assert (rel / "MANIFEST.sha256").read_bytes() == b""
    table, vectors = read_vector_release(rel)
    assert table.column_names == ["record_id", "cluster_id", "gender", "expression"]
    assert pq.read_schema(rel / "release.parquet").field("features").type.list_size == 32
    drop = read_feature_drop(synth_drop)
    text = (rel / "metadata.csv").read_text() + (rel / "README.md").read_text()
    assert not any(s in text for s in set(drop.subject_ids) | set(drop.source_ids))
    assert not set(table.column("record_id").to_pylist()) & set(drop.record_ids)
    with open(rel / "metadata.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == 300
    card = (rel / "README.md").read_text()
    assert card.startswith("---\n") and "kind: features" in card and "feature_dim: 32" in card
    # Each released vector is the mean of its cluster's original vectors; rows are not in input order.
    link = read_linkage(Path(res.linkage), load_linkage_key(root / "data" / "keys" / "dev_linkage.key"))
    where = {rid: i for i, rid in enumerate(drop.record_ids)}
    released_at = {rid: i for i, rid in enumerate(table.column("record_id").to_pylist())}
    by_cluster: dict[str, list[dict]] = {}
    for row in link:
        by_cluster.setdefault(row["cluster_id"], []).append(row)
    for members in by_cluster.values():
        mean = drop.vectors[[where[m["source_record_id"]] for m in members]].astype(np.float64).mean(axis=0)
        for m in members:
            np.testing.assert_allclose(vectors[released_at[m["released_record_id"]]], mean, rtol=1e-5, atol=1e-5)
        assert len({m["subject_id"] for m in members}) >= K
    order = [where[r["source_record_id"]] for r in sorted(link, key=lambda r: released_at[r["released_record_id"]])]
    assert order != sorted(order)
    v = verify_report(Path(res.report_dir), public_key=root / "data" / "keys" / "dev_signing.pub.pem")
    assert v.ok and v.authenticated, v.problems


def test_datasets_loads_the_feature_release(released, monkeypatch, tmp_path):
    datasets = pytest.importorskip("datasets", reason="the consumer extra (datasets) is not installed")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    _, res = released
    ds = datasets.load_dataset("parquet", data_files=str(Path(res.release_dir) / "release.parquet"), split="train",
                               cache_dir=str(tmp_path / "cache"))
    assert ds.num_rows == 300 and len(ds[0]["features"]) == 32 and set(ds.unique("gender")) == {"g0", "g1"}


def test_noise_control_is_rejected_by_the_feature_attacks(synth_drop, tmp_path):
    res = _release(synth_drop, tmp_path, method="noise", sigma=0.1)
    assert res.verdict == "rejected" and res.release_dir is None
    assert_nothing_published(tmp_path / "data" / "releases")
    assert not (Path(res.staging) / "release").exists()
    report = json.loads(Path(res.report).read_text())
    check = {c["name"]: c for c in report["checks"]}
    assert not check["reidentification_rate"]["passed"] and not report["privacy"]["exact_bound"]
    for attacker in FEATURE_ATTACKERS:
        rows = [r for r in res.privacy["reidentification"] if r["attacker"] == attacker]
        # Each attacker alone re-identifies far above 1/k: its lower bound is above it.
        assert max(r["lower"] for r in rows) > BOUND, (attacker, rows)
    assert report["dataset"]["records_released"] == 0


def _with_duplicates(src: Path, dst: Path, *, victims: int, k: int, noise: float) -> tuple[Path, dict[str, str]]:
    """The synthetic drop plus, for each victim, one of their vectors copied under k new ids with small noise."""
    d = read_feature_drop(src)
    rng = np.random.default_rng(0)
    sd = d.vectors.std(axis=0)
    vec, ids, labels = [d.vectors], list(d.subject_ids), {x: list(v) for x, v in d.label_values.items()}
    fake_of: dict[str, str] = {}
    for v in range(victims):
        i = PER_PERSON * v  # the first record of person v
        for j in range(k):
            vec.append((d.vectors[i] + noise * sd * rng.standard_normal(d.dim))[None, :])
            fake = f"dup-{v}-{j}"
            ids.append(fake)
            fake_of[fake] = d.subject_ids[i]
            for x in labels:
                labels[x].append(d.label_values[x][i])
    path = write_feature_drop(dst, vectors=np.vstack(vec), subject_ids=ids, labels=labels)
    return path, fake_of


def test_one_vector_duplicated_under_k_ids_is_caught(synth_drop, tmp_path):
    drop, fake_of = _with_duplicates(synth_drop, tmp_path / "dup", victims=3, k=K, noise=0.01)
    res = _release(drop, tmp_path / "proj", method="k-same-select")
    report = json.loads(Path(res.report).read_text())
    ident = report["configuration"]["identity"]
    assert ident["face_merges"] >= 3 * K and ident["people"] == PEOPLE  # every copy is its victim again
    assert all(m["evidence"] == "feature near-duplicate" for m in ident["examples"])
    # Merged, the victims are one person each: the release (if any) still hides them among k people,
    # counted on who the records really are (without the merge, measured: a cluster of the victim and
    # three of their copies under other ids was released, 4/5 of it one person).
    assert res.verdict == "released", res.reasons
    link = read_linkage(Path(res.linkage), load_linkage_key(tmp_path / "proj" / "data" / "keys" / "dev_linkage.key"))
    members: dict[str, list[str]] = {}
    for row in link:
        members.setdefault(row["cluster_id"], []).append(fake_of.get(row["subject_id"], row["subject_id"]))
    for who in members.values():
        assert len(set(who)) >= K and max(who.count(p) for p in who) / len(who) <= BOUND + 1e-12, who
    identity = resolve_feature_people(read_feature_drop(drop), policy="merge")
    person = dict(zip(read_feature_drop(drop).subject_ids, identity.person))
    assert all(person[fake] == person[victim] for fake, victim in fake_of.items())
    q = resolve_feature_people(read_feature_drop(drop), policy="quarantine")
    assert len(q.quarantined) >= 3 * K + 3 and {x.code for x in q.quarantined} == {"same_face_other_id"}


def test_feature_attackers_contract_and_tie_credit():
    s = synthetic_features(people=20, per_person=3, dim=16, seed=1)
    X, people = s.vectors.astype(np.float64), np.array(s.people)
    noisy = X + 0.05 * np.random.default_rng(0).standard_normal(X.shape)
    for attacker in (EuclideanAttacker(), IdentityClassifierAttacker()):
        a = attacker.fit(X, people=people)
        sim = a.similarity(noisy)
        assert sim.shape == (60, 60)
        assert rank_credit(sim, people, people).mean() > 0.9
    clf = IdentityClassifierAttacker(min_records=4).fit(X, people=people)
    assert clf.fallback_ is not None and len(clf.classes_) == 20  # nobody has 4 records: everyone is a class
    # k people released as one identical vector: any attacker names the right one at most 1/k of the time.
    released, clusters = deidentify_vectors(X, people=list(people), method="k-same", k=4)
    rows = attack_all(originals=X, original_people=people, released=released, released_people=people,
                      shape=(16,), modes=("naive", "reverse"), attackers=list(FEATURE_ATTACKERS))
    assert all(r["rate"] <= 0.25 + 1e-9 for r in rows)
    with pytest.raises(ConfigError, match="mixes face and feature-vector attackers"):
        attack_all(originals=X, original_people=people, released=X, released_people=people, shape=(16,),
                   modes=("naive",), attackers=["feature-euclidean", "lbp-chi2"])
    with pytest.raises(ConfigError, match=r"have 16 values but shape=\(8,\) says 8"):
        attack_all(originals=X, original_people=people, released=X, released_people=people, shape=(8,),
                   modes=("naive",), attackers=["feature-euclidean"])


@hsettings(max_examples=25, deadline=None)
@given(n_people=st.integers(6, 14), per=st.integers(1, 3), k=st.integers(2, 4), seed=st.integers(0, 1000))
def test_k_same_on_vectors_releases_cluster_means_of_k_people(n_people, per, k, seed):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n_people * per, 5)) * rng.uniform(0.1, 100, size=5)  # features of very different units
    people = [f"p{i // per}" for i in range(len(X))]
    released, clusters = deidentify_vectors(X, people=people, method="k-same", k=k)
    for c in np.unique(clusters):
        m = clusters == c
        assert len({people[i] for i in np.flatnonzero(m)}) >= k
        np.testing.assert_allclose(released[m], np.broadcast_to(X[m].mean(axis=0), released[m].shape),
                                   rtol=1e-9, atol=1e-9 * np.abs(X).max())


def test_vector_methods_refuse_image_methods_and_need_their_strength():
    X = np.random.default_rng(0).normal(size=(30, 4))
    people = [f"p{i % 10}" for i in range(30)]
    for method in ("blur", "pixelate", "k-same-eigen", "k-same-m"):
        with pytest.raises(ConfigError, match="does not run on feature vectors"):
            deidentify_vectors(X, people=people, method=method, k=2)
    with pytest.raises(ConfigError, match="sigma=None must be a number"):
        deidentify_vectors(X, people=people, method="noise")
    with pytest.raises(DataError, match="NaN or infinite"):
        deidentify_vectors(np.where(X > 2, np.nan, X), people=people, method="k-same", k=2)
    labels = {"g": ["a" if i % 2 else "b" for i in range(10)] * 3}
    run = vector_method_runner("k-same-select", k=2)
    out = run(X, people=people, partitions=labels["g"], labels=labels)
    assert out.shape == X.shape
    for method in ("multi-factor", "selective-mean", "attribute-preserving"):
        rel, _ = deidentify_vectors(X, people=people, method=method, k=3, labels=labels)
        assert rel.shape == X.shape and np.isfinite(rel).all() and not np.allclose(rel, X)


def test_cli_lists_the_feature_only_methods_of_the_registry():
    from deid.anonymise.methods import FEATURE_METHODS, FEATURE_ONLY, REGISTRY
    from deid.cli import FEATURE_ONLY_METHODS

    assert FEATURE_ONLY_METHODS == tuple(FEATURE_ONLY) and not set(FEATURE_ONLY) & set(REGISTRY)
    assert set(FEATURE_METHODS) <= set(REGISTRY) | set(FEATURE_ONLY)
