"""Issue 13: the release's images are listed in a signed MANIFEST.sha256, not one report entry each.

A small release (9 images, the tables) written by stage_release, listed by list_release, signed,
then verified and tampered with: every image is still covered by the Ed25519 signature.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from deid.errors import BadSignature, DataError, HashMismatch, MissingFile, StateError, UnlistedFile
from deid.release.manifest import MANIFEST_NAME, ReleaseFiles, list_release, read_manifest
from deid.release.publish import stage_release
from deid.release.signing import canonical_json, ensure_signing_key, sign_bytes, write_keypair
from deid.reporting.verify import verify_report
from deid.reporting.html_report import released_files
from deid.reporting.report import Report, hash_tree, report_problems, write_signed_report


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    priv, pub = write_keypair(d, name="trusted")
    return ensure_signing_key(configured=priv, keys_dir=d / "unused"), pub


def _stage(root: Path):
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (9, 6 * 5), dtype=np.uint8)
    images[4] = images[1]  # two records of one cluster share their bytes
    return stage_release(root, images=images, shape=(6, 5), clusters=[f"c{i % 3}" for i in range(9)],
                         labels={"g": ["f", "m", "f"] * 3})


@pytest.fixture
def signed(tmp_path, keys):
    """(report dir, release dir) of a signed release whose images are in its manifest."""
    from unit.reporting.test_report import make_report  # noqa: PLC0415

    key, _ = keys
    release = tmp_path / "release"
    staged = _stage(release)
    _, listing = list_release(release, known=staged.images)
    report = dataclasses.replace(make_report(key, release_dir=str(release)), artifacts=list(listing.artifacts),
                                 file_manifest=listing.manifest)
    write_signed_report(tmp_path / "report", report, key)
    return tmp_path / "report", release


def test_manifest_round_trips_and_sha256sum_checks_it(tmp_path):
    staged = _stage(tmp_path / "r")
    files, listing = list_release(tmp_path / "r", known=staged.images)
    rows = list(files.rows())
    assert [(h, p) for p, h, _ in rows] == list(read_manifest(tmp_path / "r" / MANIFEST_NAME))
    # What was hashed as written is what the files hold, sorted by their random names (no input order).
    on_disk = sorted((p.relative_to(tmp_path / "r").as_posix(), hashlib.sha256(p.read_bytes()).hexdigest(),
                      p.stat().st_size) for p in (tmp_path / "r" / "images").iterdir())
    assert rows == on_disk and [p for p, _, _ in rows] == sorted(pq.read_table(tmp_path / "r" / "release.parquet")
                                                                 .column("image").to_pylist())
    assert (listing.manifest.files, listing.manifest.bytes) == (9, sum(s for _, _, s in on_disk))
    # The report lists every other file (the manifest among them, with the hash the report signs).
    others = {a["path"]: a["sha256"] for a in hash_tree(tmp_path / "r") if not a["path"].startswith("images/")}
    assert {a.path: a.sha256 for a in listing.artifacts} == others
    assert others[MANIFEST_NAME] == listing.manifest.sha256
    assert files.to_table().column("sha256").type.byte_width == 32
    if shutil.which("sha256sum"):
        subprocess.run(["sha256sum", "-c", "--quiet", MANIFEST_NAME], cwd=tmp_path / "r", check=True)


def test_manifest_refuses_repeated_and_unsafe_paths(tmp_path):
    sha = np.zeros((2, 32), np.uint8)
    with pytest.raises(StateError, match="listed twice"):
        ReleaseFiles.from_columns(["images/a.png", "images/a.png"], sha, np.ones(2, np.int64))
    with pytest.raises(StateError, match="cannot be listed"):
        ReleaseFiles.from_columns(["images/../x.png", "images/a.png"], sha, np.ones(2, np.int64)).write_manifest(
            tmp_path / MANIFEST_NAME)
    (tmp_path / "m").write_bytes(b"0" * 64 + b"  images/b.png\n" + b"0" * 64 + b"  images/a.png\n")
    with pytest.raises(DataError, match="line 2"):
        list(read_manifest(tmp_path / "m"))


def test_signed_manifest_release_verifies_and_counts_every_file(signed, keys):
    report_dir, release = signed
    result = verify_report(report_dir, public_key=keys[1])
    assert result.ok and result.authenticated, result.problems
    report = json.loads((report_dir / "report.json").read_bytes())
    assert not any(a["path"].startswith("images/") for a in report["artifacts"])
    assert released_files(Report.from_dict(report)) == sum(1 for p in release.rglob("*") if p.is_file())
    assert any("9 of 9 files listed in MANIFEST.sha256 checked" in n for n in result.notes)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _an_image(release: Path) -> Path:
    return sorted((release / "images").iterdir())[3]


@pytest.mark.parametrize("tamper, kind, words", [
    (lambda rel: _flip(_an_image(rel)), HashMismatch, "hash mismatch images/"),
    (lambda rel: _an_image(rel).unlink(), MissingFile, "missing file images/"),
    (lambda rel: (rel / "images" / "0000000000000000.png").write_bytes(b"smuggled"), UnlistedFile,
     "extra unlisted file images/0000000000000000.png"),
    (lambda rel: (rel / "images" / "zz.png").symlink_to(_an_image(rel)), UnlistedFile,
     "extra unlisted file images/zz.png (symlink"),
    (lambda rel: _flip(rel / MANIFEST_NAME), HashMismatch, "hash mismatch MANIFEST.sha256"),
])
def test_a_changed_missing_or_extra_image_or_manifest_fails(signed, keys, tamper, kind, words):
    report_dir, release = signed
    tamper(release)
    result = verify_report(report_dir, public_key=keys[1])
    assert not result.ok and result.authenticated  # the report is genuine, the release is not
    assert {type(f) for f in result.failures} == {kind}, result.problems
    assert len(result.failures) == 1 and result.problems[0].startswith(words), result.problems


def test_a_manifest_rewritten_to_match_the_images_needs_a_new_signature(signed, keys):
    """Swap an image and rewrite the manifest and the report's hash of it: only the signature catches it."""
    report_dir, release = signed
    victim = _an_image(release)
    victim.write_bytes(b"another face")
    files, listing = list_release(release)  # an honest manifest of the tampered release
    d = json.loads((report_dir / "report.json").read_bytes())
    d["artifacts"] = [dataclasses.asdict(a) for a in listing.artifacts if a.path in {x["path"] for x in d["artifacts"]}]
    d["file_manifest"] = listing.manifest.to_dict()
    assert report_problems(d) == []
    (report_dir / "report.json").write_bytes(canonical_json(d))
    result = verify_report(report_dir, public_key=keys[1])
    assert not result.ok and {type(f) for f in result.failures} == {BadSignature}, result.problems
    # Re-signed by someone else's key it is still refused; by the steward's key it verifies (the signature is
    # what binds the manifest, hence every image, to the steward).
    other = ensure_signing_key(configured=None, keys_dir=report_dir.parent / "attacker")
    (report_dir / "report.json.sig").write_bytes(base64.b64encode(sign_bytes(canonical_json(d), other.private_key)))
    assert not verify_report(report_dir, public_key=keys[1]).ok
    (report_dir / "report.json.sig").write_bytes(base64.b64encode(sign_bytes(canonical_json(d), keys[0].private_key)))
    assert verify_report(report_dir, public_key=keys[1]).ok


def test_report_must_list_the_manifest_it_describes(signed):
    report_dir, _ = signed
    d = json.loads((report_dir / "report.json").read_bytes())
    assert report_problems(d) == []
    assert Report.from_dict(d).to_dict() == d
    no_manifest = {**d, "artifacts": [a for a in d["artifacts"] if a["path"] != MANIFEST_NAME]}
    assert any("is not listed in $.artifacts" in p for p in report_problems(no_manifest))
    other_hash = {**d, "file_manifest": {**d["file_manifest"], "sha256": "0" * 64}}
    assert any("differs from" in p for p in report_problems(other_hash))
    twice = {**d, "artifacts": sorted([*d["artifacts"], {"path": "images/a.png", "sha256": "0" * 64, "bytes": 1}],
                                      key=lambda a: a["path"])}
    assert any("which the file manifest lists" in p for p in report_problems(twice))
    rejected = {**d, "verdict": "rejected", "reasons": ["x"], "artifacts": [], "release_dir": None}
    assert any(p.startswith("$.file_manifest:") for p in report_problems(rejected))


def test_files_changed_or_added_since_written_are_hashed_again(tmp_path):
    staged = _stage(tmp_path / "r")
    victim = sorted((tmp_path / "r" / "images").iterdir())[2]
    victim.write_bytes(b"rewritten, another size")
    (tmp_path / "r" / "images" / "0000000000000000.png").write_bytes(b"added")
    files, _ = list_release(tmp_path / "r", known=staged.images)
    assert files.to_table().equals(list_release(tmp_path / "r")[0].to_table())  # as if every file were read
    assert len(files) == 10 and files.known()[f"images/{victim.name}"][1] == len(b"rewritten, another size")
