"""Colour releases through the Prefect flow: London in colour at 128x160 is released with colour samples.

Colour decoding and per-channel cluster averages are tests/integration/test_color.py.
"""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import cv2
import numpy as np
import pytest



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
