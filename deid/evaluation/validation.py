"""Data validation: Great Expectations suites over the manifest and the staged tables, and drop-level checks.

The suites live as JSON under ``deid/schemas/expectations/<name>.json`` (``suite.to_json_dict()`` output).
Besides ordinary expectations, each suite's ``meta["deid"]`` declares:

- ``required``: parameters :func:`run_suite` must be given (e.g. ``labels``, ``k``);
- ``per_label``: expectations repeated for every declared label column (``{label}`` is replaced);
- ``per_label_values``: the same, expanded only when ``label_sets`` is given, with the value set
  passed as the suite parameter ``values_<label>``;
- ``derived``: columns computed before validation (``_cluster_size``, ``_pixels_length``), since
  Great Expectations has no "group size" or "byte length" expectation.

Great Expectations is imported lazily (about 3-5 s) and one ephemeral context is kept per process.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import threading
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from deid.errors import ConfigError
from deid.evaluation.checks import Check

log = logging.getLogger(__name__)

SUITES = ("manifest", "ingested", "aligned", "release")
_lock = threading.Lock()
_gx_state: dict[str, Any] = {}


@lru_cache(maxsize=None)
def load_suite(name: str) -> dict:
    """The stored suite ``name`` as a JSON dict (``gx.ExpectationSuite(**d)`` rebuilds it)."""
    if name not in SUITES:
        raise ConfigError(f"suite={name!r} must be one of {list(SUITES)}")
    text = resources.files("deid.schemas").joinpath("expectations", f"{name}.json").read_text(encoding="utf-8")
    return json.loads(text)


def _gx():
    """(gx module, batch definition) of the process-wide ephemeral context, created once."""
    with _lock:
        if not _gx_state:
            import great_expectations as gx  # noqa: PLC0415 - slow import, only when validating
            from great_expectations.data_context.types.base import ProgressBarsConfig  # noqa: PLC0415

            for noisy in ("great_expectations", "great_expectations.core", "great_expectations.data_context"):
                logging.getLogger(noisy).setLevel(logging.WARNING)
            ctx = gx.get_context(mode="ephemeral")
            ctx.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
            batch_def = (ctx.data_sources.add_pandas("deid").add_dataframe_asset("table")
                         .add_batch_definition_whole_dataframe("whole"))
            _gx_state.update(gx=gx, ctx=ctx, batch=batch_def)
        return _gx_state["gx"], _gx_state["batch"]


def _fill(obj: Any, label: str) -> Any:
    if isinstance(obj, str):
        return obj.replace("{label}", label)
    if isinstance(obj, dict):
        return {k: _fill(v, label) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, label) for v in obj]
    return obj


def expand_suite(name: str, *, labels: list[str] = (), label_sets: dict[str, list] | None = None) -> dict:
    """The suite dict with its per-label templates expanded for ``labels``."""
    d = json.loads(json.dumps(load_suite(name)))
    spec = d.get("meta", {}).get("deid", {})
    for label in labels:
        d["expectations"] += [_fill(e, label) for e in spec.get("per_label", [])]
        if label_sets is not None:
            d["expectations"] += [_fill(e, label) for e in spec.get("per_label_values", [])]
    return d


def _derive(df, derived: list[str]):
    # Derived names start with "_" so they cannot shadow a real column of the table.
    df = df.copy(deep=False)
    if "_cluster_size" in derived:
        df["_cluster_size"] = (df.groupby("cluster_id")["cluster_id"].transform("size")
                               if "cluster_id" in df.columns and len(df) else None)
    if "_pixels_length" in derived and "pixels" in df.columns:
        df["_pixels_length"] = df["pixels"].map(len)
    return df.drop(columns=[c for c in ("pixels", "data") if c in df.columns])


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def run_suite(name: str, dataframe, *, labels: list[str] = (), label_sets: dict[str, list] | None = None,
              **params) -> dict:
    """Validate a table against a stored suite; return a JSON-able summary.

    Parameters
    ----------
    name : {'manifest', 'ingested', 'aligned', 'release'}
        The suite (``deid/schemas/expectations/<name>.json``).
    dataframe : pandas.DataFrame or pyarrow.Table
        The table; ``pixels``/``data`` byte columns are dropped after the derived columns are made.
    labels : list of str
        Declared utility label columns (expands the per-label expectations).
    label_sets : dict, optional
        Allowed values per label; when given, every label value must be in its set.
    **params
        Suite parameters (``k``, ``pixel_bytes``, ``allowed_columns``...).

    Returns
    -------
    dict
        ``{"suite", "success", "evaluated", "failed", "results": [{"expectation", "column", "success",
        "unexpected_count", "unexpected_percent", "partial_unexpected", "observed_value", "kwargs"}]}``.
    """
    d = load_suite(name)
    spec = d.get("meta", {}).get("deid", {})
    # An empty label list is a valid answer (a drop without utility labels); only None is missing.
    given = {"labels": None if labels is None else list(labels), "label_sets": label_sets, **params}
    missing = [p for p in spec.get("required", []) if given.get(p) is None]
    if missing:
        raise ConfigError(f"run_suite({name!r}) needs parameter(s) {missing}; pass them as keyword arguments")
    labels = list(labels)
    if label_sets is not None:
        absent = [x for x in labels if x not in label_sets]
        if absent:
            raise ConfigError(f"label_sets has no value set for label(s) {absent}; give one per declared label")
        params.update({f"values_{x}": sorted(map(str, label_sets[x])) for x in labels})
    if name == "release" and params.get("allowed_columns") is None:
        from deid.schemas.arrow import RELEASE_BASE_COLUMNS  # noqa: PLC0415

        params["allowed_columns"] = [*RELEASE_BASE_COLUMNS, *labels, *spec.get("derived", [])]
    if hasattr(dataframe, "to_pandas"):
        dataframe = dataframe.to_pandas()
    df = _derive(dataframe, spec.get("derived", []))

    gx, batch_def = _gx()
    suite = gx.ExpectationSuite(**expand_suite(name, labels=labels, label_sets=label_sets))
    with _lock:  # one shared asset: validations in threads of one process take turns
        batch = batch_def.get_batch(batch_parameters={"dataframe": df})
        res = batch.validate(suite, result_format="COMPLETE", expectation_parameters=params)
    rows = []
    for r in res.results:
        cfg = r.expectation_config
        kwargs = {k: v for k, v in cfg.kwargs.items() if k != "batch_id"}
        result = r.result or {}
        exc = r.exception_info or {}
        raised = exc.get("raised_exception") if isinstance(exc, dict) else False
        rows.append({
            "expectation": cfg.type,
            "column": kwargs.get("column"),
            "success": bool(r.success),
            "unexpected_count": result.get("unexpected_count"),
            "unexpected_percent": result.get("unexpected_percent"),
            "partial_unexpected": [str(v) for v in (result.get("partial_unexpected_list") or [])[:5]],
            "observed_value": result.get("observed_value"),
            "kwargs": kwargs,
            **({"error": str(exc.get("exception_message"))[:300]} if raised else {}),
        })
    failed = sum(not r["success"] for r in rows)
    summary = {"suite": name, "success": failed == 0, "evaluated": len(rows), "failed": failed, "results": rows}
    log.info("expectations %s: %d/%d passed", name, len(rows) - failed, len(rows))
    return _jsonable(summary)


# --------------------------------------------------------------------------------------------- tables


def manifest_frame(manifest_bytes: bytes):
    """The manifest as a pandas DataFrame of strings, empty cells as nulls (what the steward wrote)."""
    import pandas as pd  # noqa: PLC0415

    text = manifest_bytes.decode("utf-8-sig")
    rows = [r for r in csv.reader(io.StringIO(text, newline="")) if any(c.strip() for c in r)]
    if not rows:
        return pd.DataFrame()
    header = [h.strip() for h in rows[0]]
    body = [[(c.strip() or None) for c in r[: len(header)]] + [None] * max(0, len(header) - len(r)) for r in rows[1:]]
    return pd.DataFrame(body, columns=header, dtype=object)


def validate_manifest(drop) -> dict:
    """Run the ``manifest`` suite on a :class:`~deid.intake.drop.Drop`'s manifest (its declared labels)."""
    return run_suite("manifest", manifest_frame(drop.manifest_bytes), labels=list(drop.labels))


def validate_ingested(path: str | Path, labels: list[str], *, label_sets: dict[str, list] | None = None) -> dict:
    """Run the ``ingested`` suite on the staged table (its image bytes are not read)."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    schema = pq.read_schema(path)
    table = pq.read_table(path, columns=[c for c in schema.names if c != "data"])
    return run_suite("ingested", table, labels=list(labels), label_sets=label_sets)


def validate_aligned(paths: list[str | Path], *, pixel_bytes: int) -> dict:
    """Run the ``aligned`` suite on the aligned parts; ``pixel_bytes`` = canonical width * height."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.compute as pc  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    from deid.schemas import arrow as schemas  # noqa: PLC0415

    tables = [pq.read_table(p, columns=["record_id", "pixels", "eye_source"]) for p in paths]
    if tables:
        t = pa.concat_tables(tables, promote_options="permissive")
    else:
        t = schemas.aligned().empty_table().select(["record_id", "pixels", "eye_source"])
    t = t.append_column("_pixels_length", pc.binary_length(t.column("pixels"))).drop_columns(["pixels"])
    return run_suite("aligned", t, pixel_bytes=int(pixel_bytes))


def observed_label_sets(ingested_path: str | Path, labels: list[str]) -> dict[str, list[str]]:
    """Label values present in the staged originals: a release may only carry these."""
    import pyarrow.compute as pc  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    t = pq.read_table(ingested_path, columns=list(labels))
    return {x: sorted(str(v) for v in pc.unique(t.column(x)).to_pylist() if v is not None) for x in labels}


def validate_release(release, labels: list[str], *, label_sets: dict[str, list], k: int) -> dict:
    """Run the ``release`` suite on a release table (path to release.parquet, pyarrow Table or DataFrame)."""
    if isinstance(release, (str, Path)):
        import pyarrow.parquet as pq  # noqa: PLC0415

        release = pq.read_table(release)
    return run_suite("release", release, labels=list(labels), label_sets=label_sets, k=int(k))


# --------------------------------------------------------------------------------------------- checks


def suite_check(summary: dict) -> Check:
    """A gate check from a :func:`run_suite` summary: passes when every expectation passed."""
    bad = [r for r in summary["results"] if not r["success"]]
    detail = "; ".join(
        f"{r['expectation']}({r['column'] or ''}): "
        + (f"{r['unexpected_count']} unexpected, e.g. {r['partial_unexpected'][:3]}"
           if r.get("unexpected_count") else f"observed {r.get('observed_value')}")
        for r in bad[:5]
    )
    return Check(f"expectations_{summary['suite']}", bool(summary["success"]), summary["failed"], 0,
                 detail or f"{summary['evaluated']} expectations passed")


def quarantine_fraction_check(records_in: int, quarantined: int, max_fraction: float = 0.05) -> Check:
    """Gate check: the share of the drop's records that were quarantined is at most ``max_fraction``.

    A drop that loses more than that to bad files, bad rows or failed alignment is rejected as a
    whole: a steward should fix the drop rather than release a silently thinned dataset.
    """
    if not isinstance(max_fraction, (int, float)) or isinstance(max_fraction, bool) or not 0.0 <= max_fraction <= 1.0:
        raise ConfigError(f"max_quarantine_fraction={max_fraction!r} must be a number between 0 and 1 (default 0.05)")
    if records_in < 0 or quarantined < 0 or quarantined > records_in:
        raise ConfigError(f"quarantined={quarantined} must be between 0 and records_in={records_in}")
    if records_in == 0:
        return Check("quarantine_fraction", True, 0.0, max_fraction, "empty drop: see drop_not_empty")
    frac = quarantined / records_in
    ok = frac <= max_fraction + 1e-12
    detail = f"{quarantined} of {records_in} records quarantined ({frac:.1%}; limit {max_fraction:.1%})"
    if not ok:
        detail += "; fix the drop (see the quarantine table) or raise DEID_MAX_QUARANTINE_FRACTION"
    return Check("quarantine_fraction", ok, round(frac, 6), max_fraction, detail)


def drop_checks(*, records_in: int, people: int, k: int) -> list[Check]:
    """Gate checks on the drop as a whole: not empty, and at least ``k`` distinct usable people.

    ``people`` counts distinct subject ids among the records that survived ingest (or alignment):
    fewer than ``k`` cannot form a single cluster of ``k`` distinct people (k-Same, Newton et al. 2005).
    """
    empty = records_in == 0
    return [
        Check("drop_not_empty", not empty, records_in, ">= 1",
              "the manifest has no data rows (header only)" if empty else f"{records_in} records in"),
        Check("enough_people", people >= k, people, k,
              f"{people} distinct usable people, fewer than k={k}: no cluster of k people can be formed"
              if people < k else f"{people} distinct usable people"),
    ]
