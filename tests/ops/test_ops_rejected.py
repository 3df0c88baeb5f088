"""Ops: a drop the gate rejects, through `deid watch` and `deid serve`: visibly Rejected, settled, never retried."""
from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from ops_helpers import api, drop_into, flow_runs, wait_for

from deid.intake.synth import make_synthetic_drop
from deid.operations.ledger import Ledger

# The session's ops stack (tests/ops_helpers.py) is shared with the other ops modules: this test finds
# its runs, ledger entry and release by its own drop name.
pytestmark = [pytest.mark.slow, pytest.mark.ops, pytest.mark.xdist_group("ops")]
NAME = "tiny-2026-01"


def _runs_of(url: str, flow: str) -> list[dict]:
    return [r for r in flow_runs(url, flow) if Path(str(r["parameters"].get("drop"))).name == NAME]


def test_a_rejected_drop_is_settled_and_not_retried(stack, tmp_path):
    url, project = stack["url"], stack["project"]
    # Two people at the default k=5: the drop check enough_people rejects it (cheaply, before alignment).
    drop_into(stack["incoming"], make_synthetic_drop(tmp_path / "few", people=2, images_per_person=2, seed=3), NAME)
    run = wait_for("the release-on-drop run to end", lambda: next(
        (r for r in _runs_of(url, "release-on-drop") if r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")), None),
        600, stack["procs"], interval=1.0)
    (sub,) = _runs_of(url, "release")
    assert (sub["state_type"], sub["state_name"]) == ("FAILED", "Rejected") and "verdict:rejected" in sub["tags"]
    # Counted once: the release subflow is the drop's one failed run; the release-on-drop run that settled it
    # ends Completed, named Rejected, and is named and tagged like its subflow (never a random name).
    assert (run["state_type"], run["state_name"]) == ("COMPLETED", "Rejected"), run["state"]
    failed = [r for flow in ("release", "release-on-drop") for r in _runs_of(url, flow) if r["state_type"] == "FAILED"]
    assert [r["id"] for r in failed] == [sub["id"]]
    assert run["name"] == sub["name"], (run["name"], sub["name"])
    assert set(sub["tags"]) <= set(run["tags"]), (run["tags"], sub["tags"])
    # A normal rejection is no error: no ERROR line on either run, no engine traceback in `deid serve`'s log.
    errors = api(url, "/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"], sub["id"]]},
                                                "level": {"ge_": 40}}})
    assert errors == [], [e["message"][:300] for e in errors]
    assert "Engine execution exited with unexpected exception" not in stack["serve"].log.read_text()
    # `deid watch` prints the verdict once the run settled the drop (the summary `deid run` prints).
    watched = wait_for("the watcher's verdict line", lambda: (t := stack["watch"].log.read_text()) and
                       f"{NAME} (release " in t and t, 60, stack["procs"])
    after = watched[watched.index("verdict of "):]
    assert f"{NAME} (release " in after and "verdict: REJECTED" in after and "cause: " in after, after[:1500]
    # The Parameters tab: the values used (drop.yaml's labels, only the parameters the method takes).
    report = json.loads(Path(next(e for e in Ledger(project / "data" / "ledger.sqlite").entries()
                                  if Path(e.drop_path).name == NAME).report).read_text())
    assert sub["parameters"]["labels"] == report["configuration"]["labels"] != []
    assert {"sigma", "block"}.isdisjoint(sub["parameters"]) and sub["parameters"]["k"] == report["k"]
    assert sub["parameters"]["name"] == "few" and sub["name"] == f"few k={report['k']} {report['method']}", sub
    # The report artifact is a link that opens report.html from `deid server`'s reports server.
    (link,) = api(url, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [sub["id"]]},
                                                            "key": {"any_": ["deid-report"]}}})
    # (Prefect stores a link artifact as Markdown: `[text](url)`.)
    href = re.fullmatch(rf"\[report\.html of {report['release_id']}\]\((http://127\.0\.0\.1:{stack['reports_port']}/\S+)\)",
                        link["data"])
    assert href, link["data"]
    with urllib.request.urlopen(href.group(1), timeout=10) as r:
        assert r.read() == (project / "reports" / report["release_id"] / "report.html").read_bytes()
    # The catalogue was rewritten after the run: it lists the rejection.
    assert report["release_id"] in (project / "reports" / "index.html").read_text()
    entry = next(e for e in Ledger(project / "data" / "ledger.sqlite").entries() if Path(e.drop_path).name == NAME)
    assert (entry.status, entry.verdict) == ("rejected", "rejected") and Path(entry.report).is_file()
    # The nightly deployment over the incoming directory meets the drop again and leaves it alone.
    dep = api(url, "/deployments/name/release-incoming/release", None)
    fr = api(url, f"/deployments/{dep['id']}/create_flow_run", {"parameters": {}})
    final = wait_for("the nightly run", lambda: (r := api(url, f"/flow_runs/{fr['id']}"))["state_type"] in (
        "COMPLETED", "FAILED", "CRASHED") and r, 600, stack["procs"])
    assert final["state_type"] == "COMPLETED"
    assert len(_runs_of(url, "release")) == 1 and len(_runs_of(url, "release-on-drop")) == 1
    release_id = next(t.split(":", 1)[1] for t in sub["tags"] if t.startswith("release:"))
    assert not (project / "data" / "releases" / release_id).exists()
