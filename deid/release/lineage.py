"""Release lineage: successive releases of one dataset that leak nothing by differencing.

Each release of a dataset is k-anonymous on its own; together they are not (the composition
problem of k-anonymity, Ganta, Kasiviswanathan & Smith, KDD 2008). Two clusters of successive
releases that differ by fewer than ``k`` member records give the differing faces away:
``s * (M1 - M2) = a - b`` for one swapped person, ``|C2| M2 - |C1| M1 = x`` for one added face.
The standard answer for re-publication is m-invariance (Xiao & Tao, SIGMOD 2007): a person keeps
the same published group in every release, and absent members are covered by counterfeits.

The pure part, in three rooms:

- :mod:`deid.release.lineage_state`: the lineage *state* of a dataset (:class:`~deid.release.lineage_state.LineageState`),
  replayed from the registry entries (the encrypted, hash-chained store is :mod:`deid.release.lineage_registry`),
  its clusters and stored averages, and the keyed pseudonyms;
- :mod:`deid.release.lineage_plan`: :func:`~deid.release.lineage_plan.plan_release`, for a new drop, which records
  are released as a registered cluster's stored average (bit-identical), which are new people to cluster among
  themselves, which wait or are suppressed, and how many counterfeit records each republished cluster needs;
- this module: :func:`build_release` / :func:`release_from_clusters`, the release as the lineage sees it
  (basis records and people of every released cluster, released images, the republished clusters' label
  mix), which the gate checks (:mod:`deid.release.lineage_checks`) and which becomes the next registry entry.

Identities never appear in clear: a person is a keyed pseudonym (HMAC-SHA256) and a record is the
SHA-256 of its source bytes. Keys are derived from the steward's 32-byte key (the linkage key)
with HKDF-SHA256, one key per purpose and dataset, so pseudonyms of two datasets cannot be linked.

References
----------
X. Xiao, Y. Tao. m-Invariance: towards privacy preserving re-publication of dynamic datasets.
SIGMOD 2007, 689-700.
S. R. Ganta, S. P. Kasiviswanathan, A. Smith. Composition attacks and auxiliary information in
data privacy. KDD 2008, 265-273.
"""
from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deid.errors import ConfigError
from deid.release.lineage_plan import LineagePlan, partition_keys, plan_release, record_label_tuples
from deid.release.lineage_state import (ENTRY_FORMAT, LineageCluster, LineageError, LineageState, StoredImage,
                                        average_sha256, pseudonymize, stored_rows)

logger = logging.getLogger(__name__)

# Imported above for the stage modules that take them from here (deid.operations.deidentify_lineage,
# person_search and worker_lineage); they are defined in lineage_state and lineage_plan.
__all__ = [
    "LineageError",
    "LineageRelease",
    "RepublishedCluster",
    "RepublishedLabels",
    "StoredImage",
    "average_sha256",
    "build_release",
    "label_mix",
    "plan_release",
    "pseudonymize",
    "release_from_clusters",
    "stored_rows",
]


def label_mix(labels: Sequence[tuple[str, ...]], n_rows: int) -> list[tuple[str, ...]]:
    """The label tuples of ``n_rows`` rows with the mix of ``labels`` (a cluster's registered basis records).

    ``n_rows == len(labels)``: ``labels`` itself (sorted). More rows (new photos of returning people,
    counterfeits added for the 1/k rule): each label tuple gets ``n_rows`` times its share, the
    remainder to the largest fractions (Hamilton's method; ties to the smallest tuple), so every
    tuple keeps at least its registered count and the mix is a function of the registered labels and
    the released size only, never of who is absent. Fewer rows: a ValueError (only a sub-multiset
    of the registered labels can be released then).
    """
    counts = Counter(labels)
    n = sum(counts.values())
    if n_rows < n or (n == 0 and n_rows):
        raise ValueError(f"n_rows={n_rows} must be >= the {n} registered label tuples")
    base = {t: c * n_rows // n for t, c in counts.items()}
    rest = n_rows - sum(base.values())
    for t in sorted(counts, key=lambda t: (-((counts[t] * n_rows) % n), t))[:rest]:
        base[t] += 1
    return [t for t in sorted(base) for _ in range(base[t])]


@dataclass(frozen=True)
class RepublishedCluster:
    """A registered cluster in a later release: how many records carry its stored average."""

    key: str
    n_released: int                   # drop records + counterfeits
    n_counterfeit: int
    added_records: tuple[str, ...]    # fingerprints released with it for the first time
    people_released: tuple[str, ...]  # pseudonyms whose records carry it in this release


@dataclass(frozen=True)
class RepublishedLabels:
    """Released label values of a republished cluster's rows (:meth:`LineageRelease.republished_labels`)."""

    records: Mapping[int, tuple[str, ...]]   # drop record index -> label values
    counterfeits: tuple[tuple[str, ...], ...]


@dataclass(frozen=True, eq=False)
class LineageRelease:
    """One release as the lineage sees it: checked by the gate, then appended to the registry.

    ``record_cluster[i]`` is the cluster key of drop record ``i`` (``None`` = not released);
    ``images`` maps every released cluster key to its released uint8 image.
    """

    dataset: str
    release_id: str
    k: int
    method: str
    policy: str
    absent: str
    based_on_seq: int
    based_on_head: str
    new_clusters: tuple[LineageCluster, ...]
    republished: tuple[RepublishedCluster, ...]
    suppressed_clusters: tuple[tuple[str, str], ...]
    pseudonyms: tuple[str, ...]
    fingerprints: tuple[str, ...]
    record_cluster: tuple[str | None, ...]
    counts: Mapping[str, int]
    color: bool = False   # released in colour: every new cluster holds its colour average, republished ones too
    # This run's overlay for the k rules (:attr:`LineagePlan.merged`): the gate counts people through it.
    merged: Mapping[str, str] = field(default_factory=dict)

    def person(self, pseudonym: str) -> str:
        """The person ``pseudonym`` counts as in this release (its group's pseudonym under this run's merges)."""
        return self.merged.get(pseudonym, pseudonym)

    def released_clusters(self, state: LineageState) -> dict[str, tuple[LineageCluster, int]]:
        """key -> (cluster with its basis, records released with it in this release)."""
        out = {c.key: (c, c.n_released) for c in self.new_clusters}
        for r in self.republished:
            out[r.key] = (state.clusters[r.key], r.n_released)
        return out

    def released_records(self, state: LineageState) -> list[tuple[int, str, np.ndarray]]:
        """(drop record index, cluster key, released uint8 image) of every released drop record, by index."""
        clusters = self.released_clusters(state)
        return [(i, key, clusters[key][0].image) for i, key in enumerate(self.record_cluster) if key is not None]

    def counterfeits(self, state: LineageState) -> list[tuple[np.ndarray, tuple[str, ...]]]:
        """(image, partition) of every counterfeit record to add to the release (private: not marked there)."""
        return [(state.clusters[r.key].image, state.clusters[r.key].partition)
                for r in self.republished for _ in range(r.n_counterfeit)]

    def republished_labels(self, state: LineageState,
                           label_names: Sequence[str]) -> dict[str, "RepublishedLabels | None"]:
        """The released labels of every republished cluster's rows: its registered label mix, reproduced.

        Per republished cluster key: each drop record released with it keeps the labels registered for
        it (a basis record), the others (new photos of returning people) and the counterfeits take the
        rest of :func:`label_mix` of the registered labels at the released size. The cluster's released
        label multiset is thus the registered one (the same size as registered: absent members'
        labels are carried by the counterfeits, so neither who left nor which labels they had shows),
        or its proportional extension to more rows; with fewer rows (``absent="suppress"``), a part of
        it. None for a cluster whose labels were not registered (a registry written before labels
        were kept, or a label column the registering release did not have): the caller falls back.
        """
        out: dict[str, RepublishedLabels | None] = {}
        # Each cluster's records from one pass (issue 32: a scan per cluster was 2e9 steps at 100,000 records).
        by_key: dict[str, list[int]] = defaultdict(list)
        if self.republished:
            for i, key in enumerate(self.record_cluster):
                if key is not None:
                    by_key[key].append(i)
        for r in self.republished:
            c = state.clusters[r.key]
            reg = c.labels_for(label_names)
            if reg is None:
                out[r.key] = None
                continue
            recs = by_key.get(r.key, [])
            pool = Counter(label_mix(list(reg.values()), max(len(reg), r.n_released)))
            mine: dict[int, tuple[str, ...]] = {}
            for i in recs:
                lab = reg.get(self.fingerprints[i])
                if lab is not None and pool[lab] > 0:
                    mine[i] = lab
                    pool[lab] -= 1
            rest = iter(sorted(pool.elements()))
            for i in recs:
                if i not in mine:
                    mine[i] = next(rest)
            out[r.key] = RepublishedLabels(records=mine, counterfeits=tuple(next(rest) for _ in range(r.n_counterfeit)))
        return out

    def to_entry(self, *, image_at: Mapping[str, Mapping[str, Any]] | None = None,
                 color_at: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """The registry entry document (kind ``release``); the registry adds seq and chain hash.

        ``image_at`` (``color_at``): cluster key -> where the registry sealed its (colour) average (then not
        inline). A colour release says so (``"color": true``: the lineage's mode); a grey one's entry is as before.
        """
        return {"format": ENTRY_FORMAT, "kind": "release", "dataset": self.dataset, "release_id": self.release_id,
                "k": self.k, "method": self.method, "policy": self.policy, "absent": self.absent,
                "based_on_seq": self.based_on_seq, "based_on_head": self.based_on_head,
                **({"color": True} if self.color else {}),
                "new_clusters": [c.to_json(image_at=None if image_at is None else image_at[c.key],
                                           color_at=None if color_at is None else color_at.get(c.key))
                                 for c in self.new_clusters],
                "republished": [{"key": r.key, "n_released": r.n_released, "n_counterfeit": r.n_counterfeit,
                                 "added_records": list(r.added_records), "people_released": list(r.people_released)}
                                for r in self.republished],
                "suppressed_clusters": [list(x) for x in self.suppressed_clusters],
                "counts": dict(self.counts)}


def _one_image(images: Any, rows: list[int], lab: int) -> Any:
    """The image all ``rows`` of new cluster ``lab`` carry (a stored row when ``images`` keeps them on disk)."""
    if hasattr(images, "stored_image"):
        # Rows sharing a stored row are equal by construction; only others are compared in pixels.
        img = images.stored_image(rows[0])
        same = images.same_image(rows)
    else:
        img = images[rows[0]]
        same = all(np.array_equal(images[r], img) for r in rows[1:])
        img = img.copy()
    if not same:
        raise ConfigError(f"new cluster {lab}: its records carry different images; pass the released "
                          "(cluster-average) images, one row per record")
    return img


def _new_clusters(release_id: str, idx: Sequence[int], labels: np.ndarray, images: np.ndarray,
                  pseud: Sequence[str], fps: Sequence[str], parts: Sequence[tuple[str, ...]] | None,
                  shape: tuple[int, ...], k: int, method: str, record_labels: Sequence[tuple[str, ...]] | None = None,
                  label_names: Sequence[str] = (), colors: Any = None) -> tuple[list[LineageCluster], dict[int, str]]:
    by_label: dict[int, list[int]] = defaultdict(list)
    for row, lab in enumerate(labels.tolist()):
        if lab >= 0:
            by_label[lab].append(row)
    clusters, where = [], {}
    for n, lab in enumerate(sorted(by_label)):
        rows = by_label[lab]
        img = _one_image(images, rows, lab)
        color = None if colors is None else _one_image(colors, rows, lab)
        members = [idx[r] for r in rows]
        ps = [parts[i] for i in members] if parts is not None else [()]
        part = min(Counter(ps).most_common(), key=lambda x: (-x[1], x[0]))[0]
        key = f"{release_id}/{n:05d}"
        clusters.append(LineageCluster(key=key, release_id=release_id,
                                       members=frozenset((fps[i], pseud[i]) for i in members), image=img, shape=shape,
                                       partition=tuple(part), n_released=len(members), k=k, method=method,
                                       label_names=tuple(label_names),
                                       member_labels=None if record_labels is None else
                                       {fps[i]: record_labels[i] for i in members}, color=color))
        for i in members:
            where[i] = key
    return clusters, where


def _check_new(labels: Any, images: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    labels = np.asarray(labels, dtype=np.intp).reshape(-1)
    # A matrix-like with shape, dtype and row indexing (one image per cluster behind it) is kept as it is:
    # np.asarray would hold one copy per record (issue 13).
    if not all(hasattr(images, a) for a in ("shape", "dtype", "ndim", "__getitem__")):
        images = np.asarray(images)
    released_dtype = images.dtype == np.uint8 or (images.dtype.kind == "f" and images.dtype.itemsize in (4, 8))
    if labels.shape[0] != n or images.ndim != 2 or images.shape[0] != n or not released_dtype:
        raise ConfigError(f"new cluster labels ({labels.shape}) and images ({images.shape}, {images.dtype}) must have "
                          f"one row per new record ({n}); images uint8 (n, n_pixels) as released, or feature "
                          "vectors float32/float64 (n, dim) as released")
    return labels, images


def build_release(plan: LineagePlan, state: LineageState, *, release_id: str, method: str,
                  new_labels: Any, new_images: Any, shape: tuple[int, ...], new_colors: Any = None) -> LineageRelease:
    """The release of a plan, once the caller has clustered ``plan.new_records``.

    ``new_labels[j]`` is the k-Same cluster of ``plan.new_records[j]`` (-1: the caller withheld it)
    and ``new_images[j]`` its released uint8 image (the cluster average, as published), or for a
    feature drop its released float32/float64 vector (``shape=(dim,)``), stored bit for bit.
    ``new_colors[j]``: a colour release's BGR average (uint8, 3 values per pixel), stored beside the grey
    ``new_images[j]`` (its grey, what the gate attacks); every republished cluster must then hold its colour.

    Raises
    ------
    ConfigError
        A colour release of a lineage registered in grey, or the reverse (:attr:`LineageState.color_mode`):
        a returning person's released image would change.
    """
    if plan.based_on_head != state.head or plan.dataset != state.dataset:
        raise LineageError(f"the plan was made on lineage entry {plan.based_on_seq} of {plan.dataset!r} but the "
                           f"registry is now at entry {state.seq} of {state.dataset!r}; plan again")
    color = new_colors is not None
    mode = state.color_mode
    if mode is not None and mode != ("colour" if color else "grey"):
        raise ConfigError(f"dataset {state.dataset!r} was released in {mode}; this release is in "
                          f"{'colour' if color else 'grey'} (DEID_COLOR), which would change returning people's "
                          f"images; unset DEID_COLOR (auto follows the lineage) or set it to "
                          f"{'true' if mode == 'colour' else 'false'}")
    labels, images = _check_new(new_labels, new_images, len(plan.new_records))
    if color:
        _, new_colors = _check_new(labels, new_colors, len(plan.new_records))
        if new_colors.dtype != np.uint8 or new_colors.shape[1] != 3 * images.shape[1]:
            raise ConfigError(f"new_colors ({new_colors.shape}, {new_colors.dtype}) must be uint8 with 3 values per "
                              f"pixel of new_images ({images.shape[1]} pixels)")
    new, where = _new_clusters(release_id, plan.new_records, labels, images, plan.pseudonyms, plan.fingerprints,
                               plan.partitions, tuple(shape), plan.k, method, plan.record_labels, plan.label_names,
                               colors=new_colors)
    record_cluster: list[str | None] = [None] * len(plan.pseudonyms)
    for i, ckey in where.items():
        record_cluster[i] = ckey
    rep = []
    # Each republished cluster's records released so far, from one pass over the registry (not one per cluster).
    released_before: dict[str, set[str]] = defaultdict(set)
    if plan.republish:
        for f, ckey in state.record_cluster.items():
            released_before[ckey].add(f)
    for r in plan.republish:
        for i in r.records:
            record_cluster[i] = r.cluster.key
        added = sorted({plan.fingerprints[i] for i in r.records} - released_before.get(r.cluster.key, set()))
        rep.append(RepublishedCluster(key=r.cluster.key, n_released=len(r.records) + r.n_counterfeit,
                                      n_counterfeit=r.n_counterfeit, added_records=tuple(added),
                                      people_released=tuple(sorted({plan.pseudonyms[i] for i in r.records}))))
    released = sum(c is not None for c in record_cluster)
    counts = {"new_clusters": len(new), "republished_clusters": len(rep),
              "suppressed_clusters": len(plan.suppressed_clusters), "records_released": released + plan.n_counterfeit,
              "counterfeit_records": plan.n_counterfeit, "new_people": plan.n_new_people,
              "returning_people": plan.n_returning_people, "waiting_people": plan.n_waiting_people,
              "suppressed_records": len(plan.pseudonyms) - released}
    return LineageRelease(dataset=plan.dataset, release_id=release_id, k=plan.k, method=method, policy=plan.policy,
                          absent=plan.absent, based_on_seq=plan.based_on_seq, based_on_head=plan.based_on_head,
                          new_clusters=tuple(new), republished=tuple(rep),
                          suppressed_clusters=plan.suppressed_clusters, pseudonyms=plan.pseudonyms,
                          fingerprints=plan.fingerprints, record_cluster=tuple(record_cluster), counts=counts,
                          color=color, merged=plan.merged)


def release_from_clusters(state: LineageState, people: Sequence[Hashable], record_fingerprints: Sequence[str], *,
                          key: bytes, release_id: str, k: int, method: str, labels: Any, images: Any,
                          shape: tuple[int, ...], partitions: Sequence[Hashable] | None = None,
                          record_labels: Sequence[Sequence[Hashable]] | None = None,
                          label_names: Sequence[str] = ()) -> LineageRelease:
    """A release clustered without the lineage policy (every cluster new): what the gate must catch.

    ``labels`` is the cluster of every record (-1: suppressed), ``images`` the released uint8 images.
    Used for releases made before the lineage existed and by tests that bypass the policy.
    """
    pseud = pseudonymize(key, state.dataset, people)
    fps = tuple(map(str, record_fingerprints))
    labels, images = _check_new(labels, images, len(pseud))
    parts = partition_keys(partitions, len(pseud))
    new, where = _new_clusters(release_id, range(len(pseud)), labels, images, pseud, fps, parts, tuple(shape),
                               k, method, record_label_tuples(record_labels, label_names, len(pseud)), label_names)
    record_cluster = tuple(where.get(i) for i in range(len(pseud)))
    released = sum(c is not None for c in record_cluster)
    counts = {"new_clusters": len(new), "republished_clusters": 0, "suppressed_clusters": 0,
              "records_released": released, "counterfeit_records": 0, "new_people": len(set(pseud)),
              "returning_people": len(set(pseud) & set(state.person_clusters)), "waiting_people": 0,
              "suppressed_records": len(pseud) - released}
    return LineageRelease(dataset=state.dataset, release_id=release_id, k=k, method=method, policy="none",
                          absent="none", based_on_seq=state.seq, based_on_head=state.head, new_clusters=tuple(new),
                          republished=(), suppressed_clusters=(), pseudonyms=tuple(pseud), fingerprints=fps,
                          record_cluster=record_cluster, counts=counts)
