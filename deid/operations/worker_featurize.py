"""Worker functions of the featurize stage: the eigenfaces fitted on the aligned set, every aligned part
projected, and the identity first pass's features computed from the same pixels.

Each worker function is idempotent (it writes to a temporary file and renames it into place), so a task
re-run after a lost worker produces the same output; it takes paths and small parameters, never large
arrays, so nothing big travels through the scheduler.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deid.alignment.features import Eigenfaces, IlluminationFeatures
from deid.schemas import arrow as schemas

from deid.operations.worker_rows import read_pixels, write_atomic


def fit_eigenfaces(aligned_paths: list[str], n_components: int, seed: int = 0) -> Eigenfaces:
    """Fit the eigenface model on the aligned set (a seeded subset on large drops).

    Only the subset Eigenfaces would draw is loaded (the same seeded choice), so memory stays
    bounded by ``max_fit_samples`` faces instead of the whole drop.
    """
    model = Eigenfaces(n_components, random_state=seed)
    counts = [pq.ParquetFile(p).metadata.num_rows for p in aligned_paths]
    total = sum(counts)
    if total <= model.max_fit_samples:
        _, X = read_pixels(aligned_paths)
        return model.fit(X)
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(total, model.max_fit_samples, replace=False))
    rows, start = [], 0
    for path, n in zip(aligned_paths, counts):
        local = chosen[(chosen >= start) & (chosen < start + n)] - start
        if len(local):
            pix = pq.read_table(path, columns=["pixels"]).column("pixels").take(pa.array(local)).to_pylist()
            rows.extend(pix)
        start += n
    X = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(len(rows), -1)
    return model.fit(X)


def _list_column(feats: np.ndarray, n: int) -> pa.ListArray:
    """Rows of a float matrix as an Arrow list column (one buffer, no Python lists)."""
    return pa.ListArray.from_arrays(
        pa.array(np.arange(0, feats.size + 1, max(feats.shape[1], 1), dtype=np.int32)[: n + 1]),
        pa.array(np.ascontiguousarray(feats, dtype=np.float32).ravel()))


def project_part(aligned_path: str, model: Eigenfaces, out_path: str, identity=None) -> int:
    """Project one aligned part onto the eigenfaces; write (record_id, features).

    ``identity`` (a fitted :data:`CheapIdentityFeatures`): also write the identity first pass's
    features of the part (column ``identity``), from the pixels read once for both.
    """
    ids, X = read_pixels([aligned_path])
    feats = model.transform(X) if len(ids) else np.zeros((0, model.n_components_), np.float32)
    columns = {"record_id": ids, "features": _list_column(feats, len(ids))}
    if identity is not None:
        columns["identity"] = _list_column(identity.transform(X), len(ids))
    write_atomic(pa.table(columns, schema=schemas.features(identity=identity is not None)), Path(out_path))
    return len(ids)


def fit_identity_features(aligned_path: str, shape: tuple[int, int]):
    """The identity first pass's model (:data:`CheapIdentityFeatures`), fitted on the first aligned part
    (at most ~4,000 of its faces, evenly spaced)."""
    _, rows = read_pixels([aligned_path])
    return CheapIdentityFeatures(shape).fit(rows[:: max(1, len(rows) // 4000)])


IDENTITY_CHEAP_DIMS = 48  # principal components of the self-quotient images the first pass searches


def identity_cheap_features(pixels: np.ndarray, shape: tuple[int, int], *, dims: int = IDENTITY_CHEAP_DIMS,
                            chunk: int = 4096) -> np.ndarray:
    """The identity first pass's features of in-memory faces (:class:`CheapIdentityFeatures`)."""
    a = np.asarray(pixels)
    if len(a) == 0:
        return np.zeros((0, dims), np.float32)
    model = CheapIdentityFeatures(shape, n_components=dims).fit(a)
    return np.vstack([model.transform(a[s:s + chunk]) for s in range(0, len(a), chunk)])


CheapIdentityFeatures = IlluminationFeatures
"""The identity stage's first-pass features (:class:`deid.alignment.features.IlluminationFeatures`)."""
