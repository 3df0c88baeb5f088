"""The differencing attack against the releases of a dataset published on disk.

:func:`published_differencing_attack` differences this release's averages against every published
release the registry does not remember (made on a registry restored from an earlier copy, or deleted),
with only what a published release shows: each cluster's image and how many records carry it. A
difference is matched to the drop's originals, or is a face image on its own
(:class:`PublishedDifferencingResult`; the search: :mod:`deid.release.differencing_search`).
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from deid.errors import ConfigError
from deid.release.differencing_search import Averages, average_pairs, best_pairs, eigenfaces, size_tests
from deid.release.lineage_checks import LineageCheck
from deid.release.lineage_differencing import DifferencingMatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishedDifferencingResult:
    """Outcome of :func:`published_differencing_attack`; the gate fails on any match.

    ``matches`` holds gallery matches (``kind`` single/pair, the originals found) and differences that
    are a face image on their own (``kind="image"``: a plausible image at the rounding's precision, whoever
    it shows, e.g. a person who left the drop and has no original here).
    """

    releases: tuple[str, ...]
    n_cluster_pairs: int
    n_tests: int
    matches: tuple[DifferencingMatch, ...]
    people_identified: frozenset
    tolerance: float
    skipped: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.matches

    def to_check(self) -> LineageCheck:
        images = sum(1 for m in self.matches if m.kind == "image")
        detail = (f"{len(self.releases)} published releases of the dataset that the registry does not remember "
                  f"differenced against this release: {self.n_cluster_pairs} pairs of averages, {self.n_tests} size "
                  f"hypotheses (the sizes each release shows); {len(self.matches) - images} differences matched an "
                  f"original face or pair (mean abs error < {self.tolerance:.4g} grey level at the averages' scale), "
                  f"{images} are a face image on their own (every pixel within the averages' rounding of 0..255); "
                  f"{len(self.people_identified)} people identified")
        if self.skipped:
            detail += f"; {len(self.skipped)} releases not comparable (another image size) were not differenced"
        return LineageCheck("lineage_published_differencing", self.passed, len(self.people_identified) + images, 0,
                            detail, tuple(vars(m) for m in self.matches))


def published_differencing_attack(current_keys: Sequence[str], current_images: Sequence[Any],
                                  current_sizes: Sequence[Sequence[int]], published: Sequence[Any],
                                  originals: Any | None = None, *, original_people: Sequence[Hashable] | None = None,
                                  tolerance: float = 1.0, n_components: int = 50, max_pairs: int = 200_000,
                                  neighbors: int = 10, candidates: int = 16, block: int = 512,
                                  pca_sample: int = 20_000) -> PublishedDifferencingResult:
    """Difference this release's averages against every release of the dataset published on disk.

    The attacker of :func:`differencing_attack` (Ganta, Kasiviswanathan & Smith, KDD 2008), with
    only what a published release shows: each cluster id's image and how many records carry it. A
    release the registry does not remember (made on a registry restored from an earlier copy, or
    deleted) is attacked here. For a current average ``M1`` (sizes ``s1``: its basis and released
    sizes) and a published one ``M2`` (``s2``: its released size) with ``|s1 - s2| <= 1`` and
    different images, the difference ``D = +-(s1 M1 - s2 M2)`` is:

    - matched to the ``originals`` (the drop's aligned faces) as in :func:`differencing_attack`
      (exhaustive search: nearest original for a single face, the most and least aligned
      originals in whitened PCA space for a pair ``a - b``), verified in pixels: a match when the
      mean absolute error over ``max(s1, s2)`` is below ``tolerance`` grey levels;
    - and, for ``|s1 - s2| = 1``, tested as an image on its own: one face plus the rounding of two
      uint8 averages lies within ``[-(s1 + s2) / 2, 255 + (s1 + s2) / 2]`` at every pixel, while the
      difference of two unrelated averages is ``M1 + s2 (M1 - M2)``, far outside at many pixels
      (per-pixel spread about ``sqrt(2 s) x`` a face's). This finds a person who left the drop,
      whose original is not in the gallery (the issue's 6 m2 - 5 m3).

    Parameters
    ----------
    current_keys, current_images, current_sizes
        This release's clusters: key, average (flattened grey row, or a stored image), plausible sizes.
    published : sequence of :class:`deid.release.lineage_anchor.PublishedAverages`
        The published releases to attack (read from disk).
    originals : array-like (n, n_pixels), or a row source, optional
        The drop's aligned faces (the gallery); None: only the image test runs.
    original_people : sequence, optional
        Person of each original, to count the people identified.
    tolerance : float
        The match bound, in grey levels at the averages' scale.
    n_components, pca_sample : int
        Eigenfaces of the gallery (else of the published averages), fitted on at most ``pca_sample`` rows.
    max_pairs, neighbors, candidates, block : int
        Pairs of averages: all while ``n_current * n_published <= max_pairs``, else each current average's
        ``neighbors`` nearest published ones in PCA space (a leaking pair's averages differ by one face over
        ``s``: near neighbours); the originals tried per pair difference (:func:`best_pairs`); size hypotheses
        tested at a time.

    Returns
    -------
    PublishedDifferencingResult
    """
    if not tolerance > 0:
        raise ConfigError(f"tolerance={tolerance!r} must be > 0 grey levels, e.g. 1.0")
    releases = tuple(p.release_id for p in published)
    n1 = len(current_keys)
    if not n1 or not published:
        return PublishedDifferencingResult(releases, 0, 0, (), frozenset(), tolerance)
    M1 = Averages(list(current_images))
    p_dim = int(np.asarray(M1[np.arange(1)]).shape[1])
    X = _usable_gallery(originals, original_people, p_dim)
    comparable = [p for p in published if p.images.shape[1] == p_dim and len(p.images)]
    skipped = tuple(p.release_id for p in published if p not in comparable)
    if not comparable:
        return PublishedDifferencingResult(releases, 0, 0, (), frozenset(), tolerance, skipped)
    g = _Gallery.fit(X, comparable, n_components=n_components, pca_sample=pca_sample)
    Y1, h1 = _projected(M1, g, n1)
    matches: list[DifferencingMatch] = []
    n_pairs = n_tests = 0
    for pub in comparable:
        pi, pj = _pairs_to_test(Y1, h1, pub, g, all_pairs=n1 * len(pub.images) <= max_pairs, neighbors=neighbors)
        tests = size_tests(pi, pj, current_sizes, [[s] for s in pub.sizes])
        n_pairs, n_tests = n_pairs + len(pi), n_tests + len(tests)
        for start in range(0, len(tests), block):
            matches += _attack_block(tests[start:start + block], M1, pub, g, current_keys, candidates=candidates,
                                     tolerance=tolerance)
    people = frozenset((original_people[i] if original_people is not None else i)
                       for m in matches for i in m.originals)
    if matches:
        logger.warning("lineage differencing attack against published releases: %d matches, %d people identified",
                       len(matches), len(people))
    return PublishedDifferencingResult(releases, n_pairs, n_tests, tuple(matches), people, tolerance, skipped)


def _usable_gallery(originals: Any | None, original_people: Sequence[Hashable] | None, p_dim: int) -> Any | None:
    """The originals as the attack's gallery (a row source kept as it is, else float32), or None when they are not
    usable (absent, fewer than two, or not ``p_dim`` pixels wide): then only the image test runs.

    Raises
    ------
    ConfigError
        ``original_people`` not one entry per original of a usable gallery.
    """
    X = originals if originals is None or hasattr(originals, "shape") else np.asarray(originals, np.float32)
    if X is not None and (len(X.shape) != 2 or X.shape[0] < 2 or X.shape[1] != p_dim):
        X = None   # no usable gallery: the image test only
    if original_people is not None and X is not None and len(original_people) != X.shape[0]:
        raise ConfigError(f"original_people has {len(original_people)} entries for {X.shape[0]} originals")
    return X


def _projected(M1: Averages, g: "_Gallery", n1: int) -> tuple[np.ndarray, list[str]]:
    """This release's ``n1`` averages in the eigenfaces of ``g`` (read 4,096 rows at a time), and each one's SHA-256
    (of its uint8 pixels)."""
    Y1 = np.vstack([np.asarray(M1[np.arange(a, min(a + 4096, n1))], np.float32) @ g.Wz.T
                    for a in range(0, n1, 4096)])
    h1 = [hashlib.sha256(np.ascontiguousarray(np.asarray(M1[np.arange(i, i + 1)], np.uint8)).tobytes()).hexdigest()
          for i in range(n1)]
    return Y1, h1


def _pairs_to_test(Y1: np.ndarray, h1: Sequence[str], pub: Any, g: "_Gallery", *, all_pairs: bool,
                   neighbors: int) -> tuple[np.ndarray, np.ndarray]:
    """The pairs (current average, published average) to difference against one published release ``pub``.

    All pairs, or each current average's ``neighbors`` nearest published ones in the eigenfaces of ``g``
    (:func:`average_pairs`); pairs of byte-identical images (``h1``: the current ones' SHA-256) are left out,
    their difference being a multiple of the image.

    Returns
    -------
    pi, pj : ndarray of int
        Rows of the current and the published averages.
    """
    M2 = pub.images
    Y2 = M2.astype(np.float32) @ g.Wz.T
    h2 = [hashlib.sha256(np.ascontiguousarray(r).tobytes()).hexdigest() for r in M2]
    pi, pj = average_pairs(Y1, Y2, all_pairs, neighbors)
    keep = np.array([h1[a] != h2[b] for a, b in zip(pi.tolist(), pj.tolist())], dtype=bool)
    return pi[keep], pj[keep]


@dataclass(frozen=True)
class _Gallery:
    """Eigenfaces (Turk & Pentland 1991) of the gallery, else of the published averages themselves (``Wz``, ``mu``,
    ``sd``), and the gallery ``X`` in them (None: no gallery, the image test only)."""

    X: Any
    Wz: np.ndarray
    mu: np.ndarray
    sd: np.ndarray
    Zc: Any   # None without a gallery, as Zw and csq
    Zw: Any
    csq: Any
    muz: np.ndarray

    @classmethod
    def fit(cls, X: Any, comparable: Sequence[Any], *, n_components: int, pca_sample: int) -> "_Gallery":
        basis = (X if X is not None else np.vstack([p.images for p in comparable]))
        n_fit = basis.shape[0]
        fit = (np.arange(n_fit) if n_fit <= pca_sample
               else np.sort(np.random.default_rng(0).choice(n_fit, pca_sample, replace=False)))
        Wz, mu, sd = eigenfaces(np.asarray(basis[fit], dtype=np.float32), n_components)
        Zc = Zw = csq = None
        if X is not None:
            Zc = np.vstack([(np.asarray(X[np.arange(a, min(a + 4096, X.shape[0]))], np.float32) - mu) @ Wz.T
                            for a in range(0, X.shape[0], 4096)])
            Zw, csq = Zc / sd, np.einsum("ij,ij->i", Zc, Zc)
        return cls(X, Wz, mu, sd, Zc, Zw, csq, mu @ Wz.T)


def _attack_block(t: np.ndarray, M1: Averages, pub: Any, g: _Gallery, current_keys: Sequence[str], *,
                  candidates: int, tolerance: float) -> list[DifferencingMatch]:
    """The matches of one block of size hypotheses ``t`` (rows ``i, j, s1, s2``) against published release ``pub``:
    differences matched to the gallery (verified in pixels), and single-face differences that are an image alone."""
    i, j, s1, s2 = t.T
    sign = np.where(s1 >= s2, 1.0, -1.0).astype(np.float32)[:, None]
    D = sign * (s1[:, None] * np.asarray(M1[i], np.float32) - s2[:, None] * pub.images[j].astype(np.float32))
    single = s1 != s2
    smax = np.maximum(s1, s2)
    found = np.zeros(len(i), dtype=bool)
    matches: list[DifferencingMatch] = []

    def where(n: int) -> str:
        return f"{pub.release_id}/{pub.cluster_ids[n]}"

    X = g.X
    if X is not None:
        Dz = D @ g.Wz.T
        best = np.full((len(i), 2), -1, dtype=np.int64)
        if single.any():
            best[single, 0] = np.argmin(g.csq[None, :] - 2.0 * (Dz[single] - g.muz) @ g.Zc.T, axis=1)
        if (~single).any():
            best[~single] = best_pairs(Dz[~single] / g.sd, g.Zw, candidates, g.sd)
        a, b = best[:, 0], best[:, 1]
        target = (np.asarray(X[a], np.float32)
                  - np.where(b[:, None] >= 0, np.asarray(X[np.maximum(b, 0)], np.float32), 0.0))
        mae = np.abs(D - target).mean(axis=1) / smax
        for hit in np.flatnonzero(mae < tolerance):
            found[hit] = True
            origs = (int(a[hit]),) if b[hit] < 0 else (int(a[hit]), int(b[hit]))
            matches.append(DifferencingMatch(current_keys[int(i[hit])], where(int(j[hit])),
                                             (int(s1[hit]), int(s2[hit])), "single" if b[hit] < 0 else "pair",
                                             origs, round(float(mae[hit]), 4)))
    r = (0.5 * (s1 + s2)).astype(np.float32) + 1e-3
    image = single & ~found & (D.min(axis=1) >= -r) & (D.max(axis=1) <= 255.0 + r)
    for hit in np.flatnonzero(image):
        # No original to compare with (e.g. a person who left): mae 0.0, the image is the finding.
        matches.append(DifferencingMatch(current_keys[int(i[hit])], where(int(j[hit])),
                                         (int(s1[hit]), int(s2[hit])), "image", (), 0.0))
    return matches
