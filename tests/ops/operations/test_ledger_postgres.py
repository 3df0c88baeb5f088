"""The drop ledger on a real PostgreSQL server (DEID_DATABASE_URL): same rules as SQLite, across processes."""
from __future__ import annotations

import glob
import json
import os
import pwd
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from deid.errors import ConfigError, EnvironmentFailure, StateError
from deid.operations.ledger import FAILED, QUEUED, RELEASED, RUNNING, Ledger, drop_fingerprint, open_ledger, postgres_conninfo
from deid.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.ops]
ROOT = Path(__file__).resolve().parents[3]


def _pg_bindir() -> Path:
    """The newest PostgreSQL server binaries (Debian: /usr/lib/postgresql/<major>/bin), else initdb on PATH."""
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]), reverse=True)
    if dirs:
        return Path(dirs[0]).parent
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    pytest.fail("PostgreSQL server binaries (initdb, pg_ctl) not found: apt-get install postgresql "
                "(.ci/run installs it when missing)")


@pytest.fixture(scope="module")
def pg_url():
    """A throwaway PostgreSQL server on a unix socket in a fresh directory, stopped and removed afterwards.

    initdb refuses to run as root, so as root the server runs as the ``postgres`` system user
    (Debian's package creates it), else ``nobody``, owning only its temporary directory.
    """
    bindir = _pg_bindir()
    base = Path(tempfile.mkdtemp(prefix="deid-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        user = "postgres"
        try:
            pwd.getpwnam(user)
        except KeyError:
            user = "nobody"
        ent = pwd.getpwnam(user)
        os.chown(base, ent.pw_uid, ent.pw_gid)
        as_user = ["runuser", "-u", user, "--"]
    base.chmod(0o700)
    data, log = base / "data", base / "server.log"
    env = dict(os.environ, LC_ALL="C")
    subprocess.run([*as_user, str(bindir / "initdb"), "-D", str(data), "-U", "deid", "--auth=trust", "-E", "UTF8",
                    "--no-sync", "--no-instructions"], check=True, capture_output=True, env=env, cwd=base)
    # No TCP port at all: the socket lives in the private directory.
    opts = f"-k {base} -c listen_addresses='' -c fsync=off -c max_connections=50"
    start = subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "60",
                            "-o", opts, "start"], capture_output=True, text=True, env=env, cwd=base)
    if start.returncode != 0:
        pytest.fail(f"PostgreSQL did not start: {start.stderr}\n{log.read_text() if log.exists() else ''}")
    try:
        yield f"postgresql://deid@/postgres?host={base}"
    finally:
        subprocess.run([*as_user, str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                       capture_output=True, env=env, cwd=base)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def url(pg_url):
    """The server with empty ledger tables (each test starts from nothing)."""
    import psycopg

    with psycopg.connect(postgres_conninfo(pg_url), autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS drops, sightings")
    return pg_url


def race(worker: str, argvs: list[list[str]], go: Path, *, settle: float, timeout: float) -> dict[str, list]:
    """Start ``python -c worker ARGV... GO`` per argv, release them at once (``go`` appears after ``settle``
    seconds: every process imported and connected), and return each one's ``LOG <json>`` as ``p0``, ``p1``, ..."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", worker, *argv[:2], str(go), *argv[2:]], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for argv in argvs]
    time.sleep(settle)
    go.write_bytes(b"")
    logs = {}
    for n, p in enumerate(procs):
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-3000:]
        logs[f"p{n}"] = json.loads(out.split("LOG ", 1)[1])
    return logs


def _drop(path: Path, *, seed: int) -> Path:
    rng = random.Random(seed)
    (path / "images").mkdir(parents=True)
    rows = ["image,subject_id"]
    for i in range(3):
        (path / "images" / f"{i}.png").write_bytes(bytes(rng.randrange(256) for _ in range(64)))
        rows.append(f"images/{i}.png,s{i}")
    (path / "manifest.csv").write_text("\n".join(rows) + "\n")
    (path / "_READY").write_bytes(b"")
    return path


def test_settings_choose_postgres_and_urls_are_checked(pg_url, tmp_path, monkeypatch):
    monkeypatch.setenv("DEID_PROJECT_DIR", str(tmp_path))
    monkeypatch.delenv("DEID_DATABASE_URL", raising=False)
    assert open_ledger(Settings()).path == tmp_path.resolve() / "data" / "ledger.sqlite"  # the default
    # Prefect's SQLAlchemy form of the same URL works too (one URL for both in the README's set-up).
    monkeypatch.setenv("DEID_DATABASE_URL", pg_url.replace("postgresql://", "postgresql+asyncpg://"))
    led = open_ledger(Settings())
    assert led.path is None and led.location.startswith("postgresql+asyncpg://deid@/postgres")
    from deid.flows.serve import ledger  # what the release-on-drop and release-incoming flows claim through

    assert ledger().location == led.location
    assert postgres_conninfo("postgres://u:pw@h:5/db") == "postgresql://u:pw@h:5/db"
    with pytest.raises(ConfigError, match=r"DEID_DATABASE_URL='mysql://u:\*\*\*@h/db' must be a PostgreSQL URL"):
        Ledger("mysql://u:secret@h/db")
    # A server that is not there is the environment's failure, and the password is not printed.
    with pytest.raises(EnvironmentFailure, match=r"unreachable") as err:
        Ledger(f"postgresql://deid:secret@/postgres?host={tmp_path}&connect_timeout=2")
    assert "secret" not in str(err.value)


def test_lifecycle_on_postgres(url):
    led = Ledger(url, stale_after=0.3)
    assert led.sight("/in/a", "sha256:aa") == "announce"
    assert led.get("sha256:aa").status == QUEUED
    assert led.sight("/in/a", "sha256:aa") == "pending"
    assert led.sight("/in/copy", "sha256:aa") == "duplicate"
    assert led.sight("/in/copy", "sha256:aa") == "known"
    assert led.claim("sha256:aa", "/in/a", by="run-1").granted
    assert not led.claim("sha256:aa", "/in/a", by="run-2").granted
    with pytest.raises(StateError, match="not running under claim"):
        led.finish("sha256:aa", by="run-2", release_id="rel-x", verdict="released", report="r")
    e = led.finish("sha256:aa", by="run-1", release_id="rel-1", verdict="released", report="/r/report.json")
    assert (e.status, e.release_id, e.report) == (RELEASED, "rel-1", "/r/report.json")
    assert not led.claim("sha256:aa", "/in/again", by="run-3").granted
    assert Ledger(url).get("sha256:aa").release_id == "rel-1"  # another connection sees it
    # Failed and stale claims can run again; times keep sub-second precision (double, not float4).
    assert led.claim("sha256:f", "/in/f", by="r1").granted
    assert led.fail("sha256:f", by="r1", error="boom").status == FAILED
    assert led.claim("sha256:f", "/in/f", by="r2").granted
    assert not led.claim("sha256:f", "/in/f", by="r3").granted
    time.sleep(0.4)
    assert led.claim("sha256:f", "/in/f", by="r3").granted
    a, b = led.get("sha256:f").updated, time.time()
    assert 0 <= b - a < 1.0
    assert [s["outcome"] for s in led.sightings()] == ["announce", "duplicate"]


WORKER = r"""
import json, os, random, sys, time
from pathlib import Path
from deid.operations.ledger import Ledger
url, tag, go, drops = sys.argv[1], sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])
led = Ledger(url)
rng = random.Random(tag)
while not go.exists():
    time.sleep(0.005)
log = []
for rnd in range(3):
    order = list(drops)
    rng.shuffle(order)
    for path, fp in order:
        outcome = led.sight(path, fp)
        claim = led.claim(fp, path, by=tag)
        if not claim.granted:
            log.append(["refused", path, fp, outcome, claim.entry.status])
            continue
        try:  # the first granted run, in whichever process, crashes once
            os.close(os.open(go.with_name("crash-token"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            crash = True
        except FileExistsError:
            crash = False
        if crash:
            led.fail(fp, by=tag, error="injected: the first granted run crashes")
            log.append(["failed", path, fp, outcome, None])
            continue
        rid = f"rel-{tag}-{fp[7:15]}"
        led.finish(fp, by=tag, release_id=rid, verdict="released", report=f"/reports/{rid}/report.json")
        log.append(["released", path, fp, outcome, rid])
print("LOG " + json.dumps(log))
"""


def test_concurrent_processes_release_each_content_once(url, tmp_path):
    # Three drops, two with the same content under different names; four processes (a watcher and
    # flows on several machines, in effect) sight and claim all of them at once, three rounds each.
    a = _drop(tmp_path / "in" / "site-a", seed=1)
    b = _drop(tmp_path / "in" / "site-b", seed=2)
    a2 = tmp_path / "in" / "site-a-copy"
    shutil.copytree(a, a2)
    drops = [[str(p), drop_fingerprint(p)] for p in (a, b, a2)]
    assert drops[0][1] == drops[2][1] != drops[1][1]
    Ledger(url)  # tables created once here; the workers' concurrent creation is covered too (advisory lock)
    logs = race(WORKER, [[url, f"p{n}", json.dumps(drops)] for n in range(4)], tmp_path / "go", settle=1.0,
                timeout=120)
    events = [(tag, *e) for tag, log in logs.items() for e in log]
    released = [e for e in events if e[1] == "released"]
    failed = [e for e in events if e[1] == "failed"]
    # Each content released exactly once, whatever the name it came under; the crashed run's drop too.
    assert sorted(e[3] for e in released) == sorted({fp for _, fp in drops})
    assert len(failed) == 1
    led = Ledger(url)
    entries = {e.fingerprint: e for e in led.entries()}
    assert set(entries) == {fp for _, fp in drops}
    for tag, _, path, fp, _, rid in released:
        e = entries[fp]
        assert (e.status, e.verdict, e.release_id, e.claimed_by) == (RELEASED, "released", rid, tag)
        assert e.error is None
    assert not [e for e in entries.values() if e.status in (QUEUED, RUNNING, FAILED)]
    # One sighting row per (path, content); every refusal names a settled or running entry.
    sightings = led.sightings()
    assert sorted((s["drop_path"], s["fingerprint"]) for s in sightings) == sorted(map(tuple, drops))
    assert all(e[5] in (RUNNING, RELEASED) for e in events if e[1] == "refused")
    print(f"\n4 processes x 3 rounds x 3 drops: {len(released)} releases, {len(failed)} injected failure, "
          f"{sum(e[1] == 'refused' for e in events)} refused claims")
