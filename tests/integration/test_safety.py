"""Issue 11, the ordinary items: recovery, pre-flight, typed exit codes, safe drop reading, decode limits,
CSV formula injection, verify's integrity-only exit code, and children that die with `deid run`.

The fault matrix itself (kills at every stage, full disks) is tests/ops/test_faults.py (slow); an unreadable
drop through the Prefect flow is tests/flow/test_safety.py, the exit code of each exception type
tests/unit/cli/test_exit_codes.py.
"""
from __future__ import annotations

import base64
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest
from helpers import assert_nothing_published

from deid.intake.drop import read_drop
from deid.errors import DropError, EnvironmentFailure, RecordError
from deid.intake.imaging import decode_gray
from deid.intake.ingest import ingest
from deid.release.publish import stage_release
from deid.operations.safety import COMPLETE_MARKER, RunLock, is_live, preflight_locations, recover
from deid.release.signing import write_keypair
from deid.cli import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_INTEGRITY_ONLY, EXIT_OK, EXIT_STATE, main

ROOT = Path(__file__).resolve().parents[2]


def _png(seed: int = 0, shape=(40, 36)) -> bytes:
    img = np.random.default_rng(seed).integers(0, 255, shape, dtype=np.uint8)
    return cv2.imencode(".png", img)[1].tobytes()


def _drop(root: Path, rows: list[str], files: dict[str, bytes] | None = None, yaml: str = "labels: [gender]\n") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "manifest.csv").write_text("image,subject_id,gender\n" + "".join(r + "\n" for r in rows))
    (root / "drop.yaml").write_text(yaml)
    for name, data in (files or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


# ------------------------------------------------------------------------------------ recovery


def _dead_staging(staging_root: Path, name: str) -> Path:
    """A staging dir whose lock was held by a process that has exited (as after kill -9)."""
    d = staging_root / name
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from deid.operations.safety import RunLock; "
            f"RunLock.create(__import__('pathlib').Path({str(d)!r}))")
    subprocess.run([sys.executable, "-c", code], check=True)
    (d / "release" / "images").mkdir(parents=True)
    (d / "release" / "images" / "x.png").write_bytes(_png())
    return d


def test_recovery_removes_dead_runs_leftovers_and_keeps_live_and_finished_ones(tmp_path, caplog):
    data, reports = tmp_path / "data", tmp_path / "reports"
    tmp_release = data / "releases" / ".tmp-rel-0123-abcd"
    (tmp_release / "images").mkdir(parents=True)
    (tmp_release / "release.csv").write_text("record_id\n")
    (data / "releases" / "rel-done").mkdir()
    dead = _dead_staging(data / "staging", "rel-dead")
    live = RunLock.create(data / "staging" / "rel-live")
    finished = data / "staging" / "rel-finished"
    RunLock.create(finished).close()
    (finished / COMPLETE_MARKER).touch()
    unlocked = data / "staging" / "rel-legacy"  # no lock file: an older version, or a run before it locked
    unlocked.mkdir()
    partial = reports / "rel-x" / ".report.json.tmp"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(b"{")
    os.utime(partial, (time.time() - 3600,) * 2)
    try:
        assert is_live(dead) is False and is_live(live.path) is True and is_live(unlocked) is None
        with caplog.at_level("WARNING", logger="deid.operations.safety"):
            rec = recover(data, reports)
        assert set(rec.removed) == {str(tmp_release), str(dead), str(partial)}
        assert live.path.is_dir() and finished.is_dir() and unlocked.is_dir() and (data / "releases" / "rel-done").is_dir()
        assert "recovery: removed" in caplog.text and "rel-dead" in caplog.text
    finally:
        live.close()
    # Once its holder is gone, the live run's staging is a dead run's.
    assert str(live.path) in recover(data, reports).removed


def test_recovery_annotates_a_signed_but_unpublished_release(tmp_path):
    data, reports = tmp_path / "data", tmp_path / "reports"
    dead = _dead_staging(data / "staging", "rel-signed")
    (reports / "rel-signed").mkdir(parents=True)
    (reports / "rel-signed" / "report.json").write_text(json.dumps({"verdict": "released"}))
    seen = []
    rec = recover(data, reports, on_unpublished=lambda rid, d: seen.append((rid, d)))
    assert seen == [("rel-signed", reports / "rel-signed")] and rec.annotated == [str(reports / "rel-signed")]
    assert not dead.exists()


# ------------------------------------------------------------------------------------ pre-flight and exit codes


def test_preflight_refuses_an_unusable_reports_location(tmp_path):
    (tmp_path / "reports").write_text("a file where the reports directory should be")
    with pytest.raises(EnvironmentFailure, match="reports directory"):
        preflight_locations(tmp_path / "data", tmp_path / "reports")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tiny tmpfs needs root")
def test_preflight_on_a_really_full_reports_disk(tmp_path):
    mnt = tmp_path / "reports"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount tmpfs here")
    try:
        with pytest.raises(OSError):
            (mnt / "fill").write_bytes(b"\0" * (1 << 20))
        with pytest.raises(EnvironmentFailure, match="No space left on device") as exc:
            preflight_locations(tmp_path / "data", mnt)
        assert exc.value.errno == errno.ENOSPC
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_and_bugs_are_one_line_with_their_own_code(tmp_path, monkeypatch, capsys):
    import deid.intake.synth

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "D" / "x.png"))

    monkeypatch.setattr(deid.intake.synth, "make_synthetic_drop", full)
    assert main(["synth", str(tmp_path / "D"), "--people", "3"]) == EXIT_ENVIRONMENT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "environment failure" in err and "No space left on device" in err
    assert "free space" in err

    monkeypatch.setattr(deid.intake.synth, "make_synthetic_drop", lambda *a, **kw: 1 / 0)
    assert main(["synth", str(tmp_path / "D"), "--people", "3"]) == EXIT_STATE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error (ZeroDivisionError" in err and "Traceback" not in err
    assert main(["--debug", "synth", str(tmp_path / "D"), "--people", "3"]) == EXIT_STATE
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["mode_0644", "missing", "wrong_passphrase"])
def test_run_checks_the_signing_key_before_any_work(tmp_path, monkeypatch, capsys, case):
    """A bad key: exit 2 naming the fix, before Prefect starts; nothing staged, released or reported."""
    priv, _ = write_keypair(tmp_path / "keys", passphrase=b"right" if case == "wrong_passphrase" else None)
    if case == "mode_0644":
        os.chmod(priv, 0o644)
    if case == "missing":
        priv.unlink()
    if case == "wrong_passphrase":
        monkeypatch.setenv("DEID_SIGNING_KEY_PASSPHRASE", "wrong")
    monkeypatch.setenv("DEID_PROJECT_DIR", str(tmp_path))
    monkeypatch.setenv("DEID_SIGNING_KEY", str(priv))
    drop = _drop(tmp_path / "drop", ["a.png,s1,f"], {"a.png": _png()})
    assert main(["run", str(drop), "--k", "2"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert {"mode_0644": "chmod 600", "missing": "does not exist", "wrong_passphrase": "wrong passphrase"}[case] in err
    assert err.count("\n") == 1
    assert not list((tmp_path / "data" / "staging").iterdir())
    assert_nothing_published(tmp_path / "data" / "releases")
    assert not list((tmp_path / "reports").iterdir())


def test_run_with_unwritable_reports_location_is_an_environment_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DEID_PROJECT_DIR", str(tmp_path))
    monkeypatch.delenv("DEID_SIGNING_KEY", raising=False)
    (tmp_path / "reports").write_text("not a directory")
    drop = _drop(tmp_path / "drop", ["a.png,s1,f"], {"a.png": _png()})
    assert main(["run", str(drop), "--k", "2"]) == EXIT_ENVIRONMENT
    err = capsys.readouterr().err
    assert err.startswith("deid run: environment failure") and "reports directory" in err


def test_bad_deid_setting_is_a_config_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DEID_PROJECT_DIR", str(tmp_path))
    monkeypatch.setenv("DEID_K", "many")
    drop = _drop(tmp_path / "drop", ["a.png,s1,f"], {"a.png": _png()})
    assert main(["run", str(drop)]) == EXIT_BAD_INPUT
    assert "DEID_K='many'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ safe inputs


def test_manifest_symlink_to_outside_is_refused(tmp_path):
    outside = tmp_path / "elsewhere.csv"
    outside.write_text("image,subject_id,gender\na.png,s1,f\n")
    drop = tmp_path / "drop"
    drop.mkdir()
    (drop / "manifest.csv").symlink_to(outside)
    with pytest.raises(DropError, match="symlink"):
        read_drop(drop, labels=["gender"])


def test_labels_as_a_mapping_is_a_clear_error(tmp_path):
    drop = _drop(tmp_path / "drop", ["a.png,s1,f"], {"a.png": _png()}, yaml="labels:\n  gender: m/f\n")
    with pytest.raises(DropError, match=r"'labels' must be a list of column names.*dict"):
        read_drop(drop)


def test_fifo_and_directory_listed_as_images_have_their_own_reason(tmp_path):
    drop = _drop(tmp_path / "drop", ["fifo.png,s1,f", "dir.png,s2,f", "gone.png,s3,f"])
    os.mkfifo(drop / "fifo.png")
    (drop / "dir.png").mkdir()
    d = read_drop(drop)
    codes = {q.image: q.code for q in d.quarantined}
    assert codes == {"fifo.png": "not_regular_file", "dir.png": "not_regular_file", "gone.png": "missing_file"}
    assert "FIFO" in next(q.message for q in d.quarantined if q.image == "fifo.png")


def test_file_swapped_for_a_symlink_after_the_manifest_check_is_not_ingested(tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(_png(9))
    drop = _drop(tmp_path / "drop", ["a.png,s1,f", "sub/b.png,s2,f", "c.png,s3,f"],
                 {"a.png": _png(1), "sub/b.png": _png(2), "c.png": _png(3)})
    d = read_drop(drop)
    assert not d.quarantined
    # Between reading the manifest and reading the bytes: a file and a directory become symlinks,
    # and a file becomes a FIFO (which must not hang the read).
    (drop / "a.png").unlink()
    (drop / "a.png").symlink_to(secret)
    (drop / "sub" / "b.png").rename(tmp_path / "b.png")
    (drop / "sub").rmdir()
    (drop / "sub").symlink_to(tmp_path)
    (drop / "c.png").unlink()
    os.mkfifo(drop / "c.png")
    res = ingest(d, tmp_path / "staging" / "ingested.parquet")
    assert res.n_records == 0
    assert {q.image: q.code for q in res.quarantined} == {"a.png": "unsafe_path", "sub/b.png": "unsafe_path",
                                                           "c.png": "not_regular_file"}
    staged = pq.read_table(res.path).column("data").to_pylist()
    assert secret.read_bytes() not in staged


def test_decode_limit_counts_bytes_not_pixels(tmp_path):
    rgba16 = cv2.imencode(".png", np.zeros((100, 100, 4), np.uint16))[1].tobytes()
    gray8 = cv2.imencode(".png", np.zeros((100, 100), np.uint8))[1].tobytes()
    # 10 000 pixels, at the pixel limit; 80 000 decoded bytes, above 3 bytes x 10 000.
    with pytest.raises(RecordError, match=r"needs 80000 bytes .*width x height x channels x bytes per sample") as exc:
        decode_gray(rgba16, max_pixels=10_000)
    assert exc.value.code == "image_too_large"
    assert decode_gray(gray8, max_pixels=10_000).shape == (100, 100)
    drop = _drop(tmp_path / "drop", ["big.png,s1,f", "ok.png,s2,f"], {"big.png": rgba16, "ok.png": gray8})
    res = ingest(read_drop(drop), tmp_path / "st" / "ingested.parquet", max_pixels=10_000)
    assert res.n_records == 1 and [q.code for q in res.quarantined] == ["image_too_large"]


def test_release_csv_neutralises_formulas_and_parquet_keeps_the_values(tmp_path):
    evil = ['=HYPERLINK("http://x","y")', "+1", "-2", "@SUM(A1)", "\tTAB", "\rCR", "plain", "a=b"]
    images = np.zeros((len(evil), 4 * 3), np.uint8)
    staged = stage_release(tmp_path / "rel", images=images, shape=(4, 3), clusters=["c"] * len(evil),
                           labels={"gender": evil})
    import csv

    with open(staged.path / "release.csv", newline="", encoding="utf-8") as fh:
        cells = sorted(r["gender"] for r in csv.DictReader(fh))
    assert cells == sorted(["'" + v if v[0] in "=+-@\t\r" else v for v in evil])
    assert not any(c[0] in "=+-@\t\r" for c in cells)
    assert sorted(pq.read_table(staged.path / "release.parquet").column("gender").to_pylist()) == sorted(evil)


# ------------------------------------------------------------------------------------ verify


def test_verify_without_a_key_is_never_exit_0(tmp_path, capsys):
    from unit.reporting.test_verify import _signed
    from deid.release.signing import ensure_signing_key

    priv, pub = write_keypair(tmp_path / "keys", name="trusted")
    key = ensure_signing_key(configured=priv, keys_dir=tmp_path / "unused")
    report_dir, _ = _signed(tmp_path / "p", key)
    assert main(["verify", str(report_dir), "--public-key", str(pub)]) == EXIT_OK
    assert main(["verify", str(report_dir)]) == EXIT_INTEGRITY_ONLY
    assert "INTEGRITY ONLY" in capsys.readouterr().out
    # A forged signature (valid base64, right length) looks the same without a key: still 8, never 0.
    (report_dir / "report.json.sig").write_bytes(base64.b64encode(bytes(64)) + b"\n")
    assert main(["verify", str(report_dir)]) == EXIT_INTEGRITY_ONLY
    assert main(["verify", str(report_dir), "--public-key", str(pub)]) == 3


# ------------------------------------------------------------------------------------ children die with the run


def test_a_child_started_with_die_with_parent_dies_on_kill_9(tmp_path):
    script = (f"import os, subprocess, sys, time; sys.path.insert(0, {str(ROOT)!r})\n"
              "from deid.orchestration.prefect_api import _die_with_parent\n"
              "p = subprocess.Popen(['sleep', '120'], preexec_fn=_die_with_parent(os.getpid()))\n"
              "print(p.pid, flush=True); time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # A zombie (reparented to init, not yet reaped) counts as dead.
        if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the child outlived its SIGKILLed parent")


# ------------------------------------------------------------------------------------ unreadable drops through `deid run`
