"""Partitioning records by their utility labels (the "Select" of k-Same-Select)."""
from __future__ import annotations

from dataclasses import dataclass, field

from deid.errors import ConfigError
from deid.settings import SMALL_PARTITION_POLICIES as POLICIES  # the setting's values, declared there


@dataclass
class PartitionPlan:
    """Which records go into which partition, and which are withheld.

    ``groups`` maps a partition key (tuple of label values, or ``("all",)``) to record indices.
    """

    groups: dict[tuple, list[int]]
    suppressed: list[int] = field(default_factory=list)
    small: list[dict] = field(default_factory=list)  # partitions below k: key, people, records, action
    failed: bool = False


def plan_partitions(labels: list[dict[str, str]], people: list[str], *, k: int, label_names: list[str],
                    select: bool = True, policy: str = "suppress") -> PartitionPlan:
    """Group records by their label values; handle partitions with fewer than k distinct people.

    k-Same-Select (Gross, Airoldi, Malin, Sweeney 2005) runs k-Same inside each partition of
    the utility labels so that averaging keeps the labels. A partition with fewer than ``k``
    distinct people cannot be k-anonymised on its own; ``policy`` says what happens:

    - ``suppress``: its records are withheld from the release and counted in the report;
    - ``merge``: it is merged into the partition that shares the most label values with it
      (ties: the largest), which keeps as many labels pure as possible;
    - ``fail``: the plan is marked failed and the gate rejects the run.

    With ``select=False`` (plain k-Same) everything is one partition ``("all",)``.
    """
    if policy not in POLICIES:
        raise ConfigError(f"small_partitions={policy!r} must be one of {POLICIES}")
    if len(labels) != len(people):
        raise ConfigError(f"labels ({len(labels)}) and people ({len(people)}) must have the same length")
    groups: dict[tuple, list[int]] = {}
    for i, lab in enumerate(labels):
        key = tuple(lab[name] for name in label_names) if select else ("all",)
        groups.setdefault(key, []).append(i)

    def n_people(idx: list[int]) -> int:
        return len({people[i] for i in idx})

    plan = PartitionPlan(groups={})
    small = sorted((key for key, idx in groups.items() if n_people(idx) < k), key=lambda x: tuple(map(str, x)))
    big = {key: list(idx) for key, idx in groups.items() if key not in small}
    for key in small:
        idx = groups[key]
        entry = {"partition": dict(zip(label_names, key)) if select else {"all": "all"},
                 "people": n_people(idx), "records": len(idx)}
        if policy == "suppress":
            plan.suppressed.extend(idx)
            entry["action"] = "suppressed"
        elif policy == "fail":
            plan.failed = True
            plan.suppressed.extend(idx)
            entry["action"] = "failed"
        else:
            if big:
                target = max(big, key=lambda b: (sum(x == y for x, y in zip(b, key)), len(big[b]), tuple(map(str, b))))
                big[target].extend(idx)
                entry["action"] = "merged into " + "/".join(map(str, target))
            else:
                # No partition is big enough on its own: pool all small ones together.
                big.setdefault(("merged",), []).extend(idx)
                entry["action"] = "merged into pooled partition"
        plan.small.append(entry)
    # A pooled partition may itself still be too small.
    for key in [b for b in big if n_people(big[b]) < k]:
        plan.suppressed.extend(big.pop(key))
        plan.small.append({"partition": {"pooled": "/".join(map(str, key))}, "people": None,
                           "records": None, "action": "suppressed (still fewer than k people after merge)"})
    # No person may hold more than 1/k of a partition's images, or no cluster could keep them
    # at <= 1/k (deid.anonymise.ksame.DominantPersonError): withhold that person's surplus images.
    for key, idx in big.items():
        kept, trimmed = _trim_dominant(idx, people, k)
        if trimmed:
            big[key] = kept
            plan.suppressed.extend(trimmed)
            plan.small.append({"partition": dict(zip(label_names, key)) if select else {"all": "all"},
                               "people": 1, "records": len(trimmed),
                               "action": "suppressed: one person's images above 1/k of the partition"})
    plan.groups = {key: sorted(idx) for key, idx in sorted(big.items(), key=lambda kv: tuple(map(str, kv[0])))}
    plan.suppressed.sort()
    return plan


def _trim_dominant(idx: list[int], people: list[str], k: int) -> tuple[list[int], list[int]]:
    """Keep at most floor((n - c) / (k - 1)) of the c images of any person (n = partition size).

    Then every person holds at most 1/k of the partition (c' <= (n - c + c') / k), the condition
    under which k-Same can keep every cluster's one-person share <= 1/k. Later images (by
    index) are the ones withheld, so the choice is deterministic.
    """
    trimmed: list[int] = []
    while True:
        counts: dict[str, list[int]] = {}
        for i in idx:
            counts.setdefault(people[i], []).append(i)
        n = len(idx)
        worst = max(counts.values(), key=len) if counts else []
        allowed = (n - len(worst)) // (k - 1) if k > 1 else len(worst)
        if len(worst) <= allowed or not worst:
            return idx, sorted(trimmed)
        drop = set(worst[max(allowed, 0):])
        trimmed.extend(drop)
        idx = [i for i in idx if i not in drop]
