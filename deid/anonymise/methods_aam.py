"""k-Same-M with a fitted shape and appearance model, as the paper's AAM (``k-same-aam``).

Gross, Sweeney, de la Torre and Baker (2006) de-identify faces in the parameter space of an
Active Appearance Model: a linear shape model (PCA of the aligned landmark sets), a linear
appearance model of the faces warped piecewise-affinely to the mean shape (PCA of the shape-free
pixels), and a combined PCA of both parameter vectors; k-Same runs on the combined parameters
and every member of a cluster gets the face rendered from the cluster's mean parameters.
``k-same-m`` (:class:`deid.anonymise.methods_ksame.KSameM`) keeps the paper's separate averaging
of shape and appearance but clusters on pixel eigenfaces and fits no model; this module is the
model, and :class:`KSameAAM` the method that clusters in its parameter space.

Which landmarks. A shape model needs dense correspondences: dlib's 5 points (eye corners and
nose) leave the mouth, jaw and brows unconstrained, and the 68-point predictor's licence excludes
commercial use. The model uses, in this order:

* the drop's own landmarks (the manifest's ``points`` column, :mod:`deid.intake.points`; the London
  set's 189 hand-placed Psychomorph points of its neutral photos), in canonical pixels: the
  eye-based similarity of the alignment stands in for the AAM's Procrustes step, so the shape
  modes also carry what that similarity left (small scale and rotation). Only the landmarks
  inside the frame (with :data:`deid.anonymise.methods_ksame.MESH_MARGIN`) on every face shape
  the mesh; 8 fixed frame anchors make it cover the whole frame;
* where any face lacks them (London's smiling photos), a grid of virtual landmarks about
  ``grid_step`` canonical pixels apart (at least 2 x 2), placed on each face by dense optical flow
  from a reference (the member nearest the pixel mean), as ``k-same-m``'s fallback registers
  faces today.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Hashable, Sequence

import cv2
import numpy as np
from sklearn.base import BaseEstimator

from deid.anonymise.ksame import KSame
from deid.anonymise.methods_ksame import (
    FLOWS,
    MESH_MARGIN,
    _flow,
    check_images,
    check_k,
    check_points,
    check_shape,
    landmark_mesh,
    to_uint8,
)
from deid.errors import ConfigError

logger = logging.getLogger(__name__)

GRID_STEP = 8  # canonical pixels between flow landmarks: 10 x 12 = 120 on the 81 x 92 frame
MAX_FIT_SAMPLES = 2000  # the appearance PCA is fitted on at most this many faces (a seeded subset)
_CHUNK = 1024  # faces warped and projected at a time (bounded memory on large partitions)
# Lanczos, not cubic: a rendered face is resampled twice (to the mean shape, then to its own); on London at
# k=5 cubic left the cluster faces 8% less sharp (variance of the Laplacian 166 vs 181, points partitions).
_INTERPOLATION = cv2.INTER_LANCZOS4


@dataclass(frozen=True)
class LinearModel:
    """A PCA model ``x ~ mean + b @ components`` (orthonormal rows), with each mode's variance."""

    mean: np.ndarray  # (d,)
    components: np.ndarray  # (q, d)
    variances: np.ndarray  # (q,)

    @property
    def n_modes(self) -> int:
        return int(len(self.variances))

    def project(self, X: np.ndarray) -> np.ndarray:
        """Parameters ``b`` (n, q) of rows ``X`` (n, d)."""
        return (np.asarray(X, dtype=np.float64) - self.mean) @ self.components.T

    def reconstruct(self, b: np.ndarray) -> np.ndarray:
        """Rows (n, d) (or one row) from parameters ``b``."""
        return self.mean + np.asarray(b, dtype=np.float64) @ self.components


def fit_pca(X: Any, *, variance: float, max_components: int) -> LinearModel:
    """Exact PCA of the rows of ``X``: the fewest modes that explain ``variance`` of it, at most ``max_components``.

    Modes without variance (below 1e-12 of the data's sum of squares: rounding noise) are never
    kept, so identical rows give a model with no modes whose mean is that row. Exact (an SVD, or
    the eigenvectors of the Gram matrix when rows are fewer than columns), hence deterministic:
    the parrot attacker that re-runs the method on the same faces gets the same model.
    """
    A = np.asarray(X, dtype=np.float64)
    n, d = A.shape
    mean = A.mean(axis=0)
    if n < 2 or d == 0:
        return LinearModel(mean, np.zeros((0, d)), np.zeros(0))
    Xc = A - mean
    # Squared singular values below this are rounding noise (identical rows leave ~1e-28 of them).
    floor = 1e-12 * float((A ** 2).sum()) + 1e-300
    if d > n:
        vals, vecs = np.linalg.eigh(Xc @ Xc.T)
        order = np.argsort(vals)[::-1]
        sq = np.clip(vals[order], 0.0, None)
        ok = sq > floor
        components = (vecs[:, order][:, ok].T @ Xc) / np.sqrt(sq[ok])[:, None]
        sq = sq[ok]
    else:
        _, s, vt = np.linalg.svd(Xc, full_matrices=False)
        sq = s ** 2
        ok = sq > floor
        components, sq = vt[ok], sq[ok]
    var = sq / (n - 1)
    if len(var):
        explained = np.cumsum(var) / var.sum()
        q = min(int(np.searchsorted(explained, variance - 1e-12)) + 1, len(var), int(max_components))
    else:
        q = 0
    return LinearModel(mean, np.ascontiguousarray(components[:q]), var[:q])


class WarpMesh:
    """The piecewise-affine warp onto one placement of the landmarks (a Delaunay mesh plus frame anchors).

    ``sample(image, source)`` is the face whose landmarks sit at ``source`` warped onto the
    mesh's placement: every output pixel takes the image at the same barycentric position of its
    triangle in ``source`` (Lanczos interpolation: bilinear resampling alone halves a face's
    Laplacian variance at half-pixel offsets, see :func:`deid.anonymise.methods_ksame.landmark_average`,
    and a rendered face is resampled twice).
    """

    def __init__(self, target: np.ndarray, frame: tuple[int, int], *, margin: float = MESH_MARGIN):
        target = np.asarray(target, dtype=np.float64)
        self.frame = frame
        _, self.corners, self.bary, self.anchors = landmark_mesh(target, np.arange(len(target)), frame, margin=margin)

    def sample(self, image: np.ndarray, source: np.ndarray) -> np.ndarray:
        h, w = self.frame
        verts = np.vstack([np.asarray(source, dtype=np.float64), self.anchors])
        src = np.einsum("nk,nkd->nd", self.bary, verts[self.corners])
        mx = src[:, 0].reshape(h, w).astype(np.float32)
        my = src[:, 1].reshape(h, w).astype(np.float32)
        img = np.asarray(image, dtype=np.float32).reshape(h, w)
        return cv2.remap(img, mx, my, _INTERPOLATION, borderMode=cv2.BORDER_REPLICATE).astype(np.float64)


@dataclass(frozen=True)
class AppearanceModel:
    """A fitted shape and appearance model (AAM) of aligned faces.

    ``shape`` models the flattened landmark sets (canonical pixels), ``appearance`` the faces
    warped to the mean shape (whole frame, ``frame`` = (height, width)), ``combined`` the
    vectors ``[weight * b_shape, b_appearance]``; ``weight`` is Cootes' ``r`` (the square root
    of total appearance variance over total shape variance), so one pixel of shape counts as
    much as the grey levels it moves.
    """

    frame: tuple[int, int]
    shape: LinearModel
    appearance: LinearModel
    combined: LinearModel
    weight: float
    margin: float = MESH_MARGIN

    @property
    def mean_shape(self) -> np.ndarray:
        """The mean landmark set (p, 2)."""
        return self.shape.mean.reshape(-1, 2)

    def shape_free(self, faces: np.ndarray, shapes: np.ndarray, mesh: WarpMesh | None = None) -> np.ndarray:
        """Each face (n, h * w or h, w) warped from its landmarks ``shapes`` (n, p, 2) to the mean shape (n, h * w)."""
        mesh = mesh or WarpMesh(self.mean_shape, self.frame, margin=self.margin)
        return np.stack([mesh.sample(f, s).ravel() for f, s in zip(faces, shapes)]) if len(faces) else \
            np.zeros((0, self.frame[0] * self.frame[1]))

    def parameters(self, faces: np.ndarray, shapes: np.ndarray) -> np.ndarray:
        """Combined parameters (n, q) of faces with landmarks ``shapes`` (n, p, 2), computed in chunks."""
        mesh = WarpMesh(self.mean_shape, self.frame, margin=self.margin)
        out = np.empty((len(faces), self.combined.n_modes))
        for start in range(0, len(faces), _CHUNK):
            part = slice(start, start + _CHUNK)
            g = self.shape_free(faces[part], shapes[part], mesh)
            bs = self.shape.project(shapes[part].reshape(len(g), -1))
            out[part] = self.combined.project(np.hstack([self.weight * bs, self.appearance.project(g)]))
        return out

    def render(self, c: np.ndarray) -> np.ndarray:
        """The face (h, w) of combined parameters ``c``: its appearance warped from the mean shape to its shape."""
        b = self.combined.reconstruct(np.asarray(c, dtype=np.float64).reshape(-1))
        ns = self.shape.n_modes
        points = self.shape.reconstruct(b[:ns] / self.weight).reshape(-1, 2)
        g = self.appearance.reconstruct(b[ns:])
        return WarpMesh(points, self.frame, margin=self.margin).sample(g, self.mean_shape)


def fit_appearance_model(faces: np.ndarray, shapes: np.ndarray, *, variance: float = 0.98, max_components: int = 50,
                         random_state: int = 0, max_fit_samples: int = MAX_FIT_SAMPLES,
                         margin: float = MESH_MARGIN) -> AppearanceModel:
    """Fit the shape, appearance and combined models of ``faces`` (n, h, w) with landmarks ``shapes`` (n, p, 2).

    Each PCA keeps the fewest modes explaining ``variance`` of its data, at most
    ``max_components``. The appearance model (and the combined one) are fitted on at most
    ``max_fit_samples`` faces, a subset drawn with ``random_state``; below that every face, and
    the fit is exact and deterministic.

    References
    ----------
    T. F. Cootes, G. J. Edwards, C. J. Taylor. Active appearance models. IEEE TPAMI 23(6):681-685,
    2001 (the combined model and its weight). R. Gross, L. Sweeney, F. de la Torre, S. Baker.
    Model-based face de-identification. IEEE CVPR Workshop on Privacy Research in Vision, 2006.
    """
    n, h, w = faces.shape
    S = np.asarray(shapes, dtype=np.float64).reshape(n, -1)
    shape_model = fit_pca(S, variance=variance, max_components=max_components)
    fit_rows = np.arange(n)
    if n > max_fit_samples:
        rng = np.random.default_rng(random_state)
        fit_rows = np.sort(rng.choice(n, max_fit_samples, replace=False))
    mesh = WarpMesh(shape_model.mean.reshape(-1, 2), (h, w), margin=margin)
    G = np.stack([mesh.sample(faces[i], shapes[i]).ravel() for i in fit_rows])
    appearance = fit_pca(G, variance=variance, max_components=max_components)
    total_s, total_g = float(shape_model.variances.sum()), float(appearance.variances.sum())
    weight = float(np.sqrt(total_g / total_s)) if total_s > 0 and total_g > 0 else 1.0
    B = np.hstack([weight * shape_model.project(S[fit_rows]), appearance.project(G)])
    combined = fit_pca(B, variance=variance, max_components=max_components)
    return AppearanceModel((h, w), shape_model, appearance, combined, weight, margin)


def flow_shapes(faces: np.ndarray, *, flow: str = "farneback", n_iter: int = 1, step: int = GRID_STEP,
                margin: float = MESH_MARGIN) -> np.ndarray:
    """Virtual landmarks (n, p, 2) of faces (n, h, w) without given ones: a grid placed by optical flow.

    The grid (cells of about ``step`` pixels, at least 2 x 2, a node at each cell centre) lies on a
    reference face; its points are moved onto every face by the dense flow from the reference to
    that face. The first reference is the member nearest the pixel mean (flow to a ghosted mean
    underestimates the displacements, see :func:`deid.anonymise.methods_ksame.model_average`);
    each further pass re-registers to the mean of the faces warped to the mean placement, at that
    placement.
    """
    n, h, w = faces.shape
    nx, ny = max(2, round(w / step)), max(2, round(h / step))
    gx, gy = np.meshgrid((np.arange(nx) + 0.5) * w / nx, (np.arange(ny) + 0.5) * h / ny)
    ref_pts = np.column_stack([gx.ravel(), gy.ravel()])
    pixel_mean = faces.mean(axis=0, dtype=np.float64)
    nearest = int(np.argmin([((f - pixel_mean) ** 2).sum() for f in faces]))
    ref = faces[nearest].astype(np.float64)
    shapes = np.empty((n, len(ref_pts), 2))
    for it in range(n_iter):
        ref8 = to_uint8(ref)
        mx = ref_pts[:, 0].astype(np.float32).reshape(1, -1)
        my = ref_pts[:, 1].astype(np.float32).reshape(1, -1)
        for i, f in enumerate(faces):
            d = _flow(flow, ref8, to_uint8(f))
            shapes[i] = ref_pts + cv2.remap(d, mx, my, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)[0]
        if it + 1 == n_iter:
            break
        mean_pts = shapes.mean(axis=0)
        mesh = WarpMesh(mean_pts, (h, w), margin=margin)
        total = np.zeros((h, w))
        for f, s in zip(faces, shapes):
            total += mesh.sample(f, s)
        ref, ref_pts = total / n, mean_pts
    return shapes


def given_shapes(points: Sequence[Any] | None, frame: Sequence[int]) -> np.ndarray | None:
    """The landmark sets (n, p, 2) :class:`KSameAAM` fits its shape model to, or None: it places a grid by flow.

    The given ``points`` (one entry per face, None or (p, 2) in canonical pixels) when every face
    has some, all of the same number, keeping the landmarks inside the (height, width) ``frame``
    (with :data:`deid.anonymise.methods_ksame.MESH_MARGIN`) on every face, at least 3 of them.
    """
    pts = check_points(points, len(points)) if points is not None else []
    if not pts or any(p is None for p in pts) or len({len(p) for p in pts if p is not None}) != 1:
        if any(p is not None for p in pts):
            logger.info("k-same-aam: %d of %d faces have landmark points (all need the same number); placing a "
                        "grid by optical flow on every face", sum(p is not None for p in pts), len(pts))
        return None
    given = np.stack([p for p in pts if p is not None])
    h, w, m = frame[0], frame[1], MESH_MARGIN
    inside = ((given[..., 0] >= -m) & (given[..., 0] <= w - 1 + m) & (given[..., 1] >= -m)
              & (given[..., 1] <= h - 1 + m)).all(axis=0)
    if inside.sum() < 3:
        logger.info("k-same-aam: only %d landmarks inside the frame on every face; placing a grid by flow",
                    int(inside.sum()))
        return None
    return given[:, inside]


class KSameAAM(BaseEstimator):
    """k-Same-M on a fitted shape and appearance model (AAM): cluster in parameter space, render the mean.

    The faces' landmarks (the given ``points`` when every face has them, else a flow-placed grid,
    see the module's notes) and the faces themselves fit an :class:`AppearanceModel`
    (:func:`fit_appearance_model`); every face gets its combined parameters, clusters are those
    of :class:`deid.anonymise.ksame.KSame` on them (people-counting: >= k distinct people per
    cluster, no person above 1/k of one), and every member of a cluster gets the identical face
    rendered from the cluster's mean parameters (mean shape of the model's shape modes,
    appearance on the model's appearance modes, warped to that shape).

    Parameters
    ----------
    k : int, default 5
        Minimum number of distinct people per cluster (>= 2).
    shape : (int, int)
        (height, width) of the aligned faces.
    n_components : int, default 50
        At most this many modes in each of the shape, appearance and combined models.
    variance : float, default 0.98
        Fraction of the variance each model keeps (the fewest modes that explain it).
    flow : {"farneback", "dis"}, default "farneback"
        OpenCV dense optical flow that places the grid landmarks of faces without points.
    n_iter : int, default 1
        Registration passes of the flow landmarks: the first to the member nearest the pixel mean,
        each further one to the model's mean face, which over a whole partition is ghosted (flow to a
        ghosted face underestimates displacements: on London's smiling faces 2 passes left the cluster
        faces less sharp than 1, 121 vs 125).
    grid_step : int, default 8
        Canonical pixels between the flow landmarks (about; at least 2 x 2 of them per frame).
    random_state : int, default 0
        Seed of the appearance model's fit subset (only above 2,000 faces).

    Attributes
    ----------
    model_ : AppearanceModel
    parameters_ : ndarray of shape (n_faces, n_modes)
        Combined parameters of every face.
    labels_ : ndarray of shape (n_faces,)
    cluster_people_ : list of frozenset
    cluster_parameters_ : ndarray of shape (n_clusters, n_modes)
        Mean combined parameters of each cluster.
    averages_ : ndarray of shape (n_clusters, n_pixels)
        The rendered face of each cluster (float, before rounding).
    shape_source_ : str
        ``"points"`` (the given landmarks) or ``"flow"`` (the flow-placed grid).

    References
    ----------
    R. Gross, L. Sweeney, F. de la Torre, S. Baker. Model-based face de-identification. IEEE CVPR
    Workshop on Privacy Research in Vision, 2006 (k-Same-M on AAM parameters). T. F. Cootes,
    G. J. Edwards, C. J. Taylor. Active appearance models. IEEE TPAMI 23(6):681-685, 2001.
    """

    def __init__(self, k: int = 5, *, shape: tuple[int, int] = (92, 81), n_components: int = 50,
                 variance: float = 0.98, flow: str = "farneback", n_iter: int = 1, grid_step: int = GRID_STEP,
                 random_state: int = 0):
        self.k = k
        self.shape = shape
        self.n_components = n_components
        self.variance = variance
        self.flow = flow
        self.n_iter = n_iter
        self.grid_step = grid_step
        self.random_state = random_state

    def _check(self) -> None:
        check_k(self.k)
        if self.flow not in FLOWS:
            raise ConfigError(f"flow={self.flow!r} must be one of {list(FLOWS)} (OpenCV dense optical flow)")
        if isinstance(self.n_iter, bool) or not isinstance(self.n_iter, Integral) or not 1 <= self.n_iter <= 10:
            raise ConfigError(f"n_iter={self.n_iter!r} must be an integer in [1, 10] (registration passes); e.g. 1")
        if isinstance(self.variance, bool) or not isinstance(self.variance, Real) or not 0 < self.variance <= 1:
            raise ConfigError(f"variance={self.variance!r} must be a fraction in (0, 1] (variance each model keeps); "
                              "e.g. 0.98")
        if isinstance(self.n_components, bool) or not isinstance(self.n_components, Integral) or self.n_components < 1:
            raise ConfigError(f"n_components={self.n_components!r} must be an integer >= 1 (modes per model); e.g. 50")
        step = self.grid_step
        if isinstance(step, bool) or not isinstance(step, Integral) or not 2 <= step <= 64:
            raise ConfigError(f"grid_step={self.grid_step!r} must be an integer in [2, 64] (canonical pixels between "
                              "flow landmarks; a frame gets at least 2 x 2 of them); e.g. 8")

    def _shapes(self, faces: np.ndarray, pts: list[np.ndarray | None]) -> tuple[np.ndarray, str]:
        given = given_shapes(pts, faces.shape[1:])
        if given is not None:
            return given, "points"
        return flow_shapes(faces, flow=self.flow, n_iter=int(self.n_iter), step=int(self.grid_step)), "flow"

    def fit(self, X: Any, *, people: Sequence[Hashable], points: Sequence[Any] | None = None) -> "KSameAAM":
        """Fit the model on the faces ``X`` (n_faces, n_pixels) of ``people``, cluster and render.

        ``points``: per face, its landmarks (p, 2) in canonical pixels or None.
        """
        a = check_images(X)
        h, w = check_shape(self.shape, a.shape[1])
        self._check()
        pts = check_points(points, len(a))
        faces = a.reshape(len(a), h, w)
        shapes, self.shape_source_ = self._shapes(faces, pts)
        self.model_ = fit_appearance_model(faces, shapes, variance=float(self.variance),
                                           max_components=int(self.n_components), random_state=self.random_state)
        self.parameters_ = self.model_.parameters(faces, shapes)
        # KSame needs a feature column; a model without modes (identical faces) has none: all at distance 0.
        Z = self.parameters_ if self.parameters_.shape[1] else np.zeros((len(a), 1))
        ks = KSame(self.k).fit(Z, people=people, images=None)
        self.labels_ = ks.labels_
        self.cluster_people_ = ks.cluster_people_
        n_clusters = int(self.labels_.max()) + 1
        self.cluster_parameters_ = np.stack([self.parameters_[self.labels_ == c].mean(axis=0)
                                             for c in range(n_clusters)])
        self.averages_ = np.stack([self.model_.render(c).ravel() for c in self.cluster_parameters_])
        m = self.model_
        logger.info("k-same-aam: %d faces, shape from %s (%d landmarks), %d shape / %d appearance / %d combined "
                    "modes, %d clusters", len(a), self.shape_source_, shapes.shape[1], m.shape.n_modes,
                    m.appearance.n_modes, m.combined.n_modes, n_clusters)
        return self

    def fit_transform(self, X: Any, *, people: Sequence[Hashable], points: Sequence[Any] | None = None) -> np.ndarray:
        """Fit, then return the released faces (uint8): row i is the face of i's cluster."""
        return to_uint8(self.fit(X, people=people, points=points).averages_)[self.labels_]
