"""k-Same averaged out of core (issue 13: no stage holds all pixels): same bytes as in memory."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deid.anonymise.ksame import KSame
from deid.operations import worker_deidentify, worker_rows


def _partition(root, n=90, d=6, p=40, people=30, seed=0):
    rng = np.random.default_rng(seed)
    who = np.array([f"s{i % people:03d}" for i in rng.permutation(n)])
    X = rng.normal(size=(n, d)).astype(np.float32)
    pix = rng.integers(0, 256, (n, p), dtype=np.uint8)
    root.mkdir()
    for part, rows in enumerate(np.array_split(np.arange(n), 3)):  # several files, as the Hive writer makes
        pq.write_table(pa.table({
            "record_id": [f"r{i:04d}" for i in rows], "subject_id": who[rows].tolist(),
            "features": pa.array([X[i].tolist() for i in rows], pa.list_(pa.float32())),
            "pixels": [pix[i].tobytes() for i in rows]}), root / f"part-{part}.parquet")
    return who, X, pix


def test_out_of_core_release_equals_the_in_memory_k_same(tmp_path, monkeypatch):
    who, X, pix = _partition(tmp_path / "p")
    # Buckets of ~5 faces: many spill files, clusters never split between them.
    monkeypatch.setattr(worker_deidentify, "AVERAGE_BUCKET_BYTES", 5 * pix.shape[1])
    part = worker_deidentify.deidentify_partition(str(tmp_path / "p"), str(tmp_path / "out" / "d.parquet"), k=3,
                                       method="k-same-select", block_size=40)
    want = KSame(3, block_size=40).fit_transform(X, people=who, images=pix)
    got = pq.read_table(part.path)
    assert got.column("record_id").to_pylist() == [f"r{i:04d}" for i in range(90)]
    released = np.frombuffer(b"".join(got.column("pixels").to_pylist()), np.uint8).reshape(90, -1)
    np.testing.assert_array_equal(released, want)
    assert pq.ParquetFile(part.path).metadata.num_row_groups >= 1
    clusters = got.column("cluster").to_pylist()
    sizes = {c.cluster: (c.size, c.people) for c in part.clusters}
    assert sum(s for s, _ in sizes.values()) == 90 and all(p >= 3 for _, p in sizes.values())
    for name, (size, people) in sizes.items():
        members = [i for i, c in enumerate(clusters) if c == name]
        assert len(members) == size and len(set(who[members])) == people
    assert [f.name for f in (tmp_path / "out").iterdir()] == ["d.parquet"]  # spill files are gone


def test_partitions_stream_their_pixels_from_the_aligned_parts(tmp_path):
    from deid.contracts import Aligned, StagingLayout
    from deid.operations.featurize_partition import write_partitions

    rng = np.random.default_rng(1)
    ids = [f"r{i:08d}" for i in range(12)]
    pix = [rng.integers(0, 256, 20, dtype=np.uint8).tobytes() for _ in ids]
    parts = []
    for n, rows in enumerate((range(0, 5), range(5, 12))):  # two aligned parts; r00000003 did not align
        parts.append(tmp_path / f"part-{n:05d}.parquet")
        keep = [i for i in rows if i != 3]
        pq.write_table(pa.table({"record_id": [ids[i] for i in keep], "pixels": [pix[i] for i in keep]}), parts[-1])
    ok = [i for i in range(12) if i != 3]
    meta = pa.table({"record_id": [ids[i] for i in ok], "subject_id": [f"s{i % 4}" for i in ok],
                     "gender": ["f" if i % 2 else "m" for i in ok],
                     "features": pa.array([[float(i), 1.0] for i in ok], pa.list_(pa.float32()))})
    with_pixels = meta.add_column(3, "pixels", pa.array([pix[i] for i in ok], pa.binary()))
    groups = {("f",): [j for j, i in enumerate(ok) if i % 2], ("m",): [j for j, i in enumerate(ok) if not i % 2]}
    old = write_partitions(with_pixels, groups, StagingLayout(tmp_path / "a"))
    new = write_partitions(meta, groups, StagingLayout(tmp_path / "b"), Aligned(parts=tuple(parts)))
    assert [(p.name, p.records, p.people) for p in old] == [(p.name, p.records, p.people) for p in new]
    for a, b in zip(old, new):
        ta, tb = (pq.ParquetDataset(p.dir).read() for p in (a, b))
        assert tb.column_names == ta.column_names and tb.equals(ta)


def test_grouping_from_float32_features_and_arrow_person_codes_equals_ksame_fit():
    """issue 13: the out-of-core grouping holds float32 features and integer person codes; same clusters."""
    from deid.anonymise.ksame import _factorize, group_people
    from deid.anonymise.ksame_blocks import _cluster_sse, plan_blocks
    from deid.anonymise.near_copy import cluster_centroids

    rng = np.random.default_rng(3)
    n = 600
    X = (rng.normal(size=(n, 8)) * 40).astype(np.float32)
    who = [f"s{int(i):03d}" for i in rng.integers(0, 250, n)]
    who[5] = who[77] = None  # a missing person is a person too, numbered where it first appears
    want = KSame(4, block_size=60).fit(X, people=who, images=None).labels_
    people = pa.array(who, pa.string())
    codes, _ = _factorize(worker_rows.shared_objects(people), "people", n)
    enc = pa.array([w for w in who if w is not None]).dictionary_encode()  # Arrow numbers by first appearance
    assert enc.indices.to_pylist() == _factorize([w for w in who if w is not None], "people", n - 2)[0].tolist()
    got = group_people(X, codes, k=4, block_size=60)
    np.testing.assert_array_equal(got, want)
    # The float32 path's pieces give the float64 path's values exactly (float32 -> float64 is exact).
    X64 = X.astype(np.float64)
    assert [b.tolist() for b in plan_blocks(X, codes, k=4, block_size=60)] == \
        [b.tolist() for b in plan_blocks(X64, codes, k=4, block_size=60)]
    for a, b in zip(_cluster_sse(X, want), _cluster_sse(X64, want)):
        np.testing.assert_array_equal(a, b)
    blocks = (X[a:a + 7] for a in range(0, n, 7))  # the features read back a batch at a time
    np.testing.assert_array_equal(cluster_centroids(blocks, want, int(want.max()) + 1),
                                  cluster_centroids(X64, want, int(want.max()) + 1))


def test_grouping_inputs_read_codes_ids_and_float32_features(tmp_path):
    from deid.anonymise.ksame import _factorize

    who, X, _ = _partition(tmp_path / "p")
    files = sorted(str(f) for f in (tmp_path / "p").iterdir())
    ids, codes, names, feats = worker_deidentify._grouping_inputs(files)
    assert ids.to_pylist() == [f"r{i:04d}" for i in range(90)]
    np.testing.assert_array_equal(codes, _factorize(list(who), "people", 90)[0])
    assert [names[c] for c in codes] == list(who)
    assert feats.dtype == np.float32
    np.testing.assert_array_equal(feats, X)


def test_pose_grouping_reads_the_partitions_yaw_only_when_asked(tmp_path):
    # DEID_POSE_GROUPING_DEGREES: the de-identify stage appends the partition's yaw to the features
    # (deid.anonymise.ksame_pose); without it, or without a yaw column, the grouping is the plain one.
    from deid.anonymise.ksame_pose import pose_features

    who, X, pix = _partition(tmp_path / "p")
    yaw = np.random.default_rng(4).uniform(-40, 40, len(who))
    yaw[::7] = np.nan  # faces without an estimate
    for f in sorted((tmp_path / "p").iterdir()):
        t = pq.read_table(f)
        rows = [int(r[1:]) for r in t.column("record_id").to_pylist()]
        pq.write_table(t.append_column("yaw", pa.array([None if np.isnan(yaw[i]) else float(yaw[i]) for i in rows],
                                                       pa.float32())), f)

    def released(**kw):
        part = worker_deidentify.deidentify_partition(str(tmp_path / "p"), str(tmp_path / "out" / "d.parquet"), k=3,
                                                      method="k-same-select", block_size=40, **kw)
        return np.frombuffer(b"".join(pq.read_table(part.path).column("pixels").to_pylist()), np.uint8).reshape(90, -1)

    posed = KSame(3, block_size=40).fit_transform(pose_features(X, yaw.astype(np.float32), degrees=10),
                                                    people=who, images=pix)
    plain = KSame(3, block_size=40).fit_transform(X, people=who, images=pix)
    assert not np.array_equal(posed, plain)
    np.testing.assert_array_equal(released(pose_degrees=10), posed)
    np.testing.assert_array_equal(released(), plain)


def test_cluster_sums_are_reduceats_exact_sums():
    """The averages' per-cluster sums (issue 32: one reduce per cluster) equal reduceat's, for any segment sizes."""
    from deid.operations.worker_deidentify import _cluster_sums

    rng = np.random.default_rng(7)
    sizes = np.array([1, 2, 5, 9, 1, 300, 4])
    rows = rng.integers(0, 256, (int(sizes.sum()), 7452), dtype=np.uint8)
    rows[5:14] = 255  # the largest sums
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    got = _cluster_sums(rows, starts, starts + sizes)
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got, np.add.reduceat(rows, starts, axis=0, dtype=np.uint32))
