"""`deid study` gives every method the inputs `deid run` gives it: landmark points and sequence/frame columns.

The study reads them with the faces (and from its cache), passes them to the method, and decides
with the flow's contract (:class:`deid.contracts.MethodInputs`) whether the gate's re-runs get the
points (``GateInputs.points``) and the sequence model (the runner's options).
"""
from __future__ import annotations

import numpy as np
import pytest

import deid.anonymise.methods as methods
import deid.study as study
from deid.anonymise.sequences import sequence_options
from deid.evaluation.gate_types import GateConfig
from deid.intake.synth import make_synthetic_drop
from deid.intake.synth_sequences import make_sequence_drop
from helpers import add_points

GATE = GateConfig(k=2, method="k-same", attackers=("pca-whitened-cosine",), modes=("parrot",), repeats=1, folds=2)


def _spy(monkeypatch) -> tuple[list[dict], list]:
    """Record the keyword arguments of every de-identification and the inputs of every gate evaluation."""
    calls, gates = [], []
    deidentify, evaluate = methods.deidentify, study.evaluate

    def see_method(images, **kw):
        calls.append(kw)
        return deidentify(images, **kw)

    def see_gate(inputs, config, **kw):
        gates.append(inputs)
        return evaluate(inputs, config, **kw)

    monkeypatch.setattr(methods, "deidentify", see_method)
    monkeypatch.setattr(study, "evaluate", see_gate)
    return calls, gates


def test_the_study_gives_k_same_m_the_drops_landmark_points(tmp_path, monkeypatch):
    drop = make_synthetic_drop(tmp_path / "drop", people=6, images_per_person=2, seed=4, image_size=96)
    n = add_points(drop)
    d = study.load_aligned(drop, tmp_path / "work", labels=["gender"])
    assert d.inputs.points == n == len(d.pixels) and d.sequences is None
    assert all(p is not None and len(p) == 6 for p in d.points)  # canonical (x, y) of the three landmarks
    cached = study.load_aligned(drop, tmp_path / "work", labels=["gender"])
    assert cached.points == d.points  # the cache keeps them

    calls, gates = _spy(monkeypatch)
    cfg = study.StudyConfig(ks=(2,), methods=("k-same-m", "k-same-eigen"), gate=GATE)
    res = study.run_study(d.pixels, d.people, d.labels, d.shape, cfg, points=d.points)
    assert {s["method"]: s["verdict"] for s in study.summary(res.rows)}.keys() == {"k-same-m", "k-same-eigen"}
    # The release got every record's points; the gate's parrot re-ran k-same-m with them.
    assert calls[0]["method"] == "k-same-m" and calls[0]["points"] == d.points
    assert gates[0].points == d.points
    parrot = [c for c in calls[1:] if c["method"] == "k-same-m"]
    assert parrot and all(c["points"] is not None and len(c["points"]) > 0 for c in parrot)
    # A method that takes no points: its gate gets none (as in the flow).
    assert gates[1].points is None


def test_the_study_runs_a_sequence_drop_with_the_flows_sequence_model(tmp_path, monkeypatch):
    drop = make_sequence_drop(tmp_path / "drop", people=4, sequences_per_person=1, frames=3, seed=5, image_size=96)
    d = study.load_aligned(drop, tmp_path / "work", labels=["gender", "expression"])
    assert d.inputs.sequences == 4 and d.inputs.frames == len(d.pixels) == 12 and d.points is None
    assert study.load_aligned(drop, tmp_path / "work", labels=["gender", "expression"]).frames == d.frames  # cached too

    calls, gates = _spy(monkeypatch)
    cfg = study.StudyConfig(ks=(2,), methods=("multi-factor", "k-same"), gate=GATE)
    res = study.run_study(d.pixels, d.people, d.labels, d.shape, cfg, sequences=d.sequences, frames=d.frames)
    assert calls[0]["sequences"] == d.sequences and calls[0]["frames"] == d.frames
    assert gates[0].deidentify.options == sequence_options("multi-factor") is not None
    # The flow's sequence check joins the gate: every released video must fit >= k people.
    linkage = {r["method"]: r["status"] for r in res.rows if r.get("check") == "sequence_linkage_people"}
    assert set(linkage) == {"multi-factor", "k-same"} and linkage["multi-factor"] == "pass"
    with pytest.raises(Exception, match="sequences has 2 entries"):
        study.run_study(d.pixels, d.people, d.labels, d.shape, cfg, sequences=d.sequences[:2], frames=d.frames)
    np.testing.assert_array_equal(d.pixels, study.load_aligned(drop, tmp_path / "work", labels=["gender", "expression"]).pixels)


def test_the_study_aligns_video_frames_on_the_eyes_ingest_staged_as_the_flow_does(tmp_path, monkeypatch):
    """A video drop's frames reach the study's methods aligned as the flow aligns them: on the eyes ingest staged
    (one landmark pass per detected frame, moved with the face on followed frames), not one pass per frame."""
    import deid.study as study
    from deid.alignment.eyes import HaarEyeDetector
    from deid.intake.synth_videos import make_video_drop

    drop = make_video_drop(tmp_path / "drop", people=2, recordings=1, seconds=2.0, fps=10.0, extras=False, seed=3)
    passes = []
    real = HaarEyeDetector.eyes_in_box
    monkeypatch.setattr(HaarEyeDetector, "eyes_in_box", lambda self, *a, **k: (passes.append(1), real(self, *a, **k))[1])
    d = study.load_aligned(drop, tmp_path / "w")
    assert len(d.pixels) >= 30 and d.sequences is not None
    # Fewer landmark passes than frames: the followed frames took the detection's eyes moved with the face.
    assert 0 < len(passes) < len(d.pixels), (len(passes), len(d.pixels))
