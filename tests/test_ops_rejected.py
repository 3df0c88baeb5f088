"""Ops: a drop the gate rejects, through `deid watch` and `deid serve`: visibly Rejected, settled, never retried."""
from __future__ import annotations

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
    assert (run["state_type"], run["state_name"]) == ("FAILED", "Rejected"), run["state"]
    (sub,) = _runs_of(url, "release")
    assert sub["state_name"] == "Rejected" and "verdict:rejected" in sub["tags"]
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
