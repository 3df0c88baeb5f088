"""The private linkage record: encrypted round trip, wrong key / tampering, key file permissions, CLI."""
from __future__ import annotations

import csv
import io
import os
import stat

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deid.errors import ConfigError, VerificationError
from deid.release.linkage import (
    build_linkage,
    ensure_linkage_key,
    generate_linkage_key,
    linkage_path,
    linkage_to_csv,
    load_linkage_key,
    read_linkage,
    sources_from_ingested,
    write_linkage,
)
from deid.release.publish import stage_release
from deid.cli import main


def _mapping(n: int = 5) -> list[dict]:
    return [{"released_record_id": f"{i:016x}", "released_image": f"images/{i:016x}.png", "cluster_id": f"c-{i % 2}",
             "source_record_id": f"r{i:08d}", "subject_id": f"person-{i // 2}", "source_image": f"img/{i}.jpg",
             "internal_cluster": f"p000/c{i % 2}"} for i in range(n)]


@pytest.fixture
def key_file(tmp_path):
    return generate_linkage_key(tmp_path / "keys" / "linkage.key")


def test_round_trip_and_ciphertext_hides_the_mapping(tmp_path, key_file):
    key = load_linkage_key(key_file)
    assert len(key) == 32
    path = linkage_path(tmp_path / "data", "rel-abc")
    assert path == tmp_path / "data" / "private" / "rel-abc" / "linkage.bin"
    mapping = _mapping()
    write_linkage(path, mapping, key, release_id="rel-abc")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    blob = path.read_bytes()
    for needle in (b"person-", b"r0000", b"img/", b"c-0"):
        assert needle not in blob
    assert read_linkage(path, key) == mapping


def test_wrong_key_and_flipped_bytes_are_verification_errors(tmp_path, key_file):
    key = load_linkage_key(key_file)
    path = write_linkage(tmp_path / "private" / "r" / "linkage.bin", _mapping(), key)
    other = load_linkage_key(generate_linkage_key(tmp_path / "other.key"))
    with pytest.raises(VerificationError, match="wrong key, or the file was modified"):
        read_linkage(path, other)
    blob = path.read_bytes()
    rng = np.random.default_rng(0)
    # Header, nonce, ciphertext and tag: every region is authenticated.
    for pos in [0, 9, 25, len(blob) // 2, len(blob) - 1, *rng.integers(0, len(blob), 5).tolist()]:
        bad = bytearray(blob)
        bad[pos] ^= 0x01
        tampered = tmp_path / f"tampered-{pos}.bin"
        tampered.write_bytes(bytes(bad))
        with pytest.raises(VerificationError):
            read_linkage(tampered, key)
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(blob[:20])
    with pytest.raises(VerificationError, match="truncated"):
        read_linkage(truncated, key)


def test_key_file_permissions_and_no_overwrite(tmp_path, key_file):
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        generate_linkage_key(key_file)
    os.chmod(key_file, 0o640)
    with pytest.raises(ConfigError, match=r"mode 0640.*chmod 600"):
        load_linkage_key(key_file)
    with pytest.raises(ConfigError, match="does not exist"):
        load_linkage_key(tmp_path / "nope.key")
    short = tmp_path / "short.key"
    short.write_bytes(b"c2hvcnQ=\n")
    os.chmod(short, 0o600)
    with pytest.raises(ConfigError, match="32-byte key"):
        load_linkage_key(short)
    with pytest.raises(ConfigError, match="32 bytes"):
        write_linkage(tmp_path / "x.bin", [], b"too short")


def test_linkage_record_is_never_overwritten(tmp_path, key_file):
    key = load_linkage_key(key_file)
    path = write_linkage(tmp_path / "p" / "linkage.bin", _mapping(2), key)
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        write_linkage(path, _mapping(3), key)
    assert len(read_linkage(path, key)) == 2


def test_development_key_is_created_once(tmp_path):
    key1, path1, origin = ensure_linkage_key(configured=None, keys_dir=tmp_path / "keys")
    key2, path2, _ = ensure_linkage_key(configured=None, keys_dir=tmp_path / "keys")
    assert origin == "development" and path1 == path2 and key1 == key2
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700
    key3, _, origin3 = ensure_linkage_key(configured=path1, keys_dir=tmp_path / "unused")
    assert origin3 == "configured" and key3 == key1


def test_stage_release_mapping_joins_to_sources(tmp_path):
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, size=(6, 4 * 3), dtype=np.uint8)
    record_ids = [f"r{i:08d}" for i in range(6)]
    clusters = ["p0/c0", "p0/c0", "p0/c0", "p1/c0", "p1/c0", "p1/c0"]
    staged = stage_release(tmp_path / "rel", images=images, shape=(4, 3), clusters=clusters,
                           labels={"gender": list("ffmmmf")}, record_ids=record_ids)
    ingested = tmp_path / "ingested.parquet"
    pq.write_table(pa.table({"record_id": record_ids, "subject_id": [f"s{i // 2}" for i in range(6)],
                             "image": [f"src/{i}.png" for i in range(6)]}), ingested)
    rows = build_linkage(staged.mapping, sources_from_ingested(ingested))
    released = pq.read_table(tmp_path / "rel" / "release.parquet").to_pylist()
    by_rid = {r["record_id"]: r for r in released}
    assert {r["released_record_id"] for r in rows} == set(by_rid)
    for row in rows:
        rel = by_rid[row["released_record_id"]]
        i = record_ids.index(row["source_record_id"])
        assert rel["cluster_id"] == row["cluster_id"] and rel["image"] == row["released_image"]
        assert row["subject_id"] == f"s{i // 2}" and row["source_image"] == f"src/{i}.png"
        assert row["internal_cluster"] == clusters[i]
        # the released PNG is the image staged for that source record
        import cv2

        png = cv2.imread(str(tmp_path / "rel" / rel["image"]), cv2.IMREAD_UNCHANGED)
        assert np.array_equal(png.reshape(-1), images[i])
    # nothing of the mapping leaks into the release
    text = (tmp_path / "rel" / "release.csv").read_text()
    assert "r0000" not in text and "p0/c0" not in text


def test_cli_linkage_prints_csv_and_fails_cleanly(tmp_path, key_file, capsys):
    data = tmp_path / "data"
    mapping = _mapping(3)
    write_linkage(linkage_path(data, "rel-1"), mapping, load_linkage_key(key_file))
    assert main(["linkage", "rel-1", "--key", str(key_file), "--data-dir", str(data)]) == 0
    out = capsys.readouterr().out
    assert list(csv.DictReader(io.StringIO(out))) == [{k: str(v) for k, v in m.items()} for m in mapping]
    assert out == linkage_to_csv(mapping)

    other = tmp_path / "other.key"
    assert main(["linkage-keygen", "--out", str(other)]) == 0
    assert stat.S_IMODE(other.stat().st_mode) == 0o600
    assert main(["linkage-keygen", "--out", str(other)]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err

    assert main(["linkage", "rel-1", "--key", str(other), "--data-dir", str(data)]) == 2
    captured = capsys.readouterr()
    assert "wrong key" in captured.err and captured.out == ""
    assert main(["linkage", "rel-2", "--key", str(key_file), "--data-dir", str(data)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["linkage", "rel-1", "--key", str(tmp_path / "missing.key"), "--data-dir", str(data)]) == 2
    assert "does not exist" in capsys.readouterr().err
