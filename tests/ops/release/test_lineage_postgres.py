"""The lineage registry on PostgreSQL (DEID_DATABASE_URL): same sealed chain, appends serialised across processes."""
from __future__ import annotations


import numpy as np
import pytest
from ops.operations.test_ledger_postgres import pg_url, race  # noqa: F401 - the module's throwaway PostgreSQL server

from deid.release.lineage import build_release
from deid.release.lineage_plan import plan_release
from deid.release.lineage_state import LineageError
from deid.release.lineage_registry import Registry

pytestmark = [pytest.mark.slow, pytest.mark.ops]
KEY = bytes(range(32))


@pytest.fixture
def url(pg_url):  # noqa: F811
    """The server with no lineage tables and no person index (each test starts from nothing)."""
    import psycopg

    from deid.operations.ledger import postgres_conninfo

    with psycopg.connect(postgres_conninfo(pg_url), autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS deid_lineage_entries, deid_lineage_heads, deid_lineage_images, "
                     "deid_person_index, deid_person_descriptors")
    return pg_url


def _sql(url: str, statement: str, params: tuple = ()) -> list:
    import psycopg

    from deid.operations.ledger import postgres_conninfo

    with psycopg.connect(postgres_conninfo(url), autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


def _release(state, rid: str, people: list[str], shade: int):
    plan = plan_release(state, people, [f"{p}/photo" for p in people], key=KEY, k=2)
    half = len(people) // 2
    images = np.array([[shade] * 6] * half + [[255 - shade] * 6] * (len(people) - half), np.uint8)
    return build_release(plan, state, release_id=rid, method="k-same",
                         new_labels=[0] * half + [1] * (len(people) - half), new_images=images, shape=(2, 3))


def test_the_registry_on_postgres_is_sealed_chained_and_refuses_tampering(url, tmp_path):
    reg = Registry.open(tmp_path, "ward", KEY, database_url=url)
    assert not reg.exists() and reg.load().seq == -1
    state = reg.append_release(reg.load(), _release(reg.load(), "rel-1", ["ann", "bob", "cy", "dee"], 10))
    state = reg.mark_published(state, "rel-1")
    again = Registry.open(tmp_path, "ward", KEY, database_url=url).load()  # another process, same server
    assert again.head == state.head and [r.status for r in again.releases] == ["published"]
    assert not (tmp_path / "private").exists()  # nothing under data/private: the rows are the registry
    rows = _sql(url, "SELECT seq, blob FROM deid_lineage_entries WHERE dataset = 'ward' ORDER BY seq")
    assert [s for s, _ in rows] == [0, 1, 2]
    assert all(bytes(b).startswith(b"DEIDLIN1") and b"rel-1" not in bytes(b) for _, b in rows)  # ciphertext
    assert "secret" not in reg.where
    # The stored averages are rows beside the entries (issue 13), sealed, read back bit for bit.
    images = _sql(url, "SELECT blob FROM deid_lineage_images WHERE dataset = 'ward'")
    assert len(images) == 2 and not any(bytes([10] * 6) in bytes(b) for (b,) in images)
    assert sorted(np.asarray(c.image)[0] for c in again.clusters.values()) == [10, 245]
    # A stale plan is refused, as with files.
    with pytest.raises(LineageError, match="planned on another lineage state"):
        reg.append_release(again, _release(Registry.open(tmp_path, "ward", KEY).load(), "rel-x", ["e", "f"], 50))
    # Tampering with the rows is detected like tampering with the files.
    blob = bytearray(rows[1][1])
    blob[len(blob) // 2] ^= 1
    _sql(url, "UPDATE deid_lineage_entries SET blob = %s WHERE dataset = 'ward' AND seq = 1", (bytes(blob),))
    with pytest.raises(LineageError, match="entry 00000001 does not authenticate"):
        reg.load()
    _sql(url, "UPDATE deid_lineage_entries SET blob = %s WHERE dataset = 'ward' AND seq = 1", (rows[1][1],))
    _sql(url, "DELETE FROM deid_lineage_entries WHERE dataset = 'ward' AND seq = 2")
    with pytest.raises(LineageError, match="HEAD names entry 00000002 but the last entry is 00000001"):
        reg.load()


def test_a_file_registry_is_imported_once_and_a_fork_is_refused(url, tmp_path):
    files = Registry.open(tmp_path, "clinic", KEY)
    s = files.append_release(files.load(), _release(files.load(), "rel-1", ["ann", "bob", "cy", "dee"], 10))
    files.mark_published(s, "rel-1")
    head = files.load().head
    db = Registry.open(tmp_path, "clinic", KEY, database_url=url)
    assert db.exists()  # the files count until imported
    assert db.load().head == head  # imported, verified
    assert _sql(url, "SELECT count(*) FROM deid_lineage_images WHERE dataset = 'clinic'") == [(2,)]  # and its averages
    assert sorted(np.asarray(c.image)[0] for c in db.load().clusters.values()) == [10, 245]
    assert _sql(url, "SELECT count(*) FROM deid_lineage_entries WHERE dataset = 'clinic'") == [(3,)]
    s = db.append_release(db.load(), _release(db.load(), "rel-2", ["eve", "fay"], 60))  # continues in the database
    assert db.load().seq == 3 and files.load().head == head  # the files are left as they were
    # Later runs without DEID_DATABASE_URL made the files grow past the database: a forked lineage.
    f = files.load()
    f = files.append_release(f, _release(f, "rel-f", ["gus", "hal"], 90))
    files.mark_published(f, "rel-f")
    with pytest.raises(LineageError, match="the lineage has forked"):
        db.load()


WORKER = r"""
import json, sys, time
from pathlib import Path
import numpy as np
from deid.release.lineage import LineageError, build_release, plan_release
from deid.release.lineage_registry import Registry
url, tag, go, data = sys.argv[1:5]
KEY = bytes(range(32))
reg = Registry.open(Path(data), "shared", KEY, database_url=url)
while not Path(go).exists():
    time.sleep(0.005)
log = {"released": [], "refused": 0}

def retry(step):
    while True:
        try:
            return step(reg.load())
        except LineageError as exc:
            assert "moved on" in str(exc) or "concurrently" in str(exc), exc
            log["refused"] += 1

for n in range(3):
    rid = f"rel-{tag}-{n}"
    people = [f"{tag}-{n}-{i}" for i in range(4)]

    def register(state):
        plan = plan_release(state, people, [p + "/photo" for p in people], key=KEY, k=2)
        shade = 7 * int(tag[1:]) + n
        rel = build_release(plan, state, release_id=rid, method="k-same", new_labels=[0, 0, 1, 1],
                            new_images=np.array([[shade] * 6] * 2 + [[200 - shade] * 6] * 2, np.uint8), shape=(2, 3))
        return reg.append_release(state, rel)

    retry(register)
    retry(lambda state: reg.mark_published(state, rid))
    log["released"].append(rid)
print("LOG " + json.dumps(log))
"""


@pytest.mark.parametrize("n_procs", [4])
def test_concurrent_appends_from_several_processes_serialise_on_the_chain_head(url, tmp_path, n_procs):
    # Every process starts on the empty lineage (their first appends race for the genesis entry too),
    # registers three releases and marks each published, reloading and planning again when refused.
    logs = race(WORKER, [[url, f"p{n}", str(tmp_path)] for n in range(n_procs)], tmp_path / "go", settle=1.5,
                timeout=300)
    state = Registry.open(tmp_path, "shared", KEY, database_url=url).load()  # the whole chain verifies
    want = sorted(f"rel-p{n}-{i}" for n in range(n_procs) for i in range(3))
    assert sorted(r.release_id for r in state.releases) == want
    assert all(r.status == "published" for r in state.releases)
    assert state.seq == 2 * len(want)  # genesis + one release and one published entry each: nothing lost or doubled
    kinds = [e["kind"] for e in state.entries]
    assert kinds.count("genesis") == 1 and kinds[0] == "genesis"
    assert len(state.clusters) == 2 * len(want)
    seqs = [s for (s,) in _sql(url, "SELECT seq FROM deid_lineage_entries WHERE dataset = 'shared' ORDER BY seq")]
    assert seqs == list(range(state.seq + 1))
    refused = sum(log["refused"] for log in logs.values())
    print(f"\n{n_procs} processes x 3 releases: {state.seq + 1} entries in one chain, {refused} appends refused "
          "(registry moved on) and planned again")


def test_a_release_run_keeps_its_lineage_in_the_database(url, tmp_path):
    from deid.intake.synth import make_synthetic_drop
    from deid.operations.runner import run_release
    from deid.run_config import RunConfig
    from deid.settings import Settings

    drop = make_synthetic_drop(tmp_path / "drop", people=12, images_per_person=2, seed=1)
    (drop / "drop.yaml").write_text("name: mix\nlabels:\n- gender\ndataset: mix\n")
    settings = Settings(project_dir=tmp_path / "project", database_url=url, identity_embed_max=0,
                        deep_attack_sample=20, min_probes=4, cv_repeats=1)
    config = RunConfig.resolve(settings, k=3, method="k-same")
    assert "database_url" not in repr(config)
    result = run_release(drop, config)
    assert result.verdict == "released", result.report.reasons
    assert not (config.data_path / "private" / "lineage").exists()
    from deid.operations.run_setup import linkage_key

    state = Registry.open(config.data_path, "mix", linkage_key(config)[0], database_url=url).load()
    assert [(r.release_id, r.status) for r in state.releases] == [(result.release_id, "published")]


def test_a_database_registry_rolled_back_to_an_earlier_dump_is_refused_before_a_run(url, tmp_path):
    """Issue 27 item 4 with DEID_DATABASE_URL: the rows restored as they were after release 1 (entries and HEAD,
    a valid shorter chain) while a signed report names the head after release 2: a state error."""
    import base64

    from deid.errors import StateError
    from deid.operations import deidentify_lineage, run_setup
    from deid.release.lineage_anchor import head_doc
    from deid.release.signing import canonical_json, sign_bytes
    from deid.run_config import RunConfig
    from deid.settings import Settings

    config = RunConfig.resolve(Settings(project_dir=tmp_path / "project", database_url=url), k=2)
    reg = Registry.open(config.data_path, "ward", run_setup.linkage_key(config)[0], database_url=url)
    s1 = reg.mark_published(reg.append_release(reg.load(), _release(reg.load(), "rel-1", ["ann", "bob"], 10)),
                            "rel-1")
    dump = (_sql(url, "SELECT seq, blob FROM deid_lineage_entries WHERE dataset = 'ward'"),
            _sql(url, "SELECT seq, blob FROM deid_lineage_heads WHERE dataset = 'ward'"))
    s2 = reg.append_release(s1, _release(s1, "rel-2", ["cy", "dee"], 20))
    d = config.reports_path / "rel-2"
    d.mkdir(parents=True)
    payload = canonical_json({"release_id": "rel-2", "verdict": "released",
                              "lineage": {"dataset": "ward", "registry_head": head_doc(s2)}})
    (d / "report.json").write_bytes(payload)
    (d / "report.json.sig").write_bytes(base64.b64encode(sign_bytes(payload, run_setup.signing_key(config).private_key)))
    assert deidentify_lineage.open_lineage("ward", config).seq >= s2.seq   # the registry reaches the signed head

    _sql(url, "DELETE FROM deid_lineage_entries WHERE dataset = 'ward' AND seq > %s", (max(s for s, _ in dump[0]),))
    _sql(url, "UPDATE deid_lineage_heads SET seq = %s, blob = %s WHERE dataset = 'ward'", dump[1][0])
    assert Registry.open(config.data_path, "ward", reg.key, database_url=url).load().head == s1.head  # valid alone
    with pytest.raises(StateError, match=f"rolled back.*rel-2 names registry head entry {s2.seq:08d}"):
        deidentify_lineage.open_lineage("ward", config)


def test_the_person_index_on_postgres_claims_refuses_and_routes_across_datasets(url):
    """Issue 27: the project's person index in DEID_DATABASE_URL, as in SQLite (tests/integration/operations/test_person_index.py)."""
    from deid.errors import DataError
    from deid.operations.person_index import PersonIndex

    index = PersonIndex(url, KEY)
    people, fps = [f"participant-{n}" for n in range(4)], [f"{n:064x}" for n in range(4)]
    assert index.claim("cohort-a", people, fps).dataset == "cohort-a"
    held = index.count()
    with pytest.raises(DataError, match="registered under dataset 'cohort-a' \\(4 people\\)"):
        index.claim("cohort-b", [f"rekeyed-{n}" for n in range(4)], fps)
    assert index.count() == held
    routed = PersonIndex(url, KEY).claim("cohort-b", [f"rekeyed-{n}" for n in range(4)], fps, policy="route")
    assert routed.dataset == "cohort-a" and routed.aliases == {f"rekeyed-{n}": f"participant-{n}" for n in range(4)}
    stored = b"".join(bytes(r[0]) + bytes(r[1] or b"") for r in _sql(url, "SELECT digest, person FROM deid_person_index"))
    assert b"participant-" not in stored and not any(f.encode() in stored for f in fps)
    # A claim a later stage refuses is withdrawn; one routed later (by face) is moved, as in SQLite.
    new = [f"{n:064x}" for n in range(10, 14)]
    claim = index.claim("cohort-c", [f"new-{n}" for n in range(4)], new)
    assert index.count() == held + 8 and len(claim.claimed) == len(claim.claimed_ids) == 4 * 16
    index.withdraw(claim)
    assert index.count() == held and index.lookup([f"new-{n}" for n in range(4)], new).records == {}
    moved = index.resettle(index.claim("cohort-c", [f"new-{n}" for n in range(4)], new), "cohort-a",
                           ["participant-0", *(f"new-{n}" for n in range(1, 4))], new)
    assert moved.dataset == "cohort-a" and set(index.lookup(["x"] * 4, new).records) == {"cohort-a"}
