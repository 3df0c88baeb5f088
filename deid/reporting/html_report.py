"""report.html: the one self-contained page a data steward reads, and the report bundle beside it.

The page answers, top down: was it released, what does the release guarantee, why was it
rejected (in words, rounded), then the evidence (checks with their required direction, attacks,
utility, partitions, clusters, validation), provenance and how to verify, and the configuration.
Everything is inline (see :mod:`deid.reporting.html_page`); the charts come from :mod:`deid.reporting.html_charts`,
the validation page from :mod:`deid.reporting.html_validation`. Sample faces are taken only from a
published release directory by :func:`sample_release_images`; this module never reads staging data.
"""
from __future__ import annotations

import base64
import dataclasses
import logging
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from deid.anonymise.near_copy import NEAR_COPY
from deid.errors import REASONS, ConfigError
from deid.reporting.html_charts import Chart, cluster_chart, partition_chart, partition_name, reid_chart, utility_chart
from deid.reporting.html_page import document, esc, fmt, round_numbers, strip_urls, table
from deid.release.signing import SigningKey
from deid.reporting.report import (Check, Privacy, Reidentification, Report, SigningInfo, hash_report_files,
                                   stage_usage_of, write_signed_report)
from deid.reporting.verdict import NOTHING_RELEASED, VerdictSummary, verdict_summary
from deid.reporting.wording import attack_terms, check_requirement, measured, report_only, threshold_text
from deid.reporting.html_validation import (
    VALIDATION_HTML,
    build_offline_data_docs,
    render_validation_html,
    validation_summary_table,
)
from deid.evaluation.validation import suite_results
from deid.bound import within_bound

logger = logging.getLogger(__name__)

__all__ = [
    "REPORT_HTML",
    "VALIDATION_DIR",
    "build_offline_data_docs",
    "check_requirement",
    "render_report_html",
    "render_validation_html",
    "sample_release_images",
    "strip_urls",
    "summary_html",
    "threshold_text",
    "write_report_bundle",
]

REPORT_HTML = "report.html"
VALIDATION_DIR = "validation"
_MAX_SAMPLES = 200

# The configuration table: what each setting means; shown in this order, unknown keys after.
_SETTINGS = {
    "labels": "utility labels (k-Same-Select partitions by them)",
    "license": "licence the dataset card states",
    "license_name": "licence name the dataset card states (with license: other)",
    "license_link": "where the licence's terms are (the dataset card's license_link)",
    "citation": "how to cite the source dataset (in the dataset card)",
    "notes": "notes of the run",
    "small_partitions": "what happens to a label partition with fewer than k people",
    "duplicate_ids": "policy for one person listed under several subject ids",
    "identity": "how people were counted (merges of ids that are the same face)",
    "canonical_size": "aligned face size in pixels (width, height)",
    "canonical_eyes": "eye centres in the aligned face, pixels (x, y)",
    "color": "colour kept (otherwise grey levels)",
    "eye_sources": "where the eye positions came from (records)",
    "pca_components": "eigenface components",
    "randomness": "the method's random seed: secret (drawn from the OS, kept in the private linkage record) or "
                  "fixed by DEID_SEED (not secret); what the parrot attacker was assumed to know",
    "sigma": "blur sigma (method blur)",
    "block": "pixel block size (method pixelate)",
    "gate_confidence": "confidence of every interval the gate decides from",
    "attack_sample": "records attacked (at most)",
    "deep_attack_sample": "records attacked by the deep recogniser (at most)",
    "leak_threshold": "mean grey-level difference below which a released face counts as a copy",
    "max_quarantine_fraction": "largest share of the drop that may be quarantined",
    "utility_protocol": "utility protocol the gate decides from",
    "utility_tolerance": "largest accuracy drop allowed",
    "utility_sample": "images used by the utility test (at most)",
    "utility_inconclusive": "what an inconclusive utility test does",
    "cv_folds": "cross-validation folds",
    "cv_repeats": "cross-validation repeats",
    "extra_manifest_columns": "manifest columns kept out of the release",
    "fingerprint_scope": "what the dataset fingerprint covers",
    "dask": "compute cluster",
    "stage_seconds": "per stage: wall seconds (CPU seconds of the run's processes, peak resident MiB of the run "
                     "process / summed over its processes)",
}
# Shown in their own sections, not in the configuration table.
_SHOWN_ELSEWHERE = ("partitions", "clusters", "small_partitions_detail")


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


def _chart(chart: Chart | None) -> str:
    if chart is None:
        return ""
    return chart.svg  # inline SVG, laid out for its CSS size (deid.reporting.html_charts)


# --------------------------------------------------------------------------- sample faces


def _one_image_per_cluster(table_path: Path, rng: random.Random) -> Iterator[str]:
    """One released image path per cluster of ``table_path`` (its ``image`` and ``cluster_id`` columns), the
    clusters in ``rng``'s shuffle of their sorted ids, each image drawn by ``rng`` among its cluster's sorted paths.

    k-Same gives every member of a cluster the same face, so one per cluster. The columns stay Arrow arrays,
    sorted once by (cluster, image): a Python dict per row held ~0.5 GB at a million records (issue 32).
    Arrow orders strings by their UTF-8 bytes, which is Python's code point order, and the draws are made
    one cluster at a time in the shuffled order: the paths are those of sorting and drawing in Python.
    """
    import pyarrow.compute as pc  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    t = pq.read_table(table_path, columns=["image", "cluster_id"])
    t = t.take(pc.sort_indices(t, sort_keys=[("cluster_id", "ascending"), ("image", "ascending")]))
    codes = pc.dictionary_encode(t.column("cluster_id").combine_chunks())
    clusters = codes.dictionary.to_pylist()  # sorted: the dictionary lists values as they first appear
    at = codes.indices.to_numpy(zero_copy_only=False)
    starts = np.searchsorted(at, np.arange(len(clusters) + 1))
    where = {c: i for i, c in enumerate(clusters)}
    images = t.column("image")
    rng.shuffle(clusters)
    for c in clusters:
        i = where[c]
        yield rng.choice(images.slice(int(starts[i]), int(starts[i + 1] - starts[i])).to_pylist())


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
    candidates: Iterable[str]
    if table_path.is_file():
        candidates = _one_image_per_cluster(table_path, rng)
    else:
        pngs = sorted(p.relative_to(release_dir).as_posix() for p in images_dir.glob("*.png"))
        rng.shuffle(pngs)
        candidates = pngs
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


# --------------------------------------------------------------------------- words for numbers


def _status(c: Check) -> str:
    status = str(c.status or ("pass" if c.passed else "fail"))
    if status == "inconclusive":
        return ('<span class="inconclusive">inconclusive</span> '
                + ("(not blocking)" if c.passed else '<span class="fail">(blocks)</span>'))
    if status == "not_applicable":
        return f'<span class="na">{"report only (no limit set)" if report_only(_check_json(c)) else "not applicable"}</span>'
    return '<span class="pass">pass</span>' if c.passed else '<span class="fail">FAIL</span>'


def _check_json(c: Check) -> dict[str, Any]:
    """A check as the wording shared with the CLI and the Markdown summary reads it (its report.json form)."""
    return dataclasses.asdict(c)


def _summary_item(text: str, note: str = "") -> str:
    """One sentence of the verdict summary: its requirement (before the first colon) in bold."""
    head, sep, rest = text.partition(": ")
    body = f"<b>{esc(head)}</b>: {esc(rest)}" if sep else esc(text)
    return f"<li>{body}{f' <i>{esc(note)}</i>' if note else ''}</li>"


def _reasons_html(summary: VerdictSummary, *, fold_warnings: bool = False) -> str:
    """The summary's causes (root cause first, then its consequences) and its warnings (folded: a
    ``<details>`` naming how many, for a page listing many runs)."""
    out = ""
    items = [_summary_item(c) for c in summary.causes]
    items += [_summary_item(c, "(a consequence of the above)") for c in summary.consequences]
    if items:
        out += '<div class="reasons"><b>Rejected because (root cause first):</b><ul>' + "".join(items) + "</ul></div>"
    if summary.warnings:
        warnings = "<ul>" + "".join(_summary_item(w) for w in summary.warnings) + "</ul>"
        if fold_warnings:
            n = len(summary.warnings)
            out += (f'<details class="reasons warnings"><summary><b>Not blocking, but read this: {n} warning'
                    f'{"s" if n > 1 else ""}</b></summary>{warnings}</details>')
        else:
            out += f'<div class="reasons warnings"><b>Not blocking, but read this:</b>{warnings}</div>'
    return out


def _num(v: Any, digits: int = 3) -> str:
    return "\u2014" if v is None else f"{float(v):.{digits}f}"


# --------------------------------------------------------------------------- the page's sections


def _header(r: Report) -> str:
    verdict = str(r.verdict)
    summary = verdict_summary(r)  # the same verdict summary the CLI and the Prefect UI show
    out = [f'<header><span class="verdict {esc(verdict)}">{esc(summary.headline)}</span>',
           f"<h1>{esc(r.dataset.name)}: k = {int(r.k)}, {esc(r.method)}</h1>",
           f'<div class="muted">release {esc(r.release_id)} &middot; run {esc(r.run_id)} '
           f"&middot; {esc(r.created_at)}</div></header>"]
    out.append(summary_html(summary))
    return "".join(out)


def _privacy(r: Report) -> Privacy:
    """The report's privacy section; a report without one states the bound alone (as its JSON does)."""
    return r.privacy if r.privacy is not None else Privacy(bound=1.0 / r.k)


def summary_html(summary: VerdictSummary, *, figures: bool = False, fold_warnings: bool = False) -> str:
    """The verdict summary as HTML (the classes of :data:`deid.reporting.html_page.CSS`): the guarantee box,
    the causes root cause first, the warnings, and with ``figures`` its key figures (report.html has its own
    tiles and tables; the catalogue shows the figures here, its warnings folded: ``fold_warnings``)."""
    # Green only for a formal guarantee of a release; amber for a release on empirical evidence only; a
    # rejection promises nothing: red-edged grey, never the green box of a release.
    if summary.guarantee.startswith(NOTHING_RELEASED) or not summary.released:
        cls, lead = "guarantee nothing", "Guarantee"
    elif summary.guarantee.lower().startswith("no formal"):
        cls, lead = "guarantee none", "Guarantee of this release"
    else:
        cls, lead = "guarantee", "Guarantee of this release"
    out = f"<p class='{cls}'><b>{lead}:</b> {esc(summary.guarantee)}</p>" + _reasons_html(
        summary, fold_warnings=fold_warnings)
    if figures and summary.figures:
        out += "<ul class='figures'>" + "".join(_summary_item(f"{label}: {text}") for label, text in summary.figures) \
            + "</ul>"
    return out


def _tiles(r: Report) -> str:
    ds = r.dataset
    privacy = _privacy(r)
    tiles = [("records in", ds.records_in), ("released", ds.records_released),
             *([("withheld (rejected)", ds.records_withheld)] if ds.records_withheld else []),
             ("suppressed", ds.records_suppressed), ("quarantined", ds.records_quarantined),
             ("max re-identification", _num(privacy.max_rate)), ("bound 1/k", _num(privacy.bound)),
             ("min people per cluster", privacy.min_distinct_people_per_cluster),
             ("max person share", _num(privacy.max_person_share))]
    return ('<div class="summary">' + "".join(f"<div><b>{esc(v)}</b><span class='muted'>{esc(label)}</span></div>"
                                               for label, v in tiles) + "</div>")


def _checks(r: Report) -> str:
    checks = r.checks
    if not checks:
        return "<h2>Checks</h2><p class='muted'>No checks were run.</p>"
    rows = [[f"{esc(check_requirement(str(c.name)))}<small class='code'>{esc(c.name)}</small>",
             esc(measured(_check_json(c))), esc(threshold_text(str(c.name), c.threshold)), _status(c),
             esc(round_numbers(str(c.detail or "")))]
            for c in checks]
    return "<h2>Checks</h2>" + table(["requirement", "measured", "required", "result", "detail"], rows)


def _reidentification(r: Report) -> str:
    privacy = _privacy(r)
    reid = privacy.reidentification
    out = ["<h2>Re-identification</h2>"]
    if not reid:
        return out[0] + "<p class='muted'>No re-identification attack was run.</p>"
    bound = float(privacy.bound or 1.0 / int(r.k))
    sample = privacy.attack_sample or {}
    out.append(f"<p>Each attacker tries to match released faces to the right person; a formal release keeps "
               f"every rate at or below 1/k = {bound:.3f}. Bars are rates, whiskers their one-sided "
               f"{_num(sample.get('confidence', 0.95), 2)} confidence intervals.</p>")
    out.append(_chart(reid_chart(reid, bound)))
    out.append(_whiskers_past_bound(privacy, reid, bound))
    rows = [[esc(x.attacker), esc(x.mode), _num(x.rate),
             esc(f"[{x.lower:.3f}, {x.upper:.3f}]" if x.lower is not None else ""),
             esc(x.n_probes),
             ('<span class="muted">insufficient evidence</span>' if x.status == "insufficient_evidence" else
              '<span class="pass">&le; 1/k</span>' if within_bound(x.rate, limit=bound) else '<span class="fail">&gt; 1/k</span>')]
            for x in reid]
    out.append(table(["attacker", "mode", "rate", "interval", "probes", "point estimate"], rows, num=(2, 3, 4)))
    if sample.get("insufficient"):
        out.append(f"<p class='muted'>{esc(sample['insufficient'])} rate(s) from fewer than "
                   f"{esc(sample.get('min_probes'))} distinct probes: insufficient evidence, shown but neither the "
                   "headline nor deciding.</p>")
    if sample:
        out.append(f"<p class='muted'>Attacked {esc(sample.get('records'))} of {esc(sample.get('of'))} released "
                   f"records (whole {esc(sample.get('unit'))}s sampled, seed {esc(sample.get('seed'))}); one-sided "
                   f"{_num(sample.get('confidence'), 2)} Clopper-Pearson bounds, Bonferroni over "
                   f"{esc(sample.get('bonferroni_over'))} attacker x mode pairs.</p>")
    out.append(_glossary(reid))
    out.append(_membership(privacy))
    return "".join(out)


def _whiskers_past_bound(privacy: Privacy, reid: Sequence[Reidentification], bound: float) -> str:
    """Why intervals reaching past 1/k do or do not decide (a released k-Same run's chart shows such whiskers)."""
    past = [x for x in reid if x.upper is not None and x.status != "insufficient_evidence"
            and not within_bound(float(x.upper), limit=bound)]
    if not past:
        return ""
    n = len(past)
    some = f"{n} interval{'s' if n > 1 else ''} reach{'' if n > 1 else 'es'} past 1/k"
    if privacy.exact_bound:
        share = privacy.max_person_share
        exact = (f"the largest one-person share of a cluster, {_num(share)}"
                 + (" (at most 1/k: it holds)" if isinstance(share, int | float) and within_bound(share, limit=bound)
                    else " (above 1/k: it fails)") if isinstance(share, int | float) else "the largest one-person share")
        return (f"<p class='note'><b>Why whiskers past the 1/k line do not decide:</b> {some}: a rate measured on a "
                "sample of probes is uncertain, most of all in a small release. Here every member of a cluster "
                "received the identical image (checked from the pixels), so no recogniser can name the right person "
                f"more often than {exact}. That exact bound decides; an attack fails the gate only if even its "
                "lower bound is above 1/k.</p>")
    return (f"<p class='note'><b>Whiskers past the 1/k line decide here:</b> {some}. This release's clusters are "
            "not identical copies, so no exact bound stands in for the attacks: every upper bound must be at or "
            "below 1/k.</p>")


def _glossary(reid: Sequence[Reidentification]) -> str:
    """The attackers and modes of the table, in words (the reasons and the charts use their names)."""
    terms = attack_terms([x.attacker for x in reid], [x.mode for x in reid])
    if not terms:
        return ""
    return ("<details class='glossary' id='attackers'><summary><b>The attackers and modes</b></summary><dl>"
            + "".join(f"<dt><code>{esc(name)}</code></dt><dd>{esc(words)}</dd>" for name, words in terms)
            + "</dl><p class='muted'>Each attacker is a face recogniser fitted on the original faces; a rate is the "
            "share of probes it matched to the right person (ties credited fractionally).</p></details>")


def _membership(privacy: Privacy) -> str:
    """Membership beside the 1/k rate, and in words what k-Same protects and what it does not."""
    out = []
    # Free-form: the membership attack's figures (deid.evaluation.membership) and the scope's sentences.
    m = privacy.membership or {}
    if m.get("status") == "measured":
        a, t = m["auc_interval"], m["tpr_interval"]
        out.append(f"<p><b>Membership</b> (not bounded by k): {esc(m['attacker'])} tells members from non-members "
                   f"with AUC {_num(m['auc'])} [{_num(a[0])}, {_num(a[1])}] (advantage {_num(m['advantage'])}), "
                   f"TPR at {_num(100 * m['fpr'], 0)}% FPR {_num(m['tpr_at_fpr'])} [{_num(t[0])}, {_num(t[1])}]; "
                   f"{esc(m['members'])} members vs {esc(m['non_members'])} non-members. 0.5 is a coin.</p>")
    elif m:
        out.append(f"<p class='muted'><b>Membership</b> not measured: {esc(m.get('reason', ''))}</p>")
    scope = privacy.scope or {}
    if scope:
        out.append(f"<p class='muted'><b>k-Same protects</b>: {esc(scope.get('protects', ''))} "
                   f"<b>It does not protect</b>: {esc(scope.get('does_not_protect', ''))}</p>")
    return "".join(out)


def _utility(r: Report) -> str:
    utility = r.utility
    if not utility:
        labels = r.configuration.get("labels") or []
        # Labels declared but nothing measured: the run stopped before the utility check (e.g. too few people).
        why = (f"Not measured: the drop declares {esc(', '.join(map(str, labels)))}, but the run was rejected "
               "before the gate measured utility (see the reasons above)." if labels and r.verdict == "rejected"
               else "No utility labels were measured.")
        return f"<h2>Utility</h2><p class='muted'>{why}</p>"
    out = ["<h2>Utility</h2>", "<p>Can a classifier still learn each label from the release? Accuracy on the "
           "originals vs on the release; the gate decides from the cross-fit rows, the others are evidence.</p>",
           _chart(utility_chart(utility))]
    has_protocol = any(u.protocol for u in utility)
    rows = []
    for u in utility:
        o, d = u.original_accuracy, u.deidentified_accuracy
        detail = round_numbers(str(u.detail or ""))
        rows.append([esc(u.label), *([esc(u.protocol)] if has_protocol else []), _num(o), _num(d),
                     _num(None if o is None or d is None else o - d), esc(f"<= {fmt(u.tolerance)}"),
                     f"<details><summary>how measured</summary>{esc(detail)}</details>" if detail else ""])
    off = 1 if has_protocol else 0
    out.append(table(["label", *(["protocol"] if has_protocol else []), "originals", "release", "drop",
                      "allowed drop", "detail"], rows, num=(1 + off, 2 + off, 3 + off, 4 + off)))
    return "".join(out)


def _partitions(r: Report) -> str:
    # Free-form: the configuration's partitions and clusters (deid.reporting.report_build.shared_configuration).
    cfg = r.configuration
    k = int(r.k)
    out = ["<h2>Partitions and clusters</h2>"]
    partitions = list(cfg.get("partitions") or [])
    if partitions:
        labels = cfg.get("labels") or []
        head = "partition" + (f" ({esc(' / '.join(map(str, labels)))})" if labels else "")
        out.append(f"<p>k-Same runs inside each partition of the labels; each needs at least k = {k} people.</p>")
        out.append(_chart(partition_chart(partitions, k)))
        out.append(table([head, "records", "people"],
                         [[esc(partition_name(p.get("key"))), esc(p.get("records")), esc(p.get("people"))]
                          for p in partitions], num=(1, 2)))
    grouping = list(_privacy(r).partitions or [])
    if grouping:
        names = {p.get("name"): partition_name(p.get("key")) for p in partitions if p.get("name")}
        out.append("<h3>Clusters formed per partition</h3><p>A person with c photos needs c different clusters, so a "
                   f"partition of n records can form at most floor(n / {k}) clusters (its feasible maximum); the gate "
                   "fails a partition that keeps too few of them (check <code>partition_clusters</code>).</p>")
        out.append(table(["partition", "records", "people", "clusters formed", "distinct faces", "feasible maximum"],
                         [[esc(names.get(g.get("partition"), g.get("partition"))), esc(g.get("records")),
                           esc(g.get("people")), esc(g.get("clusters")), esc(g.get("faces")),
                           esc(g.get("feasible_max"))] for g in grouping], num=(1, 2, 3, 4, 5)))
    clusters = cfg.get("clusters") or {}
    sizes = list(clusters.get("sizes") or [])
    if sizes and not forms_clusters(r):
        # Blur, pixelate, selective-mean ...: the de-identify stage lists each face as its own "cluster" of one,
        # which the gate reads as no clusters at all; "204 clusters of 1-1 records" said the opposite.
        out.append(f"<h3>No clusters</h3><p>Method {esc(r.method)} forms no clusters: each of the "
                   f"{len(sizes)} faces was de-identified on its own, so no released face is shared by k = {k} "
                   "distinct people (the checks <code>min_cluster_size</code> and "
                   "<code>released_in_clusters</code>).</p>")
    elif sizes:
        out.append(f"<h3>Cluster sizes</h3><p>{esc(clusters.get('count', len(sizes)))} clusters of "
                   f"{min(sizes)}&ndash;{max(sizes)} records; every cluster needs at least k = {k}.</p>")
        out.append(_chart(cluster_chart(sizes, k)))
    if not partitions and not sizes:
        out.append("<p class='muted'>No partitions or clusters (nothing was de-identified).</p>")
    return "".join(out)


def forms_clusters(r: Report) -> bool:
    """Did the run's method form clusters? No when the gate found none (``min_cluster_size`` not applicable)."""
    return not any(c.name == "min_cluster_size" and c.status == "not_applicable" for c in r.checks)


def _near_copy_html(near: Mapping[str, Any]) -> str:
    """The near-copy repair of the de-identify stage: clusters merged, records suppressed, with the threshold."""
    low = near.get("min_distance_before")
    after = near.get("min_distance_after")
    return (f"<p><b>Near-copy repair</b> (<code>{esc(NEAR_COPY)}</code>): {esc(near.get('near_copy_clusters'))} of "
            f"{esc(near.get('clusters_checked'))} clusters had a released average within {esc(near.get('threshold'))} "
            "grey levels (mean absolute difference, the gate's leak threshold) of a member's own face"
            + (f" (closest {low:.3f})" if low is not None else "") + f": {esc(near.get('clusters_merged'))} merged "
            f"with their nearest cluster, {esc(near.get('clusters_suppressed'))} suppressed "
            f"({esc(near.get('records_suppressed'))} records)"
            + (f"; closest released average now {after:.3f} from a member" if after is not None else "") + ".</p>")


def _withheld(r: Report) -> str:
    ds = r.dataset
    cfg = r.configuration
    # Reports before records_withheld counted a rejected run's would-be release as suppressed.
    why = "small partitions" if ds.records_withheld is not None else "small partitions or a rejected run"
    if (ds.near_copy_repair or {}).get("records_suppressed"):
        why += ", near copies"
    out = ["<h2>Suppressed and quarantined records</h2>",
           f"<p>{esc(ds.records_suppressed)} suppressed ({why}), "
           + (f"{esc(ds.records_withheld)} withheld because the run was rejected, " if ds.records_withheld
              else "") + f"{esc(ds.records_quarantined)} quarantined.</p>"]
    near = ds.near_copy_repair
    if near and near.get("near_copy_clusters"):
        out.append(_near_copy_html(near))
    small = cfg.get("small_partitions_detail") or []
    if small:
        # Counts only: a suppressed partition's label values may single out the few people in it.
        out.append(table(["partition below k", "records", "people", "action"],
                         [[f"#{i}", esc(s.get("records")), esc(s.get("people")), esc(s.get("action"))]
                          for i, s in enumerate(small, start=1)], num=(1, 2)))
    by_reason = ds.quarantine_by_reason
    if by_reason:
        out.append(table(["reason", "records", "meaning"], [
            [f"<code>{esc(code)}</code>", esc(count), esc(REASONS.get(code, ""))]
            for code, count in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0]))
        ], num=(1,)))
    return "".join(out)


def _faces(verdict: str, sample_images: Sequence[np.ndarray] | None, cfg: dict | None = None) -> str:
    if (cfg or {}).get("kind") == "features":
        return ("<h2>Released feature vectors</h2>"
                f"<p class='muted'>A release of {esc((cfg or {}).get('feature_dim'))}-value feature vectors "
                "(<code>release.parquet</code>): no faces to show.</p>")
    out = "<h2>Sample of released faces</h2>"
    if verdict != "released":
        return out + "<p class='muted'>Nothing was released, so no faces are shown.</p>"
    if not sample_images:
        return out + "<p class='muted'>No sample faces were provided.</p>"
    return (out + f"<p class='muted'>{len(sample_images)} de-identified faces from the published release "
            "(one per cluster). No original or quarantined face is ever shown.</p>"
            + '<div class="faces">' + "".join(
                f'<img class="sample" alt="released de-identified face" src="{_png_data_uri(_face_png(im))}">'
                for im in sample_images) + "</div>")


def _validation(results: Any, href: str | None) -> str:
    suites = suite_results(results)
    if not suites and not href:
        return ""
    out = ["<h2>Data validation</h2>",
           "<p>Great Expectations suites on each table of the run (counts of expectations).</p>",
           validation_summary_table(suites, href=href)]
    if href:
        out.append(f'<p>Every expectation with its arguments and observed value (offline): '
                   f'<a href="{esc(href)}">{esc(href)}</a></p>')
    return "".join(out)


def released_files(r: Report) -> int:
    """How many files the report's release holds: those it lists, and those its file manifest lists."""
    return len(r.artifacts) + (r.file_manifest.files if r.file_manifest is not None else 0)


def _provenance(r: Report, public_key_hint: str, report_dir_hint: str | None) -> str:
    signing = r.signing
    out = ["<h2>Provenance</h2>", table(["", ""], [
        ["dataset fingerprint", f"<code>{esc(r.dataset.fingerprint)}</code>"],
        ["run id", f"<code>{esc(r.run_id)}</code>"],
        ["release id", f"<code>{esc(r.release_id)}</code>"],
        ["release directory", esc(r.release_dir)],
        ["signer's key fingerprint", f"<code>{esc(signing.public_key_fingerprint)}</code> "
                                     f"({esc(signing.algorithm)}, {esc(signing.key_origin)} key)"],
        ["released files", esc(released_files(r))],
    ], cls="kv")]
    if signing.key_origin == "development":
        out.append("<p class='fail'>Signed with a development key: not for production releases.</p>")
    report_dir = report_dir_hint or f"reports/{r.release_id}"
    out += ["<h3>How to verify</h3>",
            "<p>report.json is signed (Ed25519 over its canonical JSON, in report.json.sig) and lists the "
            "SHA-256 of every released file (the images through the release's file manifest, whose SHA-256 it "
            "lists), of this page and of the validation results. With the signer's "
            "public key obtained from a channel you trust (never from beside the report), run:</p>",
            f"<pre>deid verify {esc(report_dir)} --public-key {esc(public_key_hint)}</pre>",
            f"<p class='muted'>The key's fingerprint must be <code>{esc(signing.public_key_fingerprint)}</code>. "
            "Without --public-key only integrity is checked, not who signed.</p>"]
    return "".join(out)


def _setting_value(key: str, value: Any) -> str:
    if key == "stage_seconds" and isinstance(value, Mapping):
        return ", ".join(f"{k} {_stage_usage_text(v)}" for k, v in value.items())
    if key in ("canonical_size", "canonical_eyes") and isinstance(value, list | tuple):
        inner = [" x ".join(fmt(x) for x in v) if isinstance(v, list | tuple) else fmt(v) for v in value]
        return (" x " if key == "canonical_size" else "; ").join(inner)
    return fmt(value)


def _stage_usage_text(value: Any) -> str:
    """``wall`` seconds, then ``(CPU s, peak MiB of the run process / summed over its processes)`` when known."""
    u = stage_usage_of(value)
    extra = [f"CPU {u['cpu']:.1f}"] if u["cpu"] is not None else []
    if u["peak_rss_mib"] is not None:
        extra.append(f"peak {u['peak_rss_mib']:.0f}/{u['tree_peak_rss_mib']:.0f} MiB")
    return f"{u['wall']:.1f}" + (f" ({', '.join(extra)})" if extra else "")


def _configuration(cfg: Mapping[str, Any]) -> str:
    keys = [k for k in _SETTINGS if k in cfg] + sorted(k for k in cfg if k not in _SETTINGS)
    rows = [[f"<code>{esc(k)}</code>", esc(round_numbers(_setting_value(k, cfg[k]))), esc(_SETTINGS.get(k, ""))]
            for k in keys if k not in _SHOWN_ELSEWHERE]
    if not rows:
        return "<h2>Configuration</h2><p class='muted'>not recorded</p>"
    return "<h2>Configuration</h2>" + table(["setting", "value", "meaning"], rows, cls="kv")


# --------------------------------------------------------------------------- the page


def render_report_html(
    report: Report,
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
    report : Report
        The run's report (as signed; ``report_files`` is not needed and cannot include this page). A
        report.json read back: :meth:`Report.from_dict <deid.reporting.report.Report.from_dict>`.
    sample_images : de-identified faces to show, uint8 arrays; pass only released images
        (:func:`sample_release_images`). Ignored for a rejected run, which released nothing.
    gx_results : the run's validation results (anything :func:`deid.evaluation.validation.suite_results`
        accepts); default: the report's own ``validation`` section.
    validation_href : relative link to the offline validation page (e.g. ``"validation/index.html"``).
    public_key_hint, report_dir_hint : shown in the "how to verify" command.
    """
    r = report
    verdict = str(r.verdict)
    versions = r.versions
    body = "".join([
        _header(r),
        _tiles(r),
        _checks(r),
        _reidentification(r),
        _utility(r),
        _partitions(r),
        _withheld(r),
        _faces(verdict, sample_images, r.configuration),
        _validation(gx_results if gx_results is not None else r.validation, validation_href),
        _provenance(r, public_key_hint, report_dir_hint),
        "<h2>Versions</h2>" + (table(["package", "version"], [[esc(p), esc(v)] for p, v in sorted(versions.items())])
                               if versions else "<p class='muted'>not recorded</p>"),
        _configuration(r.configuration),
    ])
    return document(f"deid report {r.release_id}: {verdict}", body)


# --------------------------------------------------------------------------- all together


def run_title(r: Report) -> str:
    """Which run a page belongs to: ``london, k = 5, k-same-select, release rel-... (RELEASED)``."""
    return (f"{r.dataset.name or 'dataset'}, k = {r.k}, {r.method}, release {r.release_id} "
            f"({str(r.verdict).upper()})")


def write_report_bundle(
    report_dir: Path,
    report: Report,
    signing_key: SigningKey,
    *,
    sample_images: Sequence[np.ndarray] | None = None,
    validation_results: Any = None,
    public_key_hint: str | None = None,
) -> Path:
    """Write report.html, the offline validation results, and the signed report.json listing their hashes.

    ``signing_key`` is a :class:`deid.release.signing.SigningKey`; the report's ``signing`` is set from it.
    ``validation_results`` defaults to the report's ``validation`` section. Order matters: the HTML
    and validation files are written first, hashed into ``report_files``, and only then is report.json
    signed. Returns report.json's path.
    """
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    d = dataclasses.replace(report, signing=SigningInfo.from_key(signing_key), report_files=None).to_dict()
    # The page shows the report as it is signed: its JSON form, read back (numbers and lists as report.json has them).
    signed = Report.from_dict(d)
    if validation_results is None:
        validation_results = signed.validation or None
    href = None
    if validation_results is not None:
        build_offline_data_docs(validation_results, report_dir / VALIDATION_DIR, run=run_title(signed),
                                back_href=f"../{REPORT_HTML}")
        href = f"{VALIDATION_DIR}/{VALIDATION_HTML}"
    hint = public_key_hint or (str(signing_key.public_path) if signing_key.public_path else "KEY.pub.pem")
    page = render_report_html(signed, sample_images=sample_images, gx_results=validation_results,
                              validation_href=href, public_key_hint=hint, report_dir_hint=str(report_dir))
    tmp = report_dir / f".{REPORT_HTML}.tmp"
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, report_dir / REPORT_HTML)
    d["report_files"] = hash_report_files(report_dir)
    return write_signed_report(report_dir, d, signing_key)


