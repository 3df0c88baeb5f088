"""The gate's privacy part: the attacked sample, the re-identification attacks (every attacker x mode,
each rate with its one-sided Clopper-Pearson interval, :func:`privacy_checks`), membership disclosure
and the leak checks (near copies, one-person clusters, feature near copies).
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np
from scipy.stats import beta

from deid.evaluation.attacks import ATTACKERS, DEEP_ATTACKERS, FEATURE_ATTACKERS, attack_all
from deid.evaluation.scoring import unique_rows
from deid.evaluation.checks import INSUFFICIENT, Check
from deid.evaluation.membership import measure_membership
from deid.evaluation.leaks import (
    nearest_original_distance,
    nearest_vector_distance,
    other_person_scale,
)
from deid.progress import Progress
from deid.bound import within_bound

from deid.evaluation.gate_rows import AttackRow
from deid.evaluation.gate_order import attack_units, canonical_order, sampling_units
from deid.evaluation.gate_types import COUNTERFEIT, GateConfig, GateInputs

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- statistics


def clopper_pearson(successes: float, n: int, *, confidence: float = 0.95) -> tuple[float, float]:
    """One-sided exact binomial bounds: (lower, upper), each holding with ``confidence``.

    Fractional successes (tie credit) are rounded outwards: down for the lower bound, up for
    the upper, so the interval stays conservative on both sides.

    References
    ----------
    C. J. Clopper, E. S. Pearson. The use of confidence or fiducial limits illustrated in the
    case of the binomial. Biometrika 26(4):404-413, 1934.
    """
    if n <= 0:
        return 0.0, 1.0
    alpha = 1.0 - confidence
    lo_x = max(0, min(n, math.floor(successes + 1e-9)))
    hi_x = max(0, min(n, math.ceil(successes - 1e-9)))
    lower = 0.0 if lo_x == 0 else float(beta.ppf(alpha, lo_x, n - lo_x + 1))
    upper = 1.0 if hi_x == n else float(beta.ppf(1 - alpha, hi_x + 1, n - hi_x))
    return lower, upper


# --------------------------------------------------------------------------- attacks


def attack_sample(inputs: GateInputs, *, max_records: int, seed: int, min_units: int = 0) -> np.ndarray:
    """Indices of the records attacked, in :func:`~deid.evaluation.gate_order.canonical_order`: all of them, or whole
    clusters (or people) at random.

    Sampling whole clusters keeps every cluster's k people together, so the attacker still
    faces the k-way ambiguity the release has; the gallery shrinks to the sample's people,
    which only makes the attacks stronger. Which units are drawn, and the order the records
    come in, follow the records and ``seed``, never their input order (issue 32).

    ``min_units``: at least this many whole clusters (people) when the release has them, even
    beyond ``max_records`` (the gate passes ``GateConfig.min_probes``). A k-Same cluster is one
    distinct released image, so a sample of fewer clusters gives its naive and parrot modes fewer
    distinct probes than a rate needs to be evidence (:func:`privacy_checks`). The extra units are
    the next ones of the same seeded order: the sample only grows.
    """
    order = canonical_order(inputs)
    return order[units_sample(attack_units(inputs)[order], max_records=max_records, seed=seed, min_units=min_units)]


def units_sample(units: np.ndarray, *, max_records: int, seed: int, min_units: int = 0) -> np.ndarray:
    """Positions in ``units`` (each record's unit ranked by its text, 0..m-1) of whole units drawn at random, ascending.

    Every position when there are at most ``max_records``. The units are ranked by their text
    (:func:`~deid.evaluation.gate_order.text_ranks`) before the seeded permutation, so the draw does not depend on
    where in the records a unit first appears; ``min_units`` as :func:`attack_sample`.
    """
    n = len(units)
    if n <= max_records:
        return np.arange(n)
    n_units = int(units.max()) + 1
    order = np.random.default_rng(seed).permutation(n_units)
    sizes = np.bincount(units, minlength=n_units)
    take = order[np.cumsum(sizes[order]) <= max_records]
    if len(take) < min(max(int(min_units), 1), n_units):
        take = order[:max(int(min_units), 1)]
    return np.flatnonzero(np.isin(units, take))


def gate_attack_sample(inputs: GateInputs, config: GateConfig) -> np.ndarray:
    """The gate's attacked records: ``attack_sample`` records, at least ``min_probes`` whole clusters (people)."""
    return attack_sample(inputs, max_records=config.attack_sample, seed=config.seed, min_units=config.min_probes)


def counterfeit_sample(inputs: GateInputs, idx: np.ndarray, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The counterfeit rows attacked with the sampled records ``idx``: (uint8 images, people = no one).

    Every counterfeit of a republished cluster the sample holds real records of, and of the
    clusters released with counterfeits only, a seeded share as large as the sample's share of the
    release's clusters (all of them when the whole release is attacked).
    """
    rep = inputs.republished
    width = int(np.prod(inputs.shape))  # (h, w) faces or (n_features,) vectors
    dtype = np.float32 if inputs.kind == "features" else np.uint8  # as released: pixels, or float32 vectors
    none = np.zeros((0, width), dtype), np.zeros(0, dtype=object)
    if rep is None or not any(rep.counterfeits.values()) or inputs.clusters is None:
        return none
    present = set(inputs.clusters.tolist())
    sampled = set(inputs.clusters[np.asarray(idx, dtype=np.int64)].tolist())
    only = sorted((c for c, m in rep.counterfeits.items() if m and c not in present), key=str)
    n_only = len(only) if len(sampled) >= len(present) else round(len(only) * len(sampled) / max(len(present), 1))
    chosen = [only[i] for i in sorted(np.random.default_rng(seed).permutation(len(only))[:n_only])]
    keys = [c for c in sorted(sampled & set(rep.counterfeits), key=str) if rep.counterfeits[c]] + chosen
    if not keys:
        return none
    images = np.vstack([np.broadcast_to(np.asarray(rep.images[c], dtype=dtype).reshape(1, -1),
                                        (int(rep.counterfeits[c]), width)) for c in keys])
    return images, np.full(len(images), COUNTERFEIT, dtype=object)


def points_of(inputs: GateInputs, idx: np.ndarray) -> list | None:
    """The landmark points of the records ``idx`` (None when the release's method got none)."""
    return None if inputs.points is None else [inputs.points[int(i)] for i in idx]


def _parrot(deidentify: Callable[..., np.ndarray], people: np.ndarray, partitions: np.ndarray | None,
            labels: dict[str, np.ndarray] | None = None, points: list | None = None
            ) -> Callable[[np.ndarray], np.ndarray]:
    """The parrot attacker de-identifies its own gallery of originals the way the release was made.

    With the same inputs as the release: its people, partitions, labels and, where the method
    took them, the landmark points (a k-same-m release shaped from points is not re-made by flow).
    """
    extra = {} if points is None else {"points": points}
    return lambda originals: deidentify(originals, people=people, partitions=partitions,
                                        labels={x: list(v) for x, v in (labels or {}).items()} or None, **extra)


def attack_modes(inputs: GateInputs, config: GateConfig) -> tuple[str, ...]:
    """The configured attack modes this release can be attacked in (parrot needs the method)."""
    return tuple(m for m in config.modes if m != "parrot" or inputs.deidentify is not None)


def attack_groups(inputs: GateInputs, config: GateConfig) -> list[tuple[int | None, tuple[str, ...]]]:
    """The attackers in order, grouped by the records they can afford: (cap or None for all, names).

    Attackers that can afford the whole sample share one pass (one parrot gallery, one set of
    distinct images); an attacker may cap the records it attacks (a deep recogniser embeds
    every face it sees).
    """
    default = FEATURE_ATTACKERS if inputs.kind == "features" else ATTACKERS
    names = list(config.attackers) if config.attackers is not None else list(default)
    groups: dict[int | None, list[str]] = {}
    for name in names:
        groups.setdefault(config.deep_attack_sample if name in DEEP_ATTACKERS else None, []).append(name)
    return [(cap, tuple(group)) for cap, group in groups.items()]


def attack_rows(inputs: GateInputs, config: GateConfig, *, cap: int | None, attackers: Sequence[str],
                on_pair: Callable[[str, str], None] | None = None) -> list[AttackRow]:
    """Rates of ``attackers`` in every mode on the attacked sample (at most ``cap`` records of it).

    Rows of one attacker do not depend on which others run in the same call: the gate may run
    its attackers one call each, in other processes, and get the same rows.
    """
    idx = gate_attack_sample(inputs, config)
    released, originals = inputs.fetch(idx)
    people = inputs.people[idx]
    modes = attack_modes(inputs, config)
    parts = None if inputs.partitions is None else inputs.partitions[idx]
    labs = {x: np.asarray(v)[idx] for x, v in inputs.labels.items()}
    sub = np.arange(len(idx))
    if cap is not None and len(idx) > cap:
        # The deep attackers' share: whole units of the attacked sample, which is in canonical order already.
        units = sampling_units(None if inputs.clusters is None else inputs.clusters[idx], people)
        sub = units_sample(units, max_records=cap, seed=config.seed + 1, min_units=config.min_probes)
    pts = points_of(inputs, idx)
    parrot = None if "parrot" not in modes else _parrot(
        inputs.deidentify, people[sub], None if parts is None else parts[sub], {x: v[sub] for x, v in labs.items()},
        None if pts is None else [pts[i] for i in sub])
    fake, no_one = counterfeit_sample(inputs, idx[sub], seed=config.seed + 2)
    rel = np.vstack([released[sub], fake]) if len(fake) else released[sub]
    rows = attack_all(originals=originals[sub], original_people=people[sub], released=rel,
                      released_people=np.concatenate([people[sub], no_one]), shape=inputs.shape, modes=modes,
                      parrot=parrot, attackers=list(attackers), on_pair=on_pair)
    # The tie credit behind each rate is not reported (the rate is the credited share).
    return [AttackRow(attacker=r["attacker"], mode=r["mode"], rate=r["rate"], n_probes=r["n_probes"],
                      records=int(len(sub))) for r in rows]


def privacy_checks(inputs: GateInputs, config: GateConfig, *, exact: bool, rows: list[AttackRow] | None = None
                   ) -> tuple[list[Check], list[AttackRow], float | None, dict]:
    """Every attacker in every mode on a bounded sample, each rate with its interval.

    ``rows``: the attack rows (:func:`attack_rows` of every :func:`attack_groups` group, in that
    order) when they were computed elsewhere; by default they are computed here. Returned scored: new rows
    with their interval and status.

    Counterfeit rows of republished lineage clusters (``inputs.republished``) are attacked as what
    they are in the release: rows that carry their cluster's stored image and labels, under a
    random name, in random order, and belong to no one. They join the released side of every mode
    (naive and parrot probes, the reverse gallery) with a person that matches nobody; they have no
    original, so they are never a reverse probe nor in a gallery of originals. An attacker holding
    every release cannot tell them from the real rows of their cluster (bit-identical), so naming
    a person for one is wrong and, in the reverse gallery, they take their share of a tie. The
    gallery of originals holds this drop's real records: the absent members' faces are not in the
    drop. For a fixed recogniser, leaving them out can only raise the credit of a released row
    (fewer candidates to lose to: naive and parrot modes; the reverse mode's probes are this drop's
    faces either way), so the rates are those of an attacker who also knows who is absent, and at
    least those of one who holds the absent members' faces and does not know they left (the
    m-invariance premise). A returning person's new photo is a real record with its own original,
    released as the registered image: an ordinary probe and gallery item.

    Measuring this drop's real rows alone (counterfeits dropped) is not the release's rate: it
    conditions on knowing which rows are real, which the release hides, and it would exceed 1/k
    for release 1's own rows restricted to the people who came back. What an attacker who knows
    who is present does learn (a cluster's real rows belong to its present members) is stated by
    ``max_person_share`` (:func:`structural_checks`).

    Evidence before a figure: a row from fewer than ``config.min_probes`` distinct probes gets the
    status ``insufficient_evidence`` (its n and interval are kept); it is never the headline
    ``max_rate`` and never decides the check. The other rows get ``pass`` or ``fail`` by the rule
    above. The samples take at least ``min_probes`` whole clusters (:func:`gate_attack_sample`), so
    a row is short of probes only when the release itself has fewer distinct images than that
    (e.g. a partition released as one cluster). If every row is short, ``max_rate`` is None and the
    check is ``inconclusive``: it lets an exact release (identical images per cluster) through, whose
    privacy the exact structural checks decide, and blocks any other (nothing bounds it).
    """
    k = config.k
    if inputs.n == 0:
        return [Check("reidentification_rate", False, None, f"<= {1.0 / k:.4f}", "nothing released to attack")], \
            [], None, {}
    idx = gate_attack_sample(inputs, config)
    if rows is None:
        groups = attack_groups(inputs, config)
        progress = Progress(f"gate: attacks on {len(idx)} records", unit="attacker x mode pairs").start(
            sum(len(g) for _, g in groups) * len(attack_modes(inputs, config)))
        rows = [r for cap, group in groups for r in attack_rows(
            inputs, config, cap=cap, attackers=group, on_pair=lambda a, m: progress.advance(note=f"{a}/{m}"))]
    m = len(rows)
    # Bonferroni: the family of m one-sided tests keeps the stated confidence overall (every row counts in the
    # family, whether or not it has the evidence to decide: the bounds stay those of the whole family).
    level = 1.0 - (1.0 - config.confidence) / m
    bound = 1.0 / k
    need = config.min_probes
    rows, failing, thin = _rate_statuses(rows, level=level, bound=bound, exact=exact, need=need)
    sample = {"records": int(len(idx)), "of": inputs.n, "seed": config.seed,
              "unit": "cluster" if inputs.clusters is not None else "person", "confidence": config.confidence,
              "bonferroni_over": m, "min_probes": need, "insufficient": len(thin)}
    n_fake = len(counterfeit_sample(inputs, idx, seed=config.seed + 2)[0])
    fake_note = ""
    if n_fake:
        sample["counterfeits"] = n_fake
        fake_note = (f"; {n_fake} counterfeit rows of republished lineage clusters attacked as released rows of no "
                     "one (no original)")
    thin_note = ""
    if thin:
        most = max(r.n_probes for r in thin)
        thin_note = (f"; {len(thin)} of {m} pairs insufficient evidence (fewer than {need} distinct probes, at most "
                     f"{most}: {', '.join(sorted({r.name for r in thin}))}): reported, "
                     "neither the headline nor deciding")
    deciding = [r for r in rows if r.deciding]
    if not deciding:
        return [_inconclusive_rate_check(inputs, rows, need=need, exact=exact, bound=bound, note=fake_note)], \
            rows, None, sample
    check, max_rate = _decided_rate_check(deciding, failing, m=m, need=need, exact=exact, bound=bound,
                                          confidence=config.confidence, note=thin_note + fake_note)
    return [check], rows, max_rate, sample


def _rate_statuses(rows: list[AttackRow], *, level: float, bound: float, exact: bool,
                   need: int) -> tuple[list[AttackRow], list[AttackRow], list[AttackRow]]:
    """Each attack row with its one-sided Clopper-Pearson interval at ``level`` and its status (rate rounded);
    returns (every scored row, the failing ones, the ones short of ``need`` distinct probes).

    An exact release fails a row only if its lower bound exceeds ``bound``, any other if its upper bound does.
    """
    scored: list[AttackRow] = []
    failing: list[AttackRow] = []
    thin: list[AttackRow] = []
    for row in rows:
        lo, hi = clopper_pearson(row.rate * row.n_probes, row.n_probes, confidence=level)
        above = not within_bound(lo if exact else hi, limit=bound)
        # Too few distinct probes to be evidence: kept in the report with its n and interval, never the
        # headline, never deciding (a [0, 1] interval from one probe says nothing about the release).
        short = row.n_probes < need
        r = replace(row, rate=round(row.rate, 6), lower=round(lo, 6), upper=round(hi, 6),
                    status=INSUFFICIENT if short else "fail" if above else "pass")
        scored.append(r)
        if short:
            thin.append(r)
        elif above:
            failing.append(r)
    return scored, failing, thin


def _inconclusive_rate_check(inputs: GateInputs, rows: list[AttackRow], *, need: int, exact: bool, bound: float,
                             note: str) -> Check:
    """The ``reidentification_rate`` check when every attack row is short of ``need`` distinct probes:
    inconclusive, passing only an exact release (its structural checks decide); ``note``: the counterfeits'."""
    m = len(rows)
    most = max(rows, key=lambda r: r.n_probes)
    units = len(set(inputs.clusters.tolist())) if inputs.clusters is not None else len(set(inputs.people.tolist()))
    why = (f"insufficient evidence: every one of {m} attacker x mode pairs had fewer than {need} distinct probes "
           f"(at most {most.n_probes}, {most.name}; the release has {units} "
           f"{'clusters' if inputs.clusters is not None else 'people'}), so no rate is a headline or a decision")
    if exact:
        detail = (why + "; every cluster's members share one image, so the exact structural checks "
                  "(min_distinct_people_per_cluster, max_person_share) decide privacy" + note)
    else:
        detail = (why + "; the clusters are not identical copies, so no exact bound stands in for the attacks: "
                  "nothing shows the release keeps 1/k (more records, or a k-Same method)" + note)
    return Check("reidentification_rate", exact, None, f"<= {bound:.4f}", detail, status="inconclusive",
                 interval=(most.lower, most.upper), n=most.n_probes)


def _decided_rate_check(deciding: list[AttackRow], failing: list[AttackRow], *, m: int, need: int, exact: bool, bound: float,
                        confidence: float, note: str) -> tuple[Check, float]:
    """The ``reidentification_rate`` check decided by the ``deciding`` rows (those with at least ``need``
    distinct probes) and the headline ``max_rate``, their highest rate; ``note``: the short rows' and the
    counterfeits'."""
    worst = max(deciding, key=lambda r: r.rate)
    max_rate = worst.rate
    rule = ("fails only if a lower bound exceeds 1/k (the exact bound max_person_share decides)" if exact
            else "every upper bound must be <= 1/k (no exact bound: clusters are not identical copies)")
    detail = (f"max over {len(deciding)} attacker x mode pairs with at least {need} distinct probes: "
              f"{worst.name} {worst.rate:.3f} "
              f"[{worst.lower:.3f}, {worst.upper:.3f}] on {worst.n_probes} distinct probes; "
              f"one-sided {confidence:.0%} Clopper-Pearson, Bonferroni over {m}; {rule}")
    if failing:
        f0 = max(failing, key=lambda r: r.upper or 0.0)
        detail += (f"; {len(failing)} failing, e.g. {f0.name} {f0.rate:.3f} "
                   f"[{f0.lower:.3f}, {f0.upper:.3f}]")
    detail += note
    return Check("reidentification_rate", not failing, max_rate, f"<= {bound:.4f}", detail,
                 interval=(worst.lower, worst.upper), n=worst.n_probes), max_rate


def membership_disclosure(inputs: GateInputs, config: GateConfig) -> dict:
    """Membership disclosure of the release's method on the attacked sample (:mod:`deid.evaluation.membership`).

    The attacked sample's people are split at random into members and non-members; the run's method
    re-makes a release from the members alone (as the parrot attacker does), and every configured
    attacker that can afford the sample (deep recognisers only within ``deep_attack_sample`` records)
    tells members from non-members by their photos' nearest released face. k-Same bounds linking a
    released face to a person (1/k), not this: the figure stands beside the 1/k rate.
    """
    if inputs.deidentify is None:
        return {"status": "not_applicable", "reason": "the run's method cannot be re-run on a subset of people"}
    idx = gate_attack_sample(inputs, config)
    _, originals = inputs.fetch(idx)
    default = FEATURE_ATTACKERS if inputs.kind == "features" else ATTACKERS
    names = list(config.attackers) if config.attackers is not None else list(default)
    names = [a for a in names if a not in DEEP_ATTACKERS or len(idx) <= config.deep_attack_sample]
    known = {**ATTACKERS, **FEATURE_ATTACKERS}
    log.info("gate: membership disclosure on %d records, %d attackers", len(idx), len(names))
    out = measure_membership(
        originals=originals, people=inputs.people[idx], shape=inputs.shape, deidentify=inputs.deidentify,
        attackers={a: known[a] for a in names}, partitions=None if inputs.partitions is None else
        inputs.partitions[idx], labels={x: np.asarray(v)[idx] for x, v in inputs.labels.items()},
        points=points_of(inputs, idx), confidence=config.confidence, seed=config.seed)
    out["records"] = int(len(idx))
    return out


def leak_checks(inputs: GateInputs, config: GateConfig) -> list[Check]:
    """No released face is (nearly) a copy of an original; no released file carries metadata."""
    threshold = config.leak_threshold
    checks = []
    if inputs.n and inputs.kind == "features":
        checks.append(feature_near_copy_check(inputs, config))
    elif inputs.n:
        # Every record against its own original (O(N)); all pairs on the bounded sample.
        own = np.asarray(inputs.own_distance)
        idx = gate_attack_sample(inputs, config)
        released, originals = inputs.fetch(idx)
        fake, _ = counterfeit_sample(inputs, idx, seed=config.seed + 2)  # stored images released again
        distinct, _ = unique_rows(np.vstack([released, fake]) if len(fake) else released)
        cross, _ = nearest_original_distance(distinct, originals, threshold=threshold)
        low = float(min(own.min(), cross.min()))
        n_ident = int(np.count_nonzero(own == 0) + np.count_nonzero(cross == 0))
        n_below = int(np.count_nonzero(own < threshold) + np.count_nonzero(cross < threshold))
        checks.append(Check("no_near_copies", low >= threshold, round(low, 4), f">= {threshold}",
                            f"{n_ident} identical and {n_below} within {threshold} grey levels (mean absolute "
                            f"difference) of an original aligned face; every record vs its own original, and "
                            f"{len(distinct)} distinct released images vs {len(idx)} originals"))
    if inputs.n and inputs.clusters is not None:
        checks.append(one_person_clusters_check(inputs, config))
    bad_files = sorted(inputs.file_metadata)
    checks.append(Check("no_source_metadata", not bad_files, len(bad_files), "= 0",
                        "clean" if not bad_files else f"{bad_files[:5]} carry {inputs.file_metadata[bad_files[0]]}"))
    return checks


def one_person_clusters_check(inputs: GateInputs, config: GateConfig) -> Check:
    """No released cluster is one person under several ids (:mod:`deid.evaluation.identity_checks`).

    The clusters of the gate's attack sample (whole clusters; every cluster of a release of at most
    ``attack_sample`` records), and those holding identity resolution's near misses (``inputs.suspects``,
    whatever the sample: at scale the sample holds few clusters, and a Sybil drop resolution missed looks
    like near misses); faces go through a cheap first pass over every one of them, the recogniser (at most
    ``identity_check_max`` faces) on the ones it flags and on the near misses' clusters first.
    """
    from deid.evaluation import identity_checks  # noqa: PLC0415

    idx, must = identity_check_sample(inputs, config)  # read with the other samples (read_samples_once)
    released, originals = inputs.fetch(idx)
    clusters, people = np.asarray(inputs.clusters, dtype=object)[idx], inputs.people[idx]
    if inputs.kind == "features":
        return identity_checks.feature_check(clusters, people, originals, released, confidence=config.confidence)
    return identity_checks.image_check(clusters, people, originals, released, shape=tuple(inputs.shape),
                                       budget=config.identity_check_max, total=inputs.n,
                                       confidence=config.confidence, seed=config.seed, must=must)


def identity_check_sample(inputs: GateInputs, config: GateConfig) -> tuple[np.ndarray, list]:
    """The records the within-cluster check reads (the attack sample and the near misses' clusters, sorted) and those
    clusters (:func:`near_miss_records`)."""
    extra, must = near_miss_records(inputs, config)
    return np.union1d(gate_attack_sample(inputs, config), extra).astype(np.int64), must


def near_miss_records(inputs: GateInputs, config: GateConfig) -> tuple[np.ndarray, list]:
    """The records of the near misses' clusters (:func:`suspect_clusters`, up to a third of ``identity_check_max``
    records) and those clusters."""
    must = suspect_clusters(inputs, limit=max(config.identity_check_max // 3, 0))
    if not must:
        return np.zeros(0, np.int64), must
    return np.flatnonzero(np.isin(np.asarray(inputs.clusters, dtype=object), np.asarray(must, dtype=object))), must


def suspect_clusters(inputs: GateInputs, *, limit: int) -> list:
    """The clusters of ``inputs.suspects`` (identity resolution's near misses, closest first), in that order, whole
    clusters up to ``limit`` records (what the recogniser's share of the check can look at)."""
    if inputs.suspects is None or not len(inputs.suspects) or inputs.clusters is None or limit <= 0:
        return []
    clusters = np.asarray(inputs.clusters, dtype=object)
    sizes: dict = {}
    for c in clusters.tolist():
        sizes[c] = sizes.get(c, 0) + 1
    out: list = []
    used = 0
    for c in dict.fromkeys(clusters[np.asarray(inputs.suspects, dtype=np.int64)].tolist()):
        if c is None or (out and used + sizes[c] > limit):
            continue
        out.append(c)
        used += sizes[c]
    return out


def feature_near_copy_check(inputs: GateInputs, config: GateConfig) -> Check:
    """No released feature vector is (nearly) a copy of an original vector.

    Vectors have no grey levels: the threshold is ``feature_near_copy_ratio`` (0.2) times the
    median distance from an original to the nearest record of *another* person, measured on the
    attacked sample's originals (the typical distance between different people). Every record
    is compared with its own original (``own_distance``), the sample's distinct released
    vectors with every original of the sample.
    """
    own = np.asarray(inputs.own_distance, dtype=np.float64)
    idx = gate_attack_sample(inputs, config)
    released, originals = inputs.fetch(idx)
    distinct, _ = unique_rows(np.ascontiguousarray(released))
    cross = nearest_vector_distance(distinct, originals)
    scale = other_person_scale(originals, inputs.people[idx])
    low = float(min(own.min(), cross.min()))
    n_ident = int(np.count_nonzero(own == 0) + np.count_nonzero(cross == 0))
    if scale is None or scale <= 0:
        ok = n_ident == 0
        return Check("no_near_copies", ok, round(low, 6), "> 0",
                     f"{n_ident} released vectors identical to an original; the sample holds one person, so no "
                     "typical distance between people sets a near-copy threshold", status="pass" if ok else "fail")
    threshold = config.feature_near_copy_ratio * scale
    n_below = int(np.count_nonzero(own < threshold) + np.count_nonzero(cross < threshold))
    return Check("no_near_copies", low >= threshold, round(low, 6), f">= {threshold:.6g}",
                 f"{n_ident} identical and {n_below} within {config.feature_near_copy_ratio:g} x the median "
                 f"nearest-other-person distance ({scale:.4g}, Euclidean) of an original vector; every record vs "
                 f"its own original, and {len(distinct)} distinct released vectors vs {len(idx)} originals")
