"""Feature drops through the one runner (run_release), the ledger and the watcher.

Through the Prefect flow and `deid run`: tests/flow/test_feature_flow.py (which shares this module's drop).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import assert_nothing_published

from deid.operations.run_result import RunResult
from deid.errors import ConfigError, DropError
from deid.intake.synth_features import make_feature_drop
from deid.operations.ledger import Ledger, drop_fingerprint
from deid.orchestration.watch import Watcher
from deid.reporting.verify import verify_release, verify_report
from deid.reporting.report import report_problems
from deid.run_config import RunConfig
from deid.settings import Settings

K = 5


@pytest.fixture(scope="module")
def feature_drop(tmp_path_factory) -> Path:
    """60 people x 3 records, 16-d, gender (per person) and expression (per record) labels, with _READY."""
    return make_feature_drop(tmp_path_factory.mktemp("ff") / "voices", people=60, per_person=3, dim=16, seed=3)


def _released_feature_run(res: RunResult, project: Path) -> dict:
    """What every released feature run must show: the typed result, a schema-valid signed report, the release."""
    assert isinstance(res, RunResult) and res.verdict == "released", res.reasons
    report = json.loads(res.report_path.read_text())
    assert report_problems(report) == []
    assert report["configuration"]["kind"] == "features" and report["configuration"]["feature_dim"] == 16
    assert report["lineage"]["applied"] is True and report["lineage"]["policy"] == "invariant"
    ds = res.report.dataset
    assert (ds.records_in, ds.records_released, ds.records_withheld) == (180, 180, 0)
    assert res.report.privacy.min_distinct_people_per_cluster >= K and res.report.privacy.exact_bound
    assert sorted(p.name for p in res.release_dir.iterdir()) == ["ATTESTATION.json", "ATTESTATION.json.sig",
                                                                 "MANIFEST.sha256", "README.md", "metadata.csv",
                                                                 "release.parquet"]
    assert report["file_manifest"]["files"] == 0  # no image: the empty manifest, the image runs' listing
    # The card was written before signing: the signed artifacts list it, and the signature verifies.
    assert "README.md" in {a["path"] for a in report["artifacts"]}
    v = verify_report(res.report_dir, public_key=project / "data" / "keys" / "dev_signing.pub.pem")
    assert v.ok and v.authenticated, v.problems
    # The release verifies alone too, by its signed attestation (which the report lists).
    assert {"ATTESTATION.json", "ATTESTATION.json.sig"} <= {a["path"] for a in report["artifacts"]}
    v = verify_release(res.release_dir, public_key=project / "data" / "keys" / "dev_signing.pub.pem")
    assert v.ok and v.authenticated, v.problems
    assert {"ingest", "identity", "partition", "deidentify", "stage", "gate", "publish"} <= set(res.timings)
    assert not (res.staging / "release").exists() and res.linkage.is_file()
    return report


def test_run_release_releases_a_feature_drop_with_the_image_runs_result(feature_drop, project):
    from deid.operations.runner import run_release

    # Resolved without kind (as for images): run_release reads the drop's kind itself.
    res = run_release(feature_drop, RunConfig.resolve(Settings(), k=K))
    _released_feature_run(res, project)
    summary = res.summary()
    assert summary["verdict"] == "released" and summary["dataset"]["records_released"] == 180
    assert "released feature vectors" in (res.report_dir / "report.html").read_text().lower()


def test_feature_multi_factor_cells_carry_the_exact_bound_the_gate_found(feature_drop, project):
    from deid.operations.runner import run_release

    # Multi-factor promises no formal bound, but on vectors too each identity cluster x label cell is one
    # identical vector: the report says the exact bound holds in this release, as on images.
    res = run_release(feature_drop, RunConfig.resolve(Settings(), k=K, method="multi-factor", kind="features"))
    priv = res.report.privacy
    assert priv.exact_bound and priv.min_distinct_people_per_cluster >= K and priv.max_person_share <= 1 / K
    assert res.report.guarantee.startswith(f"exact in this release: 1/k = 1/{K} bound"), res.report.guarantee
    assert "no formal guarantee" in res.report.guarantee


def test_a_feature_publish_failing_after_signing_gets_the_runners_signed_addendum(feature_drop, project,
                                                                                  monkeypatch):
    import errno
    import os

    import deid.release.publish
    from deid.errors import EnvironmentFailure
    from deid.operations.runner import run_release

    def refuse(staged, final):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(final))

    monkeypatch.setattr(deid.release.publish, "commit_release", refuse)
    with pytest.raises(EnvironmentFailure, match="after its report was signed"):
        run_release(feature_drop, RunConfig.resolve(Settings(), k=K, kind="features"))
    (report_dir,) = list((project / "reports").iterdir())
    assert json.loads((report_dir / "report.json").read_text())["verdict"] == "released"
    add = json.loads((report_dir / "addendum.json").read_text())
    assert add["event"] == "publish_failed" and add["release_published"] is False
    res = verify_report(report_dir, public_key=project / "data" / "keys" / "dev_signing.pub.pem")
    assert res.authenticated and any(n.startswith("addendum: publish_failed") for n in res.notes)
    assert_nothing_published(project / "data" / "releases")
    assert not list((project / "data" / "staging").iterdir())
    assert not (project / "data" / "private").exists() or not list((project / "data" / "private").rglob("*.bin"))


def test_run_config_checks_the_method_against_the_drop_kind():
    with pytest.raises(ConfigError, match="does not run on feature vectors"):
        RunConfig.resolve(Settings(), k=K, method="blur", kind="features")
    with pytest.raises(ConfigError, match="needs sigma"):
        RunConfig.resolve(Settings(), k=K, method="noise", kind="features")
    with pytest.raises(ConfigError, match="method='noise' must be one of"):
        RunConfig.resolve(Settings(), k=K, method="noise", sigma=0.1)  # an image drop has no noise method
    assert RunConfig.resolve(Settings(), k=K, method="noise", sigma=0.1, kind="features").spec.name == "noise"


def test_ledger_fingerprint_of_a_feature_drop_is_its_content(feature_drop, tmp_path):
    a = tmp_path / "a"
    shutil.copytree(feature_drop, a)
    fa = drop_fingerprint(a)
    assert fa.startswith("sha256:") and drop_fingerprint(a) == fa == drop_fingerprint(feature_drop)
    (a / "_READY").write_bytes(b"touched")
    assert drop_fingerprint(a) == fa
    # One changed value in the vectors file, or a changed drop.yaml, is other content.
    b = tmp_path / "b"
    shutil.copytree(feature_drop, b)
    t = pq.read_table(b / "vectors.parquet")
    subjects = t.column("subject_id").to_pylist()
    subjects[0] = subjects[1]
    pq.write_table(t.set_column(t.schema.get_field_index("subject_id"), "subject_id", pa.array(subjects)),
                   b / "vectors.parquet")
    assert drop_fingerprint(b) != fa
    c = tmp_path / "c"
    shutil.copytree(feature_drop, c)
    (c / "drop.yaml").write_text((c / "drop.yaml").read_text() + "license: cc0-1.0\n")
    assert drop_fingerprint(c) != fa
    # Neither manifest.csv nor a feature drop.yaml: nothing to fingerprint.
    d = tmp_path / "d"
    shutil.copytree(feature_drop, d)
    (d / "drop.yaml").write_text("name: x\n")
    with pytest.raises(DropError, match="no manifest.csv"):
        drop_fingerprint(d)


def test_the_watcher_announces_a_feature_drop_once(feature_drop, tmp_path):
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    shutil.copytree(feature_drop, incoming / "first")
    shutil.copytree(feature_drop, incoming / "second")  # the same content under another name
    sent = []
    w = Watcher(incoming, Ledger(tmp_path / "ledger.sqlite"), emit=lambda d, fp: sent.append((d.name, fp)) or "ev")
    rows = {Path(r["drop"]).name: r for r in w.scan()}
    assert rows["first"]["outcome"] == "announce" and rows["second"]["outcome"] == "duplicate"
    assert sent == [("first", drop_fingerprint(feature_drop))]
