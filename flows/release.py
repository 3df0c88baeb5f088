"""The ``release`` flow: a dropped dataset in, a gated k-anonymous release (or a signed rejection) out.

The flow is a thin shell around :func:`deid.operations.runner.run_release` (the stages' one order, Prefect
free), run with the Prefect tasks of :mod:`deid.tasks.stages` on a Dask cluster. What Prefect adds:

- the run is named after the dataset, k and method, records the parameters actually used
  (defaults resolved) and is tagged with its verdict and release id;
- a rejected release ends in a ``Failed`` state named ``Rejected`` (see the README, "The verdict
  in the Prefect UI"), a released one in ``Completed``;
- artifacts: the verdict with its reasons and guarantee, every check, and where report.html is.

Call it through :func:`run_flow` (or ``release(..., return_state=True)`` and :func:`outcome`) to
get the :class:`~deid.operations.run_result.RunResult` of either verdict; called plainly, a rejected release
raises :class:`~deid.errors.ReleaseRejected`.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial, wraps
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Failed, State

from deid.operations.run_result import RunResult
from deid.errors import ReleaseRejected
from deid.intake.features import run_kind
from deid.run_config import RunConfig
from deid.operations.runner import run_release
from deid.settings import Settings
from deid.orchestration.cluster import dask_executor
from deid.orchestration.logs import progress_to_ui
from deid.tasks.stages import STEPS
from deid.reporting.markdown import md
from deid.reporting.verdict import check_rows, checks_description, root_cause_order, verdict_summary

REJECTED = "Rejected"  # the state name a rejected release ends in
log = logging.getLogger(__name__)
# The signed outcome of the flow run this process is running (set the moment run_release returns): once
# the report is signed and the release published or withheld, the Prefect API is optional -- a server
# lost after that is a warning, never a failure of a run whose result is on disk (issue 28).
_signed: list[RunResult] = []


def run_name() -> str:
    """``<dataset> k=<k> <method>``, defaults resolved (the run's name in the UI)."""
    p = flow_run.parameters
    s = Settings()
    name = p.get("name") or Path(str(p.get("drop", "drop"))).name
    return f"{name} k={p.get('k') or s.k} {p.get('method') or s.method}"


@flow(name="release", flow_run_name=run_name, log_prints=False, validate_parameters=True)
def release(drop: str, k: int | None = None, method: str | None = None, labels: list[str] | None = None,
            small_partitions: str | None = None, name: str | None = None, sigma: float | None = None,
            block: int | None = None) -> RunResult | State:
    """Ingest, align, featurize, partition, de-identify, gate, report (signed) and publish (if passed).

    A feature drop (drop.yaml ``kind: features``) skips align and featurize (its vectors are the features).
    """
    config = RunConfig.resolve(Settings(), k=k, method=method, labels=labels, small_partitions=small_partitions,
                               name=name, sigma=sigma, block=block, kind=run_kind(drop))
    # The parameters as used, not as passed (a deployment passes only the drop); drop.yaml's labels and name
    # are recorded again once the ingest has read them.
    update_run(parameters={"drop": drop, **config.used_parameters()})
    # The gate's progress lines and a progress artifact per long stage on the run's page.
    with progress_to_ui(flow_run.get_id() or None):
        result = run_release(drop, config, steps=recording_steps(drop), cluster=partial(dask_executor, drop=drop),
                             run_id=str(flow_run.get_id() or "") or None, logger=get_run_logger())
    _signed.append(result)
    refresh_catalogue(result.report_dir.parent)
    if api_reachable():
        ui_artifacts(result)
        name, tags = run_annotation(result)
        update_run(name=name, tags=tags)
    else:
        _api_lost(result, "after the verdict")
    if result.released:
        return result
    # The failed checks' names only: the reasons are in the verdict artifact and the report (the
    # console shows this message too, and `deid run` prints the reasons once).
    failed = root_cause_order([c.name for c in result.report.checks if not c.passed])  # the root cause first
    return rejected_state(f"release {result.release_id} rejected: {', '.join(failed)} (reasons in the deid-verdict "
                          "artifact and report.json)", result)


def run_annotation(result: RunResult) -> tuple[str, list[str]]:
    """The flow run's name and tags once the verdict is signed (the release subflow's and its wrapper's)."""
    r = result.report
    return f"{r.dataset.name} k={r.k} {r.method}", [f"verdict:{result.verdict}", f"release:{result.release_id}"]


def _record_ingest(step, drop: str):
    """``step`` (an ingest task), then the flow run's parameters recorded with what drop.yaml gave."""
    @wraps(step)
    def ingest(*args, **kwargs):
        ing = step(*args, **kwargs)
        facts = getattr(ing, "drop", ing)  # a feature drop's ingest keeps drop.yaml's facts on .drop
        config = args[2] if len(args) > 2 else kwargs.get("config")
        if isinstance(config, RunConfig) and hasattr(facts, "labels") and hasattr(facts, "name"):
            update_run(parameters={"drop": drop, **config.used_parameters(labels=facts.labels, name=facts.name)})
        return ing
    return ingest


def recording_steps(drop: str):
    """:data:`~deid.tasks.stages.STEPS` whose ingest steps record the parameters used once drop.yaml is read."""
    return replace(STEPS, ingest=_record_ingest(STEPS.ingest, drop),
                   features=replace(STEPS.features, ingest=_record_ingest(STEPS.features.ingest, drop)))


def rejected_state(message: str, result: object) -> State:
    """The end state of a rejected release: ``Failed`` (so the UI and dashboards count it) named ``Rejected``."""
    return Failed(name=REJECTED, message=message, data=ReleaseRejected(message, result=result))


def outcome(state: State):
    """The flow's result for either verdict: a released run's value, or a rejected run's ``result``.

    Any other failure (a crash, an environment failure, a bug) is raised as the exception it was.
    """
    if state.is_failed() and state.name == REJECTED:
        return state.result(raise_on_failure=False).result
    return state.result()


def run_flow(drop: str, **params) -> RunResult:
    """Run the release flow and return its :class:`~deid.operations.run_result.RunResult`, released or rejected.

    A failure of Prefect itself after the run signed its verdict (the API lost while the flow's
    final state or its events were sent) returns that signed result with a warning: the release
    is published (or withheld) and verifiable whatever the UI shows.
    """
    _signed.clear()
    try:
        return outcome(release(drop=drop, **params, return_state=True))
    except ReleaseRejected:
        raise
    except Exception as exc:
        if not _signed:
            raise
        result = _signed[-1]
        _api_lost(result, f"while the flow run was being closed ({type(exc).__name__}: {exc})")
        return result
    finally:
        _signed.clear()


def api_reachable(timeout: float = 2.0, *, attempts: int = 3, pause: float = 1.0) -> bool:
    """Does this process's Prefect API answer (True when none is configured: the engine's own)?

    Up to ``attempts`` health checks ``pause`` seconds apart: a server slow to answer on a loaded machine is
    not taken for a lost one (a lost API is abandoned for the rest of the process, :func:`_api_lost`).
    """
    import time  # noqa: PLC0415

    from prefect.settings import PREFECT_API_URL  # noqa: PLC0415

    from deid.orchestration.prefect_api import healthy  # noqa: PLC0415

    url = PREFECT_API_URL.value()
    if not url:
        return True
    for attempt in range(max(1, attempts)):
        if attempt:
            time.sleep(pause)
        if healthy(url, timeout=timeout):
            return True
    return False


def _api_lost(result: RunResult, when: str) -> None:
    """Warn that the Prefect API was lost ``when``; stop talking to it (the engine's final-state calls, queued
    events and logs would retry it for minutes: :func:`~deid.orchestration.prefect_api.abandon_api`).
    The run's outcome stands: the release is published (or withheld) and its report signed."""
    from prefect.settings import PREFECT_API_URL  # noqa: PLC0415

    from deid.orchestration.prefect_api import abandon_api  # noqa: PLC0415

    log.warning("the Prefect API %s stopped answering %s: the run's outcome stands (release %s %s, signed report %s; "
                "verify with `deid verify`); the flow run's state, artifacts and last logs are missing from the UI",
                PREFECT_API_URL.value() or "(this run's temporary server)", when, result.release_id, "published" if result.released else "withheld (rejected)",
                result.report_path)
    abandon_api(timeout=1.0)


def update_run(*, parameters: dict | None = None, name: str | None = None, tags: list[str] | None = None) -> None:
    """Record on this flow run what only the run knows (resolved parameters, dataset name, verdict tags)."""
    from prefect.client.orchestration import get_client  # noqa: PLC0415

    run_id = flow_run.get_id()
    if not run_id:
        return
    try:
        with get_client(sync_client=True) as client:
            if tags is not None:
                tags = sorted(set(client.read_flow_run(run_id).tags) | set(tags))
            client.update_flow_run(run_id, parameters=parameters, name=name, tags=tags)
    except Exception as exc:  # noqa: BLE001 - the UI annotation must never fail a signed run
        get_run_logger().warning("could not annotate the flow run in the Prefect UI: %s", exc)


def verdict_markdown(result: RunResult, url: str | None = None) -> str:
    """The verdict artifact: the run's verdict summary (deid.reporting.verdict), then where the files are.

    ``url``: report.html on the project's `deid server` (a link that opens); else its path.
    """
    r = result.report
    html = result.report_dir / "report.html"
    lines = [verdict_summary(r, report_html=url or html).markdown(title=f"deid release {r.release_id}"),
             "## Files (paths on the machine that ran deid)", "",
             f"- dataset: {md(r.dataset.name)}, method {md(r.method)}, k = {r.k}",
             f"- signed report: `{result.report_path}`",
             f"- release: `{result.release_dir}`" if result.release_dir else "- release: none (nothing was published)",
             f"- verify: `deid verify {result.report_dir}" + (f" --public-key {result.public_key}`" if result.public_key
                                                              else "`")]
    return "\n".join(lines)


def ui_artifacts(result: RunResult) -> None:
    """The verdict, every check and where the report lives, shown on the flow run in the Prefect UI."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact  # noqa: PLC0415

    html = result.report_dir / "report.html"
    url = report_link(result)
    # The cards on the run's Artifacts tab show the description only: the verdict and its cause there.
    create_markdown_artifact(verdict_markdown(result, url), key="deid-verdict",
                             description=verdict_summary(result.report).description())
    # The rows are built (and escaped for Markdown, which the UI renders every cell as) in deid.reporting.
    checks = check_rows(result.report)
    create_table_artifact(checks, key="deid-checks", description=checks_description(result.report))
    if url is not None:
        create_link_artifact(url, link_text=f"report.html of {result.release_id}", key="deid-report",
                             description="the signed run's HTML report, served read-only by `deid server`")
        return
    create_markdown_artifact(
        f"report.html of {result.release_id}: `{html}`\n\nOpen it from that machine's file manager or with "
        f"`xdg-open {html}` (a browser does not follow links to local files from this page; a `deid server` "
        "of this project serves reports/ and makes this a link).",
        key="deid-report", description="where the signed run's self-contained HTML report is")


def report_link(result: RunResult) -> str | None:
    """report.html's URL on this project's ``deid server`` reports server (None: no server, or another directory)."""
    from deid.orchestration.prefect_api import reports_server  # noqa: PLC0415
    from deid.orchestration.reports_server import report_url  # noqa: PLC0415

    served = reports_server(Settings().data_path)
    return None if served is None else report_url(served[0], served[1], result.report_dir)


def refresh_catalogue(reports_dir: Path) -> None:
    """Rewrite reports/index.html (the catalogue ``deid releases`` writes) after a run; a failure only warns."""
    from deid.reporting.catalogue_page import write_index  # noqa: PLC0415

    try:
        write_index(reports_dir)
    except Exception as exc:  # noqa: BLE001 - the run's outcome is signed; the catalogue is a convenience
        log.warning("could not refresh the catalogue %s/index.html (%s); `deid releases` rewrites it", reports_dir, exc)
