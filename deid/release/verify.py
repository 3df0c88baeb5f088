"""Verify a signed report and the release directory it describes."""
from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deid.errors import (
    BadSignature,
    ConfigError,
    DataError,
    HashMismatch,
    MissingFile,
    UnlistedFile,
    VerificationError,
    WrongKey,
)
from deid.reporting.report import REPORT_NAME, SIGNATURE_NAME, hash_file, iter_tree, report_problems, scan_tree
from deid.release.manifest import read_manifest
from deid.operations.safety import ADDENDUM_NAME, ADDENDUM_SIG_NAME
from deid.release.signing import SIGNATURE_BYTES, canonical_json, load_public_key, public_key_fingerprint, verify_bytes

logger = logging.getLogger(__name__)

__all__ = ["VerifyResult", "verify_report", "INTEGRITY_ONLY_NOTE"]

INTEGRITY_ONLY_NOTE = "integrity only: no --public-key given, signature not verified against a trusted key"


@dataclass
class VerifyResult:
    """Outcome of :func:`verify_report`; ``ok`` only when ``failures`` is empty.

    Each failure is a typed :class:`~deid.errors.VerificationError` (``BadSignature``, ``WrongKey``,
    ``MissingFile``, ``HashMismatch``, ``UnlistedFile``, or the base class for any other problem):
    callers choose by type, never by message text.
    """

    ok: bool
    authenticated: bool
    failures: list[VerificationError] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        """The failures' messages, one line each."""
        return [str(f) for f in self.failures]

    def raise_for_problems(self) -> None:
        """Raise :class:`~deid.errors.VerificationError` listing the problems, if any."""
        if self.problems:
            raise VerificationError("report does not verify: " + "; ".join(self.problems))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k!r}")
        d[k] = v
    return d


def _read_signature(path: Path, problems: list[VerificationError]) -> bytes | None:
    raw = path.read_bytes()
    try:
        sig = base64.b64decode(raw.strip(), validate=True)
    except (binascii.Error, ValueError):
        problems.append(BadSignature(f"bad signature: {SIGNATURE_NAME} is not base64"))
        return None
    if len(sig) != SIGNATURE_BYTES:
        problems.append(BadSignature(f"bad signature: {SIGNATURE_NAME} holds {len(sig)} bytes, an Ed25519 signature has {SIGNATURE_BYTES}"))
        return None
    return sig


def _release_dir(report_dir: Path, report: dict[str, Any], release_dir: Path | None) -> tuple[Path, str]:
    if release_dir is not None:
        return Path(release_dir), "given"
    recorded = report.get("release_dir")
    if isinstance(recorded, str) and Path(recorded).is_dir():
        return Path(recorded), "recorded in the report"
    # Reports live in <project>/reports/<release_id>, releases in <project>/data/releases/<release_id>.
    return report_dir.resolve().parent.parent / "data" / "releases" / str(report.get("release_id", "")), "default location"


def _check_release(root: Path, artifacts: list[dict[str, Any]], problems: list[VerificationError], *,
                   where: str = "", ignore: frozenset[str] = frozenset(), what: str = "release directory") -> None:
    files, others = scan_tree(root)
    _check_listed(root, artifacts, files, others, problems, where=where, ignore=ignore, what=what)


def _check_listed(root: Path, artifacts: list[dict[str, Any]], files: dict[str, str], others: list[str],
                  problems: list[VerificationError], *, where: str = "", ignore: frozenset[str] = frozenset(),
                  what: str = "release directory") -> None:
    """Every listed file exists with its hash, and every regular file of ``files`` (and entry of ``others``) is listed."""
    listed = set(ignore)
    root_resolved = root.resolve()
    for a in artifacts:
        rel = a["path"]
        listed.add(rel)
        p = root / rel
        if not p.resolve().is_relative_to(root_resolved):
            problems.append(VerificationError(f"artifact path {rel} leaves the {what}"))
            continue
        if rel not in files:
            if p.is_symlink() or rel in others:
                problems.append(VerificationError(f"not a regular file {rel}{where} (symlinks are not allowed in a {what})"))
            else:
                problems.append(MissingFile(f"missing file {rel}{where}"))
            continue
        sha, size = hash_file(files[rel])
        if size != a["bytes"]:
            problems.append(HashMismatch(f"hash mismatch {rel}{where}: {size} bytes, report lists {a['bytes']}"))
        elif sha != a["sha256"]:
            problems.append(HashMismatch(f"hash mismatch {rel}{where}: sha256 {sha}, report lists {a['sha256']}"))
    for rel in files:
        if rel not in listed:
            problems.append(UnlistedFile(f"extra unlisted file {rel}{where}"))
    for rel in others:
        if rel not in listed:
            problems.append(UnlistedFile(f"extra unlisted file {rel}{where} (symlink or special file)"))


def _check_manifested_release(root: Path, report: dict[str, Any], problems: list[VerificationError],
                              notes: list[str]) -> None:
    """A release whose images are listed in its signed file manifest (:mod:`deid.release.manifest`).

    The files outside the manifest's directories are checked against ``artifacts`` (the manifest
    among them, its sha256 signed in the report); then the manifest is streamed: every line's file
    exists and has that sha256, and as many regular files lie under the manifest's directories as
    it lists, so no other file is there. Nothing is held per image (a million of them).
    """
    fm = report["file_manifest"]
    covers = tuple(fm["covers"])
    files: dict[str, str] = {}
    others: list[str] = []
    covered, covered_others = 0, set()
    for rel, entry, regular in iter_tree(root):
        if rel.startswith(covers):
            if regular:
                covered += 1
            else:
                covered_others.add(rel)
        elif regular:
            files[rel] = entry.path
        else:
            others.append(rel)
    before = len(problems)
    _check_listed(root, report["artifacts"], dict(sorted(files.items())), sorted(others), problems)
    manifest = files.get(fm["path"])
    if manifest is None or hash_file(manifest)[0] != fm["sha256"]:
        notes.append(f"images under {list(covers)} not checked: {fm['path']} is missing or not the signed one")
        if len(problems) == before:  # not already said by the artifact check
            problems.append(HashMismatch(f"hash mismatch {fm['path']}: not the file manifest the report signs"))
        return
    rows = found = total = 0
    bad_before = len(problems)
    try:
        for sha, rel in read_manifest(Path(manifest)):
            rows += 1
            if not rel.startswith(covers):
                problems.append(VerificationError(f"{fm['path']} lists {rel}, outside its directories {list(covers)}"))
                continue
            p = os.path.join(root, rel)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                problems.append(MissingFile(f"missing file {rel}"))
                continue
            if not stat.S_ISREG(st.st_mode):
                covered_others.discard(rel)
                problems.append(VerificationError(f"not a regular file {rel} (symlinks are not allowed in a release directory)"))
                continue
            found += 1
            got, size = hash_file(Path(p))
            total += size
            if got != sha:
                problems.append(HashMismatch(f"hash mismatch {rel}: sha256 {got}, {fm['path']} lists {sha}"))
    except DataError as exc:
        problems.append(VerificationError(f"{fm['path']} is not a valid file manifest: {exc}"))
        return
    if rows != fm["files"]:
        problems.append(VerificationError(f"{fm['path']} lists {rows} files, the signed report says {fm['files']}"))
    elif len(problems) == bad_before and total != fm["bytes"]:
        problems.append(VerificationError(f"the files {fm['path']} lists hold {total} bytes, the signed report says "
                                          f"{fm['bytes']}"))
    if covered > found:  # some regular file there is not in the manifest: name them (a second pass, only now)
        listed = {rel for _, rel in read_manifest(Path(manifest))}
        problems.extend(UnlistedFile(f"extra unlisted file {rel}") for rel, _, regular in sorted(iter_tree(root))
                        if regular and rel.startswith(covers) and rel not in listed)
    problems.extend(UnlistedFile(f"extra unlisted file {rel} (symlink or special file)") for rel in sorted(covered_others))
    notes.append(f"{found} of {fm['files']} files listed in {fm['path']} checked")


REPORT_DIR_SUFFIX = " (report directory)"


def _check_report_files(report_dir: Path, report: dict[str, Any], problems: list[VerificationError], notes: list[str]) -> None:
    if "report_files" not in report:
        notes.append("the report lists no report files (report.html, validation results): only report.json was checked")
        return
    _check_release(report_dir, report["report_files"], problems, where=REPORT_DIR_SUFFIX,
                   ignore=frozenset({REPORT_NAME, SIGNATURE_NAME, ADDENDUM_NAME, ADDENDUM_SIG_NAME}),
                   what="report directory")
    if report["report_files"]:
        notes.append(f"report directory files verified: {len(report['report_files'])} listed")


def _check_addendum(report_dir: Path, public_key: Path | None, problems: list[VerificationError], notes: list[str]) -> None:
    """A signed addendum (written when a publish failed after signing, or by recovery) is shown and checked."""
    path = report_dir / ADDENDUM_NAME
    if not path.is_file():
        return
    payload = path.read_bytes()
    try:
        add = json.loads(payload.decode("utf-8"))
        notes.append(f"addendum: {add.get('event')}: {add.get('detail')}")
    except (UnicodeDecodeError, ValueError):
        problems.append(VerificationError(f"{ADDENDUM_NAME} is not valid JSON"))
        return
    if public_key is None:
        return
    sig_path = report_dir / ADDENDUM_SIG_NAME
    try:
        sig = base64.b64decode(sig_path.read_bytes().strip(), validate=True)
        key = load_public_key(Path(public_key))
    except (OSError, binascii.Error, ValueError, ConfigError):
        problems.append(BadSignature(f"bad signature: {ADDENDUM_SIG_NAME} missing or unreadable"))
        return
    if not verify_bytes(payload, sig, key):
        problems.append(BadSignature(f"bad signature: {ADDENDUM_SIG_NAME} does not match {ADDENDUM_NAME}"))


def verify_report(
    report_dir: Path,
    *,
    public_key: Path | None = None,
    release_dir: Path | None = None,
) -> VerifyResult:
    """Check a report's canonical form, its signature against a trusted public key, and its release files.

    Without ``public_key`` only integrity is checked: the report names its signer by fingerprint
    only, and a key shipped alongside a report proves nothing, so authenticity needs a key the
    verifier already trusts.
    """
    report_dir = Path(report_dir)
    problems: list[VerificationError] = []
    notes: list[str] = []
    report_path = report_dir / REPORT_NAME
    sig_path = report_dir / SIGNATURE_NAME

    if not report_path.is_file():
        problems.append(MissingFile(f"missing file {report_path}"))
        if not sig_path.is_file():
            problems.append(MissingFile(f"missing file {sig_path}"))
        return VerifyResult(ok=False, authenticated=False, failures=problems, notes=notes)
    payload = report_path.read_bytes()
    try:
        report = json.loads(
            payload.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=_no_duplicate_keys
        )
    except (UnicodeDecodeError, ValueError) as exc:
        problems.append(VerificationError(f"{REPORT_NAME} is not valid JSON: {exc}"))
        return VerifyResult(ok=False, authenticated=False, failures=problems, notes=notes)
    if not isinstance(report, dict):
        problems.append(VerificationError(f"{REPORT_NAME} is not a JSON object"))
        return VerifyResult(ok=False, authenticated=False, failures=problems, notes=notes)
    if canonical_json(report) != payload:
        problems.append(VerificationError(f"{REPORT_NAME} is not in canonical form (it was reformatted or edited after signing)"))
    schema_problems = report_problems(report)
    problems.extend(VerificationError(f"schema: {p}") for p in schema_problems)

    signature: bytes | None = None
    if not sig_path.is_file():
        problems.append(MissingFile(f"missing file {sig_path}"))
    else:
        signature = _read_signature(sig_path, problems)

    authenticated = False
    if public_key is None:
        notes.append(INTEGRITY_ONLY_NOTE)
    else:
        try:
            key = load_public_key(Path(public_key))
        except ConfigError as exc:
            problems.append(VerificationError(f"cannot load public key: {exc}"))
        else:
            given = public_key_fingerprint(key)
            signing = report.get("signing")
            claimed = signing.get("public_key_fingerprint") if isinstance(signing, dict) else None
            if claimed != given:
                problems.append(WrongKey(f"wrong key: report names signer {claimed}, the given public key is {given}"))
            elif signature is not None:
                if verify_bytes(payload, signature, key):
                    authenticated = True
                    notes.append(f"signature verified with {given}")
                    if signing.get("key_origin") == "development":
                        notes.append("signed with a development key: not for production releases")
                else:
                    problems.append(BadSignature(f"bad signature: {SIGNATURE_NAME} does not match {REPORT_NAME} under {given}"))

    if schema_problems:
        notes.append("release and report files not checked: the report does not match its schema")
    elif report["verdict"] == "rejected":
        notes.append(f"verdict rejected ({'; '.join(report['reasons'])}): no release (release_dir null)")
        root, how = _release_dir(report_dir, report, release_dir)
        if root.exists() and any(root.iterdir() if root.is_dir() else [root]):
            problems.append(VerificationError(f"release directory {root} ({how}) exists but the report's verdict is rejected"))
    else:
        root, how = _release_dir(report_dir, report, release_dir)
        if not root.is_dir():
            problems.append(VerificationError(f"release directory {root} ({how}) not found; pass release_dir="))
        else:
            notes.append(f"release directory {root} ({how})")
            if "file_manifest" in report:
                _check_manifested_release(root, report, problems, notes)
            else:  # a report older than the file manifest lists every released file itself
                _check_release(root, report["artifacts"], problems)
    if not schema_problems:
        _check_report_files(report_dir, report, problems, notes)
    _check_addendum(report_dir, public_key, problems, notes)

    ok = not problems
    logger.info("verified %s: ok=%s authenticated=%s problems=%d", report_dir, ok, authenticated, len(problems))
    return VerifyResult(ok=ok, authenticated=authenticated, failures=problems, notes=notes)
