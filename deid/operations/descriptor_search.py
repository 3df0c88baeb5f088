"""Nearest registered face descriptor of each probe, sub-linear in the number registered (an inverted file).

:class:`DescriptorSearch` is how the person index (:mod:`deid.operations.person_index`) searches a drop's
faces among the descriptors every released face run registered: exact below a size, else an IVF over a
coarse k-means quantiser (Sivic & Zisserman 2003; Jegou, Douze & Schmid 2011).
"""
from __future__ import annotations

import numpy as np

from deid.errors import ConfigError


class DescriptorSearch:
    """Nearest registered face descriptor of each probe, sub-linear in the number registered.

    An inverted file (IVF; Sivic & Zisserman, ICCV 2003; Jegou, Douze & Schmid, TPAMI 2011): the
    registered descriptors are split by a coarse k-means quantiser into about ``sqrt(n)`` lists; a
    probe is compared with the list centroids and then, exactly, with the members of its
    ``nprobe`` nearest lists: ``O(sqrt(n) + nprobe * sqrt(n))`` distances per probe instead of
    ``n``. Below ``exact_below`` descriptors every probe is compared with all of them.

    A probe's true nearest neighbour can sit in a list that is not probed (a miss, never a false
    match): the bench reports the recall against the exact search.

    Parameters
    ----------
    vectors : ndarray (n, d)
        The registered descriptors.
    nprobe : int
        Lists searched per probe.
    seed : int
        Of the quantiser's k-means (the same index for the same descriptors; not a secret).
    """

    def __init__(self, vectors: np.ndarray, *, nprobe: int = 16, exact_below: int = 20_000, seed: int = 0,
                 iterations: int = 8, train_sample: int = 65_536):
        X = np.ascontiguousarray(vectors, dtype=np.float32)
        if X.ndim != 2:
            raise ConfigError(f"vectors has shape {X.shape}; pass an (n, d) array of face descriptors")
        self.X, self.nprobe = X, max(1, int(nprobe))
        self.n, self.d = X.shape
        self.sq = np.einsum("ij,ij->i", X, X)
        self.lists: list[np.ndarray] | None = None
        n = len(X)
        if n < exact_below:
            return
        n_lists = int(min(4096, max(16, round(np.sqrt(n)))))
        rng = np.random.default_rng(seed)
        # 32 training points per list (faiss's guideline is 30-256): the quantiser only has to split the space.
        train = X[np.sort(rng.choice(n, min(n, train_sample, 32 * n_lists), replace=False))]
        C = train[rng.choice(len(train), n_lists, replace=False)].copy()
        for _ in range(iterations):  # Lloyd's k-means on the sample; empty lists keep their centroid
            a = self._nearest(train, C)
            order = np.argsort(a, kind="stable")
            counts = np.bincount(a, minlength=n_lists)
            full = np.flatnonzero(counts)
            sums = np.add.reduceat(train[order], np.concatenate([[0], np.cumsum(counts)[:-1]])[full], axis=0)
            C[full] = sums / counts[full, None]
        self.C = C
        assign = np.concatenate([self._nearest(X[a:a + 65_536], C) for a in range(0, n, 65_536)])
        order = np.argsort(assign, kind="stable")
        bounds = np.searchsorted(assign[order], np.arange(n_lists + 1))
        self.lists = [order[bounds[i]:bounds[i + 1]] for i in range(n_lists)]
        # The descriptors stored list by list: a probe reads its lists as contiguous slices (no gather). The
        # inverted file reads only these: the input order's copy is let go (one copy of 1M descriptors, not two).
        self._order, self._bounds = order, bounds
        self._Xs, self._sqs = X[order], self.sq[order]
        self.X, self.sq = np.zeros((0, self.d), np.float32), np.zeros(0, np.float32)  # not views: X is freed

    def vectors(self) -> np.ndarray:
        """The indexed descriptors in their input order (a copy when the inverted file holds them list by list)."""
        if self.lists is None:
            return self.X
        out = np.empty_like(self._Xs)
        out[self._order] = self._Xs
        return out

    @staticmethod
    def _nearest(X: np.ndarray, C: np.ndarray) -> np.ndarray:
        return np.argmin(np.einsum("ij,ij->i", C, C)[None, :] - 2.0 * X @ C.T, axis=1)

    def search(self, probes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index of the nearest registered descriptor, its Euclidean distance) of each probe."""
        Q = np.ascontiguousarray(probes, dtype=np.float32).reshape(-1, self.d)
        idx = np.full(len(Q), -1, np.int64)
        dist = np.full(len(Q), np.inf)
        if not self.n:
            return idx, dist
        if self.lists is None:
            for a in range(0, len(Q), 256):
                q = Q[a:a + 256]
                d2 = self.sq[None, :] - 2.0 * q @ self.X.T + np.einsum("ij,ij->i", q, q)[:, None]
                j = np.argmin(d2, axis=1)
                idx[a:a + 256], dist[a:a + 256] = j, np.sqrt(np.maximum(d2[np.arange(len(q)), j], 0))
            return idx, dist
        dc = np.einsum("ij,ij->i", self.C, self.C)[None, :] - 2.0 * Q @ self.C.T
        near = np.argsort(dc, axis=1)[:, :self.nprobe]
        b = self._bounds
        for i, q in enumerate(Q):
            best, at = np.inf, -1
            for c in near[i].tolist():
                lo, hi = int(b[c]), int(b[c + 1])
                if hi == lo:
                    continue
                d2 = self._sqs[lo:hi] - 2.0 * (self._Xs[lo:hi] @ q)
                j = int(np.argmin(d2))
                if d2[j] < best:
                    best, at = float(d2[j]), lo + j
            if at >= 0:
                idx[i], dist[i] = self._order[at], float(np.sqrt(max(best + float(q @ q), 0.0)))
        return idx, dist

    def within(self, probes: np.ndarray, radius: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every registered descriptor within ``radius`` of each probe: (probe, registered index, distance) arrays.

        The inverted file looks in the probe's ``nprobe`` nearest lists, as :meth:`search` does (a
        pair in a list not searched is missed, never invented).
        """
        Q = np.ascontiguousarray(probes, dtype=np.float32).reshape(-1, self.d)
        r2 = float(radius) ** 2
        ps: list[np.ndarray] = []
        js: list[np.ndarray] = []
        ds: list[np.ndarray] = []
        if self.n and len(Q) and self.lists is None:
            for a in range(0, len(Q), 256):
                q = Q[a:a + 256]
                d2 = self.sq[None, :] - 2.0 * q @ self.X.T + np.einsum("ij,ij->i", q, q)[:, None]
                i, j = np.nonzero(d2 < r2)
                ps.append(i + a)
                js.append(j)
                ds.append(np.sqrt(np.maximum(d2[i, j], 0)))
        elif self.n and len(Q):
            near = np.argsort(np.einsum("ij,ij->i", self.C, self.C)[None, :] - 2.0 * Q @ self.C.T, axis=1)
            b = self._bounds
            for p, q in enumerate(Q):
                qq = float(q @ q)
                for c in near[p, :self.nprobe].tolist():
                    lo, hi = int(b[c]), int(b[c + 1])
                    d2 = self._sqs[lo:hi] - 2.0 * (self._Xs[lo:hi] @ q) + qq
                    j = np.flatnonzero(d2 < r2)
                    if len(j):
                        ps.append(np.full(len(j), p))
                        js.append(self._order[lo + j])
                        ds.append(np.sqrt(np.maximum(d2[j], 0)))
        if not ps:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
        return (np.concatenate(ps).astype(np.int64), np.concatenate(js).astype(np.int64),
                np.concatenate(ds).astype(np.float64))
