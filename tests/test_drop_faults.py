"""Issue 28's faults, on small synthetic drops without Prefect: each ends in a clear message and a signed report."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from deid.errors import DropError, RecordError
from deid.intake.drop import MANIFEST, open_drop_file, read_drop_file
from deid.intake.features import write_feature_drop
from deid.intake.synth import make_synthetic_drop
from deid.operations.ledger import drop_fingerprint
from deid.orchestration.cluster import manifest_rows
from deid.operations.runner import UNUSABLE_DROP, run_release
from deid.release.verify import verify_report
from deid.run_config import RunConfig
from deid.settings import Settings

QUICK = dict(identity_embed_max=0, deep_attack_sample=20, cv_repeats=1)


def _within(seconds: float, fn, *args, **kwargs):
    """``fn(*args)`` in a thread; fails (instead of hanging the suite) if it has not returned in ``seconds``."""
    out: dict = {}

    def call():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn.__name__} still blocked after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_fifo_or_symlinked_manifest_is_refused_at_once_everywhere_it_is_opened(tmp_path):
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / MANIFEST)
    with pytest.raises(RecordError) as err:
        _within(5, open_drop_file, fifo, MANIFEST)
    assert err.value.code == "not_regular_file" and "FIFO" in err.value.message
    # The orchestration's row count (a plain open() waited for a writer forever) and the watcher's fingerprint.
    assert _within(5, manifest_rows, fifo, stop_after=10) is None
    with pytest.raises(DropError, match="manifest.csv is not a regular file"):
        _within(5, drop_fingerprint, fifo)

    linked = tmp_path / "linked"
    linked.mkdir()
    real = tmp_path / "elsewhere.csv"
    real.write_text("image,subject_id\na.png,s1\n")
    (linked / MANIFEST).symlink_to(real)
    with pytest.raises(RecordError) as err:
        read_drop_file(linked, MANIFEST)
    assert err.value.code == "unsafe_path"
    assert manifest_rows(linked, stop_after=10) is None
    with pytest.raises(DropError, match="manifest.csv is not a regular file"):
        drop_fingerprint(linked)
    # A regular manifest is still counted.
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / MANIFEST).write_text("image,subject_id\na.png,s1\nb.png,s2\n")
    assert manifest_rows(tmp_path / "ok", stop_after=10) == 2


def test_the_rejection_of_a_fifo_manifest_is_signed_and_names_no_absolute_path(tmp_path):
    drop = tmp_path / "fifo-drop"
    drop.mkdir()
    os.mkfifo(drop / MANIFEST)
    config = RunConfig.resolve(Settings(project_dir=tmp_path / "project", **QUICK), k=3)
    result = _within(30, run_release, drop, config)
    assert result.verdict == "rejected" and "FIFO" in result.input_error
    report = json.loads(result.report_path.read_text())
    assert report["reasons"][0].startswith("unreadable drop: fifo-drop/manifest.csv: "), report["reasons"]
    assert str(tmp_path) not in result.report_path.read_text()
    assert verify_report(result.report_dir, public_key=result.public_key).authenticated


def test_identical_feature_vectors_end_in_a_signed_rejection_not_an_attacker_error(tmp_path):
    """A DataError raised inside the gate (the attackers' PCA) was exit 2 with no report at all."""
    drop = write_feature_drop(tmp_path / "same", vectors=np.ones((24, 8)),
                              subject_ids=[f"p{i // 2:02d}" for i in range(24)])
    config = RunConfig.resolve(Settings(project_dir=tmp_path / "project", **QUICK), k=3)
    result = run_release(drop, config)
    assert result.verdict == "rejected" and result.input_error.startswith(UNUSABLE_DROP)
    report = json.loads(result.report_path.read_text())
    (reason,) = report["reasons"]
    assert "identical" in reason and "gallery images" not in reason, reason
    assert [c["name"] for c in report["checks"] if not c["passed"]] == ["gate_error"]
    res = verify_report(result.report_dir, public_key=result.public_key)
    assert res.authenticated, res.problems
    assert not list((tmp_path / "project" / "data" / "releases").glob("*"))
