"""Verify a signed report and the release directory it describes, or a release directory alone.

:func:`verify_report` checks the steward's signed report (``reports/<release id>``) and the release it
lists; :func:`verify_release` checks a release directory by itself, from the signed attestation it
carries (:mod:`deid.release.attestation`): what a recipient, who never sees the report, can run.
"""
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
from deid.release.hashing import hash_file, iter_tree, scan_tree
from deid.reporting.report import REPORT_NAME, SIGNATURE_NAME, report_problems
from deid.release.attestation import ATTESTATION_FORMAT, ATTESTATION_NAME, ATTESTATION_SIG_NAME, attestation_problems
from deid.release.manifest import read_manifest
from deid.run_files import ADDENDUM_NAME, ADDENDUM_SIG_NAME
from deid.release.signing import SIGNATURE_BYTES, canonical_json, load_public_key, public_key_fingerprint, verify_bytes

logger = logging.getLogger(__name__)

__all__ = ["VerifyResult", "verify_release", "verify_report", "INTEGRITY_ONLY_NOTE"]

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
                              notes: list[str], *, ignore: frozenset[str] = frozenset()) -> None:
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
    _check_listed(root, report["artifacts"], dict(sorted(files.items())), sorted(others), problems, ignore=ignore)
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

    authenticated = _check_report_signature(report, payload, sig_path, public_key, problems, notes)

    _check_report_release(report_dir, report, release_dir, bool(schema_problems), problems, notes)
    if not schema_problems:
        _check_report_files(report_dir, report, problems, notes)
    _check_addendum(report_dir, public_key, problems, notes)

    ok = not problems
    logger.info("verified %s: ok=%s authenticated=%s problems=%d", report_dir, ok, authenticated, len(problems))
    return VerifyResult(ok=ok, authenticated=authenticated, failures=problems, notes=notes)


def _check_report_signature(report: dict, payload: bytes, sig_path: Path, public_key: Path | None,
                            problems: list[VerificationError], notes: list[str]) -> bool:
    """Check ``payload``'s signature file under ``public_key`` (integrity only without one): True when authentic.

    Appends ``MissingFile``, ``WrongKey`` or ``BadSignature`` to ``problems`` and what was checked to ``notes``.
    """
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
                    if isinstance(signing, dict) and signing.get("key_origin") == "development":
                        notes.append("signed with a development key: not for production releases")
                else:
                    problems.append(BadSignature(f"bad signature: {SIGNATURE_NAME} does not match {REPORT_NAME} under {given}"))
    return authenticated


def _check_report_release(report_dir: Path, report: dict, release_dir: Path | None, schema_invalid: bool,
                          problems: list[VerificationError], notes: list[str]) -> None:
    """Check the release a report names: absent for a rejection, every file as listed for a release.

    Not checked when the report does not match its schema (``schema_invalid``): its lists cannot be trusted.
    """
    if schema_invalid:
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


def _attestation_problem(att: Any) -> str | None:
    """Why ``att`` is not an attestation this version reads (None when it is): checked before any field is used."""
    if isinstance(att, dict) and "format" in att and att["format"] != ATTESTATION_FORMAT:
        return f"has format {att['format']!r}; this deid reads {ATTESTATION_FORMAT!r}"
    problems = attestation_problems(att)
    return None if not problems else "does not match its schema: " + "; ".join(problems[:5])


def _check_attestation_signature(att: Any, payload: bytes, signature: bytes | None, shape: str | None,
                                 public_key: Path | None, problems: list[VerificationError],
                                 notes: list[str]) -> bool:
    """Check an attestation's ``signature`` over ``payload`` under ``public_key``: True when authentic.

    ``shape`` is why the attestation cannot be read (None when it can): a bad signature over bytes that no
    longer parse is a forgery, reported as ``BadSignature``. Raises ``ConfigError`` for an unusable key.
    """
    authenticated = False
    if public_key is None:
        notes.append(INTEGRITY_ONLY_NOTE)
    else:
        key = load_public_key(Path(public_key))  # ConfigError: an unusable key is bad input (the CLI: exit 2)
        given = public_key_fingerprint(key)
        claimed = att.get("signer", {}).get("public_key_fingerprint") if isinstance(att, dict) and isinstance(
            att.get("signer"), dict) else None
        if signature is not None and verify_bytes(payload, signature, key):
            authenticated = True
            notes.append(f"attestation signature verified with {given}")
            if claimed != given:  # signed by this key, yet naming another: not what deid writes
                problems.append(WrongKey(f"wrong key: {ATTESTATION_NAME} names signer {claimed}, signed by {given}"))
            elif att["signer"].get("key_origin") == "development":
                notes.append("signed with a development key: not for production releases")
        elif signature is not None:
            if shape is None and claimed != given:
                problems.append(WrongKey(f"wrong key: {ATTESTATION_NAME} names signer {claimed}, the given public "
                                         f"key is {given}"))
            else:  # the bytes were changed after signing (perhaps no longer even JSON), or the signature was
                problems.append(BadSignature(f"bad signature: {ATTESTATION_SIG_NAME} does not match "
                                             f"{ATTESTATION_NAME} under {given}"))
    return authenticated


def verify_release(release_dir: Path, *, public_key: Path | None = None) -> VerifyResult:
    """Check a release directory alone: its attestation's signature, then every file's sha256, nothing unlisted.

    Parameters
    ----------
    release_dir : path
        A published release (or a copy of it anywhere) holding ``ATTESTATION.json`` and its ``.sig``.
    public_key : path, optional
        The steward's public key the recipient trusts (obtained from the steward, not from the release).
        Without it only integrity is checked: anyone can write an attestation that matches the files.

    Returns
    -------
    VerifyResult
        ``BadSignature`` when the signature does not match the attestation's bytes under the key (also
        when those bytes are no longer valid JSON: one flipped byte is a forgery, not a format problem);
        ``WrongKey`` when the attestation names another signer; ``MissingFile`` / ``HashMismatch`` /
        ``UnlistedFile`` for the files: those the attestation lists (the dataset card, the tables,
        ``MANIFEST.sha256``), the images ``MANIFEST.sha256`` lists (its sha256 the attestation's),
        and any other file but the attestation's two.
    """
    root = Path(release_dir)
    problems: list[VerificationError] = []
    notes: list[str] = []
    path, sig_path = root / ATTESTATION_NAME, root / ATTESTATION_SIG_NAME
    if not path.is_file():
        problems.append(MissingFile(f"missing file {ATTESTATION_NAME} (a release of this deid carries its signed "
                                    "attestation; for an older release verify its report: deid verify reports/<id>)"))
        return VerifyResult(ok=False, authenticated=False, failures=problems, notes=notes)
    for p in (path, sig_path):
        if p.is_symlink():  # a release holds regular files only; a link could point anywhere
            problems.append(VerificationError(f"not a regular file {p.name} (symlinks are not allowed in a release "
                                              "directory)"))
            return VerifyResult(ok=False, authenticated=False, failures=problems, notes=notes)
    payload = path.read_bytes()
    signature = sig_path.read_bytes() if sig_path.is_file() else None
    if signature is None:
        problems.append(MissingFile(f"missing file {ATTESTATION_SIG_NAME}"))
    elif len(signature) != SIGNATURE_BYTES:
        problems.append(BadSignature(f"bad signature: {ATTESTATION_SIG_NAME} holds {len(signature)} bytes, an "
                                     f"Ed25519 signature has {SIGNATURE_BYTES} (raw, not base64)"))
        signature = None
    att: Any = None
    parse_error = None
    try:
        att = json.loads(payload.decode("utf-8"), parse_constant=_reject_constant,
                         object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as exc:
        parse_error = f"{ATTESTATION_NAME} is not valid JSON: {exc}"
    shape = parse_error or (None if (why := _attestation_problem(att)) is None else f"{ATTESTATION_NAME} {why}")

    authenticated = _check_attestation_signature(att, payload, signature, shape, public_key, problems, notes)
    if shape is not None:
        problems.append(VerificationError(f"{shape}; files not checked"))
        return VerifyResult(ok=False, authenticated=False, failures=problems, notes=notes)
    if canonical_json(att) != payload:
        problems.append(VerificationError(f"{ATTESTATION_NAME} is not in canonical form (reformatted or edited "
                                          "after signing)"))
    fm = att["file_manifest"]
    listed = {f["path"]: f for f in att["files"]}
    if fm["path"] not in listed or listed[fm["path"]]["sha256"] != fm["sha256"]:
        problems.append(VerificationError(f"{ATTESTATION_NAME} lists {fm['path']} in files with another sha256 "
                                          "than its file_manifest, or not at all"))
    _check_manifested_release(root, {"file_manifest": fm, "artifacts": att["files"]}, problems, notes,
                              ignore=frozenset({ATTESTATION_NAME, ATTESTATION_SIG_NAME}))
    notes.append(f"release {att['release_id']}: {att['verdict']}, k={att['k']}, method {att['method']}, "
                 f"created {att['created_at']}; guarantee: {att['guarantee']}")
    ok = not problems
    logger.info("verified release %s: ok=%s authenticated=%s problems=%d", root, ok, authenticated, len(problems))
    return VerifyResult(ok=ok, authenticated=authenticated and ok, failures=problems, notes=notes)
