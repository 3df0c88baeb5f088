"""deid.operations.gate_publish: what the gate's inputs are built from."""
from __future__ import annotations

import numpy as np

from deid.contracts import Deidentified, Partitioned, RecordCounts
from deid.operations import gate_publish, worker_gate
from deid.run_config import RunConfig
from deid.settings import Settings


def test_the_gate_inputs_carry_identity_resolutions_near_misses(tmp_path, monkeypatch):
    """The partition stage's near misses (record ids) reach the gate's inputs as positions, for the within-cluster
    check (issue 27)."""
    asked = {}

    def records(root, parts, **kw):
        asked.update(kw)
        n = 4
        return worker_gate.GateRecords(
            record_ids=[f"r{i}" for i in range(n)], people=np.array(["a", "b", "c", "d"], object),
            clusters=np.array(["c0"] * n, object), partitions=np.array(["p"] * n, object), labels={},
            image_index=np.zeros(n, np.int64), own_distance=np.full(n, 30.0),
            fetch=lambda idx: (np.zeros((len(idx), 6), np.uint8),) * 2, suspects=np.array([3, 1]))

    monkeypatch.setattr(worker_gate, "gate_records", records)
    config = RunConfig.resolve(Settings(project_dir=tmp_path), k=2).for_release()
    part = Partitioned(root=tmp_path, identity_suspects=("r3", "r1"))
    inputs = gate_publish.gate_inputs(Deidentified(parts=(tmp_path / "p.parquet",)), part, config, labels=[],
                                      counts=RecordCounts(records_in=4))
    assert asked["suspects"] == ("r3", "r1")
    assert inputs.suspects.tolist() == [3, 1]
