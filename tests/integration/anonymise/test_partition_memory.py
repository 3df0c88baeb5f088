"""What the partition stage keeps for the lineage holds one object per distinct value, same values (issue 13)."""
from __future__ import annotations

import dataclasses
import hashlib
import hmac

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deid.operations import worker_lineage
from deid.release.lineage_state import derive_key, empty_state, pseudonymize

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
    by_dict = worker_lineage.plan_lineage(faces, fps, empty_state("ds"), **kw)
    by_cols = worker_lineage.plan_lineage(faces, table, empty_state("ds"), **kw)
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

    from deid.anonymise.ksame_blocks import _Rows
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
    from unit.anonymise.test_ksame_out_of_core import _partition

    from deid.anonymise.ksame import KSame
    from deid.operations import worker_deidentify as st

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


def _staged_parts(root, n: int = 30, d: int = 4, seed: int = 3):
    """Aligned and feature parts of ``n`` faces in shuffled order over 3 parts (as align writes them)."""
    from deid.contracts import Aligned, Featurized

    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    root.mkdir(parents=True, exist_ok=True)
    aligned, feats = [], []
    for p, rows in enumerate(np.array_split(order, 3)):
        ids = [f"r{i:05d}" for i in rows]
        pq.write_table(pa.table({"record_id": ids, "pixels": [bytes([i % 256]) * 6 for i in rows]}),
                       root / f"a{p}.parquet")
        X = (rows[:, None] * 10 + np.arange(d)[None, :]).astype(np.float32)
        feats_t = pa.table({"record_id": ids, "features": pa.array(list(X), pa.list_(pa.float32()))})
        pq.write_table(feats_t, root / f"f{p}.parquet")
        aligned.append(root / f"a{p}.parquet")
        feats.append(root / f"f{p}.parquet")
    return Aligned(parts=tuple(aligned)), Featurized(parts=tuple(feats), n_components=d)


def test_load_faces_places_each_faces_features_as_concatenating_and_taking_did(tmp_path):
    """issue 13: the features are copied part by part into one buffer, in record order, not concatenated and taken."""
    import pyarrow.compute as pc

    from deid.operations.featurize_partition import load_faces

    aligned, feats = _staged_parts(tmp_path / "s", n=30)
    meta = _faces(32)  # two records (r00030, r00031) never aligned: not faces
    faces = load_faces(meta, aligned, feats, ["gender"], pixels=False)
    assert faces.column("record_id").to_pylist() == [f"r{i:05d}" for i in range(30)]
    every = pa.concat_tables([pq.read_table(p) for p in feats.parts])
    at = pc.index_in(faces.column("record_id"), value_set=every.column("record_id").combine_chunks())
    assert faces.column("features").combine_chunks().equals(every.column("features").take(at).combine_chunks())
    assert faces.schema.field("features").type == pq.read_schema(feats.parts[0]).field("features").type
    with_pixels = load_faces(meta, aligned, feats, ["gender"])
    assert with_pixels.column("pixels").to_pylist() == [bytes([i]) * 6 for i in range(30)]


def test_load_faces_names_a_face_without_features_and_refuses_ragged_parts(tmp_path):
    import pytest

    from deid.contracts import Featurized
    from deid.errors import StateError
    from deid.operations.featurize_partition import load_faces

    aligned, feats = _staged_parts(tmp_path / "s", n=30)
    short = pq.read_table(feats.parts[1])
    missing = short.column("record_id")[0].as_py()
    pq.write_table(short.slice(1), feats.parts[1])
    with pytest.raises(KeyError, match=missing):
        load_faces(_faces(30), aligned, feats, [], pixels=False)
    aligned, feats = _staged_parts(tmp_path / "t", n=30)
    t = pq.read_table(feats.parts[2])
    rows = t.column("features").to_pylist()
    rows[0] = rows[0][:-1]  # one row shorter: positions in one flat buffer would shift
    pq.write_table(t.set_column(1, "features", pa.array(rows, pa.list_(pa.float32()))), feats.parts[2])
    with pytest.raises(StateError, match="different lengths"):
        load_faces(_faces(30), aligned, Featurized(parts=feats.parts, n_components=4), [], pixels=False)


def test_partitions_written_from_row_indices_hold_the_rows_a_copy_of_each_would(tmp_path):
    """write_partitions hands write_with_pixels each partition's rows of one table, not a copy per partition."""
    from deid.contracts import StagingLayout
    from deid.operations.featurize_partition import load_faces, write_partitions

    aligned, feats = _staged_parts(tmp_path / "s", n=30)
    faces = load_faces(_faces(30), aligned, feats, ["gender", "expression"], pixels=False)
    groups = {("a",): [0, 2, 5, 7, 8, 29], ("b",): [1, 3, 4], ("c",): list(range(9, 29))}
    layout = StagingLayout(tmp_path / "staging")
    parts = write_partitions(faces, groups, layout, aligned)
    full = load_faces(_faces(30), aligned, feats, ["gender", "expression"])
    for info, idx in zip(parts, groups.values()):
        got = pq.read_table(next(info.dir.glob("*.parquet")))
        assert got.schema.names == full.schema.names
        # Rows come in the aligned parts' order (as they are streamed), each whole.
        assert sorted(got.to_pylist(), key=lambda r: r["record_id"]) == full.take(pa.array(idx, pa.int64())).to_pylist()
        mine = set(full.take(pa.array(idx, pa.int64())).column("record_id").to_pylist())
        in_parts = [r for p in aligned.parts for r in pq.read_table(p).column("record_id").to_pylist()]
        assert got.column("record_id").to_pylist() == [r for r in in_parts if r in mine]
        assert info.records == len(idx)
