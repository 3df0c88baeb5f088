"""Progress artifacts go through one Prefect client for the whole run (issue 32), with what the UI got before."""
from __future__ import annotations

import logging
import time
import uuid

import pytest

from deid.orchestration import logs


class FakeClient:
    """The sync Prefect client's two calls the handler makes, recorded."""

    opened = 0

    def __init__(self):
        self.calls: list[tuple] = []

    def __enter__(self):
        FakeClient.opened += 1
        return self

    def __exit__(self, *exc):
        return False

    def create_artifact(self, artifact):
        self.calls.append(("create", artifact.key, artifact.type, artifact.data, artifact.description))
        return type("Created", (), {"id": f"id-{artifact.key}"})()

    def update_artifact(self, artifact_id, artifact):
        self.calls.append(("update", artifact_id, artifact.data, artifact.description,
                           "description" in artifact.model_fields_set))


@pytest.fixture
def client(monkeypatch):
    import prefect.client.orchestration as orchestration

    made: list[FakeClient] = []

    def get_client(sync_client=False):
        assert sync_client
        made.append(FakeClient())
        return made[-1]

    FakeClient.opened = 0
    monkeypatch.setattr(orchestration, "get_client", get_client)
    return made


def _line(stage: str, share: float, text: str) -> logging.LogRecord:
    record = logging.LogRecord("deid.progress", logging.INFO, __file__, 1, text, None, None)
    record.deid_progress = {"stage": stage, "share": share}
    return record


def test_one_client_sends_every_update_of_the_run(client):
    bars = logs.ProgressArtifacts(uuid.uuid4(), period=0.01)
    for i, share in enumerate((0.1, 0.5, 1.0)):
        bars.emit(_line("align", share, f"align: {i}"))
        time.sleep(0.05)
    bars.emit(_line("gate attacks", 1.0, "gate: done"))
    bars.close()
    assert len(client) == 1 and FakeClient.opened == 1
    calls = client[0].calls
    assert calls[0] == ("create", "deid-progress-align", "progress", 10.0, "align: 0")
    assert ("update", "id-deid-progress-align", 100.0, "align: 2", True) in calls
    assert ("create", "deid-progress-gate-attacks", "progress", 100.0, "gate: done") in calls
    assert not bars._failed


def test_a_refused_update_stops_the_bars_not_the_run(client, monkeypatch, caplog):
    def refuse(self, artifact):
        raise RuntimeError("503 from the API")

    monkeypatch.setattr(FakeClient, "create_artifact", refuse)
    bars = logs.ProgressArtifacts(uuid.uuid4(), period=0.01)
    with caplog.at_level(logging.WARNING, logger=logs.__name__):
        bars.emit(_line("align", 0.2, "align: 1"))
        time.sleep(0.1)
        bars.emit(_line("align", 0.4, "align: 2"))
        bars.close()
    assert bars._failed
    assert any("progress artifacts stopped" in r.getMessage() and "503" in r.getMessage() for r in caplog.records)
