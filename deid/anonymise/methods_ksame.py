"""The k-Same family beyond pixel averaging: k-Same-Eigen and model-based k-Same-M.

Both cluster faces exactly as :class:`deid.anonymise.ksame.KSame` does (greedy, >= k distinct people
per cluster, in eigenface coefficient space) and give every member of a cluster the
*identical* image, so they carry k-Same's structural guarantee; they differ in how the
cluster's face is formed.
"""
from __future__ import annotations

import logging
from numbers import Integral
from typing import Any, Hashable, Sequence

import cv2
import numpy as np
from sklearn.base import BaseEstimator

from deid.errors import ConfigError
from deid.alignment.features import Eigenfaces
from deid.anonymise.ksame import KSame

logger = logging.getLogger(__name__)

FLOWS = ("farneback", "dis")


def check_images(X: Any) -> np.ndarray:
    """Validate a 2-D array of flattened faces (n_faces, n_pixels), finite, numeric."""
    a = np.asarray(X)
    if a.ndim != 2 or a.shape[0] == 0 or not np.issubdtype(a.dtype, np.number):
        raise ConfigError(f"images has shape {a.shape} and dtype {a.dtype}; pass a non-empty numeric "
                          "(n_faces, height * width) array of aligned grey faces")
    if not np.isfinite(a).all():
        raise ConfigError("images contain NaN or infinite values; pass aligned uint8 faces")
    return a


def check_shape(shape: Any, n_pixels: int | None = None) -> tuple[int, int]:
    """Validate (height, width), optionally against the number of pixels per face."""
    try:
        h, w = (int(v) for v in shape)
    except (TypeError, ValueError):
        raise ConfigError(f"shape={shape!r} must be the (height, width) of the aligned faces, e.g. (92, 81)") from None
    if h < 1 or w < 1:
        raise ConfigError(f"shape={shape!r} must be positive (height, width) of the aligned faces, e.g. (92, 81)")
    if n_pixels is not None and h * w != n_pixels:
        raise ConfigError(f"images have {n_pixels} pixels but shape={tuple(shape)!r} has {h * w}; "
                          "pass the (height, width) of the aligned faces")
    return h, w


def check_k(k: Any) -> int:
    if isinstance(k, bool) or not isinstance(k, Integral) or k < 2:
        raise ConfigError(f"k={k!r} must be an integer >= 2 (k=1 releases every face unchanged); pass e.g. k=5")
    return int(k)


def to_uint8(a: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(a), 0, 255).astype(np.uint8)


def sharpness(images: Any, *, shape: tuple[int, int]) -> np.ndarray:
    """Variance of the Laplacian of each face (higher = sharper; ghosted averages score low).

    The usual focus measure (Pech-Pacheco et al., ICPR 2000), used here to measure how much
    an averaging method ghosts.
    """
    a = check_images(images)
    h, w = check_shape(shape, a.shape[1])
    return np.array([cv2.Laplacian(r.reshape(h, w).astype(np.float64), cv2.CV_64F).var() for r in a])


class KSameEigen(BaseEstimator):
    """k-Same-Eigen: average each cluster's eigenface coefficients and reconstruct.

    Clusters are those of :class:`deid.anonymise.ksame.KSame` (people-counting) on the eigenface
    coefficients; the released face of every member is ``mean_ + c @ components_`` where
    ``c`` is the mean coefficient vector of the cluster, i.e. the pixel average projected
    onto the eigenface subspace. Every member of a cluster gets the identical image.

    Parameters
    ----------
    k : int, default 5
        Minimum number of distinct people per cluster (>= 2).
    n_components : int, default 50
        Eigenfaces fitted on the faces being de-identified.
    random_state : int, default 0
        Seed of the eigenface fit.

    Attributes
    ----------
    eigenfaces_ : deid.alignment.features.Eigenfaces
    labels_ : ndarray of shape (n_faces,)
        Cluster of every face.
    coefficients_ : ndarray of shape (n_clusters, n_components_)
        Mean eigenface coefficients of each cluster.
    averages_ : ndarray of shape (n_clusters, n_pixels)
        Reconstructed face of each cluster (float, before rounding).
    cluster_people_ : list of frozenset

    References
    ----------
    E. Newton, L. Sweeney, B. Malin. Preserving privacy by de-identifying face images.
    IEEE Trans. Knowledge and Data Engineering 17(2):232-243, 2005 (k-Same-Eigen, section 4).
    """

    def __init__(self, k: int = 5, *, n_components: int = 50, random_state: int = 0):
        self.k = k
        self.n_components = n_components
        self.random_state = random_state

    def fit(self, X: Any, *, people: Sequence[Hashable]) -> "KSameEigen":
        """Cluster the faces ``X`` (n_faces, n_pixels) of ``people`` and form each cluster's face."""
        check_k(self.k)
        a = check_images(X)
        self.eigenfaces_ = Eigenfaces(self.n_components, random_state=self.random_state).fit(a)
        Z = self.eigenfaces_.transform(a).astype(np.float64)
        ks = KSame(self.k).fit(Z, people=people, images=Z)
        self.labels_ = ks.labels_
        self.coefficients_ = ks.averages_
        self.cluster_people_ = ks.cluster_people_
        e = self.eigenfaces_
        self.averages_ = e.mean_.astype(np.float64) + self.coefficients_ @ e.components_.astype(np.float64)
        return self

    def fit_transform(self, X: Any, *, people: Sequence[Hashable]) -> np.ndarray:
        """Fit, then return the released faces (uint8): row i is the face of i's cluster."""
        return to_uint8(self.fit(X, people=people).averages_)[self.labels_]


def _flow(flow: str, ref: np.ndarray, img: np.ndarray) -> np.ndarray:
    """Dense flow ``f`` with ``ref(y, x) ~ img(y + f[..., 1], x + f[..., 0])`` (uint8 inputs)."""
    if flow == "dis":
        dis = cv2.DISOpticalFlow_create(cv2.DISOPTICAL_FLOW_PRESET_MEDIUM)
        return dis.calc(ref, img, None)
    # Small windows and 3 levels: faces are ~80 px wide and misalignment is a few pixels.
    return cv2.calcOpticalFlowFarneback(ref, img, None, pyr_scale=0.5, levels=3, winsize=9, iterations=3,
                                        poly_n=5, poly_sigma=1.1, flags=0)


def model_average(faces: np.ndarray, *, flow: str = "farneback", n_iter: int = 2) -> np.ndarray:
    """Average faces (m, h, w) with shape and shape-free appearance averaged separately.

    Each face is registered densely to the current reference (optical flow), warped into the
    reference frame (its shape-free appearance), and the appearances are averaged; the mean
    displacement field is the mean shape, at which the mean appearance is rendered. The
    result is the next reference; the first is the member nearest the pixel mean (ties: the
    first), because flow to a ghosted mean underestimates the displacements.
    """
    faces = faces.astype(np.float32)
    m, h, w = faces.shape
    gx, gy = np.meshgrid(np.arange(w, dtype=np.float32), np.arange(h, dtype=np.float32))
    # Start from the member nearest the pixel mean, not the mean itself: flow to a ghosted
    # mean underestimates the displacements (on shifted textures by ~4x), flow to a sharp
    # member does not. Rendering at the mean shape removes that member's shape.
    pixel_mean = faces.mean(axis=0)
    ref = faces[int(np.argmin(((faces - pixel_mean) ** 2).sum(axis=(1, 2))))]
    src = [to_uint8(f) for f in faces]
    for _ in range(n_iter):
        ref8 = to_uint8(ref)
        appearance = np.zeros((h, w), np.float64)
        shape = np.zeros((h, w, 2), np.float64)
        for f8, f in zip(src, faces):
            d = _flow(flow, ref8, f8)
            appearance += cv2.remap(f, gx + d[..., 0], gy + d[..., 1], cv2.INTER_CUBIC,
                                    borderMode=cv2.BORDER_REPLICATE)
            shape += d
        appearance /= m
        shape /= m
        # Render at the mean shape: the reference point x sits at x + mean_d(x) in the mean
        # shape, so out(y) ~ appearance(y - mean_d(y)) (first-order inverse of a smooth field).
        ref = cv2.remap(appearance.astype(np.float32), gx - shape[..., 0].astype(np.float32),
                        gy - shape[..., 1].astype(np.float32), cv2.INTER_CUBIC, borderMode=cv2.BORDER_REPLICATE)
    return ref.astype(np.float64)


# Landmarks may lie up to this many pixels outside the canonical frame and still shape the mesh;
# the frame's corners and edge midpoints, this far out, are fixed anchors so the mesh covers it.
MESH_MARGIN = 4.0


def landmark_mesh(mean_shape: np.ndarray, keep: np.ndarray, shape: tuple[int, int], *, margin: float = MESH_MARGIN):
    """Delaunay mesh of the kept landmarks of ``mean_shape`` plus 8 fixed frame anchors.

    Returns the scipy Delaunay triangulation of the vertices (kept landmarks first, then the
    anchors) and, for every pixel centre of the (height, width) frame, its triangle and
    barycentric coordinates in that triangle: the piecewise-affine warp from the mean shape to
    any other placement of the same vertices is then a weighted sum of those vertices.
    """
    from scipy.spatial import Delaunay  # noqa: PLC0415 - scipy is sklearn's dependency

    h, w = shape
    lo_x, hi_x, lo_y, hi_y = -margin, w - 1 + margin, -margin, h - 1 + margin
    mx, my = (lo_x + hi_x) / 2, (lo_y + hi_y) / 2
    anchors = np.array([(lo_x, lo_y), (mx, lo_y), (hi_x, lo_y), (hi_x, my), (hi_x, hi_y), (mx, hi_y), (lo_x, hi_y),
                        (lo_x, my)])
    verts = np.vstack([mean_shape[keep], anchors])
    tri = Delaunay(verts)
    gx, gy = np.meshgrid(np.arange(w, dtype=np.float64), np.arange(h, dtype=np.float64))
    pix = np.column_stack([gx.ravel(), gy.ravel()])
    simplex = tri.find_simplex(pix)
    # Every pixel centre lies inside the anchors' rectangle, hence in some triangle.
    simplex = np.where(simplex < 0, 0, simplex)
    t = tri.transform[simplex]
    b2 = np.einsum("nij,nj->ni", t[:, :2], pix - t[:, 2])
    bary = np.column_stack([b2, 1.0 - b2.sum(axis=1)])
    return tri, tri.simplices[simplex], bary, anchors


def landmark_average(faces: np.ndarray, points: np.ndarray, *, margin: float = MESH_MARGIN) -> np.ndarray:
    """Average faces (m, h, w) by their landmarks (m, p, 2): mean shape, shape-free mean appearance.

    The mean shape is the mean of the members' landmarks (canonical pixels: the eye-based
    similarity already removed position, scale and rotation). Each member's appearance is
    warped onto the mean shape by the piecewise-affine warp of a Delaunay mesh of the mean
    shape (the landmarks inside the frame, with ``margin``, for every member, plus 8 fixed
    frame anchors): every pixel of a mean-shape triangle is sampled at the same barycentric
    position of the member's triangle. The mean of the warped appearances, at the mean shape,
    is the cluster's face (Gross et al. 2006, with the AAM's fitted shape replaced by the
    given landmarks and the appearance averaged without a PCA model).
    """
    faces = faces.astype(np.float32)
    m, h, w = faces.shape
    pts = np.asarray(points, dtype=np.float64)
    mean_shape = pts.mean(axis=0)
    inside = ((pts[..., 0] >= -margin) & (pts[..., 0] <= w - 1 + margin) & (pts[..., 1] >= -margin)
              & (pts[..., 1] <= h - 1 + margin)).all(axis=0)
    keep = np.flatnonzero(inside)
    if len(keep) < 3:
        logger.debug("landmark_average: only %d landmarks inside the frame; the mesh is the frame anchors", len(keep))
    _, corners, bary, anchors = landmark_mesh(mean_shape, keep, (h, w), margin=margin)
    total = np.zeros(h * w, np.float64)
    for face, member in zip(faces, pts):
        verts = np.vstack([member[keep], anchors])
        src = np.einsum("nk,nkd->nd", bary, verts[corners])
        mx = src[:, 0].reshape(h, w).astype(np.float32)
        my = src[:, 1].reshape(h, w).astype(np.float32)
        # Cubic, as the flow average: bilinear resampling alone halves a face's Laplacian variance at
        # half-pixel offsets (London: 1279 -> 368; cubic 766).
        total += cv2.remap(face, mx, my, cv2.INTER_CUBIC, borderMode=cv2.BORDER_REPLICATE).ravel()
    return (total / m).reshape(h, w)


def check_points(points: Any, n: int) -> list[np.ndarray | None]:
    """Validate per-face landmarks: None, or a sequence of n entries each None or a finite (p, 2) array (p >= 3)."""
    if points is None:
        return [None] * n
    out = list(points)
    if len(out) != n:
        raise ConfigError(f"points has {len(out)} entries but images has {n} rows; pass one entry (landmarks or "
                          "None) per face")
    for i, p in enumerate(out):
        if p is None:
            continue
        a = np.asarray(p, dtype=np.float64)
        if a.ndim == 1 and a.size % 2 == 0:
            a = a.reshape(-1, 2)
        if a.ndim != 2 or a.shape[1] != 2 or len(a) < 3 or not np.isfinite(a).all():
            raise ConfigError(f"points[{i}] has shape {np.shape(p)}; pass finite (n_points >= 3, 2) landmarks in "
                              "canonical pixels, or None")
        out[i] = a
    return out


def shape_sources(labels: np.ndarray, points: Sequence[Any] | None) -> list[str]:
    """Per cluster 0..max(labels), where :class:`KSameM` takes its shape: ``"points"`` or ``"flow"``.

    Landmarks when every member has some, all of the same number; optical flow otherwise.
    """
    labels = np.asarray(labels)
    pts = check_points(points, len(labels))
    out = []
    for c in range(int(labels.max()) + 1 if len(labels) else 0):
        mp = [pts[i] for i in np.flatnonzero(labels == c)]
        out.append("points" if mp and all(p is not None for p in mp) and len({len(p) for p in mp}) == 1 else "flow")
    return out


class KSameM(BaseEstimator):
    """Model-based k-Same (k-Same-M): average shape and shape-free appearance separately.

    Clusters are those of :class:`deid.anonymise.ksame.KSame` (people-counting) on eigenface
    coefficients. Instead of the pixel mean, which ghosts when members are not perfectly
    aligned, each cluster's face is :func:`model_average` of its members: every member is
    registered by dense optical flow (OpenCV Farneback or DIS) on the canonical faces to a
    reference (first the member nearest the pixel mean, then the previous pass's average),
    the registered appearances are averaged, and the average is rendered at the mean
    displacement (the mean shape); two passes by default. When every member of a cluster has
    landmark ``points`` (the same number each, canonical pixels), shape comes from them
    instead (:func:`landmark_average`: mean shape of the points, each member's appearance
    warped to it piecewise-affinely); other clusters fall back to optical flow. Every member
    of a cluster gets the identical image.

    Parameters
    ----------
    k : int, default 5
        Minimum number of distinct people per cluster (>= 2).
    shape : (int, int)
        (height, width) of the aligned faces.
    n_components : int, default 50
        Eigenfaces used for clustering.
    flow : {"farneback", "dis"}, default "farneback"
        OpenCV dense optical flow used for registration.
    n_iter : int, default 2
        Registration passes (each re-registers to the previous pass's result).
    random_state : int, default 0
        Seed of the eigenface fit.

    Attributes
    ----------
    labels_ : ndarray of shape (n_faces,)
    averages_ : ndarray of shape (n_clusters, n_pixels)
        The face of each cluster (float, before rounding).
    cluster_people_ : list of frozenset
    shape_sources_ : list of str
        ``"points"`` or ``"flow"``: how each cluster's shape was found.

    References
    ----------
    R. Gross, L. Sweeney, F. de la Torre, S. Baker. Model-based face de-identification.
    IEEE CVPR Workshop on Privacy Research in Vision, 2006. R. Gross, L. Sweeney, J. Cohn,
    F. de la Torre, S. Baker. Face de-identification. In Protecting Privacy in Video
    Surveillance, Springer 2009, ch. 8 (k-Same-M, Fig. 5b).
    """

    def __init__(self, k: int = 5, *, shape: tuple[int, int] = (92, 81), n_components: int = 50,
                 flow: str = "farneback", n_iter: int = 2, random_state: int = 0):
        self.k = k
        self.shape = shape
        self.n_components = n_components
        self.flow = flow
        self.n_iter = n_iter
        self.random_state = random_state

    def fit(self, X: Any, *, people: Sequence[Hashable], points: Sequence[Any] | None = None) -> "KSameM":
        """Cluster the faces ``X`` (n_faces, n_pixels) of ``people`` and form each cluster's face.

        ``points``: per face, its landmarks (p, 2) in canonical pixels or None.
        """
        check_k(self.k)
        if self.flow not in FLOWS:
            raise ConfigError(f"flow={self.flow!r} must be one of {list(FLOWS)} (OpenCV dense optical flow)")
        if isinstance(self.n_iter, bool) or not isinstance(self.n_iter, Integral) or not 1 <= self.n_iter <= 10:
            raise ConfigError(f"n_iter={self.n_iter!r} must be an integer in [1, 10] (registration passes); e.g. 2")
        a = check_images(X)
        h, w = check_shape(self.shape, a.shape[1])
        pts = check_points(points, len(a))
        Z = Eigenfaces(self.n_components, random_state=self.random_state).fit_transform(a)
        ks = KSame(self.k).fit(Z, people=people, images=Z[:, :1])  # pixels are averaged below
        self.labels_ = ks.labels_
        self.cluster_people_ = ks.cluster_people_
        faces = a.reshape(len(a), h, w)
        averages = []
        self.shape_sources_ = shape_sources(self.labels_, pts)
        for c, source in enumerate(self.shape_sources_):
            members = np.flatnonzero(self.labels_ == c)
            if source == "points":
                averages.append(landmark_average(faces[members], np.stack([pts[i] for i in members])).ravel())
            else:
                averages.append(model_average(faces[members], flow=self.flow, n_iter=int(self.n_iter)).ravel())
        self.averages_ = np.stack(averages)
        n_points = self.shape_sources_.count("points")
        if any(p is not None for p in pts):
            logger.info("k-same-m: shape from landmarks in %d of %d clusters (the others: optical flow, a member "
                        "without points)", n_points, len(averages))
        return self

    def fit_transform(self, X: Any, *, people: Sequence[Hashable], points: Sequence[Any] | None = None) -> np.ndarray:
        """Fit, then return the released faces (uint8): row i is the face of i's cluster."""
        return to_uint8(self.fit(X, people=people, points=points).averages_)[self.labels_]
