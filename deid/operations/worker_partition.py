"""Worker functions of the partition stage: face descriptors, identity resolution (who is who) and the
records' label combinations.

Each worker function is idempotent (it writes to a temporary file and renames it into place), so a task
re-run after a lost worker produces the same output; it takes paths and small parameters, never large
arrays, so nothing big travels through the scheduler.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pyarrow as pa

from deid.errors import ConfigError, Quarantined
from deid.anonymise.identity import PeopleResolution, resolve_people

from deid.operations.worker_rows import as_array, feature_rows, shared_objects


def embed_faces(pixels: list[bytes], shape: tuple[int, int]) -> np.ndarray:
    """dlib ResNet descriptors of aligned canonical faces (a Dask task: one core per chunk)."""
    from deid.evaluation.recognizer import DlibEmbedder  # noqa: PLC0415 (dlib import cost)

    a = np.frombuffer(b"".join(pixels), np.uint8).reshape(len(pixels), -1)
    return DlibEmbedder(tuple(shape)).transform(a)


def resolve_identities(faces: pa.Table, *, policy: str = "merge", embeddings: np.ndarray | None = None,
                       cheap: np.ndarray | None = None, embed: Callable[[np.ndarray], np.ndarray] | None = None,
                       embed_budget: int = 2000) -> tuple[pa.Table, PeopleResolution, list[Quarantined]]:
    """Replace ``subject_id`` by the effective person (normalised ids, matching faces merged).

    Near-duplicate eigenface features always count; ``embeddings`` (dlib descriptors, one per
    row) add the recogniser's same-person matches, or ``cheap`` first-pass features with ``embed``
    (descriptors of the positions it flags, at most ``embed_budget``) at any size
    (:func:`deid.anonymise.identity.resolve_people`). ``policy="quarantine"`` withholds every
    record involved in a face match across ids instead of merging them.
    """
    if policy not in ("merge", "quarantine"):
        raise ConfigError(f"duplicate_ids={policy!r} must be 'merge' or 'quarantine'")
    # float32 as stored (resolve_people converts a bucket at a time) and one str per person (issue 13).
    X = feature_rows(faces.column("features"), np.float32) if faces.num_rows else None
    res = resolve_people(shared_objects(as_array(faces.column("subject_id"))).tolist(), X, embeddings=embeddings,
                         cheap=cheap, embed=embed, embed_budget=embed_budget)
    del X
    if res.face_merges:  # the report names a merge by its records' staging ids, never by subject id
        at = res.merged_positions()
        res = res.named(dict(zip(at, as_array(faces.column("record_id")).take(pa.array(at, pa.int64())).to_pylist())))
    people = pa.array(list(res.person), pa.string())
    faces = faces.set_column(faces.schema.get_field_index("subject_id"), "subject_id", people)
    quarantined: list[Quarantined] = []
    if policy == "quarantine" and res.flagged_records:
        ids = faces.column("record_id").to_pylist()
        quarantined = [Quarantined(ids[i], "", "same_face_other_id",
                                   "the face matches a record under another subject id", "identity")
                       for i in res.flagged_records]
        keep = np.ones(faces.num_rows, dtype=bool)
        keep[list(res.flagged_records)] = False
        faces = faces.filter(pa.array(keep))
    return faces, res, quarantined


def label_combinations(faces: pa.Table, labels: Sequence[str]) -> tuple[list[tuple], np.ndarray]:
    """The distinct combinations of the ``labels`` columns' values (a null is None), and each row's index
    into them: per-record label rows can then share one object per combination (issue 13)."""
    codes = np.zeros(faces.num_rows, np.int64)
    values = []
    for x in labels:
        enc = as_array(faces.column(x)).dictionary_encode()
        vals = [*enc.dictionary.to_pylist(), None]
        idx = enc.indices.fill_null(len(vals) - 1).to_numpy(zero_copy_only=False).astype(np.int64)
        codes = codes * len(vals) + idx
        values.append(vals)
    uniq, inverse = np.unique(codes, return_inverse=True)
    combos = []
    for c in uniq.tolist():
        key = []
        for vals in reversed(values):
            c, i = divmod(c, len(vals))
            key.append(vals[i])
        combos.append(tuple(reversed(key)))
    return combos, inverse.ravel()
