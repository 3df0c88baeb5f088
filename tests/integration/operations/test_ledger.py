"""Drop fingerprints, the idempotency ledger and the watcher's decisions (no Prefect, no server)."""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest

from deid.errors import ConfigError, DropError, StateError
from deid.operations.ledger import FAILED, QUEUED, RELEASED, RUNNING, Ledger, drop_fingerprint, ready_drops
from deid.orchestration.watch import Watcher


def _drop(path: Path, *, seed: int = 0, ready: bool = True) -> Path:
    """A tiny drop: manifest + a few 'image' files with seeded bytes (the watcher never decodes them)."""
    import random

    rng = random.Random(seed)
    (path / "images").mkdir(parents=True)
    rows = ["image,subject_id,gender"]
    for i in range(4):
        (path / "images" / f"{i}.png").write_bytes(bytes(rng.randrange(256) for _ in range(200)))
        rows.append(f"images/{i}.png,s{i},{'fm'[i % 2]}")
    (path / "manifest.csv").write_text("\n".join(rows) + "\n")
    if ready:
        (path / "_READY").write_bytes(b"")
    return path


def test_fingerprint_is_content_not_name_and_ignores_ready(tmp_path):
    a = _drop(tmp_path / "a")
    b = tmp_path / "other-name"
    shutil.copytree(a, b)
    fa = drop_fingerprint(a)
    assert fa.startswith("sha256:") and len(fa) == 7 + 64
    assert drop_fingerprint(b) == fa
    (b / "_READY").write_bytes(b"touched")
    assert drop_fingerprint(b) == fa
    # One flipped byte in an image, an extra file, or a renamed file all change it.
    img = b / "images" / "2.png"
    data = bytearray(img.read_bytes())
    data[10] ^= 1
    img.write_bytes(bytes(data))
    assert drop_fingerprint(b) != fa
    c = tmp_path / "c"
    shutil.copytree(a, c)
    (c / "drop.yaml").write_text("labels: [gender]\n")
    assert drop_fingerprint(c) != fa
    d = tmp_path / "d"
    shutil.copytree(a, d)
    (d / "images" / "0.png").rename(d / "images" / "9.png")
    assert drop_fingerprint(d) != fa


def test_fingerprint_errors_name_the_problem(tmp_path):
    with pytest.raises(DropError, match="does not exist"):
        drop_fingerprint(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DropError, match="manifest.csv"):
        drop_fingerprint(tmp_path / "empty")


def test_ready_drops_only_complete_visible_dirs(tmp_path):
    _drop(tmp_path / "b")
    _drop(tmp_path / "a")
    _drop(tmp_path / "partial", ready=False)
    _drop(tmp_path / ".copying")
    (tmp_path / "file").write_text("x")
    assert [p.name for p in ready_drops(tmp_path)] == ["a", "b"]
    assert ready_drops(tmp_path / "nope") == []


def test_ledger_sight_claim_finish_lifecycle(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    assert led.sight("/in/a", "sha256:aa") == "announce"
    assert led.get("sha256:aa").status == QUEUED
    assert led.sight("/in/a", "sha256:aa") == "pending"          # same path, still queued
    assert led.sight("/in/copy", "sha256:aa") == "duplicate"     # same content elsewhere
    assert led.sight("/in/copy", "sha256:aa") == "known"         # reported once
    claim = led.claim("sha256:aa", "/in/a", by="run-1")
    assert claim.granted and claim.entry.status == RUNNING
    assert not led.claim("sha256:aa", "/in/a", by="run-2").granted    # a duplicate event
    with pytest.raises(StateError, match="not running under claim"):
        led.finish("sha256:aa", by="run-2", release_id="rel-x", verdict="released", report="r")
    e = led.finish("sha256:aa", by="run-1", release_id="rel-1", verdict="released", report="/r/report.json")
    assert (e.status, e.release_id, e.report) == (RELEASED, "rel-1", "/r/report.json") and e.settled
    refused = led.claim("sha256:aa", "/in/again", by="run-3")
    assert not refused.granted and refused.entry.release_id == "rel-1"
    assert led.sight("/in/again", "sha256:aa") == "duplicate"
    assert led.sight("/in/a", "sha256:aa") == "known"
    # A reopened ledger (another process) sees the same state.
    assert Ledger(tmp_path / "l.sqlite").get("sha256:aa").release_id == "rel-1"
    with pytest.raises(ConfigError, match="verdict="):
        led.finish("sha256:aa", by="run-1", release_id="r", verdict="maybe", report="r")


def test_failed_and_stale_entries_can_run_again(tmp_path):
    led = Ledger(tmp_path / "l.sqlite", stale_after=0.2)
    assert led.claim("sha256:f", "/in/f", by="r1").granted
    led.fail("sha256:f", by="r1", error="boom")
    assert led.get("sha256:f").status == FAILED
    assert led.sight("/in/f", "sha256:f") == "announce"  # re-announced after a failure
    assert led.claim("sha256:f", "/in/f", by="r2").granted
    assert not led.claim("sha256:f", "/in/f", by="r3").granted
    time.sleep(0.3)  # r2's process died without reporting: stale
    assert led.claim("sha256:f", "/in/f", by="r3").granted
    with pytest.raises(ConfigError, match="stale_after"):
        Ledger(tmp_path / "x.sqlite", stale_after=0)


def test_concurrent_claims_grant_exactly_one_per_fingerprint(tmp_path):
    path = tmp_path / "l.sqlite"
    Ledger(path)
    granted: list[tuple[str, str]] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        led = Ledger(path)  # its own connections, like separate processes
        for fp in ("sha256:one", "sha256:two"):
            if led.claim(fp, f"/in/{fp}", by=f"w{n}").granted:
                with lock:
                    granted.append((fp, f"w{n}"))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(fp for fp, _ in granted) == ["sha256:one", "sha256:two"]  # both drops run, each once


def test_watcher_announces_new_drops_once_and_reports_duplicates(tmp_path):
    incoming = tmp_path / "incoming"
    incoming.mkdir()
    led = Ledger(tmp_path / "ledger.sqlite")
    sent: list[tuple[str, str]] = []
    w = Watcher(incoming, led, emit=lambda d, fp: sent.append((d.name, fp)) or f"ev{len(sent)}")
    _drop(incoming / "a", seed=1)
    _drop(incoming / "b", seed=2)
    _drop(incoming / "c", seed=3, ready=False)
    rows = w.scan()
    assert sorted(r["outcome"] for r in rows) == ["announce", "announce"]  # two drops at once: both
    assert sorted(n for n, _ in sent) == ["a", "b"]
    assert w.scan() == []  # nothing new; nothing hashed again
    (incoming / "c" / "_READY").write_bytes(b"")
    assert [r["outcome"] for r in w.scan()] == ["announce"]
    # A run releases a; then the same content arrives under another name.
    fa = drop_fingerprint(incoming / "a")
    assert led.claim(fa, str(incoming / "a"), by="run").granted
    led.finish(fa, by="run", release_id="rel-a", verdict="released", report="rep")
    shutil.copytree(incoming / "a", incoming / "a-again")
    rows = w.scan()
    # The same pass reports a's verdict once its run settled it in the ledger (`deid watch` prints it).
    assert sorted(r["outcome"] for r in rows) == ["duplicate", "verdict"]
    (row,) = [r for r in rows if r["outcome"] == "duplicate"]
    assert (row["outcome"], row["release_id"], Path(row["duplicate_of"]).name) == ("duplicate", "rel-a", "a")
    (verdict,) = [r for r in rows if r["outcome"] == "verdict"]
    assert (Path(verdict["drop"]).name, verdict["status"], verdict["release_id"], verdict["report"]) == (
        "a", "released", "rel-a", "rep")
    assert len(sent) == 3
    # A restarted watcher does not announce or report anything again.
    w2 = Watcher(incoming, led, emit=lambda d, fp: sent.append((d.name, fp)))
    assert {r["outcome"] for r in w2.scan()} <= {"pending", "known"}
    assert len(sent) == 3
    # A changed drop under the same name (producer rewrites it, then writes _READY again) is new.
    (incoming / "a" / "_READY").unlink()
    (incoming / "a" / "images" / "0.png").write_bytes(b"new bytes")
    time.sleep(0.01)
    (incoming / "a" / "_READY").write_bytes(b"")
    (row,) = w.scan()
    assert row["outcome"] == "announce" and row["fingerprint"] != fa
    assert sent[-1] == ("a", row["fingerprint"])
    # A run that failed without a verdict is reported once too, with its error; unsettled drops are not.
    fb = drop_fingerprint(incoming / "b")
    assert led.claim(fb, str(incoming / "b"), by="run").granted
    assert w.verdicts() == []
    led.fail(fb, by="run", error="EnvironmentFailure: disk full")
    assert [(Path(r["drop"]).name, r["outcome"], r["error"]) for r in w.scan()] == [
        ("b", "failed", "EnvironmentFailure: disk full")]
    assert w.scan() == []


def test_watcher_retries_an_event_the_server_did_not_take(tmp_path):
    incoming = tmp_path / "incoming"
    _drop(incoming / "a")
    calls = []

    def flaky(drop, fp):
        calls.append(fp)
        if len(calls) == 1:
            raise ConnectionError("server down")
        return "ev"

    w = Watcher(incoming, Ledger(tmp_path / "l.sqlite"), emit=flaky)
    assert [r["outcome"] for r in w.scan()] == ["unsent"]
    assert [r["outcome"] for r in w.scan()] == ["announce"]
    assert w.scan() == [] and len(calls) == 2
    with pytest.raises(ConfigError, match="interval"):
        w.run(interval=0)
