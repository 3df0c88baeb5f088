"""Issue 13: the columnar forms of the manifest, the ingest bookkeeping, the linkage record and the gate's
records give what the per-record Python objects gave (same rows, same bytes, same values)."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from deid.errors import StateError
from deid.intake.drop import ManifestRow, read_drop
from deid.intake.ingest import ingest
from deid.operations.worker_rows import StringColumn, shared_objects
from deid.release.linkage import (
    MAGIC,
    NONCE_BYTES,
    build_linkage,
    linkage_table,
    read_linkage,
    sources_from_ingested,
    write_linkage,
)
from deid.release.publish import stage_release


def _drop(root, rows: list[str], files: dict[str, bytes]):
    root.mkdir()
    for name, data in files.items():
        (root / name).write_bytes(data)
    (root / "manifest.csv").write_text(
        "image,subject_id,gender,eye_left_x,eye_left_y,eye_right_x,eye_right_y\n" + "\n".join(rows) + "\n")
    (root / "drop.yaml").write_text("labels: [gender]\n")
    return root


PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 32


def test_manifest_rows_read_as_manifest_rows_and_ingest_hashes_every_record_read(tmp_path):
    d = read_drop(_drop(tmp_path / "d", ["a.png,s1,f,30,10,10,10", "b.png,s2,m,,,,", "a.png,s3,f,,,,",
                                         "c.png,s3,f,,,,", "e.png,s4,m,,,,"],
                        {"a.png": PNG + b"a", "b.png": PNG + b"b", "c.png": PNG + b"b", "e.png": b""}))
    assert len(d.rows) == 4 and [q.code for q in d.quarantined] == ["duplicate_path"]
    first = d.rows[0]
    assert isinstance(first, ManifestRow) and first == d.rows[-4]
    assert (first.record_id, first.row, first.image, first.subject_id, first.labels, first.eyes) == (
        "r00000001", 1, "a.png", "s1", {"gender": "f"}, ((10.0, 10.0), (30.0, 10.0)))
    assert first.path == d.root / "a.png" and d.rows[1].eyes is None
    assert d.rows == list(d.rows) and d.rows[1:3] == [d.rows[1], d.rows[2]]
    assert [r.image for r in d.rows.take([3, 0])] == ["e.png", "a.png"]
    with pytest.raises(IndexError):
        d.rows[4]
    res = ingest(d, tmp_path / "ingested.parquet", batch_size=2)
    # b.png and c.png hold the same bytes under two people: both quarantined; e.png is empty.
    assert sorted((q.record_id, q.code) for q in res.quarantined) == [
        ("r00000002", "duplicate_across_people"), ("r00000004", "duplicate_across_people"),
        ("r00000005", "empty_file")]
    assert "['s3']" in next(q.message for q in res.quarantined if q.record_id == "r00000002")
    import hashlib
    assert dict(res.source_sha256) == {"r00000001": hashlib.sha256(PNG + b"a").hexdigest(),
                                       "r00000002": hashlib.sha256(PNG + b"b").hexdigest(),
                                       "r00000004": hashlib.sha256(PNG + b"b").hexdigest()}
    assert sorted(res.source_sha256.values()) == sorted(dict(res.source_sha256).values())
    t = pq.read_table(res.path)
    assert t.column("record_id").to_pylist() == ["r00000001"] and t.column("eye_left_x").to_pylist() == [10.0]
    assert t.column("data").to_pylist() == [PNG + b"a"] and res.row_groups == 1


def test_linkage_table_written_streamed_is_build_linkages_payload(tmp_path):
    rng = np.random.default_rng(5)
    ids = [f"r{i:08d}" for i in range(7)] + ["counterfeit-0"]
    clusters = ["p0/a"] * 4 + ["p0/b"] * 4
    staged = stage_release(tmp_path / "rel", images=rng.integers(0, 256, (8, 12), dtype=np.uint8), shape=(4, 3),
                           clusters=clusters, labels={"g": list("ffmmffmm")}, record_ids=ids)
    meta = pa.table({"record_id": ids[:7], "subject_id": [f"s{i // 2}" for i in range(7)],
                     "image": [f"src/{i}.png" for i in range(7)]})
    table = linkage_table(staged.mapping, meta)
    expected = build_linkage(staged.mapping, sources_from_ingested(meta))
    key = bytes(range(32))
    path = write_linkage(tmp_path / "p" / "linkage.bin", table, key, release_id="rel-x")
    assert read_linkage(path, key) == expected and sum(r.get("counterfeit", False) for r in expected) == 1
    blob = path.read_bytes()
    nonce = blob[len(MAGIC):len(MAGIC) + NONCE_BYTES]
    payload = AESGCM(key).decrypt(nonce, blob[len(MAGIC) + NONCE_BYTES:], MAGIC)
    assert payload == json.dumps({"format": "deid-linkage-v1", "release_id": "rel-x", "records": expected},
                                 sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    with pytest.raises(StateError, match="has no source row"):
        linkage_table(staged.mapping, meta.slice(1))


def test_gate_columns_share_one_str_per_value():
    values = pa.array(["b", "a", None, "b"], pa.string())
    out = shared_objects(values)
    assert out.dtype == object and out.tolist() == ["b", "a", None, "b"] and out[0] is out[3]
    col = StringColumn(pa.array(["r1", "r2", "r3"]))
    assert len(col) == 3 and col[1] == "r2" and col[-1] == "r3" and list(col) == ["r1", "r2", "r3"]


def test_label_rows_share_one_dict_per_combination():
    from deid.operations.featurize_partition import _label_rows, shared_tuple

    faces = pa.table({"g": ["f", "m", "f", "f"], "e": ["x", "y", "x", "y"], "subject_id": ["a", "b", "a", "c"]})
    rows = _label_rows(faces, ["g", "e"])
    assert rows == [{"g": "f", "e": "x"}, {"g": "m", "e": "y"}, {"g": "f", "e": "x"}, {"g": "f", "e": "y"}]
    assert rows[0] is rows[2] and _label_rows(faces, []) == [{}] * 4
    people = shared_tuple(faces.column("subject_id"))
    assert people == ("a", "b", "a", "c") and people[0] is people[2]


def test_release_files_look_up_by_path_as_a_dict_would():
    import numpy as np

    from deid.release.manifest import ReleaseFiles

    sha = np.arange(3 * 32, dtype=np.uint8).reshape(3, 32)
    files = ReleaseFiles.from_columns(["images/b.png", "images/a.png", "images/c0.png"], sha, np.array([5, 7, 9]))
    known = files.known()
    assert dict(known) == {"images/a.png": (sha[1].tobytes().hex(), 7), "images/b.png": (sha[0].tobytes().hex(), 5),
                           "images/c0.png": (sha[2].tobytes().hex(), 9)}
    # Longer, shorter, absent: never a false hit (the keys are fixed-width bytes).
    assert known.get("images/c0.pngx") is None and known.get("images/c") is None and known.get("README.md") is None


@pytest.mark.parametrize("text", ["a,b\r\n1,2\r\n", "a,b\r1,2\r3", "a,b\n\"x\r\ny\",2\n\n", "", "a", "a,\"b\rc\"\r\n"])
def test_csv_lines_split_as_a_newline_empty_stringio(text):
    import csv
    import io

    from deid.intake.drop import csv_lines

    assert list(csv.reader(csv_lines(text))) == list(csv.reader(io.StringIO(text, newline="")))
