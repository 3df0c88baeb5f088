"""Sensitive columns (drop.yaml `sensitive`): never a partition label, released only when every cluster is l-diverse."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from deid.errors import ConfigError
from deid.evaluation.sensitive import least_diverse, sensitive_release
from deid.intake.drop import read_drop
from deid.intake.synth import make_synthetic_drop


def test_released_only_when_every_cluster_is_l_diverse():
    clusters = ["c1"] * 3 + ["c2"] * 3
    diverse = ["flu", "hiv", "flu", "flu", "none", "hiv"]
    homogeneous = ["hiv", "hiv", "hiv", "flu", "none", "flu"]  # c1: one value, linking to c1 reveals it
    assert least_diverse(clusters, diverse) == 2 and least_diverse(clusters, homogeneous) == 1
    released, check = sensitive_release(clusters, {"diagnosis": diverse, "status": homogeneous}, l=2)
    assert released == ["diagnosis"]
    assert check.name == "sensitive_l_diversity" and check.value == 1 and check.threshold == ">= 2"
    assert check.passed and check.status == "not_applicable" and "withheld" in check.detail
    assert not any(v in check.detail for v in ("hiv", "flu", "none"))  # counts, never values
    released, check = sensitive_release(clusters, {"diagnosis": diverse}, l=2)
    assert released == ["diagnosis"] and check.status == "pass" and check.value == 2
    assert sensitive_release(clusters, {"diagnosis": diverse}, l=3)[0] == []
    # No clusters (blur, pixelate): nothing can be l-diverse; republished rows without values: withheld.
    assert sensitive_release(None, {"diagnosis": diverse}, l=2)[0] == []
    assert sensitive_release(clusters, {"diagnosis": diverse}, l=2, why_not="counterfeits")[0] == []
    with pytest.raises(ConfigError, match="DEID_SENSITIVE_L"):
        sensitive_release(clusters, {"diagnosis": diverse}, l=0)


def test_entropy_l_diversity_withholds_a_cluster_one_value_dominates():
    """Distinct l counts a cluster of nine 'hiv' and one 'flu' as 2-diverse; entropy l (exp H = 1.38) does not."""
    import math

    clusters = ["c1"] * 10 + ["c2"] * 4
    skewed = ["hiv"] * 9 + ["flu"] + ["flu", "hiv", "flu", "hiv"]
    assert least_diverse(clusters, skewed) == 2
    want = math.exp(-(0.9 * math.log(0.9) + 0.1 * math.log(0.1)))
    assert least_diverse(clusters, skewed, "entropy") == pytest.approx(want, abs=1e-6) and 1.38 < want < 1.39
    # l equally frequent values give exactly l (c2: two values twice each).
    assert least_diverse(["c"] * 4, ["a", "b", "a", "b"], "entropy") == 2.0
    assert sensitive_release(clusters, {"diagnosis": skewed}, l=2)[0] == ["diagnosis"]
    released, check = sensitive_release(clusters, {"diagnosis": skewed}, l=2, measure="entropy")
    assert released == [] and check.value == pytest.approx(want, abs=1e-6) and check.threshold == ">= 2"
    assert "exp(entropy) is 1.384" in check.detail and "withheld" in check.detail and "entropy l-diversity" \
        in check.detail
    assert not any(v in check.detail for v in ("hiv", "flu"))
    balanced = ["hiv"] * 5 + ["flu"] * 5 + ["flu", "hiv", "flu", "hiv"]
    assert sensitive_release(clusters, {"diagnosis": balanced}, l=2, measure="entropy")[0] == ["diagnosis"]
    with pytest.raises(ConfigError, match="DEID_SENSITIVE_DIVERSITY"):
        sensitive_release(clusters, {"diagnosis": balanced}, l=2, measure="shannon")


def test_the_diversity_setting_reaches_the_run(monkeypatch):
    from deid.run_config import RunConfig
    from deid.settings import Settings

    assert RunConfig.resolve(Settings(), k=3).sensitive_diversity == "distinct"
    monkeypatch.setenv("DEID_SENSITIVE_DIVERSITY", "entropy")
    assert RunConfig.resolve(Settings(), k=3).sensitive_diversity == "entropy"
    monkeypatch.setenv("DEID_SENSITIVE_DIVERSITY", "shannon")
    with pytest.raises(ValueError, match="sensitive_diversity"):
        Settings()


def _with_columns(drop: Path, sensitive: list[str], labels: list[str] | None = None) -> Path:
    """Add `diagnosis` (each person's two images: flu, hiv), `cohort` (one value for all) and `ward` (one value per
    person, so every cluster of >= k distinct people holds >= k values) to a synth drop."""
    path = drop / "manifest.csv"
    rows = list(csv.DictReader(path.open()))
    seen: dict[str, int] = {}
    for r in rows:
        n = seen[r["subject_id"]] = seen.get(r["subject_id"], -1) + 1
        r["diagnosis"] = ("flu", "hiv")[n % 2]
        r["cohort"] = "trial-a"
        r["ward"] = f"ward-{list(seen).index(r['subject_id']):03d}"  # first-seen order: one value per person
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    meta = yaml.safe_load((drop / "drop.yaml").read_text()) if (drop / "drop.yaml").exists() else {}
    meta["sensitive"] = sensitive
    if labels is not None:
        meta["labels"] = labels
    (drop / "drop.yaml").write_text(yaml.safe_dump(meta))
    return drop


def test_a_sensitive_label_is_refused_and_a_sensitive_column_is_not_a_label(tmp_path):
    drop = _with_columns(make_synthetic_drop(tmp_path / "d", people=4, images_per_person=2, seed=1),
                         ["diagnosis"], labels=["gender", "diagnosis"])
    with pytest.raises(ConfigError, match=r"\['diagnosis'\].*never a partition label"):
        read_drop(drop)
    meta = yaml.safe_load((drop / "drop.yaml").read_text())
    meta["labels"] = ["gender"]
    (drop / "drop.yaml").write_text(yaml.safe_dump(meta))
    d = read_drop(drop)
    assert d.labels == ["gender"] and d.sensitive == ["diagnosis"]
    assert "diagnosis" in d.rows.table.column_names and "diagnosis" not in d.extra_columns
    assert "cohort" in d.extra_columns  # not declared: kept out of the release


@pytest.mark.slow
def test_a_run_releases_the_diverse_column_and_withholds_the_homogeneous_one(tmp_path):
    from deid.operations.runner import run_release
    from deid.run_config import RunConfig
    from deid.settings import Settings

    drop = _with_columns(make_synthetic_drop(tmp_path / "drop", people=12, images_per_person=2, seed=1),
                         ["diagnosis", "cohort", "ward"])
    settings = Settings(project_dir=tmp_path / "project", identity_embed_max=0, deep_attack_sample=20, min_probes=4,
                        cv_repeats=1)
    result = run_release(drop, RunConfig.resolve(settings, k=3))
    assert result.verdict == "released", result.reasons
    report = json.loads(result.report_path.read_text())
    check = {c["name"]: c for c in report["checks"]}["sensitive_l_diversity"]
    # cohort is one value everywhere: every cluster is homogeneous, it is withheld whatever the clustering.
    assert check["value"] == 1 and "withheld" in check["detail"] and "cohort: least diverse cluster holds 1" \
        in check["detail"]
    assert report["configuration"]["sensitive_columns"] == ["diagnosis", "cohort", "ward"]
    assert report["configuration"]["sensitive_diversity"] == "distinct"
    table = pq.read_table(result.release_dir / "release.parquet")
    assert "cohort" not in table.column_names
    # ward (one value per person) is l-diverse in every cluster of >= k = 3 people: released, every cluster holding
    # at least 3 of its values.
    assert "ward: least diverse cluster holds" in check["detail"] and "ward" in table.column_names
    wards: dict = {}
    for c, v in zip(table.column("cluster_id").to_pylist(), table.column("ward").to_pylist()):
        wards.setdefault(c, set()).add(v)
    assert min(len(s) for s in wards.values()) >= 3
    assert "cohort" not in (result.release_dir / "metadata.csv").read_text().splitlines()[0]
    # diagnosis (flu and hiv per person) is released exactly when its least diverse cluster holds both.
    least = int(re.search(r"diagnosis: least diverse cluster holds (\d+)", check["detail"]).group(1))
    assert ("diagnosis" in table.column_names) == (least >= 2)
    if "diagnosis" in table.column_names:
        per = {}
        for c, v in zip(table.column("cluster_id").to_pylist(), table.column("diagnosis").to_pylist()):
            per.setdefault(c, set()).add(v)
        assert min(len(s) for s in per.values()) == least
    text = "".join(p.read_text(errors="ignore") for p in result.report_dir.iterdir() if p.suffix in (".json", ".html"))
    assert "trial-a" not in text and "hiv" not in text
    m = report["privacy"]["membership"]
    # 6 members in 4 label partitions cannot make k=3 clusters: not measured, and the report says why.
    assert (m["status"] == "measured" and m["members"] + m["non_members"] == 12) or \
        (m["status"] == "not_applicable" and "could not re-make a release" in m["reason"]), m
    assert report["privacy"]["scope"]["does_not_protect"].startswith("Membership")


def test_the_stage_releases_a_column_only_when_every_cluster_is_l_diverse():
    import types

    import pyarrow as pa

    from deid.contracts import ReleaseRows
    from deid.operations.release_staging import _sensitive_columns

    meta = pa.table({"record_id": [f"r{i}" for i in range(6)],
                     "diagnosis": ["flu", "hiv", "flu", "hiv", "flu", "none"], "cohort": ["a"] * 6})
    ing = types.SimpleNamespace(sensitive=("diagnosis", "cohort"), metadata=meta)
    config = types.SimpleNamespace(sensitive_l=2, sensitive_diversity="distinct",
                                   spec=types.SimpleNamespace(clustered=True))
    rows = ReleaseRows(vectors=None, shape=(2, 2), clusters=("c1",) * 3 + ("c2",) * 3, labels={},
                       record_ids=tuple(f"r{i}" for i in range(6)))
    cols, check = _sensitive_columns(rows, ing, config)
    assert list(cols) == ["diagnosis"] and cols["diagnosis"] == ("flu", "hiv", "flu", "hiv", "flu", "none")
    assert check.value == 1 and "['cohort']" in check.detail
    # A counterfeit row of a republished cluster (no source record): every sensitive column withheld.
    fake = ReleaseRows(vectors=None, shape=(2, 2), clusters=(*rows.clusters, "c2"), labels={},
                       record_ids=(*rows.record_ids, "counterfeit-1"))
    cols, check = _sensitive_columns(fake, ing, config)
    assert cols == {} and "republishes registered clusters" in check.detail
    config.sensitive_l = 3
    assert _sensitive_columns(rows, ing, config)[0] == {}
    # Entropy l: c1 holds flu twice and hiv once, exp(H) = 1.89 < 2: withheld, where distinct l = 2 released it.
    config.sensitive_l, config.sensitive_diversity = 2, "entropy"
    cols, check = _sensitive_columns(rows, ing, config)
    assert cols == {} and check.value == 1.0 and "diagnosis: least diverse cluster's effective number of values " \
        "exp(entropy) is 1.890" in check.detail


def test_a_feature_drop_refuses_a_sensitive_label(tmp_path):
    from deid.intake.features import read_feature_drop
    from deid.intake.synth_features import make_feature_drop

    drop = make_feature_drop(tmp_path / "f", people=6, per_person=2, dim=4, seed=1)
    meta = yaml.safe_load((drop / "drop.yaml").read_text())
    meta["sensitive"] = [meta["labels"][0]]
    (drop / "drop.yaml").write_text(yaml.safe_dump(meta))
    with pytest.raises(ConfigError, match="never a label"):
        read_feature_drop(drop)
