"""report.html: one self-contained page a data steward reads, and the offline validation results beside it.

Everything is inline (CSS in a ``<style>``, charts and faces as base64 PNG data URIs) and the page
contains no ``http://``/``https://`` text at all, so it renders offline, years later, and cannot
leak that it was opened. Charts are PNG rather than SVG because matplotlib's SVG carries XML
namespace URLs. Sample faces are taken only from a published release directory by
:func:`sample_release_images`; this module never reads staging data.
"""
from __future__ import annotations

import base64
import html
import io
import json
import logging
import os
import random
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from deid.errors import REASONS, ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "REPORT_HTML",
    "VALIDATION_DIR",
    "build_offline_data_docs",
    "render_report_html",
    "render_validation_html",
    "sample_release_images",
    "strip_urls",
    "validation_results_to_dicts",
    "write_report_bundle",
]

REPORT_HTML = "report.html"
VALIDATION_DIR = "validation"
VALIDATION_JSON = "validation_results.json"
VALIDATION_HTML = "index.html"
# A URL up to whitespace, a quote or bracket; trailing sentence punctuation stays in the text.
_URL = re.compile(r"(?i)\b(?:https?|ftp)://[^\s\"'<>)]*?(?=[.,;:!?]*(?:[\s\"'<>)]|$))")
_MAX_SAMPLES = 200

_CSS = """
:root { --ok: #1b7f3b; --bad: #b3261e; --muted: #5f6368; --line: #dadce0; }
* { box-sizing: border-box; }
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 0 auto;
       max-width: 1100px; padding: 1.5rem; color: #202124; line-height: 1.4; }
h1 { margin: 0 0 .25rem 0; font-size: 1.6rem; }
h2 { border-bottom: 1px solid var(--line); padding-bottom: .2rem; margin-top: 2rem; font-size: 1.2rem; }
.verdict { display: inline-block; padding: .3rem .8rem; border-radius: .3rem; color: #fff; font-weight: 700;
           letter-spacing: .05em; }
.verdict.released { background: var(--ok); } .verdict.rejected { background: var(--bad); }
.summary { display: flex; flex-wrap: wrap; gap: 1.5rem; margin: .8rem 0; }
.summary div { min-width: 8rem; } .summary b { display: block; font-size: 1.3rem; }
.muted { color: var(--muted); font-size: .9rem; }
table { border-collapse: collapse; width: 100%; margin: .5rem 0; font-size: .9rem; }
th, td { border: 1px solid var(--line); padding: .3rem .5rem; text-align: left; vertical-align: top; }
th { background: #f1f3f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.pass { color: var(--ok); font-weight: 700; } .fail { color: var(--bad); font-weight: 700; }
.reasons { background: #fce8e6; border-left: 4px solid var(--bad); padding: .5rem 1rem; }
.chart { max-width: 100%; height: auto; }
.faces { display: flex; flex-wrap: wrap; gap: 4px; }
.faces img { width: 81px; image-rendering: pixelated; border: 1px solid var(--line); }
pre { background: #f8f9fa; border: 1px solid var(--line); padding: .6rem; overflow-x: auto; font-size: .8rem; }
code { background: #f1f3f4; padding: 0 .2rem; }
"""


# --------------------------------------------------------------------------- helpers


def _e(value: Any) -> str:
    """HTML-escaped text of any value (None as an em dash)."""
    if value is None:
        return "&mdash;"
    return html.escape(str(value), quote=True)


def strip_urls(text: str) -> str:
    """Replace every ``http(s)://`` or ``ftp://`` URL in ``text`` by ``[link removed]``.

    Report text comes from manifests, settings and gate details the steward does not control;
    a URL in it would otherwise appear in a page promised to reference nothing external.
    """
    return _URL.sub("[link removed]", text)


def _fmt(value: Any) -> str:
    """Compact human text of a check value / threshold (JSON for structures)."""
    if value is None:
        return "\u2014"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int | str):
        return str(value)
    return json.dumps(value, sort_keys=True, default=str)


def _png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _face_png(image: np.ndarray) -> bytes:
    import cv2  # noqa: PLC0415 - keeps the module importable without OpenCV for the JSON-only paths

    arr = np.asarray(image)
    if arr.dtype != np.uint8 or arr.ndim not in (2, 3):
        raise ConfigError(
            f"sample image of dtype {arr.dtype} and shape {arr.shape} must be a uint8 (h, w) or (h, w, c) array; "
            "pass the decoded released PNGs from sample_release_images"
        )
    ok, buf = cv2.imencode(".png", arr)
    if not ok:
        raise ConfigError(f"could not PNG-encode a sample image of shape {arr.shape}")
    return buf.tobytes()


def _figure_png(fig) -> bytes:
    buf = io.BytesIO()
    # No Software metadata: it carries matplotlib's homepage URL.
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    import matplotlib.pyplot as plt  # noqa: PLC0415

    plt.close(fig)
    return buf.getvalue()


def _pyplot():
    import matplotlib  # noqa: PLC0415 - ~0.5 s; only needed when a report is rendered

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def _img(png: bytes, alt: str, cls: str = "chart") -> str:
    return f'<img class="{cls}" alt="{_e(alt)}" src="{_png_data_uri(png)}">'


# --------------------------------------------------------------------------- charts


def _reid_chart(reid: list[dict[str, Any]], bound: float) -> bytes | None:
    if not reid:
        return None
    plt = _pyplot()
    names = [f"{r['attacker']}\n{r['mode']}" for r in reid]
    rates = [float(r["rate"]) for r in reid]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * len(reid) + 2), 3.2))
    colors = ["#b3261e" if r > bound + 1e-12 else "#1a73e8" for r in rates]
    ax.bar(range(len(rates)), rates, color=colors)
    ax.axhline(bound, color="#202124", linestyle="--", linewidth=1.2, label=f"1/k = {bound:.4g}")
    ax.set_xticks(range(len(rates)), names, fontsize=7, rotation=35, ha="right")
    ax.set_ylabel("re-identification rate")
    ax.set_ylim(0, max(max(rates), bound) * 1.25 or 1.0)
    for i, r in enumerate(rates):
        ax.text(i, r, f"{r:.3f}", ha="center", va="bottom", fontsize=8)
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title("Re-identification per attacker x mode", fontsize=10)
    return _figure_png(fig)


def _interval(iv: Any, n: Any = None) -> str:
    if not iv:
        return ""
    return f"[{iv[0]:.3f}, {iv[1]:.3f}]" + (f" n={n}" if n is not None else "")


def _utility_label(u: Mapping[str, Any]) -> str:
    return f"{u['label']} ({u['protocol']})" if u.get("protocol") else str(u["label"])


def _utility_chart(utility: list[dict[str, Any]]) -> bytes | None:
    rows = [u for u in utility if u.get("original_accuracy") is not None or u.get("deidentified_accuracy") is not None]
    if not rows:
        return None
    plt = _pyplot()
    x = np.arange(len(rows))
    orig = [u.get("original_accuracy") or 0.0 for u in rows]
    deid = [u.get("deidentified_accuracy") or 0.0 for u in rows]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.4 * len(rows) + 2), 3.2))
    ax.bar(x - 0.2, orig, width=0.4, label="original", color="#9aa0a6")
    ax.bar(x + 0.2, deid, width=0.4, label="release", color="#1a73e8")
    ax.set_xticks(x, [_utility_label(u) for u in rows], fontsize=7, rotation=25, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("classifier accuracy")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("Utility: original vs release", fontsize=10)
    return _figure_png(fig)


def _partition_chart(partitions: list[dict[str, Any]]) -> bytes | None:
    if not partitions:
        return None
    plt = _pyplot()
    x = np.arange(len(partitions))
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(partitions) + 2), 3.2))
    ax.bar(x - 0.2, [p.get("records", 0) for p in partitions], width=0.4, label="records", color="#1a73e8")
    ax.bar(x + 0.2, [p.get("people", 0) for p in partitions], width=0.4, label="people", color="#fbbc04")
    ax.set_xticks(x, [str(p.get("key", i)) for i, p in enumerate(partitions)], fontsize=7, rotation=30, ha="right")
    ax.legend(fontsize=8)
    ax.set_title("Partitions", fontsize=10)
    return _figure_png(fig)


def _cluster_chart(sizes: list[int], k: int) -> bytes | None:
    if not sizes:
        return None
    plt = _pyplot()
    counts = Counter(int(s) for s in sizes)
    xs = sorted(counts)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(xs) + 2), 3.0))
    ax.bar(xs, [counts[s] for s in xs], color="#1a73e8", width=0.8)
    ax.axvline(k - 0.5, color="#b3261e", linestyle="--", linewidth=1.0, label=f"k = {k}")
    lo, hi = min(k - 1, xs[0] - 1), xs[-1] + 1
    ax.set_xlim(lo, hi)
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("records per cluster")
    ax.set_ylabel("clusters")
    ax.legend(fontsize=8)
    ax.set_title("Cluster sizes", fontsize=10)
    return _figure_png(fig)


# --------------------------------------------------------------------------- sample faces


def sample_release_images(release_dir: Path, n: int = 24, seed: int = 0) -> list[np.ndarray]:
    """Decode up to ``n`` released faces (grayscale uint8), one per released cluster, from a published release.

    Reads only ``release_dir/release.parquet`` and PNGs under ``release_dir/images/``: a path that
    leaves ``images/``, a symlink or a non-PNG is skipped, so nothing but released faces can be shown.
    Without ``release.parquet`` the PNGs of ``images/`` are sampled directly.
    """
    import cv2  # noqa: PLC0415

    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= _MAX_SAMPLES:
        raise ConfigError(f"n={n!r} must be an integer between 0 and {_MAX_SAMPLES}")
    release_dir = Path(release_dir)
    images_dir = release_dir / "images"
    if not images_dir.is_dir() or images_dir.is_symlink():
        raise ConfigError(f"{release_dir} is not a published release (no images/ directory); pass data/releases/<id>")
    root = images_dir.resolve()
    rng = random.Random(seed)
    table_path = release_dir / "release.parquet"
    candidates: list[str]
    if table_path.is_file():
        import pyarrow.parquet as pq  # noqa: PLC0415

        rows = pq.read_table(table_path, columns=["image", "cluster_id"]).to_pylist()
        by_cluster: dict[str, list[str]] = {}
        for r in rows:
            by_cluster.setdefault(str(r["cluster_id"]), []).append(str(r["image"]))
        clusters = sorted(by_cluster)
        rng.shuffle(clusters)
        # One face per cluster: k-Same gives every member of a cluster the same face.
        candidates = [rng.choice(sorted(by_cluster[c])) for c in clusters]
    else:
        candidates = sorted(p.relative_to(release_dir).as_posix() for p in images_dir.glob("*.png"))
        rng.shuffle(candidates)
    out: list[np.ndarray] = []
    for rel in candidates:
        if len(out) >= n:
            break
        p = release_dir / rel
        if p.is_symlink() or not p.is_file() or p.suffix.lower() != ".png" or p.resolve().parent != root:
            logger.warning("sample_release_images: skipping %s (not a PNG directly under images/)", rel)
            continue
        img = cv2.imdecode(np.frombuffer(p.read_bytes(), np.uint8), cv2.IMREAD_UNCHANGED)
        if img is None or img.dtype != np.uint8:
            logger.warning("sample_release_images: skipping %s (not an 8-bit PNG)", rel)
            continue
        out.append(img)
    return out


# --------------------------------------------------------------------------- the page


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], num: Sequence[int] = ()) -> str:
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{c}</td>' if i in num else f"<td>{c}</td>" for i, c in enumerate(r)) + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _pct(v: Any) -> str:
    return "\u2014" if v is None else f"{float(v):.3f}"


def render_report_html(
    report: Mapping[str, Any],
    *,
    sample_images: Sequence[np.ndarray] | None = None,
    gx_results: Any = None,
    validation_href: str | None = None,
    public_key_hint: str = "KEY.pub.pem",
    report_dir_hint: str | None = None,
) -> str:
    """The steward's report as one self-contained HTML document (no external reference of any kind).

    Parameters
    ----------
    report : the report dict (as signed; ``report_files`` is not needed and cannot include this page).
    sample_images : de-identified faces to show, uint8 arrays; pass only released images
        (:func:`sample_release_images`). Ignored for a rejected run, which released nothing.
    gx_results : Great Expectations validation results (see :func:`validation_results_to_dicts`);
        summarised in a table.
    validation_href : relative link to the offline validation page (e.g. ``"validation/index.html"``).
    public_key_hint, report_dir_hint : shown in the "how to verify" command.
    """
    r = report
    ds = r.get("dataset", {})
    cfg = r.get("configuration", {}) or {}
    privacy = r.get("privacy") or {}
    k = int(r["k"])
    verdict = str(r["verdict"])
    parts: list[str] = []
    add = parts.append

    # --- header
    add(f'<header><span class="verdict {_e(verdict)}">{_e(verdict.upper())}</span>')
    add(f"<h1>{_e(ds.get('name', 'dataset'))}: k = {k}, {_e(r.get('method'))}</h1>")
    add(f'<div class="muted">release {_e(r.get("release_id"))} &middot; run {_e(r.get("run_id"))} '
        f"&middot; {_e(r.get('created_at'))}</div></header>")
    if r.get("guarantee"):
        add(f"<p class='guarantee'>{_e(r['guarantee'])}</p>")
    if r.get("reasons"):
        add('<div class="reasons"><b>Rejected because:</b><ul>'
            + "".join(f"<li>{_e(x)}</li>" for x in r["reasons"]) + "</ul></div>")
    if r.get("warnings"):
        add('<div class="reasons"><b>Warnings (not blocking):</b><ul>'
            + "".join(f"<li>{_e(x)}</li>" for x in r["warnings"]) + "</ul></div>")
    add('<div class="summary">')
    for label, value in (
        ("records in", ds.get("records_in")), ("released", ds.get("records_released")),
        ("suppressed", ds.get("records_suppressed")), ("quarantined", ds.get("records_quarantined")),
        ("max re-identification", _pct(privacy.get("max_rate"))), ("bound 1/k", _pct(privacy.get("bound"))),
        ("min people per cluster", privacy.get("min_distinct_people_per_cluster")),
        ("max person share", _pct(privacy.get("max_person_share"))),
    ):
        add(f"<div><b>{_e(value)}</b><span class='muted'>{_e(label)}</span></div>")
    add("</div>")

    # --- checks
    add("<h2>Checks</h2>")
    checks = r.get("checks", [])
    if checks:
        add(_table(["check", "value", "interval", "threshold", "status", "result", "detail"], [
            [_e(c["name"]), _e(_fmt(c.get("value"))), _e(_interval(c.get("interval"), c.get("n"))),
             _e(_fmt(c.get("threshold"))), _e(str(c.get("status") or ("pass" if c["passed"] else "fail")).replace("_", " ")),
             '<span class="pass">pass</span>' if c["passed"] else '<span class="fail">FAIL</span>',
             _e(c.get("detail", ""))]
            for c in checks
        ]))
    else:
        add("<p class='muted'>No checks were run.</p>")

    # --- privacy
    add("<h2>Re-identification</h2>")
    reid = list(privacy.get("reidentification") or [])
    bound = float(privacy.get("bound") or 1.0 / k)
    chart = _reid_chart(reid, bound)
    if chart:
        add(_img(chart, "re-identification rate per attacker and mode, with the 1/k bound"))
        add(_table(["attacker", "mode", "rate", "interval (n distinct probes)", "bound 1/k", "point estimate"], [
            [_e(x["attacker"]), _e(x["mode"]), _pct(x["rate"]),
             _e(_interval((x["lower"], x["upper"]), x.get("n_probes")) if "lower" in x else ""), _pct(bound),
             '<span class="pass">&le; 1/k</span>' if x["rate"] <= bound + 1e-12 else '<span class="fail">&gt; 1/k</span>']
            for x in reid
        ], num=(2, 4)))
        sample = privacy.get("attack_sample") or {}
        if sample:
            add(f"<p class='muted'>Attacked {sample.get('records')} of {sample.get('of')} released records "
                f"(whole {_e(sample.get('unit'))}s sampled, seed {_e(sample.get('seed'))}); one-sided "
                f"{_pct(sample.get('confidence'))} Clopper-Pearson bounds, Bonferroni over "
                f"{_e(sample.get('bonferroni_over'))} attacker x mode pairs.</p>")
    else:
        add("<p class='muted'>No re-identification attack was run.</p>")

    # --- utility
    add("<h2>Utility</h2>")
    utility = list(r.get("utility") or [])
    if utility:
        chart = _utility_chart(utility)
        if chart:
            add(_img(chart, "classifier accuracy per label, original vs release"))
        has_protocol = any(u.get("protocol") for u in utility)
        head = ["label", *(["protocol"] if has_protocol else []), "original", "release", "drop", "tolerance", "detail"]
        rows = []
        for u in utility:
            o, d = u.get("original_accuracy"), u.get("deidentified_accuracy")
            drop = None if o is None or d is None else o - d
            rows.append([_e(u["label"]), *([_e(u.get("protocol"))] if has_protocol else []), _pct(o), _pct(d),
                         _pct(drop), _pct(u.get("tolerance")),
                         _e(u.get("detail", ""))])
        off = 1 if has_protocol else 0
        add(_table(head, rows, num=(1 + off, 2 + off, 3 + off, 4 + off)))
    else:
        add("<p class='muted'>No utility labels were measured.</p>")

    # --- partitions and clusters
    add("<h2>Partitions and clusters</h2>")
    partitions = list(cfg.get("partitions") or [])
    chart = _partition_chart(partitions)
    if chart:
        add(_img(chart, "records and people per partition"))
        add(_table(["partition", "records", "people"],
                   [[_e(p.get("key")), _e(p.get("records")), _e(p.get("people"))] for p in partitions], num=(1, 2)))
    clusters = cfg.get("clusters") or {}
    sizes = list(clusters.get("sizes") or [])
    chart = _cluster_chart(sizes, k)
    if chart:
        add(_img(chart, "histogram of cluster sizes"))
    add(f"<p>{_e(clusters.get('count', len(sizes)))} clusters"
        + (f", sizes {min(sizes)}&ndash;{max(sizes)}" if sizes else "") + ".</p>")
    if not partitions and not sizes:
        add("<p class='muted'>No partitions or clusters (nothing was de-identified).</p>")

    # --- withheld records
    add("<h2>Suppressed and quarantined records</h2>")
    add(f"<p>{_e(ds.get('records_suppressed', 0))} suppressed (small partitions or a rejected run), "
        f"{_e(ds.get('records_quarantined', 0))} quarantined.</p>")
    small = cfg.get("small_partitions_detail") or []
    if small:
        # Counts only: a suppressed partition's label values may single out the few people in it.
        add(_table(["partition below k", "records", "people", "action"],
                   [[f"#{i}", _e(s.get("records")), _e(s.get("people")), _e(s.get("action"))]
                    for i, s in enumerate(small, start=1)], num=(1, 2)))
    by_reason = ds.get("quarantine_by_reason") or {}
    if by_reason:
        add(_table(["reason", "records", "meaning"], [
            [f"<code>{_e(code)}</code>", _e(count), _e(REASONS.get(code, ""))]
            for code, count in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0]))
        ], num=(1,)))

    # --- sample faces
    add("<h2>Sample of released faces</h2>")
    if verdict != "released":
        add("<p class='muted'>Nothing was released, so no faces are shown.</p>")
    elif sample_images:
        add(f"<p class='muted'>{len(sample_images)} de-identified faces from the published release "
            "(one per cluster). No original or quarantined face is ever shown.</p>")
        add('<div class="faces">' + "".join(
            _img(_face_png(im), "released de-identified face", cls="sample") for im in sample_images) + "</div>")
    else:
        add("<p class='muted'>No sample faces were provided.</p>")

    # --- validation
    if gx_results is not None or validation_href:
        add("<h2>Data validation</h2>")
        if gx_results is not None:
            add(_validation_summary_table(validation_results_to_dicts(gx_results)))
        if validation_href:
            add(f'<p>Full validation results (offline): <a href="{_e(validation_href)}">{_e(validation_href)}</a></p>')

    # --- provenance and verification
    add("<h2>Provenance</h2>")
    signing = r.get("signing") or {}
    add(_table(["", ""], [
        ["dataset fingerprint", f"<code>{_e(ds.get('fingerprint'))}</code>"],
        ["run id", f"<code>{_e(r.get('run_id'))}</code>"],
        ["release id", f"<code>{_e(r.get('release_id'))}</code>"],
        ["release directory", _e(r.get("release_dir"))],
        ["signer's key fingerprint", f"<code>{_e(signing.get('public_key_fingerprint'))}</code> "
                                     f"({_e(signing.get('algorithm', 'ed25519'))}, {_e(signing.get('key_origin'))} key)"],
        ["released files", _e(len(r.get("artifacts") or []))],
    ]))
    if signing.get("key_origin") == "development":
        add("<p class='fail'>Signed with a development key: not for production releases.</p>")
    add("<h3>How to verify</h3>")
    report_dir = report_dir_hint or f"reports/{r.get('release_id')}"
    add("<p>report.json is signed (Ed25519 over its canonical JSON, in report.json.sig) and lists the "
        "SHA-256 of every released file, of this page and of the validation results. With the signer's "
        "public key obtained from a channel you trust (never from beside the report), run:</p>")
    add(f"<pre>deid verify {_e(report_dir)} --public-key {_e(public_key_hint)}</pre>")
    add(f"<p class='muted'>The key's fingerprint must be <code>{_e(signing.get('public_key_fingerprint'))}</code>. "
        "Without --public-key only integrity is checked, not who signed.</p>")

    add("<h2>Versions</h2>")
    versions = r.get("versions") or {}
    add(_table(["package", "version"], [[_e(p), _e(v)] for p, v in sorted(versions.items())]) if versions
        else "<p class='muted'>not recorded</p>")
    add("<h2>Configuration</h2>")
    add(f"<pre>{_e(json.dumps(cfg, indent=2, sort_keys=True, default=str))}</pre>")

    title = f"deid report {r.get('release_id')}: {verdict}"
    doc = (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        # Belt and braces: even if a URL slipped through, the browser may not fetch anything.
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; "
        "style-src 'unsafe-inline'\">"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        + "".join(parts)
        + "</body></html>\n"
    )
    return strip_urls(doc)


# --------------------------------------------------------------------------- validation results


def validation_results_to_dicts(results: Any) -> list[dict[str, Any]]:
    """Normalise GX validation results to a list of JSON dicts, each with a ``name``.

    Accepts one result, a list of them, or a mapping name -> result; a result is a GX
    ``ExpectationSuiteValidationResult`` (anything with ``to_json_dict()``) or its dict form.
    """
    if results is None:
        return []
    if isinstance(results, Mapping) and "results" not in results:
        items = list(results.items())
    elif isinstance(results, Sequence) and not isinstance(results, str | bytes | Mapping):
        items = [(None, x) for x in results]
    else:
        items = [(None, results)]
    out = []
    for i, (name, res) in enumerate(items):
        d = res.to_json_dict() if hasattr(res, "to_json_dict") else res
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"validation result {name or i} is a {type(res).__name__}; pass a GX ExpectationSuiteValidationResult "
                "or its to_json_dict() form"
            )
        d = json.loads(json.dumps(d, default=str))
        d["name"] = str(name or d.get("suite_name") or f"suite-{i}")
        out.append(d)
    return out


def _validation_summary_table(results: list[dict[str, Any]]) -> str:
    rows = []
    for d in results:
        stats = d.get("statistics") or {}
        rows.append([
            _e(d["name"]),
            '<span class="pass">pass</span>' if d.get("success") else '<span class="fail">FAIL</span>',
            _e(stats.get("evaluated_expectations")), _e(stats.get("successful_expectations")),
            _e(stats.get("unsuccessful_expectations")),
        ])
    if not rows:
        return "<p class='muted'>No validation results.</p>"
    return _table(["suite", "result", "evaluated", "passed", "failed"], rows, num=(2, 3, 4))


def render_validation_html(results: Any, *, title: str = "Data validation results") -> str:
    """Offline HTML of GX validation results: per suite, every expectation with its kwargs and observed result.

    GX's own Data Docs load Bootstrap, jQuery, Vega and Font Awesome from CDNs and GX 1.24 does
    not ship those assets, so they cannot be made offline by rewriting links; this page renders
    the same validation results with inline CSS only.
    """
    docs = validation_results_to_dicts(results)
    parts = [f"<h1>{_e(title)}</h1>", _validation_summary_table(docs)]
    for d in docs:
        meta = d.get("meta") or {}
        parts.append(f"<h2 id=\"{_e(d['name'])}\">{_e(d['name'])} "
                     + ('<span class="pass">pass</span>' if d.get("success") else '<span class="fail">FAIL</span>')
                     + "</h2>")
        if meta.get("great_expectations_version"):
            parts.append(f"<p class='muted'>Great Expectations {_e(meta['great_expectations_version'])}</p>")
        rows = []
        for x in d.get("results") or []:
            cfg = x.get("expectation_config") or {}
            kwargs = {k: v for k, v in (cfg.get("kwargs") or {}).items() if k != "batch_id"}
            res = x.get("result") or {}
            observed = res.get("observed_value")
            if observed is None and "unexpected_count" in res:
                observed = (f"{res.get('unexpected_count')} unexpected of {res.get('element_count')}"
                            f" ({float(res.get('unexpected_percent') or 0):.2f}%)")
                if res.get("partial_unexpected_list"):
                    observed += "; e.g. " + json.dumps(res["partial_unexpected_list"][:10], default=str)
            exc = x.get("exception_info") or {}
            if exc.get("raised_exception"):
                observed = f"error: {exc.get('exception_message')}"
            rows.append([
                '<span class="pass">pass</span>' if x.get("success") else '<span class="fail">FAIL</span>',
                f"<code>{_e(cfg.get('type') or cfg.get('expectation_type'))}</code>",
                f"<code>{_e(json.dumps(kwargs, sort_keys=True, default=str))}</code>",
                _e(_fmt(observed)),
            ])
        parts.append(_table(["result", "expectation", "arguments", "observed"], rows) if rows
                     else "<p class='muted'>no expectations</p>")
    doc = (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; "
        "style-src 'unsafe-inline'\">"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"
        + "".join(parts) + "</body></html>\n"
    )
    return strip_urls(doc)


def build_offline_data_docs(validation_results: Any, out_dir: Path) -> list[Path]:
    """Write the run's validation results for offline reading: ``validation_results.json`` and ``index.html``.

    Returns the written paths. The JSON is GX's own ``to_json_dict()`` form (one entry per suite)
    so nothing is lost; the HTML is :func:`render_validation_html`, because the stock Data Docs
    depend on CDN assets that the installed GX does not include.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    docs = validation_results_to_dicts(validation_results)
    json_path = out_dir / VALIDATION_JSON
    json_path.write_text(json.dumps(docs, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    html_path = out_dir / VALIDATION_HTML
    html_path.write_text(render_validation_html(docs), encoding="utf-8")
    return [json_path, html_path]


# --------------------------------------------------------------------------- all together


def write_report_bundle(
    report_dir: Path,
    report: Mapping[str, Any],
    signing_key,
    *,
    sample_images: Sequence[np.ndarray] | None = None,
    validation_results: Any = None,
    public_key_hint: str | None = None,
) -> Path:
    """Write report.html, the offline validation results, and the signed report.json listing their hashes.

    ``signing_key`` is a :class:`deid.release.signing.SigningKey`; ``report["signing"]`` is set from it.
    Order matters: the HTML and validation files are written first, hashed into
    ``report["report_files"]``, and only then is report.json signed. Returns report.json's path.
    """
    from deid.reporting.report import hash_report_files, write_signed_report  # noqa: PLC0415 - avoid a cycle at import

    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    d = dict(report)
    d["signing"] = {"algorithm": "ed25519", "public_key_fingerprint": signing_key.fingerprint,
                    "key_origin": signing_key.origin}
    d.pop("report_files", None)
    href = None
    if validation_results is not None:
        build_offline_data_docs(validation_results, report_dir / VALIDATION_DIR)
        href = f"{VALIDATION_DIR}/{VALIDATION_HTML}"
    hint = public_key_hint or (str(signing_key.public_path) if signing_key.public_path else "KEY.pub.pem")
    page = render_report_html(d, sample_images=sample_images, gx_results=validation_results,
                              validation_href=href, public_key_hint=hint, report_dir_hint=str(report_dir))
    tmp = report_dir / f".{REPORT_HTML}.tmp"
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, report_dir / REPORT_HTML)
    d["report_files"] = hash_report_files(report_dir)
    return write_signed_report(report_dir, d, signing_key)
