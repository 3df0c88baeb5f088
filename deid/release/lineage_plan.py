"""Planning a new release of a dataset against its lineage (m-invariance, Xiao & Tao 2007).

:func:`plan_release` decides, for every record of a new drop, whether it is released as a registered
cluster's stored average (bit-identical: :class:`Republish`, padded with counterfeits where members are
absent or a returning person would exceed 1/k), clustered among the new people (``new_records``), or
suppressed with a reason; registered clusters this run's identity merges leave below k people are
withheld. The result is a :class:`LineagePlan`; :func:`deid.release.lineage.build_release` turns it into
the release once the new records are clustered.

**The rules** (m-invariance adapted to face averages). Policy ``invariant``:

1. A record already registered (same source fingerprint) goes to its registered cluster. A new
   record of a returning person goes to one of that person's registered clusters: the one of
   the record's partition (when ``partitions`` is given; none -> suppressed,
   ``returning_partition_mismatch``), the one with the fewest of their records so far, then
   the lowest key. Every such record is released as the cluster's *stored* average.
2. Registered clusters never change: no new member joins, no average is recomputed.
3. Records of people never released are ``new_records``: the caller runs k-Same on them only.
   Fewer than ``k`` new people (per partition, when given) -> they wait (suppressed,
   ``waiting_for_k_new_people``) until enough arrive.
4. A registered cluster some of whose basis people have no record in it this time:
   ``absent="republish"`` releases it anyway, padded with counterfeit records (stored average)
   up to the size it was first released with; ``absent="suppress"`` suppresses the whole
   cluster (its records too). With ``republish`` every registered cluster reappears at least at
   its first size, whoever left, so absence reveals nothing; the counterfeits are counted in the
   private registry only. A registered cluster with fewer than ``k`` people (``k`` was raised)
   is suppressed.
5. No person holds more than 1/k of a republished cluster's released rows (every row carries
   the same image: a recogniser naming one person for it is right on that person's share of the
   rows). A returning person with new photos could exceed it: ``republish`` adds counterfeits
   until the cluster has at least ``k`` times that person's rows; ``suppress`` withholds the
   surplus (``returning_surplus_over_1_k``, new photos first), as the partition stage does for
   new clusters.

Policy ``release-once``: every record of a person already released (or a registered record) is
suppressed (``released_before``); only new people are clustered; registered clusters retire.

**Who is one person.** Records are keyed by what cannot flip between runs: the source fingerprint
and the normalised steward id (``people``). Who is one person is an *overlay* for the k rules
(issue 27): this run's identity merges (``persons``, the effective person of each record) and
registered bytes now listed under another steward id (the same photograph: the same person under an
alias) join pseudonyms for every count above (people per cluster, 1/k shares, new people per
partition), and a person is returning when anyone they are joined with is. A merge can thus neither
re-key nor block the lineage; it can only leave a registered cluster with fewer than ``k`` people
among its basis records, or one person above 1/k of them: such a cluster is re-checked and withheld
(``merged_below_k``, ``merged_over_1_k``; with ``merges="refuse"`` the gate's ``lineage_merges``
check also fails the run). An un-merge only adds people to a count: nothing changes.
"""
from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

from deid.errors import ConfigError
from deid.release.lineage_state import (ABSENT_POLICIES, BELOW_K, CLUSTER_SUPPRESSED, MEMBER_ABSENT, MERGE_POLICIES,
                                        MERGED_BELOW_K, MERGED_OVER_SHARE, PARTITION_MISMATCH, POLICIES,
                                        RELEASED_BEFORE, RETIRED, SURPLUS, WAITING, LineageCluster, LineageState,
                                        pseudonymize)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Republish:
    """A registered cluster released again: these drop records (and counterfeits) get its stored average."""

    cluster: LineageCluster
    records: tuple[int, ...]      # drop record indices released as the stored average
    n_counterfeit: int            # counterfeit records (stored average, the cluster's labels, no source)


@dataclass(frozen=True, eq=False)
class LineagePlan:
    """What a new drop may release, given the lineage (see :func:`plan_release`).

    Every drop record index is in exactly one of: a :class:`Republish`'s ``records``,
    ``new_records`` (the caller clusters them with k-Same among themselves only) or ``suppressed``.
    """

    dataset: str
    policy: str
    absent: str
    k: int
    based_on_seq: int
    based_on_head: str
    pseudonyms: tuple[str, ...]            # per drop record
    fingerprints: tuple[str, ...]          # per drop record
    partitions: tuple[tuple[str, ...], ...] | None
    republish: tuple[Republish, ...]
    new_records: tuple[int, ...]
    suppressed: tuple[tuple[int, str], ...]            # (record index, reason)
    suppressed_clusters: tuple[tuple[str, str], ...]   # (registered cluster key, reason)
    n_new_people: int
    n_returning_people: int
    n_waiting_people: int
    label_names: tuple[str, ...] = ()
    record_labels: tuple[tuple[str, ...], ...] | None = None   # per drop record, released label values
    merges: str = "withhold"                                   # MERGE_POLICIES (DEID_LINEAGE_MERGES)
    # The overlay for the k rules: pseudonym -> the pseudonym representing its person in this run, for the
    # pseudonyms this run joins to another (identity merges, registered bytes under another steward id).
    merged: Mapping[str, str] = field(default_factory=dict)
    # merged_people (groups of several pseudonyms), aliased_records (registered under another pseudonym),
    # rechecked_clusters (registered clusters holding a joined pseudonym): the report's lineage.merges.
    merge_counts: Mapping[str, int] = field(default_factory=dict)

    @property
    def n_counterfeit(self) -> int:
        return sum(r.n_counterfeit for r in self.republish)

    @property
    def withheld_by_merges(self) -> tuple[tuple[str, str], ...]:
        """The registered clusters this run's merges withhold: (key, :data:`MERGED_BELOW_K` or
        :data:`MERGED_OVER_SHARE`)."""
        return tuple(x for x in self.suppressed_clusters if x[1] in (MERGED_BELOW_K, MERGED_OVER_SHARE))

    def merges_summary(self) -> dict[str, Any]:
        """The report's ``merges`` entry: the policy and counts (no pseudonym, fingerprint or cluster key)."""
        reasons = Counter(r for _, r in self.withheld_by_merges)
        return {"policy": self.merges, **{f: int(self.merge_counts.get(f, 0)) for f in _MERGE_COUNT_FIELDS},
                "withheld_clusters": sum(reasons.values()), "withheld_by_reason": dict(sorted(reasons.items()))}

    def summary(self) -> dict[str, Any]:
        """Counts and decisions for the signed report: no pseudonym, fingerprint or cluster key."""
        reasons = Counter(r for _, r in self.suppressed)
        return {"dataset": self.dataset, "policy": self.policy, "absent": self.absent, "k": self.k,
                "based_on_entry": self.based_on_seq, "republished_clusters": len(self.republish),
                "republished_records": sum(len(r.records) for r in self.republish),
                "counterfeit_records": self.n_counterfeit,
                "suppressed_registered_clusters": len(self.suppressed_clusters),
                "new_records": len(self.new_records), "new_people": self.n_new_people,
                "returning_people": self.n_returning_people, "waiting_people": self.n_waiting_people,
                "suppressed_records": len(self.suppressed), "suppressed_by_reason": dict(sorted(reasons.items())),
                "merges": self.merges_summary()}


_MERGE_COUNT_FIELDS = ("merged_people", "aliased_records", "rechecked_clusters")


def _check_policy(policy: str, absent: str, k: Any) -> None:
    if policy not in POLICIES:
        raise ConfigError(f"lineage policy={policy!r} must be one of {POLICIES} (DEID_LINEAGE_POLICY); "
                          "'invariant' keeps returning people in their registered cluster")
    if absent not in ABSENT_POLICIES:
        raise ConfigError(f"absent={absent!r} must be one of {ABSENT_POLICIES} (DEID_LINEAGE_ABSENT)")
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise ConfigError(f"k={k!r} must be an integer >= 2")


def partition_keys(partitions: Sequence[Hashable] | None, n: int) -> tuple[tuple[str, ...], ...] | None:
    if partitions is None:
        return None
    shared: dict = {}  # one tuple per distinct key, shared by its records (8 bytes each; issue 13)

    def key(p):
        k = tuple(map(str, p)) if isinstance(p, tuple | list) else (str(p),)
        return shared.setdefault(k, k)

    out = tuple(key(p) for p in partitions)
    if len(out) != n:
        raise ConfigError(f"partitions has {len(out)} entries but there are {n} records; pass one per record")
    return out


def plan_release(state: LineageState, people: Sequence[Hashable], record_fingerprints: Sequence[str], *,
                 key: bytes, k: int, policy: str = "invariant", absent: str = "republish",
                 partitions: Sequence[Hashable] | None = None,
                 record_labels: Sequence[Sequence[Hashable]] | None = None, label_names: Sequence[str] = (),
                 persons: Sequence[Hashable] | None = None, merges: str = "withhold") -> LineagePlan:
    """Plan a new release of a dataset so that it adds no information about anyone already released.

    m-invariance adapted to face averages (Xiao & Tao 2007): the five rules of policy ``invariant``, policy
    ``release-once`` and who is one person are in the module docstring (:mod:`deid.release.lineage_plan`).

    Parameters
    ----------
    state : LineageState
        The dataset's registered lineage (:func:`deid.release.lineage_registry.Registry.load`).
    people : sequence of hashable
        Person id (subject id) of each drop record; pseudonymised here with ``key``.
    record_fingerprints : sequence of str
        SHA-256 of each record's source bytes (``source_sha256`` of the ingested table).
    key : bytes
        The steward's 32-byte key (the linkage key).
    k : int
        Minimum number of people per cluster.
    policy : {"invariant", "release-once"}
    absent : {"republish", "suppress"}
    partitions : sequence of hashable, optional
        Partition key of each record (label values tuple, as given to k-Same-Select).
    record_labels : sequence of sequences, optional
        The released label values of each record (in ``label_names`` order). New clusters register
        them per basis record, so a later release of the cluster reproduces its label mix exactly
        (:meth:`LineageRelease.republished_labels`).
    label_names : sequence of str
        The names of the labels in ``record_labels``.
    persons : sequence of hashable, optional
        The effective person of each record after this run's identity resolution
        (:func:`deid.anonymise.identity.resolve_people`); default ``people`` (no merges).
    merges : {"withhold", "refuse"}
        What a registered cluster the merges leave below k people or above 1/k does: withheld from
        this release, or also the run refused by the gate (``DEID_LINEAGE_MERGES``).

    Returns
    -------
    LineagePlan

    References
    ----------
    X. Xiao, Y. Tao. M-invariance: towards privacy preserving re-publication of dynamic datasets. SIGMOD 2007.
    """
    _check_policy(policy, absent, k)
    n = len(people)
    _check_plan_inputs(merges, n, record_fingerprints, persons)
    pseud = pseudonymize(key, state.dataset, people)
    fps = tuple(str(f) for f in record_fingerprints)
    parts = partition_keys(partitions, n)
    labs = record_label_tuples(record_labels, label_names, n)
    who = _Overlay.of(state, pseud, fps, _effective(key, state.dataset, people, persons, pseud))
    suppressed: list[tuple[int, str]] = []
    assigned, new_idx = _assign_records(state, pseud, fps, parts, policy, who, suppressed)
    if policy == "invariant":
        republish, suppressed_clusters, rechecked = _registered_clusters(state, assigned, pseud, fps, k=k,
                                                                         absent=absent, who=who, suppressed=suppressed)
    else:
        republish, suppressed_clusters, rechecked = [], [(ckey, RETIRED) for ckey in sorted(state.clusters)], 0
    new_records, waiting = _new_people(new_idx, parts, pseud, who.root, k, suppressed)
    n_new_people = len({who.root(pseud[i]) for i in new_idx})
    _log_plan(state.dataset, suppressed_clusters, waiting, k=k, merges=merges)
    return LineagePlan(
        dataset=state.dataset, policy=policy, absent=absent, k=k, based_on_seq=state.seq,
        based_on_head=state.head, pseudonyms=tuple(pseud), fingerprints=fps, partitions=parts,
        republish=tuple(republish), new_records=tuple(sorted(new_records)),
        suppressed=tuple(sorted(suppressed)), suppressed_clusters=tuple(suppressed_clusters),
        n_new_people=n_new_people, n_returning_people=len(who.returning),
        n_waiting_people=len(waiting), label_names=tuple(map(str, label_names)), record_labels=labs,
        merges=merges, merged=who.merged,
        merge_counts={"merged_people": len(who.members_of), "aliased_records": who.n_aliased,
                      "rechecked_clusters": rechecked},
    )


def _check_plan_inputs(merges: str, n: int, record_fingerprints: Sequence[str],
                       persons: Sequence[Hashable] | None) -> None:
    """:func:`plan_release`'s ``merges`` policy checked, and ``record_fingerprints`` and ``persons`` (when given)
    checked to hold one entry per record (``n``).

    Raises
    ------
    ConfigError
        Naming the argument and what to pass.
    """
    if merges not in MERGE_POLICIES:
        raise ConfigError(f"merges={merges!r} must be one of {MERGE_POLICIES} (DEID_LINEAGE_MERGES); 'withhold' "
                          "leaves out a registered cluster that this run's merges put below k people")
    if len(record_fingerprints) != n:
        raise ConfigError(f"record_fingerprints has {len(record_fingerprints)} entries but people has {n}; "
                          "pass the source_sha256 of every record")
    if persons is not None and len(persons) != n:
        raise ConfigError(f"persons has {len(persons)} entries but people has {n}; pass the effective person of "
                          "every record (or None: no merges)")


def _log_plan(dataset: str, suppressed_clusters: Sequence[tuple[str, str]], waiting: Any, *, k: int,
              merges: str) -> None:
    """Log what a plan withholds for the merges (a warning) and who waits for more new people (info)."""
    withheld = sum(r in (MERGED_BELOW_K, MERGED_OVER_SHARE) for _, r in suppressed_clusters)
    if withheld:
        logger.warning("lineage %s: %d registered clusters withheld: this run's merges leave them below k=%d people "
                       "or one person above 1/k (%s)", dataset, withheld, k, merges)
    if waiting:
        logger.info("lineage %s: %d new people wait for more (fewer than k=%d new people in their partition)",
                    dataset, len(waiting), k)


def _effective(key: bytes, dataset: str, people: Sequence[Hashable], persons: Sequence[Hashable] | None,
               pseud: Sequence[str]) -> list[str] | None:
    """The pseudonym of each record's effective person (this run's identity merges); None: no record moved."""
    if persons is None:
        return None
    # Only the records a merge moved are pseudonymised again (one HMAC per distinct id; issue 13).
    moved = [i for i, (a, b) in enumerate(zip(people, persons)) if str(a) != str(b)]
    if not moved:
        return None
    effective = list(pseud)
    for i, e in zip(moved, pseudonymize(key, dataset, [persons[i] for i in moved])):
        effective[i] = e
    return effective


@dataclass(frozen=True)
class _Overlay:
    """Who is one person in this run (:func:`_overlay`): ``merged`` maps a pseudonym of a joined group to the group's
    pseudonym, ``members_of`` a group's pseudonym to its members (joined groups only), ``returning`` the groups
    anyone of whom was registered or released, ``n_aliased`` the records registered under another pseudonym."""

    merged: dict[str, str]
    members_of: dict[str, set[str]]
    returning: set[str]
    n_aliased: int

    def root(self, p: str) -> str:
        return self.merged.get(p, p)

    @classmethod
    def of(cls, state: LineageState, pseud: Sequence[str], fps: Sequence[str],
           effective: Sequence[str] | None) -> "_Overlay":
        merged, n_aliased = _overlay(state, pseud, fps, effective)
        members_of: dict[str, set[str]] = defaultdict(set)   # root -> its pseudonyms (joined groups only)
        for p, r in merged.items():
            members_of[r].add(p)
        # A person is returning when anyone this run joins them with was registered or released.
        returning = {r for r in {merged.get(p, p) for p in pseud}
                     if any(m in state.person_clusters or m in state.released_people for m in members_of.get(r, (r,)))}
        return cls(merged, members_of, returning, n_aliased)


def _assign_records(state: LineageState, pseud: Sequence[str], fps: Sequence[str],
                    parts: Sequence[tuple[str, ...]] | None, policy: str, who: _Overlay,
                    suppressed: list[tuple[int, str]]) -> tuple[dict[str, list[int]], list[int]]:
    """Each record to its registered cluster (``assigned``: cluster key -> records), to the new people (``new_idx``)
    or, appended to ``suppressed``, withheld: released before (``release-once``) or no cluster of its partition."""
    root = who.root
    assigned: dict[str, list[int]] = defaultdict(list)
    new_idx: list[int] = []
    for i, (p, f) in enumerate(zip(pseud, fps)):
        known_record = f in state.record_cluster
        if root(p) not in who.returning and not known_record:
            new_idx.append(i)
        elif policy == "release-once":
            suppressed.append((i, RELEASED_BEFORE))
        elif known_record:
            assigned[state.record_cluster[f]].append(i)
        else:
            choice = _choose_cluster(state, p, None if parts is None else parts[i], assigned, pseud,
                                     others=who.members_of.get(root(p), ()), root=root)
            if choice is None:
                suppressed.append((i, PARTITION_MISMATCH))
            else:
                assigned[choice].append(i)
    return assigned, new_idx


def _registered_clusters(state: LineageState, assigned: Mapping[str, list[int]], pseud: Sequence[str],
                         fps: Sequence[str], *, k: int, absent: str, who: _Overlay,
                         suppressed: list[tuple[int, str]]) -> tuple[list[Republish], list[tuple[str, str]], int]:
    """Policy ``invariant``: every registered cluster republished (its records, counterfeits) or suppressed with a
    reason (its records appended to ``suppressed``); and how many were re-checked under this run's merges."""
    root = who.root
    republish: list[Republish] = []
    suppressed_clusters: list[tuple[str, str]] = []
    rechecked = 0
    for ckey in sorted(state.clusters):
        c = state.clusters[ckey]
        recs = assigned.get(ckey, [])
        reason = None
        if len(c.people) < k:
            reason = BELOW_K
        elif who.merged and any(p in who.merged for p in c.people):
            rechecked += 1
            reason = _merge_recheck(c, root, k)
        if reason is None and absent == "suppress" and not {root(p) for p in c.people} <= {root(pseud[i])
                                                                                         for i in recs}:
            reason = MEMBER_ABSENT
        if reason is not None:
            suppressed_clusters.append((ckey, reason))
            suppressed.extend((i, CLUSTER_SUPPRESSED) for i in recs)
            continue
        if absent == "suppress":
            recs, surplus = _trim_surplus(recs, pseud, fps, c, k, root=root)
            suppressed.extend((i, SURPLUS) for i in surplus)
        pad = _counterfeits_needed(c, recs, pseud, k, root=root) if absent == "republish" else 0
        if recs or pad:
            republish.append(Republish(c, tuple(sorted(recs)), pad))
    return republish, suppressed_clusters, rechecked


def _new_people(new_idx: Sequence[int], parts: Sequence[tuple[str, ...]] | None, pseud: Sequence[str],
                root: Callable[[str], str], k: int, suppressed: list[tuple[int, str]]) -> tuple[list[int], set[str]]:
    """New people: clustered among themselves, only where there are at least k of them (per partition); the
    others wait (their records appended to ``suppressed``). Returns the records to cluster and who waits."""
    groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for i in new_idx:
        groups[parts[i] if parts is not None else ("all",)].append(i)
    new_records: list[int] = []
    waiting: set[str] = set()
    for g, idx in groups.items():
        people = {root(pseud[i]) for i in idx}
        if len(people) < k:
            waiting |= people
            suppressed.extend((i, WAITING) for i in idx)
        else:
            new_records.extend(idx)
    return new_records, waiting


def record_label_tuples(record_labels: Sequence[Sequence[Hashable]] | None, label_names: Sequence[str],
                   n: int) -> tuple[tuple[str, ...], ...] | None:
    if record_labels is None:
        return None
    shared: dict = {}  # one tuple per distinct combination, shared by its records (issue 13)
    out = tuple(shared.setdefault(t, t) for t in (tuple(map(str, r)) for r in record_labels))
    if len(out) != n or any(len(r) != len(label_names) for r in out):
        raise ConfigError(f"record_labels must have one entry per record ({n}) of {len(label_names)} values "
                          f"(label_names={list(label_names)}); got {len(out)} entries")
    return out


def _same(p: str) -> str:
    return p


def _counterfeits_needed(c: LineageCluster, recs: Sequence[int], pseud: Sequence[str], k: int, *,
                         root: Callable[[str], str] = _same) -> int:
    """Counterfeit rows a republished cluster needs (``absent="republish"``).

    At least its first released size (so an absent member's rows look as before) and at least
    ``k`` times the rows of the person with the most of them: every row carries the same image,
    so a recogniser that names one person for it is right on at most that person's share of the
    rows. A counterfeit belongs to no one, so it dilutes a returning person who brought new photos
    exactly as an absent member's row would. ``root`` maps a pseudonym to its person under this
    run's merges (:func:`plan_release`).
    """
    top = max(Counter(root(pseud[i]) for i in recs).values(), default=0)
    return max(0, c.n_released - len(recs), k * top - len(recs))


def _trim_surplus(recs: Sequence[int], pseud: Sequence[str], fps: Sequence[str], c: LineageCluster,
                  k: int, *, root: Callable[[str], str] = _same) -> tuple[list[int], list[int]]:
    """``absent="suppress"`` (no counterfeits): withhold a person's rows above 1/k of the cluster's rows.

    As the partition stage does for new clusters. New photos go first, then registered ones, the
    highest record index first (deterministic).
    """
    keep = sorted(recs, key=lambda i: (fps[i] in c.records, -i))  # new photos first, then by index
    surplus: list[int] = []
    while keep:
        counts = Counter(root(pseud[i]) for i in keep)
        person, top = max(counts.items(), key=lambda x: (x[1], x[0]))
        if k * top <= len(keep):
            break
        drop = next(i for i in keep if root(pseud[i]) == person)
        keep.remove(drop)
        surplus.append(drop)
    return sorted(keep), surplus


def _overlay(state: LineageState, pseud: Sequence[str], fps: Sequence[str],
             effective: Sequence[str] | None) -> tuple[dict[str, str], int]:
    """Who is one person in this run, over the pseudonyms of the steward ids: ``(merged, n_aliased)``.

    Joins each record's pseudonym with its effective person's (this run's identity merges) and with
    the pseudonym its source bytes were registered under, when that differs (the same photograph is
    the same person: a re-keyed id, or a merge an earlier run registered under one id). ``merged``
    maps every pseudonym of a group of several to the group's smallest (order-free); pseudonyms on
    their own are not in it. ``n_aliased``: records whose registered pseudonym differs from today's.
    Before, such a record stopped the lineage for good (a state error, issue 27); the join keeps it
    in its registered cluster and counts its ids as one person.
    """
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        r = x
        while parent.get(r, r) != r:
            r = parent[r]
        while parent.get(x, x) != r:
            parent[x], x = r, parent[x]
        return r

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            lo, hi = sorted((ra, rb))
            parent[hi] = lo
            parent.setdefault(lo, lo)

    if effective is not None:
        for p, e in zip(pseud, effective):
            if p != e:
                union(p, e)
    aliased = 0
    for p, f in zip(pseud, fps):
        ckey = state.record_cluster.get(f)
        c = state.clusters.get(ckey) if ckey is not None else None
        if c is None or (f, p) in c.members:   # unregistered, or registered under this pseudonym (a set lookup)
            continue
        registered = next((q for g, q in c.members if g == f), None)  # a basis record's registered pseudonym
        if registered is not None and registered != p:
            aliased += 1
            union(p, registered)
    return {x: find(x) for x in list(parent)}, aliased


def _merge_recheck(c: LineageCluster, root: Callable[[str], str], k: int) -> str | None:
    """Why a registered cluster may not be republished under this run's merges (None: it may).

    Its basis records (the records averaged into its image) must still hold ``k`` distinct people,
    none of them above 1/k of the records: the k-Same guarantee of the stored image, re-counted.
    """
    counts = Counter(root(p) for _, p in c.members)
    if len(counts) < k:
        return MERGED_BELOW_K
    if k * max(counts.values()) > len(c.members):
        return MERGED_OVER_SHARE
    return None


def _choose_cluster(state: LineageState, person: str, part: tuple[str, ...] | None,
                    assigned: Mapping[str, list[int]], pseud: Sequence[str], *, others: Iterable[str] = (),
                    root: Callable[[str], str] = _same) -> str | None:
    """The registered cluster of a new record of a returning person: one of their own clusters, or (an id
    first seen now, joined with registered ones by this run's merges) one of the clusters of those ids."""
    own = state.person_clusters.get(person, ())
    keys = own or tuple(sorted({c for q in others for c in state.person_clusters.get(q, ())}))
    cands = [c for c in keys if c in state.clusters]
    if part is not None:
        cands = [c for c in cands if state.clusters[c].partition == part]
    if not cands:
        return None
    me = root(person)
    return min(cands, key=lambda c: (sum(root(pseud[i]) == me for i in assigned.get(c, ())), c))
