"""The gate's exact checks, decided in O(N) on the release's structure: the records, people and clusters
counted (:func:`structural_checks`: ``max_person_share`` against 1/k, the drop checks, the lineage's
registered members), each label partition's clusters (:func:`partition_grouping`,
:func:`partition_clusters_check`) and how close a released image sits to its own original
(:func:`closeness_check`).
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from deid.anonymise.clusters import cluster_shares, value_codes
from deid.anonymise.ksame import feasible_clusters
from deid.method_registry import CLUSTER_METHODS
from deid.evaluation.checks import Check
from deid.evaluation.validation import quarantine_fraction_check
from deid.schemas.arrow import FEATURE_RELEASE_BASE_COLUMNS, FORBIDDEN_RELEASE_COLUMNS, RELEASE_BASE_COLUMNS
from deid.bound import within_bound

from deid.evaluation.gate_types import GateConfig, GateInputs, Republished


# --------------------------------------------------------------------------- structure


def identical_within_clusters(image_index: Sequence[int], clusters: Sequence[Hashable] | None) -> bool:
    """True when every cluster's released rows are one distinct image (the k-Same structure)."""
    if clusters is None or len(image_index) == 0:
        return False
    c_codes, _ = value_codes(list(clusters))
    pairs = np.unique(np.stack([c_codes, np.asarray(image_index, dtype=np.int64)]), axis=1)
    return bool(pairs.shape[1] == len(np.unique(c_codes)))


def forms_clusters(method: str) -> bool:
    """Does the method form clusters (the registry says)? Unknown names are treated as clustered."""
    from deid.anonymise.methods import FEATURE_ONLY, REGISTRY  # noqa: PLC0415

    spec = REGISTRY.get(method) or FEATURE_ONLY.get(method)
    return True if spec is None else bool(spec.clustered)


def registered_rows(clusters: Sequence[Hashable], people: Sequence[Hashable],
                    members: Mapping[Hashable, Sequence[Hashable]]) -> tuple[list, list]:
    """Cluster and person of every row, a republished cluster's rows replaced by its registered basis.

    The image of a republished cluster is the average of its registered basis records (the earlier
    release's members), whoever of them is in this drop: its size, its distinct people and their
    shares are those of the basis. A republished cluster with no row in this drop is counted too.
    """
    keep = [(c, p) for c, p in zip(clusters, people) if c not in members]
    keep += [(c, p) for c, ps in members.items() for p in ps]
    return [c for c, _ in keep], [p for _, p in keep]


def republished_row_shares(clusters: Sequence[Hashable], people: Sequence[Hashable], republished: Republished
                           ) -> tuple[dict, dict]:
    """Per republished cluster: one person's largest share of its released rows, and of its real rows.

    Released rows are this drop's real rows plus the counterfeits, which belong to no one. Every row
    carries the identical image, so any recogniser names one person (or a tie) for all of them: the
    first share bounds its success on the cluster. The second is what an attacker who knows exactly
    who is in this drop learns: the real rows belong to the present members (evidence, see
    :func:`structural_checks`).
    """
    per: dict[Hashable, Counter] = {c: Counter() for c in republished.members}
    for c, p in zip(clusters, people):
        if c in per:
            per[c][p] += 1
    rows, real = {}, {}
    for c, counts in per.items():
        n_real = sum(counts.values())
        top = max(counts.values(), default=0)
        total = n_real + int(republished.counterfeits.get(c, 0))
        rows[c] = top / total if total else 0.0
        real[c] = top / n_real if n_real else 0.0
    return rows, real


# The drop's own checks (deid.evaluation.validation.drop_checks): when one fails, nothing was de-identified.
_DROP_CHECKS = ("drop_not_empty", "enough_people", "lineage_color", "lineage_canonical_size")


def structural_checks(inputs: GateInputs, config: GateConfig) -> tuple[list[Check], int | None, float | None, bool]:
    """Checks that need no model: cluster sizes, people and person shares per cluster, columns, accounting.

    Republished lineage clusters (``inputs.republished``) are counted twice, and both must hold.
    Their size, distinct people and person shares are those of their *registered basis*: the
    released image is the average of those records, so the k-anonymity of the image is the basis's
    (a drop where members are absent, or bring new photos, does not change the image). And one
    person's share of their *released rows*, counterfeits included as rows of no one, must stay
    <= 1/k: all rows carry one image, so that share is the exact bound on any recogniser naming a
    person for them (:func:`republished_row_shares`); a returning person with new photos is where
    it could exceed the basis share (the lineage plan pads or trims for it).
    """
    k = config.k
    n = inputs.n
    # A drop that failed its own checks (empty, fewer than k people) never reached de-identification:
    # that failure is the reason, not the empty release or the records it did not account for.
    held = [c.name for c in inputs.extra_checks if c.name in _DROP_CHECKS and not c.passed]
    if held and n == 0:
        why = f"not applicable: the drop failed {', '.join(held)}, so no record reached de-identification"
        checks = [Check("release_not_empty", True, n, ">= 1", why, status="not_applicable")]
    else:
        # n counts the records judged here: released if every check passes, withheld if the gate rejects.
        checks = [Check("release_not_empty", n > 0, n, ">= 1",
                        f"{n} de-identified records judged (released only if every check passes)" if n > 0
                        else "no record could be released")]
    min_people = share = None
    exact = False
    if n and inputs.clusters is not None and forms_clusters(config.method):
        cluster_checks, min_people, share, exact = _cluster_checks(inputs, config)
        checks.extend(cluster_checks)
    elif n:
        checks.append(Check("min_cluster_size", True, None, f">= {k}",
                            f"not applicable: method {config.method} forms no clusters, so nothing structural "
                            "bounds re-identification; the empirical attacks decide (every upper bound <= 1/k)",
                            status="not_applicable"))
        # Invariant 1 (every released image is shared by a cluster of >= k distinct people) is what the
        # report validator enforces before anything is published: a method that releases one image per
        # face is rejected here, with its reason, instead of failing that validation after the gate
        # (a "state" error, exit 70). Its attack figures stay in the report as evidence.
        checks.append(Check("released_in_clusters", False, 1, f">= {k} distinct people per released image",
                            f"method {config.method} releases one image per face (no cluster of k people shares "
                            "it): a release needs every image shared by >= k distinct people; use a k-Same "
                            f"method ({', '.join(CLUSTER_METHODS)})"))
    base = FEATURE_RELEASE_BASE_COLUMNS if inputs.kind == "features" else RELEASE_BASE_COLUMNS
    columns = inputs.release_columns or (*base, *config.labels)
    allowed = set(base) | set(config.labels)
    bad = sorted(set(columns) - allowed)
    forbidden = sorted(set(columns) & set(FORBIDDEN_RELEASE_COLUMNS))
    checks.append(Check("no_forbidden_columns", not bad and not forbidden, bad or forbidden or [],
                        sorted(allowed), "release columns: " + ", ".join(columns)))
    total = n + inputs.suppressed + inputs.quarantined
    if held and n == 0:
        checks.append(Check("records_accounted", True, total, f"= {inputs.records_in}", why, status="not_applicable"))
    else:
        checks.append(Check("records_accounted", total == inputs.records_in, total, f"= {inputs.records_in}",
                            f"judged {n} (released, or withheld if rejected) + suppressed {inputs.suppressed} + "
                            f"quarantined {inputs.quarantined} = {total} of {inputs.records_in} in"))
    if inputs.partition_failed:
        checks.append(Check("small_partitions", False, "fail", "every partition >= k people",
                            inputs.partition_detail or "a label partition has fewer than k distinct people"))
    checks.append(quarantine_fraction_check(inputs.records_in, inputs.quarantined, config.max_quarantine_fraction))
    return checks, min_people, share, exact


def _cluster_checks(inputs: GateInputs, config: GateConfig) -> tuple[list[Check], int, float, bool]:
    """The cluster checks of a clustered release (``min_cluster_size``, ``min_distinct_people_per_cluster``,
    ``max_person_share``), republished lineage clusters counted as :func:`structural_checks` says; returns them
    with the fewest distinct people in a cluster, the largest person share and whether the clusters are
    identical copies (the exact bound)."""
    k = config.k
    checks: list[Check] = []
    rep = inputs.republished
    clusters, people = list(inputs.clusters), list(inputs.people)
    row_shares: dict = {}
    real_shares: dict = {}
    if rep is not None and rep.members:
        row_shares, real_shares = republished_row_shares(clusters, people, rep)
        clusters, people = registered_rows(clusters, people, rep.members)
    sizes, distinct, shares = cluster_shares(clusters, people)
    shares = {c: max(v, row_shares.get(c, 0.0)) for c, v in shares.items()}
    min_size, min_people, share = min(sizes.values()), min(distinct.values()), max(shares.values())
    exact = identical_within_clusters(inputs.image_index, list(inputs.clusters))
    unit, copy = ("records", "vector") if inputs.kind == "features" else ("images", "image")
    note = ""
    if row_shares:
        n_fake = sum(int(rep.counterfeits.get(c, 0)) for c in row_shares)
        note = (f"; {len(row_shares)} republished clusters counted on their registered members, and on their "
                f"released rows with {n_fake} counterfeit rows of no one (largest share "
                f"{max(row_shares.values()):.3f})")
    checks.append(Check("min_cluster_size", min_size >= k, min_size, f">= {k}",
                        f"{len(sizes)} clusters; smallest has {min_size} {unit}" + note))
    checks.append(Check("min_distinct_people_per_cluster", min_people >= k, min_people, f">= {k}",
                        f"smallest number of distinct people in a cluster: {min_people}" + note))
    worst = max(shares, key=shares.get)
    presence = ""
    if real_shares:
        presence = (f"; an attacker who knows exactly who is in this drop knows a republished cluster's real rows "
                    f"belong to its present members: up to {max(real_shares.values()):.3f} of them to one person "
                    "(1.0: one member present; DEID_LINEAGE_ABSENT=suppress withholds clusters with absent "
                    "members)")
    checks.append(Check(
        "max_person_share", within_bound(share, k), round(share, 6), f"<= {1.0 / k:.4f}",
        f"largest share of one person's {unit} in a cluster: {share:.3f} (cluster of {sizes[worst]} {unit}, "
        f"{distinct[worst]} people); " + (f"every cluster's members received the identical {copy}, so this is "
                                           "the exact bound on any recogniser's success"
                                           if exact else "clusters are not identical copies: the empirical "
                                           "attacks decide") + note + presence))
    return checks, min_people, share, exact


def clusters_people(method: str) -> bool:
    """Does the method cluster people rather than images (the registry says)? Unknown names: no."""
    from deid.anonymise.methods import FEATURE_ONLY, REGISTRY  # noqa: PLC0415

    spec = REGISTRY.get(method) or FEATURE_ONLY.get(method)
    return spec is not None and spec.clusters_people


def partition_grouping(inputs: GateInputs, k: int, *, per_person: bool = False) -> list[dict]:
    """Per label partition: records, people, clusters formed, distinct released faces and the feasible maximum.

    The feasible maximum is :func:`deid.anonymise.ksame.feasible_clusters` of the partition's images per
    person (``floor(records / k)`` when any grouping exists, else 0); with ``per_person`` (a method that
    clusters people: ``MethodSpec.clusters_people``) of one per person (``floor(people / k)``). Partitions are
    named by their opaque key (``p000``; the report's configuration maps keys to label values), never by a
    label value.
    """
    parts = inputs.partitions if inputs.partitions is not None else np.zeros(inputs.n, dtype=object)
    p_codes, p_keys = value_codes(parts)  # the columns as they are: no list copy of a million records
    c_codes, _ = value_codes(inputs.clusters)
    who, _ = value_codes(inputs.people)
    image = np.asarray(inputs.image_index)
    rows = []
    for j, key in enumerate(p_keys):
        m = p_codes == j
        counts = np.bincount(who[m])
        rows.append({"partition": "all" if inputs.partitions is None else str(key), "records": int(m.sum()),
                     "people": int(np.count_nonzero(counts)), "clusters": int(np.unique(c_codes[m]).size),
                     "faces": int(np.unique(image[m]).size),
                     # A method clustering people: each person counts once (a video of 20 frames is one person).
                     "feasible_max": feasible_clusters(np.minimum(counts, 1) if per_person else counts, k)})
    return rows


def partition_clusters_check(rows: Sequence[Mapping[str, Any]], config: GateConfig) -> Check:
    """Every partition keeps at least ``min_cluster_fraction`` of the clusters a grouping could form (issue 26).

    A partition whose people hold skewed numbers of photos could collapse into a handful of
    clusters (one released face for hundreds of records): the k rules hold, but the release has lost
    that partition's faces. The feasible maximum is exact (a person with ``c`` photos needs ``c``
    clusters; :func:`deid.anonymise.ksame.feasible_clusters`), so this check is a count, not an estimate.
    """
    judged = [r for r in rows if r["feasible_max"] > 0]
    worst = min(judged, key=lambda r: r["clusters"] / r["feasible_max"], default=None)
    table = "; ".join(f"{r['partition']}: {r['records']} records of {r['people']} people -> {r['clusters']} clusters "
                      f"of {r['feasible_max']} feasible" for r in rows)
    if worst is None:
        return Check("partition_clusters", True, None, f">= {config.min_cluster_fraction:g} x feasible maximum",
                     f"not applicable: no partition can form a cluster of {config.k} people ({table})",
                     status="not_applicable")
    ratio = worst["clusters"] / worst["feasible_max"]
    ok = ratio >= config.min_cluster_fraction
    return Check("partition_clusters", ok, round(ratio, 4), f">= {config.min_cluster_fraction:g} x feasible maximum",
                 (f"every partition keeps >= {config.min_cluster_fraction:g} of the clusters its people allow"
                  if ok else f"partition {worst['partition']} collapsed: {worst['records']} records released as "
                  f"{worst['clusters']} clusters where {worst['feasible_max']} were feasible ({ratio:.2f} < "
                  f"{config.min_cluster_fraction:g}); its labels' faces are lost")
                 + f" (lowest {ratio:.3f}; {table})")


def closeness_check(inputs: GateInputs, config: GateConfig) -> Check:
    """No cluster's image is much closer to one member's face than clusters normally are.

    A cluster made of one person's photographs under several subject ids averages away the
    noise and releases that person's face; its image then sits far closer to one member's
    original than a real average of k different people does. Each cluster's distance to its
    closest member (mean absolute grey difference) is compared with the median of that
    distance over all clusters. Measured (k-Same, k = 2..10): the smallest ratio was 0.65 on
    London and 0.56 on synthetic drops; five noisy copies of one face (sigma 3) gave ~0.2.
    Records under different ids with near-identical faces are merged into one person before
    clustering (:mod:`deid.anonymise.identity`); this check is the backstop on the released images.
    """
    name = "cluster_not_close_to_one_member"
    if inputs.clusters is None or inputs.n == 0 or not forms_clusters(config.method):
        return Check(name, True, None, None, "not applicable: no clusters", status="not_applicable")
    c_codes, keys = value_codes(list(inputs.clusters))
    if len(keys) < 5:
        return Check(name, True, None, None, f"not applicable: {len(keys)} clusters are too few for a typical "
                     "distance (needs 5)", status="not_applicable")
    d = np.asarray(inputs.own_distance, dtype=np.float64)
    closest = np.full(len(keys), np.inf)
    np.minimum.at(closest, c_codes, d)
    typical = float(np.median(closest))
    limit = config.closeness_ratio * typical
    worst = int(np.argmin(closest))
    bad = int(np.count_nonzero(closest < limit))
    unit = "(Euclidean, feature units)" if inputs.kind == "features" else "grey levels"
    return Check(name, bad == 0, round(float(closest[worst]), 3), f">= {limit:.3f}",
                 f"{bad} of {len(keys)} clusters lie within {config.closeness_ratio:g} x the median closest-member "
                 f"distance ({typical:.2f} {unit}) of one member; closest {closest[worst]:.2f}")
