"""Data validation: Great Expectations suites over the manifest and the staged tables, and drop-level checks.

The suites live as JSON under ``schemas/expectations/<name>.json`` (``suite.to_json_dict()`` output).
Besides ordinary expectations, each suite's ``meta["deid"]`` declares:

- ``required``: parameters :func:`run_suite` must be given (e.g. ``labels``, ``k``);
- ``per_label``: expectations repeated for every declared label column (``{label}`` is replaced);
- ``per_label_values``: the same, expanded only when ``label_sets`` is given, with the value set
  passed as the suite parameter ``values_<label>``;
- ``derived``: columns computed before validation (``_cluster_size``, ``_pixels_length``), since
  Great Expectations has no "group size" or "byte length" expectation.

Great Expectations is imported lazily (about 3-5 s) and one ephemeral context is kept per process.
A suite's outcome is a :class:`SuiteResult` (one :class:`ExpectationResult` per expectation), built
from GX's own result objects; the gate's checks, report.json and the offline validation page all
read that one shape.
"""
from __future__ import annotations

import csv
import json
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from deid.errors import ConfigError
from deid.evaluation.checks import Check

log = logging.getLogger(__name__)

SUITES = ("manifest", "ingested", "aligned", "release", "feature_table", "feature_release")
# The order a run validates its tables in; ``feature_ingested`` is the ``feature_table`` suite run on the staged table.
_ORDER = ("manifest", "ingested", "aligned", "release", "feature_table", "feature_ingested", "feature_release")
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
            source = ctx.data_sources.add_pandas("deid")
            batch_def = source.add_dataframe_asset("table").add_batch_definition_whole_dataframe("whole")
            _gx_state.update(gx=gx, ctx=ctx, source=source, batch=batch_def)
        return _gx_state["gx"], _gx_state["batch"]


def warm_validation() -> None:
    """Great Expectations imported and this process's context made (~2-4 s of CPU), ahead of the first validation:
    a pool process's first warm-up job, or a process that forks the commands it runs (tests/forked_cli.py)."""
    _gx()


def _forget_batches() -> None:
    """Drop the table the context's pandas engine keeps after a validation (with ``_lock`` held).

    The engine caches the last batch and its DataFrame (``BatchManager``) until the next validation
    replaces them: in a run's process that was the manifest's million rows from the ingest to the
    stage, then the release's to the end (~0.3 GiB at a million records each; issue 32). Every
    validation loads its table again, so nothing it computes changes.
    """
    batches = _gx_state["source"].get_execution_engine().batch_manager
    batches.reset_batch_cache()
    batches.batch_data_cache.clear()


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


def _short(value: Any) -> str:
    """Compact text of an observed value (lists as comma-separated items)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ", ".join(_short(v) for v in value)
    return str(value)


# Examples of unexpected values kept per expectation: enough to find the problem, not a copy of the table.
_MAX_EXAMPLES = 5
# Columns whose failing values a report may show as examples: values deid made itself (staging and
# release ids, hashes, sizes, derived lengths and flags). A drop's own cells (subject ids, image paths,
# sequence keys, label values: a value held by fewer than k people is itself identifying) are counted,
# never named, in report.json, its reasons and the validation page (issue 28).
_EXAMPLE_COLUMNS = frozenset({"record_id", "cluster_id", "source_sha256", "size", "eye_source", "frame",
                              "eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y"})
_NOT_NAMED = "values not named (a drop's ids, paths and label values stay out of reports)"


def _examples_shown(column: Any) -> bool:
    """May a report name this column's unexpected values (a derived ``_...`` column or one deid made)?"""
    return column is not None and (str(column).startswith("_") or str(column) in _EXAMPLE_COLUMNS)


@dataclass(frozen=True)
class ExpectationResult:
    """One expectation as Great Expectations evaluated it (from an ``ExpectationValidationResult``).

    ``type`` is the expectation's name (``ExpectationConfiguration.type``), ``kwargs`` its
    arguments after the suite parameters were substituted (GX's ``batch_id`` dropped); the
    remaining fields are GX's ``result`` dict: ``observed_value`` for aggregate expectations,
    the ``*_count`` fields for column-map ones, ``error`` when GX raised instead of evaluating.
    """

    type: str
    kwargs: Mapping[str, Any]
    success: bool
    observed_value: Any = None
    element_count: int | None = None
    unexpected_count: int | None = None
    unexpected_percent: float | None = None
    partial_unexpected: tuple[str, ...] = ()
    error: str | None = None
    why: str | None = None

    @property
    def column(self) -> str | None:
        col = self.kwargs.get("column")
        return None if col is None else str(col)

    def observed_text(self) -> str:
        """What GX observed, in words (every expectation has one; never blank)."""
        if self.error:
            return f"error: {self.error}"
        if self.observed_value is not None:
            return _short(self.observed_value)
        if self.unexpected_count is not None:
            of = "" if self.element_count is None else f" of {self.element_count}"
            text = f"{self.unexpected_count} unexpected{of} ({float(self.unexpected_percent or 0.0):.1f}%)"
            if self.partial_unexpected:
                text += "; e.g. " + ", ".join(self.partial_unexpected[:3])
            elif self.unexpected_count and not _examples_shown(self.column):
                text += "; " + _NOT_NAMED
            return text
        if self.type == "expect_column_to_exist":
            return "column present" if self.success else "column missing"
        return "GX reports pass/fail only for this expectation"

    @classmethod
    def from_gx(cls, r: Any) -> "ExpectationResult":
        """From a GX 1.x ``ExpectationValidationResult``."""
        cfg = r.expectation_config
        result = dict(r.result or {})
        exc = r.exception_info or {}
        raised = bool(exc.get("raised_exception")) if isinstance(exc, dict) else False
        meta = cfg.meta or {}
        return cls(
            type=str(cfg.type),
            kwargs=_jsonable({k: v for k, v in cfg.kwargs.items() if k != "batch_id"}),
            success=bool(r.success),
            observed_value=_jsonable(result.get("observed_value")),
            element_count=result.get("element_count"),
            unexpected_count=result.get("unexpected_count"),
            unexpected_percent=result.get("unexpected_percent"),
            partial_unexpected=tuple(str(v) for v in (result.get("partial_unexpected_list") or [])[:_MAX_EXAMPLES])
            if _examples_shown(cfg.kwargs.get("column")) else (),
            error=str(exc.get("exception_message"))[:300] if raised else None,
            why=meta.get("why") or cfg.description,
        )

    def to_dict(self) -> dict:
        out = {"expectation": self.type, "column": self.column, "kwargs": dict(self.kwargs),
               "success": self.success, "observed_value": self.observed_value, "element_count": self.element_count,
               "unexpected_count": self.unexpected_count, "unexpected_percent": self.unexpected_percent,
               "partial_unexpected": list(self.partial_unexpected)}
        if self.error:
            out["error"] = self.error
        if self.why:
            out["why"] = self.why
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ExpectationResult":
        """Inverse of :meth:`to_dict` (also reads the summaries of earlier report.json files)."""
        kind = d.get("expectation") or d.get("type") if isinstance(d, Mapping) else None
        if not kind or "success" not in d:
            shape = "GX's to_json_dict() form" if isinstance(d, Mapping) and "expectation_config" in d else repr(d)[:80]
            raise ConfigError(f"expectation result {shape} has no 'expectation' name and 'success'; pass GX result "
                              "objects or SuiteResult.to_dict() output")
        return cls(type=str(kind), kwargs=dict(d.get("kwargs") or {}),
                   success=bool(d.get("success")), observed_value=d.get("observed_value"),
                   element_count=d.get("element_count"), unexpected_count=d.get("unexpected_count"),
                   unexpected_percent=d.get("unexpected_percent"),
                   partial_unexpected=tuple(d.get("partial_unexpected") or ()), error=d.get("error"),
                   why=d.get("why"))


@dataclass(frozen=True)
class SuiteResult:
    """One suite's validation of one table (from an ``ExpectationSuiteValidationResult``)."""

    suite: str
    expectations: tuple[ExpectationResult, ...] = field(default_factory=tuple)
    gx_version: str | None = None

    @property
    def success(self) -> bool:
        return all(e.success for e in self.expectations)

    @property
    def evaluated(self) -> int:
        return len(self.expectations)

    @property
    def failed(self) -> int:
        return sum(not e.success for e in self.expectations)

    @property
    def passed(self) -> int:
        return self.evaluated - self.failed

    @classmethod
    def from_gx(cls, res: Any, *, suite: str | None = None) -> "SuiteResult":
        """From a GX 1.x ``ExpectationSuiteValidationResult`` (``suite`` overrides its ``suite_name``)."""
        meta = res.meta or {}
        return cls(suite=str(suite or res.suite_name),
                   expectations=tuple(ExpectationResult.from_gx(r) for r in res.results),
                   gx_version=meta.get("great_expectations_version"))

    def to_dict(self) -> dict:
        """The JSON form kept in report.json and ``validation/validation_results.json``."""
        return {"suite": self.suite, "success": self.success, "evaluated": self.evaluated, "passed": self.passed,
                "failed": self.failed, "gx_version": self.gx_version,
                "results": [e.to_dict() for e in self.expectations]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, suite: str | None = None) -> "SuiteResult":
        """Inverse of :meth:`to_dict`."""
        if not isinstance(d, Mapping) or not isinstance(d.get("results"), list):
            raise ConfigError(f"validation result {suite or '?'} is a {type(d).__name__} without a 'results' list; "
                              "pass SuiteResult.to_dict() output (report.json's 'validation' entries)")
        return cls(suite=str(suite or d.get("suite") or d.get("name") or "suite"),
                   expectations=tuple(ExpectationResult.from_dict(e) for e in d["results"]),
                   gx_version=d.get("gx_version"))


def suite_results(results: Any) -> list[SuiteResult]:
    """Any form of the run's validation results as a list of :class:`SuiteResult`.

    Accepts a :class:`SuiteResult`, a GX ``ExpectationSuiteValidationResult``, the JSON form of a
    SuiteResult, a list of these, or a mapping suite name -> one of these (report.json's
    ``validation``); a mapping key names its suite.
    """
    if results is None:
        return []
    if isinstance(results, Mapping) and "results" not in results:
        items = list(results.items())
    elif isinstance(results, list | tuple):
        items = [(None, x) for x in results]
    else:
        items = [(None, results)]
    out: list[SuiteResult] = []
    for name, res in items:
        if isinstance(res, SuiteResult):
            out.append(res if name is None or name == res.suite else SuiteResult(str(name), res.expectations,
                                                                                res.gx_version))
        elif hasattr(res, "results") and hasattr(res, "suite_name"):
            out.append(SuiteResult.from_gx(res, suite=name))
        else:
            out.append(SuiteResult.from_dict(res, suite=name))
    # In the order the run validates its tables (report.json's canonical JSON sorts the keys).
    order = {name: i for i, name in enumerate(_ORDER)}
    return sorted(out, key=lambda s: order.get(s.suite, len(order)))


def validation_section(results: Mapping[str, SuiteResult]) -> dict[str, dict]:
    """report.json's ``validation``: each suite's :meth:`SuiteResult.to_dict`, by table."""
    return {s.suite: s.to_dict() for s in suite_results(dict(results))}


def run_suite(name: str, dataframe, *, labels: list[str] = (), label_sets: dict[str, list] | None = None,
              **params) -> SuiteResult:
    """Validate a table against a stored suite.

    Parameters
    ----------
    name : {'manifest', 'ingested', 'aligned', 'release'}
        The suite (``schemas/expectations/<name>.json``).
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
    SuiteResult
        Every expectation with its arguments, what GX observed and whether it passed.
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
    if hasattr(dataframe, "to_pandas"):
        dataframe = dataframe.to_pandas()
    if name == "release" and params.get("allowed_columns") is None:
        from deid.schemas.arrow import RELEASE_BASE_COLUMNS, RELEASE_SEQUENCE_COLUMNS  # noqa: PLC0415

        # A release of image sequences also has sequence_id and frame (both, or neither).
        seq = [c for c in RELEASE_SEQUENCE_COLUMNS if c in dataframe.columns]
        seq = list(RELEASE_SEQUENCE_COLUMNS) if len(seq) == len(RELEASE_SEQUENCE_COLUMNS) else []
        params["allowed_columns"] = [*RELEASE_BASE_COLUMNS, *labels, *seq, *spec.get("derived", [])]
    df = _derive(dataframe, spec.get("derived", []))

    gx, batch_def = _gx()
    suite = gx.ExpectationSuite(**expand_suite(name, labels=labels, label_sets=label_sets))
    with _lock:  # one shared asset: validations in threads of one process take turns
        batch = batch_def.get_batch(batch_parameters={"dataframe": df})
        try:
            res = batch.validate(suite, result_format="COMPLETE", expectation_parameters=params)
        finally:
            del batch
            _forget_batches()
    out = SuiteResult.from_gx(res, suite=name)
    log.info("expectations %s: %d/%d passed", name, out.passed, out.evaluated)
    return out


# --------------------------------------------------------------------------------------------- tables


def manifest_frame(manifest_bytes: bytes):
    """The manifest as a pandas DataFrame of strings, empty cells as nulls (what the steward wrote)."""
    import pandas as pd  # noqa: PLC0415

    from deid.intake.drop import csv_lines  # noqa: PLC0415

    text = manifest_bytes.decode("utf-8-sig")
    # Column by column as the rows stream (issue 13: a list per row and a StringIO of the text held ~1.5 GB
    # for a million rows); the same frame as pd.DataFrame(rows, columns=header, dtype=object).
    rows = (r for r in csv.reader(csv_lines(text)) if any(c.strip() for c in r))
    first = next(rows, None)
    if first is None:
        return pd.DataFrame()
    header = [h.strip() for h in first]
    cols: list[list] = [[] for _ in header]
    for r in rows:
        for j, col in enumerate(cols):
            col.append((r[j].strip() or None) if j < len(r) else None)
    if len(set(header)) != len(header):  # duplicate names (read_drop refuses them first): as the row-wise frame
        return pd.DataFrame(list(zip(*cols)) if cols and cols[0] else [], columns=header, dtype=object)
    return pd.DataFrame({h: pd.Series(c, dtype=object) for h, c in zip(header, cols)}, columns=header)


def validate_manifest(drop) -> SuiteResult:
    """Run the ``manifest`` suite on a :class:`~deid.intake.drop.Drop`'s manifest (its declared labels)."""
    return run_suite("manifest", manifest_frame(drop.manifest_bytes), labels=list(drop.labels))


def validate_ingested(path, labels: list[str], *, label_sets: dict[str, list] | None = None) -> SuiteResult:
    """Run the ``ingested`` suite on the staged table (its image bytes are not read).

    ``path``: ingested.parquet, or its table already read without the ``data`` column.
    """
    if isinstance(path, (str, Path)):
        import pyarrow.parquet as pq  # noqa: PLC0415

        schema = pq.read_schema(path)
        path = pq.read_table(path, columns=[c for c in schema.names if c != "data"])
    return run_suite("ingested", path, labels=list(labels), label_sets=label_sets)


def validate_aligned(paths: list[str | Path], *, pixel_bytes: int) -> SuiteResult:
    """Run the ``aligned`` suite on the aligned parts; ``pixel_bytes`` = canonical width * height."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.compute as pc  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    from deid.schemas import arrow as schemas  # noqa: PLC0415

    def lengths(t: pa.Table) -> pa.Table:
        return t.append_column("_pixels_length", pc.binary_length(t.column("pixels"))).drop_columns(["pixels"])

    # One part's pixels at a time: a million aligned faces are 7.5 GB (issue 13).
    tables = [lengths(pq.read_table(p, columns=["record_id", "pixels", "eye_source"])) for p in paths]
    if tables:
        t = pa.concat_tables(tables, promote_options="permissive")
    else:
        t = lengths(schemas.aligned().empty_table().select(["record_id", "pixels", "eye_source"]))
    return run_suite("aligned", t, pixel_bytes=int(pixel_bytes))


def observed_label_sets(ingested_path: str | Path, labels: list[str]) -> dict[str, list[str]]:
    """Label values present in the staged originals: a release may only carry these."""
    import pyarrow.compute as pc  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    t = pq.read_table(ingested_path, columns=list(labels))
    return {x: sorted(str(v) for v in pc.unique(t.column(x)).to_pylist() if v is not None) for x in labels}


def cluster_size_floor(k: int, *, clustered: bool) -> int:
    """The release suites' smallest allowed cluster: ``k``, or 1 for a method without clusters.

    A method without clusters (blur, the selective mean, feature noise...) releases one record per
    cluster id: the gate's min_cluster_size is not applicable there, and a floor of k would fail
    every row as a second rejection reason next to the gate's own verdict.
    """
    return int(k) if clustered else 1


def validate_release(release, labels: list[str], *, label_sets: dict[str, list], k: int,
                     clustered: bool = True) -> SuiteResult:
    """Run the ``release`` suite on a release table (path to release.parquet, pyarrow Table or DataFrame)."""
    if isinstance(release, (str, Path)):
        import pyarrow.parquet as pq  # noqa: PLC0415

        release = pq.read_table(release)
    return run_suite("release", release, labels=list(labels), label_sets=label_sets,
                     k=cluster_size_floor(k, clustered=clustered))


# --------------------------------------------------------------------------------------------- feature drops


def vector_columns(table, column: str):
    """``table`` with the vector column replaced by ``_vector_length`` and ``_vector_finite``.

    ``_vector_length`` is each row's number of values (null for a null vector), ``_vector_finite``
    whether every value is a finite number (null for a null vector); Great Expectations has no
    expectation on list cells, and the vectors themselves never need to reach it.
    """
    import numpy as np  # noqa: PLC0415
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.compute as pc  # noqa: PLC0415

    col = table.column(column).combine_chunks()
    lengths = pc.list_value_length(col)
    values = pc.list_flatten(col)
    parents = np.asarray(pc.list_parent_indices(col).to_numpy(zero_copy_only=False), dtype=np.int64)
    ok = pc.fill_null(pc.is_finite(values.cast(pa.float64())), False).to_numpy(zero_copy_only=False)
    finite = np.ones(len(col), dtype=bool)
    finite[parents[~np.asarray(ok, dtype=bool)]] = False
    valid = np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    out = table.drop_columns([column])
    out = out.append_column("_vector_length", lengths.cast(pa.int64()))
    return out.append_column("_vector_finite", pa.array(finite, pa.bool_(), mask=~valid))


def validate_feature_table(drop, *, staged: bool = False) -> SuiteResult:
    """Run the ``feature_table`` suite on a feature drop's table (``staged``: the staged table instead).

    The table as the steward wrote it (``feature_table``: every bad row the reader quarantines
    shows here), or the staged records (``feature_ingested``: what the run goes on with, which must
    pass). Record ids unique and non-null (``row N`` for a table without them, as the reader names
    them), subject ids non-null, every vector of the declared dimension with finite values, every
    label non-null and, when drop.yaml declares ``label_values``, in its declared set.
    """
    import dataclasses  # noqa: PLC0415

    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    from deid.intake.drop_files import read_drop_file  # noqa: PLC0415

    labels = list(drop.labels)
    if staged:
        table, column = drop.to_table().drop_columns(["source_id"]), "features"
    else:
        table = pq.read_table(pa.BufferReader(read_drop_file(drop.root, drop.features_file)))
        column = drop.vector_column
        if "record_id" not in table.column_names:
            table = table.append_column("record_id", pa.array([f"row {i}" for i in range(1, table.num_rows + 1)]))
        # Ids and labels as the reader sees them: text, an empty cell as null.
        text = {c: pa.array([None if v is None or not str(v).strip() else str(v).strip()
                             for v in table.column(c).to_pylist()], pa.string())
                for c in ("record_id", "subject_id", *labels)}
        table = pa.table({**text, column: table.column(column)})
    declared = None if drop.label_sets is None else {x: list(v) for x, v in drop.label_sets.items()}
    result = run_suite("feature_table", vector_columns(table, column), labels=labels, label_sets=declared,
                       dim=int(drop.dim))
    return dataclasses.replace(result, suite="feature_ingested") if staged else result


def validate_feature_release(release, labels: list[str], *, label_sets: dict[str, list], k: int, dim: int,
                             source_record_ids: list[str], clustered: bool = True) -> SuiteResult:
    """Run the ``feature_release`` suite on a feature release table (path to release.parquet or a pyarrow Table).

    No column but ``record_id``, ``cluster_id``, the labels and ``features``; record ids fresh
    (random hex, none of ``source_record_ids``) and unique; clusters of at least ``k`` rows
    (:func:`cluster_size_floor`); vectors of ``dim`` finite values; labels in ``label_sets``.
    """
    if isinstance(release, (str, Path)):
        import pyarrow.parquet as pq  # noqa: PLC0415

        release = pq.read_table(release)
    from deid.schemas.arrow import FEATURE_RELEASE_BASE_COLUMNS  # noqa: PLC0415

    spec = load_suite("feature_release")["meta"]["deid"]
    allowed = [c for c in FEATURE_RELEASE_BASE_COLUMNS if c != "features"] + list(labels) + spec["derived"]
    table = vector_columns(release, "features") if "features" in release.column_names else release
    return run_suite("feature_release", table, labels=list(labels), label_sets=label_sets,
                     k=cluster_size_floor(k, clustered=clustered), dim=int(dim),
                     source_record_ids=sorted(map(str, source_record_ids)), allowed_columns=allowed)


# --------------------------------------------------------------------------------------------- checks


def suite_check(summary: SuiteResult) -> Check:
    """A gate check from a :func:`run_suite` result: passes when every expectation passed."""
    bad = [e for e in summary.expectations if not e.success]
    detail = "; ".join(f"{e.type}({e.column or ''}): {e.observed_text()}" for e in bad[:5])
    return Check(f"expectations_{summary.suite}", summary.success, summary.failed, "= 0 failed",
                 detail or f"{summary.evaluated} expectations passed")


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
        return Check("quarantine_fraction", True, 0.0, f"<= {max_fraction:g}", "empty drop: see drop_not_empty")
    frac = quarantined / records_in
    ok = frac <= max_fraction + 1e-12
    detail = f"{quarantined} of {records_in} records quarantined ({frac:.1%}; limit {max_fraction:.1%})"
    if not ok:
        detail += "; fix the drop (see the quarantine table) or raise DEID_MAX_QUARANTINE_FRACTION"
    return Check("quarantine_fraction", ok, round(frac, 6), f"<= {max_fraction:g}", detail)


def drop_checks(*, records_in: int, people: int, k: int, unit: str = "the manifest has no data rows (header only)"
                ) -> list[Check]:
    """Gate checks on the drop as a whole: not empty, and at least ``k`` distinct usable people.

    ``people`` counts distinct subject ids among the records that survived ingest (or alignment):
    fewer than ``k`` cannot form a single cluster of ``k`` distinct people (k-Same, Newton et al. 2005).
    ``unit``: what an empty drop is told (a feature drop has a table, not a manifest).
    """
    empty = records_in == 0
    return [
        Check("drop_not_empty", not empty, records_in, ">= 1",
              unit if empty else f"{records_in} records in"),
        Check("enough_people", people >= k, people, f">= {k}",
              f"{people} distinct usable people, fewer than k={k}: no cluster of k people can be formed"
              if people < k else f"{people} distinct usable people"),
    ]
