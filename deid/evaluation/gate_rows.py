"""The gate's result rows, typed: one :class:`AttackRow` per attacker x mode, one :class:`UtilityRow` per label and
utility protocol.

Made by the gate (:mod:`deid.evaluation.gate_privacy`, :mod:`deid.evaluation.gate_utility`), held by
:class:`~deid.evaluation.gate_types.GateResult`, read by the report builder (:mod:`deid.reporting.report_build`).
:class:`AttackRow` is also the report's own row (``deid.reporting.report.Reidentification`` is this class: the
report sits above the gate and uses its type, one definition for both). Frozen: a later step (the attack rows'
intervals and statuses) makes new rows with :func:`dataclasses.replace`. ``to_dict`` is each row as the report
writes it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deid.evaluation.checks import INSUFFICIENT


@dataclass(frozen=True)
class AttackRow:
    """One attacker in one mode on the attacked sample: its rate, with its interval and status once scored.

    ``n_probes``: distinct probes the rate is over (the gate always sets it; None only in a report row read
    back without it, as the report schema allows); ``records``: the sample the attacker saw; ``lower``,
    ``upper``: the one-sided Clopper-Pearson bounds (Bonferroni over every row) and ``status`` (``pass``,
    ``fail`` or :data:`INSUFFICIENT`), None until :func:`deid.evaluation.gate_privacy.privacy_checks` scored
    the row.
    """

    attacker: str
    mode: str
    rate: float
    n_probes: int | None = None
    records: int | None = None
    lower: float | None = None
    upper: float | None = None
    status: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The row as the report writes it (``privacy.reidentification[]``), keys in field order."""
        return dataclasses.asdict(self)

    @property
    def deciding(self) -> bool:
        """Scored with enough distinct probes to count (not :data:`INSUFFICIENT`)."""
        return self.status != INSUFFICIENT

    @property
    def name(self) -> str:
        """``attacker/mode``, as the gate's details name a row."""
        return f"{self.attacker}/{self.mode}"


# The utility row's keys the gate and the report read by name (UtilityRow's typed fields).
_UTILITY_FIELDS = ("label", "protocol", "tolerance", "detail", "original_accuracy", "deidentified_accuracy")


@dataclass(frozen=True)
class UtilityRow:
    """One utility label measured by one protocol: the accuracies, the tolerance, and the protocol's evidence.

    The typed fields are what the gate and the report read by name. ``evidence`` holds the protocol's
    other figures (intervals, sample sizes, folds, statuses ...): free-form, as each protocol has its own
    (:class:`deid.evaluation.utility_evidence.UtilityEvidence` for the cross-fit,
    :func:`deid.evaluation.utility_protocols.utility_protocols` for the others). ``keys``: every key of
    the row in the protocol's order, so :meth:`to_dict` gives back the row it was made from.
    """

    label: str
    protocol: str | None
    tolerance: float
    detail: str | None = None
    original_accuracy: float | None = None
    deidentified_accuracy: float | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)
    keys: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> UtilityRow:
        """The typed row of a protocol's dict (``label`` and ``tolerance`` required, the rest as given)."""
        return cls(label=row["label"], protocol=row.get("protocol"), tolerance=row["tolerance"],
                   detail=row.get("detail"), original_accuracy=row.get("original_accuracy"),
                   deidentified_accuracy=row.get("deidentified_accuracy"),
                   evidence={k: v for k, v in row.items() if k not in _UTILITY_FIELDS}, keys=tuple(row))

    def to_dict(self) -> dict[str, Any]:
        """The row as the report writes it: every key it was made from, in that order."""
        typed = {"label": self.label, "protocol": self.protocol, "tolerance": self.tolerance, "detail": self.detail,
                 "original_accuracy": self.original_accuracy, "deidentified_accuracy": self.deidentified_accuracy}
        # A row made field by field (no ``keys``): the typed fields, then the evidence.
        keys = self.keys or (*_UTILITY_FIELDS, *self.evidence)
        return {k: typed[k] if k in typed else self.evidence[k] for k in keys}
