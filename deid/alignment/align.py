"""Face alignment of staged records: decode each image once, at the coarsest sufficient resolution, and align it.

k-Same (Newton, Sweeney & Malin, 2005) averages faces in pixel space, so every face is registered
first: eyes from :mod:`deid.alignment.eyes`, the similarity warp to the canonical frame from
:mod:`deid.alignment.canonical`. Bad records are quarantined, never raised.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import cv2
import numpy as np

from deid.errors import Quarantined, RecordError
from deid.intake.imaging import decode_color_reduced, decode_gray_reduced, sniff_format, upright_size
from deid.alignment.canonical import FaceAligner, _scale_eyes
from deid.alignment.eyes import EyePair, HaarEyeDetector, _check_gray
from deid.alignment.pose import estimate_yaw

__all__ = ["align_records", "tracked_eyes_finder"]


def tracked_eyes_finder(detector: HaarEyeDetector | None = None):
    """The landmark pass alignment runs on a staged video frame, for ingest to run on detected frames only.

    Returns ``find(staged bytes, face box) -> (left x, y, right x, y) | None``: the grey decode and the
    one 5-point landmark pass in the tracked box (:meth:`HaarEyeDetector.eyes_in_box`) that
    :func:`align_records` runs on a frame staged without eyes, so a detected frame's eyes are the same
    either way; ingest moves them with the face to the frames it follows
    (:class:`deid.intake.video.StagedEyes`), which then need no landmark pass (~0.8 ms a frame).
    """
    det = detector if detector is not None else HaarEyeDetector()

    def find(data: bytes, face_box) -> tuple[float, float, float, float] | None:
        eyes = det.eyes_in_box(decode_gray_reduced(data, 1), tuple(float(v) for v in face_box))
        return None if eyes is None else (*eyes.left, *eyes.right)

    return find


_threads_capped = False


def _cap_opencv_threads(n: int | None) -> None:
    # Dask runs one task per worker thread on each core; OpenCV's own thread pool on top of that only
    # oversubscribes the cores (and detectMultiScale parallelises badly over small images).
    global _threads_capped
    if n is None or _threads_capped:
        return
    cv2.setNumThreads(int(n))
    _threads_capped = True


def _decode_for_alignment(
    data: bytes, eyes: Any, aligner: FaceAligner, max_pixels: int, face_box: Any = None, frame_eyes: Any = None,
) -> tuple[np.ndarray, EyePair | None, str, int, tuple[int, int] | None]:
    """Decode once at the coarsest resolution that suffices; returns (gray, full-res eyes, source, factor, size).

    JPEG is decoded reduced by libjpeg's DCT scaling (IMREAD_REDUCED_GRAYSCALE_*, which also applies
    the EXIF orientation); other formats are decoded in full, the warp and the detector area-shrink
    only the part they need. A video frame comes with its tracked ``face_box`` (a dlib HOG box, x, y,
    w, h in its pixels): the eyes are the 5-point landmarks in it, one predictor pass and no face
    search (source ``landmarks_tracked``); where they are implausible the face is searched as in a still.
    A frame staged with its eyes (``frame_eyes``, :class:`deid.intake.video.StagedEyes`: that same
    landmark pass run by ingest on a detected frame, or its eyes moved with the face on a followed one,
    source ``landmarks_followed``) is aligned on them, no landmark pass.
    """
    jpeg = sniff_format(data) == "jpeg"
    size = upright_size(data) if jpeg else None
    if eyes is not None:
        ok = isinstance(eyes, EyePair) and eyes.is_finite()
        f = aligner.reduction_for(eyes.distance) if (ok and size is not None) else 1
        return decode_gray_reduced(data, f, max_pixels=max_pixels), eyes, "manifest", f, size
    if frame_eyes is not None:
        gray = decode_gray_reduced(data, 1, max_pixels=max_pixels)
        lx, ly, rx, ry, followed = (float(v) for v in frame_eyes)
        h, w = gray.shape
        if all(0 <= x <= w - 1 and 0 <= y <= h - 1 for x, y in ((lx, ly), (rx, ry))) and rx > lx:
            return gray, EyePair((lx, ly), (rx, ry)), "landmarks_followed" if followed else "landmarks_tracked", 1, size
    detector = aligner.detector if aligner.detector is not None else HaarEyeDetector()
    if face_box is not None and hasattr(detector, "eyes_in_box"):
        gray = decode_gray_reduced(data, 1, max_pixels=max_pixels)
        found = detector.eyes_in_box(gray, tuple(float(v) for v in face_box))
        if found is not None:
            return gray, found, "landmarks_tracked", 1, size
    f = detector.reduction(*size) if (size is not None and hasattr(detector, "reduction")) else 1
    gray = decode_gray_reduced(data, f, max_pixels=max_pixels)
    found, source = aligner._find_eyes(gray)
    found = _scale_eyes(found, f)
    need = aligner.reduction_for(found.distance)
    if need < f:  # a small face: too few pixels at this reduction for the warp, decode finer
        f = need
        gray = decode_gray_reduced(data, f, max_pixels=max_pixels)
    return gray, found, source, f, size


def align_records(
    records: Iterable[dict], aligner: FaceAligner, *, max_pixels: int = 100_000_000, opencv_threads: int | None = 1,
    color: bool = False, max_yaw: float | None = None,
) -> tuple[list[dict], list[Quarantined]]:
    """Decode and align a batch of records; bad ones are quarantined (stage 'align'), never raised.

    Each image is decoded once, at a reduced JPEG resolution when that loses nothing for the canonical
    face (see :meth:`FaceAligner.reduction_for`, :meth:`HaarEyeDetector.reduction`). ``opencv_threads``
    caps OpenCV's thread pool for the whole process (None leaves it alone): parallelism comes from Dask.
    With ``color`` each record also gets ``color``: the (height, width, 3) BGR canonical face, decoded
    again in colour at the same reduction and warped by the same transform as the grey one (eyes are
    found, and everything but the released pixels is computed, on grey). A record with ``points``
    (landmarks in source pixels, flattened or (n, 2)) gets them in canonical pixels
    (:meth:`FaceAligner.points_to_canonical`, flattened); None stays None. With ``max_yaw`` (degrees)
    each record whose eyes were detected (not given in the manifest) gets ``yaw``, its head yaw (:func:`deid.alignment.pose.estimate_yaw`, on the decoded
    grey image; None when not estimable), and a face turned further than ``max_yaw`` either way is
    quarantined with reason ``pose``: averaged with frontal faces it leaves double outlines.
    """
    _cap_opencv_threads(opencv_threads)
    aligner._validate()  # a bad configuration is the caller's error, raised once, not a quarantine
    done: list[dict] = []
    bad: list[Quarantined] = []
    for rec in records:
        rid, image = str(rec.get("record_id", "")), str(rec.get("image", ""))
        try:
            gray, eyes, source, f, size = _decode_for_alignment(rec["data"], rec.get("eyes"), aligner, max_pixels,
                                                                rec.get("face_box"), rec.get("frame_eyes"))
            face = aligner._align_full(_check_gray(gray), eyes, source, f, size)
            extra: dict[str, Any] = {}
            # Detected eyes only: detection costs ~50 ms a photo, the estimate 0.6 ms; eyes given in the
            # manifest (curated, usually frontal drops; every synthetic face) cost ~0.3 ms to align, and an
            # estimate per face would triple that (+5 min of a million-face run).
            if max_yaw is not None and source != "manifest":
                yaw = estimate_yaw(gray, EyePair(*(((x + 0.5) / f - 0.5, (y + 0.5) / f - 0.5)
                                                   for x, y in (face.eyes.left, face.eyes.right))))
                extra["yaw"] = yaw if math.isfinite(yaw) else None
                if math.isfinite(yaw) and abs(yaw) > max_yaw:
                    raise RecordError("pose", f"estimated head yaw {yaw:+.0f} degrees is beyond max_yaw_degrees="
                                              f"{max_yaw:g} (DEID_MAX_YAW_DEGREES, 5-90; 90 = no pose limit): "
                                              "averaged with frontal faces it would ghost")
            if color:
                bgr = decode_color_reduced(rec["data"], f, max_pixels=max_pixels)
                if bgr.shape[:2] != gray.shape:
                    raise RecordError("corrupt_image", f"the colour decode is {bgr.shape[1]}x{bgr.shape[0]} but "
                                                       f"the grey one {gray.shape[1]}x{gray.shape[0]}")
                extra["color"] = aligner._warp_to_canonical(bgr, face.eyes, f).tobytes()
            if "points" in rec:
                pts = rec["points"]
                extra["points"] = None if pts is None else aligner.points_to_canonical(pts, face.eyes).ravel().tolist()
        except RecordError as exc:
            bad.append(Quarantined(rid, image, exc.code, exc.message, stage="align"))
            continue
        except cv2.error as exc:
            bad.append(Quarantined(rid, image, "corrupt_image", f"OpenCV failed: {str(exc).strip()[:200]}", stage="align"))
            continue
        done.append(
            {
                "record_id": rid,
                "pixels": face.image.tobytes(),
                "eye_source": face.source,
                "eye_left_x": float(face.eyes.left[0]),
                "eye_left_y": float(face.eyes.left[1]),
                "eye_right_x": float(face.eyes.right[0]),
                "eye_right_y": float(face.eyes.right[1]),
                **extra,
            }
        )
    return done, bad
