"""Worker functions of the align stage: one Parquet row group of staged images aligned to canonical faces,
and the pose spread of the aligned set.

Each worker function is idempotent (it writes to a temporary file and renames it into place), so a task
re-run after a lost worker produces the same output; it takes paths and small parameters, never large
arrays, so nothing big travels through the scheduler.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deid.alignment.eyes import EyePair, HaarEyeDetector
from deid.alignment.canonical import FaceAligner
from deid.alignment.align import align_records
from deid.contracts import StagingLayout
from deid.errors import Quarantined
from deid.schemas import arrow as schemas

from deid.operations.worker_rows import write_atomic


@dataclass(frozen=True)
class AlignedBatch:
    """What one align task returns: its aligned part, how many faces it holds, what it quarantined."""

    path: str
    aligned: int
    quarantined: tuple[Quarantined, ...]
    eye_sources: Mapping[str, int]  # eye source (detector, manifest, ...) -> aligned faces
    yaw_histogram: tuple[int, ...] = ()  # aligned faces per whole degree of |yaw| (0..90); () = not estimated


def make_aligner(params: dict) -> FaceAligner:
    """Build the aligner from plain parameters (so it can be sent to a worker)."""
    return FaceAligner(
        size=tuple(params["size"]),
        eye_left=tuple(params["eye_left"]),
        eye_right=tuple(params["eye_right"]),
        max_upsample=params["max_upsample"],
        min_eye_distance=params["min_eye_distance"],
        detector=HaarEyeDetector(),
    )


def align_batch(ingested_path: str, row_groups: list[int], out_path: str, aligner_params: dict,
                exclude: list[str] = ()) -> AlignedBatch:
    """Align the faces of some row groups of the ingested table; return counts and quarantine records."""
    pf = pq.ParquetFile(ingested_path)
    points = "points" in pf.schema_arrow.names  # landmarks go to canonical pixels with their face
    boxes = "face_box" in pf.schema_arrow.names  # video frames: the tracked face box, eyes found in it
    staged_eyes = "frame_eyes" in pf.schema_arrow.names  # ... or found (followed) by ingest
    table = pf.read_row_groups(
        row_groups, columns=["record_id", "image", "data", "eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y",
                             *(["points"] if points else []), *(["face_box"] if boxes else []),
                             *(["frame_eyes"] if staged_eyes else [])]
    )
    skip = set(exclude)
    aligner = make_aligner(aligner_params)
    cols = table.to_pydict()
    records = []
    for i, rid in enumerate(cols["record_id"]):
        if rid in skip:
            continue
        lx, ly, rx, ry = (cols[c][i] for c in ("eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y"))
        eyes = EyePair((lx, ly), (rx, ry)) if lx is not None else None
        records.append({"record_id": rid, "image": cols["image"][i], "data": cols["data"][i], "eyes": eyes,
                        **({"points": cols["points"][i]} if points else {}),
                        **({"face_box": cols["face_box"][i]} if boxes else {}),
                        **({"frame_eyes": cols["frame_eyes"][i]} if staged_eyes else {})})
    del cols, table
    color = bool(aligner_params.get("color"))
    max_yaw = aligner_params.get("max_yaw")
    ok, bad = align_records(records, aligner, color=color, max_yaw=max_yaw)
    if color:
        # Colour faces beside the grey ones (<staging>/aligned_color/<same part name>): only the
        # de-identification reads them; everything measured (eyes, features, identity, attacks) is grey.
        write_atomic(pa.table({"record_id": [r["record_id"] for r in ok], "color": [r["color"] for r in ok]},
                               schema=schemas.aligned_color()), color_part(out_path))
    out = pa.table(
        {
            "record_id": [r["record_id"] for r in ok],
            "pixels": [r["pixels"] for r in ok],
            "eye_source": [r["eye_source"] for r in ok],
            "eye_left_x": [float(r["eye_left_x"]) for r in ok],
            "eye_left_y": [float(r["eye_left_y"]) for r in ok],
            "eye_right_x": [float(r["eye_right_x"]) for r in ok],
            "eye_right_y": [float(r["eye_right_y"]) for r in ok],
            **({"points": [r["points"] for r in ok]} if points else {}),
            **({"yaw": [r.get("yaw") for r in ok]} if max_yaw is not None else {}),
        },
        schema=schemas.aligned(points=points, yaw=max_yaw is not None),
    )
    write_atomic(out, Path(out_path))
    return AlignedBatch(path=out_path, aligned=len(ok), quarantined=tuple(bad),
                        eye_sources={s: sum(r["eye_source"] == s for r in ok) for s in {r["eye_source"] for r in ok}},
                        yaw_histogram=yaw_histogram([r.get("yaw") for r in ok]) if max_yaw is not None else ())


def yaw_histogram(yaws: Iterable[float | None]) -> tuple[int, ...]:
    """Faces per whole degree of |yaw| (bins 0..90; None, not estimable, left out): summed over align tasks."""
    a = np.abs(np.array([y for y in yaws if y is not None], dtype=np.float64))
    return tuple(int(c) for c in np.bincount(np.minimum(a, 90).astype(np.int64), minlength=91))


def pose_spread(histogram: Sequence[int], *, max_yaw: float | None, quarantined: int) -> dict:
    """The report's pose figures: |yaw| quantiles (whole degrees, upper bin edge) of the aligned faces."""
    if max_yaw is None:
        return {"estimated": False, "max_yaw_degrees": None}
    h = np.asarray(histogram, dtype=np.int64)
    n = int(h.sum())
    out = {"estimated": True, "max_yaw_degrees": max_yaw, "faces": n, "quarantined_pose": int(quarantined)}
    if n:
        cum = np.cumsum(h)
        for q in (50, 90, 99):
            out[f"abs_yaw_p{q}"] = int(np.searchsorted(cum, q / 100 * n)) + 1
        out["abs_yaw_max"] = int(np.nonzero(h)[0][-1]) + 1
    return out


def color_part(aligned_part: str | Path) -> Path:
    """Where :func:`align_batch` writes the colour faces of one aligned part (``<staging>/aligned/<part>``)."""
    p = Path(aligned_part)
    return StagingLayout(p.parent.parent).color_part(p)
