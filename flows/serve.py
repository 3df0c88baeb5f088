"""Deployments: a nightly ``release`` over the incoming directory and ``release-on-drop`` on ``deid.drop.ready``.

Both wrap :func:`deid.flows.release.release` (run as a subflow) with the ledger: a flow claims the
drop's fingerprint before running and records the verdict after, so a duplicate event, a
re-drop, or the nightly run meeting a drop already released never releases the same content
twice. A rejected drop is settled too (ledger ``rejected``): no deployment retries it. Its
``release`` subflow ends ``Failed`` named ``Rejected`` (the one failed run of the drop); the
``release-on-drop`` run that settled it ends ``Completed`` named ``Rejected``, named and tagged
like its subflow.
"""
from __future__ import annotations

import os
from pathlib import Path

# The runner polls the server for scheduled/triggered runs; 2 s measured 2.5-3.8 s from event to
# flow body (10 s default: 4.5-12 s). Read when prefect is imported, hence before it.
RUNNER_POLL_SECONDS = "2"
os.environ.setdefault("PREFECT_RUNNER_POLL_FREQUENCY", RUNNER_POLL_SECONDS)

from prefect import flow, get_run_logger  # noqa: E402
from prefect.artifacts import create_markdown_artifact  # noqa: E402 (after the poll frequency is set)
from prefect.runtime import flow_run  # noqa: E402 (after the poll frequency is set)
from prefect.states import Completed  # noqa: E402 (after the poll frequency is set)

from deid.operations.run_result import RunResult  # noqa: E402 (after the poll frequency is set)
from deid.operations.ledger import Ledger, drop_fingerprint, open_ledger, ready_drops  # noqa: E402 (after the poll frequency is set)
from deid.settings import Settings  # noqa: E402 (after the poll frequency is set)
from deid.flows.release import REJECTED, update_run, run_annotation, run_flow  # noqa: E402 (after the poll frequency is set)
from deid.reporting.markdown import md_cell  # noqa: E402 (after the poll frequency is set)

EVENT = "deid.drop.ready"
RESOURCE_PREFIX = "deid.drop."
# Defaults for settings deid.settings.Settings does not have yet (schedule_cron, incoming_dir);
# DEID_SCHEDULE_CRON / DEID_INCOMING_DIR override them.
DEFAULT_CRON = "0 2 * * *"
DEFAULT_INCOMING = "incoming"  # under the data dir
def schedule_cron(settings: Settings | None = None) -> str:
    """The nightly release's cron expression (``DEID_SCHEDULE_CRON``, default nightly at 02:00)."""
    settings = settings or Settings()
    return settings.schedule_cron or DEFAULT_CRON


def incoming_dir(settings: Settings | None = None) -> Path:
    """Where producers drop datasets (``DEID_INCOMING_DIR``, default ``<data dir>/incoming``)."""
    settings = settings or Settings()
    return settings.incoming_dir.resolve() if settings.incoming_dir else settings.data_path / DEFAULT_INCOMING


def ledger(settings: Settings | None = None) -> Ledger:
    """The project's ledger: ``DEID_DATABASE_URL`` (PostgreSQL) or ``<data dir>/ledger.sqlite``."""
    return open_ledger(settings or Settings())


def _run_claimed(drop: str, fingerprint: str, led: Ledger, by: str, **params) -> tuple[dict, RunResult]:
    """Run the release subflow on a claimed drop and write its outcome to the ledger.

    A rejected release is a settled verdict (ledger ``rejected``, never claimed again); only a
    run that failed without a verdict is ``failed`` (another run may claim it).
    """
    try:
        result = run_flow(drop, **params)
    except BaseException as exc:
        led.fail(fingerprint, by=by, error=f"{type(exc).__name__}: {exc}")
        raise
    led.finish(fingerprint, by=by, release_id=result.release_id, verdict=result.verdict,
               report=str(result.report_path))
    return {"drop": drop, "fingerprint": fingerprint, "status": result.verdict, "release_id": result.release_id,
            "report": str(result.report_path)}, result


def drop_run_name() -> str:
    """``drop <directory>``: a ``release-on-drop`` run's name until its subflow's verdict renames it."""
    return f"drop {Path(str(flow_run.parameters.get('drop', 'drop'))).name}"


def _summary_artifact(rows: list[dict]) -> None:
    lines = ["| drop | fingerprint | outcome | release | report |", "|---|---|---|---|---|"]
    for r in rows:
        # Every cell escaped: the UI renders Markdown, and a drop's path is the producer's text.
        cells = [r["drop"], f"{r['fingerprint'][:19]}…", r["status"], r.get("release_id") or "", r.get("report") or ""]
        lines.append("| " + " | ".join(str(md_cell(c)) for c in cells) + " |")
    create_markdown_artifact("\n".join(lines), key="deid-ledger", description="deid ledger outcome of this run")


@flow(name="release-on-drop", flow_run_name=drop_run_name, log_prints=False)
def release_on_drop(drop: str, fingerprint: str | None = None) -> dict:
    """Release one dropped dataset unless the ledger already has its content (a duplicate)."""
    logger = get_run_logger()
    by = str(flow_run.get_id() or f"pid-{os.getpid()}")
    drop_path = str(Path(drop).resolve())
    fp = drop_fingerprint(drop_path)
    if fingerprint and fingerprint != fp:
        logger.warning("drop %s changed since it was announced (%s, now %s); releasing what is there now",
                       drop_path, fingerprint, fp)
    led = ledger()
    claim = led.claim(fp, drop_path, by=by)
    if not claim.granted:
        e = claim.entry
        logger.info("duplicate: %s has the content of %s (%s, release %s); nothing to do",
                    drop_path, e.drop_path, e.status, e.release_id)
        row = {"drop": drop_path, "fingerprint": fp, "status": "duplicate", "duplicate_of": e.drop_path,
               "ledger_status": e.status, "release_id": e.release_id, "report": e.report}
        _summary_artifact([row])
        update_run(name=f"{drop_run_name()} duplicate", tags=["duplicate", *([f"release:{e.release_id}"]
                                                                             if e.release_id else [])])
        return row
    row, result = _run_claimed(drop_path, fp, led, by)
    _summary_artifact([row])
    name, tags = run_annotation(result)  # named and tagged like its release subflow
    update_run(name=name, tags=tags)
    if row["status"] == "rejected":
        # Counted once: the release subflow is the failed run (Failed, named Rejected). This run did its job
        # (the drop is settled in the ledger), so it ends Completed, named Rejected: a Failed state here
        # would be a second failed run on the dashboard, and Prefect's runner logs every flow ending
        # Failed as an ERROR "Engine execution exited with unexpected exception" with a traceback.
        return Completed(name=REJECTED, message=f"drop {drop_path} rejected (release {row['release_id']}); the "
                         "release subflow holds the verdict", data=row)
    return row


def incoming_run_name() -> str:
    """``incoming <directory>``: the nightly run's name (the directory it releases from)."""
    given = flow_run.parameters.get("incoming")
    return f"incoming {(Path(given) if given else incoming_dir()).name}"


@flow(name="release-incoming", flow_run_name=incoming_run_name, log_prints=False)
def release_incoming(incoming: str | None = None) -> list[dict]:
    """Release every complete drop in the incoming directory whose content the ledger has not released."""
    logger = get_run_logger()
    root = Path(incoming).resolve() if incoming else incoming_dir()
    by = str(flow_run.get_id() or f"pid-{os.getpid()}")
    led = ledger()
    rows: list[dict] = []
    tags: list[str] = []
    for drop in ready_drops(root):
        fp = drop_fingerprint(drop)
        claim = led.claim(fp, str(drop), by=by)
        if not claim.granted:
            logger.debug("skip %s: %s (%s)", drop, claim.entry.status, claim.entry.drop_path)
            continue
        try:
            row, result = _run_claimed(str(drop), fp, led, by)
            rows.append(row)
            tags.extend(run_annotation(result)[1])  # tagged like its subflows: every verdict and release id
        except Exception as exc:  # one bad drop must not stop the others; the ledger marks it failed
            logger.error("drop %s failed: %s", drop, exc)
            rows.append({"drop": str(drop), "fingerprint": fp, "status": "failed", "error": str(exc)})
    logger.info("incoming %s: %d drop(s) processed", root, len(rows))
    if rows:
        _summary_artifact(rows)
    if tags:
        update_run(tags=tags)
    return rows


def deployments(settings: Settings | None = None) -> list:
    """The two deployments ``deid serve`` serves."""
    from prefect.events import DeploymentEventTrigger

    settings = settings or Settings()
    nightly = release_incoming.to_deployment(
        name="release", cron=schedule_cron(settings), parameters={"incoming": str(incoming_dir(settings))},
        description="Nightly: release every complete drop in the incoming directory not yet in the ledger.")
    on_drop = release_on_drop.to_deployment(
        name="release-on-drop",
        description=f"Release a drop when `deid watch` emits {EVENT}.",
        triggers=[DeploymentEventTrigger(
            name="drop ready", expect={EVENT}, match={"prefect.resource.id": f"{RESOURCE_PREFIX}*"},
            parameters={"drop": "{{ event.payload.drop }}", "fingerprint": "{{ event.payload.fingerprint }}"})])
    return [nightly, on_drop]


def serve_all(*, limit: int | None = None) -> None:
    """Serve both deployments until interrupted (SIGINT/SIGTERM pause them)."""
    from prefect import serve

    serve(*deployments(), limit=limit, print_starting_message=True)
