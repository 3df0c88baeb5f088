"""Colour releases (DEID_COLOR=true): colour decoded and aligned like grey, clusters averaged per channel."""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path

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


@pytest.mark.slow
@pytest.mark.london
def test_london_in_colour_at_128x160_is_released_with_colour_samples(project, prefect_server, london_dir, tmp_path,
                                                                      monkeypatch):
    from deid.release.card import split_card
    from deid.intake.london import import_london
    from deid.reporting.verify import verify_report
    from deid.flows.release import run_flow

    monkeypatch.setenv("DEID_COLOR", "true")
    # Colour is the subject: identity and the gate's attacks run on grey, exactly as in
    # tests/flow/test_flow.py::test_london_k5_k_same_select_is_released, which runs them in full. Here the
    # recogniser identity check is skipped, the deep recogniser attacks a 20-record sample and the
    # earlier utility protocols (report evidence only) run once.
    monkeypatch.setenv("DEID_IDENTITY_EMBED_MAX", "0")
    monkeypatch.setenv("DEID_DEEP_ATTACK_SAMPLE", "20")
    monkeypatch.setenv("DEID_MIN_PROBES", "4")  # the 20-record deep sample: 4 clusters, not grown
    monkeypatch.setenv("DEID_CV_REPEATS", "1")
    monkeypatch.setenv("DEID_CANONICAL_WIDTH", "128")
    monkeypatch.setenv("DEID_CANONICAL_HEIGHT", "160")
    drop = import_london(london_dir, tmp_path / "london")
    result = run_flow(str(drop), k=5, method="k-same-select").summary()
    assert result["verdict"] == "released", result["reasons"]
    assert result["privacy"]["max_rate"] <= 0.2
    rel = Path(result["release_dir"])
    faces = [cv2.imread(str(p), cv2.IMREAD_UNCHANGED) for p in sorted((rel / "images").glob("*.png"))]
    assert len(faces) == result["dataset"]["records_released"] > 0
    assert all(f.shape == (160, 128, 3) for f in faces)
    # Real colour: the channels differ (London's photographs are in colour).
    assert np.mean([np.abs(f[:, :, 2].astype(int) - f[:, :, 0].astype(int)).mean() for f in faces]) > 5
    report = json.loads(Path(result["report"]).read_text())
    assert report["configuration"]["color"] is True and report["configuration"]["canonical_size"] == [128, 160]
    assert verify_report(Path(result["report_dir"]), public_key=Path(result["public_key"])).ok
    # report.html shows colour samples.
    page = (Path(result["report_dir"]) / "report.html").read_text()
    samples = [cv2.imdecode(np.frombuffer(base64.b64decode(b), np.uint8), cv2.IMREAD_UNCHANGED)
               for b in re.findall(r'data:image/png;base64,([A-Za-z0-9+/=]+)', page)]
    colour_samples = [s for s in samples if s is not None and s.shape[:2] == (160, 128)]
    assert colour_samples and all(s.ndim == 3 and s.shape[2] == 3 for s in colour_samples)
    card, body = split_card((rel / "README.md").read_text())
    assert card["deid"]["color"] is True and "colour faces" in body
