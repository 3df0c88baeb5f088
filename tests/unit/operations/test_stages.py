"""Worker-side stage functions."""
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from deid.alignment.features import Eigenfaces
from deid.operations.worker_featurize import fit_eigenfaces
from deid.operations.worker_rows import read_pixels
from deid.schemas import arrow as schemas


def _part(path, X, tag):
    n = len(X)
    pq.write_table(pa.table({"record_id": [f"{tag}-{i}" for i in range(n)], "pixels": [x.tobytes() for x in X],
                             "eye_source": ["manifest"] * n, **{c: [1.0] * n for c in
                             ("eye_left_x", "eye_left_y", "eye_right_x", "eye_right_y")}},
                            schema=schemas.aligned()), path)


def test_fit_eigenfaces_loads_only_the_subset_and_matches_the_full_fit(tmp_path):
    rng = np.random.default_rng(1)
    paths = []
    for j in range(3):  # 2700 faces > max_fit_samples (2000): the subset path
        paths.append(str(tmp_path / f"{j}.parquet"))
        _part(paths[-1], rng.integers(0, 255, (900, 120), dtype=np.uint8), f"p{j}")
    sub = fit_eigenfaces(paths, 8, seed=3)
    _, X = read_pixels(paths)
    full = Eigenfaces(8, random_state=3).fit(X)
    np.testing.assert_allclose(sub.mean_, full.mean_, atol=1e-5)
    np.testing.assert_allclose(np.abs(sub.components_), np.abs(full.components_), atol=1e-4)
