"""Worker functions of a dataset's release lineage: the lineage planned on the effective persons, new
clusters' labels and images, returning people's registered averages written as a de-identified part,
counterfeit rows, and the gate's view of the republished clusters.

Each worker function is idempotent (it writes to a temporary file and renames it into place), so a task
re-run after a lost worker produces the same output; it takes paths and small parameters, never large
arrays, so nothing big travels through the scheduler.
"""
from __future__ import annotations

import logging
import os
import uuid
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from deid.contracts import LINEAGE_PARTITION, ClusterInfo, CounterfeitRow, ReleaseRows, StagingLayout
from deid.anonymise.identity import normalize_subject_id
from deid.release.linkage import COUNTERFEIT_PREFIX  # staging id of a counterfeit record (private linkage only)
from deid.schemas import arrow as schemas

from deid.operations.worker_deidentify import DeidentifiedPart
from deid.operations.worker_partition import label_combinations
from deid.operations.worker_rows import (IndexedRows, OUT_ROWS, as_array, binary_rows, distinct_rows, positions_in,
                                         shared_objects)

log = logging.getLogger(__name__)


def lineage_partition_key(root: Path, labels: list[str], select: bool,
                           by_key: dict[tuple[str, ...], str] | None = None):
    """The gate partition of a returning person's record: the label partition its labels belong to.

    Returning records are staged together (``partition=lineage``); the gate's utility protocol
    re-runs the method per partition, so they join the new records' partition of the same label
    values (k-Same-Select), or the single partition of plain k-Same.
    """
    import json  # noqa: PLC0415

    if by_key is None:
        index_path = StagingLayout(root.parent).partition_index
        index = json.loads(index_path.read_text()) if index_path.is_file() else []
        by_key = {tuple(e["key"]): Path(e["dir"]).name.split("=", 1)[-1] for e in index}
    if not select:
        single = next(iter(by_key.values())) if len(by_key) == 1 else LINEAGE_PARTITION
        return lambda lab: single
    return lambda lab: by_key.get(lab, f"{LINEAGE_PARTITION}|" + "|".join(lab))


# --------------------------------------------------------------------------- release lineage (deid.release.lineage)


def plan_lineage(faces: pa.Table, sources: Mapping[str, str] | pa.Table, state, *, key: bytes, k: int, policy: str,
                 absent: str, labels: list[str], select: bool, merges: str = "withhold"):
    """The lineage plan over the resolved faces (``subject_id`` = effective person), in table order.

    ``sources`` maps record_id -> source_sha256: a mapping, or a table with those two columns (the
    ingested table's; looked up as columns, no dict of a million ids). A table that also has the
    manifest's ``subject_id`` keys the lineage by each record's normalised steward id, the resolved
    person being the overlay of this run's merges for the k rules (issue 27: a merge that holds in one
    run and not the next never re-keys a record); otherwise the resolved ``subject_id`` is both.
    Partitions are the label tuples when the method partitions by labels (k-Same-Select), else none.
    """
    from deid.release.lineage import plan_release  # noqa: PLC0415 - crypto imports only where needed

    n = faces.num_rows
    ids = as_array(faces.column("record_id"))
    stewards: list | None = None
    if isinstance(sources, pa.Table):
        at = positions_in(ids, sources.column("record_id"))  # as the mapping's lookup: every face has its source
        fingerprints = as_array(sources.column("source_sha256")).take(at).to_pylist()
        if "subject_id" in sources.column_names and n:
            raw = shared_objects(as_array(sources.column("subject_id")).take(at)).tolist()
            normal = {s: normalize_subject_id(s) for s in dict.fromkeys(raw)}  # one str per distinct id
            stewards = [normal[s] for s in raw]
    else:
        fingerprints = [sources[r] for r in ids.to_pylist()]
    # Every record's labels: new clusters register them, so their later counterfeits reproduce the label mix.
    # One tuple (and one str per value) per distinct combination, shared by its records (issue 13).
    record_labels = _label_tuples(faces, labels)
    parts = record_labels if select and labels else None
    people = shared_objects(as_array(faces.column("subject_id"))).tolist() if n else []
    persons = None
    if stewards is None:
        stewards = people        # no manifest ids given: the resolved ids are the keys, no overlay
    else:
        persons = people
    return plan_release(state, stewards, fingerprints, key=key, k=k, policy=policy, absent=absent, partitions=parts,
                        record_labels=record_labels, label_names=labels, persons=persons, merges=merges)


def _label_tuples(faces: pa.Table, labels: list[str]) -> list[tuple[str, ...]]:
    """Each row's label values as a tuple of str (``str(value)``; a null is ``"None"``), one tuple object per
    distinct combination."""
    if not labels:
        return [()] * faces.num_rows
    combos, inverse = label_combinations(faces, labels)
    shared = [tuple(str(v) for v in c) for c in combos]
    return [shared[i] for i in inverse.tolist()]


def lineage_new_labels(plan, record_ids: list[str], deid_paths: list[str],
                       column: str = "pixels") -> tuple[np.ndarray, IndexedRows]:
    """(cluster index, released uint8 image) of each of ``plan.new_records`` from the de-identified parts.

    A new record the partition stage withheld (not in any part) gets cluster -1 and a zero image.
    The images are an :class:`IndexedRows`: each cluster's image once, not one copy per record
    (the parts are streamed a batch at a time; issue 13). ``column="color"``: the colour averages of a
    colour release (DEID_COLOR), numbered the same way.
    """
    import pyarrow.compute as pc  # noqa: PLC0415

    n_new = len(plan.new_records)
    # Each cluster's image once, on disk next to the de-identified parts (200,000 clusters of a million
    # faces are 1.5 GB): the registered clusters read it when asked (issue 13).
    spill = Path(deid_paths[0]).parent / f".lineage-new-{'colors' if column == 'color' else 'images'}.u8" \
        if deid_paths else None
    keys, images = distinct_rows(deid_paths, column, spill=spill)
    # Records matched to new records and clusters numbered as arrays (Arrow), not Python strings per record.
    new_ids = pa.array([record_ids[i] for i in plan.new_records], pa.string())
    j = pc.index_in(keys.column("record_id"), value_set=new_ids).to_numpy(zero_copy_only=False)
    found = ~np.isnan(j) if j.dtype.kind == "f" else np.ones(len(j), bool)
    j = np.where(found, j, -1).astype(np.int64)
    code = pc.dictionary_encode(keys.column("cluster").combine_chunks()).indices.to_numpy(zero_copy_only=False)
    hit = np.flatnonzero(j >= 0)
    cluster = np.full(n_new, -1, dtype=np.int64)
    row = np.full(n_new, -1, dtype=np.int64)
    cluster[j[hit]] = code[hit]
    row[j[hit]] = keys.column("row").to_numpy()[hit]
    labels_ = np.full(n_new, -1, dtype=np.intp)
    given = np.flatnonzero(cluster >= 0)
    if len(given):  # numbered in record order, as before: by each cluster's first new record
        uniq, first = np.unique(cluster[given], return_index=True)
        number = np.empty(int(uniq.max()) + 1, dtype=np.intp)
        number[uniq[np.argsort(first, kind="stable")]] = np.arange(len(uniq))
        labels_[given] = number[cluster[given]]
    p = images.shape[1] if len(keys) else 0
    n0 = images.table.shape[0]
    # A withheld record points past the table: one zero row held in memory.
    return labels_, IndexedRows(images.table, np.where(row >= 0, row, n0), extra=np.zeros((1, p), np.uint8))


def write_lineage_part(partition_dir: str, out_path: str, release, state, record_ids: list[str]) -> DeidentifiedPart:
    """The de-identified part of the returning people: each record carries its registered stored average.

    Written in the order of the ``partition=lineage`` dataset, like every de-identified part, so
    the gate pairs each record with its original. A colour release (``release.color``) adds each
    cluster's stored colour average (column ``color``, as :func:`deidentify_partition` writes it) beside
    its grey. Returns the cluster summary of :func:`deidentify_partition` (sizes count this drop's records,
    not counterfeits).
    """
    where = {record_ids[i]: key for i, key in enumerate(release.record_cluster) if key is not None}
    t = ds.dataset(partition_dir, format="parquet").to_table(columns=["record_id", "subject_id"])
    ids = t.column("record_id").to_pylist()
    people = t.column("subject_id").to_pylist()
    clusters = [where[r] for r in ids]
    # The part written a row group at a time, each registered image read once per row group, a registry
    # pack's at once (a stored average is read from the registry when asked: never every one at once, issue 13;
    # one read and decryption per cluster, not an open file per record's cluster, issue 32).
    from deid.release.lineage import stored_rows  # noqa: PLC0415

    color = bool(getattr(release, "color", False))
    schema = schemas.deidentified(color=color)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex}.tmp")
    with pq.ParquetWriter(tmp, schema, **schemas.writer_options(schema.names)) as writer:
        for a in range(0, len(ids), OUT_ROWS):
            cs = pa.array(clusters[a:a + OUT_ROWS], pa.string()).dictionary_encode()
            keys = cs.dictionary.to_pylist()
            at = cs.indices.to_numpy()
            columns = [pa.array(ids[a:a + OUT_ROWS], pa.string()), cs.dictionary_decode()]
            if color:  # the schema's order: colour, then its grey
                colours = stored_rows([state.clusters[c].released(True) for c in keys], slice(None))
                columns.append(binary_rows(colours.astype(np.uint8, copy=False)[at]))
            table = stored_rows([state.clusters[c].image for c in keys], slice(None)).astype(np.uint8, copy=False)
            columns.append(binary_rows(table[at]))
            writer.write_batch(pa.record_batch(columns, schema=schema))
    os.replace(tmp, out)
    # Each cluster's size and people from one pass (a pass per cluster was quadratic in the drop).
    members: dict[str, list] = defaultdict(list)
    for person, c in zip(people, clusters):
        members[c].append(person)
    summary = [ClusterInfo(cluster=c, size=len(members[c]), people=len(set(members[c]))) for c in sorted(members)]
    return DeidentifiedPart(path=out_path, records=len(ids), clusters=tuple(summary))


def counterfeit_rows(release, state, labels: list[str], present: Mapping[str, Sequence[Mapping[str, str]]],
                     fallback: Mapping[str, str]) -> list[CounterfeitRow]:
    """The counterfeit records of the republished clusters: stored average and utility labels, no source.

    Labels are the registered labels of the cluster's absent members
    (:meth:`~deid.release.lineage.LineageRelease.republished_labels`). A cluster registered before the
    registry kept labels falls back to its partition (k-Same-Select), else a record of the cluster in
    this drop (``present``: cluster key -> label mappings), else the drop's most common values.
    """
    rows: list[CounterfeitRow] = []
    registered = release.republished_labels(state, labels)
    color = bool(getattr(release, "color", False))
    for r in release.republished:
        c = state.clusters[r.key]
        # Read once per cluster; a colour release publishes the stored colour average.
        average = np.ascontiguousarray(c.released(color)) if r.n_counterfeit else None
        for n in range(r.n_counterfeit):
            if registered.get(r.key) is not None:
                lab = dict(zip(labels, registered[r.key].counterfeits[n]))
            elif labels and len(c.partition) == len(labels):
                lab = dict(zip(labels, c.partition))
            elif present.get(r.key):
                lab = dict(present[r.key][n % len(present[r.key])])
            else:
                lab = dict(fallback)
            # The stored average as registered: uint8 pixels, or a feature drop's float vector.
            rows.append(CounterfeitRow(record_id=f"{COUNTERFEIT_PREFIX}{len(rows):06d}", cluster=r.key,
                                       average=average, labels=lab))
    return rows


def lineage_release_rows(rows: ReleaseRows, lineage, labels: Sequence[str],
                         fallback: Callable[[], Mapping[str, str]], *, logger=None) -> ReleaseRows:
    """The would-be release's rows as the lineage makes them (image and feature drops alike).

    Returning records carry their registered labels (the cluster's released label mix stays the
    registered one, :func:`registered_row_labels`); the counterfeits of republished clusters follow
    (:func:`counterfeit_rows`; ``fallback()`` gives the drop's most common label values).
    """
    if lineage is None:
        return rows
    labels = list(labels)
    if lineage.release.republished:
        rows = registered_row_labels(lineage.release, lineage.state, list(lineage.record_ids), labels, rows)
    if not lineage.release.counts["counterfeit_records"]:
        return rows
    present: dict[str, list[dict[str, str]]] = {}
    for c, lab in zip(rows.clusters, rows.label_rows(labels)):
        present.setdefault(c, []).append(dict(zip(labels, lab)))
    fakes = counterfeit_rows(lineage.release, lineage.state, labels, present, fallback())
    (logger or log).info(f"stage: {len(fakes)} counterfeit records of republished clusters")
    return rows.with_counterfeits(fakes)


def lineage_row_keys(release, record_ids: list[str], rows: ReleaseRows) -> list[str | None]:
    """The lineage cluster key of every row of the would-be release (None: no key).

    A drop record's key is the one the release gives it; a counterfeit row's cluster is its key.
    """
    where = {r: i for i, r in enumerate(record_ids)}
    republished = {r.key for r in release.republished}
    out: list[str | None] = []
    for rid, cluster in zip(rows.record_ids, rows.clusters):
        i = where.get(rid)
        out.append(release.record_cluster[i] if i is not None else cluster if cluster in republished else None)
    return out


def registered_row_labels(release, state, record_ids: list[str], labels: list[str], rows: ReleaseRows) -> ReleaseRows:
    """The rows with the drop records of republished clusters given their registered labels.

    So that each republished cluster's released labels are its registered label mix
    (:meth:`~deid.release.lineage.LineageRelease.republished_labels`); clusters registered without
    labels keep the drop's labels.
    """
    registered = release.republished_labels(state, labels)
    where = {r: i for i, r in enumerate(record_ids)}
    out = {x: list(v) for x, v in rows.labels.items()}
    for j, rid in enumerate(rows.record_ids):
        i = where.get(rid)
        got = registered.get(release.record_cluster[i]) if i is not None else None
        if got is not None:
            for x, v in zip(labels, got.records[i]):
                out[x][j] = v
    return replace(rows, labels={x: tuple(v) for x, v in out.items()})


def republished_for_gate(release, state):
    """The gate's view of the republished clusters (:class:`deid.evaluation.gate_types.Republished`).

    Per republished cluster: the person (pseudonym) of each registered basis record, under this run's
    merges (two steward ids it resolves to one person count once), its counterfeit rows and its stored image.
    """
    from deid.evaluation.gate_types import Republished  # noqa: PLC0415 (the gate's imports are not needed on workers)

    person = getattr(release, "person", lambda p: p)
    return Republished(
        members={r.key: tuple(sorted(person(p) for _, p in state.clusters[r.key].members)) for r in release.republished},
        counterfeits={r.key: int(r.n_counterfeit) for r in release.republished},
        images={r.key: state.clusters[r.key].image for r in release.republished})


def lineage_can_abandon(state, release_id: str) -> bool:
    """Whether a pending release may be marked abandoned: no release registered after it.

    A later release was planned with this one's clusters as registered (pending constrains) and
    may republish them; abandoning it would drop clusters that release refers to. It stays
    pending then, which only ever constrains more.
    """
    seen = False
    for doc in state.entries:
        if doc.get("kind") == "release":
            if seen:
                return False
            seen = doc.get("release_id") == release_id
    return True
