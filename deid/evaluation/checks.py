"""The gate's check record, shared by the gate and the data-validation suites."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["pass", "fail", "inconclusive", "not_applicable"]
STATUSES: tuple[str, ...] = ("pass", "fail", "inconclusive", "not_applicable")

INSUFFICIENT = "insufficient_evidence"
"""Status of a re-identification row (not a check) from fewer distinct probes than the gate's ``min_probes``:
reported with its n and interval, never the headline, never deciding (:func:`deid.evaluation.gate_privacy.privacy_checks`)."""


@dataclass(frozen=True)
class Check:
    """One gate check: what was measured, against what, and whether it blocks the release.

    ``passed`` says whether the check lets the release through; ``status`` says what the
    evidence showed (an ``inconclusive`` utility check may pass or block, by configuration).
    ``interval`` is the one-sided confidence interval of an empirical rate, ``n`` its sample.
    """

    name: str
    passed: bool
    value: object
    threshold: object
    detail: str = ""
    status: str | None = None
    interval: tuple[float, float] | None = None
    n: int | None = None

    def __post_init__(self) -> None:
        if self.status is None:
            object.__setattr__(self, "status", "pass" if self.passed else "fail")
        if self.status not in STATUSES:
            raise ValueError(f"check {self.name!r}: status={self.status!r} must be one of {STATUSES}")
        object.__setattr__(self, "passed", bool(self.passed))

    def to_dict(self) -> dict:
        out = {"name": self.name, "passed": self.passed, "status": self.status, "value": self.value,
               "threshold": self.threshold, "detail": self.detail}
        if self.interval is not None:
            out["interval"] = [float(self.interval[0]), float(self.interval[1])]
        if self.n is not None:
            out["n"] = int(self.n)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Check":
        interval = d.get("interval")
        return cls(d["name"], d["passed"], d.get("value"), d.get("threshold"), d.get("detail", ""),
                   status=d.get("status"), interval=tuple(interval) if interval is not None else None, n=d.get("n"))
