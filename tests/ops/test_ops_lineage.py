"""Ops: two drops of one dataset through `deid watch` and `deid serve` (issue 10, release lineage).

The first drop is the ops session's drop a (``two_releases``: 60 people, seed 7, ``dataset:
site-clinic``). The second drop has 6 more people (same synth seed, so the same 60 people with the
same photos come back): the watcher sees new content, the ledger lets it run, and the flow routes it
into the dataset's lineage by its `dataset:`; the second release reuses every earlier cluster bit
for bit.
"""
from __future__ import annotations

import json
from pathlib import Path

import cv2
import pytest
from ops_helpers import DATASET, SITES, drop_into, runs_for, synthetic_drop, wait_for

from deid.operations.ledger import Ledger
from deid.release.linkage import linkage_path, load_linkage_key, read_linkage

# The session's ops stack (conftest/ops_helpers.py), shared with tests/ops/test_ops.py: one worker.
pytestmark = [pytest.mark.slow, pytest.mark.ops, pytest.mark.xdist_group("ops")]
FIRST, SECOND = SITES[0], "clinic-2026-02"


def _released(project: Path, release_id: str, key: bytes) -> dict[str, bytes]:
    rows = read_linkage(linkage_path(project / "data", release_id), key)
    rel = project / "data" / "releases" / release_id
    return {r["source_image"]: cv2.imread(str(rel / r["released_image"]), cv2.IMREAD_UNCHANGED).tobytes()
            for r in rows if not r.get("counterfeit")}


def test_a_redrop_of_a_dataset_through_the_watcher_reuses_every_cluster(stack, two_releases, tmp_path):
    url, project = stack["url"], stack["project"]
    assert runs_for(url, "release-on-drop", [FIRST], state="COMPLETED")
    drop_into(stack["incoming"], synthetic_drop(tmp_path / "b", 66, 7, dataset=DATASET), SECOND)
    wait_for("the second release-on-drop run", lambda: runs_for(url, "release-on-drop", [SECOND], state="COMPLETED"),
             600, stack["procs"], interval=1.0)
    entries = {Path(e.drop_path).name: e for e in Ledger(project / "data" / "ledger.sqlite").entries()}
    first, second = entries[FIRST], entries[SECOND]
    assert first.verdict == "released" and second.verdict == "released", (first, second)
    key = load_linkage_key(project / "data" / "keys" / "dev_linkage.key")
    one, two = _released(project, first.release_id, key), _released(project, second.release_id, key)
    assert one and all(two[src] == img for src, img in one.items())  # every earlier record, bit for bit
    lineage = json.loads(Path(second.report).read_text())["lineage"]
    assert lineage["dataset"] == DATASET and lineage["returning_people"] == 60 and lineage["new_people"] == 6
    checks = {c["name"]: c for c in json.loads(Path(second.report).read_text())["checks"]}
    assert checks["lineage_differencing_attack"]["passed"] and checks["lineage_cluster_differences"]["passed"]
    print(f"\nops lineage: release 2 {lineage['republished_clusters']} republished clusters, "
          f"{lineage['new_records']} new records, {lineage['waiting_people']} people waiting; "
          f"{checks['lineage_differencing_attack']['detail']}")
