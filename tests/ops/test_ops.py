"""Operations end to end: a real Prefect server, `deid serve` and `deid watch` processes, the UI in Chromium.

The stack (server, serve, watch) and its two first releases are the session fixtures ``stack`` and
``two_releases`` of tests/ops_helpers.py, shared with the other ops modules (test_ops_lineage redrops
the first drop's dataset): runs, reports and ledger entries are looked up by drop name.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from ops_helpers import SITES, api, browser, chromium, drop_into, runs_for, wait_for

from deid.operations.ledger import Ledger
from deid.reporting.verify import verify_report

pytestmark = [pytest.mark.slow, pytest.mark.ops, pytest.mark.xdist_group("ops")]
RESENT = "site-a-2026-01-resent"


def _iso(ts: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def test_drops_are_released_once_each(stack, two_releases):
    url, project = stack["url"], stack["project"]
    runs = two_releases["runs"]
    assert len(runs) == 2 and all(r["state_type"] == "COMPLETED" for r in runs)
    assert {Path(r["parameters"]["drop"]).name for r in runs} == {"site-a-2026-01", "site-b-2026-01"}
    ledger = Ledger(project / "data" / "ledger.sqlite")
    # (The stack is shared with the other ops modules: their drops have other names.)
    entries = {Path(e.drop_path).name: e for e in ledger.entries() if Path(e.drop_path).name.startswith("site-")}
    assert set(entries) == set(SITES)
    figures = {}
    for name, e in entries.items():
        assert e.status == "released" and e.verdict == "released", e
        report = Path(e.report)
        assert report.is_file() and report.with_name("report.json.sig").is_file()
        res = verify_report(report.parent, public_key=project / "data" / "keys" / "dev_signing.pub.pem")
        assert res.ok and res.authenticated, res.problems
        body = json.loads(report.read_text())
        assert body["verdict"] == "released" and body["release_id"] == e.release_id
        ds = body["dataset"]
        assert ds["records_in"] == 120 == ds["records_released"] + ds["records_suppressed"] + ds["records_quarantined"]
        run = next(r for r in runs if Path(r["parameters"]["drop"]).name == name)
        t_drop = two_releases["dropped_at"][name]
        figures[name] = {"drop_to_flow_start_s": round(_iso(run["start_time"]) - t_drop, 1),
                         "drop_to_report_s": round(report.stat().st_mtime - t_drop, 1)}
        # The drop triggered the run and the run wrote the report (latency itself is a benchmark
        # figure, printed below, never a pass/fail threshold of a test on a shared machine).
        assert 0 <= figures[name]["drop_to_flow_start_s"] <= figures[name]["drop_to_report_s"], figures
    print(f"\nops figures: server healthy after {stack['server_seconds']} s; {json.dumps(figures)}")

    # The same content again under another name: reported as a duplicate, never released twice.
    reports = {p.parent.name for p in (project / "reports").glob("*/report.json")}
    assert {e.release_id for e in entries.values()} <= reports
    n_entries = len(ledger.entries())
    t_dup = drop_into(stack["incoming"], two_releases["src"], RESENT)
    wait_for("the watcher's duplicate report",
             lambda: any(s["outcome"] == "duplicate" and s["drop_path"].endswith("-resent")
                         for s in ledger.sightings()), 30, stack["procs"])
    assert "duplicate:" in stack["watch"].log.read_text()
    time.sleep(4)  # two runner polls: a wrongly triggered run would exist by now
    assert len(runs_for(url, "release-on-drop", (*SITES, RESENT))) == 2
    assert len(runs_for(url, "release", (*SITES, RESENT))) == 2
    assert {p.parent.name for p in (project / "reports").glob("*/report.json")} == reports
    assert len(ledger.entries()) == n_entries
    print(f"duplicate detected {round(time.time() - t_dup, 1)} s after drop (upper bound)")

    # A duplicate event (e.g. replayed) reaching release-on-drop does not release either.
    dup = api(url, "/deployments/name/release-on-drop/release-on-drop", None)
    fr = api(url, f"/deployments/{dup['id']}/create_flow_run",
             {"parameters": {"drop": str(stack["incoming"] / RESENT)}})
    final = wait_for("the replayed run", lambda: (r := api(url, f"/flow_runs/{fr['id']}"))["state_type"] in (
        "COMPLETED", "FAILED", "CRASHED") and r, 300, stack["procs"])
    assert final["state_type"] == "COMPLETED"
    assert len(runs_for(url, "release", (*SITES, RESENT))) == 2 and len(ledger.entries()) == n_entries
    assert {p.parent.name for p in (project / "reports").glob("*/report.json")} == reports


def test_flow_run_page_in_a_realbrowser(stack, two_releases, tmp_path):
    exe = chromium()
    url, port = stack["url"], stack["port"]
    run = two_releases["runs"][0]
    page = f"http://127.0.0.1:{port}/runs/flow-run/{run['id']}"
    dom = browser(exe, tmp_path / "profile", page)
    assert run["name"] in dom, f"flow run name {run['name']!r} not in the UI page's DOM"
    assert "Completed" in dom and "release-on-drop" in dom
    shot = tmp_path / "flow-run.png"
    browser(exe, tmp_path / "profile", page, screenshot=shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    # Artifacts of the run (the ledger outcome) and of its release subflow (the verdict), each shown.
    subflows = api(url, "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run["id"]]}}})
    ids = [run["id"], *(s["id"] for s in subflows)]
    artifacts = api(url, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": ids}}})
    assert {"deid-ledger", "deid-verdict"} <= {a["key"] for a in artifacts}, [a["key"] for a in artifacts]
    for art in artifacts:
        dom = browser(exe, tmp_path / "profile", f"http://127.0.0.1:{port}/artifacts/artifact/{art['id']}")
        assert (art["key"] or art["id"]) in dom, f"artifact {art['key']} not shown"
        if art["key"] == "deid-ledger":
            release_id = re.search(r"rel-[0-9a-f]+", art["data"]).group(0)
            assert release_id in dom, f"the ledger artifact's release id {release_id} is not shown"
    print(f"\nUI: {page} ({len(artifacts)} artifact(s)); screenshot {shot}")
