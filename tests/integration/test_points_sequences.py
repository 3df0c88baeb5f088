"""Landmark points and image sequences through the release flow (the Prefect-free runner).

A drop with a ``points`` column run with ``k-same-m`` takes its clusters' shape from the points
(not optical flow); a drop of image sequences is staged as videos with fresh sequence ids and
frame counts that match, and the gate's decision on it is reported with its intervals.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from deid.evaluation import gate as gate_module
from deid.evaluation.leaks import avi_has_metadata
from deid.intake.synth import make_synthetic_drop
from deid.intake.synth_sequences import make_sequence_drop
from deid.operations import release_staging
from deid.operations.runner import Steps, run_release
from deid.release.publish import RELEASE_TABLE, read_video
from deid.run_config import RunConfig
from deid.settings import Settings
from helpers import add_points as _add_points

# The subject is the wiring, not the gate's figures: the deep recogniser on a small sample, no
# per-face recogniser identity check, one repeat of the older utility protocols.
QUICK = dict(identity_embed_max=0, deep_attack_sample=20, min_probes=4, cv_repeats=1)


def _config(tmp_path: Path, **params) -> RunConfig:
    return RunConfig.resolve(Settings(project_dir=tmp_path / "project", **QUICK), **params)


def test_k_same_m_takes_its_shapes_from_the_drops_points_through_the_runner(tmp_path, monkeypatch):
    drop = make_synthetic_drop(tmp_path / "drop", people=8, images_per_person=2, seed=3, image_size=128)
    n = _add_points(drop)
    gate_points = []
    evaluate = gate_module.evaluate

    def see_gate_inputs(inputs, config, **kw):
        gate_points.append(inputs.points)
        return evaluate(inputs, config, **kw)

    monkeypatch.setattr(gate_module, "evaluate", see_gate_inputs)
    # keep_staging=last:1: the test reads the run's partitions, which the default policy removes at its end.
    config = RunConfig.resolve(Settings(project_dir=tmp_path / "project", keep_staging="last:1", **QUICK),
                               k=3, method="k-same-m")
    result = run_release(drop, config)
    report = json.loads(result.report_path.read_text())
    used, ds = report["configuration"]["method_inputs"], report["dataset"]
    # Every partitioned record carried its points (k-same-m partitions by the labels: a partition of
    # fewer than k people is suppressed), and every cluster's shape came from them.
    assert ds["records_quarantined"] == 0 and ds["records_in"] == n
    assert used["points"] == n - ds["records_suppressed"] > 0 and used["sequences"] == 0
    n_clusters = report["configuration"]["clusters"]["count"]
    assert n_clusters >= 2 and used["shape_sources"] == {"points": n_clusters}
    part = next((result.staging / "partitions").glob("partition=*/*.parquet"))
    pts = pq.read_table(part, columns=["points"]).column("points").to_pylist()
    assert all(p is not None and len(p) == 6 for p in pts)  # canonical (x, y) of the three landmarks
    # The gate got every judged record's points: its parrot and utility folds re-run k-same-m with them.
    (got,) = gate_points
    assert got is not None and len(got) == used["points"] and all(p is not None and len(p) == 6 for p in got)
    assert result.verdict in ("released", "rejected")


@pytest.mark.slow
def test_without_points_k_same_m_falls_back_to_optical_flow(tmp_path):
    drop = make_synthetic_drop(tmp_path / "drop", people=6, images_per_person=2, seed=3, image_size=128)
    result = run_release(drop, _config(tmp_path, k=3, method="k-same-m"))
    used = json.loads(result.report_path.read_text())["configuration"]["method_inputs"]
    assert used["points"] == 0 and set(used["shape_sources"]) == {"flow"}


@pytest.mark.slow
def test_a_sequence_drop_is_staged_as_videos_and_judged_with_intervals(tmp_path):
    people, per_person, frames = 6, 2, 4
    drop = make_sequence_drop(tmp_path / "drop", people=people, sequences_per_person=per_person, frames=frames,
                              image_size=128)
    seen = {}

    def stage_and_look(deidentified, ingested, layout, config, **kw):
        # The staged release is inspected before the gate: a rejected run withholds it afterwards.
        staged = release_staging.stage(deidentified, ingested, layout, config, **kw)
        table = pq.read_table(staged.dir / RELEASE_TABLE).to_pydict()
        seen.update(table=table, videos={v: len(read_video(staged.dir / v)) for v in staged.videos},
                    metadata={v: avi_has_metadata((staged.dir / v).read_bytes()) for v in staged.videos},
                    file_metadata=dict(staged.file_metadata))
        return staged

    result = run_release(drop, _config(tmp_path, k=3, method="multi-factor"), steps=Steps(stage=stage_and_look))
    table, videos = seen["table"], seen["videos"]
    # One video per source sequence, each with as many frames as the release lists for it.
    assert len(videos) == people * per_person
    ids = table["sequence_id"]
    for video, n_frames in videos.items():
        sid = Path(video).stem
        assert n_frames == frames == ids.count(sid)
        assert sorted(f for f, s in zip(table["frame"], ids) if s == sid) == list(range(frames))
    # Fresh random sequence ids: none is a source key, none repeats, none shows a subject id.
    assert all(re.fullmatch(r"q-[0-9a-f]{12}", s) for s in set(ids))
    assert not {s for s in ids} & {f"s{p:05d}-q{q}" for p in range(1, people + 1) for q in range(per_person)}
    # The videos carry no text tags (FFmpeg's are blanked) and the gate's file check saw them.
    assert seen["metadata"] == dict.fromkeys(videos, []) and seen["file_metadata"] == {}
    report = json.loads(result.report_path.read_text())
    assert report["configuration"]["method_inputs"] == {"points": 0, "sequences": people * per_person,
                                                        "frames": people * per_person * frames, "shape_sources": {}}
    # Whatever the verdict, it is stated with every attack's interval and sample size.
    rates = report["privacy"]["reidentification"]
    assert rates and all(r["lower"] <= r["rate"] <= r["upper"] and r["n_probes"] > 0 for r in rates)
    check = next(c for c in report["checks"] if c["name"] == "reidentification_rate")
    # The decision follows from the bounds: with identical images per cluster no lower bound may exceed 1/k,
    # otherwise every upper bound must stay within it.
    if report["privacy"]["exact_bound"]:
        assert check["passed"] == all(r["lower"] <= 1 / 3 + 1e-9 for r in rates)
    else:
        assert check["passed"] == all(r["upper"] <= 1 / 3 + 1e-9 for r in rates)
    linkage = next(c for c in report["checks"] if c["name"] == "sequence_linkage_people")
    assert linkage["passed"] == (linkage["value"] >= 3)
    assert report["verdict"] in ("released", "rejected")
    if report["verdict"] == "rejected":
        assert report["reasons"] and result.release_dir is None
    else:
        assert sorted(p.name for p in (result.release_dir / "videos").iterdir()) == sorted(
            Path(v).name for v in videos)
