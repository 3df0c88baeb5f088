"""What one release run produced (:class:`RunResult`): the verdict, the signed report (typed) and where
everything is; the runner returns it, the Prefect flow, the server and the CLI read it.

It lives in the operations layer, not in :mod:`deid.contracts`, because it holds the typed report
(:mod:`deid.reporting.report`): a base module naming it would make every layer below depend on reporting.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from deid.reporting.report import DatasetSummary, Privacy, Report, Utility


@dataclass(frozen=True)
class RunResult:
    """What one release run produced: the verdict, the signed report (typed) and where everything is."""

    release_id: str
    verdict: Literal["released", "rejected"]
    report: Report
    report_path: Path
    public_key: Path | None
    key_origin: str
    staging: Path | None = None
    release_dir: Path | None = None
    linkage: Path | None = None
    timings: Mapping[str, Mapping[str, float | None]] = field(default_factory=dict)  # stage -> wall, cpu, peaks
    recovered: tuple[str, ...] = ()
    input_error: str | None = None

    @property
    def released(self) -> bool:
        return self.verdict == "released"

    @property
    def reasons(self) -> list[str]:
        return list(self.report.reasons)

    @property
    def report_dir(self) -> Path:
        return self.report_path.parent

    @property
    def dataset(self) -> DatasetSummary:
        """The report's :class:`~deid.reporting.report.DatasetSummary` (records in, released, withheld ...)."""
        return self.report.dataset

    @property
    def privacy(self) -> Privacy | None:
        return self.report.privacy

    @property
    def utility(self) -> list[Utility]:
        return self.report.utility

    def summary(self) -> dict[str, Any]:
        """JSON-ready summary (paths as strings, the report's dataset, privacy and utility sections)."""
        d = self.report.to_dict()

        def text(p: Path | None) -> str | None:
            return None if p is None else str(p)

        return {"release_id": self.release_id, "verdict": self.verdict, "reasons": list(d["reasons"]),
                "report": str(self.report_path), "report_dir": str(self.report_dir),
                "release_dir": text(self.release_dir), "public_key": text(self.public_key),
                "key_origin": self.key_origin, "staging": text(self.staging), "linkage": text(self.linkage),
                "input_error": self.input_error, "dataset": d["dataset"], "privacy": d["privacy"],
                "utility": d["utility"], "timings": dict(self.timings), "recovered": list(self.recovered)}
