"""Checks on released image sequences: one identity per sequence, expression kept frame by frame."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np

from deid.errors import ConfigError, DataError
from deid.evaluation.checks import Check


@dataclass(frozen=True)
class IdentitySpread:
    """How tightly each sequence's frames sit together against the distance between identities.

    ``within`` is the mean over sequences of the RMS distance of a sequence's frames to their
    centroid; ``between`` the median distance between the centroids of sequences of different
    identities; ``ratio`` = within / between (well below 1: each sequence keeps one identity).
    ``nearest_own`` is the share of frames nearer their own sequence's centroid than any
    centroid of a sequence of another identity.
    """

    within: float
    between: float
    ratio: float
    nearest_own: float
    n_sequences: int
    n_frames: int


def identity_spread(features: np.ndarray, sequences: Sequence[Hashable | None],
                    people: Sequence[Hashable]) -> IdentitySpread:
    """:class:`IdentitySpread` of frames ``features`` (n, d), e.g. eigenface coefficients or recogniser descriptors.

    ``people`` is the identity of each frame: the subject for source frames, the released
    identity (the k-Same cluster: its people share one de-identified identity) for released
    ones. Still images (sequence None) are left out. Needs sequences of at least two identities.
    """
    F = np.asarray(features, dtype=np.float64)
    keys = [s for s in dict.fromkeys(sequences) if s is not None]
    if len(F) != len(sequences) or len(F) != len(people):
        raise ConfigError(f"features has {len(F)} rows, sequences {len(sequences)}, people {len(people)}; one per frame")
    idx = {key: np.array([i for i, s in enumerate(sequences) if s == key]) for key in keys}
    owner = {key: people[int(idx[key][0])] for key in keys}
    if len(set(owner.values())) < 2:
        raise DataError("identity_spread needs the sequences of at least two identities")
    cent = np.stack([F[idx[key]].mean(axis=0) for key in keys])
    within = float(np.mean([np.sqrt(((F[idx[key]] - cent[j]) ** 2).sum(axis=1).mean()) for j, key in enumerate(keys)]))
    d = np.sqrt(((cent[:, None, :] - cent[None, :, :]) ** 2).sum(axis=2))
    other = np.array([[owner[a] != owner[b] for b in keys] for a in keys])
    between = float(np.median(d[other]))
    own = 0
    for j, key in enumerate(keys):
        dist = np.sqrt(((F[idx[key]][:, None, :] - cent[None, :, :]) ** 2).sum(axis=2))
        own += int((dist[:, j] < dist[:, other[j]].min(axis=1)).sum())
    n_frames = sum(len(v) for v in idx.values())
    return IdentitySpread(within, between, within / between if between > 0 else float("inf"), own / n_frames,
                          len(keys), n_frames)


def label_agreement(source: np.ndarray, released: np.ndarray, labels: Sequence[Hashable],
                    people: Sequence[Hashable], *, n_components: int = 30, seed: int = 0) -> dict:
    """Does a classifier of ``labels`` trained on source faces read the same labels on the released ones?

    Trained (eigenfaces + logistic regression) on the source frames of half the people (seeded
    split by person), it is scored on the *other* people's source frames and on their released
    frames: ``source_accuracy`` is what it can do, ``released_accuracy`` how much of that the
    release keeps, ``agreement`` how often it gives a released frame the label it gives the
    same frame's source. Counts and held-out people are returned with the rates.
    """
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415
    from sklearn.pipeline import make_pipeline  # noqa: PLC0415

    from deid.alignment.features import Eigenfaces  # noqa: PLC0415

    y = np.asarray(labels, dtype=object).astype(str)
    p = np.asarray(people, dtype=object)
    who = np.array(sorted(set(p.tolist()), key=str), dtype=object)
    rng = np.random.default_rng(seed)
    test_people = set(rng.permutation(who)[: len(who) // 2].tolist())
    test = np.array([q in test_people for q in p])
    if test.all() or not test.any() or len(set(y[~test])) < 2:
        raise DataError("label_agreement needs at least two people and two label values among the training people")
    clf = make_pipeline(Eigenfaces(n_components, random_state=seed), LogisticRegression(max_iter=2000))
    clf.fit(np.asarray(source)[~test], y[~test])
    on_source = clf.predict(np.asarray(source)[test])
    on_released = clf.predict(np.asarray(released)[test])
    return {"source_accuracy": float(np.mean(on_source == y[test])),
            "released_accuracy": float(np.mean(on_released == y[test])),
            "agreement": float(np.mean(on_source == on_released)),
            "n_test_frames": int(test.sum()), "n_test_people": len(test_people)}


def sequence_linkage_check(sequences: Sequence[Hashable | None], clusters: Sequence[Hashable],
                           people: Sequence[Hashable], *, k: int) -> Check:
    """A video links its frames: do >= k people fit every released sequence?

    A released sequence shows, frame by frame, images of some clusters; an attacker who knows
    who is in which cluster (the parrot attacker re-running the method on the originals does)
    narrows the sequence's person to the people with records in *every* one of those clusters.
    The attacks judge frames one at a time and cannot see that; this check counts, for each
    sequence, the people of the intersection of its clusters' members and requires >= k (a
    necessary condition; with identical images per cluster it is what the exact bound needs
    once frames are linked). Image k-Same on sequences scatters a person's frames over clusters
    of different people and fails it.

    ``sequences[i]`` is record i's sequence key (None: a still image), ``clusters[i]`` its
    released cluster, ``people[i]`` its person (None: a row of no one, e.g. a counterfeit).
    """
    members: dict[Hashable, set] = {}
    for c, p in zip(clusters, people):
        if p is not None:
            members.setdefault(c, set()).add(p)
    of: dict[Hashable, set] = {}
    for q, c in zip(sequences, clusters):
        if q is not None:
            of.setdefault(q, set()).add(c)
    if not of:
        return Check("sequence_linkage_people", True, None, f">= {k}", "no image sequences: nothing links frames",
                     status="not_applicable")
    fits = {q: len(set.intersection(*(members.get(c, set()) for c in cs))) for q, cs in of.items()}
    low = min(fits.values())
    short = sum(1 for v in fits.values() if v < k)
    return Check("sequence_linkage_people", low >= k, low, f">= {k}",
                 f"{len(fits)} released sequences; the fewest people with records in every cluster a sequence's frames "
                 f"were released in: {low}" + (f"; {short} sequences below k" if short else ""))
