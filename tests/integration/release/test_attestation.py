"""A release verifies alone: its signed ATTESTATION.json (deid.release.attestation, deid.reporting.verify.verify_release).

Small synthetic releases (a few files, no run): the flow test (tests/flow/test_flow.py) checks a real release.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_no_deid_check

from deid.errors import BadSignature, HashMismatch, MissingFile, UnlistedFile, VerificationError, WrongKey
from deid.release.attestation import ATTESTATION_NAME, ATTESTATION_SIG_NAME, write_attestation
from deid.release.manifest import list_release
from deid.release.signing import ensure_signing_key, write_keypair
from deid.reporting.verify import verify_release
from deid.reporting.attestation import attestation_from_report
from deid.reporting.report import (
    Check,
    DatasetSummary,
    Privacy,
    Reidentification,
    Report,
    SigningInfo,
    Utility,
    dataset_fingerprint,
)

SECRET_ID = "subj-0042"  # a source subject id put where a careless copy of the report would carry it


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    priv, pub = write_keypair(d, name="steward")
    _, other_pub = write_keypair(d, name="other")
    return ensure_signing_key(configured=priv, keys_dir=d / "unused"), pub, other_pub


def _report(listing, key) -> Report:
    return Report(
        release_id="rel-0123456789abcdef", verdict="released", k=3, method="k-same", run_id=f"run-{SECRET_ID}",
        dataset=DatasetSummary(f"drop-{SECRET_ID}", dataset_fingerprint(b"m", []), 6, 6, 0, 0, {}),
        checks=[Check("enough_people", True, 6, 3, f"6 people, e.g. {SECRET_ID}", status="pass"),
                Check("identity_merge", True, SECRET_ID, None, f"merged {SECRET_ID}", status="pass"),
                Check("reidentification", True, 0.1, "<= 0.25", "", status="pass", interval=[0.0, 0.3], n=30)],
        privacy=Privacy(1 / 3, 0.1, 3, [Reidentification("nearest", "pixels", 0.1)]),
        utility=[Utility("gender", 0.9, 0.85, 0.05)],
        artifacts=list(listing.artifacts), file_manifest=listing.manifest, release_dir=f"/src/{SECRET_ID}",
        signing=SigningInfo.from_key(key), configuration={"seed": 9876543, "drop": f"/data/{SECRET_ID}"})


def _release(root: Path, key) -> Path:
    """A staged release (two images, a card, a table), its manifest written, then attested."""
    (root / "images").mkdir(parents=True)
    (root / "images" / "0a.png").write_bytes(b"\x89PNG fake image one")
    (root / "images" / "1b.png").write_bytes(b"\x89PNG fake image two")
    (root / "README.md").write_text("# card\n", encoding="utf-8")
    (root / "release.csv").write_text("record_id,image\nx,images/0a.png\ny,images/1b.png\n", encoding="utf-8")
    _, listing = list_release(root)
    write_attestation(root, attestation_from_report(_report(listing, key)), key)
    return root


def test_attestation_is_the_public_part_only(tmp_path, keys):
    key, _, _ = keys
    root = _release(tmp_path / "rel", key)
    att = json.loads((root / ATTESTATION_NAME).read_text())
    assert (att["verdict"], att["k"], att["method"]) == ("released", 3, "k-same")
    assert att["signer"]["public_key_fingerprint"] == key.fingerprint
    assert {f["path"] for f in att["files"]} == {"MANIFEST.sha256", "README.md", "release.csv"}
    assert att["file_manifest"]["files"] == 2
    assert {k: v for k, v in att["checks"][2].items() if k != "requirement"} == {
        "name": "reidentification", "passed": True, "status": "pass", "value": 0.1, "required": "<= 0.25",
        "interval": [0.0, 0.3], "n": 30}  # a threshold in words is stated as "required" (with its direction)
    assert att["checks"][0]["required"] == ">= 3" and att["checks"][0]["threshold"] == 3 and att["checks"][0]["requirement"]
    assert "value" not in att["checks"][1]  # a non-numeric value never goes out
    text = (root / ATTESTATION_NAME).read_text()
    for leak in (SECRET_ID, "9876543", "seed", "/src/", "/data/", "run_id", "dataset_fingerprint", "detail"):
        assert leak not in text, leak
    assert len((root / ATTESTATION_SIG_NAME).read_bytes()) == 64  # raw, for openssl -sigfile


def _flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x01
    path.write_bytes(bytes(data))


def _as_link(path: Path) -> None:
    """Move the file out of the release and leave a symlink to it in its place."""
    moved = path.rename(path.parent.parent / path.name)
    path.symlink_to(moved)


def _flip_k(root: Path) -> None:  # still canonical, valid JSON: only the signature catches it
    path = root / ATTESTATION_NAME
    _flip(path, path.read_bytes().index(b'"k":3') + 4)


@pytest.mark.parametrize("tamper, other, kind, code", [
    (None, False, None, 0),
    (_flip_k, False, BadSignature, 3),
    (lambda r: _flip(r / ATTESTATION_NAME, 0), False, BadSignature, 3),  # no longer JSON: still a bad signature
    (lambda r: (r / ATTESTATION_SIG_NAME).write_bytes(b"A" * 88), False, BadSignature, 3),  # base64, not raw
    (None, True, WrongKey, 4),
    (lambda r: (r / "release.csv").unlink(), False, MissingFile, 5),
    (lambda r: (r / ATTESTATION_SIG_NAME).unlink(), False, MissingFile, 5),
    (lambda r: _flip(r / "images" / "1b.png"), False, HashMismatch, 6),
    (lambda r: _flip(r / "README.md", 0), False, HashMismatch, 6),
    (lambda r: (r / "images" / "2c.png").write_bytes(b"smuggled"), False, UnlistedFile, 7),
    (lambda r: (r / "notes.txt").write_bytes(b"smuggled"), False, UnlistedFile, 7),
    (lambda r: _as_link(r / ATTESTATION_NAME), False, VerificationError, 1),  # a link, even to the genuine bytes
])
def test_each_tampering_has_its_type_and_exit_code(tmp_path, keys, capsys, tamper, other, kind, code):
    from deid.cli import main

    key, pub, other_pub = keys
    root = _release(tmp_path / "rel", key)
    if tamper is not None:
        tamper(root)
    given = other_pub if other else pub
    result = verify_release(root, public_key=given)
    if kind is None:
        assert result.ok and result.authenticated and result.failures == []
    else:
        assert not result.ok and kind in {type(f) for f in result.failures}, result.problems
        assert {type(f) for f in result.failures} <= {kind, VerificationError, HashMismatch}, result.problems
    assert main(["verify", str(root), "--public-key", str(given)]) == code
    out = capsys.readouterr().out
    assert ("OK: ATTESTATION.json signature and every file of the release verified" in out) == (code == 0)


def test_without_key_integrity_only_and_mistyped_path_is_bad_input(tmp_path, keys, capsys):
    from deid.cli import EXIT_BAD_INPUT, EXIT_INTEGRITY_ONLY, main

    key, _, _ = keys
    root = _release(tmp_path / "rel", key)
    assert main(["verify", str(root)]) == EXIT_INTEGRITY_ONLY
    assert "INTEGRITY ONLY" in capsys.readouterr().out
    assert main(["verify", str(root) + "-typo"]) == EXIT_BAD_INPUT
    assert main(["verify", str(root), "--release", str(root)]) == EXIT_BAD_INPUT  # --release is for a report dir


def test_no_deid_commands_verify_and_catch_tampering(tmp_path, keys):
    key, pub, _ = keys
    root = _release(tmp_path / "rel", key)
    runs = run_no_deid_check(root, pub)
    assert [r.returncode for r in runs] == [0, 0, 0, 0], [r.stderr for r in runs]
    assert "Signature Verified Successfully" in runs[0].stdout + runs[-1].stdout
    _flip(root / "images" / "0a.png")
    _flip(root / "README.md", 0)
    _flip_k(root)
    runs = run_no_deid_check(root, pub)
    assert [r.returncode != 0 for r in runs] == [True, True, True, True], [(r.stdout, r.stderr) for r in runs]


def test_readme_shows_the_tested_commands():
    """README.md documents the same no-deid commands the card shows and the test above runs (one source)."""
    from deid.release.attestation import NO_DEID_CHECK, PYTHON_SIGNATURE_CHECK

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text(encoding="utf-8")
    assert "```\n" + "\n".join(NO_DEID_CHECK) + "\n```" in readme and PYTHON_SIGNATURE_CHECK in readme


def test_a_field_outside_the_schema_is_never_signed_nor_accepted(tmp_path, keys):
    """The schema is the allow-list: an extra field (a subject id, say) stops the writer, and a verifier refuses
    an attestation carrying one even when it is validly signed (by whoever holds the key)."""
    from deid.errors import StateError
    from deid.release.signing import canonical_json, sign_bytes

    key, pub, _ = keys
    root = _release(tmp_path / "rel", key)
    att = json.loads((root / ATTESTATION_NAME).read_text())
    with pytest.raises(StateError, match="attestation.schema.json"):
        write_attestation(root, {**att, "subject_ids": [SECRET_ID]}, key)
    with pytest.raises(StateError, match="attestation.schema.json"):
        write_attestation(root, {**att, "checks": [{**att["checks"][0], "detail": SECRET_ID}]}, key)
    payload = canonical_json({**att, "subject_ids": [SECRET_ID]})
    (root / ATTESTATION_NAME).write_bytes(payload)
    (root / ATTESTATION_SIG_NAME).write_bytes(sign_bytes(payload, key.private_key))
    result = verify_release(root, public_key=pub)
    assert not result.ok and any("does not match its schema" in p and "subject_ids" in p for p in result.problems)


def test_a_release_without_its_attestation_is_a_missing_file(tmp_path, keys, capsys):
    from deid.cli import main

    key, pub, _ = keys
    root = _release(tmp_path / "rel", key)
    (root / ATTESTATION_NAME).unlink()
    (root / ATTESTATION_SIG_NAME).unlink()
    assert main(["verify", str(root), "--public-key", str(pub)]) == 5
    assert "missing file ATTESTATION.json" in capsys.readouterr().out
