"""Issue 29: one verdict summary, read right in the CLI, the Prefect UI (Markdown) and report.html."""
from __future__ import annotations

import copy
import re
from pathlib import Path
from types import SimpleNamespace

from markdown_it import MarkdownIt
from unit.reporting.test_html_report_page import GUARANTEE, _report

from deid.cli import print_summary
from deid.reporting.html_report import render_report_html
from deid.reporting.markdown import md, md_cell
from deid.reporting.report import Report
from deid.reporting.verdict import (
    DETAIL_CHARS,
    NOTHING_RELEASED,
    REQUIRED_CHARS,
    REQUIREMENT_CHARS,
    check_rows,
    checks_description,
    verdict_summary,
)

# The UI renders artifacts with a CommonMark renderer (tables as in GitHub Markdown).
_RENDER = MarkdownIt("commonmark").enable("table")


def _k_too_large() -> dict:
    """A rejection with k above the number of people, its checks in the order the gate lists them."""
    r = _report("rejected")
    r["k"], r["privacy"] = 200, {"bound": 1 / 200, "max_rate": None, "min_distinct_people_per_cluster": None,
                                 "reidentification": []}
    r["utility"] = []
    r["checks"] = [
        {"name": "release_not_empty", "passed": False, "status": "fail", "value": 0, "threshold": ">= 1",
         "detail": "no record could be released"},
        {"name": "records_accounted", "passed": False, "status": "fail", "value": 0, "threshold": "= 24",
         "detail": "judged 0 + suppressed 0 + quarantined 0 = 0 of 24 in"},
        {"name": "enough_people", "passed": False, "status": "fail", "value": 12, "threshold": ">= 200",
         "detail": "12 distinct usable people, fewer than k=200: no cluster of k people can be formed"},
    ]
    r["reasons"] = [f"{c['name']}: {c['detail']}" for c in r["checks"]]
    return r


def _inconclusive_release() -> dict:
    """Released, with a utility drop of 0.078 against 0.05 that the data could not decide (not blocking)."""
    r = _report("released")
    r["checks"].append({"name": "utility_gender", "passed": True, "status": "inconclusive", "value": 0.078,
                        "threshold": "accuracy drop <= 0.05", "interval": [0.012, 0.144], "n": 60,
                        "detail": "originals 0.9 vs release 0.822: delta +0.078"})
    r["checks"].append({"name": "lineage_label_mix", "passed": True, "status": "not_applicable", "value": None,
                        "threshold": None, "detail": "first release of this dataset " * 20})
    r["warnings"] = ["utility_gender: originals 0.9 vs release 0.822: delta +0.078"]
    r.update(artifacts=[], release_dir="data/releases/rel-0dbff1073f8f51c6")
    return r


def test_thresholds_keep_their_direction_in_markdown():
    assert md(">= 5") == "\\>= 5" and md("- x") == "\\- x" and md("a|b") == "a\\|b" and md("0.5 >= 0.2") == "0.5 \\>= 0.2"
    rows = check_rows(_inconclusive_release())
    table = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    table += ["| " + " | ".join(str(v) for v in row.values()) + " |" for row in rows]
    page = _RENDER.render("\n".join(table))
    cells = re.findall(r"<td>(.*?)</td>", page)
    assert "blockquote" not in page and "&gt;= 5" in cells and "&lt;= 0.200" in cells
    # Every cell renders as the text it holds: no Markdown construct anywhere in the table.
    assert not re.search(r"<(em|strong|code|a|ul|ol|h\d)\b", page)


def test_checks_table_states_status_and_fits_a_screen():
    rows = {r["check"].replace("\\_", "_"): r for r in check_rows(_inconclusive_release())}
    assert all("passed" not in r for r in rows.values())
    assert rows["utility_gender"]["result"] == "inconclusive (not blocking)"
    assert rows["lineage_label_mix"]["result"] == "not applicable"
    assert rows["min_distinct_people_per_cluster"]["result"] == "pass"
    assert all(len(r["detail"].replace("\\", "")) <= DETAIL_CHARS for r in rows.values())
    assert rows["lineage_label_mix"]["detail"].endswith("\u2026")
    assert md_cell(3) == 3 and md_cell("a\nb") == "a b"
    # The UI cuts a wide table at the screen's edge: result, requirement and required first, the long cells cut.
    assert list(check_rows(_inconclusive_release())[0]) == ["result", "requirement", "required", "measured", "check",
                                                            "detail"]
    assert all(len(r["requirement"].replace("\\", "")) <= REQUIREMENT_CHARS and
               len(r["required"].replace("\\", "")) <= REQUIRED_CHARS for r in rows.values())
    n = len(_inconclusive_release()["checks"])
    assert checks_description(_inconclusive_release()) == \
        f"{n} gate checks: 1 inconclusive, {n - 2} pass, 1 not applicable"
    assert checks_description(_k_too_large()) == "3 gate checks: 3 FAIL"


def test_artifact_card_and_report_link():
    """The verdict card's one line names the root cause; a served report.html is a Markdown link, a path is code."""
    s = verdict_summary(_k_too_large(), report_html="http://127.0.0.1:4201/rel-1/report.html")
    assert s.description() == "REJECTED: The drop has at least k distinct usable people: not met"
    links = re.findall(r'<a href="([^"]+)"', _RENDER.render(s.markdown()))
    assert links == ["http://127.0.0.1:4201/rel-1/report.html"]
    local = verdict_summary(_inconclusive_release(), report_html="/srv/reports/rel-1/report.html")
    assert "<code>/srv/reports/rel-1/report.html</code>" in _RENDER.render(local.markdown())
    assert local.description().startswith("RELEASED: guarantee ") and len(local.description()) <= 100


def test_rejected_summary_states_no_guarantee_and_the_root_cause_first():
    s = verdict_summary(_k_too_large(), report_html="reports/rel-x/report.html")
    assert s.guarantee == NOTHING_RELEASED
    for text in ("\n".join(s.text_lines()), s.markdown()):
        assert "formal" not in text and "1/k bound" not in text and "None" not in text
    assert s.causes[0].startswith("The drop has at least k distinct usable people: not met (12 distinct usable people")
    assert [c.split(":")[0] for c in s.consequences] == ["At least one record is released",
                                                         "Every record is released, suppressed or quarantined"]
    lines = s.text_lines()
    assert lines[:3] == ["verdict: REJECTED", f"guarantee: {NOTHING_RELEASED}", f"  cause: {s.causes[0]}"]
    assert lines[-1] == "report: reports/rel-x/report.html"
    page = render_report_html(Report.from_dict(_k_too_large()))
    assert "class='guarantee'" not in page and GUARANTEE not in page
    assert page.index("12 distinct usable people") < page.index("At least one record is released</b>")
    # Labels declared, nothing measured: said so, not "No utility labels were measured" (seen on a screenshot).
    assert "Not measured: the drop declares gender, expression, but the run was rejected before the gate" in page


def test_cli_summary_prints_warnings_guarantee_and_report_html(tmp_path, capsys):
    d = _inconclusive_release()
    blur = copy.deepcopy(d)
    blur["privacy"]["min_distinct_people_per_cluster"] = None  # blur forms no clusters
    report_dir = tmp_path / "reports" / d["release_id"]
    for report in (d, blur):
        print_summary(SimpleNamespace(report=Report.from_dict(report), report_dir=report_dir,
                                      report_path=report_dir / "report.json", release_dir=Path(d["release_dir"]),
                                      key_origin="development", public_key=tmp_path / "dev.pub.pem"))
        out = capsys.readouterr().out
        lines = out.splitlines()
        assert lines[0] == "verdict: RELEASED" and lines[1] == f"guarantee: {GUARANTEE}"
        warning = next(x for x in lines if x.startswith("warning: The label 'gender'"))
        assert "could not be decided" in warning and "0.078 [0.012, 0.144] n=60" in warning
        assert "required accuracy drop <= 0.05" in warning
        assert f"report: {report_dir / 'report.html'}" in lines
        assert f"signed report: {report_dir / 'report.json'}" in lines
        assert "None" not in out
        utility = [x for x in lines if x.startswith("utility ")]
        assert [x.split(":")[0] for x in utility] == ["utility gender", "utility expression"]  # one per label
    assert "people per cluster: at least 5 distinct" not in out  # blur's run: no such figure, not "None"


def test_a_utility_line_says_what_its_gate_check_decided():
    # The cross-fit row may carry "pass" (one protocol's view) while the check is inconclusive: the line
    # follows the check, so "RELEASED" never hides an undecided label behind "pass".
    r = _inconclusive_release()
    for u in r["utility"]:
        u["status"] = "pass"
    lines = dict(verdict_summary(r).figures)
    gender = [v for key, v in lines.items() if key.startswith("utility gender")]
    assert gender and gender[0].endswith("inconclusive"), lines


def test_attackers_and_modes_named_outside_report_html_are_explained():
    """Issue 29 item 10: the CLI and the Prefect verdict name "pca-mahalanobis (naive)"; they say what that is."""
    from deid.reporting.wording import ATTACKER_WORDS, MODE_WORDS

    s = verdict_summary(_inconclusive_release(), report_html="reports/rel-x/report.html")
    reid = dict(s.figures)["re-identification"]
    named = [n for n in (*ATTACKER_WORDS, *MODE_WORDS) if n in reid.replace("(", " ").replace(")", " ").split()]
    assert named and [t for t, _ in s.terms] == named, (reid, s.terms)
    lines = s.text_lines()
    assert [x for x in lines if x.startswith("term: ")] == [f"term: {n} = {w}" for n, w in s.terms]
    assert lines[-1] == "report: reports/rel-x/report.html"
    assert not any(x.startswith("term: ") for x in s.text_lines(terms=False))
    page = _RENDER.render(s.markdown())
    assert "<h2>Terms</h2>" in page and all(f"<strong>{n}</strong>" in page for n in named)
    # A method's name is no mode (k-same-naive), and nothing named is nothing explained.
    r = _k_too_large()
    r["method"] = "k-same-naive"
    r["checks"][2]["detail"] += " with k-same-naive"
    assert verdict_summary(r).terms == ()


def test_a_figure_without_a_limit_is_report_only_not_not_applicable():
    """Seen on a screenshot: membership AUC 0.95 beside "not applicable" reads as "irrelevant"; it is measured and
    reported, judged by nothing (no DEID_MEMBERSHIP_MAX_ADVANTAGE)."""
    r = _inconclusive_release()
    r["checks"].append({"name": "membership_advantage", "passed": True, "status": "not_applicable", "value": 0.9508,
                        "threshold": None, "interval": [0.873, 0.998], "n": 102,
                        "detail": "AUC 0.975; report only (DEID_MEMBERSHIP_MAX_ADVANTAGE unset)"})
    rows = {x["check"].replace("\\_", "_"): x for x in check_rows(r)}
    assert rows["membership_advantage"]["result"] == "report only (no limit set)"
    assert rows["lineage_label_mix"]["result"] == "not applicable"  # nothing measured: still not applicable
    n = len(r["checks"])
    assert checks_description(r) == f"{n} gate checks: 1 inconclusive, {n - 3} pass, 1 report only, 1 not applicable"
    page = render_report_html(Report.from_dict(r))
    assert '<span class="na">report only (no limit set)</span>' in page and '<span class="na">not applicable</span>' in page
