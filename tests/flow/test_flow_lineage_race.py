"""A run whose dataset's registry moves on between planning and registering (issue 10), through the real flow.

Another run of the dataset registered first: this one fails with StateError, publishing nothing, with a
signed rejection saying why; the ledger marks the drop failed and the next ``release-incoming`` run claims
it again and releases it, planned on the new head. The kills of the registry's runs are
tests/ops/test_flow_lineage_ops.py, whose drop, registry and settings this test shares.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import assert_nothing_published
from ops.test_faults import _releases_without_verified_report
from ops.test_flow_lineage_ops import OPS, _drop, _kinds, _registry

from deid.operations.ledger import FAILED, RELEASED, Ledger, drop_fingerprint

pytestmark = pytest.mark.slow


def test_a_run_whose_registry_moves_on_fails_and_the_ledger_runs_it_again(project, prefect_server, tmp_path,
                                                                          monkeypatch):
    import deid.operations.deidentify_lineage as ts
    from deid.run_config import RunConfig
    from deid.release.lineage import build_release
    from deid.release.lineage_plan import plan_release
    from deid.flows.serve import release_incoming

    for name, value in OPS.items():
        monkeypatch.setenv(name, value)
    incoming = tmp_path / "incoming"
    drop = _drop(incoming / "site-b")
    checks = ts.lineage_checks
    other: list[str] = []

    def racing(lin, rel, aligned, **kw):
        # Another run of the dataset registers its release while this one is past planning (the flow
        # plans, clusters and gates before it registers).
        if not other:
            reg = _registry(project)
            current = reg.load()
            p = plan_release(current, [], [], key=ts.linkage_key(RunConfig.resolve())[0], k=3)
            o = build_release(p, current, release_id="other-run", method="k-same-select", new_labels=[],
                              new_images=np.zeros((0, 92 * 81), np.uint8), shape=(92, 81))
            reg.append_release(current, o)
            other.append(o.release_id)
        return checks(lin, rel, aligned, **kw)

    monkeypatch.setattr(ts, "lineage_checks", racing)
    (row,) = release_incoming(incoming=str(incoming))
    assert row["status"] == "failed" and "moved on" in row["error"], row
    led = Ledger(project / "data" / "ledger.sqlite")
    assert led.get(drop_fingerprint(drop)).status == FAILED
    assert_nothing_published(project / "data" / "releases")
    # Failed before its report was signed: a signed rejection says why (check "state"), nothing else signed.
    (sig,) = (project / "reports").glob("*/report.json.sig")
    rejection = json.loads((sig.parent / "report.json").read_text())
    assert rejection["verdict"] == "rejected" and [c["name"] for c in rejection["checks"]] == ["state"]
    assert "moved on" in rejection["reasons"][0]
    assert [(r.release_id, r.status) for r in _registry(project).load().releases] == [("other-run", "pending")]

    monkeypatch.setattr(ts, "lineage_checks", checks)
    (row,) = release_incoming(incoming=str(incoming))  # e.g. the nightly run: a failed drop is claimed again
    assert row["status"] == "released", row
    assert led.get(drop_fingerprint(drop)).status == RELEASED
    state = _registry(project).load()
    assert _kinds(state) == [("genesis", None), ("release", "other-run"), ("abandoned", "other-run"),
                             ("release", row["release_id"]), ("published", row["release_id"])]
    assert not _releases_without_verified_report(project)
    print(f"\nracing run: StateError (registry moved on), ledger failed, claimed again: {row['release_id']} "
          f"released, planned on entry {state.entries[3]['based_on_seq']}")
