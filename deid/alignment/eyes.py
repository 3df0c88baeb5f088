"""Eye centres of a face: dlib's 5-point landmarks in the face box, OpenCV Haar cascades as fallback.

Eye centres come from the manifest when given, else from dlib's 5-point landmark model on the face box
(Kazemi & Sullivan, 2014), falling back to OpenCV Haar eye cascades (Viola & Jones, 2001).
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Any

import cv2
import numpy as np

from deid.alignment.dlib_models import dlib_model
from deid.errors import ConfigError, RecordError

logger = logging.getLogger(__name__)

__all__ = ["EYE_SOURCES", "EyePair", "EyeDetection", "HaarEyeDetector", "five_points"]



# Where an aligned face's eye positions came from; the aligned-table suite
# (schemas/expectations/aligned.json) lists the same values, tests/integration/alignment/test_align.py checks it.
EYE_SOURCES: tuple[str, ...] = ("manifest", "detected", "landmarks", "landmarks_hog", "face_geometry", "landmarks_tracked",
                                 "landmarks_followed")

@dataclass(frozen=True)
class EyePair:
    """Eye centres in pixel coordinates; ``left`` is the eye with the smaller x in the image."""

    left: tuple[float, float]
    right: tuple[float, float]

    @property
    def distance(self) -> float:
        """Euclidean inter-ocular distance in pixels."""
        return math.hypot(self.right[0] - self.left[0], self.right[1] - self.left[1])

    def ordered(self) -> "EyePair":
        """The same eyes with ``left`` guaranteed to be the one with the smaller x."""
        if self.left[0] <= self.right[0]:
            return self
        return EyePair(self.right, self.left)

    def is_finite(self) -> bool:
        """True when all four coordinates are finite numbers."""
        try:
            return all(math.isfinite(float(v)) for v in (*self.left, *self.right)) and len(self.left) == 2 == len(self.right)
        except (TypeError, ValueError):
            return False


@dataclass(frozen=True)
class EyeDetection:
    """Detector output: the eyes, how they were found and the face box.

    ``source`` is 'landmarks' (5-point landmarks in the Haar face box), 'landmarks_hog' (landmarks
    in dlib's HOG face box, where the Haar face cascade found no face: e.g. tightly cropped faces),
    'detected' (Haar eye cascade) or 'face_geometry' (estimated from the face box).
    """

    eyes: EyePair
    source: str
    face: tuple[float, float, float, float]  # x, y, width, height in full-resolution pixels


# Haar cascades: loaded lazily, once per thread. CascadeClassifier.detectMultiScale keeps per-call
# state in the object, so one instance must not be shared by threads (Dask workers run several).
_cascades = threading.local()


def _cascade(name: str) -> cv2.CascadeClassifier:
    cache: dict[str, cv2.CascadeClassifier] | None = getattr(_cascades, "cache", None)
    if cache is None:
        cache = _cascades.cache = {}
    clf = cache.get(name)
    if clf is None:
        path = name if "/" in name else cv2.data.haarcascades + name
        clf = cv2.CascadeClassifier(path)
        if clf.empty():
            raise ConfigError(
                f"cascade={name!r} could not be loaded from {path!r}; use a file name from cv2.data.haarcascades"
                " (e.g. 'haarcascade_frontalface_alt2.xml') or an absolute path to a cascade XML"
            )
        cache[name] = clf
    return clf


def _positive(name: str, value: Any, *, low: float = 0.0, high: float = math.inf, integer: bool = False) -> None:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or not (low < float(value) < high) or not math.isfinite(float(value)):
        kind = "an integer" if integer else "a number"
        rng = f"> {low}" if high == math.inf else f"in ({low}, {high})"
        raise ConfigError(f"{name}={value!r} must be {kind} {rng}")


def five_points(gray: np.ndarray, box: tuple[float, float, float, float]) -> np.ndarray:
    """dlib's 5-point landmarks (Kazemi & Sullivan, 2014) in ``box`` (x, y, w, h) of ``gray``: (5, 2) float64.

    Points 0-1 are the corners of the image-right eye, 2-3 of the image-left eye, 4 the base of the nose.
    """
    import dlib  # noqa: PLC0415 - only when landmarks are used

    x, y, w, h = box
    rect = dlib.rectangle(int(round(x)), int(round(y)), int(round(x + w)), int(round(y + h)))
    shape = dlib_model("shape5")(gray, rect)
    return np.array([(float(shape.part(i).x), float(shape.part(i).y)) for i in range(5)], dtype=np.float64)


class HaarEyeDetector:
    """Eye centres from OpenCV Haar cascades: the face at a coarse scale, then the eyes inside it.

    Faces smaller than ``min_face_fraction`` of the image's shorter side are not searched, so the
    face search runs on the image area-downscaled until that smallest face is ``min_face_size``
    pixels (about 100 px for a portrait): the cascade cost grows with the number of windows, and a
    coarse face box is enough because the eyes are then searched only in the eye band of the largest
    face (``eye_band`` of its height), resampled to ``eye_work_width`` pixels wide, for eyes of
    ``eye_size`` of that width. The best left/right pair is chosen by geometry (roughly horizontal,
    0.25-0.55 face widths apart, symmetric about the face centre, similar sizes). Cascades are Viola
    & Jones (2001) detectors as shipped with OpenCV.

    Parameters
    ----------
    min_face_fraction : float
        Smallest face searched, as a fraction of the image's shorter side (0.25: portraits, not
        group photos; a smaller face is ``no_face``).
    min_face_size : int
        Size in pixels of that smallest face in the downscaled search image (>= 20, the cascade window).
    face_cascade, eye_cascade : str
        Cascade XML file names in ``cv2.data.haarcascades`` (or absolute paths).
    scale_factor, min_neighbors : float, int
        ``detectMultiScale`` parameters of the face search.
    eye_work_width : int
        Width to which the eye band of the face is resampled for the eye search.
    eye_band : (float, float)
        Top and bottom of the eye band as fractions of the face box height.
    eye_size : (float, float)
        Smallest and largest eye box searched, as fractions of ``eye_work_width``.
    eye_scale_factor, eye_min_neighbors : float, int
        ``detectMultiScale`` parameters of the eye search.
    detect_min_side : int
        :func:`align_records` decodes a JPEG for detection at the largest reduction (1/2, 1/4, 1/8)
        that keeps the shorter side at least this many pixels (see :meth:`reduction`).
    multiple_face_ratio : float
        Another non-overlapping face at least this fraction of the largest face's width makes the image
        ambiguous (``multiple_faces``); smaller ones are taken as false positives and ignored.
    geometry_fallback : bool
        When the eye cascade finds no plausible pair, estimate the eyes from the face box
        (source 'face_geometry') instead of raising ``eyes_not_found``.
    landmarks : {"primary", "fallback", "off"}
        Use dlib's 5-point shape predictor (eye centre = mean of the eye's two corner points, moved
        up by ``pupil_offset``) before the Haar eye cascade ("primary"), only when the cascade finds
        no pair ("fallback"), or never. With landmarks on, a face the Haar face cascade misses is
        searched with dlib's HOG detector on the image padded by replicated borders (a tightly
        cropped face fills the frame, leaving no context for either detector); landmark eyes are
        kept only if plausible (distance and tilt).
    pupil_offset : float
        Distance, as a fraction of the inter-ocular distance, from the eye-corner midpoint up to the
        pupil centre (perpendicular to the eye line): 0.052 measured on the 102 neutral London
        photos against their manual pupils (sd 0.009; 0.0514 and 0.0516 on odd and even ids; the
        offset of one half applied to the other gives mean errors 0.018 and 0.0175, max 0.048).
        Our canonical eye points are pupils, so every eye source lands on the same point.

    Notes
    -----
    Measured on the 102 neutral London photos (``deid eval-alignment``): Haar eye cascade mean
    error 0.051 of the inter-ocular distance (max 0.097); landmarks in the Haar face box 0.018
    (max 0.046), and the two predictor passes (~1-2 ms) cost less than the eye cascade's search
    (align_records on all 204 London photos: 11.8 vs 15.6 ms of CPU per image). On 200
    synthetic cartoon faces the cascade is the more accurate where it finds a pair (0.040 vs
    0.056) but finds one in 41% only; landmarks align 99% of them. The predictor was trained on
    HOG boxes, so the Haar box is first mapped to the HOG box geometry (``HOG_BOX_IN_HAAR``).
    V. Kazemi, J. Sullivan. One millisecond face alignment with an ensemble of regression trees.
    CVPR 2014. N. Dalal, B. Triggs. Histograms of oriented gradients for human detection. CVPR 2005.
    """

    # Mean eye centres inside the alt2 face box as found by the coarse face search with the default
    # parameters (fractions of its width/height), measured on the 102 neutral London photos against
    # the manual landmarks (sd 0.013-0.017); used only by the geometry fallback.
    GEOMETRY_LEFT = (0.324, 0.386)
    GEOMETRY_RIGHT = (0.659, 0.386)
    # dlib's HOG face box inside the alt2 face box (x, y offsets and width, height as fractions of the
    # alt2 box), mean over the 102 neutral London photos (sd 0.025, 0.027, 0.051, 0.050).
    HOG_BOX_IN_HAAR = (0.089, 0.159, 0.813, 0.816)
    # Plausible landmark eyes: inter-ocular distance as a fraction of the predictor box width (HOG
    # boxes: ~0.41 on London), and largest tilt of the eye line in radians.
    LANDMARK_EYE_DISTANCE = (0.25, 0.65)
    LANDMARK_MAX_TILT = 0.35
    # The same HOG box relative to the pupils (offsets of its top-left corner from the eye midpoint,
    # width, height; units of the inter-ocular distance), from the two measurements above.
    HOG_BOX_FROM_EYES = (-1.20, -0.68, 2.43, 2.44)
    # HOG face search where the Haar face cascade finds none: padding (fraction of the shorter side),
    # working size of the padded shorter side (the detector's window is 80 px) and score threshold.
    # On 200 synthetic faces cropped tightly (2.0-2.4 inter-ocular distances, 80 px) it found
    # 194-199 faces at -0.8 (58-141 unpadded at dlib's default 0), and none in 100 noise textures.
    HOG_PAD = 0.25
    HOG_WORK_SIDE = 340
    HOG_THRESHOLD = -0.8

    def __init__(
        self,
        *,
        min_face_fraction: float = 0.25,
        min_face_size: int = 24,
        face_cascade: str = "haarcascade_frontalface_alt2.xml",
        eye_cascade: str = "haarcascade_eye.xml",
        scale_factor: float = 1.1,
        min_neighbors: int = 4,
        eye_work_width: int = 160,
        eye_band: tuple[float, float] = (0.20, 0.55),
        eye_size: tuple[float, float] = (0.17, 0.32),
        eye_scale_factor: float = 1.12,
        eye_min_neighbors: int = 3,
        multiple_face_ratio: float = 0.5,
        geometry_fallback: bool = True,
        detect_min_side: int = 512,
        landmarks: str = "primary",
        pupil_offset: float = 0.052,
        refine_landmarks: bool = True,
    ):
        self.min_face_fraction = min_face_fraction
        self.min_face_size = min_face_size
        self.face_cascade = face_cascade
        self.eye_cascade = eye_cascade
        self.scale_factor = scale_factor
        self.min_neighbors = min_neighbors
        self.eye_work_width = eye_work_width
        self.eye_band = eye_band
        self.eye_size = eye_size
        self.eye_scale_factor = eye_scale_factor
        self.eye_min_neighbors = eye_min_neighbors
        self.multiple_face_ratio = multiple_face_ratio
        self.geometry_fallback = geometry_fallback
        self.detect_min_side = detect_min_side
        self.landmarks = landmarks
        self.pupil_offset = pupil_offset
        self.refine_landmarks = refine_landmarks

    def _validate(self) -> None:
        _positive("min_face_fraction", self.min_face_fraction, low=0.0, high=1.0)
        _positive("min_face_size", self.min_face_size, low=19, integer=True)
        _positive("eye_work_width", self.eye_work_width, low=39, integer=True)
        _positive("detect_min_side", self.detect_min_side, low=31, integer=True)
        _fractions("eye_band", self.eye_band, high=1.0)
        _fractions("eye_size", self.eye_size, high=1.0)
        _positive("scale_factor", self.scale_factor, low=1.0, high=2.0)
        _positive("eye_scale_factor", self.eye_scale_factor, low=1.0, high=2.0)
        _positive("min_neighbors", self.min_neighbors, low=-1, integer=True)
        _positive("eye_min_neighbors", self.eye_min_neighbors, low=-1, integer=True)
        _positive("multiple_face_ratio", self.multiple_face_ratio, low=0.0, high=1.0)
        if self.landmarks not in ("primary", "fallback", "off"):
            raise ConfigError(f"landmarks={self.landmarks!r} must be 'primary' (5-point landmarks first), "
                              "'fallback' (after the Haar eye cascade) or 'off'")
        if not (isinstance(self.pupil_offset, (int, float)) and not isinstance(self.pupil_offset, bool)
                and -0.3 <= self.pupil_offset <= 0.3):
            raise ConfigError(f"pupil_offset={self.pupil_offset!r} must be a number in [-0.3, 0.3] "
                              "(fraction of the inter-ocular distance; 0 = eye-corner midpoint)")

    def reduction(self, width: int, height: int) -> int:
        """Largest JPEG decode reduction in (1, 2, 4, 8) keeping the shorter side >= ``detect_min_side``."""
        f = 8
        while f > 1 and min(width, height) / f < self.detect_min_side:
            f //= 2
        return f

    def _face(self, gray: np.ndarray) -> tuple[float, float, float, float]:
        h, w = gray.shape
        smallest = self.min_face_fraction * min(h, w)
        s = min(1.0, self.min_face_size / smallest) if smallest > 0 else 1.0
        # An integer reduction (the at most n-1 last rows/columns dropped) takes OpenCV's fast area-averaging
        # path, several times cheaper than a fractional one; rounded down, the smallest face stays >= min_face_size.
        n = max(1, int(1.0 / s + 1e-9))
        if n == 1 or h < n or w < n:
            small = gray
        else:
            small = cv2.resize(gray[: h - h % n, : w - w % n], (w // n, h // n), interpolation=cv2.INTER_AREA)
        size = max(20, round(smallest / n))  # the smallest face searched, in the reduced image
        if min(small.shape) < size:
            raise RecordError("no_face", f"the image ({w}x{h}) is smaller than the smallest face searched")
        faces = _cascade(self.face_cascade).detectMultiScale(
            small, scaleFactor=self.scale_factor, minNeighbors=int(self.min_neighbors), minSize=(size, size)
        )
        if len(faces) == 0:
            raise RecordError("no_face", "the face cascade found no face")
        faces = sorted((tuple(float(v) for v in f) for f in faces), key=lambda f: f[2] * f[3], reverse=True)
        big = faces[0]
        for other in faces[1:]:
            if other[2] >= self.multiple_face_ratio * big[2] and not _overlaps(big, other):
                raise RecordError(
                    "multiple_faces",
                    f"{len(faces)} faces found; a second one is {other[2] / big[2]:.2f} of the largest's width",
                )
        x, y, fw, fh = big
        sx = sy = float(n) if small is not gray else 1.0
        return (x * sx, y * sy, fw * sx, fh * sy)

    def _eyes(self, gray: np.ndarray, face: tuple[float, float, float, float]) -> EyePair | None:
        fx, fy, fw, fh = face
        h, w = gray.shape
        x0, x1 = max(0, int(fx)), min(w, int(math.ceil(fx + fw)))
        y0, y1 = max(0, int(fy + self.eye_band[0] * fh)), min(h, int(math.ceil(fy + self.eye_band[1] * fh)))
        if x1 - x0 < 8 or y1 - y0 < 8:
            return None
        roi = gray[y0:y1, x0:x1]
        k = self.eye_work_width / roi.shape[1]
        interp = cv2.INTER_AREA if k < 1 else cv2.INTER_LINEAR
        band = cv2.resize(roi, (int(self.eye_work_width), max(1, round(roi.shape[0] * k))), interpolation=interp)
        ky = band.shape[0] / roi.shape[0]
        lo, hi = round(self.eye_size[0] * self.eye_work_width), round(self.eye_size[1] * self.eye_work_width)
        found = _cascade(self.eye_cascade).detectMultiScale(
            band, scaleFactor=self.eye_scale_factor, minNeighbors=int(self.eye_min_neighbors), minSize=(lo, lo), maxSize=(hi, hi)
        )
        # Box centre back to full-resolution pixel-centre coordinates.
        cands = [
            (x0 + (ex + ew / 2) / k - 0.5, y0 + (ey + eh / 2) / ky - 0.5, ew / k)
            for ex, ey, ew, eh in (tuple(float(v) for v in e) for e in found)
        ]
        cx = fx + fw / 2
        best: tuple[float, EyePair] | None = None
        for a in cands:
            for b in cands:
                if a[0] >= b[0]:
                    continue
                d = math.hypot(b[0] - a[0], b[1] - a[1])
                if not 0.25 * fw <= d <= 0.55 * fw:
                    continue
                tilt = abs(math.atan2(b[1] - a[1], b[0] - a[0]))
                if tilt > 0.35:
                    continue
                score = (
                    abs((a[0] + b[0]) / 2 - cx) / fw  # symmetric about the face centre
                    + tilt
                    + 0.5 * abs(math.log(a[2] / b[2]))  # both eyes about the same size
                    + abs(d / fw - 0.38)  # typical inter-ocular distance in an alt2 face box
                )
                if best is None or score < best[0]:
                    best = (score, EyePair((a[0], a[1]), (b[0], b[1])))
        return None if best is None else best[1]

    def eyes_in_box(self, gray: np.ndarray, box: tuple[float, float, float, float]) -> EyePair | None:
        """Pupils from the 5-point landmarks in a dlib HOG face ``box`` (x, y, w, h) of ``gray``, or None.

        For boxes that already are HOG detections (a video's tracked face, :mod:`deid.intake.video`):
        one predictor pass, no face search; None when the landmark eyes are implausible for the box
        (then the caller searches the face as for any still).
        """
        return self._landmark_pass(_check_gray(gray), box)

    def _landmark_eyes(self, gray: np.ndarray, box: tuple[float, float, float, float]) -> EyePair | None:
        """Pupils from the 5-point landmarks in ``box`` (x, y, w, h), or None when implausible.

        The predictor is run a second time in the HOG-shaped box placed on the first eyes
        (``HOG_BOX_FROM_EYES``): the regression trees were trained on HOG boxes, and a Haar box or
        the whole frame is only roughly one.
        """
        eyes = self._landmark_pass(gray, box)
        if eyes is None or not self.refine_landmarks:
            return eyes
        d = eyes.distance
        mx, my = (eyes.left[0] + eyes.right[0]) / 2, (eyes.left[1] + eyes.right[1]) / 2
        ox, oy, bw, bh = self.HOG_BOX_FROM_EYES
        again = self._landmark_pass(gray, (mx + ox * d, my + oy * d, bw * d, bh * d))
        return again if again is not None else eyes

    def _landmark_pass(self, gray: np.ndarray, box: tuple[float, float, float, float]) -> EyePair | None:
        x, y, w, h = box
        p = [(float(q[0]), float(q[1])) for q in five_points(gray, box)[:4]]
        # Points 0-1: corners of the image-right eye, 2-3 of the image-left eye (dlib's 5-point model).
        left = ((p[2][0] + p[3][0]) / 2, (p[2][1] + p[3][1]) / 2)
        right = ((p[0][0] + p[1][0]) / 2, (p[0][1] + p[1][1]) / 2)
        ux, uy = right[0] - left[0], right[1] - left[1]
        d = math.hypot(ux, uy)
        lo, hi = self.LANDMARK_EYE_DISTANCE
        if ux <= 0 or not lo * w <= d <= hi * w or abs(math.atan2(uy, ux)) > self.LANDMARK_MAX_TILT:
            return None
        # The pupil sits above the line of the eye corners: move along the upward normal (uy, -ux).
        k = float(self.pupil_offset)
        eyes = EyePair((left[0] + k * uy, left[1] - k * ux), (right[0] + k * uy, right[1] - k * ux))
        hh, ww = gray.shape
        if not all(0 <= px <= ww - 1 and 0 <= py <= hh - 1 for px, py in (eyes.left, eyes.right)):
            return None
        return eyes

    def _hog_faces(self, gray: np.ndarray) -> list[tuple[float, float, float, float]]:
        """dlib HOG face boxes (x, y, w, h) in ``gray`` coordinates, largest first.

        The image is padded by ``HOG_PAD`` of its shorter side (replicated borders) so that a face
        filling the frame (tightly cropped drops) still fits the detector's window with context, and
        resampled so the padded shorter side is ``HOG_WORK_SIDE`` pixels; detections down to the
        score ``HOG_THRESHOLD`` are kept (dlib's default is 0).
        """
        h, w = gray.shape
        p = int(self.HOG_PAD * min(h, w))
        padded = cv2.copyMakeBorder(gray, p, p, p, p, cv2.BORDER_REPLICATE) if p else gray
        ph, pw = padded.shape
        s = min(self.HOG_WORK_SIDE / min(ph, pw), 8.0)  # tiny images magnified at most 8x
        work = cv2.resize(padded, (max(1, round(pw * s)), max(1, round(ph * s))),
                          interpolation=cv2.INTER_AREA if s < 1 else cv2.INTER_LINEAR)
        sx, sy = pw / work.shape[1], ph / work.shape[0]
        found, _, _ = dlib_model("hog").run(work, 0, self.HOG_THRESHOLD)
        boxes = [(r.left() * sx - p, r.top() * sy - p, r.width() * sx, r.height() * sy) for r in found]
        return sorted(boxes, key=lambda b: b[2] * b[3], reverse=True)

    def _locate_without_haar_face(self, gray: np.ndarray) -> EyeDetection | None:
        """Landmarks in dlib's HOG face box, searched on the padded image (faces filling the frame)."""
        smallest = self.min_face_fraction * min(gray.shape)
        faces = [f for f in self._hog_faces(gray) if f[2] >= 0.8 * smallest]
        if not faces:
            return None
        big = faces[0]
        for other in faces[1:]:
            if other[2] >= self.multiple_face_ratio * big[2] and not _overlaps(big, other):
                raise RecordError("multiple_faces", f"{len(faces)} faces found by the HOG detector; a second one "
                                  f"is {other[2] / big[2]:.2f} of the largest's width")
        eyes = self._landmark_eyes(gray, big)
        return None if eyes is None else EyeDetection(eyes, "landmarks_hog", big)

    def locate(self, gray: np.ndarray) -> EyeDetection:
        """Eyes of the single face of ``gray`` with their source; raises RecordError when not found."""
        self._validate()
        gray = _check_gray(gray)
        try:
            face = self._face(gray)
        except RecordError as exc:
            if exc.code != "no_face" or self.landmarks == "off":
                raise
            found = self._locate_without_haar_face(gray)
            if found is None:
                raise
            return found
        if self.landmarks != "off":
            fx, fy, fw, fh = face
            bx, by, bw, bh = self.HOG_BOX_IN_HAAR
            box = (fx + bx * fw, fy + by * fh, bw * fw, bh * fh)
        if self.landmarks == "primary":
            eyes = self._landmark_eyes(gray, box)
            if eyes is not None:
                return EyeDetection(eyes, "landmarks", face)
        eyes = self._eyes(gray, face)
        if eyes is not None:
            return EyeDetection(eyes, "detected", face)
        if self.landmarks == "fallback":
            eyes = self._landmark_eyes(gray, box)
            if eyes is not None:
                return EyeDetection(eyes, "landmarks", face)
        if not self.geometry_fallback:
            raise RecordError("eyes_not_found", "the eye cascade found no plausible left/right pair in the face")
        fx, fy, fw, fh = face
        eyes = EyePair(
            (fx + self.GEOMETRY_LEFT[0] * fw, fy + self.GEOMETRY_LEFT[1] * fh),
            (fx + self.GEOMETRY_RIGHT[0] * fw, fy + self.GEOMETRY_RIGHT[1] * fh),
        )
        logger.debug("no eye pair found; eyes estimated from the face box %s", face)
        return EyeDetection(eyes, "face_geometry", face)

    def detect(self, gray: np.ndarray) -> EyePair:
        """Eye centres of the single face of ``gray``, in its full-resolution pixel coordinates."""
        return self.locate(gray).eyes


def _overlaps(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    # Overlap measured on the smaller box: a detection nested in or straddling the big face is the same face.
    ix = max(0.0, min(a[0] + a[2], b[0] + b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[1] + a[3], b[1] + b[3]) - max(a[1], b[1]))
    return ix * iy > 0.3 * min(a[2] * a[3], b[2] * b[3])


def _fractions(name: str, value: Any, *, high: float) -> None:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} must be a (low, high) pair of fractions") from None
    if not (0.0 <= lo < hi <= high):
        raise ConfigError(f"{name}={value!r} must satisfy 0 <= low < high <= {high}")


def _check_gray(gray: Any) -> np.ndarray:
    gray = np.asarray(gray)
    if gray.ndim != 2 or gray.dtype != np.uint8 or gray.size == 0:
        raise ValueError(f"gray must be a non-empty 2-D uint8 array; got shape {gray.shape} dtype {gray.dtype}")
    return gray
