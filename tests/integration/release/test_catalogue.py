"""The catalogue of releases (deid.release.catalogue, ``deid releases``): every run listed, index.html offline."""
import json
import re

from deid.cli import main
from deid.release.catalogue import read_catalogue
from deid.reporting.catalogue_page import write_index


def _report(release_id, *, verdict="released", created="2026-11-01T10:00:00Z", name="london", k=5, reasons=()):
    return {
        "release_id": release_id, "verdict": verdict, "reasons": list(reasons), "k": k, "method": "k-same-select",
        "created_at": created,
        "dataset": {"name": name, "records_in": 204, "records_released": 200 if verdict == "released" else 0},
        "privacy": {"bound": 1 / k, "max_rate": 0.17, "min_distinct_people_per_cluster": 5,
                    "reidentification": [
                        {"attacker": "pca", "mode": "naive", "rate": 0.17, "lower": 0.05, "upper": 0.31,
                         "n_probes": 40},
                        {"attacker": "lbp", "mode": "reverse", "rate": 0.12, "lower": 0.08, "upper": 0.18,
                         "n_probes": 200}]},
        "utility": [
            {"label": "gender", "protocol": "cv", "original_accuracy": 0.9, "deidentified_accuracy": 0.5},
            {"label": "gender", "protocol": "cross-fit", "original_accuracy": 0.84, "deidentified_accuracy": 0.85,
             "delta_lower": -0.08, "delta_upper": 0.06, "n_test_images": 200, "status": "pass"}],
        "configuration": {"utility_protocol": "cross-fit"},
    }


def _write(root, report, *, signed=True, html=True):
    d = root / report["release_id"]
    d.mkdir(parents=True)
    (d / "report.json").write_text(json.dumps(report))
    if signed:
        (d / "report.json.sig").write_text("c2ln\n")
    if html:
        (d / "report.html").write_text("<html></html>")
    return d


def _reports(tmp_path):
    root = tmp_path / "reports"
    _write(root, _report("rel-old", created="2026-10-01T09:00:00Z"))
    rej = _report("rel-rej", verdict="rejected", created="2026-11-02T09:00:00Z", name="drop <b>x</b>",
                  reasons=["utility_gender: release 0.5 vs originals 0.9 - tolerance 0.05"])
    rej["checks"] = [{"name": "enough_people", "passed": True, "status": "pass", "value": 40, "threshold": ">= 5"},
                     {"name": "release_not_empty", "passed": False, "status": "fail", "value": 0, "threshold": ">= 1",
                      "detail": "nothing to release"},
                     {"name": "utility_gender", "passed": False, "status": "fail", "value": 0.4, "threshold": 0.05,
                      "detail": "release 0.5 vs originals 0.9 - tolerance 0.05"}]
    rej["guarantee"] = "formal: 1/k bound (k-Same)"
    _write(root, rej)
    d = _write(root, _report("rel-gone", created="2026-11-03T09:00:00Z"))
    (d / "addendum.json").write_text(json.dumps({"event": "not_published", "release_published": False}))
    _write(root, _report("rel-nosig", created="2026-11-04T09:00:00Z"), signed=False, html=False)
    (root / "rel-broken").mkdir()
    (root / "rel-broken" / "report.json").write_text("{not json")
    (root / "README.md").write_text("not a run")
    return root


def test_catalogue_lists_every_run_newest_first_with_its_state(tmp_path):
    entries = read_catalogue(_reports(tmp_path))
    assert [e.release_id for e in entries] == ["rel-nosig", "rel-gone", "rel-rej", "rel-old", "rel-broken"]
    by = {e.release_id: e for e in entries}
    assert by["rel-old"].verdict == "released" and by["rel-old"].status is None
    assert by["rel-rej"].verdict == "rejected" and by["rel-rej"].reasons[0].startswith("utility_gender")
    assert by["rel-gone"].status.startswith("not published") and "not_published" in by["rel-gone"].status
    assert by["rel-nosig"].status == "unsigned" and by["rel-nosig"].report_html is None
    assert by["rel-broken"].verdict == "unreadable" and "could not be read" in by["rel-broken"].status
    fig = by["rel-old"].figures
    # The worst attack is the one with the highest upper bound; utility is the protocol the gate decided by.
    assert (fig.worst_attack, fig.worst_upper, fig.worst_probes) == ("pca (naive)", 0.31, 40)
    assert [(u.label, u.deidentified_accuracy, u.n_test) for u in fig.utility] == [("gender", 0.85, 200)]
    assert (fig.records_in, fig.records_released, fig.bound) == (204, 200, 0.2)


def test_index_html_links_each_report_relatively_and_references_nothing_external(tmp_path):
    from deid.reporting.verdict import verdict_summary

    root = _reports(tmp_path)
    page = write_index(root).read_text()
    # Each run is its verdict summary, rendered (the words deid run, the Prefect UI and report.html use).
    rej = verdict_summary(json.loads((root / "rel-rej" / "report.json").read_text()))
    assert rej.causes and rej.consequences and rej.guarantee == "none: nothing released"
    for text in (*rej.causes, *rej.consequences, "(a consequence of the above)"):
        assert text.split(": ", 1)[-1].replace("&", "&amp;").replace(">", "&gt;") in page, text
    rows = {r.split('href="')[1].split("/")[0]: r for r in page.split("<tr>") if 'href="' in r}
    assert "none: nothing released" in rows["rel-rej"] and "formal" not in rows["rel-rej"]  # it promises nothing
    assert "guarantee nothing'><b>Guarantee:</b> none: nothing released (not published (signed addendum: " \
        "not_published))" in rows["rel-gone"]  # the grey box of a run that released nothing, not the green one
    assert "re-identification</b>: max 0.1700 (highest bound: pca (naive) 0.170 [0.050, 0.310], n=40)" in rows["rel-old"]
    links = re.findall(r'href="([^"]+)"', page)
    assert sorted(links) == ["rel-gone/report.html", "rel-old/report.html", "rel-rej/report.html"]
    assert all((root / link).is_file() for link in links)
    assert "http://" not in page and "https://" not in page and "src=" not in page
    assert "Content-Security-Policy" in page and "default-src 'none'" in page
    assert "drop &lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page  # dataset names are escaped
    assert "rel-broken" in page and "no report.html" in page
    assert not list(root.glob(".*.tmp"))


def test_deid_releases_prints_the_catalogue_and_writes_the_index(tmp_path, capsys):
    root = _reports(tmp_path)
    assert main(["releases", "--reports-dir", str(root)]) == 0
    out = capsys.readouterr().out
    assert "rel-old  RELEASED" in out and "rel-rej  REJECTED" in out
    # The verdict summary: the root cause before its consequence, no guarantee for a rejection, the figures
    # rounded with their interval and n, report.html's path (report.json's only where there is no report.html).
    block = out[out.index("rel-rej  REJECTED"):out.index("rel-old  RELEASED")]
    assert block.index("  cause: ") < block.index("  then: ") and "guarantee: none: nothing released" in block
    assert "re-identification: max 0.1700 (highest bound: pca (naive) 0.170 [0.050, 0.310], n=40); bound 1/k = " \
        "0.2000" in out
    assert f"report: {root / 'rel-old' / 'report.html'}" in out
    assert f"report: {root / 'rel-nosig' / 'report.json'} (no report.html)" in out
    assert "5 runs: 1 released, 4 rejected, unpublished, unsigned or unreadable" in out
    assert (root / "index.html").is_file()
    assert main(["releases", "--reports-dir", str(root), "--json", "--no-index"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [e["release_id"] for e in listed][:2] == ["rel-nosig", "rel-gone"]
    assert listed[0]["summary"]["verdict"] == "released" and listed[0]["summary"]["figures"]


def test_deid_releases_on_a_missing_directory_is_bad_input(tmp_path, capsys):
    assert main(["releases", "--reports-dir", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_reports_server_serves_report_html_and_the_catalogue_read_only(tmp_path):
    """`deid server`'s reports server: the report artifact's link opens report.html; nothing else is possible."""
    import urllib.error
    import urllib.request

    from deid.orchestration.reports_server import report_url, start_reports_server

    reports = tmp_path / "reports"
    _write(reports, _report("rel-a"))
    write_index(reports)
    httpd = start_reports_server(reports, 0)  # port 0: a free one
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        url = report_url(base, reports, reports / "rel-a")
        assert url == f"{base}/rel-a/report.html"
        with urllib.request.urlopen(url, timeout=5) as r:
            assert r.status == 200 and r.read() == (reports / "rel-a" / "report.html").read_bytes()
            assert r.headers["Cache-Control"] == "no-store"
        with urllib.request.urlopen(base + "/", timeout=5) as r:
            assert "rel-a" in r.read().decode()  # the catalogue, index.html
        for method, path, code in (("PUT", "/rel-a/report.html", 501), ("DELETE", "/rel-a/report.html", 501),
                                   ("GET", "/rel-a/", 404), ("GET", "/../" + tmp_path.name + "/x", 404)):
            req = urllib.request.Request(base + path, method=method, data=b"x" if method == "PUT" else None)
            try:
                urllib.request.urlopen(req, timeout=5)
                raise AssertionError(f"{method} {path} answered")
            except urllib.error.HTTPError as exc:
                assert exc.code == code, (method, path, exc.code)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert (reports / "rel-a" / "report.html").is_file()  # nothing written or removed
    assert report_url(base, reports, tmp_path / "elsewhere" / "rel-b") is None
