"""What the partition stage keeps for the lineage holds one object per distinct value, same values (issue 13)."""
from __future__ import annotations

import dataclasses
import hashlib
import hmac

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deid.operations import stages
from deid.release.lineage import derive_key, empty_state, pseudonymize

KEY = bytes(range(32))


def _faces(n: int = 40, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    people = [f"p{i // 2}" for i in range(n)]
    gender = pa.array([None if i == 3 else ("f", "m")[int(rng.integers(2))] for i in range(n)], pa.string())
    return pa.table({"record_id": [f"r{i:05d}" for i in range(n)], "subject_id": people, "gender": gender,
                     "expression": [("neutral", "smile", "frown")[int(rng.integers(3))] for _ in range(n)]})


def test_pseudonyms_are_the_hmac_of_each_person_one_str_per_person():
    people = ["a", "b", "a", 7, "7", "b"]
    pkey = derive_key(KEY, "ds", "pseudonym")
    got = pseudonymize(KEY, "ds", people)
    assert got == [hmac.new(pkey, str(p).encode(), hashlib.sha256).hexdigest() for p in people]
    assert got[0] is got[2] and got[3] is got[4] and got[0] != got[1]


def test_plan_lineage_from_the_ingested_columns_equals_the_dict_lookup_and_shares_label_tuples():
    faces = _faces()
    fps = {r: hashlib.sha256(r.encode()).hexdigest() for r in faces.column("record_id").to_pylist()}
    table = pa.table({"record_id": list(fps)[::-1], "source_sha256": list(fps.values())[::-1]})
    kw = dict(key=KEY, k=3, policy="invariant", absent="republish", labels=["gender", "expression"], select=True)
    by_dict = stages.plan_lineage(faces, fps, empty_state("ds"), **kw)
    by_cols = stages.plan_lineage(faces, table, empty_state("ds"), **kw)
    for f in dataclasses.fields(by_dict):
        assert getattr(by_cols, f.name) == getattr(by_dict, f.name), f.name
    # The values the per-record form had (a null label is "None"), each distinct combination one tuple object.
    cols = faces.to_pydict()
    expect = [(str(g), str(e)) for g, e in zip(cols["gender"], cols["expression"])]
    assert list(by_cols.record_labels) == expect and list(by_cols.partitions) == expect
    assert len({id(t) for t in by_cols.record_labels}) == len(set(expect))
    assert len({id(p) for p in by_cols.pseudonyms}) == len(set(cols["subject_id"]))
    assert list(by_cols.fingerprints) == [fps[r] for r in cols["record_id"]]


def _blocks_in_a_task(n: int) -> list:
    from deid.operations.executors import map_on_cluster

    return map_on_cluster(pow, range(n), [2] * n)


def test_map_on_cluster_in_a_worker_keeps_order_with_a_bounded_window():
    from distributed import Client, LocalCluster

    from deid.anonymise.ksame import _Rows
    from deid.operations.executors import MAP_WINDOW

    n = 3 * MAP_WINDOW + 1  # more items than the window: later ones are submitted as earlier ones finish
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        assert client.submit(_blocks_in_a_task, n).result() == [i * i for i in range(n)]
    # The blocks' rows, made one block at a time, are the slices a list would hold.
    A, blocks = np.arange(20).reshape(10, 2), [np.array([0, 3]), np.array([1, 2, 9])]
    rows = _Rows(A, blocks)
    assert len(rows) == 2 and [r.tolist() for r in rows] == [A[b].tolist() for b in blocks]
    assert [r.tolist() for r in rows[1:]] == [A[blocks[1]].tolist()]


def test_a_bucket_averaged_a_few_clusters_at_a_time_releases_the_same_bytes(tmp_path, monkeypatch):
    from test_ksame_out_of_core import _partition

    from deid.anonymise.ksame import KSame
    from deid.operations import stages as st

    who, X, pix = _partition(tmp_path / "p")
    want = KSame(3, block_size=40).fit_transform(X, people=who, images=pix)
    # Every record's distance to its cluster's mean, as the near-copy repair receives it.
    own_want = np.abs(want.astype(np.int16) - pix.astype(np.int16)).mean(axis=1)
    repair = st._repair_out_of_core
    seen = {}

    def spy(spill, labels_, X_, people, own, *a, **kw):
        seen["own"] = own.copy()
        return repair(spill, labels_, X_, people, own, *a, **kw)

    monkeypatch.setattr(st, "_repair_out_of_core", spy)
    monkeypatch.setattr(st, "_DISTANCE_ROWS", 4)
    groups = {}
    for chunk in (3, 1000):  # several chunks per bucket, or the whole bucket at once
        monkeypatch.setattr(st, "_MEAN_CLUSTERS", chunk)
        part = st.deidentify_partition(str(tmp_path / "p"), str(tmp_path / f"out{chunk}" / "d.parquet"), k=3,
                                       method="k-same-select", block_size=40, near_copy_threshold=2.0)
        t = pq.read_table(part.path)
        released = np.frombuffer(b"".join(t.column("pixels").to_pylist()), np.uint8).reshape(t.num_rows, -1)
        np.testing.assert_array_equal(released, want)
        np.testing.assert_array_equal(seen.pop("own"), own_want)
        by = {}
        for rid, c in zip(t.column("record_id").to_pylist(), t.column("cluster").to_pylist()):
            by.setdefault(c, []).append(rid)
        groups[chunk] = sorted(by.values())
    assert groups[3] == groups[1000]


def test_message_logs_bounded_and_a_lower_setting_kept():
    """issue 13: distributed's stream logs kept every block task's features (1000 messages by default)."""
    import dask

    from deid.operations.executors import MESSAGE_LOG_LENGTH, bound_message_logs

    key = "distributed.admin.low-level-log-length"
    with dask.config.set({key: 1000}):
        bound_message_logs()
        assert dask.config.get(key) == MESSAGE_LOG_LENGTH
    with dask.config.set({key: 5}):
        bound_message_logs()
        assert dask.config.get(key) == 5
