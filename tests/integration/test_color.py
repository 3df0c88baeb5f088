"""Colour releases (DEID_COLOR=true): colour decoded and aligned like grey, clusters averaged per channel.

London released in colour through the Prefect flow is tests/flow/test_color.py.
"""
from __future__ import annotations

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deid.errors import StateError
from deid.intake.imaging import decode_color_reduced, decode_gray_reduced
from deid.operations.worker_deidentify import _colour_faces, _colour_means, colour_to_grey
from deid.schemas import arrow as schemas


def _colour_image(seed: int, size=(97, 70)) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w, h = size
    base = cv2.resize(rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8), (w, h))
    return base


@pytest.mark.parametrize("ext", [".jpg", ".png", ".png-alpha", ".pgm"])
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_colour_decode_has_the_grey_decodes_size_and_grey(ext, factor):
    img = _colour_image(1)
    if ext == ".png-alpha":
        img = np.dstack([img, np.full(img.shape[:2], 200, np.uint8)])
    elif ext == ".pgm":
        img = cv2.cvtColor(img, cv2.COLOR_BGR2GRAY)
    ok, buf = cv2.imencode(ext.split("-")[0], img)
    assert ok
    data = buf.tobytes()
    colour = decode_color_reduced(data, factor)
    grey = decode_gray_reduced(data, factor)
    assert colour.dtype == np.uint8 and colour.ndim == 3 and colour.shape[2] == 3
    assert colour.shape[:2] == grey.shape
    diff = np.abs(cv2.cvtColor(colour, cv2.COLOR_BGR2GRAY).astype(int) - grey.astype(int)).mean()
    assert diff < 2.0, diff
    if ext == ".pgm":
        assert (colour[:, :, 0] == colour[:, :, 1]).all() and (colour[:, :, 1] == colour[:, :, 2]).all()


def test_a_cluster_gets_its_mean_per_channel_and_the_grey_of_that(tmp_path):
    rng = np.random.default_rng(0)
    n, p = 7, 4 * 3 * 3
    colour = rng.integers(0, 256, (n, p), dtype=np.uint8)
    ids = [f"r{i}" for i in range(n)]
    d = tmp_path / "aligned_color"
    d.mkdir()
    # Two parts, shuffled: the means must follow record ids, not file order.
    for name, idx in (("part-0.parquet", [3, 0, 5]), ("part-1.parquet", [6, 1, 4, 2])):
        pq.write_table(pa.table({"record_id": [ids[i] for i in idx], "color": [colour[i].tobytes() for i in idx]},
                                schema=schemas.aligned_color()), d / name)
    labels = np.array([0, 1, 0, 1, 0, 1, 1])
    # What deidentify_partition does: the faces in record order, then each cluster's mean.
    out = _colour_means(_colour_faces(str(d), ids), labels)
    for c in (0, 1):
        members = np.flatnonzero(labels == c)
        want = np.rint(colour[members].astype(float).mean(axis=0))
        assert (out[members] == want.astype(np.uint8)).all()
    grey = colour_to_grey(out)
    assert grey.shape == (n, p // 3)
    assert (grey[labels == 0] == grey[0]).all()
    with pytest.raises(StateError, match="no colour face"):
        _colour_faces(str(d), [*ids, "r-missing"])
    # One cluster (labels None): the mean face once, as the near-copy repair asks for a merged cluster.
    one = _colour_means(colour, None)
    assert one.shape == (1, p) and (one[0] == np.rint(colour.astype(float).mean(axis=0)).astype(np.uint8)).all()
