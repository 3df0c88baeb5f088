"""Issue 13 on photographs: work done once (lineage originals read from disk by row, one descriptor per distinct
face) with the same results as before (the differencing attack on threads: tests/integration/release/test_lineage.py)."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deid.operations import featurize_partition, worker_partition, worker_rows


def test_lineage_originals_row_file_reads_the_asked_records_in_their_order(tmp_path):
    rng = np.random.default_rng(3)
    X = rng.integers(0, 256, (9, 12), dtype=np.uint8)
    ids = [f"r{i}" for i in range(9)]
    paths = []
    for n, rows in enumerate(([0, 1, 2, 3], [4, 5, 6, 7, 8])):
        p = tmp_path / f"part-{n}.parquet"
        pq.write_table(pa.table({"record_id": [ids[i] for i in rows], "pixels": [X[i].tobytes() for i in rows]}), p,
                       row_group_size=2)
        paths.append(str(p))
    want = ["r7", "r0", "r5", "r2"]
    rows = worker_rows.RowFile.from_aligned(paths, want, tmp_path / "originals.u8")
    assert rows.shape == (4, 12) and len(rows) == 4
    np.testing.assert_array_equal(rows[np.arange(4)], X[[7, 0, 5, 2]])  # a run of rows: one read
    np.testing.assert_array_equal(rows[[3, 1]], X[[2, 0]])


def test_embed_faces_sends_each_distinct_face_once(monkeypatch):
    rng = np.random.default_rng(5)
    shape = (4, 5)
    faces = rng.integers(0, 256, (3, 20), dtype=np.uint8)
    rows = faces[[0, 1, 0, 2, 1, 0] * 6]  # 36 rows, 3 distinct faces
    sent: list[bytes] = []

    def fake_embed(pixels, shape):
        sent.extend(pixels)
        return np.stack([np.frombuffer(p, np.uint8)[:4].astype(np.float32) for p in pixels])

    class TwoChunks:
        workers = 2

        def map(self, fn, calls, *, on_done=None, ahead=0):
            out = [fn(**c) for c in calls]
            for o in out:
                on_done(o)
            return out

    monkeypatch.setattr(worker_partition, "embed_faces", fake_embed)
    monkeypatch.setattr("deid.evaluation.recognizer.DlibEmbedder.prime", lambda self, X, E: None)
    E = featurize_partition.embed_faces(pa.table({"pixels": [r.tobytes() for r in rows]}), shape, TwoChunks())
    assert sorted(sent) == sorted(f.tobytes() for f in faces)  # each distinct face embedded once
    np.testing.assert_array_equal(E, rows[:, :4].astype(np.float32))  # every row gets its own face's descriptor
