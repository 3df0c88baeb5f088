"""release.csv and metadata.csv written from columns (issue 32) are the bytes the rows-as-dicts writer gave."""
from __future__ import annotations

import pyarrow as pa

from deid.release.publish import _write_csv, _write_table_csv


def _rows(table: pa.Table):
    for b in table.to_batches(max_chunksize=3):  # several batches
        yield from b.to_pylist()


def _table() -> pa.Table:
    awkward = ["=1+1", "+x", "-y", "@z", "\tq", "\rr", "a,b", 'he said "hi"', "line\nbreak", "", " ", "é", None]
    n = len(awkward)
    return pa.table({
        "record_id": [f"r{i:03d}" for i in range(n)],
        "image": [f"images/r{i:03d}.png" if i != 1 else "=images/x.png" for i in range(n)],
        "cluster_id": ["c-1"] * n,
        "label": awkward,
        "score": pa.array([0.1, 1e-17, 2.5, None, 3.0, -1.0, 1e20, 0.0, 7.25, 1.0 / 3, 2.0, 4.0, 5.0], pa.float64()),
        "n": pa.array(range(n), pa.int64()),
        "flag": pa.array([True, False, None] * 4 + [True], pa.bool_()),
        "tag": pa.array(["=a", "b", "=a"] * 4 + ["b"]).dictionary_encode(),
    })


def test_release_csv_bytes_are_the_dict_writers(tmp_path):
    t = _table()
    names = t.schema.names
    _write_csv(tmp_path / "old.csv", names, _rows(t))
    _write_table_csv(tmp_path / "new.csv", t, names, names, batch=4)
    assert (tmp_path / "new.csv").read_bytes() == (tmp_path / "old.csv").read_bytes()
    assert b"'=1+1" in (tmp_path / "new.csv").read_bytes()  # formulas neutralised, as before


def test_metadata_csv_bytes_are_the_dict_writers(tmp_path):
    t = _table()
    others = [c for c in t.schema.names if c != "image"]
    _write_csv(tmp_path / "old.csv", ["file_name", *others], ({"file_name": r["image"], **r} for r in _rows(t)),
               drop=("image",))
    _write_table_csv(tmp_path / "new.csv", t, ["file_name", *others], ["image", *others], batch=5)
    assert (tmp_path / "new.csv").read_bytes() == (tmp_path / "old.csv").read_bytes()
    assert (tmp_path / "new.csv").read_text(encoding="utf-8").splitlines()[0] == ",".join(["file_name", *others])
