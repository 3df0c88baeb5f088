"""The project's person index in a run (issue 27): a drop's people claimed for a lineage, the ones the
lookup did not find searched by face, and a released drop's face descriptors registered.

One function per stage, with the contract :mod:`deid.operations` describes.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from deid.evaluation.checks import Check
from deid.contracts import (
    Ingested,
    StagingLayout,
)
from deid.errors import DataError, Quarantined
from deid.heap import release_free_memory
from deid.run_config import RunConfig

from deid.operations.deidentify_lineage import open_lineage
from deid.operations.ingest_align import lineage_color_check, lineage_size_check
from deid.operations.run_setup import Logger, linkage_key

log = logging.getLogger(__name__)


def person_index(config: RunConfig):
    """The project's :class:`~deid.operations.person_index.PersonIndex` (under the data dir, or DEID_DATABASE_URL)."""
    from deid.operations.person_index import PersonIndex  # noqa: PLC0415

    url = config.database_url
    url = url.get_secret_value() if hasattr(url, "get_secret_value") else url
    return PersonIndex.open(config.data_path, linkage_key(config)[0], database_url=url)


PERSON_FACES = "person_faces.npz"  # in the run's private staging: the descriptors the release registers


def search_people(config: RunConfig, routing, lineage_state, *, listed: pa.Array, record_ids: pa.Array, identity,
                  rows: np.ndarray, descriptors: np.ndarray, metadata: pa.Table, quarantined: Sequence[Quarantined],
                  layout: StagingLayout, lg=log):
    """The person index's face search of a drop (issue 27): its people the fingerprint and id lookup did not find,
    searched among the faces other datasets (and other ids of its own) registered.

    ``listed``, ``record_ids``: each face's subject id as listed (before identity resolution;
    ``identity.person`` is its effective person) and record id; ``rows``, ``descriptors``: the faces
    identity resolution embedded and their dlib descriptors; ``metadata``: the drop's records as claimed.
    At identity resolution's calibrated threshold, a match is that registered person
    (:meth:`~deid.operations.person_index.PersonIndex.route_faces`): under ``DEID_CROSS_DATASET=refuse`` a
    person of another dataset refuses the drop naming it (the claim withdrawn), under ``route`` the drop is
    planned in that dataset's lineage as those people (the claim moved there).

    Returns ``(aliases, lineage_state, check, note, faces_file)``: drop person -> registered person;
    the lineage to plan in (another dataset's, opened, when routed); the ``person_index`` check (its
    detail states how many people were matched by face); the report note (empty: none); the staged
    descriptors the release registers (None: nothing to register).
    """
    from deid.release.lineage import pseudonymize  # noqa: PLC0415

    cal = identity.calibration
    if cal is None or not len(rows):
        detail = ("face search: not run (identity resolution embedded no face of the drop, so there is no calibrated "
                  "same-person distance); the person index looked the drop up by fingerprint and steward id only")
        return {}, lineage_state, Check("person_index", True, 0, None, detail), "", None
    rows = np.asarray(rows, np.int64)
    people = [identity.person[r] for r in rows.tolist()]
    # People the lineage holds already (released under its pseudonyms) were found by the lookup: not matched again.
    distinct = sorted(set(people))
    released, clusters = lineage_state.released_people, lineage_state.person_clusters  # looked up, not copied
    known = {p for p, h in zip(distinct, pseudonymize(linkage_key(config)[0], lineage_state.dataset, distinct))
             if h in released or h in clusters}
    index = person_index(config)
    faces = index.route_faces(routing, people, descriptors, threshold=float(cal["threshold"]), known=known,
                              held=len(known), policy=config.cross_dataset)
    lg.info("partition: %s", faces.detail())
    if faces.routed_from is not None:
        lg.warning("%s", faces.note)
        # The drop's records move to the lineage it is planned in, the matched people's under their registered ids.
        person_of = dict(zip(listed.take(pa.array(rows)).to_pylist(), people))
        final = [faces.aliases.get(person_of.get(s, ""), s) for s in metadata.column("subject_id").to_pylist()]
        index.resettle(routing, faces.dataset, final, [str(f) for f in metadata.column("source_sha256").to_pylist()],
                       id_scope=config.cross_dataset_ids)
        lineage_state = open_lineage(faces.dataset, config, logger=lg)
        blocked = [c for c in (lineage_color_check(config, lineage_state), lineage_size_check(config, lineage_state))
                   if c is not None and not c.passed]
        if blocked:
            raise DataError("; ".join(c.detail for c in blocked))
    elif faces.note:
        lg.warning("person index: %s", faces.note)
    # Registered with the release (register_person_faces): the faces with no registered copy, of records not
    # quarantined, under the person they are planned as.
    out = {q.record_id for q in quarantined}
    fresh = np.asarray(faces.fresh, np.int64)
    ids = record_ids.take(pa.array(rows[fresh])).to_pylist() if len(fresh) else []
    keep = [int(i) for i, r in zip(fresh.tolist(), ids) if r not in out]
    path = None
    if keep:
        path = layout.root / PERSON_FACES
        np.savez(path, people=np.array([faces.aliases.get(people[i], people[i]) for i in keep], dtype=str),
                 descriptors=np.asarray(descriptors, np.float32)[keep])
    detail = faces.detail()
    # Face search sees only the faces identity resolution embedded (at most DEID_IDENTITY_EMBED_MAX, chosen by
    # the cheap first pass): a drop's other people were looked up by fingerprint and steward id only. Said in
    # the check, so a large drop's report never reads as if all its people had been searched by face.
    unembedded = identity.n_people - len(distinct)
    if unembedded > 0:
        detail += (f"; {unembedded} of the drop's {identity.n_people} people had no face embedded (identity "
                   f"resolution embedded {len(rows)} faces: at most DEID_IDENTITY_EMBED_MAX="
                   f"{config.identity_embed_max}, those its cheap first pass flagged): they were looked up by "
                   "fingerprint and steward id only, not by face")
    check = Check("person_index", True, faces.n_matched, None, detail, n=faces.searched)
    return faces.aliases, lineage_state, check, faces.note, path


def register_person_faces(config: RunConfig, dataset: str, path: Path | None, *, logger: Logger | None = None) -> int:
    """Register a released drop's face descriptors (staged by :func:`search_people`) under ``dataset``, sealed
    (AES-256-GCM under the linkage key, as the rest of the person index); the number registered."""
    if path is None or not Path(path).is_file():
        return 0
    with np.load(path) as z:
        people, descriptors = z["people"].tolist(), z["descriptors"]
    person_index(config).register_faces(dataset, people, descriptors)
    (logger or log).info("person index: %d face descriptors registered under dataset %r", len(people), dataset)
    return len(people)


def claim_records(config: RunConfig, dataset: str, subject_ids: Sequence[str], fingerprints: Sequence[str], *,
                  logger: Logger | None = None):
    """The person index's :meth:`~deid.operations.person_index.PersonIndex.claim` of a drop's records (faces or
    feature vectors): its :class:`~deid.operations.person_index.Routing`, logged."""
    routing = person_index(config).claim(dataset, subject_ids, fingerprints, policy=config.cross_dataset,
                                         id_scope=config.cross_dataset_ids)
    lg = logger or log
    if routing.note:
        lg.warning("%s", routing.note)
    elif routing.aliases:
        lg.warning("person index: %d re-keyed subject ids of dataset %r (their records are registered under another "
                   "id) are listed under their registered ids", len(routing.aliases), routing.dataset)
    return routing


def claim_people(ingested: Ingested, config: RunConfig, *, logger: Logger | None = None):
    """Look the drop's people up in the project's person index and claim them for a lineage.

    Returns ``(ingested, routing)``: the drop with re-keyed subject ids listed under their registered
    ids (:attr:`~deid.operations.person_index.Routing.aliases`), and where its lineage is planned
    (:class:`~deid.operations.person_index.Routing`). A drop holding people another dataset
    registered is refused (:class:`~deid.errors.DataError`, naming it) under ``DEID_CROSS_DATASET=refuse``.
    """
    meta = ingested.metadata
    subjects = [str(s) for s in meta.column("subject_id").to_pylist()]
    routing = claim_records(config, ingested.dataset, subjects,
                            [str(f) for f in meta.column("source_sha256").to_pylist()], logger=logger)
    if routing.aliases:
        column = pa.array([routing.aliases.get(s, s) for s in subjects], pa.string())
        meta = meta.set_column(meta.column_names.index("subject_id"), meta.schema.field("subject_id"), column)
        ingested = replace(ingested, metadata=meta, people=pc.count_distinct(column).as_py())
    del subjects
    release_free_memory()  # a million records' ids, fingerprints and digests (~1 GB): not held through the run
    return ingested, routing
