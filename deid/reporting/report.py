"""The release report: its model, its JSON Schema validation, and writing it signed."""
from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata, resources
from pathlib import Path, PurePath
from typing import Any, Literal

import jsonschema

from deid.errors import REASONS, ConfigError, StateError
from deid.evaluation.checks import INSUFFICIENT
from deid.evaluation.gate_rows import AttackRow
# The released files' records and their hashing belong to the release (its manifest and verifier use them): re-exported.
from deid.release.hashing import Artifact, FileManifest, hash_file, iter_tree, scan_tree
from deid.release.signing import SigningKey, canonical_json, sign_bytes
from deid.bound import within_bound

logger = logging.getLogger(__name__)

__all__ = [
    "Artifact",
    "Check",
    "DatasetSummary",
    "FileManifest",
    "Privacy",
    "Reidentification",
    "Report",
    "SigningInfo",
    "Utility",
    "dataset_fingerprint",
    "hash_file",
    "hash_report_files",
    "hash_tree",
    "iter_tree",
    "jsonable",
    "load_schema",
    "package_versions",
    "report_problems",
    "utc_now_iso",
    "validate_report",
    "write_signed_report",
]

REPORT_NAME = "report.json"
SIGNATURE_NAME = "report.json.sig"
SCHEMA_NAME = "report.schema.json"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
DEFAULT_VERSION_PACKAGES = (
    "deid", "numpy", "opencv-python-headless", "scikit-learn", "pyarrow", "cryptography", "prefect", "dask",
)


def stage_usage_of(value: Any) -> dict[str, float | None]:
    """One ``configuration.stage_seconds`` entry as ``{"wall", "cpu", "peak_rss_mib", "tree_peak_rss_mib"}``.

    Reports before issue 32 hold the wall seconds alone (a number): the other figures are then None.
    """
    keys = ("wall", "cpu", "peak_rss_mib", "tree_peak_rss_mib")
    if isinstance(value, Mapping):
        return {k: None if value.get(k) is None else float(value[k]) for k in keys}
    return {"wall": float(value), "cpu": None, "peak_rss_mib": None, "tree_peak_rss_mib": None}


def _drop_none(d: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``d`` without the optional ``keys`` whose value is None (older reports lack them)."""
    for key in keys:
        if d.get(key, 0) is None:
            del d[key]
    return d


@dataclass
class DatasetSummary:
    """Where the records went: in = released + withheld + suppressed + quarantined.

    ``records_withheld``: de-identified and judged by the gate, not released because the gate
    rejected the run (0 when released; None in reports older than this field). Suppressed
    records were held back before the gate (small label partitions, lineage newcomers waiting,
    near-copy clusters the de-identify stage could not repair: ``near_copy_repair``).
    """

    name: str
    fingerprint: str
    records_in: int
    records_released: int
    records_suppressed: int
    records_quarantined: int
    quarantine_by_reason: dict[str, int] = field(default_factory=dict)
    records_withheld: int | None = None
    # The de-identify stage's near-copy repair (deid.anonymise.near_copy.NearCopyRepair.to_dict);
    # None: the method gets none (or an older report).
    near_copy_repair: dict[str, Any] | None = None


@dataclass
class Check:
    """One gate check and its outcome (``value``/``threshold``: any JSON value, None when absent).

    ``status`` (pass, fail, inconclusive, not_applicable), ``interval`` and ``n`` as in
    :class:`deid.evaluation.checks.Check`; None leaves them out.
    """

    name: str
    passed: bool
    value: Any = None
    threshold: Any = None
    detail: str = ""
    status: str | None = None
    interval: list[float] | None = None
    n: int | None = None

    @classmethod
    def from_gate(cls, check: Any) -> Check:
        """The report's record of a :class:`deid.evaluation.checks.Check`."""
        return cls(**check.to_dict())


# Re-identification rate of one attacker in one mode, with its one-sided bounds and sample sizes: the gate's row,
# one type for the gate and the report (the report is above the gate in the layers, so it uses the gate's type).
Reidentification = AttackRow


@dataclass
class Privacy:
    """The privacy bound 1/k and what was measured against it (see the gate, :mod:`deid.evaluation.gate`)."""

    bound: float
    max_rate: float | None = None
    min_distinct_people_per_cluster: int | None = None
    reidentification: list[Reidentification] = field(default_factory=list)
    max_person_share: float | None = None
    exact_bound: bool | None = None
    attack_sample: dict[str, Any] | None = None
    # Per label partition (opaque key): records, people, clusters formed, distinct faces, feasible maximum.
    partitions: list[dict[str, Any]] | None = None
    # Membership disclosure (deid.evaluation.membership): what k-Same does not bound, measured beside 1/k.
    membership: dict[str, Any] | None = None
    # What the guarantee covers and what it does not, in words (deid.evaluation.membership.SCOPE).
    scope: dict[str, str] | None = None


@dataclass
class Utility:
    """Classifier accuracy for one utility label before and after de-identification."""

    label: str
    original_accuracy: float | None
    deidentified_accuracy: float | None
    tolerance: float
    detail: str | None = ""
    # How accuracy was measured (e.g. "train-original/test-release"); None leaves it out of the report.
    protocol: str | None = None
    # The protocol's further evidence (intervals, sample sizes, the gate's status ...), flattened into the row.
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Utility:
        """A utility row of the gate (or of a report) as the typed record; unknown keys go to ``extra``."""
        known = ("label", "original_accuracy", "deidentified_accuracy", "tolerance", "detail", "protocol")
        return cls(label=row["label"], original_accuracy=row.get("original_accuracy"),
                   deidentified_accuracy=row.get("deidentified_accuracy"), tolerance=row["tolerance"],
                   detail=row.get("detail"), protocol=row.get("protocol"),
                   extra={k: v for k, v in row.items() if k not in known})


@dataclass
class SigningInfo:
    """Which key signed the report (by fingerprint; the key itself is never embedded)."""

    public_key_fingerprint: str
    key_origin: Literal["configured", "development"]
    algorithm: Literal["ed25519"] = "ed25519"

    @classmethod
    def from_key(cls, signing_key: SigningKey) -> SigningInfo:
        return cls(public_key_fingerprint=signing_key.fingerprint, key_origin=signing_key.origin)


@dataclass
class Report:
    """The signed record of one run, released or rejected (see ``schemas/report.schema.json``)."""

    release_id: str
    verdict: Literal["released", "rejected"]
    k: int
    method: str
    run_id: str
    dataset: DatasetSummary
    signing: SigningInfo
    reasons: list[str] = field(default_factory=list)
    created_at: str = field(default_factory=lambda: utc_now_iso())
    checks: list[Check] = field(default_factory=list)
    privacy: Privacy | None = None
    utility: list[Utility] = field(default_factory=list)
    artifacts: list[Artifact] = field(default_factory=list)
    release_dir: str | None = None
    versions: dict[str, str | None] = field(default_factory=dict)  # None: not installed
    configuration: dict[str, Any] = field(default_factory=dict)
    # Files of the report directory besides report.json/.sig (report.html, validation results);
    # None leaves the field out (older reports), a list makes verify check the report dir exactly.
    report_files: list[Artifact] | None = None
    # The method's promise (deid.anonymise.methods.guarantee), checks that could not decide, the dataset's
    # lineage and the data-validation summaries; None leaves each out (older reports).
    guarantee: str | None = None
    warnings: list[str] | None = None
    lineage: dict[str, Any] | None = None
    validation: dict[str, Any] | None = None
    # The images are listed in a signed file of the release, not in ``artifacts`` (issue 13); None: every
    # released file is in ``artifacts`` (a rejected run, or a report older than the manifest).
    file_manifest: FileManifest | None = None

    @property
    def released(self) -> bool:
        return self.verdict == "released"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (Paths as POSIX strings, tuples as lists, numpy scalars as Python numbers)."""
        # The file lists (one entry per released file: a million at issue 13's scale) are converted
        # directly, not through the generic dataclasses.asdict / jsonable walk.
        files = {"artifacts": _files_dicts(self.artifacts),
                 "report_files": None if self.report_files is None else _files_dicts(self.report_files)}
        d = dataclasses.asdict(dataclasses.replace(self, artifacts=[], report_files=None, file_manifest=None))
        if d["privacy"] is None:
            d["privacy"] = dataclasses.asdict(Privacy(bound=1.0 / self.k))
        _drop_none(d, "report_files", "guarantee", "warnings", "lineage", "validation", "file_manifest")
        _drop_none(d["dataset"], "records_withheld", "near_copy_repair")
        _drop_none(d["privacy"], "max_person_share", "exact_bound", "attack_sample", "partitions", "membership",
                   "scope")
        for r in d["privacy"]["reidentification"]:
            _drop_none(r, "n_probes", "records", "lower", "upper", "status")
        for c in d["checks"]:
            _drop_none(c, "status", "interval", "n")
        for u in d["utility"]:
            extra = u.pop("extra")
            _drop_none(u, "protocol", "detail")
            u.update(extra)
        out = jsonable(d)
        out["artifacts"] = files["artifacts"]
        if files["report_files"] is not None:
            out["report_files"] = files["report_files"]
        if self.file_manifest is not None:
            out["file_manifest"] = self.file_manifest.to_dict()
        # The keys in the dataclass's field order, as dataclasses.asdict gives them.
        return {f.name: out[f.name] for f in dataclasses.fields(self) if f.name in out}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Report:
        """Inverse of :meth:`to_dict` (no validation; call :func:`validate_report` for that)."""
        p = d["privacy"]
        optional = {key: d[key] for key in ("guarantee", "warnings", "lineage", "validation") if key in d}
        return cls(**optional,
            release_id=d["release_id"],
            verdict=d["verdict"],
            reasons=list(d["reasons"]),
            k=d["k"],
            method=d["method"],
            created_at=d["created_at"],
            run_id=d["run_id"],
            dataset=DatasetSummary(**d["dataset"]),
            checks=[Check(**c) for c in d["checks"]],
            privacy=Privacy(
                bound=p["bound"],
                max_rate=p["max_rate"],
                min_distinct_people_per_cluster=p["min_distinct_people_per_cluster"],
                reidentification=[Reidentification(**r) for r in p["reidentification"]],
                max_person_share=p.get("max_person_share"),
                exact_bound=p.get("exact_bound"),
                attack_sample=p.get("attack_sample"),
                partitions=p.get("partitions"),
                membership=p.get("membership"),
                scope=p.get("scope"),
            ),
            utility=[Utility.from_row(u) for u in d["utility"]],
            artifacts=[Artifact(**a) for a in d["artifacts"]],
            release_dir=d["release_dir"],
            signing=SigningInfo(**d["signing"]),
            versions=dict(d["versions"]),
            configuration=dict(d["configuration"]),
            report_files=[Artifact(**a) for a in d["report_files"]] if "report_files" in d else None,
            file_manifest=FileManifest.from_dict(d["file_manifest"]) if "file_manifest" in d else None,
        )


def _files_dicts(files: Iterable[Artifact]) -> list[dict[str, Any]]:
    """``[{path, sha256, bytes}]`` of :class:`Artifact` s, as :func:`jsonable` would give them."""
    return [{"path": a.path if type(a.path) is str else jsonable(a.path), "sha256": jsonable(a.sha256),
             "bytes": jsonable(a.bytes)} for a in files]


def utc_now_iso() -> str:
    """Current time as ISO 8601 UTC with a ``Z`` suffix, second precision."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def package_versions(packages: Iterable[str] = DEFAULT_VERSION_PACKAGES) -> dict[str, str]:
    """Installed version of each package that is installed (missing ones are left out)."""
    out: dict[str, str] = {}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def jsonable(obj: Any) -> Any:
    """Convert Paths, tuples, sets, numpy scalars/arrays and dataclasses to plain JSON types, recursively."""
    if obj is None or isinstance(obj, bool | str):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, PurePath):
        return obj.as_posix()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, set | frozenset):
        return sorted(jsonable(v) for v in obj)
    # numpy without importing it: scalars have .item(), arrays .tolist()
    if hasattr(obj, "tolist") and callable(obj.tolist):
        return jsonable(obj.tolist())
    if hasattr(obj, "item") and callable(obj.item):
        return jsonable(obj.item())
    raise TypeError(f"cannot put a {type(obj).__name__} ({obj!r}) into a report; convert it to str, number, list or dict")


def dataset_fingerprint(manifest_bytes: bytes, source_sha256s: Iterable[str]) -> str:
    """Fingerprint a drop by its manifest bytes and the hashes of its source files.

    Returns ``"sha256:" + hexdigest`` of SHA-256 over exactly these bytes::

        b"deid-dataset-v1\\n"
        len(manifest_bytes) as 8-byte big-endian unsigned integer
        manifest_bytes
        for each source hash h in sorted(lowercase hex hashes), duplicates kept:
            h as 64 ASCII bytes + b"\\n"

    The length prefix keeps manifest bytes and hash list unambiguous; sorting makes the
    result independent of the order in which files were hashed.
    """
    hashes = []
    for h in source_sha256s:
        hl = str(h).lower()
        if hl.startswith("sha256:"):
            hl = hl[len("sha256:"):]
        if not _HEX64.match(hl):
            raise ConfigError(f"source sha256 {h!r} must be 64 hexadecimal characters (a SHA-256 hexdigest)")
        hashes.append(hl)
    digest = hashlib.sha256()
    digest.update(b"deid-dataset-v1\n")
    digest.update(len(manifest_bytes).to_bytes(8, "big"))
    digest.update(bytes(manifest_bytes))
    for hl in sorted(hashes):
        digest.update(hl.encode("ascii") + b"\n")
    return "sha256:" + digest.hexdigest()


def _hash_regular_files(root: Path, *, what: str, missing: str, special: str,
                        skip: tuple[str, ...] = (),
                        known: Mapping[str, tuple[str, int]] | None = None) -> list[dict[str, Any]]:
    """``[{path, sha256, bytes}]`` of the files under ``root`` but ``skip``; ``what`` and the hints word the errors.

    ``known``: relative path -> (sha256, bytes) of files whose hash the caller computed from the very
    bytes it wrote; such a file (still that size) is not read again.
    """
    if not root.is_dir():
        raise StateError(f"{what} {root} {missing}")
    files, others = scan_tree(root)
    if others:
        raise StateError(f"{what} {root} contains symlinks or special files {others[:5]}; {special}")
    out = []
    known = known or {}
    for rel, p in files.items():
        if rel in skip:
            continue
        got = known.get(rel)
        if got is not None and os.stat(p).st_size == got[1]:
            sha, size = got
        else:
            sha, size = hash_file(p)
        out.append({"path": rel, "sha256": sha, "bytes": size})
    return out


def hash_tree(root: Path, *, known: Mapping[str, tuple[str, int]] | None = None) -> list[dict[str, Any]]:
    """``[{path, sha256, bytes}]`` for every regular file under ``root``, sorted by POSIX relative path; refuses symlinks.

    ``known``: (sha256, bytes) of files hashed as they were written (e.g.
    :meth:`deid.release.manifest.ReleaseFiles.known`), not read again. A release lists its images with
    :func:`deid.release.manifest.list_release` (columns and a manifest), not with this.
    """
    return _hash_regular_files(
        Path(root),
        what="release directory",
        missing="does not exist or is not a directory",
        special="a release must hold only regular files (copy the data instead of linking it)",
        known=known,
    )


def hash_report_files(report_dir: Path) -> list[dict[str, Any]]:
    """``[{path, sha256, bytes}]`` for every file of ``report_dir`` except report.json and its signature.

    Call it after writing report.html and the validation results and before signing, and put the
    result in the report's ``report_files``; verify then checks the report directory exactly.
    """
    return _hash_regular_files(
        Path(report_dir),
        what="report directory",
        missing="does not exist; write report.html into it first",
        special="write regular files only",
        skip=(REPORT_NAME, SIGNATURE_NAME),
    )


@functools.lru_cache(maxsize=1)
def load_schema() -> dict[str, Any]:
    """The report JSON Schema (draft 2020-12) shipped in the ``deid.schemas`` package."""
    text = resources.files("deid.schemas").joinpath(SCHEMA_NAME).read_text(encoding="utf-8")
    schema = json.loads(text)
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def _non_finite(obj: Any, where: str = "$") -> list[str]:
    if isinstance(obj, float) and not math.isfinite(obj):
        return [f"{where} = {obj!r} is not a finite number (use null when a value could not be computed)"]
    if isinstance(obj, Mapping):
        return [p for k, v in obj.items() for p in _non_finite(v, f"{where}.{k}")]
    if isinstance(obj, list | tuple):
        return [p for i, v in enumerate(obj) for p in _non_finite(v, f"{where}[{i}]")]
    return []


def _where(path: Iterable[Any]) -> str:
    out = "$"
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def report_problems(report: Mapping[str, Any]) -> list[str]:
    """Every way ``report`` breaks the schema or the report's own consistency rules (empty list: valid)."""
    problems = _non_finite(report)
    if problems:
        return problems
    validator = jsonschema.Draft202012Validator(load_schema())
    errors = sorted(validator.iter_errors(_one_file_each(report)), key=lambda e: (list(e.absolute_path), e.message))
    if errors:
        # A problem: the messages come from the whole report (every item of the file lists included).
        errors = sorted(validator.iter_errors(report), key=lambda e: (list(e.absolute_path), e.message))
    problems = [f"{_where(e.absolute_path)}: {e.message}" for e in errors]
    if problems:
        return problems

    # Rules a JSON Schema cannot express.
    problems += _consistency_problems(report)
    if report["verdict"] == "released":
        problems += _released_problems(report)
    return problems


def _consistency_problems(report: Mapping[str, Any]) -> list[str]:
    """The report's own rules for any verdict: the bound is 1/k, counts add up, reason codes known, paths once."""
    problems: list[str] = []
    k = report["k"]
    privacy = report["privacy"]
    if not math.isclose(privacy["bound"], 1.0 / k, rel_tol=1e-12, abs_tol=0.0):
        problems.append(f"$.privacy.bound = {privacy['bound']!r} must equal 1/k = {1.0 / k!r}")
    ds = report["dataset"]
    for key in ("records_released", "records_suppressed", "records_quarantined"):
        if ds[key] > ds["records_in"]:
            problems.append(f"$.dataset.{key} = {ds[key]} exceeds records_in = {ds['records_in']}")
    problems += _count_problems(report)
    by_reason = ds["quarantine_by_reason"]
    if sum(by_reason.values()) != ds["records_quarantined"]:
        problems.append(
            f"$.dataset.quarantine_by_reason sums to {sum(by_reason.values())}, "
            f"but records_quarantined = {ds['records_quarantined']}"
        )
    unknown = sorted(set(by_reason) - set(REASONS))
    if unknown:
        problems.append(f"$.dataset.quarantine_by_reason has unknown reason codes {unknown}; valid codes are deid.errors.REASONS")
    paths = [a["path"] for a in report["artifacts"]]
    if len(set(paths)) != len(paths):
        dupes = sorted({p for p in paths if paths.count(p) > 1})
        problems.append(f"$.artifacts lists paths more than once: {dupes}")
    report_paths = [a["path"] for a in report.get("report_files", [])]
    if len(set(report_paths)) != len(report_paths):
        dupes = sorted({p for p in report_paths if report_paths.count(p) > 1})
        problems.append(f"$.report_files lists paths more than once: {dupes}")
    problems += _manifest_problems(report, paths)
    signed = sorted({REPORT_NAME, SIGNATURE_NAME} & set(report_paths))
    if signed:
        problems.append(f"$.report_files must not list {signed}: report.json cannot contain its own hash")
    return problems


def _released_problems(report: Mapping[str, Any]) -> list[str]:
    """What a released verdict needs: every check passed, records out, k people a cluster, attacks within 1/k."""
    problems: list[str] = []
    k = report["k"]
    privacy = report["privacy"]
    ds = report["dataset"]
    failed = [c["name"] for c in report["checks"] if not c["passed"]]
    if failed:
        problems.append(f"verdict 'released' but checks failed: {failed}")
    if ds["records_released"] < 1:
        problems.append("verdict 'released' but $.dataset.records_released = 0")
    mdp = privacy["min_distinct_people_per_cluster"]
    if mdp is None or mdp < k:
        problems.append(
            f"verdict 'released' but $.privacy.min_distinct_people_per_cluster = {mdp!r}; "
            f"every cluster must hold at least k = {k} distinct people"
        )
    max_rate = privacy["max_rate"]
    bound = privacy["bound"]
    # A rate from too few distinct probes (the gate's min_probes) is evidence of nothing: it never decides.
    deciding = [r for r in privacy["reidentification"] if r.get("status") != INSUFFICIENT]
    thin_only = bool(privacy["reidentification"]) and not deciding
    # Every attack short of probes: only an exact structural bound (checked below) can decide alone.
    if max_rate is None and not (thin_only and privacy.get("exact_bound")):
        problems.append("verdict 'released' but $.privacy.max_rate is null: no attack was measured with enough "
                        "distinct probes")
    if privacy.get("exact_bound") and (max_rate is not None or thin_only):
        # Identical images per cluster: the exact bound decides; an attack fails only by its lower bound.
        share = privacy.get("max_person_share")
        if share is None or not within_bound(share, limit=bound):
            problems.append(f"verdict 'released' but $.privacy.max_person_share = {share!r} exceeds 1/k = "
                            f"{privacy['bound']!r}")
        bad = [r for r in deciding if not within_bound(r.get("lower", r["rate"]), limit=bound)]
        if bad:
            problems.append(f"verdict 'released' but {bad[0]['attacker']}/{bad[0]['mode']} has a lower bound "
                            f"{bad[0].get('lower', bad[0]['rate'])!r} above 1/k = {privacy['bound']!r}")
    elif max_rate is not None:
        bad = [r for r in deciding if not within_bound(r.get("upper", r["rate"]), limit=bound)]
        if bad:
            problems.append(
                f"verdict 'released' but {bad[0]['attacker']}/{bad[0]['mode']} re-identification "
                f"{bad[0]['rate']!r} (upper bound {bad[0].get('upper')!r}) is not shown to be at most 1/k = "
                f"{privacy['bound']!r}")
    for r in deciding:
        if max_rate is not None and r["rate"] > max_rate:
            problems.append(f"$.privacy.max_rate = {max_rate!r} is below the {r['attacker']}/{r['mode']} rate {r['rate']!r}")
    return problems


def _manifest_problems(report: Mapping[str, Any], paths: list[str]) -> list[str]:
    """The file manifest is a release file the report lists (same sha256), and no file is listed twice (in
    ``artifacts`` and, through a covered directory, in the manifest)."""
    fm = report.get("file_manifest")
    if fm is None:
        return []
    out = []
    listed = [a for a in report["artifacts"] if a["path"] == fm["path"]]
    if not listed:
        out.append(f"$.file_manifest.path = {fm['path']!r} is not listed in $.artifacts; the report must sign the "
                   "manifest's hash as a release file")
    elif listed[0]["sha256"] != fm["sha256"]:
        out.append(f"$.file_manifest.sha256 = {fm['sha256']} differs from $.artifacts' {listed[0]['sha256']} for "
                   f"{fm['path']}")
    covers = tuple(fm["covers"])
    twice = [p for p in paths if p.startswith(covers)]
    if twice:
        out.append(f"$.artifacts lists {len(twice)} file(s) under {list(covers)} (e.g. {twice[0]}), which the file "
                   "manifest lists")
    return out


def _count_problems(report: Mapping[str, Any]) -> list[str]:
    """The tiles (``dataset``) and the gate's accounting checks must tell the same story."""
    ds = report["dataset"]
    withheld = ds.get("records_withheld")
    if withheld is None:  # reports older than records_withheld
        return []
    out = []
    parts = ("records_released", "records_withheld", "records_suppressed", "records_quarantined")
    total = sum(ds[p] for p in parts)
    if total != ds["records_in"]:
        out.append(f"$.dataset: released + withheld + suppressed + quarantined = {total}, but records_in = "
                   f"{ds['records_in']}")
    if report["verdict"] == "released" and withheld:
        out.append(f"verdict 'released' but $.dataset.records_withheld = {withheld}")
    if report["verdict"] == "rejected" and ds["records_released"]:
        out.append(f"verdict 'rejected' but $.dataset.records_released = {ds['records_released']}")
    checks = {c["name"]: c for c in report["checks"]}
    judged = (checks.get("release_not_empty") or {}).get("value")
    if isinstance(judged, int) and not (judged == ds["records_released"] if report["verdict"] == "released"
                                        else judged <= withheld):
        out.append(f"check release_not_empty judged {judged} records but $.dataset says {ds['records_released']} "
                   f"released and {withheld} withheld")
    return out


_FILE_LISTS = ("artifacts", "report_files")


@functools.lru_cache(maxsize=1)
def _file_item_rules() -> tuple[Any, ...] | None:
    """(path pattern, path min length, sha256 pattern, bytes minimum) of the schema's file-list items.

    Read from the schema itself; None when an item is not exactly the ``{path, sha256, bytes}`` object
    this fast check knows (the lists are then validated by jsonschema item by item).
    """
    schema = load_schema()
    defs = schema.get("$defs", {})
    rules = set()
    for key in _FILE_LISTS:
        item = schema["properties"][key].get("items", {})
        props = item.get("properties", {})
        path, sha, size = props.get("path", {}), props.get("sha256", {}), props.get("bytes", {})
        if (set(item) - {"description"} != {"type", "additionalProperties", "required", "properties"}
                or item["type"] != "object" or item["additionalProperties"] is not False
                or sorted(item["required"]) != ["bytes", "path", "sha256"] or set(props) != {"path", "sha256", "bytes"}
                or set(path) - {"description"} != {"type", "minLength", "pattern"} or path["type"] != "string"
                or sha != {"$ref": "#/$defs/sha256_hex"} or size != {"$ref": "#/$defs/count"}
                or defs.get("sha256_hex", {}).keys() != {"type", "pattern"} or defs["sha256_hex"]["type"] != "string"
                or defs.get("count", {}).keys() != {"type", "minimum"} or defs["count"]["type"] != "integer"
                or schema["properties"][key].keys() - {"description"} != {"type", "items"}):
            return None
        rules.add((path["pattern"], int(path["minLength"]), defs["sha256_hex"]["pattern"], defs["count"]["minimum"]))
    if len(rules) != 1:
        return None
    path_re, min_len, sha_re, minimum = rules.pop()
    return re.compile(path_re), min_len, re.compile(sha_re), minimum


def _files_valid(items: Any) -> bool:
    """True only if every item of a file list is valid under the schema's item rules (:func:`_file_item_rules`).

    The same rules as jsonschema (``pattern`` is ``re.search``; integers, not booleans), a few
    microseconds per item instead of jsonschema's walk: a report lists every released file.
    """
    rules = _file_item_rules()
    if rules is None or not isinstance(items, list):
        return False
    path_re, min_len, sha_re, minimum = rules
    keys = {"path", "sha256", "bytes"}
    for a in items:
        if type(a) is not dict or a.keys() != keys:
            return False
        p, h, n = a["path"], a["sha256"], a["bytes"]
        if (type(p) is not str or len(p) < min_len or path_re.search(p) is None or type(h) is not str
                or sha_re.search(h) is None or type(n) is not int or n < minimum):
            return False
    return True


def _one_file_each(report: Mapping[str, Any]) -> Mapping[str, Any]:
    """``report`` with each long file list that :func:`_files_valid` accepts cut to its first item.

    The schema constrains these lists by their items and by being empty or not (``minItems: 1``,
    ``maxItems: 0``), both unchanged by the cut; jsonschema then validates the rest of the report.
    """
    cut = {key: report[key][:1] for key in _FILE_LISTS
           if isinstance(report.get(key), list) and len(report[key]) > 1 and _files_valid(report[key])}
    return {**report, **cut} if cut else report


def validate_report(report: Mapping[str, Any]) -> None:
    """Raise :class:`~deid.errors.StateError` listing every schema or consistency problem of ``report`` (built by the run: a bug)."""
    problems = report_problems(report)
    if problems:
        raise StateError(
            f"report does not match schemas/{SCHEMA_NAME} ({len(problems)} problem(s)): "
            + "; ".join(problems[:20])
            + ("" if len(problems) <= 20 else f"; … and {len(problems) - 20} more")
        )


def _atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_signed_report(report_dir: Path, report: Mapping[str, Any] | Report, signing_key: SigningKey) -> Path:
    """Validate ``report``, write it as canonical JSON to ``report_dir/report.json`` and its signature to ``.sig``.

    Returns the path of ``report.json``. The ``.sig`` file is the base64 of the raw 64-byte
    Ed25519 signature over exactly the bytes of ``report.json``, plus a newline.
    """
    d = report.to_dict() if isinstance(report, Report) else jsonable(report)
    validate_report(d)
    signing = d["signing"]
    if signing["public_key_fingerprint"] != signing_key.fingerprint or signing["key_origin"] != signing_key.origin:
        raise ConfigError(
            f"report signing = {signing!r} does not describe the key used ({signing_key.fingerprint}, "
            f"{signing_key.origin}); build it with SigningInfo.from_key(signing_key)"
        )
    payload = canonical_json(d)
    signature = sign_bytes(payload, signing_key.private_key)
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    report_path = report_dir / REPORT_NAME
    if report_path.exists() and report_path.read_bytes() != payload:
        logger.warning("replacing existing report %s with a different one", report_path)
    # Report first, then signature: a crash in between leaves a pair that fails verification, never a false pass.
    _atomic_write(report_path, payload)
    _atomic_write(report_dir / SIGNATURE_NAME, base64.b64encode(signature) + b"\n")
    logger.info("wrote signed report %s (verdict %s, key %s)", report_path, d["verdict"], signing_key.fingerprint)
    return report_path
