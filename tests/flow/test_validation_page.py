"""The offline validation page and report.html of a whole flow run, on REAL Great Expectations output.

The pages of suites run for real through the core stages (fast) are tests/integration/test_validation_page.py.
"""
from __future__ import annotations

import html
import json
import logging
from pathlib import Path

import pytest
from pagecheck import Page, assert_validation_page_names_every_expectation

from deid.intake.synth import make_synthetic_drop
from deid.evaluation.validation import suite_results



class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.slow
def test_a_real_runs_pages(project, prefect_server, tmp_path):
    """One flow run: its validation page names every expectation, report.html reads at a glance,
    and the long stages reported their progress (throttled)."""
    from deid.flows.release import run_flow

    # Our own handler: Prefect's logging set-up replaces the root handlers pytest's caplog relies on.
    progress_log = logging.getLogger("deid.progress")
    seen = _Lines()
    progress_log.addHandler(seen)
    # setLevel, not an assignment to .level: logging caches isEnabledFor per logger, and only
    # setLevel clears that cache (an earlier test's WARNING root would otherwise still drop INFO here).
    level = progress_log.level
    progress_log.setLevel(logging.INFO)
    try:
        drop = make_synthetic_drop(tmp_path / "drop", people=20, images_per_person=2, seed=11, image_size=120)
        result = run_flow(str(drop), k=3).summary()
    finally:
        progress_log.removeHandler(seen)
        progress_log.setLevel(level)
    report_dir = Path(result["report_dir"])
    report = json.loads((report_dir / "report.json").read_text())
    on_disk = json.loads((report_dir / "validation" / "validation_results.json").read_text())
    suites = suite_results(report["validation"])
    assert suites == suite_results(on_disk) and [s.suite for s in suites] == [
        "manifest", "ingested", "aligned", "release"]
    validation = (report_dir / "validation" / "index.html").read_text()
    assert_validation_page_names_every_expectation(validation, suites)
    # Whose page it is, and the way back (issue 29 item 10).
    assert f"release {report['release_id']} (RELEASED)" in Page(validation).headings[0][2]
    assert '<a href="../report.html">' in validation and (report_dir / "validation" / "../report.html").is_file()

    doc = (report_dir / "report.html").read_text()
    page = Page(doc)
    counts = page.table_after("suite")
    assert [r[3:6] for r in counts[1:]] == [[str(s.evaluated), str(s.passed), str(s.failed)] for s in suites]
    # The guarantee sentence of report.json, under the verdict (before any evidence).
    assert 0 < doc.index(html.escape(report["guarantee"])) < doc.index("<h2>Checks</h2>")
    checks = page.table_after("requirement")
    assert all(c[2] == "\u2014" or c[2].startswith(("<=", ">=", "=", "only:", "accuracy drop <=",
                                                    "every partition >="))
               for c in checks[1:]), [c[2] for c in checks[1:]]
    partitions = page.table_after("partition")
    assert partitions[0][0] == "partition (gender / expression)"
    assert {r[0] for r in partitions[1:]} <= {"female / neutral", "female / smile", "male / neutral", "male / smile"}
    assert "['" not in doc and "<pre>{" not in doc

    lines = seen.lines
    assert any(x.startswith("gate: attacks on") and "done in" in x for x in lines), lines
    assert any(x.startswith("gate: utility cross-fit") and "done in" in x for x in lines), lines
    assert len(lines) < 40, lines  # throttled: a few lines per stage, not one per unit
