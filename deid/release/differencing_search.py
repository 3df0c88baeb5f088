"""The differencing attack's search: which pairs of averages to test, and which originals a difference is.

An exact difference of two released averages (``s1 M1 - s2 M2``) is one face or one swapped pair of
faces. The attack projects originals and averages on eigenfaces (:func:`eigenfaces`; Turk & Pentland
1991), chooses the pairs of averages to test (:func:`average_pairs`: all, or nearest neighbours in PCA
space plus :func:`structural_pairs` sharing a record or a person; :func:`content_pairs`: bases that differ
by at most a few contents, :func:`content_ids`), makes their size hypotheses (:func:`size_tests`) and
finds each difference's best single original or pair (:func:`best_pairs`, or among its clusters' members:
:class:`MemberGallery`). Averages and whitened projections are read a part at a time
(:class:`Averages`, :class:`Whitened`).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Sequence

import numpy as np

from deid.release.hashing import image_digest
from deid.release.lineage_state import LineageCluster, stored_rows


class Averages:
    """The released averages of a list of clusters as rows: ``A[idx]`` reads just those rows
    (:func:`deid.release.lineage.stored_rows`), never the whole matrix."""

    def __init__(self, images: Sequence[Any]):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, idx) -> np.ndarray:
        return stored_rows(self.images, idx)


def size_tests(pairs_i: np.ndarray, pairs_j: np.ndarray, sizes1: Sequence[Sequence[int]],
           sizes2: Sequence[Sequence[int]]) -> np.ndarray:
    """(i, j, s1, s2) of every size hypothesis with ``|s1 - s2| <= 1``, pair by pair, ``s1`` then ``s2`` ascending.

    One int64 array (a million faces make millions of tests: Python tuples would cost gigabytes).
    """
    def table(sizes: Sequence[Sequence[int]]) -> np.ndarray:
        out = np.zeros((len(sizes), max(1, max(map(len, sizes)))), dtype=np.int64)
        for n, s in enumerate(sizes):
            out[n, :len(s)] = s
        return out

    S1, S2 = table(sizes1), table(sizes2)
    parts = []
    for a in range(S1.shape[1]):
        for b in range(S2.shape[1]):
            s1, s2 = S1[pairs_i, a], S2[pairs_j, b]
            p = np.flatnonzero((s1 > 0) & (s2 > 0) & (np.abs(s1 - s2) <= 1))
            parts.append(np.stack([p, np.full(len(p), a), np.full(len(p), b), pairs_i[p], pairs_j[p], s1[p], s2[p]],
                                  axis=1))
    t = np.concatenate(parts) if parts else np.zeros((0, 7), dtype=np.int64)
    t = t[np.lexsort((t[:, 2], t[:, 1], t[:, 0]))]
    return np.ascontiguousarray(t[:, 3:], dtype=np.int64)


def content_ids(X: Any, records: Sequence[str], clusters: Sequence[LineageCluster],
                 chunk: int = 4096) -> dict[str, str]:
    """Member fingerprint -> content id: ``"px:"`` and the digest of its original's values when the gallery holds it.

    Only the rows of the ``clusters``' members are read (ascending, a chunk at a time). Two records
    with the same pixels (a copy under another fingerprint) get the same id; a fingerprint the
    gallery lacks is its own content (:func:`content_pairs` maps it to itself).
    """
    members = set().union(*(c.records for c in clusters)) if clusters else set()
    row_of: dict[str, int] = {}
    for r, f in enumerate(records):
        if f in members:
            row_of.setdefault(f, r)
    rows = np.array(sorted(set(row_of.values())), dtype=np.int64)
    digest: dict[int, str] = {}
    for a in range(0, len(rows), chunk):
        part = rows[a:a + chunk]
        block = np.ascontiguousarray(np.asarray(X[part]))
        for r, row in zip(part.tolist(), block):
            digest[r] = "px:" + image_digest(row).hex()
    return {f: digest[r] for f, r in row_of.items()}


def content_pairs(new: Sequence[LineageCluster], reg: Sequence[LineageCluster], content: dict[str, str],
                   max_diff: int) -> tuple[np.ndarray, np.ndarray]:
    """(i, j) of every ``new[i]`` and ``reg[j]`` whose basis content multisets differ by at most ``max_diff`` records.

    An inverted index from content to the registered clusters holding it: a pair is looked at only
    if it shares a content (or both clusters are so small that, disjoint, they still differ by at
    most ``max_diff``). ``|A ^ B| = |A| + |B| - 2 |A & B|`` on multisets of contents.
    """
    def bag(c: LineageCluster) -> Counter:
        return Counter(content.get(f, "fp:" + f) for f in c.records)

    index: dict[str, list[tuple[int, int]]] = defaultdict(list)
    size2 = np.array([len(c.records) for c in reg], dtype=np.int64)
    for j, c in enumerate(reg):
        for cid, m in bag(c).items():
            index[cid].append((j, m))
    small2 = np.flatnonzero(size2 < max_diff)   # disjoint pairs of tiny clusters can differ by few records too
    out_i: list[int] = []
    out_j: list[int] = []
    for i, c in enumerate(new):
        overlap: dict[int, int] = defaultdict(int)
        for cid, n in bag(c).items():
            for j, m in index.get(cid, ()):
                overlap[j] += min(n, m)
        n1 = len(c.records)
        js = {j for j, ov in overlap.items() if n1 + int(size2[j]) - 2 * ov <= max_diff}
        if n1 < max_diff:
            js.update(int(j) for j in small2 if n1 + int(size2[j]) <= max_diff)
        out_i.extend([i] * len(js))
        out_j.extend(sorted(js))
    return np.asarray(out_i, dtype=np.int64), np.asarray(out_j, dtype=np.int64)


def structural_pairs(new: Sequence[LineageCluster], reg: Sequence[LineageCluster],
                      max_person_clusters: int) -> tuple[np.ndarray, np.ndarray]:
    """(i, j) of every released cluster ``new[i]`` and registered ``reg[j]`` sharing a basis record or a person.

    A person in more than ``max_person_clusters`` registered clusters adds no pairs this way (one
    person's many photos would make the pairs quadratic in their number); shared records still do.
    """
    by_record: dict[str, list[int]] = defaultdict(list)
    by_person: dict[str, list[int]] = defaultdict(list)
    for j, c in enumerate(reg):
        for f, p in c.members:
            by_record[f].append(j)
            by_person[p].append(j)
    out_i: list[int] = []
    out_j: list[int] = []
    for i, c in enumerate(new):
        js: set[int] = set()
        for f, p in c.members:
            js.update(by_record.get(f, ()))
            near = by_person.get(p, ())
            if len(near) <= max_person_clusters:
                js.update(near)
        out_i.extend([i] * len(js))
        out_j.extend(sorted(js))
    return np.asarray(out_i, dtype=np.int64), np.asarray(out_j, dtype=np.int64)


class MemberGallery:
    """Candidate originals of each test: the present members of its two clusters (see :func:`differencing_attack`).

    Clusters with members absent from the gallery also get, through a k-d tree over the centred PCA
    projections, the nearest originals within the radius an exact difference lies at.
    """

    def __init__(self, records: Sequence[str], new: Sequence[LineageCluster], reg: Sequence[LineageCluster],
                 Zc: np.ndarray, Zw: np.ndarray, muz: np.ndarray, sd: np.ndarray, candidates: int,
                 radius_per_size: float):
        row_of: dict[str, int] = {}
        for r, f in enumerate(records):
            row_of.setdefault(f, r)   # byte-identical photos listed twice: one record, the same pixels
        cache: dict[str, tuple[tuple[int, ...], bool]] = {}

        def members(c: LineageCluster) -> tuple[tuple[int, ...], bool]:
            if c.key not in cache:
                rows = [row_of[f] for f in c.records if f in row_of]
                cache[c.key] = (tuple(sorted(set(rows))), len(rows) == len(c.records))
            return cache[c.key]

        m1, m2 = [members(c) for c in new], [members(c) for c in reg]
        self.rows1, self.full1 = [m for m, _ in m1], np.array([f for _, f in m1], dtype=bool)
        self.rows2, self.full2 = [m for m, _ in m2], np.array([f for _, f in m2], dtype=bool)
        self.Zc, self.Zw, self.muz, self.sd, self.candidates = Zc, Zw, muz, sd, candidates
        self.radius_per_size = float(radius_per_size)
        self.tree: Any = None
        if not (self.full1.all() and self.full2.all()):
            from scipy.spatial import cKDTree  # noqa: PLC0415 - only lineages with absent members need it

            self.tree = cKDTree(Zc)

    def _near(self, Q: np.ndarray, radius: float) -> np.ndarray:
        """Nearest original to each query within ``radius`` (-1: none)."""
        _, idx = self.tree.query(np.asarray(Q, dtype=np.float64), k=1, distance_upper_bound=radius)
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        return np.where(idx < self.Zc.shape[0], idx, -1)

    def best(self, Dz: np.ndarray, i: np.ndarray, j: np.ndarray, single: np.ndarray, smax: np.ndarray) -> np.ndarray:
        """(a, b) of each test's best candidate (b = -1 for a single face, a = -1 when there is none)."""
        n = len(Dz)
        cand = [set(self.rows1[x]) | set(self.rows2[y]) for x, y in zip(i.tolist(), j.tolist())]
        partial = np.flatnonzero(~(self.full1[i] & self.full2[j]))
        full_search = []
        if len(partial):
            radius = self.radius_per_size * float(smax[partial].max())
            s_rows = partial[single[partial]]
            if len(s_rows):   # a single face: around the difference itself
                for t, g in zip(s_rows.tolist(), self._near(Dz[s_rows] - self.muz, radius).tolist()):
                    if g >= 0:
                        cand[t].add(g)
            owner, queries = [], []
            for t in partial[~single[partial]].tolist():
                if not cand[t]:
                    full_search.append(t)
                    continue
                for g in cand[t]:   # the other face of the pair: b = a - d, or a = b + d
                    owner += [t, t]
                    queries += [self.Zc[g] - Dz[t], self.Zc[g] + Dz[t]]
            if queries:
                for t, g in zip(owner, self._near(np.stack(queries), radius).tolist()):
                    if g >= 0:
                        cand[t].add(g)
        width = max(1, max(map(len, cand)))
        C = np.full((n, width), -1, dtype=np.int64)
        for t, c in enumerate(cand):
            C[t, :len(c)] = sorted(c)
        best = np.full((n, 2), -1, dtype=np.int64)
        s = np.flatnonzero(single)
        if len(s):
            R = self.Zc[np.maximum(C[s], 0)] - (Dz[s] - self.muz)[:, None, :]
            d = np.where(C[s] >= 0, np.einsum("bmq,bmq->bm", R, R), np.inf)
            k = np.argmin(d, axis=1)
            best[s, 0] = np.where(np.isfinite(d[np.arange(len(s)), k]), C[s, k], -1)
        p = np.flatnonzero(~single)
        if len(p):
            best[p] = _best_pairs_among(Dz[p] / self.sd, self.Zw, C[p], self.candidates, self.sd)
        if full_search:
            fs = np.asarray(full_search, dtype=np.int64)
            best[fs] = best_pairs(Dz[fs] / self.sd, self.Zw, self.candidates, self.sd)
        return best


def eigenfaces(X: np.ndarray, n_components: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Eigenfaces of the originals (Turk & Pentland 1991): components, mean, per-component std.

    Through the small Gram matrix when there are at most a few thousand faces, else randomized SVD
    (``X`` is then overwritten: pass a copy).
    """
    n, p = X.shape
    q = max(1, min(n_components, n - 1, p))
    mu = X.mean(axis=0)
    Xc = X - mu if n <= 3000 else np.subtract(X, mu, out=X)  # a large sample is centred in place (issue 13)
    if n <= 3000:
        vals, vecs = np.linalg.eigh(Xc @ Xc.T)
        order = np.argsort(vals)[::-1][:q]
        vals, vecs = np.maximum(vals[order], 1e-6), vecs[:, order]
        W = (Xc.T @ vecs / np.sqrt(vals)).T
    else:
        from sklearn.decomposition import PCA  # noqa: PLC0415 - only large galleries need it

        # copy=False: the sample is not copied again (20,000 faces are 600 MB of float32).
        W = PCA(q, svd_solver="randomized", random_state=0, copy=False).fit(Xc).components_
        vals = ((Xc @ W.T) ** 2).sum(axis=0)
    sd = np.sqrt(np.maximum(vals, 1e-6) / n).astype(np.float32)
    return W.astype(np.float32), mu.astype(np.float32), sd


def average_pairs(Y1: np.ndarray, Y2: np.ndarray, all_pairs: bool, neighbors: int, *,
           structural: tuple[np.ndarray, np.ndarray] | None = None, brute_max: float = 4e8,
           threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Cluster pairs to test: all of them, or each released average's nearest registered ones and ``structural``.

    Exact nearest neighbours by blocks while ``len(Y1) * len(Y2) <= brute_max``; above that a k-d
    tree's (1 + eps)-approximate ones, eps = 1 (O(N log N), see :func:`differencing_attack`).
    """
    if all_pairs:
        i, j = np.meshgrid(np.arange(len(Y1)), np.arange(len(Y2)), indexing="ij")
        return i.ravel(), j.ravel()
    m = min(neighbors, len(Y2))
    out_i, out_j = [], []
    if len(Y1) * len(Y2) <= brute_max:
        y2sq = np.einsum("ij,ij->i", Y2, Y2)
        for start in range(0, len(Y1), 1024):
            d = y2sq[None, :] - 2.0 * Y1[start:start + 1024] @ Y2.T
            nn = np.argpartition(d, m - 1, axis=1)[:, :m]
            out_i.append(np.repeat(np.arange(start, start + len(d)), m))
            out_j.append(nn.ravel())
    else:
        from scipy.spatial import cKDTree  # noqa: PLC0415 - only large releases need it

        _, nn = cKDTree(Y2).query(Y1, k=m, eps=1.0, workers=max(1, threads))
        nn = np.asarray(nn, dtype=np.int64).reshape(len(Y1), m)
        out_i.append(np.repeat(np.arange(len(Y1)), m))
        out_j.append(nn.ravel())
    if structural is not None:
        out_i.append(structural[0])
        out_j.append(structural[1])
    i, j = np.concatenate(out_i), np.concatenate(out_j)
    code = np.unique(i * len(Y2) + j)   # each pair once, by released then registered average
    return code // len(Y2), code % len(Y2)


class Whitened:
    """``Z / sd`` computed for the rows asked for: the same float32 values as the whole quotient's rows, without
    holding it (a million originals' projections are 200 MB; issue 13). ``np.asarray`` gives the whole."""

    def __init__(self, Z: np.ndarray, sd: np.ndarray):
        self.Z, self.sd = Z, sd

    @property
    def shape(self) -> tuple[int, ...]:
        return self.Z.shape

    def __getitem__(self, idx) -> np.ndarray:
        return self.Z[idx] / self.sd

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.Z / self.sd
        return out if dtype is None else out.astype(dtype, copy=False)


EXHAUSTIVE_PAIRS_MAX = 64
"""Up to this many originals, :func:`best_pairs` compares every pair (n^2 per difference) instead of preselecting
``candidates`` on each side: cheap there, and where the preselection is weakest (few originals, little structure
for the alignment to rank by)."""


def best_pairs(Dw: np.ndarray, Zw: np.ndarray, candidates: int, sd: np.ndarray | None = None) -> np.ndarray:
    """For each whitened difference D, the pair (a, b), a != b, of originals with Z_a - Z_b nearest to D.

    For the true pair, ``Z_a . D = Z_a . (Z_a - Z_b)`` is about ``|Z_a|^2``, far above the other
    originals in whitened space (where every component has unit variance), and ``Z_b . D`` far
    below; so ``a`` is searched among the ``candidates`` originals most aligned with D, ``b`` among
    the ``candidates`` least aligned, all combinations compared exactly. O(n q) per difference.
    With ``sd`` (the whitening scale) the combinations are compared unwhitened, as the pixel check
    that follows measures them: whitening multiplies the rounding error of the averages in the
    low-variance components, where a wrong pair can then come out nearest (seen on 36-pixel random
    faces at k=2, tests/unit/release/test_lineage_differencing_scale.py).

    Up to :data:`EXHAUSTIVE_PAIRS_MAX` originals every pair is compared: the preselection missed the true
    pair of a swap among 37 random 36-pixel faces (its ``a`` not among the 16 most aligned), which every
    pair finds (hypothesis, the content-index property of the same tests).
    """
    Zw = np.asarray(Zw)   # every original is scored: the whole matrix, for this call only
    if Zw.shape[0] <= max(candidates, EXHAUSTIVE_PAIRS_MAX):
        return _all_pairs(Dw, Zw, sd)
    t = min(candidates, Zw.shape[0])
    u = Dw @ Zw.T                                                  # (B, n)
    A = np.argpartition(-u, t - 1, axis=1)[:, :t]                  # (B, t)
    C = np.argpartition(u, t - 1, axis=1)[:, :t]                   # (B, t)
    R = Zw[A][:, :, None, :] - Zw[C][:, None, :, :] - Dw[:, None, None, :]   # (B, t, t, q)
    if sd is not None:
        R = R * sd
    d = np.einsum("btcq,btcq->btc", R, R)
    d[A[:, :, None] == C[:, None, :]] = np.inf                     # a != b
    flat = np.argmin(d.reshape(len(Dw), -1), axis=1)
    ia, ic = np.divmod(flat, t)
    rows = np.arange(len(Dw))
    return np.stack([A[rows, ia], C[rows, ic]], axis=1)


def _all_pairs(Dw: np.ndarray, Zw: np.ndarray, sd: np.ndarray | None, chunk: int = 256) -> np.ndarray:
    """:func:`best_pairs` over every pair (a, b), a != b: ``|W_a - W_b - E|^2 = |G_a|^2 + |W_b|^2 - 2 G_a . W_b``
    with ``G_a = W_a - E`` (W, E: Z and D unwhitened by ``sd`` when given), a (chunk, n, n) block at a time.
    (-1, -1) when there are fewer than two originals."""
    n = Zw.shape[0]
    out = np.full((len(Dw), 2), -1, dtype=np.int64)
    if n < 2:
        return out
    W = Zw * sd if sd is not None else Zw
    E = Dw * sd if sd is not None else Dw
    ww = np.einsum("nq,nq->n", W, W)
    diag = np.eye(n, dtype=bool)
    for s in range(0, len(E), chunk):
        G = W[None, :, :] - E[s:s + chunk, None, :]                           # (b, n, q): row a, G_a
        d = np.einsum("bnq,bnq->bn", G, G)[:, :, None] + ww[None, None, :] - 2.0 * (G @ W.T)   # (b, a, b')
        d[:, diag] = np.inf                                                  # a != b
        ia, ib = np.divmod(np.argmin(d.reshape(len(d), -1), axis=1), n)
        out[s:s + chunk] = np.stack([ia, ib], axis=1)
    return out


def _best_pairs_among(Dw: np.ndarray, Zw: np.ndarray, cand: np.ndarray, candidates: int,
                      sd: np.ndarray | None = None) -> np.ndarray:
    """:func:`best_pairs` with each difference's originals limited to its row of ``cand`` (-1: padding).

    (-1, -1) where no two distinct candidates exist.
    """
    B, m = cand.shape
    valid = cand >= 0
    Zs = Zw[np.maximum(cand, 0)]                                   # (B, m, q)
    u = np.einsum("bmq,bq->bm", Zs, Dw)
    t = min(candidates, m)
    A = np.argpartition(-np.where(valid, u, -np.inf), t - 1, axis=1)[:, :t]
    C = np.argpartition(np.where(valid, u, np.inf), t - 1, axis=1)[:, :t]
    rows = np.arange(B)[:, None]
    R = Zs[rows, A][:, :, None, :] - Zs[rows, C][:, None, :, :] - Dw[:, None, None, :]
    if sd is not None:
        R = R * sd
    d = np.einsum("btcq,btcq->btc", R, R)
    ga, gc = cand[rows, A], cand[rows, C]
    bad = (ga[:, :, None] == gc[:, None, :]) | (ga[:, :, None] < 0) | (gc[:, None, :] < 0)
    d[bad] = np.inf
    flat = np.argmin(d.reshape(B, -1), axis=1)
    ia, ic = np.divmod(flat, t)
    r = np.arange(B)
    out = np.stack([ga[r, ia], gc[r, ic]], axis=1)
    out[~np.isfinite(d.reshape(B, -1)[r, flat])] = -1
    return out
