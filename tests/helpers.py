"""Helpers shared by several test modules (tests/ is on sys.path: ``from helpers import ...``)."""
from __future__ import annotations

import csv
import fnmatch
import functools
import json
import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]  # the repository
# The London face set, read in place: its one definition for the tests and the benchmarks (conftest's london_dir
# fixture fails the tests that need it, naming this path, when it is missing). ``../shared/datasets/london`` beside
# the clone, as CI has it; DEID_LONDON_DIR points a clone elsewhere to it (the images are never copied in).
LONDON = Path(os.environ.get("DEID_LONDON_DIR") or ROOT.parent / "shared" / "datasets" / "london")


def assert_nothing_published(releases: Path) -> None:
    """Assert that a rejected or failed run published nothing: ``releases`` (data/releases) is absent or empty."""
    left = sorted(p.name for p in releases.iterdir()) if releases.exists() else []
    assert not left, f"nothing may be published, but {releases} holds {left}"


def load_london_aligned(*, smiling: str = "smiling") -> tuple[np.ndarray, list[str], list[str], list[str]]:
    """Aligned London faces read in place: (pixels, people, gender, expression), one row per face.

    Pupils come from the .tem files (neutral photos), Haar eye detection otherwise (smiling);
    faces whose eyes cannot be found are skipped. ``smiling`` is the expression label of the
    smiling photos ("neutral" for the others). Fails the test when the dataset is missing.
    Aligned once per test process (~3 s of CPU); every call gets its own copies.
    """
    if not (LONDON / "london_info.csv").is_file():
        pytest.fail(f"the London set is missing at {LONDON}; see ../shared/datasets/london/README.md")
    faces, people, gender, expr = _london_aligned()
    return faces.copy(), list(people), list(gender), [smiling if e == "smile" else e for e in expr]


def london_descriptors() -> np.ndarray:
    """dlib descriptors of :func:`load_london_aligned`'s faces, row for row (~20 s of CPU, once per process).

    The London tests that need them share one worker (``xdist_group("london-dlib")``), so the
    suite embeds London once.
    """
    return _london_descriptors().copy()


@functools.cache
def _london_descriptors() -> np.ndarray:
    from deid.evaluation.recognizer import DlibEmbedder

    return DlibEmbedder().transform(_london_aligned()[0])


@functools.cache
def _london_aligned() -> tuple[np.ndarray, tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    from deid.alignment.london import align_london

    faces, people, gender, expr = align_london(LONDON)
    return faces, tuple(people), tuple(gender), tuple(expr)


def add_points(drop: Path) -> int:
    """Give every image of a synthetic drop a JSON landmark file: its two eyes and a point below them."""
    with open(drop / "manifest.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    (drop / "points").mkdir()
    for i, r in enumerate(rows):
        lx, ly, rx, ry = (float(r[c]) for c in ("eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y"))
        name = f"points/{i:04d}.json"
        (drop / name).write_text(json.dumps([[lx, ly], [rx, ry], [(lx + rx) / 2, (ly + ry) / 2 + 0.9 * (rx - lx)]]))
        r["points"] = name
    with open(drop / "manifest.csv", "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return len(rows)


def identifying_text_in_reports(reports_dir: Path, needles, *, must_read=()) -> list[str]:
    """``"<file>: <needle>"`` for every needle found in a report, report page, validation page or catalogue.

    Reads every report.json, report.html, validation file and the catalogue (index.html,
    catalogue JSON) under ``reports_dir``; a drop's subject ids and rare label values must be in none.
    ``must_read``: fnmatch patterns of whole paths relative to ``reports_dir`` (``index.html`` is the catalogue
    only), each of which a file read must match, so
    that the search cannot pass because a kind of file was never written.
    """
    hits, read = [], []
    for path in sorted(Path(reports_dir).rglob("*")):
        if not path.is_file() or path.suffix not in (".json", ".html", ".sig", ".csv", ".md", ".txt"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        read.append(path.relative_to(reports_dir))
        hits += [f"{read[-1].as_posix()}: {n}" for n in needles if n in text]
    missing = [p for p in must_read if not any(fnmatch.fnmatchcase(r.as_posix(), p) for r in read)]
    assert not missing, f"no file under {reports_dir} matches {missing}; read {[r.as_posix() for r in read]}"
    return hits


def run_no_deid_check(root: Path, public_key: Path) -> list:
    """The documented no-deid check of a release directory (deid.release.attestation.NO_DEID_CHECK), exactly, then
    the Python signature check; each a CompletedProcess. Run by a shell in ``root`` with the key saved there as
    STEWARD.pub.pem (removed after). Where openssl is missing its step is the Python one: never skipped."""
    import shutil  # noqa: PLC0415
    import subprocess  # noqa: PLC0415

    from deid.release.attestation import NO_DEID_CHECK, PYTHON_SIGNATURE_CHECK  # noqa: PLC0415

    steps = list(NO_DEID_CHECK)
    if shutil.which("openssl") is None:
        steps[0] = PYTHON_SIGNATURE_CHECK
    shutil.copy(public_key, Path(root) / "STEWARD.pub.pem")
    try:
        return [subprocess.run(cmd, shell=True, cwd=root, capture_output=True, text=True, timeout=120)
                for cmd in [*steps, PYTHON_SIGNATURE_CHECK]]
    finally:
        (Path(root) / "STEWARD.pub.pem").unlink()
