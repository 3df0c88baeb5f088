"""Issue 28's faults, on small synthetic drops without Prefect: each ends in a clear message and a signed report."""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_nothing_published

from deid.errors import DropError, RecordError
from deid.intake.drop import MANIFEST
from deid.intake.drop_files import open_drop_file, read_drop_file
from deid.intake.features import write_feature_drop
from deid.intake.synth import make_synthetic_drop
from deid.operations.ledger import drop_fingerprint
from deid.orchestration.cluster import manifest_rows
from deid.operations.runner import UNUSABLE_DROP, run_release
from deid.reporting.verify import verify_report
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
    assert_nothing_published(tmp_path / "project" / "data" / "releases")


def test_any_other_error_inside_the_gate_ends_in_a_signed_rejection_that_quotes_no_data(tmp_path):
    """A defect (not a DataError) raised in the gate: exit 70 as before, but never without a signed report."""
    from dataclasses import replace

    from deid.cli import EXIT_STATE, exit_code_for
    from deid.operations.features import FeatureSteps
    from deid.operations.runner import Steps

    def broken_gate(*args, **kwargs):
        raise KeyError("p03")  # an unexpected message may quote data: a subject id here

    drop = write_feature_drop(tmp_path / "drop", vectors=np.random.default_rng(0).normal(size=(24, 8)),
                              subject_ids=[f"p{i // 2:02d}" for i in range(24)])
    config = RunConfig.resolve(Settings(project_dir=tmp_path / "project", **QUICK), k=3)
    with pytest.raises(KeyError) as err:
        run_release(drop, config, steps=replace(Steps(), features=replace(FeatureSteps(), gate=broken_gate)))
    assert exit_code_for(err.value) == EXIT_STATE
    (path,) = (tmp_path / "project" / "reports").glob("*/report.json")
    report = json.loads(path.read_text())
    (reason,) = report["reasons"]
    assert report["verdict"] == "rejected" and reason.startswith("internal error (not a verdict on the data): KeyError")
    assert [c["name"] for c in report["checks"]] == ["internal"] and "p03" not in path.read_text()
    pub = tmp_path / "project" / "data" / "keys" / "dev_signing.pub.pem"
    assert verify_report(path.parent, public_key=pub).authenticated
    assert_nothing_published(tmp_path / "project" / "data" / "releases")
    assert not list((tmp_path / "project" / "data" / "staging").glob("*"))


def test_a_feature_table_that_decodes_past_the_limit_is_refused_from_its_metadata(tmp_path):
    """300 x 100,000 zeros: a 2 KB Parquet file decoding to 240 MB (3.2 GB for a run) is refused before decoding."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from deid.intake.features import decoded_table_bytes, read_feature_drop
    from deid.settings import FEATURE_MAX_BYTES

    drop = tmp_path / "bomb"
    drop.mkdir()
    n, d = 300, 100_000
    flat = pa.array(np.zeros(n * d), pa.float64())
    table = pa.table({"subject_id": pa.array([f"p{i // 2}" for i in range(n)]),
                      "features": pa.FixedSizeListArray.from_arrays(flat, d)})
    pq.write_table(table, drop / "v.parquet", compression="zstd")
    del table, flat
    (drop / "drop.yaml").write_text("kind: features\nfeatures: v.parquet\nname: bomb\n")
    assert (drop / "v.parquet").stat().st_size < 10_000
    assert decoded_table_bytes(pq.ParquetFile(drop / "v.parquet").metadata) >= n * d * 8
    with pytest.raises(DropError, match=r"decodes to 240,0\d\d,\d\d\d bytes, above DEID_FEATURE_MAX_BYTES=200,000,000"):
        read_feature_drop(drop)
    assert FEATURE_MAX_BYTES == 200_000_000 == Settings().feature_max_bytes
    # The same table under a raised limit is read (the limit, not the file, refused it), and a small one passes.
    small = write_feature_drop(tmp_path / "small", vectors=np.ones((6, 4)), subject_ids=list("aabbcc"))
    assert len(read_feature_drop(small, max_bytes=10_000).record_ids) == 6
    with pytest.raises(DropError, match="DEID_FEATURE_MAX_BYTES=100"):
        read_feature_drop(small, max_bytes=100)


def test_a_run_on_a_feature_bomb_is_a_signed_rejection_naming_the_limit(tmp_path):
    """The decompression limit in a run: refused at ingest from the Parquet metadata, exit 2, a signed rejection."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    drop = tmp_path / "bomb"
    drop.mkdir()
    n, d = 300, 10_000  # 24 MB decoded from a few KB, under a 10 MB limit
    table = pa.table({"subject_id": pa.array([f"p{i // 2}" for i in range(n)]),
                      "features": pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(n * d), pa.float64()), d)})
    pq.write_table(table, drop / "v.parquet", compression="zstd")
    (drop / "drop.yaml").write_text("kind: features\nfeatures: v.parquet\nname: bomb\n")
    config = RunConfig.resolve(Settings(project_dir=tmp_path / "project", feature_max_bytes=10_000_000, **QUICK),
                               k=3, kind="features")
    result = _within(60, run_release, drop, config)
    # input_error: `deid run` prints the signed rejection's summary, then exits 2 (deid.cli.cmd_run).
    assert result.verdict == "rejected" and "DEID_FEATURE_MAX_BYTES=10,000,000" in result.input_error
    report = json.loads(result.report_path.read_text())
    (reason,) = report["reasons"]
    assert reason.startswith("unreadable drop: ") and "decodes to 24,0" in reason, reason
    assert str(tmp_path) not in result.report_path.read_text()
    assert verify_report(result.report_dir, public_key=result.public_key).authenticated
    assert_nothing_published(tmp_path / "project" / "data" / "releases")


def test_a_feature_table_without_rows_says_so(tmp_path):
    """A 0-row table was told "the manifest has no data rows" (a feature drop has no manifest)."""
    drop = write_feature_drop(tmp_path / "empty", vectors=np.zeros((0, 8)), subject_ids=[])
    config = RunConfig.resolve(Settings(project_dir=tmp_path / "project", **QUICK), k=3, kind="features")
    result = _within(60, run_release, drop, config)
    assert result.verdict == "rejected"
    report = json.loads(result.report_path.read_text())
    text = " ".join(report["reasons"])
    assert "the feature table has no rows" in text and "manifest" not in text, report["reasons"]
    assert verify_report(result.report_dir, public_key=result.public_key).authenticated


def test_the_watcher_names_a_fifo_or_symlinked_manifest_and_never_waits_on_it(tmp_path):
    """The watcher said "has no manifest.csv" for a manifest that is there but is not a regular file."""
    from deid.operations.ledger import Ledger
    from deid.orchestration.watch import Watcher

    incoming = tmp_path / "incoming"
    for name in ("fifo", "linked"):
        (incoming / name).mkdir(parents=True)
        (incoming / name / "_READY").write_bytes(b"")
    os.mkfifo(incoming / "fifo" / MANIFEST)
    (tmp_path / "elsewhere.csv").write_text("image,subject_id\na.png,s1\n")
    (incoming / "linked" / MANIFEST).symlink_to(tmp_path / "elsewhere.csv")
    sent: list = []
    w = Watcher(incoming, Ledger(tmp_path / "ledger.sqlite"), emit=lambda d, fp: sent.append(d) or "ev")
    rows = _within(10, w.scan)
    assert sorted(Path(r["drop"]).name for r in rows) == ["fifo", "linked"] and not sent
    for r in rows:
        assert r["outcome"] == "error" and "manifest.csv is not a regular file" in r["error"], r
        assert "has no manifest.csv" not in r["error"]
    assert w.scan() == []  # reported once per _READY


def test_a_path_as_dataset_name_is_refused_and_drop_names_become_safe_slugs(tmp_path):
    from deid.errors import ConfigError
    from deid.intake.drop import read_drop

    with pytest.raises(ConfigError, match=r"name='../../x' must be a dataset name"):
        RunConfig.resolve(Settings(project_dir=tmp_path), k=3, name="../../x")
    assert RunConfig.resolve(Settings(project_dir=tmp_path), k=3, name="London 2026").name == "London 2026"
    drop = make_synthetic_drop(tmp_path / "d", people=3, images_per_person=1, seed=1)
    assert read_drop(drop, name="../../x").dataset == "x"
    assert read_drop(drop, name="--.x y.--").dataset == "x-y"


def test_a_prefect_api_lost_after_the_verdict_is_a_warning_and_the_signed_result_stands(monkeypatch):
    """The API died during the gate: deid signed and published, then exited 70 after minutes of retries."""
    import socket
    from types import SimpleNamespace

    import httpx
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from deid.flows import release as flow

    with socket.socket() as s:  # a port nothing listens on: the lost server
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/api"
    with temporary_settings({PREFECT_API_URL: dead}):
        assert flow.api_reachable(timeout=1.0, pause=0.0) is False
        # A server that misses one health check (a loaded machine) is not taken for lost (and abandoned).
        answers = iter([False, True])
        monkeypatch.setattr("deid.orchestration.prefect_api.healthy", lambda url, timeout: next(answers))
        assert flow.api_reachable(timeout=1.0, pause=0.0) is True
        monkeypatch.undo()
    published = SimpleNamespace(release_id="rel-1", released=True, report_path=Path("reports/rel-1/report.json"))
    flushed = []
    monkeypatch.setattr("deid.orchestration.prefect_api.abandon_api", lambda timeout: flushed.append(timeout))

    def engine_loses_the_api(**_):  # the flow body returned (signed, published); closing the run fails
        flow._signed.append(published)
        raise httpx.ConnectError("All connection attempts failed")

    monkeypatch.setattr(flow, "release", engine_loses_the_api)
    warned = []  # (Prefect's logging configuration keeps these records from caplog)
    monkeypatch.setattr(flow.log, "warning", lambda msg, *args: warned.append(msg % args))
    with temporary_settings({PREFECT_API_URL: dead}):
        assert flow.run_flow("drop") is published
    assert len(warned) == 1 and f"the Prefect API {dead} stopped answering" in warned[0] and "rel-1 published" in warned[0]
    assert flushed and not flow._signed  # the senders stopped (no minutes of retries at exit); nothing kept

    def fails_before_signing(**_):  # no verdict yet: the failure is the run's, raised as it was
        raise httpx.ConnectError("All connection attempts failed")

    monkeypatch.setattr(flow, "release", fails_before_signing)
    with pytest.raises(httpx.ConnectError):
        flow.run_flow("drop")


def test_16_bit_alpha_images_convert_in_their_own_buffer_with_the_same_values():
    """The chunked, in-place 16-to-8-bit conversion and alpha composite give the whole-array formulas' bytes."""
    from deid.intake import imaging

    rng = np.random.default_rng(0)
    img = rng.integers(0, 65536, size=(1500, 701, 4), dtype=np.uint16)  # > 1 chunk, rows not a chunk multiple
    want8 = ((img.astype(np.uint32) * 255 + 32767) // 65535).astype(np.uint8)
    gray = imaging.cv2.cvtColor(want8[:, :, :3], imaging.cv2.COLOR_BGR2GRAY).astype(np.float32)
    a = want8[:, :, 3].astype(np.float32) / 255.0
    want_gray = np.clip(np.rint(gray * a + 255.0 * (1.0 - a)), 0, 255).astype(np.uint8)
    colour = want8[:, :, :3].astype(np.float32) * a[:, :, None] + 255.0 * (1.0 - a[:, :, None])
    want_bgr = np.clip(np.rint(colour), 0, 255).astype(np.uint8)
    assert np.array_equal(imaging._to_bgr(img.copy()), want_bgr)
    buf = img.copy()
    got = imaging._to_uint8(buf)
    assert np.array_equal(got, want8) and np.shares_memory(got, buf)  # no second buffer
    assert np.array_equal(imaging._to_gray(img.copy()), want_gray)
