"""The within-cluster identity check: a released cluster must hold different-looking people.

Identity resolution (:mod:`deid.anonymise.identity`) may miss one person under several ids: copies
re-lit, masked or noised beyond its thresholds. k-Same then averages her photos together and releases
her face. After clustering, this check looks at every cluster again (issue 27):

* **one-person cluster**: at least ``ONE_PERSON_SHARE`` of the pairs of its members (of different
  resolved people) are within the same-person threshold: the members look like one person, unlike the
  members of normal clusters;
* **released at one member**: the released image is within the threshold of one member and at most
  ``AT_ONE_MEMBER_RATIO`` of its distance to the nearest member of another person (an average of k
  different people sits roughly as far from each); for feature vectors, within ``FEATURE_AT_ONE_RATIO``
  x the median nearest-other-person distance of a member.

Faces are compared in the dlib recogniser's space (threshold calibrated on the checked originals by
:func:`deid.anonymise.identity_calibration.calibrate_recogniser`), on the clusters a cheap first pass over every
cluster flags (self-quotient images, :class:`deid.alignment.features.IlluminationFeatures`); feature
vectors in their own space (threshold
``FEATURE_SAME_RATIO`` x the median nearest-other-person distance).

References
----------
E. Newton, L. Sweeney, B. Malin. Preserving privacy by de-identifying face images. IEEE TKDE 17(2), 2005.
J. R. Douceur. The Sybil attack. IPTPS 2002.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from deid.evaluation.checks import Check

log = logging.getLogger(__name__)

NAME = "no_one_person_clusters"
ONE_PERSON_SHARE = 0.5
AT_ONE_MEMBER_RATIO = 0.5
FEATURE_SAME_RATIO = 0.7
FEATURE_AT_ONE_RATIO = 0.5  # a released vector within this x the median nearest-other-person distance of a member
CHEAP_SAME_RATIO = 0.8  # the cheap first pass's same-person distance: x its median nearest-other-person distance
REFERENCES = 200  # faces of unflagged clusters the recogniser's calibration sees beside the flagged ones
CHEAP_FLAG_SHARE = 0.2  # it flags a cluster with this share of member pairs within that distance (or at one member)


def _references(H: np.ndarray, people: np.ndarray, clusters: np.ndarray, rows: np.ndarray, *,
                limit: int) -> np.ndarray:
    """Unflagged rows nearest each flagged cluster (of ``rows``) in the cheap space ``H``, each with its
    person's other rows (ids with several faces calibrate the recogniser): an equal share of ``limit`` per
    flagged cluster, so each is judged among faces of its own kind."""
    rest = np.setdiff1d(np.arange(len(H)), rows)
    if not len(rest) or limit <= 0 or not len(rows):
        return np.zeros(0, np.int64)
    by_person: dict[Any, list[int]] = {}
    for i in rest.tolist():
        by_person.setdefault(people[i], []).append(i)
    flagged: dict[Any, list[int]] = {}
    for i in rows.tolist():
        flagged.setdefault(clusters[i], []).append(i)
    share = max(2, limit // len(flagged))
    chosen: dict[int, None] = {}
    for members in flagged.values():
        d = np.min([((H[rest] - H[m]) ** 2).sum(1) for m in members], axis=0)
        taken = 0
        for i in rest[np.argsort(d, kind="stable")].tolist():
            group = [r for r in by_person[people[i]] if r not in chosen]
            if taken + len(group) > share or len(chosen) + len(group) > limit:
                break
            chosen.update(dict.fromkeys(group))
            taken += len(group)
    return np.array(sorted(chosen), dtype=np.int64)


def _rows_of(clusters: np.ndarray, hot: list, limit: int) -> np.ndarray:
    """The rows of the clusters ``hot``, in that order, whole clusters up to ``limit`` rows."""
    at: dict[Any, list[int]] = {}
    for i, c in enumerate(clusters.tolist()):
        at.setdefault(c, []).append(i)
    rows: list[int] = []
    for c in hot:
        if rows and len(rows) + len(at[c]) > limit:
            break
        rows += at[c]
    return np.array(sorted(rows), dtype=np.int64)


def _pairwise(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * (a @ b.T)
    return np.sqrt(np.maximum(d, 0.0))


def cluster_figures(clusters: Sequence[Any] | np.ndarray, people: Sequence[Any] | np.ndarray, members: np.ndarray, released: np.ndarray,
                    threshold: float | np.ndarray, *, at_one: float | None = None,
                    at_one_ratio: float = AT_ONE_MEMBER_RATIO) -> list[dict]:
    """Per cluster: how alike its members are, and where its released image lies among them.

    Parameters
    ----------
    clusters, people : sequence, length n
        Each record's cluster and resolved person.
    members : ndarray of shape (n, d)
        Each record's original, in the comparison space.
    released : ndarray of shape (n, d)
        Each record's released image (or vector), in the same space.
    threshold : float or ndarray of shape (n,)
        Same-person distance (per record: the smaller of two records' thresholds applies to a pair).
    at_one, at_one_ratio : float
        The released image is *at one member* when within ``at_one`` (default: ``threshold``) of it and
        at most ``at_one_ratio`` x its distance to the nearest member of another person (inf: no ratio).

    Returns
    -------
    list of dict
        ``cluster`` (position in first-seen order, never an id), ``members``, ``pairs``, ``alike_pairs``,
        ``alike_share``, ``median_pairwise``, ``released_nearest``, ``released_other``, ``one_person``,
        ``at_one_member``.
    """
    M = np.asarray(members, dtype=np.float64)
    Rel = np.asarray(released, dtype=np.float64)
    who = np.asarray(people, dtype=object)
    t = np.broadcast_to(np.asarray(threshold, dtype=np.float64), (len(M),))
    near_t = t if at_one is None else np.full(len(M), float(at_one))
    order: dict[Any, list[int]] = {}
    for i, c in enumerate(clusters):
        order.setdefault(c, []).append(i)
    out = []
    for pos, members_of in enumerate(order.values()):
        rows = np.asarray(members_of)
        p = who[rows]
        d = _pairwise(M[rows], M[rows])
        tt = np.minimum(t[rows][:, None], t[rows][None, :])
        other = (p[:, None] != p[None, :]) & np.triu(np.ones_like(d, bool), 1)
        pairs = int(other.sum())
        alike = int(np.count_nonzero(d[other] < tt[other]))
        r = _pairwise(Rel[rows[:1]], M[rows])[0]
        j = int(np.argmin(r))
        rest = r[p != p[j]]
        near, far = float(r[j]), (float(rest.min()) if len(rest) else float("inf"))
        out.append({"cluster": pos, "members": int(len(rows)), "pairs": pairs, "alike_pairs": alike,
                    "alike_share": round(alike / pairs, 4) if pairs else 0.0,
                    "median_pairwise": round(float(np.median(d[other])), 4) if pairs else None,
                    "released_nearest": round(near, 4), "released_other": round(far, 4) if np.isfinite(far) else None,
                    "one_person": bool(pairs and alike / pairs >= ONE_PERSON_SHARE),
                    "at_one_member": bool(near < near_t[rows][j] and near <= at_one_ratio * far)})
    return out


def _decide(figs: list[dict], *, space: str, threshold_text: str, checked: int, total: int, confidence: float,
            extra: str = "") -> Check:
    from deid.evaluation.gate_privacy import clopper_pearson  # noqa: PLC0415 - the gate imports this module lazily

    bad = [f for f in figs if f["one_person"] or f["at_one_member"]]
    normal = [f["median_pairwise"] for f in figs if not (f["one_person"] or f["at_one_member"])
              and f["median_pairwise"] is not None]
    typical = round(float(np.median(normal)), 4) if normal else None
    interval = clopper_pearson(len(bad), len(figs), confidence=confidence) if figs else None
    worst = sorted(bad, key=lambda f: -f["alike_share"])[:3]
    detail = (f"{len(bad)} of {len(figs)} clusters checked in {space} space ({checked} of {total} records) hold "
              f"members alike as one person (>= {ONE_PERSON_SHARE:g} of member pairs within {threshold_text}) or a "
              f"released image at one member (within the threshold and <= {AT_ONE_MEMBER_RATIO:g} x the next "
              f"person's distance); normal clusters' median member distance {typical}")
    if worst:
        detail += "; e.g. " + "; ".join(f"cluster {f['cluster']}: {f['alike_pairs']}/{f['pairs']} pairs alike, "
                                        f"median {f['median_pairwise']}, released {f['released_nearest']} from one "
                                        f"member vs {f['released_other']}" for f in worst)
    return Check(NAME, not bad, len(bad), 0, detail + extra, interval=interval, n=len(figs))


def feature_check(clusters: Sequence[Any], people: Sequence[Any], originals: np.ndarray, released: np.ndarray, *,
                  confidence: float = 0.95) -> Check:
    """The check on feature vectors, in their own space (threshold: ``FEATURE_SAME_RATIO`` x the median
    nearest-other-person distance of the originals)."""
    from deid.evaluation.leaks import other_person_scale  # noqa: PLC0415

    scale = other_person_scale(originals, people)
    if not scale:
        return Check(NAME, True, 0, 0, "one person only: no typical distance between people", status="not_applicable")
    t = FEATURE_SAME_RATIO * scale
    # Low-dimensional vectors: the mean of k people may lie near one of them by chance, so a released
    # vector is at one member by its distance alone (issue 27: Sybil copies 0.17 x, normal clusters >= 0.81 x).
    figs = cluster_figures(clusters, people, originals, released, t, at_one=FEATURE_AT_ONE_RATIO * scale,
                           at_one_ratio=float("inf"))
    return _decide(figs, space="feature", threshold_text=f"{FEATURE_SAME_RATIO:g} x the median nearest-other-person "
                   f"distance ({t:.4g}; released at one member: within {FEATURE_AT_ONE_RATIO:g} x)",
                   checked=len(people), total=len(people), confidence=confidence)


def image_check(clusters: Sequence[Any], people: Sequence[Any], originals: np.ndarray, released: np.ndarray, *,
                shape: tuple[int, int], budget: int, total: int | None = None, confidence: float = 0.95,
                seed: int = 0, must: Sequence[Any] = ()) -> Check:
    """The check on aligned faces: a cheap first pass over every given cluster, the recogniser on the flagged ones.

    ``budget``: most faces (members and released images) the recogniser embeds; 0 turns the check off.
    ``total``: records in the release (the given ones may be a sample of whole clusters); ``seed`` draws the
    calibration's reference faces from the unflagged clusters. ``must``: clusters the recogniser sees first,
    flagged or not (those holding identity resolution's near misses).
    """
    from deid.anonymise.identity_calibration import calibrate_recogniser  # noqa: PLC0415
    from deid.evaluation.leaks import other_person_scale  # noqa: PLC0415

    n = len(people)
    total = n if total is None else total
    if budget <= 0:
        return Check(NAME, True, None, 0, "the recogniser is off (DEID_IDENTITY_EMBED_MAX=0): clusters not checked",
                     status="not_applicable")
    cl: np.ndarray = np.asarray(clusters, dtype=object)
    who: np.ndarray = np.asarray(people, dtype=object)
    originals, released = np.asarray(originals), np.asarray(released)
    from deid.alignment.features import IlluminationFeatures  # noqa: PLC0415

    hw = (int(shape[0]), int(shape[1]))
    cheap = IlluminationFeatures(hw).fit(originals)
    H, R = cheap.transform(originals).astype(np.float64), cheap.transform(released).astype(np.float64)
    scale = other_person_scale(H, who) or 1.0
    figs = cluster_figures(cl, who, H, R, CHEAP_SAME_RATIO * scale)
    keys = list(dict.fromkeys(cl.tolist()))
    hot = [keys[f["cluster"]] for f in sorted(figs, key=lambda f: (-f["alike_share"], f["released_nearest"]))
           if f["alike_share"] >= CHEAP_FLAG_SHARE or f["at_one_member"]]
    present = set(keys)
    must = [c for c in dict.fromkeys(must) if c in present]
    first = set(must)
    cheap_only = [c for c in hot if c not in first]
    rows = _rows_of(cl, must + cheap_only, budget // 3)
    flagged_by = (f"a cheap first pass (self-quotient images, {CHEAP_SAME_RATIO:g} x their median nearest-other-person "
                  f"distance) flagged {len(hot)} of {len(figs)} clusters"
                  + (f", identity resolution's near misses {len(must)} more" if len(must) else "")
                  + f"; the recogniser checked {len(set(cl[rows].tolist()))} of them")
    if not len(rows):
        return Check(NAME, True, 0, 0, f"{flagged_by}; {n} of {total} records", n=0)
    from deid.evaluation.recognizer import DlibEmbedder  # noqa: PLC0415

    # The calibration needs normal faces of the same kind (a flagged cluster of one person's copies would
    # otherwise set the scale itself, and cartoons far away would judge real faces): references from the
    # unflagged clusters nearest the flagged faces in the cheap space, with their people's other faces.
    ref = _references(H, who, cl, rows, limit=min(max(0, budget - 2 * len(rows)), max(REFERENCES, 2 * len(rows))))
    emb = DlibEmbedder(hw)
    E = emb.transform(originals[np.concatenate([rows, ref])]).astype(np.float64)
    Er = emb.transform(released[rows]).astype(np.float64)
    codes = np.unique(who[np.concatenate([rows, ref])].astype(str), return_inverse=True)[1].ravel()
    cal = calibrate_recogniser(E, codes)
    t = cal.row_threshold[:len(rows)]
    figs = cluster_figures(cl[rows], who[rows], E[:len(rows)], Er, t)
    undecided = cal.row_threshold[~cal.informative]
    return _decide(figs, space="recogniser", threshold_text=f"the calibrated same-person distance {cal.threshold:.3f} "
                   f"({len(undecided)} faces in subsets it does not separate: their own lower tail, "
                   f"{float(undecided.max(initial=cal.duplicate)):.3f} at most, near-copy {cal.duplicate:g} at least)",
                   checked=len(rows), total=total, confidence=confidence, extra=f"; {flagged_by}")
