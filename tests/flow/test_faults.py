"""Faults of the release flow in-process (issue 11): a publish failing after signing, and rare labels and formulas.

A publish that fails after the report was signed leaves a signed addendum and nothing published; a
suppressed partition's label value is in no report and a formula label is neutralised in release.csv.
The fault matrix of `deid run` processes (kills at every stage, full disks) is tests/ops/test_faults.py.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import assert_nothing_published, identifying_text_in_reports
from ops.test_faults import FAST

from deid.intake.synth import make_synthetic_drop
from deid.operations.safety import ADDENDUM_NAME
from deid.reporting.verify import verify_report

pytestmark = pytest.mark.slow


def test_rare_labels_stay_out_of_the_report_and_formulas_out_of_release_csv(project, prefect_server, tmp_path,
                                                                           monkeypatch):
    """A suppressed partition is described by counts only; a formula label is neutralised in release.csv."""
    import csv

    from deid.flows.release import run_flow
    from deid.reporting.catalogue_page import write_index

    for key, value in FAST.items():
        monkeypatch.setenv(key, value)
    # 30 people: label cells of ~7 people, so the cross-fitted utility check (which
    # de-identifies 4/5 of the people per fold) is not starved of whole cells.
    def rare_drop(name: str, seed: int) -> tuple[Path, list[str]]:
        drop = make_synthetic_drop(tmp_path / name, people=30, images_per_person=2, seed=seed)
        lines = (drop / "manifest.csv").read_text().splitlines()
        out = [lines[0]]
        for line in lines[1:]:
            cells = line.split(",")
            if cells[1] == "s00001":
                cells[3] = "RAREVALUE"  # one person: a partition of 1 < k people, suppressed
            if cells[2] == "female":
                cells[2] = '=HYPERLINK("http://x")'.replace(",", ";")
            out.append(",".join(cells))
        (drop / "manifest.csv").write_text("\n".join(out) + "\n")
        return drop, out

    drop, out = rare_drop("drop", 1)
    result = run_flow(str(drop), k=3).summary()
    assert result["verdict"] == "released", result["reasons"]
    assert result["dataset"]["records_suppressed"] >= 1
    report_dir = Path(result["report_dir"])
    leaked = [p.relative_to(report_dir).as_posix() for p in report_dir.rglob("*")
              if p.is_file() and b"RAREVALUE" in p.read_bytes()]
    assert not leaked, f"a suppressed partition's label value appears in {leaked}"
    report = json.loads((report_dir / "report.json").read_text())
    small = report["configuration"]["small_partitions_detail"]
    assert all(set(e) == {"records", "people", "action"} for e in small)
    # The one-person partition is held back either by the partition policy or, for a dataset's
    # lineage, by the release plan (newcomers wait until k of them share a partition): by counts.
    lineage = report.get("lineage") or {}
    by_reason = lineage.get("suppressed_by_reason", {})
    assert small or (lineage.get("suppressed_records", 0) >= 1 and by_reason), (small, lineage)
    assert all(isinstance(v, int) for v in by_reason.values())
    with open(Path(result["release_dir"]) / "release.csv", newline="", encoding="utf-8") as fh:
        genders = {r["gender"] for r in csv.DictReader(fh)}
    assert "'=HYPERLINK(\"http://x\")" in genders and not any(g.startswith("=") for g in genders)
    # Issue 28: merging the small partition instead kept the rare value in the would-be release, and the
    # rejection's reasons, report.html and validation page named it; now counted, never named. No report
    # (the released one, the rejection, the validation pages, the catalogue) names a subject id either.
    # A first release: other people (another seed, the same ids and labels). The same photographs under another
    # dataset name would be refused by the project's person index (issue 27), before the gate.
    other, out2 = rare_drop("other", 2)
    merged = run_flow(str(other), k=3, small_partitions="merge", name="rare-merge").summary()
    assert merged["verdict"] == "rejected" and any("expectations_release" in r for r in merged["reasons"])
    subjects = {line.split(",")[1] for line in out[1:] + out2[1:]}
    write_index(project / "reports")
    # Every kind of file the issue names was written and read: both runs' reports and pages, a validation
    # page of each, and the catalogue.
    reports = sorted(p.parent.name for p in (project / "reports").glob("*/report.json"))
    assert len(reports) == 2, reports
    kinds = [f"{rid}/{name}" for rid in reports for name in ("report.json", "report.html", "validation/*.html")]
    leaked = identifying_text_in_reports(project / "reports", ["RAREVALUE", *sorted(subjects)],
                                         must_read=[*kinds, "index.html"])
    assert not leaked, f"a rare label value or a subject id in a report: {leaked[:10]}"


def test_publish_failing_after_signing_leaves_a_signed_addendum_and_nothing_published(project, prefect_server,
                                                                                       tmp_path, monkeypatch):
    import errno

    import deid.release.publish
    from deid.errors import EnvironmentFailure
    from deid.flows.release import run_flow

    for key, value in FAST.items():
        monkeypatch.setenv(key, value)

    def refuse(staged, final):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(final))

    monkeypatch.setattr(deid.release.publish, "commit_release", refuse)
    drop = make_synthetic_drop(tmp_path / "drop", people=12, images_per_person=2, seed=1)
    with pytest.raises(EnvironmentFailure, match="after its report was signed"):
        run_flow(str(drop), k=3)
    (report_dir,) = list((project / "reports").iterdir())
    pub = project / "data" / "keys" / "dev_signing.pub.pem"
    assert json.loads((report_dir / "report.json").read_text())["verdict"] == "released"
    add = json.loads((report_dir / ADDENDUM_NAME).read_text())
    assert add["event"] == "publish_failed" and add["release_published"] is False
    res = verify_report(report_dir, public_key=pub)
    # The report is genuine, the release it describes was never published, and verify says both.
    assert not res.ok and res.authenticated and any("not found" in p for p in res.problems)
    assert any(n.startswith("addendum: publish_failed") for n in res.notes)
    assert_nothing_published(project / "data" / "releases")
    assert not list((project / "data" / "staging").iterdir())
    assert not (project / "data" / "private").exists() or not list((project / "data" / "private").rglob("*.bin"))
    # A forged addendum does not verify.
    (report_dir / ADDENDUM_NAME).write_text((report_dir / ADDENDUM_NAME).read_text().replace("publish_failed", "x"))
    assert any("bad signature: addendum" in p for p in verify_report(report_dir, public_key=pub).problems)
