"""report.html reads at a glance: guarantee under the verdict, reasons in words, thresholds with their
direction, partitions as label values, readable charts, the configuration as a table."""
from __future__ import annotations

import html

import pytest
from pagecheck import Page

from deid.reporting import html_charts
from deid.reporting.html_charts import FONT_PX, MAX_WIDTH_PX
from deid.reporting.html_page import round_numbers
from deid.reporting.html_report import check_requirement, render_report_html, threshold_text
from deid.reporting.report import Reidentification, Report

GUARANTEE = ("formal: 1/k = 1/5 bound on re-identification by any recogniser, because every released face is the "
             "pixel average of a cluster of at least k=5 distinct people (Newton et al. 2005)")


def _report(verdict: str = "rejected") -> dict:
    """A report as the flow signs it (values taken from a real synthetic run, with their full precision)."""
    released = verdict == "released"
    return {
        "release_id": "rel-0dbff1073f8f51c6", "run_id": "e5240686", "verdict": verdict, "k": 5,
        "method": "k-same-select", "created_at": "2026-11-22T12:21:00Z", "guarantee": GUARANTEE,
        "reasons": [] if released else
        ["utility_expression: protocol cv: release 0.8216666666666667 vs originals 0.8900 - tolerance 0.05"],
        "warnings": [],
        "dataset": {"name": "d1", "fingerprint": "sha256:" + "ab" * 32, "records_in": 60,
                    "records_released": 60 if released else 0, "records_suppressed": 0 if released else 60,
                    "records_quarantined": 0, "quarantine_by_reason": {}},
        "checks": [
            {"name": "min_distinct_people_per_cluster", "passed": True, "status": "pass", "value": 5,
             "threshold": ">= 5", "detail": "smallest number of distinct people in a cluster: 5"},
            {"name": "max_person_share", "passed": True, "status": "pass", "value": 0.2, "threshold": "<= 0.2000",
             "detail": ""},
            {"name": "no_forbidden_columns", "passed": True, "status": "pass", "value": [],
             "threshold": ["cluster_id", "gender", "image", "record_id"], "detail": ""},
            # Reports signed before thresholds carried a direction: bare numbers.
            {"name": "quarantine_fraction", "passed": True, "status": "pass", "value": 0.0, "threshold": 0.05,
             "detail": "0 of 60 records quarantined (0.0%; limit 5.0%)"},
            {"name": "enough_people", "passed": True, "status": "pass", "value": 30, "threshold": 5, "detail": ""},
            {"name": "lineage_returning_identical", "passed": True, "value": 0, "threshold": 0, "detail": ""},
            {"name": "reidentification_rate", "passed": True, "status": "pass", "value": 0.166667,
             "threshold": "<= 0.2000", "interval": [0.061268, 0.332261], "n": 60,
             "detail": "max over 15 attacker x mode pairs: pca-mahalanobis/reverse 0.166667"},
            {"name": "utility_expression", "passed": released, "status": "pass" if released else "fail",
             "value": 0.068333, "threshold": "accuracy drop <= 0.05", "interval": [0.0412, 0.0954], "n": 60,
             "detail": "originals 0.8900 vs release 0.8216666666666667: delta +0.06833333, 95% bounds "
                       "[+0.0412222, +0.0954444]"},
        ],
        "privacy": {"bound": 0.2, "max_rate": 0.166667, "min_distinct_people_per_cluster": 5,
                    "max_person_share": 0.2, "exact_bound": True,
                    "reidentification": [
                        {"attacker": a, "mode": m, "rate": 0.15, "lower": 0.05, "upper": 0.3, "n_probes": 60}
                        for a in ("pca-mahalanobis", "fisherfaces", "lbp-chi2", "dlib-resnet")
                        for m in ("naive", "reverse", "parrot")],
                    "attack_sample": {"records": 60, "of": 60, "unit": "cluster", "seed": 0, "confidence": 0.95,
                                      "bonferroni_over": 12}},
        "utility": [{"label": x, "protocol": p, "original_accuracy": 0.89, "deidentified_accuracy": 0.8216666666666667,
                     "tolerance": 0.05, "detail": "protocol 1: grouped k-fold CV"}
                    for x in ("gender", "expression") for p in ("cross-fit", "cv", "train-original-test-release")],
        "configuration": {
            "labels": ["gender", "expression"], "small_partitions": "suppress", "canonical_size": [81, 92],
            "canonical_eyes": [[24.3, 34.04], [56.699999999999996, 34.04]], "utility_tolerance": 0.05,
            "eye_sources": {"manifest": 60}, "stage_seconds": {"align": 4.0623, "gate": 7.7616},
            "partitions": [{"key": ["female", "neutral"], "records": 16, "people": 16},
                           {"key": ["female", "smile"], "records": 16, "people": 16},
                           {"key": ["male", "neutral"], "records": 14, "people": 14},
                           {"key": ["male", "smile"], "records": 14, "people": 14}],
            "clusters": {"count": 12, "sizes": [5] * 10 + [6, 7]},
            "small_partitions_detail": [],
        },
        "signing": {"algorithm": "ed25519", "public_key_fingerprint": "sha256:" + "0" * 64, "key_origin": "development"},
        "versions": {"deid": "0.1.0"},
        "artifacts": [], "release_dir": None,
    }


@pytest.fixture(scope="module")
def rejected() -> tuple[str, Page]:
    doc = render_report_html(Report.from_dict(_report()))
    return doc, Page(doc)


def test_guarantee_sentence_sits_under_the_verdict(rejected):
    doc, page = rejected
    assert page.headings[0] == ("h1", None, "d1: k = 5, k-same-select")
    # A rejection released nothing, so it states no guarantee (issue 29), in a grey box, never the green one.
    assert "<p class='guarantee nothing'><b>Guarantee:</b> none: nothing released</p>" in doc
    assert doc.index("REJECTED") < doc.index("none: nothing released") < doc.index("<h2>Checks</h2>")
    assert html.escape(GUARANTEE) not in doc and "formal:" not in doc
    released = render_report_html(Report.from_dict(_report("released")))
    assert released.index("RELEASED") < released.index(f"<p class='guarantee'><b>Guarantee of this release:</b> "
                                                        f"{html.escape(GUARANTEE)}") < released.index("<h2>Checks</h2>")


def test_rejection_reasons_in_words_with_rounded_numbers(rejected):
    doc, _ = rejected
    box = doc[doc.index('<div class="reasons">'):doc.index("</div>", doc.index('<div class="reasons">'))]
    assert check_requirement("utility_expression") in box.replace("&#x27;", "'")
    assert "measured 0.0683 [0.041, 0.095] n=60, required accuracy drop &lt;= 0.05" in box
    assert "0.822" in box and "+0.068" in box and "0.8216666" not in box
    assert "0.8216666" not in doc  # nowhere on the page (report.json keeps the exact figures)


def test_every_threshold_states_its_direction(rejected):
    _, page = rejected
    table = page.table_after("requirement")
    assert table[0] == ["requirement", "measured", "required", "result", "detail"]
    # The requirement cell is the plain sentence followed by the check's code name.
    code = {c["name"]: next(row[2] for row in table[1:] if row[0].endswith(c["name"])) for c in _report()["checks"]}
    assert [code[c] for c in ("min_distinct_people_per_cluster", "max_person_share", "quarantine_fraction",
                              "enough_people", "lineage_returning_identical", "reidentification_rate")] == [
        ">= 5", "<= 0.200", "<= 0.05", ">= 5", "= 0", "<= 0.200"]
    assert code["no_forbidden_columns"] == "only: cluster_id, gender, image, record_id"
    assert threshold_text("expectations_release", 0) == "= 0" and threshold_text("x", None) == "\u2014"


def test_partitions_are_label_values_not_python_lists(rejected):
    doc, page = rejected
    table = page.table_after("partition")
    assert table[0] == ["partition (gender / expression)", "records", "people"]
    assert [r[0] for r in table[1:]] == ["female / neutral", "female / smile", "male / neutral", "male / smile"]
    assert "['" not in doc and "[&#x27;" not in doc


def test_configuration_is_a_table_not_a_json_dump(rejected):
    doc, page = rejected
    table = page.table_after("setting")
    rows = {r[0]: r[1:] for r in table[1:]}
    assert rows["utility_tolerance"] == ["0.05", "largest accuracy drop allowed"]
    assert rows["canonical_size"][0] == "81 x 92"
    assert rows["canonical_eyes"][0] == "24.3 x 34.04; 56.7 x 34.04"
    assert rows["stage_seconds"][0] == "align 4.1, gate 7.8"
    assert rows["labels"][0] == "gender, expression"
    assert "partitions" not in rows and "clusters" not in rows  # shown in their own section
    assert doc.count("<pre>") == 1  # only the verify command


def test_charts_are_drawn_for_their_displayed_size(rejected):
    _, page = rejected
    charts = [a for a in page.svgs if a.get("class") == "chart"]
    assert len(charts) == 4  # re-identification, utility, partitions, cluster sizes
    for svg in charts:
        width = int(svg["width"])
        assert 300 <= width <= MAX_WIDTH_PX  # never scaled down by the browser at 100% zoom
        # Drawn in CSS pixels: the viewBox is the displayed size, so text keeps its size.
        assert svg["viewbox"] == f"0 0 {svg['width']} {svg['height']}"
        assert svg["aria-label"] and svg["role"] == "img"


def _box(el) -> tuple[float, float]:
    """Vertical extent (top, bottom) of a rect, line or text element (text: its font size around y)."""
    if el.tag == "rect":
        y = float(el.get("y"))
        return y, y + float(el.get("height"))
    if el.tag == "line":
        return sorted((float(el.get("y1")), float(el.get("y2"))))
    y, h = float(el.get("y")), float(el.get("font-size"))
    return y - h / 2, y + h / 2


def test_chart_text_size_k_line_and_legend_outside_the_bars():
    from xml.etree import ElementTree

    r = _report()
    typed = Report.from_dict(r)
    charts = {"reid": html_charts.reid_chart(typed.privacy.reidentification, 0.2),
              "utility": html_charts.utility_chart(typed.utility),
              "partitions": html_charts.partition_chart(r["configuration"]["partitions"], 5),
              "clusters": html_charts.cluster_chart(r["configuration"]["clusters"]["sizes"], 5)}
    for name, chart in charts.items():
        root = ElementTree.fromstring(chart.svg)
        texts = root.findall(".//text")
        # 10.5 pt is 14 CSS px (the old PNG charts: 7 pt scaled to about 6 px).
        assert texts and min(float(t.get("font-size")) for t in texts) >= FONT_PX >= 13, name
        assert chart.width <= MAX_WIDTH_PX and int(root.get("width")) == chart.width, name
        legend = root.find("g[@class='legend']")
        bars = root.findall("rect[@class='bar']")
        assert legend is not None and bars, name
        legend_bottom = max(_box(el)[1] for el in legend)
        assert legend_bottom <= min(_box(b)[0] for b in bars), name  # above every bar: it cannot cover one
        # Labels never run into the plot: a right-anchored y label ends left of the bars' start.
        for t in root.findall("text[@class='ylabel']"):
            assert float(t.get("x")) <= min(float(b.get("x")) for b in bars), name
    clusters = ElementTree.fromstring(charts["clusters"].svg)
    ticks = {t.text: float(t.get("x")) for t in clusters.findall("text") if t.text and t.text.isdigit()}
    k_line = clusters.find("line[@class='vline']")
    assert float(k_line.get("x1")) == float(k_line.get("x2")) == pytest.approx(ticks["5"], abs=0.1)  # at k, not k - 0.5
    labels = [t.text for t in ElementTree.fromstring(charts["partitions"].svg).findall("text[@class='ylabel']")]
    assert labels == ["female / neutral", "female / smile", "male / neutral", "male / smile"]
    # A rate above 1/k is drawn red, and the legend says what red means.
    over = html_charts.reid_chart([Reidentification("a", "naive", 0.5, lower=0.3, upper=0.7),
                                   Reidentification("b", "naive", 0.1)], 0.2)
    assert "rate &gt; 1/k" in over.svg or "rate > 1/k" in over.svg
    fills = [b.get("fill") for b in ElementTree.fromstring(over.svg).findall("rect[@class='bar']")]
    assert fills[0] != fills[1]


def test_round_numbers_keeps_versions_ranges_and_signs():
    assert round_numbers("delta +0.0683333 [-0.0321, 0.0654] v1.24.1 2026.8.0 seeds 0..2 0.05") == \
        "delta +0.068 [-0.032, 0.065] v1.24.1 2026.8.0 seeds 0..2 0.05"


def test_whiskers_past_1_over_k_are_explained_and_the_attackers_named():
    """Issue 29 item 10: a released k-Same run's chart has whiskers far past 1/k (upper bounds 0.3 > 0.2 here);
    the page says why it passes (the exact bound decides), and what each attacker and mode is."""
    from deid.evaluation.attacks import ATTACKERS, FEATURE_ATTACKERS, MODES
    from deid.reporting.wording import ATTACKER_WORDS, MODE_WORDS

    assert set(ATTACKER_WORDS) == set(ATTACKERS) | set(FEATURE_ATTACKERS) and set(MODE_WORDS) == set(MODES)
    doc = render_report_html(Report.from_dict(_report("released")))
    section = doc[doc.index("<h2>Re-identification</h2>"):doc.index("<h2>Utility</h2>")]
    note = section[section.index("Why whiskers past the 1/k line do not decide"):]
    note = note[:note.index("</p>")]
    assert "12 intervals reach past 1/k" in note and "identical image" in note and "0.200 (at most 1/k: it holds)" in note
    glossary = section[section.index("<details class='glossary'"):]
    for name in ("pca-mahalanobis", "fisherfaces", "lbp-chi2", "dlib-resnet", "naive", "reverse", "parrot"):
        assert f"<dt><code>{name}</code></dt><dd>{html.escape(ATTACKER_WORDS.get(name) or MODE_WORDS[name])}</dd>" \
            in glossary, name
    assert "pca-whitened-cosine" not in glossary  # only the attackers the table shows
    # Without the exact bound the same whiskers decide, and the page says so; within 1/k: nothing to explain.
    r = _report("rejected")
    r["privacy"]["exact_bound"] = False
    assert "Whiskers past the 1/k line decide here" in render_report_html(Report.from_dict(r))
    for row in r["privacy"]["reidentification"]:
        row["upper"] = 0.19
    assert "Whiskers past" not in render_report_html(Report.from_dict(r)) and "whiskers past" not in render_report_html(Report.from_dict(r))


def test_a_method_without_clusters_is_not_reported_as_forming_them():
    """Issue 29 item 10: blur's report said "forms no clusters" (gate) and "204 clusters" (page)."""
    r = _report("rejected")
    r["method"] = "blur"
    r["configuration"]["clusters"] = {"count": 60, "sizes": [1] * 60}
    r["checks"].append({"name": "min_cluster_size", "passed": True, "status": "not_applicable", "value": None,
                        "threshold": ">= 5", "detail": "not applicable: method blur forms no clusters"})
    doc = render_report_html(Report.from_dict(r))
    assert "Method blur forms no clusters: each of the 60 faces was de-identified on its own" in doc
    assert "60 clusters" not in doc and "Cluster sizes" not in doc
    assert "12 clusters of 5&ndash;7 records" in render_report_html(Report.from_dict(_report("rejected")))
