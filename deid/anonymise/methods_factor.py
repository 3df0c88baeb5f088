"""Multi-factor de-identification: k-Same on the identity factor, each image keeps its own expression."""
from __future__ import annotations

import logging
from numbers import Integral
from typing import Any, Hashable, Mapping, Sequence

import numpy as np
from sklearn.base import BaseEstimator

from deid.errors import ConfigError
from deid.alignment.features import Eigenfaces
from deid.anonymise.ksame import InsufficientPeopleError, KSame, KSameSelect, _factorize
from deid.anonymise.methods_ksame import check_images, check_k, to_uint8

logger = logging.getLogger(__name__)

NON_IDENTITY = ("labels", "projected", "residual", "frames", "grouped", "label-groups")


def check_labels(labels: Mapping[str, Sequence[Hashable]] | None, n: int) -> dict[str, np.ndarray]:
    """Validate ``{label name: one value per face}``; returns integer codes per label."""
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise ConfigError(f"labels={type(labels).__name__} must be a mapping {{label name: one value per face}}, "
                          "e.g. {'expression': [...]}")
    return {str(name): _factorize(values, f"labels[{name!r}]", n)[0] for name, values in labels.items()}


def group_means(Z: np.ndarray, codes: np.ndarray, n_groups: int) -> np.ndarray:
    """Mean row of ``Z`` per code 0..n_groups-1 (zero for an empty group)."""
    sums = np.zeros((n_groups, Z.shape[1]))
    np.add.at(sums, codes, Z)
    counts = np.bincount(codes, minlength=n_groups)
    return sums / np.maximum(counts, 1)[:, None]


def group_within_clusters(V: np.ndarray, person_codes: np.ndarray, clusters: np.ndarray) -> np.ndarray:
    """Group the faces of each identity cluster so that every group holds faces of *all* its people.

    Within a cluster, the person with the fewest faces seeds one group per face; every other
    person's faces are matched to the groups (optimal assignment on the Euclidean distance
    between ``V`` rows and the groups' running means, each group taking at most
    ``ceil(m_p / n_groups)`` faces of person p). With equal face counts every group holds one
    face of each member, so a group shared by all of the cluster's people is what any face of
    the cluster, or any sequence of them, can be traced back to.

    Returns the global group index of every face (dense, clusters in order).
    """
    from scipy.optimize import linear_sum_assignment  # noqa: PLC0415

    groups = np.empty(len(V), dtype=np.intp)
    offset = 0
    for c in np.unique(clusters):
        idx = np.flatnonzero(clusters == c)
        who, counts = np.unique(person_codes[idx], return_counts=True)
        order = np.argsort(counts, kind="stable")
        seed = idx[person_codes[idx] == who[order[0]]]
        n_groups = len(seed)
        sums, sizes = V[seed].astype(np.float64).copy(), np.ones(n_groups)
        groups[seed] = offset + np.arange(n_groups)
        for j in order[1:]:
            mine = idx[person_codes[idx] == who[j]]
            slots = int(np.ceil(len(mine) / n_groups))
            centres = np.repeat(sums / sizes[:, None], slots, axis=0)
            cost = ((V[mine, None, :] - centres[None, :, :]) ** 2).sum(axis=2)
            rows, cols = linear_sum_assignment(cost)
            g = cols // slots
            groups[mine[rows]] = offset + g
            np.add.at(sums, g, V[mine[rows]])
            np.add.at(sizes, g, 1)
        offset += n_groups
    return groups


def label_groups(V: np.ndarray, person_codes: np.ndarray, cells: np.ndarray, k: int | None = None) -> np.ndarray:
    """Groups of frames, one per frame of a cell's least-filmed person, each holding frames of *every* person.

    Within each cell (identity cluster x expression label, :func:`release_cells`) the person
    with the fewest frames seeds one group per frame. Every other person, fewest frames first,
    gives each group exactly one frame (optimal assignment on the Euclidean distance between
    ``V`` rows, the frames' expression factors, and the groups' running means: the group takes
    the frame nearest in expression space), and then any frames left over go to the nearest
    groups, at most ``ceil(m_p / n_groups) - 1`` more per group. So every group holds at least
    one frame of each of the cell's people (>= k distinct people when the cell does), unlike
    :func:`group_within_clusters`, whose capped assignment may leave a group without some person.
    With equal frame counts per person and cell, every group holds one frame of each person
    (share 1/people <= 1/k). Extra frames (unequal counts: a video's quarantined frames) raise
    their person's share; with ``k`` given, a group in which a person then holds more than 1/k
    of the frames joins the group of its cell nearest in expression space (smallest first),
    until none does or the cell is one group (whose shares are then the cell's, left to the
    gate's ``max_person_share`` check as :func:`release_cells` leaves them).

    Returns the global group index of every frame (dense, cells in order).
    """
    from scipy.optimize import linear_sum_assignment  # noqa: PLC0415

    V = np.asarray(V, dtype=np.float64)
    groups = np.empty(len(V), dtype=np.intp)
    offset = 0
    for c in np.unique(cells):
        idx = np.flatnonzero(cells == c)
        who, counts = np.unique(person_codes[idx], return_counts=True)
        order = np.argsort(counts, kind="stable")
        seed = idx[person_codes[idx] == who[order[0]]]
        n_groups = len(seed)
        sums, sizes = V[seed].copy(), np.ones(n_groups)
        groups[seed] = offset + np.arange(n_groups)
        for j in order[1:]:
            mine = idx[person_codes[idx] == who[j]]
            cost = ((V[mine, None, :] - (sums / sizes[:, None])[None, :, :]) ** 2).sum(axis=2)
            rows, cols = linear_sum_assignment(cost)  # one frame per group (len(mine) >= n_groups)
            groups[mine[rows]] = offset + cols
            rest = np.setdiff1d(np.arange(len(mine)), rows)
            if len(rest):
                slots = int(np.ceil(len(mine) / n_groups)) - 1
                centres = np.repeat(sums / sizes[:, None], slots, axis=0)
                r2, c2 = linear_sum_assignment(((V[mine[rest], None, :] - centres[None, :, :]) ** 2).sum(axis=2))
                groups[mine[rest[r2]]] = offset + c2 // slots
            np.add.at(sums, groups[mine] - offset, V[mine])
            np.add.at(sizes, groups[mine] - offset, 1)
        if k is not None:
            groups[idx] = offset + _join_heavy_groups(V[idx], person_codes[idx], groups[idx] - offset, int(k))
            n_groups = int(groups[idx].max()) - offset + 1
        offset += n_groups
    return groups


def _join_heavy_groups(V: np.ndarray, people: np.ndarray, groups: np.ndarray, k: int) -> np.ndarray:
    """Join each group with a person above 1/k of its frames to its nearest group; returns dense group ids."""
    groups = groups.copy()
    while True:
        live = np.unique(groups)
        heavy = [g for g in live if not _share_fits(people[groups == g], k)]
        if not heavy or len(live) == 1:
            break
        g = min(heavy, key=lambda h: (int((groups == h).sum()), int(h)))
        mean = V[groups == g].mean(axis=0)
        target = min((o for o in live if o != g),
                     key=lambda o: (float(((V[groups == o].mean(axis=0) - mean) ** 2).sum()), int(o)))
        groups[groups == g] = target
    return np.unique(groups, return_inverse=True)[1].ravel().astype(np.intp)


def _share_fits(person_codes: np.ndarray, k: int) -> bool:
    """No person holds more than 1/k of the faces."""
    counts = np.unique(person_codes, return_counts=True)[1]
    return int(counts.max()) * k <= len(person_codes)


def _cell_fits(person_codes: np.ndarray, k: int) -> bool:
    """>= k distinct people, none holding more than 1/k of the faces."""
    counts = np.unique(person_codes, return_counts=True)[1]
    return len(counts) >= k and int(counts.max()) * k <= len(person_codes)


def merge_clusters_for_cells(person_clusters: np.ndarray, averages: np.ndarray, identity: np.ndarray,
                             person_cell: Sequence[Hashable], person_codes: np.ndarray,
                             label_codes: Sequence[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Join identity clusters until each of their label cells holds >= k people, none above 1/k.

    A person lacking one expression (or photographed twice with one) leaves a cell of their
    identity cluster short of k people or with one person above 1/k. Joining that cluster with
    the nearest cluster (Euclidean distance between mean identities) of the same identity-label
    cell (``person_cell``, e.g. gender) gives every cell more people while every face keeps its
    labels' image; smallest offending clusters first. A cluster with no partner left is kept
    as it is (:func:`release_cells` then merges its cells).

    Returns every person's cluster (dense) and each cluster's mean identity (a joined cluster's
    is the mean of all its people's identities; the others' are ``averages`` unchanged).
    """
    clusters = np.asarray(person_clusters).copy()
    faces = np.asarray(person_codes)
    labels = np.stack([np.asarray(c) for c in label_codes], axis=1)
    members = {int(c): list(np.flatnonzero(clusters[faces] == c)) for c in np.unique(clusters)}
    cell_of = {int(c): person_cell[int(np.flatnonzero(clusters == c)[0])] for c in members}

    def fits(c: int) -> bool:
        idx = np.asarray(members[c])
        keys = np.unique(labels[idx], axis=0, return_inverse=True)[1].ravel()
        return all(_cell_fits(faces[idx[keys == g]], k) for g in np.unique(keys))

    means = {c: identity[clusters == c].mean(axis=0) for c in members}
    stuck: set[int] = set()
    joined: set[int] = set()
    while True:
        bad = [c for c in members if c not in stuck and not fits(c)]
        if not bad:
            break
        c = min(bad, key=lambda b: (len(np.unique(faces[members[b]])), b))
        partners = [o for o in members if o != c and cell_of[o] == cell_of[c]]
        if not partners:
            stuck.add(c)
            continue
        target = min(partners, key=lambda o: (float(((means[o] - means[c]) ** 2).sum()), o))
        clusters[clusters == c] = target
        members[target] += members.pop(c)
        means.pop(c)
        means[target] = identity[clusters == target].mean(axis=0)
        joined.add(target)
        joined.discard(c)
        stuck.discard(target)
    keys, dense = np.unique(clusters, return_inverse=True)
    out = np.asarray(averages, dtype=np.float64)[keys].copy()
    for j, c in enumerate(keys):
        if int(c) in joined:
            out[j] = means[int(c)]
    if joined:
        logger.info("multi-factor: %d identity clusters joined others so that every label cell holds >= %d "
                    "people (none above 1/k)", len(np.unique(person_clusters)) - len(keys), k)
    return dense.astype(np.intp), out


def release_cells(clusters: np.ndarray, person_codes: np.ndarray, label_codes: Sequence[np.ndarray], k: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The cells of a ``"labels"`` release: identity cluster x label values, merged until each holds k people.

    With ``non_identity="labels"`` every face of one identity cluster with the same label values
    gets the identical image, so those cells are what the release really holds: a cell of >= k
    distinct people in which no person has more than 1/k of the faces bounds any recogniser at
    1/k. A cell that still misses that after :func:`merge_clusters_for_cells` (a person lacking one expression, a rare label, a person with
    two photos of one expression) is merged, within its identity cluster, into the cell sharing
    the most label values (ties: the most people, then the most faces; as
    :func:`deid.anonymise.partition.plan_partitions` merges small label partitions), and the
    merged cell's faces get one image (the mean of their non-identity factors). The last resort
    is the whole identity cluster, which people-aware k-Same made of >= k distinct people; one
    person's share above 1/k there (unequal photo counts) is left for the gate to reject.

    Returns the cell of every face (dense, numbered in order of first appearance) and a mask of
    the faces whose cell was merged.
    """
    codes = np.asarray(person_codes)
    cells: dict[int, dict[tuple, list[int]]] = {}
    for i, key in enumerate(zip(np.asarray(clusters).tolist(), *(np.asarray(c).tolist() for c in label_codes))):
        cells.setdefault(key[0], {}).setdefault(tuple(key[1:]), []).append(i)

    def people(idx: list[int]) -> int:
        return len(np.unique(codes[idx]))

    def fits(idx: list[int]) -> bool:
        counts = np.unique(codes[idx], return_counts=True)[1]
        return len(counts) >= k and int(counts.max()) * k <= len(idx)

    cell_of: dict[int, tuple] = {}
    merged = np.zeros(len(codes), dtype=bool)
    for c, groups in cells.items():
        groups = {lab: list(idx) for lab, idx in sorted(groups.items())}
        while len(groups) > 1:
            bad = [lab for lab, idx in groups.items() if not fits(idx)]
            if not bad:
                break
            lab = min(bad, key=lambda g: (people(groups[g]), len(groups[g]), g))
            idx = groups.pop(lab)
            target = max(groups, key=lambda g: (sum(x == y for x, y in zip(g, lab)), people(groups[g]),
                                                len(groups[g])))
            groups[target] += idx
            merged[groups[target]] = True
        for lab, idx in groups.items():
            for i in idx:
                cell_of[i] = (c, lab)
    index: dict[tuple, int] = {}
    return np.array([index.setdefault(cell_of[i], len(index)) for i in range(len(codes))], dtype=np.intp), merged


def _span(effects: dict[str, np.ndarray]) -> np.ndarray:
    """Orthogonal projector onto the span of the label-effect vectors."""
    rows = np.vstack(list(effects.values()))
    u, sv, vt = np.linalg.svd(rows, full_matrices=False)
    basis = vt[sv > 1e-9 * max(sv.max(initial=0.0), 1.0)]
    return basis.T @ basis


class MultiFactor(BaseEstimator):
    """Multi-factor de-identification in eigenface space.

    Each face's eigenface coefficients are modelled additively as an identity factor (one
    vector per person) plus non-identity effects (one vector per value of each label that
    varies within people, e.g. expression) plus the face's own residual::

        z_i = a[person_i] + sum_l b_l[label_l,i] + e_i

    fitted by least squares (backfitting, label effects centred), so the labels constrain
    the split: a person photographed only smiling does not get a smiling identity. Labels
    constant within every person (e.g. gender) are attributes of identity and are left in
    ``a`` (and kept by clustering within their cells, ``select_identity``). Without labels the model reduces to person means and per-face deviations.

    The identity vectors of the people are de-identified with people-aware k-Same
    (:class:`deid.anonymise.ksame.KSame`, one row per person: clusters of >= k distinct people), and
    face ``i`` is reconstructed from its cluster's mean identity plus its *own* non-identity
    factor, one of:

    * ``"labels"`` (default): its label effects ``sum_l b_l``: faces of one cluster with
      the same labels get the identical image, and ``labels_`` are those cells, so the gate
      finds the k-Same structure and its exact 1/k bound in the data. Where a cell would hold
      fewer than k people or a person above 1/k (someone lacking one expression), its identity
      cluster first joins the nearest one (:func:`merge_clusters_for_cells`: every face keeps
      its expression), then cells still short are merged (:func:`release_cells`). London k=5: max re-identification 0.186 (naive + reverse, five attackers; 0.186
      with parrot too in the release flow), within 1/k;
    * ``"projected"``: inside the subspace spanned by the label effects the face keeps its
      own coefficients (e.g. how much this very face smiles, frame by frame), elsewhere it
      gets the cluster's identity. London k=5: 0.196 (n=204 faces: at the 0.2 bound; 0.206
      without the gender cells of ``select_identity``);
    * ``"residual"``: the whole deviation ``z_i - a[person_i]``. London k=5: 0.92 (with two
      photos per person the deviations are +-half their difference: an identity signature);
    * ``"frames"``: its label effects plus its own residual ``e_i`` inside the label-effect
      subspace: how much this frame smiles or opens its mouth beyond its label's average,
      relative to its *own* person (unlike "projected", no part of the person's identity rides
      along in that subspace). For image sequences (:mod:`deid.anonymise.sequences`). That
      residual is a fingerprint of the very frame: an attacker holding the source frames who
      re-runs the method matches every released frame to its source (parrot attack, synthetic
      sequences k=3: 1.0);
    * ``"grouped"``: as "frames", then k-Same on that factor within each identity cluster
      (:func:`group_within_clusters`): each face gets the mean non-identity factor of a group
      holding faces of every person of its cluster, so the members of a group receive the
      identical image and ``labels_`` are the groups (>= k distinct people each; with equal
      face counts per person no person above 1/k of a group): the k-Same structure again.
    * ``"label-groups"`` (method ``multi-factor-expression``): per-frame expression with
      privacy. Each face's "frames" factor (its label effects plus its own residual) is
      replaced by the mean over a group of faces of >= k distinct people with the same
      expression labels, in the same identity cluster, matched nearest in expression space
      (:func:`label_groups`, within the cells of the "labels" mode, merged as there where a cell
      lacks k people): how far this frame's mouth is open survives as the mean of k such frames,
      and no released residual belongs to one person. A group's faces get the identical image
      (its cluster's identity plus the group's mean factor), ``labels_`` are the groups: the
      k-Same structure, so the gate finds the exact bound in the data (groups *across* identity
      clusters would give each face a unique (identity cluster, group) pair, which the parrot
      attacker re-running the method matches to one person).

    In the other modes the faces of one cluster do not share an identical image, so no formal
    k-Same guarantee holds: the empirical attacks decide.

    Parameters
    ----------
    k : int, default 5
        Minimum number of distinct people per identity cluster (>= 2).
    n_components : int, default 50
        Eigenfaces of the linear model.
    non_identity : {"labels", "projected", "residual", "frames", "grouped", "label-groups"}, default "labels"
        Without labels that vary within people, "projected" and "labels" keep nothing (the
        release is k-Same-Eigen of the person means) and "residual" the person deviation.
    select_identity : bool, default True
        Cluster the identities within each cell of the labels that are constant within
        people (e.g. gender: k-Same-Select on the identity factor only, a few cells instead of
        one per label combination), so the release keeps them; falls back to one cell, with a
        warning, when a cell holds fewer than k people.
    n_iter : int, default 50
        Maximum backfitting sweeps (stops earlier when the fit no longer changes).
    random_state : int, default 0
        Seed of the eigenface fit.

    Attributes
    ----------
    eigenfaces_ : deid.alignment.features.Eigenfaces
    people_ : list
        Person ids in first-appearance order (rows of ``identity_``).
    identity_ : ndarray of shape (n_people, n_components_)
        Fitted identity factor per person.
    effects_ : dict of str to ndarray
        Fitted effect per value (code order) of each non-identity label.
    non_identity_labels_ : list of str
        The labels that vary within people (used as non-identity factors).
    identity_labels_ : list of str
        The person-constant labels whose cells the identity clusters respect.
    non_identity_ : ndarray of shape (n_faces, n_components_)
        The non-identity factor each face keeps.
    person_clusters_ : ndarray of shape (n_people,)
        k-Same cluster of each person.
    labels_ : ndarray of shape (n_faces,)
        Cluster of every face: with ``"labels"`` (and labels that vary within people) its
        cell, whose faces all get the identical image; with ``"grouped"`` or ``"label-groups"`` its group; otherwise
        its person's identity cluster (``person_clusters_``).

    References
    ----------
    R. Gross, L. Sweeney, J. Cohn, F. de la Torre, S. Baker. Face de-identification. In
    Protecting Privacy in Video Surveillance, Springer 2009, ch. 8 (multi-factor models).
    R. Gross, L. Sweeney, F. de la Torre, S. Baker. Semi-supervised learning of multi-factor
    models for face de-identification. IEEE CVPR 2008.
    """

    def __init__(self, k: int = 5, *, n_components: int = 50, non_identity: str = "labels",
                 select_identity: bool = True, n_iter: int = 50, random_state: int = 0):
        self.k = k
        self.select_identity = select_identity
        self.n_components = n_components
        self.non_identity = non_identity
        self.n_iter = n_iter
        self.random_state = random_state

    def fit(self, X: Any, *, people: Sequence[Hashable],
            labels: Mapping[str, Sequence[Hashable]] | None = None) -> "MultiFactor":
        """Fit the factor model on faces ``X`` (n_faces, n_pixels) and de-identify the identities."""
        check_k(self.k)
        if self.non_identity not in NON_IDENTITY:
            raise ConfigError(f"non_identity={self.non_identity!r} must be one of {list(NON_IDENTITY)}: 'labels' keeps "
                              "each face's label effects, 'projected' its deviation from its identity within the "
                              "label-effect subspace, 'residual' all of that deviation, 'frames' its label effects "
                              "plus its own residual within the label-effect subspace, 'grouped' that averaged over "
                              "a group of faces of all the people of its identity cluster, 'label-groups' that "
                              "averaged over a group of >= k people's faces with the same labels")
        if not isinstance(self.select_identity, (bool, np.bool_)):
            raise ConfigError(f"select_identity={self.select_identity!r} must be True or False")
        if isinstance(self.n_iter, bool) or not isinstance(self.n_iter, Integral) or self.n_iter < 1:
            raise ConfigError(f"n_iter={self.n_iter!r} must be an integer >= 1 (backfitting sweeps); e.g. 50")
        a = check_images(X)
        n = len(a)
        pcodes, pkeys = _factorize(people, "people", n)
        codes = check_labels(labels, n)
        self.eigenfaces_ = Eigenfaces(self.n_components, random_state=self.random_state).fit(a)
        Z = self.eigenfaces_.transform(a).astype(np.float64)
        # A label is a non-identity factor only if it varies within some person; one constant
        # within every person (gender) cannot be told apart from identity.
        varying = [name for name, c in codes.items()
                   if any(len(np.unique(c[pcodes == p])) > 1 for p in range(len(pkeys)))]
        if labels is not None and not varying:
            logger.warning("multi-factor: no label varies within a person (%s); identity = person mean", list(codes))
        identity, effects = self._backfit(Z, pcodes, len(pkeys), {name: codes[name] for name in varying})
        fx = sum((effects[name][codes[name]] for name in varying), np.zeros_like(Z))
        constant = {name: c for name, c in codes.items() if name not in varying}
        ks = self._cluster(identity, pkeys, pcodes, constant)
        person_clusters, cluster_identity = ks.labels_, ks.averages_
        cells_mode = self.non_identity in ("labels", "label-groups")
        if cells_mode and varying:
            # Cells (identity cluster x labels) are what the release holds: an identity cluster whose cell
            # lacks k people (someone without one expression) joins its nearest cluster of the same identity
            # labels, which keeps every face's expression (release_cells merges the cells that remain).
            first = np.unique(pcodes, return_index=True)[1]
            person_cell = [tuple(int(constant[x][i]) for x in self.identity_labels_) for i in first]
            person_clusters, cluster_identity = merge_clusters_for_cells(
                person_clusters, cluster_identity, identity, person_cell, pcodes, [codes[x] for x in varying],
                int(self.k))
        face_identity = cluster_identity[person_clusters[pcodes]]
        if self.non_identity == "labels":
            self.non_identity_ = fx
        elif self.non_identity == "residual":
            self.non_identity_ = Z - identity[pcodes]
        elif self.non_identity in ("frames", "grouped", "label-groups"):
            self.non_identity_ = fx + ((Z - identity[pcodes] - fx) @ _span(effects) if varying else 0.0)
        else:  # the face's own coefficients inside the label-effect span replace the cluster's
            self.non_identity_ = (Z - face_identity) @ _span(effects) if varying else np.zeros_like(Z)
        self.people_, self.identity_, self.effects_ = pkeys, identity, effects
        self.non_identity_labels_ = varying
        self.person_clusters_ = person_clusters
        self.labels_ = person_clusters[pcodes]
        if cells_mode and varying:
            # Every face of one identity cluster with the same labels gets the identical image: those cells
            # (merged where one holds fewer than k people) are the release's clusters, the k-Same structure
            # whose exact bound the gate then finds in the data.
            self.labels_, merged = release_cells(self.labels_, pcodes, [codes[x] for x in varying], int(self.k))
            if merged.any() and self.non_identity == "labels":
                cells = self.labels_[merged]
                _, dense = np.unique(cells, return_inverse=True)
                self.non_identity_ = self.non_identity_.copy()
                self.non_identity_[merged] = group_means(self.non_identity_[merged], dense, int(dense.max()) + 1)[dense]
        if self.non_identity in ("grouped", "label-groups"):
            # k-Same on the non-identity factor too, within each identity cluster ("grouped") or each of its
            # label cells ("label-groups"): a group's faces get the identical image (cluster identity + the
            # group's mean non-identity factor), and each group holds faces of >= k distinct people.
            if self.non_identity == "grouped":
                self.labels_ = group_within_clusters(self.non_identity_, pcodes, self.labels_)
            else:
                self.labels_ = label_groups(self.non_identity_, pcodes, self.labels_, int(self.k))
            self.non_identity_ = group_means(self.non_identity_, self.labels_, int(self.labels_.max()) + 1)[self.labels_]
        self.cluster_identity_ = cluster_identity
        e = self.eigenfaces_
        coef = face_identity + self.non_identity_
        self.released_ = e.mean_.astype(np.float64) + coef @ e.components_.astype(np.float64)
        return self

    def _cluster(self, identity: np.ndarray, pkeys: list, pcodes: np.ndarray,
                 constant: dict[str, np.ndarray]) -> KSame:
        """People-aware k-Same on the identities, within cells of the identity labels if asked."""
        self.identity_labels_ = list(constant) if self.select_identity else []
        if self.identity_labels_:
            first = np.unique(pcodes, return_index=True)[1]  # each person's first face
            cells = [tuple(int(c[i]) for c in constant.values()) for i in first]
            try:
                return KSameSelect(self.k).fit(identity, people=pkeys, images=identity, partitions=cells)
            except InsufficientPeopleError as exc:
                logger.warning("multi-factor: identity labels %s not kept (%s); clustering all people together",
                               self.identity_labels_, exc)
                self.identity_labels_ = []
        return KSame(self.k).fit(identity, people=pkeys, images=identity)

    def _backfit(self, Z: np.ndarray, pcodes: np.ndarray, n_people: int,
                 codes: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        sizes = {name: int(c.max()) + 1 for name, c in codes.items()}
        effects = {name: np.zeros((sizes[name], Z.shape[1])) for name in codes}
        identity = group_means(Z, pcodes, n_people)
        for sweep in range(int(self.n_iter) if codes else 0):
            before = identity
            for name, c in codes.items():
                others = sum((effects[m][codes[m]] for m in codes if m != name), np.zeros_like(Z))
                b = group_means(Z - identity[pcodes] - others, c, sizes[name])
                effects[name] = b - b[c].mean(axis=0)  # centred over faces: the identity holds the mean
            fx = sum((effects[m][codes[m]] for m in codes), np.zeros_like(Z))
            identity = group_means(Z - fx, pcodes, n_people)
            if np.abs(identity - before).max() <= 1e-6 * (1 + np.abs(identity).max()):
                logger.debug("multi-factor: backfitting converged after %d sweeps", sweep + 1)
                break
        return identity, effects

    def fit_transform(self, X: Any, *, people: Sequence[Hashable],
                      labels: Mapping[str, Sequence[Hashable]] | None = None) -> np.ndarray:
        """Fit, then return the released faces (uint8)."""
        return to_uint8(self.fit(X, people=people, labels=labels).released_)
