"""Alignment quality: eye detection measured against the manual eye points of a drop's manifest.

The error of one image is the larger of the two eye-centre errors divided by the true inter-ocular
distance (the usual normalised eye localisation error, Jesorsky, Kirchberg & Frischholz, 2001); an
error under 0.10 puts both detected eyes well inside the true eye region.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deid.alignment.eyes import EyePair, HaarEyeDetector
from deid.alignment.canonical import FaceAligner
from deid.intake.drop import read_drop
from deid.errors import RecordError
from deid.intake.imaging import decode_gray

log = logging.getLogger(__name__)


@dataclass
class EyeEvalRow:
    """One image: whether eyes were located (and aligned), the error and the time taken."""

    image: str
    subject_id: str
    has_truth: bool
    found: bool
    aligned: bool
    source: str | None
    code: str | None
    error: float | None  # max(left, right) eye error / true inter-ocular distance
    seconds: float  # decode + detect


@dataclass
class AlignmentEvaluation:
    """Per-image rows and the summary figures of :func:`evaluate_alignment`."""

    rows: list[EyeEvalRow] = field(default_factory=list)
    threshold: float = 0.10

    def _of(self, truth: bool) -> list[EyeEvalRow]:
        return [r for r in self.rows if r.has_truth == truth]

    def summary(self) -> dict:
        """JSON-able summary: counts, detection rate, error statistics and time per image."""
        out: dict = {"threshold": self.threshold}
        for key, rows in (("with_eye_points", self._of(True)), ("without_eye_points", self._of(False))):
            if not rows:
                continue
            errors = [r.error for r in rows if r.error is not None]
            part = {
                "images": len(rows),
                "found": sum(r.found for r in rows),
                "aligned": sum(r.aligned for r in rows),
                "detection_rate": sum(r.found for r in rows) / len(rows),
                "sources": {s: sum(r.source == s for r in rows) for s in sorted({r.source for r in rows if r.source})},
                "source_shares": {s: sum(r.source == s for r in rows) / len(rows)
                                  for s in sorted({r.source for r in rows if r.source})},
                "error_by_source": _error_by_source(rows, self.threshold),
                "failures": {c: sum(r.code == c for r in rows) for c in sorted({r.code for r in rows if r.code})},
                "seconds_per_image": statistics.fmean(r.seconds for r in rows),
            }
            if errors:
                part.update(
                    mean_error=statistics.fmean(errors),
                    median_error=statistics.median(errors),
                    max_error=max(errors),
                    under_threshold=sum(e < self.threshold for e in errors),
                )
            out[key] = part
        return out

    def to_dict(self) -> dict:
        return {"summary": self.summary(), "rows": [asdict(r) for r in self.rows]}


def _error_by_source(rows: list[EyeEvalRow], threshold: float) -> dict:
    """Mean / max error and count under the threshold for each eye source with measured errors."""
    out = {}
    for src in sorted({r.source for r in rows if r.source and r.error is not None}):
        errs = [r.error for r in rows if r.source == src and r.error is not None]
        out[src] = {"n": len(errs), "mean_error": statistics.fmean(errs), "max_error": max(errs),
                    "under_threshold": sum(e < threshold for e in errs)}
    return out


def eye_error(found: EyePair, truth: EyePair) -> float:
    """max(left, right) eye-centre distance over the true inter-ocular distance (both pairs ordered)."""
    f, t = found.ordered(), truth.ordered()
    worst = max(math.hypot(f.left[0] - t.left[0], f.left[1] - t.left[1]),
                math.hypot(f.right[0] - t.right[0], f.right[1] - t.right[1]))
    return worst / t.distance


def evaluate_alignment(drop_dir: str | Path, *, detector: HaarEyeDetector | None = None,
                       aligner: FaceAligner | None = None, include_unlabelled: bool = False,
                       labels: list[str] | None = None, threshold: float = 0.10,
                       max_pixels: int = 100_000_000) -> AlignmentEvaluation:
    """Detect eyes on every drop image with manual eye points (ignoring them) and measure the error.

    Parameters
    ----------
    drop_dir : path
        A drop; its manifest rows with all four eye columns are the ground truth.
    detector : HaarEyeDetector, optional
        The detector under test (default ``HaarEyeDetector()``).
    aligner : FaceAligner, optional
        Used to check that the detected eyes are also accepted for alignment (size limits).
    include_unlabelled : bool
        Also run detection on rows without eye points (counts detection only, no error).
    labels : list of str, optional
        Label columns, when the drop's ``drop.yaml`` declares none (only needed to read the manifest).
    threshold : float
        Error reported as ``under_threshold`` in the summary.
    """
    drop = read_drop(drop_dir, labels=labels)
    detector = detector or HaarEyeDetector()
    aligner = aligner or FaceAligner(detector=detector)
    ev = AlignmentEvaluation(threshold=threshold)
    for row in drop.rows:
        has_truth = row.eyes is not None
        if not has_truth and not include_unlabelled:
            continue
        t0 = time.perf_counter()
        found = source = code = None
        try:
            gray = decode_gray(row.path.read_bytes(), max_pixels=max_pixels)
            hit = detector.locate(gray)
            found, source = hit.eyes, hit.source
        except RecordError as exc:
            code = exc.code
        seconds = time.perf_counter() - t0
        aligned = False
        if found is not None:
            try:
                aligner.align(gray, found)
                aligned = True
            except RecordError as exc:
                code = exc.code
        error = eye_error(found, EyePair(*row.eyes)) if (found is not None and has_truth) else None
        ev.rows.append(EyeEvalRow(row.image, row.subject_id, has_truth, found is not None, aligned, source, code,
                                  error, seconds))
        log.debug("%s: error %s, %.3f s", row.image, error, seconds)
    return ev

