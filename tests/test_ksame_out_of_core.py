"""k-Same averaged out of core (issue 13: no stage holds all pixels): same bytes as in memory."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deid.anonymise.ksame import KSame
from deid.operations import stages


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
    monkeypatch.setattr(stages, "AVERAGE_BUCKET_BYTES", 5 * pix.shape[1])
    part = stages.deidentify_partition(str(tmp_path / "p"), str(tmp_path / "out" / "d.parquet"), k=3,
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
    from deid.operations.pipeline import write_partitions

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
