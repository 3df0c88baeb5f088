"""Video files as a drop: decode a recording at a declared rate, track its subject's face, emit frame records.

A manifest row whose ``image`` names a video file (:data:`VIDEO_SUFFIXES`) is one recording of
its ``subject_id``. Ingest (:func:`deid.intake.ingest.ingest`) turns it into frame records --
sequence = the recording, frame = the index in the resampled stream -- which the image-sequence
path then handles exactly as a drop of pre-extracted frames (``sequence``/``frame`` columns).

Decoding streams: :func:`iter_frames` holds one decoded frame at a time (OpenCV's FFmpeg
backend reads the file through a descriptor opened by :func:`deid.intake.drop_files.open_drop_file`,
so the symlink and regular-file rules of every drop file hold). The rate is ``fps:`` in
``drop.yaml`` or the source's own; a lower rate keeps the frame nearest each sample time.

Tracking (:class:`FaceTracker`): dlib's HOG frontal face detector (Dalal & Triggs features;
on 80 frames of synthetic recordings it found a face in 74, 4 of the misses being frames the
face had left, where OpenCV's Haar cascade found 44) per frame, on a frame reduced to at most :data:`WORK_WIDTH` pixels wide, detections
down to the score :data:`HOG_THRESHOLD`. A frame with no face is quarantined
(``video_no_face``). With the track known (the previous kept frame's box), the face overlapping
it most (intersection over union >= :data:`MIN_IOU`) is kept and every other face is masked out
of the crop; with two or more faces and none overlapping the track (or no track yet), which face
is the subject cannot be told and the frame is quarantined (``video_ambiguous_faces``): a second,
unidentified face is never released. A lone face that does not continue the track is
quarantined too (``video_track_lost``: it may be someone else) unless the subject was not seen for
:data:`REACQUIRE_SECONDS` and no other face was seen there in the last :data:`REMEMBER_SECONDS`
(where other faces stay masked in the crops); then it re-acquires the track (the row says the recording shows its
subject; another person alone in frame after such a gap is not told apart: descriptor-based
association is not done here). Quarantined
frames are reported per segment: each frame's message names its run of consecutive frames with
the same reason (``frames 30-44, 2.00-2.93 s``).

Following between detections. The full detection (the rules above) costs ~19 ms a frame, 25x
the decoding of a 480p frame, so it runs on the first frame, then at least every
:data:`DETECT_EVERY` frames and every :data:`DETECT_SECONDS` (N = 15 frames, 1 s at 15 fps),
and on every frame that cannot be followed with certainty. In between, a frame is *followed*
(no detector run): on a grey copy reduced by a whole factor (the face box ~:data:`FOLLOW_SIDE`
px wide, "cells"), the face box as detected is found again by normalised cross-correlation
within :data:`FOLLOW_SEARCH` box sides of where it was, and the frame is kept, with the box
moved by that whole-cell shift, only if

1. the correlation with the face as detected is >= :data:`FOLLOW_MIN_NCC`, and
2. every cell of the crop outside the face box (all that :func:`crop_face` releases besides the
   box, with two cells to spare) lies, as a 3x3 local mean, within :data:`CHANGE_MAX` grey
   levels of the range of the same cell's 3x3 neighbourhood at the detection, moved with the face.

Otherwise the full detection runs on that frame. The other faces masked at the detection are
masked again, moved with the face (the check says everything around it moved with it, a pan).
So what a second face can do between detections: anywhere outside the crop, anything (nothing
of it is released; the next full detection, at most N - 1 frames later, sees it); into the
crop, nothing unnoticed: entering changes the cells it covers, which runs the full detection on
that very frame, and the frame is masked or quarantined by the rules above
(``tests/integration/intake/test_video_tracking.py`` shows the check is what catches it). What following does not
see is what the detector would not see either: a face inside the subject's own box (occluding
it; the correlation drops when much of the box changes) or one whose every cell stays within
:data:`CHANGE_MAX` of the background's range. A frame with no texture in the box (sd below
:data:`MIN_TEXTURE`) is never followed.

The kept face is cropped with a margin (:data:`CROP_MARGIN` of the box on each side) and staged
losslessly (uncompressed BMP: :func:`encode_staged`), reduced by a whole factor when the face box is
above :data:`STAGED_FACE_MAX` px (:func:`staged_crop`), with the face box in the crop's
pixels: alignment finds the eyes by one 5-point landmark pass in that box (eye source
``landmarks_tracked``), no face search; where those are implausible it searches as in a still.
With the landmark pass supplied (:class:`StagedEyes`, as the release's ingest does), ingest runs
it on the detected frames only and stages each frame's eyes: on a followed frame whose eye band
(:data:`EYE_BAND` of the box) correlates >= :data:`EYES_MIN_NCC` with the detection's, found again
to a fraction of a pixel on a grey copy :data:`EYES_FINE` times finer than the follow's, the
detection frame's eyes moved by as much (eye source ``landmarks_followed``; a turn, a blink or a
smile reaching the eyes lowers the correlation, and alignment runs the landmark pass on that frame).
On synthetic recordings these moves are within 2% of the eye distance of the generator's, where a
fresh landmark pass on the frame errs by 1-5% on average and up to 20%
(``tests/integration/intake/test_video_eyes.py``).

References
----------
N. Dalal, B. Triggs. Histograms of oriented gradients for human detection. CVPR 2005 (dlib's
frontal face detector).
R. Gross, L. Sweeney, J. Cohn, F. de la Torre, S. Baker. Face de-identification. In Protecting
Privacy in Video Surveillance, Springer 2009, ch. 8 (de-identifying video).
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from deid.errors import ConfigError, RecordError

log = logging.getLogger(__name__)

# Containers the installed opencv-python-headless 4.14 (bundled FFmpeg) decodes; measured on this
# machine: AVI (MJPEG, FFV1), MP4 and MOV (MPEG-4 part 2 'mp4v'), WebM (VP8, VP9), Matroska.
# H.264 cannot be written here (no encoder in the wheel), so its decoding is not tested.
VIDEO_SUFFIXES = (".avi", ".mp4", ".m4v", ".mov", ".webm", ".mkv")
WORK_WIDTH = 640  # detection runs on frames reduced to this width (480p and 1080p alike)
MIN_IOU = 0.3  # a face continues the track when its box overlaps the previous one this much
CROP_MARGIN = 0.3  # of the face box, on each side: context for the eye finder
MASK_GROW = 0.15  # other faces are masked with this much extra margin
MAX_FPS = 240.0
HOG_THRESHOLD = -0.5  # dlib's default is 0; -0.5 finds the turned and talking faces of the synthetic recordings
REACQUIRE_SECONDS = 0.5  # a lone face away from the track is taken as the subject only after this gap
REMEMBER_SECONDS = 2.0  # another face is masked where it was last seen for this long after it was seen
# Following between full detections (FaceTracker.step): see the module docstring for what it guarantees.
DETECT_EVERY = 15  # frames: a full-frame detection at least every this many frames ...
DETECT_SECONDS = 1.0  # ... and at least every this many seconds of the recording
FOLLOW_SIDE = 48  # the face box is followed on a grey copy reduced (by an integer factor) to about this wide
FOLLOW_SEARCH = 0.25  # of the box side, each way: how far the face may move from one frame to the next
FOLLOW_MIN_NCC = 0.8  # normalised cross-correlation with the face as last detected, below it: detect again
CHANGE_MAX = 8.0  # grey levels (3x3 local mean at the follow scale) the crop around the face may differ by
MIN_TEXTURE = 4.0  # a detected face flatter than this (grey-level sd at the follow scale) is never followed
STAGED_FACE_MAX = 256  # px: a staged crop is reduced until its face box is at most this big (staged_crop)
# Eyes of a followed frame (TrackedFrame.moved): the eye band of the face box, matched on a finer grey copy.
EYE_BAND = (0.1, 0.15, 0.9, 0.6)  # of the face box (x0, y0, x1, y1): eyes and brows, not the mouth
EYES_FINE = 3  # the eye band is matched on cells this many times finer than the follow's (>= 1 px)
EYES_MIN_NCC = 0.9  # correlation of the eye band with the detection's, below it: no moved eyes (landmarks)


def _detector():
    """dlib's HOG frontal face detector, built once per process (building it takes ~1.4 s)."""
    global _DETECTOR
    if _DETECTOR is None:
        import dlib  # noqa: PLC0415 - dlib-bin, a dependency (alignment's landmarks)

        _DETECTOR = dlib.get_frontal_face_detector()
    return _DETECTOR


_DETECTOR = None


def is_video(name: str) -> bool:
    """Whether a manifest ``image`` cell names a video file (by its suffix, case-insensitive)."""
    # PurePosixPath(name).suffix without the object (called once per manifest row: 1M rows).
    base = name.rstrip("/").rpartition("/")[2]
    dot = base.rfind(".")
    return 0 < dot < len(base) - 1 and base[dot:].lower() in VIDEO_SUFFIXES


def check_fps(fps, *, where: str = "fps") -> float | None:
    """A declared frame rate (None: the source's), validated: a number in (0, 240]."""
    if fps is None:
        return None
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= MAX_FPS or math.isnan(fps):
        raise ConfigError(f"{where}={fps!r} must be a number of frames per second in (0, {MAX_FPS:g}]; "
                          "e.g. 'fps: 15' in drop.yaml, or leave it out to keep the source's rate")
    return float(fps)


def _open(path: str | os.PathLike | int) -> tuple[cv2.VideoCapture, int | None]:
    """A capture on ``path`` or on an open descriptor (read through /proc/self/fd: no path re-resolved)."""
    fd = path if isinstance(path, int) else None
    cap = cv2.VideoCapture(f"/proc/self/fd/{fd}" if fd is not None else str(path), cv2.CAP_FFMPEG)
    if not cap.isOpened():
        cap.release()
        raise RecordError("unreadable_video", "OpenCV/FFmpeg cannot open it as a video (decodes AVI/MJPEG, MP4 and "
                          "MOV with MPEG-4 part 2, WebM VP8/VP9, Matroska)")
    return cap, fd


def source_fps(cap: cv2.VideoCapture) -> float:
    """The container's frame rate, or RecordError when it declares none."""
    fps = cap.get(cv2.CAP_PROP_FPS)
    if not fps or not math.isfinite(fps) or fps <= 0:
        raise RecordError("unreadable_video", "the video declares no frame rate; set 'fps:' in drop.yaml")
    return float(fps)


def iter_frames(path: str | os.PathLike | int, *, fps: float | None = None,
                max_pixels: int | None = None) -> Iterator[tuple[int, float, np.ndarray]]:
    """Yield ``(index, seconds, bgr frame)`` of a video at ``fps`` (None: the source's rate), one at a time.

    At a lower rate than the source's, sample ``i`` (time ``i / fps``) is the first source frame at
    or after that time; a higher rate than the source's is refused (frames would repeat). Only one
    decoded frame is alive at a time, so a long recording never sits in memory.
    """
    cap, _ = _open(path)
    try:
        src = source_fps(cap)
        rate = src if fps is None else fps
        if rate > src * 1.001:
            raise RecordError("video_fps_too_high", f"fps={rate:g} is above the source's {src:g} frames per second; "
                              "declare at most the source's rate (or leave fps out)")
        w, h = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if max_pixels is not None and w * h > max_pixels:
            raise RecordError("image_too_large", f"{w}x{h} frames exceed max_pixels={max_pixels}; raise "
                              "DEID_MAX_PIXELS if the video is genuine")
        n_src = out = 0
        while True:
            if not cap.grab():
                break
            t = n_src / src
            n_src += 1
            # Keep the source frame at or just after the next sample time (1e-9: float tolerance).
            if t + 1e-9 < out / rate:
                continue
            ok, frame = cap.retrieve()
            if not ok:
                break
            yield out, out / rate, frame
            out += 1
    finally:
        cap.release()


def iou(a, b) -> float:
    """Intersection over union of two (x, y, w, h) boxes."""
    ix = max(0.0, min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = a[2] * a[3] + b[2] * b[3] - inter
    return inter / union if union > 0 else 0.0


@dataclass(frozen=True)
class TrackedFrame:
    """One frame's outcome: the subject's face crop (BGR) or the reason it is quarantined."""

    index: int
    seconds: float
    crop: np.ndarray | None
    reason: str | None = None  # video_no_face | video_ambiguous_faces | video_track_lost
    faces: int = 0  # faces found in the frame (a followed frame: at the last full detection)
    masked: int = 0  # other faces masked inside the crop
    box: tuple[int, int, int, int] | None = None  # the crop in frame pixels (x0, y0, x1, y1)
    face: tuple[float, float, float, float] | None = None  # the subject's face box in crop pixels (x, y, w, h)
    detected: bool = True  # False: followed from the last full detection, no detector run on this frame
    # A followed frame whose eye band matched the detection's: how far it moved since the detection (frame
    # pixels, sub-pixel); its eyes are the detection frame's moved by this. None: detected, or not verified.
    moved: tuple[float, float] | None = None


@dataclass
class _Reference:
    """The last full detection that kept a face, at the follow scale: what each followed frame must match.

    Everything is on a grid of ``q`` x ``q`` source pixels ("cells"), so the reference and a later
    frame reduced by :func:`_cells` line up exactly once the face's displacement (whole cells) is known.
    """

    index: int
    seconds: float
    faces: int
    box: tuple[float, float, float, float]  # the face box at the detection, frame pixels
    others: list[tuple[float, float, float, float]]  # other faces masked in the crop then, frame pixels
    q: int  # source pixels per cell
    cell: tuple[int, int, int, int]  # the face box in cells: x, y, width, height
    margin: tuple[int, int]  # cells around the box that cover every pixel crop_face releases (x, y)
    search: tuple[int, int]  # cells the face may move from one frame to the next (x, y)
    crop: np.ndarray  # float32 grey cells of the box plus margin at the detection
    ring: np.ndarray  # float32 1 outside the box, 0 inside (same shape as crop)
    ring_weight: np.ndarray  # 3x3 box filter of ring: normalises the local mean of differences
    low: np.ndarray  # 3x3 minimum of crop
    high: np.ndarray  # 3x3 maximum of crop
    shift: tuple[int, int] = (0, 0)  # the face's displacement since the detection, in cells
    fine: int = 1  # source pixels per fine cell (the eye band's grid)
    band_at: tuple[int, int] = (0, 0)  # the eye band's top-left at the detection, in fine cells
    band: np.ndarray | None = None  # float32 grey fine cells of the eye band at the detection (None: too small)

    @property
    def template(self) -> np.ndarray:
        (mx, my), (_, _, bw, bh) = self.margin, self.cell
        return self.crop[my:my + bh, mx:mx + bw]


_K3 = np.ones((3, 3), np.uint8)


def _cells(bgr: np.ndarray, q: int, x0: int, y0: int, x1: int, y1: int) -> np.ndarray | None:
    """Grey float32 means of the q x q cells [x0, x1) x [y0, y1) of a frame (None: no cell in frame).

    Cells beyond the frame's edge repeat its border pixels (the crop is clipped there, but the
    face may sit close to the edge): a cell straddling the edge averages its frame pixels with
    copies of the edge.
    """
    h, w = bgr.shape[:2]
    X0, Y0, X1, Y1 = x0 * q, y0 * q, x1 * q, y1 * q
    c0, r0, c1, r1 = max(0, X0), max(0, Y0), min(w, X1), min(h, Y1)
    if c1 <= c0 or r1 <= r0:
        return None
    roi = bgr[r0:r1, c0:c1]
    gray = cv2.cvtColor(roi, cv2.COLOR_BGR2GRAY) if roi.ndim == 3 else roi
    if (c0, r0, c1, r1) != (X0, Y0, X1, Y1):
        gray = cv2.copyMakeBorder(gray, r0 - Y0, Y1 - r1, c0 - X0, X1 - c1, cv2.BORDER_REPLICATE)
    if q > 1:  # INTER_AREA by a whole factor: exact means of the q x q blocks
        gray = cv2.resize(gray, (x1 - x0, y1 - y0), interpolation=cv2.INTER_AREA)
    return gray.astype(np.float32)


class FaceTracker:
    """Follow one subject's face through a recording (see the module docstring for the rules).

    Parameters
    ----------
    min_face_fraction : float, default 0.08
        Smallest face side searched, as a fraction of the frame's shorter side.
    min_iou : float, default :data:`MIN_IOU`
        Overlap with the previous kept box for a face to continue the track.
    reacquire_seconds : float, default :data:`REACQUIRE_SECONDS`
        Gap after which a lone face away from the track re-acquires it.
    detect_every : int, default :data:`DETECT_EVERY`
        A full-frame detection runs at least every this many frames (and every
        :data:`DETECT_SECONDS`); in between the face is followed (module docstring). 1: detect on
        every frame.
    """

    def __init__(self, *, min_face_fraction: float = 0.08, min_iou: float = MIN_IOU,
                 reacquire_seconds: float = REACQUIRE_SECONDS, detect_every: int = DETECT_EVERY):
        if not 0 < min_face_fraction < 1:
            raise ConfigError(f"min_face_fraction={min_face_fraction!r} must be in (0, 1), e.g. 0.08")
        if not 0 < min_iou <= 1:
            raise ConfigError(f"min_iou={min_iou!r} must be in (0, 1], e.g. {MIN_IOU}")
        if not reacquire_seconds >= 0:
            raise ConfigError(f"reacquire_seconds={reacquire_seconds!r} must be >= 0, e.g. {REACQUIRE_SECONDS}")
        if isinstance(detect_every, bool) or not isinstance(detect_every, int) or detect_every < 1:
            raise ConfigError(f"detect_every={detect_every!r} must be an integer >= 1 (frames between full "
                              f"detections; 1 = every frame), e.g. {DETECT_EVERY}")
        self.min_face_fraction = min_face_fraction
        self.min_iou = min_iou
        self.reacquire_seconds = reacquire_seconds
        self.detect_every = detect_every
        self.detector = _detector()
        self.track: tuple[float, float, float, float] | None = None
        self.others: list[tuple[tuple[float, float, float, float], float]] = []  # (box, seconds) of other faces
        self.seen_at: float | None = None  # time of the last kept frame
        self._ref: _Reference | None = None  # set by a kept full detection, cleared by any quarantined frame

    def faces(self, bgr: np.ndarray) -> list[tuple[float, float, float, float]]:
        """Face boxes (x, y, w, h) in frame pixels, found on a copy at most WORK_WIDTH wide."""
        gray = cv2.cvtColor(bgr, cv2.COLOR_BGR2GRAY) if bgr.ndim == 3 else bgr
        s = min(1.0, WORK_WIDTH / gray.shape[1])
        work = cv2.resize(gray, None, fx=s, fy=s, interpolation=cv2.INTER_AREA) if s < 1 else gray
        side = self.min_face_fraction * min(work.shape)
        found, _, _ = self.detector.run(work, 0, HOG_THRESHOLD)
        return [(r.left() / s, r.top() / s, r.width() / s, r.height() / s) for r in found if r.width() >= side]

    def step(self, index: int, seconds: float, bgr: np.ndarray) -> TrackedFrame:
        """The outcome of the next frame (updates the track when a face is kept).

        Between full detections the face is followed (:meth:`_follow`); a frame that cannot be
        followed with certainty gets the full detection.
        """
        ref = self._ref
        if (ref is not None and index - ref.index < self.detect_every
                and seconds - ref.seconds < DETECT_SECONDS - 1e-9):
            followed = self._follow(index, seconds, bgr, ref)
            if followed is not None:
                return followed
        self._ref = None
        tf = self._detect(index, seconds, bgr)
        if tf.crop is not None:
            self._ref = self._reference(index, seconds, bgr, tf)
        return tf

    def _detect(self, index: int, seconds: float, bgr: np.ndarray) -> TrackedFrame:
        """The full detection: every face of the frame found and associated with the track."""
        boxes = self.faces(bgr)
        if not boxes:
            return TrackedFrame(index, seconds, None, "video_no_face", 0)
        if len(boxes) == 1:
            chosen = boxes[0]
            if self.track is not None and iou(chosen, self.track) < self.min_iou and (
                    seconds - self.seen_at < self.reacquire_seconds
                    # where another face was seen lately: that face, not the subject, is the likely one
                    or any(iou(chosen, b) >= self.min_iou for b, t in self.others
                           if seconds - t <= REMEMBER_SECONDS)):
                return TrackedFrame(index, seconds, None, "video_track_lost", 1)
        else:
            best = max(boxes, key=lambda b: iou(b, self.track)) if self.track is not None else None
            if best is None or iou(best, self.track) < self.min_iou:
                self.others += [(b, seconds) for b in boxes]  # remembered though the frame is quarantined
                return TrackedFrame(index, seconds, None, "video_ambiguous_faces", len(boxes))
            chosen = best
        self.track, self.seen_at = chosen, seconds
        # Other faces seen within REMEMBER_SECONDS stay masked where they were last seen: a frame in which
        # the detector misses the second face must not release it.
        self.others = [(b, t) for b, t in self.others if seconds - t <= REMEMBER_SECONDS]
        self.others += [(b, seconds) for b in boxes if b is not chosen]
        others = [b for b, _ in self.others if iou(b, chosen) < self.min_iou]
        return _kept(index, seconds, bgr, chosen, others, len(boxes), True)

    def _reference(self, index: int, seconds: float, bgr: np.ndarray, tf: TrackedFrame) -> _Reference | None:
        """What the next frames are followed against, or None when this detection cannot be followed."""
        x, y, w, h = self.track
        q = max(1, int(w // FOLLOW_SIDE))
        bx, by, bw, bh = round(x / q), round(y / q), max(1, round(w / q)), max(1, round(h / q))
        # Cells that cover crop_face's margin (CROP_MARGIN of the box, its rounding, the box's own rounding).
        mx, my = math.ceil(CROP_MARGIN * w / q) + 2, math.ceil(CROP_MARGIN * h / q) + 2
        crop = _cells(bgr, q, bx - mx, by - my, bx + bw + mx, by + bh + my)
        if crop is None:  # pragma: no cover - a kept face is in the frame
            return None
        ring = np.ones_like(crop)
        ring[my:my + bh, mx:mx + bw] = 0
        ref = _Reference(index, seconds, tf.faces, self.track, list(self._masked), q, (bx, by, bw, bh), (mx, my),
                         (max(1, math.ceil(FOLLOW_SEARCH * w / q)), max(1, math.ceil(FOLLOW_SEARCH * h / q))),
                         crop, ring, cv2.blur(ring, (3, 3)), cv2.erode(crop, _K3), cv2.dilate(crop, _K3))
        if float(ref.template.std()) < MIN_TEXTURE:  # nothing to correlate with (a flat box)
            return None
        ref.fine = max(1, q // EYES_FINE)
        bx0, by0 = (round(v / ref.fine) for v in (x + EYE_BAND[0] * w, y + EYE_BAND[1] * h))
        bx1, by1 = (round(v / ref.fine) for v in (x + EYE_BAND[2] * w, y + EYE_BAND[3] * h))
        band = _cells(bgr, ref.fine, bx0, by0, bx1, by1) if bx1 - bx0 >= 8 and by1 - by0 >= 4 else None
        ref.band_at, ref.band = (bx0, by0), band if band is not None and float(band.std()) >= MIN_TEXTURE else None
        return ref

    def _follow(self, index: int, seconds: float, bgr: np.ndarray, ref: _Reference) -> TrackedFrame | None:
        """The frame with the face followed from the last detection, or None when that is not certain.

        Certain means: the face box, found again within :data:`FOLLOW_SEARCH` box sides of where it
        was, correlates with the face as detected at >= :data:`FOLLOW_MIN_NCC`, and every cell of the
        crop around it (all that :func:`crop_face` would release besides the box) is, as a 3x3 local
        mean, within :data:`CHANGE_MAX` grey levels of the same cell at the detection, moved with the
        face. Then the other faces masked at the detection are masked again, moved with the face.
        """
        (bx, by, bw, bh), (mx, my), (sx, sy), (dx, dy) = ref.cell, ref.margin, ref.search, ref.shift
        x0, y0 = bx + dx - mx - sx, by + dy - my - sy
        cells = _cells(bgr, ref.q, x0, y0, bx + dx + bw + mx + sx, by + dy + bh + my + sy)
        if cells is None:
            return None
        window = cells[my:my + bh + 2 * sy, mx:mx + bw + 2 * sx]
        _, score, _, (u, v) = cv2.minMaxLoc(cv2.matchTemplate(window, ref.template, cv2.TM_CCOEFF_NORMED))
        if not score >= FOLLOW_MIN_NCC:  # NaN (a flat window) included
            return None
        # How far each cell lies outside the range of the detection's cells around it (3x3): a sub-cell
        # move of an edge is no change; anything new in the crop is.
        cur = cells[v:v + bh + 2 * my, u:u + bw + 2 * mx]
        diff = np.maximum(cur - ref.high, ref.low - cur).clip(0) * ref.ring
        local = cv2.blur(diff, (3, 3)) / np.maximum(ref.ring_weight, 1e-6) * ref.ring
        if not float(local.max()) <= CHANGE_MAX:
            return None
        ref.shift = (dx + u - sx, dy + v - sy)
        mvx, mvy = ref.shift[0] * ref.q, ref.shift[1] * ref.q
        x, y, w, h = ref.box
        self.track, self.seen_at = (x + mvx, y + mvy, w, h), seconds
        others = [(ox + mvx, oy + mvy, ow, oh) for ox, oy, ow, oh in ref.others]
        return _kept(index, seconds, bgr, self.track, others, ref.faces, False, _eyes_moved(bgr, ref))

    @property
    def _masked(self) -> list[tuple[float, float, float, float]]:
        """The other faces the last kept detection masked (boxes in frame pixels)."""
        return [b for b, _ in self.others if iou(b, self.track) < self.min_iou]


def _kept(index, seconds, bgr, box, others, faces: int, detected: bool, moved=None) -> TrackedFrame:
    crop, masked, at = crop_face(bgr, box, others)
    face = (box[0] - at[0], box[1] - at[1], box[2], box[3])
    return TrackedFrame(index, seconds, crop, None, faces, masked, at, face, detected, moved)


def _eyes_moved(bgr: np.ndarray, ref: _Reference) -> tuple[float, float] | None:
    """How far the eye band moved since the detection (frame pixels, sub-pixel), or None when not certain.

    The band of the face box that holds the eyes and brows (:data:`EYE_BAND`, not the mouth: a
    talking face changes there) is found again on cells :data:`EYES_FINE` times finer than the
    follow's (1 px at 480p), within one follow cell and a fine cell of where the follow put it, by
    normalised cross-correlation with the band at the detection, refined below a cell by a
    parabola through the peak and its neighbours (each axis). Certain means a correlation >=
    :data:`EYES_MIN_NCC` (the band is the same picture, moved) and a peak inside the search window
    (not on its edge, where the best position may lie beyond it). Then the detection's eyes moved by
    this are the frame's (a rigid move of the band; a turn or a blink lowers the correlation, and
    the eyes are found by landmarks as on a detected frame).
    """
    if ref.band is None:
        return None
    f, (bx, by), bh, bw = ref.fine, ref.band_at, *ref.band.shape
    px, py = ref.shift[0] * ref.q / f, ref.shift[1] * ref.q / f  # the follow's move, in fine cells
    r = math.ceil(ref.q / f) + 1
    x0, y0 = bx + math.floor(px) - r, by + math.floor(py) - r
    window = _cells(bgr, f, x0, y0, x0 + bw + 2 * r + 1, y0 + bh + 2 * r + 1)
    if window is None:  # pragma: no cover - the face box is in the frame
        return None
    ncc = cv2.matchTemplate(window, ref.band, cv2.TM_CCOEFF_NORMED)
    _, score, _, (u, v) = cv2.minMaxLoc(ncc)
    if not score >= EYES_MIN_NCC or not (0 < u < ncc.shape[1] - 1 and 0 < v < ncc.shape[0] - 1):
        return None

    def vertex(a: float, b: float, c: float) -> float:  # of the parabola through (-1, a), (0, b), (1, c)
        d = a - 2 * b + c
        return float(np.clip(0.5 * (a - c) / d, -0.5, 0.5)) if d < 0 else 0.0

    du = vertex(ncc[v, u - 1], ncc[v, u], ncc[v, u + 1])
    dv = vertex(ncc[v - 1, u], ncc[v, u], ncc[v + 1, u])
    return ((x0 + u + du - bx) * f, (y0 + v + dv - by) * f)


def crop_face(bgr: np.ndarray, box, others=()) -> tuple[np.ndarray, int, tuple[int, int, int, int]]:
    """The face ``box`` with :data:`CROP_MARGIN` around it, every other face box in it filled flat.

    The fill is the crop's median colour, so neither the second face's pixels nor its outline
    reach alignment or the release. Returns ``(crop, faces masked, (x0, y0, x1, y1))``.
    """
    h, w = bgr.shape[:2]
    x, y, bw, bh = box
    x0, y0 = max(0, int(x - CROP_MARGIN * bw)), max(0, int(y - CROP_MARGIN * bh))
    x1, y1 = min(w, int(math.ceil(x + (1 + CROP_MARGIN) * bw))), min(h, int(math.ceil(y + (1 + CROP_MARGIN) * bh)))
    crop = np.ascontiguousarray(bgr[y0:y1, x0:x1])
    fill = None
    masked = 0
    for ox, oy, ow, oh in others:
        a0, b0 = int(ox - MASK_GROW * ow) - x0, int(oy - MASK_GROW * oh) - y0
        a1, b1 = int(math.ceil(ox + (1 + MASK_GROW) * ow)) - x0, int(math.ceil(oy + (1 + MASK_GROW) * oh)) - y0
        a0, b0, a1, b1 = max(0, a0), max(0, b0), min(crop.shape[1], a1), min(crop.shape[0], b1)
        if a0 < a1 and b0 < b1:
            if fill is None:  # the median of every 4th pixel each way, before any masking (only when needed)
                fill = np.median(crop[::4, ::4].reshape(-1, crop.shape[2] if crop.ndim == 3 else 1),
                                 axis=0).astype(np.uint8)
            crop[b0:b1, a0:a1] = fill
            masked += 1
    return crop, masked, (x0, y0, x1, y1)


def track_video(path: str | os.PathLike | int, *, fps: float | None = None, max_pixels: int | None = None,
                tracker: FaceTracker | None = None) -> Iterator[TrackedFrame]:
    """:func:`iter_frames` through a :class:`FaceTracker`: one :class:`TrackedFrame` per sampled frame."""
    tracker = tracker or FaceTracker()
    for index, seconds, frame in iter_frames(path, fps=fps, max_pixels=max_pixels):
        yield tracker.step(index, seconds, frame)


_REASONS = {"video_no_face": "no face found (the subject left the frame or turned away)",
            "video_ambiguous_faces": "several faces and none continues the subject's track; a second, "
                                     "unidentified face is never released",
            "video_track_lost": "a face away from the subject's track right after it was seen (maybe someone else)"}


def segment_messages(dropped: list[tuple[int, float, str]], rate: float) -> list[str]:
    """Per quarantined frame ``(index, seconds, reason)`` (in order), a message naming its segment.

    Consecutive frames with one reason form a segment: ``frames 30-44 (2.00-2.93 s): no face found ...``.
    """
    out: list[str] = []
    i = 0
    while i < len(dropped):
        j = i
        while (j + 1 < len(dropped) and dropped[j + 1][2] == dropped[i][2]
               and dropped[j + 1][0] == dropped[j][0] + 1):
            j += 1
        first, last = dropped[i], dropped[j]
        msg = (f"frame {first[0]}: in the segment frames {first[0]}-{last[0]} ({first[1]:.2f}-{last[1]:.2f} s, "
               f"{j - i + 1} frames at {rate:g} fps): {_REASONS.get(first[2], first[2])}")
        out.extend(msg.replace(f"frame {first[0]}:", f"frame {d[0]}:", 1) for d in dropped[i:j + 1])
        i = j + 1
    return out


def video_rate(path: str | os.PathLike | int, fps: float | None) -> float:
    """The rate frames are taken at: ``fps`` or the source's."""
    if fps is not None:
        return fps
    cap, _ = _open(path)
    try:
        return source_fps(cap)
    finally:
        cap.release()


def encode_png(bgr: np.ndarray) -> bytes:
    """Lossless bytes of a frame crop: PNG with the pixels stored, not deflated (zlib level 0, no filter).

    Deflating was the dearest step of video ingest: zlib level 1 took 2.4-4.2 ms to write and
    ~1.5 ms to read back a 346 px crop (10 s of 480p at 15 fps: 1.0 s of CPU), stored 0.3 ms and
    0.3 ms. The price is disk: a staged crop is its raw size (~0.36 MB at 480p, ~0.45 MB for a
    reduced 1080p one, :func:`staged_crop`), ~3x the deflated one: ~25 GB of staging per hour of
    1080p at 15 fps, freed by the staging retention like any staged table.
    """
    ok, buf = cv2.imencode(".png", bgr, [cv2.IMWRITE_PNG_COMPRESSION, 0,
                                         cv2.IMWRITE_PNG_FILTER, cv2.IMWRITE_PNG_FILTER_NONE])
    if not ok:  # pragma: no cover - OpenCV always encodes PNG
        raise RuntimeError("OpenCV could not encode a PNG frame")
    return buf.tobytes()


def encode_staged(bgr: np.ndarray) -> bytes:
    """The bytes ingest stages of a frame crop: BMP (24-bit, uncompressed; :func:`staged_crop`).

    The same pixels as :func:`encode_png`'s stored PNG at the same size (both are the raw pixels
    plus a header), for about half its CPU: a PNG, even stored, runs a CRC-32 and an Adler-32 over
    every byte and a filter byte per row each way, ~0.6 ms of a 480p frame's ~4 ms of ingest and
    alignment (measured on a 288 px crop: encode 0.37 vs 0.81 ms, grey decode 0.56 vs 0.85 ms,
    loaded machine). The grey decode alignment makes of it is identical.
    """
    ok, buf = cv2.imencode(".bmp", bgr)
    if not ok:  # pragma: no cover - OpenCV always encodes BMP
        raise RuntimeError("OpenCV could not encode a BMP frame")
    return buf.tobytes()


def staged_factor(face: tuple[float, float, float, float], max_face: int = STAGED_FACE_MAX) -> int:
    """The whole factor a crop with this face box is reduced by when staged (1: not reduced; :func:`staged_crop`)."""
    return max(1, math.ceil(max(face[2], face[3]) / max_face))


def staged_crop(tf: TrackedFrame, *, max_face: int = STAGED_FACE_MAX) -> tuple[bytes, tuple[float, float, float, float]]:
    """What ingest stages of a kept frame: the crop's bytes (BMP, :func:`encode_staged`) and the face box in its pixels.

    A crop whose face box is more than ``max_face`` pixels on a side is reduced by the smallest
    whole factor that brings it to ``max_face`` or less (area averaging: exact block means, and
    the cheap path of OpenCV's resize): a 486 px face of a 1080p frame is staged at 243 px. The
    eye distance stays >= ~100 px, three times what the default 81 px canonical face needs (a
    canonical face up to ~250 px wide is made without magnification); a one-hour 1080p
    recording stages ~4x fewer bytes and ingest spends less on them.
    """
    if tf.crop is None or tf.face is None:
        raise ValueError("staged_crop needs a kept frame (crop and face box), not a quarantined one")
    x, y, w, h = tf.face
    crop = tf.crop
    n = staged_factor(tf.face, max_face)
    if n > 1:
        rows, cols = crop.shape[0] // n, crop.shape[1] // n
        crop = cv2.resize(crop[:rows * n, :cols * n], (cols, rows), interpolation=cv2.INTER_AREA)
        x, y, w, h = x / n, y / n, w / n, h / n  # box edges, so no half-pixel shift
    return encode_staged(crop), (float(x), float(y), float(w), float(h))


EyesFinder = Callable[[bytes, tuple[float, float, float, float]], "tuple[float, float, float, float] | None"]


class StagedEyes:
    """The eyes of each staged frame of one recording, so alignment runs no landmark pass on followed frames.

    ``find(staged bytes, face box)`` gives the eyes (left x, y, right x, y, staged pixels) of a staged
    crop, or None; alignment supplies it (one 5-point landmark pass in the box: what it would run
    on the frame itself, so a detected frame's eyes are the ones it would find). A detected frame
    gets ``find``'s eyes; a followed frame whose eye band was verified to have moved rigidly since
    that detection (:attr:`TrackedFrame.moved`) gets the detection frame's eyes moved by as much; any
    other frame none (alignment finds them in its face box). :meth:`__call__` returns
    ``(left x, left y, right x, right y, followed)`` in the staged crop's pixels (followed: 0.0 or
    1.0), or None.
    """

    def __init__(self, find: EyesFinder, max_face: int = STAGED_FACE_MAX):
        self.find = find
        self.max_face = max_face
        self._ref: np.ndarray | None = None  # the last detected frame's eyes, frame pixels, (2, 2)

    def __call__(self, tf: TrackedFrame, data: bytes, face) -> tuple[float, ...] | None:
        if tf.face is None or tf.box is None:
            raise ValueError("StagedEyes needs a kept frame (crop, face box), not a quarantined one")
        n = staged_factor(tf.face, self.max_face)
        at = np.array(tf.box[:2], np.float64)
        half = (n - 1) / 2  # a staged pixel's centre is the centre of the n x n source pixels it averages
        if tf.detected:
            found = self.find(data, face)
            self._ref = None if found is None else np.reshape(found, (2, 2)) * n + half + at
            return None if found is None else (*map(float, found), 0.0)
        if tf.moved is None or self._ref is None:
            return None
        eyes = (self._ref + np.array(tf.moved) - at - half) / n
        return (*map(float, eyes.ravel()), 1.0)


def frame_record_id(record_id: str, index: int) -> str:
    """The staging record id of frame ``index`` of the video on row ``record_id`` (internal only)."""
    return f"{record_id}f{index:06d}"


def write_video(path: Path, frames, *, fps: float, fourcc: str = "MJPG") -> Path:
    """Write BGR frames (one size) with OpenCV; used by the synthetic drops and the benchmark."""
    frames = iter(frames)
    first = next(frames)
    h, w = first.shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), float(fps), (w, h))
    if not writer.isOpened():
        raise ConfigError(f"fourcc={fourcc!r} cannot be written to {Path(path).suffix!r} by this OpenCV; "
                          "use MJPG (.avi), mp4v (.mp4/.mov) or VP80 (.webm)")
    try:
        writer.write(first)
        for f in frames:
            writer.write(f)
    finally:
        writer.release()
    return Path(path)
