"""A modern face recogniser: dlib's ResNet face descriptor on our canonical (eye-aligned) faces.

dlib's ``dlib_face_recognition_resnet_model_v1`` (a 29-layer ResNet trained on about 3 million
faces; 99.38% on the LFW benchmark) maps a 150x150 RGB *face chip* to a 128-d descriptor in which
two photos of one person are usually less than 0.6 apart (Euclidean). dlib makes the chip with a
similarity transform fitted to 5 landmarks (:func:`dlib.get_face_chip`). Our aligned faces already
have their eyes at known canonical points, so the chip is made directly from them by the one
similarity that maps the canonical eyes onto the eye positions of dlib's chip template (one affine
warp per face, no landmark search); grey faces are replicated to 3 channels.

The model files come from the pinned ``face-recognition-models`` package (never downloaded at
run time). The 68-point landmark model in that package is not used (its licence excludes
commercial use).

References
----------
D. E. King. Dlib-ml: A machine learning toolkit. JMLR 10:1755-1758, 2009.
D. E. King. High quality face recognition with deep metric learning. dlib blog, 2017-02-12
(dlib_face_recognition_resnet_model_v1; 99.38% on LFW).
K. He, X. Zhang, S. Ren, J. Sun. Deep residual learning for image recognition. CVPR 2016.
"""
from __future__ import annotations

import hashlib
import logging
import math
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Hashable, Sequence

import cv2
import numpy as np
from sklearn.base import BaseEstimator

from deid.alignment.dlib_models import dlib_model
from deid.errors import ConfigError
from deid.memo import RowCache, RowStore
from deid.neighbours import distance_blocks

logger = logging.getLogger(__name__)

__all__ = [
    "CHIP_SIZE",
    "CHIP_PADDING",
    "SAME_PERSON_THRESHOLD",
    "DUPLICATE_THRESHOLD",
    "MIN_MEDIAN_DISTANCE",
    "SamePersonMatches",
    "chip_eyes",
    "DlibEmbedder",
    "DlibResNetAttacker",
    "SamePersonPair",
    "same_person_pairs",
    "embedding_distances",
]

CHIP_SIZE = 150
"""Side of dlib's face chip in pixels (the ResNet's input)."""
CHIP_PADDING = 0.25
"""dlib's default chip padding for the recogniser (``compute_face_descriptor``)."""

# dlib's mean-face template for the 5-point model, in [0, 1] chip units before padding
# (dlib/image_transforms/interpolation.h, get_face_chip_details): points 0-1 are the corners of the
# image-right eye, 2-3 of the image-left eye, 4 the base of the nose.
_TEMPLATE_5 = (
    (0.8595674595992, 0.2134981538014),
    (0.6460604764104, 0.2289674387931),
    (0.1205750620789, 0.2137274526848),
    (0.3340850613712, 0.2290642403242),
    (0.4901123135679, 0.6277975316475),
)

SAME_PERSON_THRESHOLD = 0.45
"""Descriptor distance below which two faces are one person (calibration in :func:`same_person_pairs`)."""
DUPLICATE_THRESHOLD = 0.12
"""Stricter distance used when the recogniser cannot tell the drop's people apart (near-copies only)."""
MIN_MEDIAN_DISTANCE = 0.65
"""Below this median distance between different ids, descriptors are not informative for the drop."""


def chip_eyes(size: int = CHIP_SIZE, padding: float = CHIP_PADDING) -> tuple[tuple[float, float], tuple[float, float]]:
    """Eye centres (left, right) in dlib's face chip: the mean of each eye's two template corners.

    With the defaults: (47.7, 47.1) and (100.3, 47.1). Measured on 40 London photos, the 5-point
    predictor run on dlib's own chips puts the eye-corner midpoints at (46.7, 47.2) and (100.6, 47.2).
    """
    t = [((padding + x) / (2 * padding + 1) * size, (padding + y) / (2 * padding + 1) * size) for x, y in _TEMPLATE_5]
    left = ((t[2][0] + t[3][0]) / 2, (t[2][1] + t[3][1]) / 2)
    right = ((t[0][0] + t[1][0]) / 2, (t[0][1] + t[1][1]) / 2)
    return left, right


# ------------------------------------------------------------------------------ descriptor cache
DESCRIPTOR_CACHE = RowCache(200_000)
"""Shared descriptor cache (at most 200,000 descriptors, ~150 MB); ``DESCRIPTOR_CACHE.clear()`` empties it.

The same original faces are embedded by every mode of every attack and by the same-person check;
a content key (embedder geometry + image bytes, not array identity) makes them cost once per
process, whatever copies or float conversions the callers make."""

DESCRIPTOR_STORE_ENV = "DEID_DESCRIPTOR_CACHE"
DESCRIPTOR_STORE = RowStore("dlib_face_recognition_resnet_model_v1-descriptors-1", DESCRIPTOR_STORE_ENV)
"""Descriptors kept between processes and runs when ``DEID_DESCRIPTOR_CACHE`` names a directory (off by default).

Keyed as :data:`DESCRIPTOR_CACHE` keys them (geometry, jitters and the face's bytes), below it: a face this
process has not embedded is looked up here before the network runs. For studies and test suites that embed
the same faces in many processes; it holds biometric templates of those faces (see :class:`deid.memo.RowStore`).
The model file is pinned (``face-recognition-models``); a change of model needs a new store name."""


def _check_pair(name: str, value: Any) -> tuple[float, float]:
    try:
        x, y = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} must be an (x, y) pair of fractions of the face width and height") from None
    if not (0.0 < x < 1.0 and 0.0 < y < 1.0):
        raise ConfigError(f"{name}={value!r} must lie inside the face: 0 < x < 1 and 0 < y < 1 (fractions)")
    return x, y


def _to_uint8_rows(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise ConfigError(f"{name} has shape {a.shape}; it must be a non-empty 2-D array (n_images, n_pixels)")
    if a.dtype == np.uint8:
        return np.ascontiguousarray(a)
    f = a.astype(np.float64, copy=False)
    if not np.isfinite(f).all():
        raise ConfigError(f"{name} contains NaN or infinite values; pass finite pixel values in 0..255")
    # Released and original faces are uint8 images; floats are those images converted by the caller.
    return np.clip(np.rint(f), 0, 255).astype(np.uint8)


class DlibEmbedder(BaseEstimator):
    """128-d dlib ResNet descriptors of aligned canonical faces (flat uint8 rows).

    Each face (grey ``height * width`` or RGB ``height * width * 3`` values per row) is warped by
    one similarity transform that sends the canonical eyes onto the eyes of dlib's 150x150 chip
    template (:func:`chip_eyes`), bilinear, borders replicated (dlib's chip is ~2.9 inter-ocular
    distances wide, our 81x92 face 2.5, so a thin margin is extrapolated); grey is copied to
    three channels. Identical rows are embedded once (content hash), descriptors are cached per
    process (:data:`DESCRIPTOR_CACHE`), and the network runs on batches of ``batch_size`` chips.

    Parameters
    ----------
    shape : (int, int), default (92, 81)
        (height, width) of the aligned faces.
    eye_left, eye_right : (float, float)
        Canonical eye centres as fractions of (width, height); defaults match
        :class:`deid.alignment.canonical.FaceAligner` (0.30, 0.37) and (0.70, 0.37).
    num_jitters : int, default 0
        dlib's test-time augmentation (0 or 1: none); each jitter costs a full forward pass.
    batch_size : int, default 1
        Chips per call of the network. dlib holds the GIL for a whole call: short calls let the
        process's other threads run between them (a small run's pool is fed by threads of the
        process that embeds its own share: each hand-over waits for the call in progress). The
        descriptors do not depend on it, and neither does the speed from 1 to 32 (0.095-0.099
        CPU-s per face for 1, 2, 4 and 8, bit-identical descriptors, measured).

    Attributes
    ----------
    n_features_in_ : int
        Values per row seen by ``fit``.

    Notes
    -----
    Cost (measured, one core, this machine): about 0.08 s per distinct face. The network runs on
    dlib's own CPU code (no BLAS), single-threaded.
    """

    def __init__(self, shape: tuple[int, int] = (92, 81), *, eye_left: tuple[float, float] = (0.30, 0.37),
                 eye_right: tuple[float, float] = (0.70, 0.37), num_jitters: int = 0, batch_size: int = 1):
        self.shape = shape
        self.eye_left = eye_left
        self.eye_right = eye_right
        self.num_jitters = num_jitters
        self.batch_size = batch_size

    def _geometry(self) -> tuple[int, int, np.ndarray]:
        try:
            h, w = (int(v) for v in self.shape)
        except (TypeError, ValueError):
            raise ConfigError(f"shape={self.shape!r} must be the (height, width) of the aligned faces, e.g. (92, 81)") from None
        if h < 8 or w < 8:
            raise ConfigError(f"shape={self.shape!r} must be at least (8, 8); pass the canonical (height, width), e.g. (92, 81)")
        lx, ly = _check_pair("eye_left", self.eye_left)
        rx, ry = _check_pair("eye_right", self.eye_right)
        if not lx < rx:
            raise ConfigError(f"eye_left={self.eye_left!r} must have a smaller x than eye_right={self.eye_right!r}")
        for name, v, low in (("num_jitters", self.num_jitters, 0), ("batch_size", self.batch_size, 1)):
            if isinstance(v, bool) or not isinstance(v, Integral) or v < low:
                raise ConfigError(f"{name}={v!r} must be an integer >= {low}")
        (cl, cr) = chip_eyes()
        # z -> a z + b on complex numbers maps the canonical eyes onto the chip's exactly.
        s_l, s_r = complex(lx * w, ly * h), complex(rx * w, ry * h)
        d_l, d_r = complex(*cl), complex(*cr)
        a = (d_r - d_l) / (s_r - s_l)
        b = d_l - a * s_l
        m = np.array([[a.real, -a.imag, b.real], [a.imag, a.real, b.imag]], dtype=np.float64)
        return h, w, m

    def _key_base(self) -> Any:
        """Hash state seeded with the geometry, so equal pixels under another geometry key differently."""
        h, w, _ = self._geometry()
        seed = repr((h, w, tuple(map(float, self.eye_left)), tuple(map(float, self.eye_right)), int(self.num_jitters)))
        return hashlib.blake2b(seed.encode(), digest_size=16, person=b"deid-dlib")

    def fit(self, X: Any = None, y: Any = None) -> "DlibEmbedder":
        """Check the parameters (the network is pre-trained; nothing is learned). Returns self."""
        self._geometry()
        if X is not None:
            self.n_features_in_ = _to_uint8_rows(X, "X").shape[1]
        return self

    def chips(self, X: Any) -> np.ndarray:
        """dlib face chips of the rows of ``X``: uint8 array (n, 150, 150, 3)."""
        h, w, m = self._geometry()
        a = _to_uint8_rows(X, "X")
        if a.shape[1] == h * w:
            faces = a.reshape(len(a), h, w)
        elif a.shape[1] == h * w * 3:
            faces = a.reshape(len(a), h, w, 3)
        else:
            raise ConfigError(f"rows have {a.shape[1]} values but shape={tuple(self.shape)!r} needs {h * w} (grey) "
                              f"or {h * w * 3} (RGB); pass the (height, width) of the aligned faces")
        out = np.empty((len(a), CHIP_SIZE, CHIP_SIZE, 3), dtype=np.uint8)
        for i, f in enumerate(faces):
            chip = cv2.warpAffine(f, m, (CHIP_SIZE, CHIP_SIZE), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
            out[i] = chip[:, :, None] if chip.ndim == 2 else chip
        return out

    def transform(self, X: Any) -> np.ndarray:
        """Descriptors of the rows of ``X``: float32 array (n, 128), rows of identical faces identical."""
        base = self._key_base()
        a = _to_uint8_rows(X, "X")
        out = np.empty((len(a), 128), dtype=np.float32)
        todo = DESCRIPTOR_CACHE.fill(out, DESCRIPTOR_CACHE.keys(a, base))
        for k, raw in DESCRIPTOR_STORE.get_many(list(todo)).items():
            d = np.frombuffer(raw, dtype=np.float32)
            if d.shape == (128,):  # anything else is not a descriptor: computed again below
                out[todo.pop(k)] = d
                DESCRIPTOR_CACHE.put(k, d.copy())
        if todo:
            first = np.array([idx[0] for idx in todo.values()])
            desc = self._compute(a[first])
            for (k, idx), d in zip(todo.items(), desc):
                out[idx] = d
                DESCRIPTOR_CACHE.put(k, d.copy())
            DESCRIPTOR_STORE.put_many({k: d.astype(np.float32).tobytes() for k, d in zip(todo, desc)})
            logger.debug("dlib: embedded %d distinct faces of %d rows", len(first), len(a))
        return out

    def fit_transform(self, X: Any, y: Any = None) -> np.ndarray:
        return self.fit(X).transform(X)

    def prime(self, X: Any, descriptors: Any) -> None:
        """Remember descriptors computed elsewhere (e.g. on Dask workers) for the rows of ``X``."""
        base = self._key_base()
        a = _to_uint8_rows(X, "X")
        d = np.asarray(descriptors, dtype=np.float32)
        if d.shape != (len(a), 128):
            raise ValueError(f"descriptors have shape {d.shape}; expected ({len(a)}, 128), one per row of X")
        for key, desc in zip(DESCRIPTOR_CACHE.keys(a, base), d):
            DESCRIPTOR_CACHE.put(key, desc.copy())

    def known(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        """The rows of ``X`` this process already has descriptors of, and those descriptors (nothing computed).

        Another process is handed them with :meth:`prime` (the gate's parallel attacks).
        """
        base = self._key_base()
        a = _to_uint8_rows(X, "X")
        hits = []
        for i, key in enumerate(DESCRIPTOR_CACHE.keys(a, base)):
            d = DESCRIPTOR_CACHE.get(key)
            if d is not None:
                hits.append((i, d))
        rows = np.array([i for i, _ in hits], dtype=np.int64)
        return a[rows], np.array([d for _, d in hits], dtype=np.float32).reshape(len(hits), 128)

    def _compute(self, a: np.ndarray) -> np.ndarray:
        model = dlib_model("recognizer")
        chips = self.chips(a)
        out = np.empty((len(a), 128), dtype=np.float32)
        bs = int(self.batch_size)
        for s in range(0, len(a), bs):
            batch = [np.ascontiguousarray(c) for c in chips[s:s + bs]]
            vecs = model.compute_face_descriptor(batch, int(self.num_jitters))
            out[s:s + len(batch)] = np.array([np.asarray(v) for v in vecs], dtype=np.float32)
        return out


def embedding_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Euclidean distances between the rows of ``a`` and of ``b`` (float64, shape (len(a), len(b)))."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    d = np.einsum("ij,ij->i", a, a)[:, None] + np.einsum("ij,ij->i", b, b)[None, :] - 2.0 * (a @ b.T)
    return np.sqrt(np.maximum(d, 0.0, out=d), out=d)


# ---------------------------------------------------------------------------------- same person
@dataclass(frozen=True)
class SamePersonPair:
    """Records ``i`` < ``j`` (row indices) listed under different ids whose faces match."""

    i: int
    j: int
    id_i: Hashable
    id_j: Hashable
    distance: float


@dataclass(frozen=True)
class SamePersonMatches:
    """Result of :func:`same_person_pairs`: the pairs and the evidence behind the decision.

    ``informative`` is False when faces under different ids are too alike for the recogniser
    (median distance below ``min_median_distance``, e.g. synthetic cartoon faces): then only
    near-copies (``threshold_used`` = the duplicate threshold) are matched.
    """

    pairs: tuple[SamePersonPair, ...]
    threshold_used: float
    informative: bool
    median_other_distance: float  # median descriptor distance between records of different ids (sampled)
    n_other_pairs_sampled: int
    n_records: int


def same_person_pairs(embeddings: Any, ids: Sequence[Hashable], *, threshold: float = SAME_PERSON_THRESHOLD,
                      duplicate_threshold: float = DUPLICATE_THRESHOLD,
                      min_median_distance: float = MIN_MEDIAN_DISTANCE, sample_pairs: int = 20_000,
                      seed: int = 0, block: int = 2048) -> SamePersonMatches:
    """Pairs of records under different ids whose dlib descriptors say "same person".

    A pair matches when its Euclidean descriptor distance is below ``threshold``. dlib's own
    verification threshold is 0.6 (on its 5-landmark chips, LFW pairs), but merging compares all
    n(n-1)/2 pairs of a drop, so the false-match rate per pair must be far smaller than a
    verification benchmark tolerates. Calibration on the London set (102 people x 2 photos,
    neutral and smiling, aligned by deid and embedded from the 81x92 grey canonical faces):

    ========== =============================== =========================
    threshold  false matches (different people) missed (same person)
    ========== =============================== =========================
    0.40       0 / 20,604 (95% upper 1.5e-4)   1 / 102 (95% upper 0.046)
    0.45       0 / 20,604 (95% upper 1.5e-4)   0 / 102 (95% upper 0.029)
    0.50       5 / 20,604 (95% upper 5.1e-4)   0 / 102
    0.60       221 / 20,604 (1.07%)            0 / 102
    ========== =============================== =========================

    (closest different people 0.479, farthest same-person pair 0.447; one-sided Clopper-Pearson
    bounds; the pairs share faces, so they are not independent). The same photo with added
    Gaussian noise of sd 2 / 5 / 10 grey levels is 0.105 / 0.26 / 0.43 from the clean one at most.

    On synthetic cartoon faces (``deid synth``, 100 people x 2) the recogniser does not separate
    people (different ids: median 0.475, 20% of 19,800 pairs below 0.40), so when the median
    distance between different ids in the drop is below ``min_median_distance`` (London: 0.83,
    sd 0.09) the descriptors are declared not informative and only near-copies below
    ``duplicate_threshold`` match (synthetic: none of 19,800 pairs below 0.157; a synthetic face
    with Gaussian noise of sd 2 / 3 / 5 grey levels added to its canonical face is at most 0.085 /
    0.129 / 0.214 from the clean one, n=20, so only the lightest noisy copies are caught there).

    Parameters
    ----------
    embeddings : array-like of shape (n, 128)
        Descriptors from :class:`DlibEmbedder`.
    ids : sequence of hashable, length n
        Subject id of each record (normalise them first).
    threshold, duplicate_threshold : float
        Match distances for informative and non-informative descriptors.
    min_median_distance : float
        Informativeness bound on the median distance between records of different ids.
    sample_pairs, seed : int
        That median is estimated on at most ``sample_pairs`` random pairs (seeded).
    block : int
        Largest number of rows per block of the exact all-pairs search (fewer when n is large, so a
        block holds at most 16 M distances). Cost: n^2/2 dot products of 128 floats (BLAS).

    Returns
    -------
    SamePersonMatches
    """
    e = np.asarray(embeddings, dtype=np.float32)
    if e.ndim != 2 or e.shape[1] == 0:
        raise ConfigError(f"embeddings has shape {e.shape}; pass the (n, 128) descriptors of DlibEmbedder.transform")
    ids = list(ids)
    n = len(e)
    if len(ids) != n:
        raise ConfigError(f"ids has {len(ids)} entries but embeddings has {n} rows; pass one subject id per record")
    for name, v in (("threshold", threshold), ("duplicate_threshold", duplicate_threshold),
                    ("min_median_distance", min_median_distance)):
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 2 and math.isfinite(v)):
            raise ConfigError(f"{name}={v!r} must be a distance in [0, 2] (descriptors have unit-scale length)")
    codes = np.unique(np.array([str(type(x)) + repr(x) for x in ids], dtype=object), return_inverse=True)[1]
    med, n_sampled = _median_other_distance(e, codes, sample_pairs=int(sample_pairs), seed=seed)
    informative = not (med < min_median_distance)  # nan (nothing to compare) counts as informative
    t = float(threshold if informative else duplicate_threshold)
    if not informative:
        logger.warning("same person: median distance between different ids %.3f < %.2f: the recogniser does not "
                       "separate these faces; matching near-copies only (distance < %.2f)", med, min_median_distance, t)
    return SamePersonMatches(_pairs_within(e, codes, ids, t, block=int(block)), t, informative, med, n_sampled, n)


def _median_other_distance(e: np.ndarray, codes: np.ndarray, *, sample_pairs: int, seed: int) -> tuple[float, int]:
    """Informativeness of the descriptors (:func:`same_person_pairs`): the median distance over at most
    ``sample_pairs`` random pairs of records with different ids (seeded), and how many pairs it is over.

    Parameters
    ----------
    e : ndarray of shape (n, d)
        The descriptors.
    codes : ndarray of shape (n,)
        An integer per record, equal for records of the same id.
    sample_pairs, seed : int
        The most pairs sampled; the seed of the draw.

    Returns
    -------
    median : float
        NaN when there is no pair of different ids.
    n_sampled : int
    """
    n = len(e)
    rng = np.random.default_rng(seed)
    med, n_sampled = float("nan"), 0
    if n >= 2 and len(np.unique(codes)) >= 2:
        a = rng.integers(0, n, size=sample_pairs * 2)
        b = rng.integers(0, n, size=sample_pairs * 2)
        keep = codes[a] != codes[b]
        a, b = a[keep][:sample_pairs], b[keep][:sample_pairs]
        n_sampled = len(a)
        if n_sampled:
            med = float(np.median(np.linalg.norm(e[a] - e[b], axis=1)))
    return med, n_sampled


def _pairs_within(e: np.ndarray, codes: np.ndarray, ids: list, t: float, *, block: int) -> tuple[SamePersonPair, ...]:
    """Every pair of records under different ids (``codes``) whose descriptors ``e`` are closer than ``t``: an exact
    search over the upper triangle, in row blocks of at most ``block`` rows and ~16 M distances (64 MB float32).

    Parameters
    ----------
    e : ndarray of shape (n, d), float32
        The descriptors.
    codes : ndarray of shape (n,)
        An integer per record, equal for records of the same id.
    ids : list, length n
        The subject ids the pairs name.
    t : float
        The match distance (strict).
    block : int
        The most rows per block.

    Returns
    -------
    tuple of SamePersonPair
        In row order (``i``, then ``j``).
    """
    pairs: list[SamePersonPair] = []
    for s, d2 in distance_blocks(e, max_cells=16_000_000, max_rows=block, upper=True):
        ii, jj = np.nonzero(d2 < t * t)
        for i, j in zip(ii + s, jj + s):
            if j > i and codes[i] != codes[j]:
                dist = float(np.linalg.norm(e[i].astype(np.float64) - e[j]))
                if dist < t:
                    pairs.append(SamePersonPair(int(i), int(j), ids[i], ids[j], dist))
    return tuple(pairs)


# ------------------------------------------------------------------------------------- attacker
from deid.evaluation.attackers import _GalleryAttacker  # noqa: E402 - attacks registers this class lazily (no import cycle)


class DlibResNetAttacker(_GalleryAttacker):
    """Re-identification by dlib's ResNet face descriptor; similarity is minus the Euclidean distance.

    A modern recogniser next to the 2005-era ones of :mod:`deid.evaluation.attacks`: nothing is learned from
    the gallery (the network is pre-trained), so ``fit`` only enrolls it. Descriptors come from
    :class:`DlibEmbedder`, so identical faces (k-Same releases hold N/k distinct images) are
    embedded once, get bit-identical descriptors and therefore exactly tied scores, and the
    originals are embedded once per process however many modes reuse them.

    Parameters
    ----------
    shape : (int, int), default (92, 81)
        (height, width) of the aligned faces.
    num_jitters, batch_size : int
        Passed to :class:`DlibEmbedder`.

    Attributes
    ----------
    embedder_ : DlibEmbedder
    gallery_ : ndarray of shape (n_gallery, 128)
    gallery_people_ : ndarray

    References
    ----------
    D. E. King. Dlib-ml: A machine learning toolkit. JMLR 10:1755-1758, 2009.
    """

    def __init__(self, shape: tuple[int, int] = (92, 81), *, num_jitters: int = 0, batch_size: int = 1):
        self.shape = shape
        self.num_jitters = num_jitters
        self.batch_size = batch_size

    def _fit_model(self, g: np.ndarray, codes: np.ndarray) -> None:
        self.embedder_ = DlibEmbedder(self.shape, num_jitters=self.num_jitters, batch_size=self.batch_size).fit(g)

    def _embed(self, a: np.ndarray) -> np.ndarray:
        return self.embedder_.transform(a).astype(np.float64)

    def _score(self, p: np.ndarray, g: np.ndarray) -> np.ndarray:
        return -embedding_distances(p, g)
