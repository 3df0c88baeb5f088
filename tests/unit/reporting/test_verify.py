"""End-to-end: sign a report over a release directory, then tamper with it (deid.reporting.verify)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from deid.errors import BadSignature, HashMismatch, MissingFile, UnlistedFile, VerificationError, WrongKey
from deid.reporting.report import (
    Artifact,
    Check,
    DatasetSummary,
    Privacy,
    Reidentification,
    Report,
    SigningInfo,
    Utility,
    dataset_fingerprint,
    hash_tree,
    write_signed_report,
)
from deid.release.signing import canonical_json, ensure_signing_key, write_keypair
from deid.reporting.verify import INTEGRITY_ONLY_NOTE, verify_report


@pytest.fixture(scope="module")
def key_material(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    priv, pub = write_keypair(d, name="trusted")
    signing_key = ensure_signing_key(configured=priv, keys_dir=d / "unused")
    _, other_pub = write_keypair(d, name="other")
    return signing_key, pub, other_pub


def _release(project: Path, release_id: str = "r1", *, verdict: str = "released") -> tuple[Path, Path]:
    """A project dir with data/releases/<id> (a few seeded files) and an empty reports/<id>."""
    release_dir = project / "data" / "releases" / release_id
    report_dir = project / "reports" / release_id
    report_dir.mkdir(parents=True)
    if verdict == "released":
        rng = np.random.default_rng(7)
        (release_dir / "faces").mkdir(parents=True)
        np.save(release_dir / "faces" / "part-0.npy", rng.integers(0, 255, size=(4, 8, 8), dtype=np.uint8))
        (release_dir / "labels.csv").write_text("id,gender\n0,f\n1,m\n", encoding="utf-8")
        (release_dir / "README.txt").write_text("deidentified, k=3\n", encoding="utf-8")
    return release_dir, report_dir


def _signed(project: Path, signing_key, *, verdict: str = "released", record_release_dir: bool = True) -> tuple[Path, Path]:
    release_dir, report_dir = _release(project, verdict=verdict)
    released = verdict == "released"
    report = Report(
        release_id="r1",
        verdict=verdict,
        reasons=[] if released else ["utility: gender accuracy dropped by 0.2 > tolerance 0.05"],
        k=3,
        method="k-same",
        run_id="run-1",
        dataset=DatasetSummary("toy", dataset_fingerprint(b"m", []), 6, 6 if released else 0, 0, 0, {}),
        checks=[Check("utility_gender", released, 0.85 if released else 0.7, 0.05, "")],
        privacy=Privacy(1 / 3, 0.2, 3, [Reidentification("nearest", "pixels", 0.2)]),
        utility=[Utility("gender", 0.9, 0.85 if released else 0.7, 0.05)],
        artifacts=[Artifact(**a) for a in hash_tree(release_dir)] if released else [],
        release_dir=(str(release_dir) if record_release_dir else "/nonexistent/elsewhere/r1") if released else None,
        signing=SigningInfo.from_key(signing_key),
    )
    write_signed_report(report_dir, report, signing_key)
    return report_dir, release_dir


def test_sign_then_verify_passes(tmp_path, key_material):
    signing_key, pub, _ = key_material
    report_dir, _ = _signed(tmp_path, signing_key)
    result = verify_report(report_dir, public_key=pub)
    assert result.problems == []
    assert result.ok and result.authenticated


def test_without_public_key_only_integrity_is_checked(tmp_path, key_material):
    signing_key, _, _ = key_material
    report_dir, _ = _signed(tmp_path, signing_key)
    result = verify_report(report_dir)
    assert result.ok and not result.authenticated
    assert INTEGRITY_ONLY_NOTE in result.notes


def test_flipped_byte_in_report_fails(tmp_path, key_material):
    signing_key, pub, _ = key_material
    report_dir, _ = _signed(tmp_path, signing_key)
    path = report_dir / "report.json"
    data = bytearray(path.read_bytes())
    # flip one byte inside a value so the file stays canonical JSON: only the signature can catch it
    i = data.index(b'"run-1"') + 5
    data[i] ^= 0x01  # '1' -> '0'
    path.write_bytes(bytes(data))
    result = verify_report(report_dir, public_key=pub)
    assert not result.ok and not result.authenticated
    assert any(p.startswith("bad signature") for p in result.problems), result.problems


def test_reformatted_report_is_not_canonical(tmp_path, key_material):
    signing_key, pub, _ = key_material
    report_dir, _ = _signed(tmp_path, signing_key)
    path = report_dir / "report.json"
    path.write_text(json.dumps(json.loads(path.read_bytes()), indent=2), encoding="utf-8")
    result = verify_report(report_dir, public_key=pub)
    assert not result.ok
    assert any("not in canonical form" in p for p in result.problems)
    assert any(p.startswith("bad signature") for p in result.problems)


def test_flipped_byte_in_release_file_fails(tmp_path, key_material):
    signing_key, pub, _ = key_material
    report_dir, release_dir = _signed(tmp_path, signing_key)
    target = release_dir / "faces" / "part-0.npy"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))
    result = verify_report(report_dir, public_key=pub)
    assert not result.ok and result.authenticated  # the report is genuine, the release is not
    assert len(result.problems) == 1
    assert result.problems[0].startswith("hash mismatch faces/part-0.npy")


def test_missing_and_extra_release_files_fail(tmp_path, key_material):
    signing_key, pub, _ = key_material
    report_dir, release_dir = _signed(tmp_path, signing_key)
    (release_dir / "labels.csv").unlink()
    (release_dir / "faces" / "smuggled.npy").write_bytes(b"\x00" * 16)
    result = verify_report(report_dir, public_key=pub)
    assert not result.ok
    assert "missing file labels.csv" in result.problems
    assert "extra unlisted file faces/smuggled.npy" in result.problems
    assert len(result.problems) == 2


def test_symlink_in_release_fails(tmp_path, key_material):
    signing_key, pub, _ = key_material
    report_dir, release_dir = _signed(tmp_path, signing_key)
    os.symlink(release_dir / "labels.csv", release_dir / "alias.csv")
    result = verify_report(report_dir, public_key=pub)
    assert not result.ok
    assert any(p.startswith("extra unlisted file alias.csv") for p in result.problems)


def test_other_key_fails_as_wrong_key(tmp_path, key_material):
    signing_key, _, other_pub = key_material
    report_dir, _ = _signed(tmp_path, signing_key)
    result = verify_report(report_dir, public_key=other_pub)
    assert not result.ok and not result.authenticated
    assert len(result.problems) == 1 and result.problems[0].startswith("wrong key: ")
    assert signing_key.fingerprint in result.problems[0]


def test_missing_signature_fails(tmp_path, key_material):
    signing_key, pub, _ = key_material
    report_dir, _ = _signed(tmp_path, signing_key)
    (report_dir / "report.json.sig").unlink()
    for kwargs in ({"public_key": pub}, {}):
        result = verify_report(report_dir, **kwargs)
        assert not result.ok and not result.authenticated
        assert any(p.startswith("missing file") and p.endswith("report.json.sig") for p in result.problems)


def test_missing_report_fails(tmp_path, key_material):
    result = verify_report(tmp_path / "reports" / "nothing")
    assert not result.ok
    assert any(p.endswith("report.json") and p.startswith("missing file") for p in result.problems)


def test_release_dir_fallbacks(tmp_path, key_material):
    signing_key, pub, _ = key_material
    # recorded release_dir does not exist on this machine: the default <project>/data/releases/<id> is used
    report_dir, release_dir = _signed(tmp_path / "p1", signing_key, record_release_dir=False)
    result = verify_report(report_dir, public_key=pub)
    assert result.ok, result.problems
    assert any("default location" in n for n in result.notes)
    # an explicit release_dir wins, and is checked
    moved = tmp_path / "moved"
    shutil.copytree(release_dir, moved)
    (moved / "labels.csv").write_text("tampered\n", encoding="utf-8")
    result = verify_report(report_dir, public_key=pub, release_dir=moved)
    assert not result.ok
    assert len(result.problems) == 1 and result.problems[0].startswith("hash mismatch labels.csv")


def test_rejected_report_verifies_with_note(tmp_path, key_material):
    signing_key, pub, _ = key_material
    report_dir, release_dir = _signed(tmp_path, signing_key, verdict="rejected")
    result = verify_report(report_dir, public_key=pub)
    assert result.ok and result.authenticated, result.problems
    assert any("no release (release_dir null)" in n for n in result.notes)
    # but data published under the rejected release id is a problem
    release_dir.mkdir(parents=True)
    (release_dir / "faces.npy").write_bytes(b"x")
    result = verify_report(report_dir, public_key=pub)
    assert not result.ok and "verdict is rejected" in result.problems[0]


def test_report_edited_and_resigned_with_foreign_key_claims_trusted_fingerprint(tmp_path, key_material):
    """An attacker who copies the trusted fingerprint into a report signed with their own key is caught."""
    signing_key, pub, _ = key_material
    report_dir, _ = _signed(tmp_path, signing_key)
    attacker = ensure_signing_key(configured=None, keys_dir=tmp_path / "attacker_keys")
    d = json.loads((report_dir / "report.json").read_bytes())
    d["k"] = 2
    d["privacy"]["bound"] = 0.5
    payload = canonical_json(d)  # keeps the trusted fingerprint in signing
    import base64

    from deid.release.signing import sign_bytes

    (report_dir / "report.json").write_bytes(payload)
    (report_dir / "report.json.sig").write_bytes(base64.b64encode(sign_bytes(payload, attacker.private_key)) + b"\n")
    result = verify_report(report_dir, public_key=pub)
    assert not result.ok and not result.authenticated
    assert any(p.startswith("bad signature") for p in result.problems)


def test_report_without_report_files_notes_that_only_report_json_was_checked(tmp_path, key_material):
    signing_key, pub, _ = key_material
    report_dir, _ = _signed(tmp_path, signing_key)
    (report_dir / "report.html").write_text("unlisted, but the report makes no claim about it")
    result = verify_report(report_dir, public_key=pub)
    assert result.ok, result.problems
    assert any("lists no report files" in n for n in result.notes)


def _flip_report_byte(report_dir: Path, release_dir: Path) -> None:
    path = report_dir / "report.json"
    data = bytearray(path.read_bytes())
    data[data.index(b'"run-1"') + 5] ^= 0x01  # still canonical JSON: only the signature catches it
    path.write_bytes(bytes(data))


def _flip_release_byte(report_dir: Path, release_dir: Path) -> None:
    target = release_dir / "faces" / "part-0.npy"
    data = bytearray(target.read_bytes())
    data[-1] ^= 0xFF
    target.write_bytes(bytes(data))


@pytest.mark.parametrize("tamper, use_other_key, kind, code", [
    (None, False, None, 0),
    (_flip_report_byte, False, BadSignature, 3),
    (None, True, WrongKey, 4),
    (lambda rep, rel: (rel / "labels.csv").unlink(), False, MissingFile, 5),
    (_flip_release_byte, False, HashMismatch, 6),
    (lambda rep, rel: (rel / "faces" / "smuggled.npy").write_bytes(b"\0" * 16), False, UnlistedFile, 7),
    (lambda rep, rel: shutil.rmtree(rel), False, VerificationError, 1),  # release directory not found
])
def test_each_kind_of_failure_has_its_type_and_its_exit_code(tmp_path, key_material, capsys, tamper,
                                                             use_other_key, kind, code):
    from deid.cli import main

    signing_key, pub, other_pub = key_material
    report_dir, release_dir = _signed(tmp_path, signing_key)
    if tamper is not None:
        tamper(report_dir, release_dir)
    key = other_pub if use_other_key else pub
    result = verify_report(report_dir, public_key=key)
    if kind is None:
        assert result.ok and result.failures == []
    else:
        # Exactly the expected kind (the base class only when no subclass applies).
        assert {type(f) for f in result.failures} == {kind}, result.problems
    assert main(["verify", str(report_dir), "--public-key", str(key)]) == code
    out = capsys.readouterr().out
    assert ("OK: signature and every artifact verified" in out) == (code == 0)
    assert out.count("FAIL: ") == len(result.failures)


def test_an_unusable_public_key_option_is_bad_input(tmp_path, key_material, capsys):
    from deid.cli import EXIT_BAD_INPUT, main

    signing_key, _, _ = key_material
    report_dir, _ = _signed(tmp_path, signing_key)
    assert main(["verify", str(report_dir), "--public-key", str(tmp_path / "nope.pub.pem")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.pub.pem does not exist" in err[0], err
