"""Manifest validation, ingestion and partitioning: bad input is quarantined with a reason, never lost."""
from __future__ import annotations

import os
from collections import Counter

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest

from deid.intake.drop import read_drop
from deid.errors import REASONS, DropError
from deid.intake.ingest import ingest, write_quarantine
from deid.anonymise.partition import plan_partitions


def _png(seed: int, size=(40, 40)) -> bytes:
    rng = np.random.default_rng(seed)
    ok, buf = cv2.imencode(".png", rng.integers(0, 255, size, dtype=np.uint8))
    assert ok
    return buf.tobytes()


def _write_drop(root, rows, *, header="image,subject_id,gender,eye_left_x,eye_left_y,eye_right_x,eye_right_y",
                yaml_text="name: t\nlabels: [gender]\n", files=None):
    root.mkdir(parents=True, exist_ok=True)
    (root / "manifest.csv").write_text(header + "\n" + "\n".join(rows) + "\n", encoding="utf-8")
    if yaml_text is not None:
        (root / "drop.yaml").write_text(yaml_text)
    for name, data in (files or {}).items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


def test_bad_rows_are_quarantined_with_stable_codes(tmp_path):
    outside = tmp_path / "outside.png"
    outside.write_bytes(_png(9))
    drop = _write_drop(
        tmp_path / "drop",
        [
            "a.png,s1,f,10,10,30,10",
            "b.png,,f,,,,",  # empty subject
            "c.png,s3,,,,,",  # empty label
            "/etc/passwd,s4,f,,,,",  # absolute
            "../outside.png,s5,f,,,,",  # ..
            "link.png,s6,m,,,,",  # symlink out of the drop
            "a.png,s1,f,,,,",  # listed twice
            "missing.png,s8,m,,,,",  # no such file
            "d.png,s9,m,1,2,x,4",  # eye points not numbers
            "e.png,s10,m,1,2,,",  # incomplete eye points
        ],
        files={"a.png": _png(1), "b.png": _png(2), "c.png": _png(3), "d.png": _png(4), "e.png": _png(5)},
    )
    os.symlink(outside, drop / "link.png")
    d = read_drop(drop)
    codes = Counter(q.code for q in d.quarantined)
    assert [r.image for r in d.rows] == ["a.png"]
    assert d.rows[0].eyes == ((10.0, 10.0), (30.0, 10.0))
    assert codes == {"missing_subject_id": 1, "missing_label": 1, "unsafe_path": 3, "duplicate_path": 1,
                     "missing_file": 1, "bad_eye_points": 2}
    assert d.records_in == 10
    assert all(q.code in REASONS and q.message for q in d.quarantined)


def test_manifest_quirks_bom_crlf_quotes_extra_columns(tmp_path):
    root = tmp_path / "drop"
    root.mkdir()
    (root / "x, y.png").write_bytes(_png(1))
    (root / "manifest.csv").write_bytes(
        "\ufeffimage,subject_id,gender,notes\r\n\"x, y.png\",s1,f,\"a, b\"\r\n".encode("utf-8"))
    d = read_drop(root, labels=["gender"])
    assert [r.image for r in d.rows] == ["x, y.png"]
    assert d.extra_columns == ["notes"]
    assert d.rows[0].eyes is None


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00", "not"),  # binary junk
        (b"image,gender\na.png,f\n", "subject_id"),  # required column missing
        (b"image,subject_id\na.png,s1\n", "label column"),  # declared label column missing
    ],
)
def test_unusable_manifest_raises_drop_error(tmp_path, content, message):
    root = tmp_path / "drop"
    root.mkdir()
    (root / "manifest.csv").write_bytes(content)
    (root / "drop.yaml").write_text("labels: [gender]\n")
    with pytest.raises(DropError, match=message):
        read_drop(root)


def test_no_labels_declared_is_a_drop_without_labels(tmp_path):
    # Issue 9: a drop with no utility labels is a normal case (k-Same without partitions);
    # the undeclared manifest column stays out of the release as an extra column.
    root = _write_drop(tmp_path / "d", ["a.png,s1,f,,,,"], yaml_text=None, files={"a.png": _png(1)})
    drop = read_drop(root)
    assert drop.labels == []
    assert "gender" in drop.extra_columns
    assert len(drop.rows) == 1


def test_mistyped_label_names_the_real_columns(tmp_path):
    root = _write_drop(tmp_path / "d", ["a.png,s1,f,,,,"], yaml_text=None, files={"a.png": _png(1)})
    with pytest.raises(DropError, match=r"\['gendr'\] are missing; found columns \[.*'gender'"):
        read_drop(root, labels=["gendr"])


def test_ingest_stages_bytes_and_quarantines_bad_files(tmp_path):
    good = {f"g{i}.png": _png(i) for i in range(5)}
    same = _png(100)
    files = {**good, "empty.png": b"", "junk.jpg": os.urandom(64), "dupA.png": same, "dupB.png": same,
             "bomb.png": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + (60000).to_bytes(4, "big") * 2 + b"\x08\x00\x00\x00\x00"}
    rows = [f"g{i}.png,s{i},f,,,," for i in range(5)] + [
        "empty.png,s7,m,,,,", "junk.jpg,s8,m,,,,", "dupA.png,s9,m,,,,", "dupB.png,s10,m,,,,", "bomb.png,s11,m,,,,"]
    d = read_drop(_write_drop(tmp_path / "drop", rows, files=files))
    res = ingest(d, tmp_path / "st" / "ingested.parquet", max_pixels=10_000_000, batch_size=2)
    codes = Counter(q.code for q in res.quarantined)
    assert codes == {"empty_file": 1, "unsupported_format": 1, "duplicate_across_people": 2, "image_too_large": 1}
    table = pq.read_table(res.path)
    assert table.num_rows == res.n_records == 5
    assert pq.ParquetFile(res.path).num_row_groups == res.row_groups == 3
    assert table.column("data").to_pylist()[0] == good["g0.png"]
    # Every readable source is hashed (the drop fingerprint covers them), staged or not.
    assert set(table.column("record_id").to_pylist()) < set(res.source_sha256)
    assert len(res.source_sha256) == 7
    q = write_quarantine(d.quarantined + res.quarantined, tmp_path / "st" / "q.parquet")
    assert pq.read_table(q).num_rows == 5


def test_reader_threads_stage_what_one_thread_stages_in_the_same_order(tmp_path):
    """Files read ahead by several threads are staged in manifest order, hashed and quarantined as by one."""
    files, rows = {}, []
    for i in range(90):
        name = f"d{i % 7}/sub{i % 3}/f{i}.png"  # 21 directories: more than a small cache keeps
        files[name] = b"" if i % 17 == 5 else os.urandom(32) if i % 13 == 4 else _png(i, (24, 24))
        rows.append(f"{name},s{i % 30},{'mf'[i % 2]},,,,")
    rows.append("missing/none.png,s99,f,,,,")
    d = read_drop(_write_drop(tmp_path / "drop", rows, files=files))
    out = {}
    for threads in (1, 4):
        res = ingest(d, tmp_path / f"st{threads}" / "ingested.parquet", batch_size=8, read_threads=threads)
        t = pq.read_table(res.path)
        out[threads] = (t.column("record_id").to_pylist(), t.column("data").to_pylist(), t.column("source_sha256").to_pylist(),
                        [(q.record_id, q.code) for q in res.quarantined], res.row_groups, dict(res.source_sha256))
    assert out[1] == out[4]
    ids, data, _, quarantined, _, _ = out[4]
    assert ids == sorted(ids)  # manifest order
    assert data == [files[f"d{i % 7}/sub{i % 3}/f{i}.png"] for i in range(90) if not (i % 17 == 5 or i % 13 == 4)]
    assert {c for _, c in quarantined} == {"empty_file", "unsupported_format"}  # a missing file: read_drop's


def test_kept_directories_read_the_same_bytes_and_still_refuse_links(tmp_path):
    """The ingest's directory cache: same bytes, least recently used closed, a symlinked file refused at reading."""
    from deid.errors import RecordError
    from deid.intake.drop_files import DropDirectories, read_drop_file

    root = tmp_path / "drop"
    for i in range(6):
        (root / f"a{i}" / "b").mkdir(parents=True)
        (root / f"a{i}" / "b" / "x.bin").write_bytes(bytes([i]) * (i + 1))
    (tmp_path / "outside.bin").write_bytes(b"secret")
    (root / "a0" / "b" / "link.bin").symlink_to(tmp_path / "outside.bin")
    before = len(os.listdir("/proc/self/fd"))
    with DropDirectories(size=3) as dirs:
        for _ in range(2):
            for i in range(6):
                assert read_drop_file(root, f"a{i}/b/x.bin", dirs=dirs) == bytes([i]) * (i + 1)
        assert len(dirs._fds) == 3  # at most ``size`` directories kept open
        with pytest.raises(RecordError) as exc:
            read_drop_file(root, "a0/b/link.bin", dirs=dirs)
        assert exc.value.code == "unsafe_path"
        with pytest.raises(RecordError) as exc:
            read_drop_file(root, "a9/b/x.bin", dirs=dirs)
        assert exc.value.code == "missing_file"
    assert len(os.listdir("/proc/self/fd")) == before  # every descriptor closed


def test_partitions_suppress_merge_fail():
    labels = [{"g": "f", "e": "n"}] * 6 + [{"g": "f", "e": "s"}] * 2 + [{"g": "m", "e": "n"}] * 5
    people = [f"p{i}" for i in range(6)] + ["p0", "p1"] + [f"q{i}" for i in range(5)]
    plan = plan_partitions(labels, people, k=3, label_names=["g", "e"], policy="suppress")
    assert set(plan.groups) == {("f", "n"), ("m", "n")}
    assert plan.suppressed == [6, 7] and not plan.failed
    merged = plan_partitions(labels, people, k=3, label_names=["g", "e"], policy="merge")
    assert merged.groups[("f", "n")] == list(range(8)) and merged.suppressed == []
    failed = plan_partitions(labels, people, k=3, label_names=["g", "e"], policy="fail")
    assert failed.failed
    whole = plan_partitions(labels, people, k=3, label_names=["g", "e"], select=False)
    assert whole.groups == {("all",): list(range(13))}
    # Every input is in exactly one partition or suppressed.
    for p in (plan, merged, whole):
        flat = sorted([i for idx in p.groups.values() for i in idx] + p.suppressed)
        assert flat == list(range(13))


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(
    layout=st.lists(st.tuples(st.integers(1, 4), st.sampled_from("fm"), st.sampled_from("ns")), min_size=1,
                    max_size=40),
    k=st.integers(2, 5),
    policy=st.sampled_from(["suppress", "merge"]),
    seed=st.integers(0, 2**16),
)
def test_partition_then_ksame_covers_every_input_once(layout, k, policy, seed):
    """Property: after partitioning and k-Same, every input is in exactly one cluster or suppressed,
    and every cluster holds >= k images of >= k distinct people (many images per person allowed)."""
    from deid.anonymise.ksame import KSame

    people, labels = [], []
    for person, (n_images, gender, expression) in enumerate(layout):
        for i in range(n_images):
            people.append(f"p{person}")
            # A person keeps their gender; expression varies between their images.
            labels.append({"g": gender, "e": expression if i % 2 == 0 else ("s" if expression == "n" else "n")})
    plan = plan_partitions(labels, people, k=k, label_names=["g", "e"], policy=policy)
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(len(people), 5))
    images = rng.integers(0, 255, size=(len(people), 12))
    seen = list(plan.suppressed)
    for idx in plan.groups.values():
        idx = np.asarray(idx)
        model = KSame(k).fit(X[idx], people=[people[i] for i in idx], images=images[idx])
        for c in range(model.n_clusters_):
            members = idx[model.labels_ == c]
            assert len(members) >= k
            assert len({people[i] for i in members}) >= k
        seen.extend(idx.tolist())
    assert sorted(seen) == list(range(len(people)))
