"""Staging retention: what finished runs keep of ``data/staging/<release_id>/`` (``DEID_KEEP_STAGING``; issue 32).

A finished run's staging is private working data (ingested bytes, aligned faces, features, partitions,
de-identified parts): about 11 GB for a 100k run and 30 GB for a 1M run, read by no later run. The
lineage registry keeps its own sealed averages under ``data/private/lineage/``, the linkage record moves
to ``data/private/<id>/`` at publication, ``deid verify`` reads the release and the report, and recovery
looks only at unfinished runs (see :attr:`deid.contracts.StagingLayout.kept_when_finished`). So every
finished run is *trimmed* to its markers and quarantine table unless the policy
(:class:`deid.settings.StagingRetention`) keeps it whole.

:func:`plan_retention` is the policy, a pure function of the runs found; :func:`apply_retention` scans
the staging directory, plans, and trims (or, dry, only counts). A run applies it at its end, after its
verdict and publication (:func:`deid.operations.runner.run_release`); ``deid gc`` applies it to
existing staging. Liveness is the run lock's (:func:`deid.operations.safety.is_live`): a staging
directory whose lock is held is never touched, nor one without the ``.complete`` marker (a live run
before it locked, or a dead run's leftovers, which the next run's recovery removes and annotates).
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from deid.contracts import StagingLayout
from deid.operations.safety import is_live, remove_path
from deid.settings import StagingRetention

log = logging.getLogger(__name__)

__all__ = ["Decision", "RetentionResult", "StagedRun", "apply_retention", "plan_retention", "scan_staging",
           "tree_bytes"]

Action = Literal["keep", "trim", "live", "unfinished"]


@dataclass(frozen=True)
class StagedRun:
    """One directory under ``data/staging/`` as the policy sees it.

    ``finished_at``: when the run wrote ``.complete`` (its mtime), None when it has no marker (running, or
    died). ``verdict``: the run's verdict (``.complete``'s JSON, else its report), None when unknown.
    ``live``: :func:`~deid.operations.safety.is_live` (None: no lock file).
    """

    release_id: str
    finished_at: float | None
    verdict: str | None = None
    live: bool | None = False


@dataclass(frozen=True)
class Decision:
    """What the policy does with one staging directory, and why (said by ``deid gc``)."""

    release_id: str
    action: Action
    reason: str


def plan_retention(runs: Sequence[StagedRun], policy: StagingRetention) -> list[Decision]:
    """The policy over the staging directories found: keep whole, trim, or leave alone (live, unfinished).

    Parameters
    ----------
    runs : sequence of StagedRun
        Every directory under ``data/staging/`` (any order).
    policy : StagingRetention
        ``none``: every finished run is trimmed; ``failed``: rejected runs are kept whole; ``last:N``: the N
        most recently finished runs (by ``finished_at``, ties by release id) are kept whole; ``all``: nothing
        is trimmed.

    Returns
    -------
    list of Decision
        One per run, in the order given. A live run (lock held) is ``live`` and a run without ``.complete``
        ``unfinished``: never trimmed, whatever the policy.
    """
    finished = sorted((r for r in runs if r.finished_at is not None and r.live is not True),
                      key=lambda r: (-float(r.finished_at), r.release_id))
    recent = {r.release_id for r in finished[:policy.last]} if policy.mode == "last" else set()
    out = []
    for r in runs:
        if r.live is True:
            out.append(Decision(r.release_id, "live", "its run lock is held (a live run): never touched"))
        elif r.finished_at is None:
            out.append(Decision(r.release_id, "unfinished", "no .complete marker: a run that has not finished or "
                                                            "died (the next run's recovery removes it)"))
        elif policy.mode == "all":
            out.append(Decision(r.release_id, "keep", "DEID_KEEP_STAGING=all"))
        elif policy.mode == "failed" and r.verdict == "rejected":
            out.append(Decision(r.release_id, "keep", "rejected by the gate (DEID_KEEP_STAGING=failed)"))
        elif r.release_id in recent:
            out.append(Decision(r.release_id, "keep", f"one of the {policy.last} most recently finished runs "
                                                      f"(DEID_KEEP_STAGING={policy})"))
        else:
            out.append(Decision(r.release_id, "trim", f"finished ({r.verdict or 'verdict unknown'}); "
                                                      f"DEID_KEEP_STAGING={policy} keeps its markers and "
                                                      "quarantine table only"))
    return out


def tree_bytes(path: Path) -> int:
    """Apparent bytes under ``path`` (files, directories and links themselves, as ``du -sb`` counts them)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    total = st.st_size
    if not os.path.isdir(path) or os.path.islink(path):
        return total
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in (*dirs, *files):
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                pass
    return total


def _verdict(layout: StagingLayout, reports_path: Path | None) -> str | None:
    try:
        v = json.loads(layout.complete.read_bytes() or b"{}").get("verdict")
        if v:
            return str(v)
    except (OSError, ValueError, AttributeError):
        pass
    if reports_path is None:
        return None
    try:  # an older run's empty marker: its report says
        v = json.loads((Path(reports_path) / layout.root.name / "report.json").read_bytes()).get("verdict")
        return str(v) if v else None
    except (OSError, ValueError, AttributeError):
        return None


def scan_staging(data_path: Path, reports_path: Path | None = None) -> list[StagedRun]:
    """Every run directory under ``<data_path>/staging/`` (symlinks and plain files are not runs), by name."""
    root = Path(data_path) / "staging"
    if not root.is_dir():
        return []
    out = []
    for d in sorted(root.iterdir()):
        if d.is_symlink() or not d.is_dir():
            continue
        layout = StagingLayout(d)
        try:
            finished = layout.complete.stat().st_mtime
        except FileNotFoundError:
            finished = None
        out.append(StagedRun(d.name, finished, _verdict(layout, reports_path) if finished is not None else None,
                             is_live(d)))
    return out


@dataclass
class RetentionResult:
    """What :func:`apply_retention` did (or, dry, would do): per run its decision and bytes, and the totals."""

    decisions: list[Decision] = field(default_factory=list)
    freed: dict[str, int] = field(default_factory=dict)  # release id -> bytes removed (dry: removable)
    kept: dict[str, int] = field(default_factory=dict)  # release id -> bytes left in its staging
    dry_run: bool = False

    @property
    def freed_total(self) -> int:
        return sum(self.freed.values())

    @property
    def kept_total(self) -> int:
        return sum(self.kept.values())


def _trim(layout: StagingLayout, *, dry_run: bool) -> int:
    keep = {p.name for p in layout.kept_when_finished}
    freed = 0
    for p in sorted(layout.root.iterdir()):
        if p.name in keep:
            continue
        freed += tree_bytes(p)
        if not dry_run:
            remove_path(p)  # False: another process applying the policy removed it first
    return freed


def apply_retention(data_path: Path, reports_path: Path | None, policy: StagingRetention, *,
                    dry_run: bool = False, measure: bool = True) -> RetentionResult:
    """Apply ``policy`` to every run under ``<data_path>/staging/``: trim what it does not keep.

    ``dry_run`` removes nothing and counts what would go. ``measure=False`` skips counting the bytes
    of the runs left alone (a run's end needs only what it freed). Liveness is checked again right
    before a directory is trimmed. A file that cannot be removed is logged and left (the next
    application tries again); it never fails the caller.
    """
    runs = scan_staging(data_path, reports_path)
    out = RetentionResult(decisions=plan_retention(runs, policy), dry_run=dry_run)
    root = Path(data_path) / "staging"
    for d in out.decisions:
        layout = StagingLayout(root / d.release_id)
        if d.action == "trim" and is_live(layout.root) is not True:
            try:
                out.freed[d.release_id] = _trim(layout, dry_run=dry_run)
            except OSError as exc:
                log.warning("staging retention: could not trim %s: %s", layout.root, exc)
            else:
                if out.freed[d.release_id] and not dry_run:
                    log.info("staging retention: trimmed %s (%d bytes freed; %s)", layout.root,
                             out.freed[d.release_id], d.reason)
        if measure or d.action == "trim":
            out.kept[d.release_id] = tree_bytes(layout.root) - (out.freed.get(d.release_id, 0) if dry_run else 0)
    return out
