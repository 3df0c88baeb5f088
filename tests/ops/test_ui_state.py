"""The verdict in the Prefect UI: a rejected release ends `Rejected` (a Failed state), a released one `Completed`.

A real Prefect server (`deid server`), `deid run` processes against it, the API read back, and the
runs page rendered by headless Chromium. Small synthetic drops: the subject is the UI, not the gate.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from forked_cli import ForkedCli
from ops_helpers import QUICK_GATE, Proc, api, browser, chromium, clean_env, free_port, start_server

from deid.intake.synth import make_synthetic_drop

pytestmark = [pytest.mark.slow, pytest.mark.ops]
ROOT = Path(__file__).resolve().parents[2]
QUICK = {**QUICK_GATE, "DEID_DASK_WORKERS": "1"}
# A deployment calls the flow with the drop only: the flow resolves k and method itself.
FLOW_DEFAULTS = """
import sys
from deid.flows.release import run_flow
if __name__ == "__main__":
    result = run_flow(sys.argv[1], method="blur")
    print("VERDICT", result.verdict, result.release_id)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, _dask_scheduler):
    base = tmp_path_factory.mktemp("ui")
    logs, project = base / "logs", base / "project"
    logs.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = clean_env(project, base / "prefect-client", **QUICK, PYTHONPATH=str(ROOT))
    procs: list[Proc] = []
    try:
        server = start_server(port, env, logs, procs)
        # The runs' stages on the test process's Dask worker (the subject is the UI, not the cluster): no
        # LocalCluster start and model load per run.
        client = dict(env, PREFECT_API_URL=url, DEID_DASK_ADDRESS=_dask_scheduler)
        drop = make_synthetic_drop(base / "faces", people=12, images_per_person=2, seed=1)
        few = make_synthetic_drop(base / "few", people=2, images_per_person=2, seed=2)
        out = {}
        script = base / "flow_defaults.py"
        script.write_text(FLOW_DEFAULTS)
        # Each run is its own process, forked from one that imported the run's packages once
        # (tests/forked_cli.py): the subject is the UI, not the start-up.
        with ForkedCli(client, ROOT, base / "cli") as cli:
            for key, argv, extra in (("released", ["run", drop, "--k", "3"], {}),
                                     ("too-few", ["run", few, "--k", "3"], {}),
                                     ("blur", [drop], {"script": script, "env": {"DEID_K": "3"}})):
                r = cli.run(argv, **extra)
                out[key] = {"code": r.returncode, "log": r.stdout + r.stderr}
        flows = api(url, "/flow_runs/filter", {"flows": {"name": {"any_": ["release"]}}, "sort": "START_TIME_ASC"})
        yield {"url": url, "port": port, "out": out, "flows": flows, "base": base,
               "reports_port": server.reports_port}
    finally:
        for p in procs:
            p.stop()


def _run(runs: dict, verdict_tag: str, name: str) -> dict:
    hits = [r for r in runs["flows"] if verdict_tag in r["tags"] and r["name"] == name]
    assert len(hits) == 1, [(r["name"], r["tags"], r["state_name"]) for r in runs["flows"]]
    return hits[0]


def test_cli_exit_codes_follow_the_verdict(runs):
    out = runs["out"]
    assert out["released"]["code"] == 0 and "verdict: RELEASED" in out["released"]["log"], out["released"]["log"][-3000:]
    assert out["too-few"]["code"] == 1 and "verdict: REJECTED" in out["too-few"]["log"], out["too-few"]["log"][-3000:]
    assert out["blur"]["code"] == 0 and "VERDICT rejected" in out["blur"]["log"], out["blur"]["log"][-3000:]


def test_states_names_tags_and_parameters_through_the_api(runs):
    released = _run(runs, "verdict:released", "faces k=3 k-same-select")
    assert (released["state_type"], released["state_name"]) == ("COMPLETED", "Completed")
    blur = _run(runs, "verdict:rejected", "faces k=3 blur")
    few = _run(runs, "verdict:rejected", "few k=3 k-same-select")
    for run in (blur, few):
        assert (run["state_type"], run["state_name"]) == ("FAILED", "Rejected")
        assert run["state"]["message"].startswith("release rel-")
    for run in (released, blur, few):
        release_id = next(t.split(":", 1)[1] for t in run["tags"] if t.startswith("release:"))
        report = json.loads((runs["base"] / "project" / "reports" / release_id / "report.json").read_text())
        assert report["run_id"] == run["id"] and f"verdict:{report['verdict']}" in run["tags"]
    # The values used, not `k: null`: the blur run was called with the drop and the method only.
    assert blur["parameters"]["k"] == 3 and blur["parameters"]["method"] == "blur"
    assert released["parameters"]["method"] == "k-same-select" and released["parameters"]["small_partitions"]
    # drop.yaml's labels and name, and only the parameters the method takes (blur: sigma; k-same-select: neither).
    assert released["parameters"]["labels"] == ["gender", "expression"] and released["parameters"]["name"] == "faces"
    assert {"sigma", "block"}.isdisjoint(released["parameters"]) and "block" not in blur["parameters"]
    assert isinstance(blur["parameters"]["sigma"], (int, float))
    # The rejected run's verdict artifact: verdict, reasons, guarantee, report.html's path.
    arts = api(runs["url"], "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [blur["id"]]}}})
    verdict = next(a["data"] for a in arts if a["key"] == "deid-verdict")
    # (The verdict summary of deid.reporting.verdict: the failed check in plain words, and no guarantee for a
    # run that released nothing.)
    assert "**REJECTED**" in verdict and "Re-identification attacks succeed at most 1/k of the time: not met" in \
        verdict and "**Guarantee:** none: nothing released" in verdict and "formal" not in verdict, verdict
    # report.html as a link to `deid server`'s reports server (served: it opens), never a file:// link.
    assert f"**report.html**: [http://127.0.0.1:{runs['reports_port']}/rel-" in verdict and "file://" not in verdict


def _text(dom: str, *, sep: str = " ") -> str:
    """What the page shows as text: tags replaced by ``sep`` (scripts and styles dropped), entities decoded."""
    import html
    import re

    return html.unescape(re.sub(r"<[^>]+>", sep, re.sub(r"(?s)<(script|style)\b.*?</\1>", "", dom)))


def _page(exe: str, profile: Path, url: str, *, shows: str) -> str:
    """The rendered DOM of ``url``; a cold profile may render before the app has loaded: load it again."""
    for _ in range(3):
        dom = browser(exe, profile, url)
        if shows in dom:
            break
    return dom


def test_runs_page_shows_rejected_and_completed_in_a_realbrowser(runs, tmp_path):
    exe = chromium()
    port = runs["port"]
    dom = _page(exe, tmp_path / "profile", f"http://127.0.0.1:{port}/runs", shows="faces k=3 blur")
    assert "faces k=3 blur" in dom and "faces k=3 k-same-select" in dom, "run names not on the runs page"
    assert "Rejected" in dom and "Completed" in dom
    blur = _run(runs, "verdict:rejected", "faces k=3 blur")
    dom = _page(exe, tmp_path / "profile", f"http://127.0.0.1:{port}/runs/flow-run/{blur['id']}", shows="Rejected")
    assert "Rejected" in dom and "verdict:rejected" in dom


def test_parameters_tab_and_report_link_in_a_realbrowser(runs, tmp_path):
    """The Parameters tab shows the values used; the checks table keeps its thresholds' direction; a rejection
    shows no guarantee; the deid-report artifact and the verdict's report.html are links that open report.html."""
    import re
    import urllib.request

    exe = chromium()
    port = runs["port"]
    released = _run(runs, "verdict:released", "faces k=3 k-same-select")
    dom = _page(exe, tmp_path / "profile", f"http://127.0.0.1:{port}/runs/flow-run/{released['id']}?tab=Parameters",
                shows="expression")
    # The tab's JSON as rendered equals the values the run used (its signed report's), drop.yaml's included.
    shown = _text(dom, sep="")
    params, _ = json.JSONDecoder().raw_decode(shown[shown.index('{\n  "drop"'):])
    report = json.loads((runs["base"] / "project" / "reports" / next(
        t.split(":", 1)[1] for t in released["tags"] if t.startswith("release:")) / "report.json").read_text())
    cfg = report["configuration"]
    assert params == released["parameters"] and "sigma" not in params and "block" not in params, params
    assert (params["k"], params["method"], params["name"]) == (report["k"], report["method"], report["dataset"]["name"])
    assert params["labels"] == cfg["labels"] == ["gender", "expression"]
    assert params["small_partitions"] == cfg["small_partitions"]
    # The checks table as the UI renders it (every cell as Markdown): thresholds keep ">=" (not a blockquote
    # "= 3"), the result states the status, and the short decisive columns come first.
    arts = api(runs["url"], "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [released["id"]]}}})
    checks = next(a for a in arts if a["key"] == "deid-checks")
    dom = _page(exe, tmp_path / "profile", f"http://127.0.0.1:{port}/artifacts/artifact/{checks['id']}",
                shows="min_distinct_people_per_cluster")
    table = " ".join(_text(dom[dom.index("<table"):dom.rindex("</table>")]).split())
    assert "blockquote" not in dom[dom.index("<table"):dom.rindex("</table>")]
    assert re.search(r"pass Every cluster holds at least k distinct people >= 3 3 min_distinct_people_per_cluster",
                     table), table[:3000]
    assert re.search(r"pass At least one record is released >= 1 \d+ release_not_empty", table), table[:3000]
    assert " true " not in f" {table} " and checks["description"].startswith(f"{len(report['checks'])} gate checks")
    # A rejected run's verdict as rendered: no guarantee, and its report.html link opens that report.
    few = _run(runs, "verdict:rejected", "few k=3 k-same-select")
    verdict = next(a for a in api(runs["url"], "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [
        few["id"]]}}}) if a["key"] == "deid-verdict")
    dom = _page(exe, tmp_path / "profile", f"http://127.0.0.1:{port}/artifacts/artifact/{verdict['id']}",
                shows="nothing released")
    shown = " ".join(_text(dom).split())
    assert "REJECTED" in shown and "Guarantee: none: nothing released" in shown and "formal" not in shown, shown
    assert verdict["description"].startswith("REJECTED: The drop has at least k distinct usable people")
    href = re.search(rf'href="(http://127\.0\.0\.1:{runs["reports_port"]}/(rel-[0-9a-f]+)/report\.html)"', dom)
    assert href, "no link to report.html in the rejected run's verdict"
    with urllib.request.urlopen(href.group(1), timeout=10) as r:
        assert r.read() == (runs["base"] / "project" / "reports" / href.group(2) / "report.html").read_bytes()
    (art,) = api(runs["url"], "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [released["id"]]},
                                                                   "key": {"any_": ["deid-report"]}}})
    dom = _page(exe, tmp_path / "profile", f"http://127.0.0.1:{port}/artifacts/artifact/{art['id']}",
                shows="report.html")
    href = re.search(rf'href="(http://127\.0\.0\.1:{runs["reports_port"]}/rel-[0-9a-f]+/report\.html)"', dom)
    assert href, "no link to report.html on the artifact's page"
    with urllib.request.urlopen(href.group(1), timeout=10) as r:
        page = r.read()
    release_id = href.group(1).rsplit("/", 2)[1]
    assert page == (runs["base"] / "project" / "reports" / release_id / "report.html").read_bytes()
