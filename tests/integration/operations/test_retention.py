"""Issue 32, the disk part: the staging retention policy (DEID_KEEP_STAGING), `deid gc`, and per-stage CPU/RSS.

The policy is tested as a function over fabricated staging trees (cheap); one test runs a small drop twice
through the Prefect-free runner: the default policy leaves only the markers and quarantine table, `deid gc`
frees a run kept whole, and the re-release of the same people is bit-identical.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from pydantic import ValidationError

from deid.cli import main
from deid.contracts import StagingLayout
from deid.operations.retention import StagedRun, apply_retention, plan_retention, tree_bytes
from deid.operations.safety import RunLock
from deid.operations.usage import merge_usage, sample_start, stage_usage
from deid.reporting.html_report import _setting_value
from deid.reporting.report import load_schema, stage_usage_of
from deid.settings import Settings, StagingRetention

ROOT = Path(__file__).resolve().parents[3]
KEPT = {".run.lock", ".complete", "quarantine.parquet"}


# ------------------------------------------------------------------------------------ the setting


@pytest.mark.parametrize("text, mode, last", [("none", "none", 0), ("FAILED", "failed", 0), ("last:3", "last", 3),
                                              ("last:0", "last", 0), ("all", "all", 0)])
def test_keep_staging_forms(text, mode, last, monkeypatch):
    monkeypatch.setenv("DEID_KEEP_STAGING", text)
    got = Settings().staging_retention
    assert (got.mode, got.last) == (mode, last)


@pytest.mark.parametrize("bad", ["last", "last:-1", "last:x", "keep", ""])
def test_a_bad_keep_staging_names_the_value_the_forms_and_an_example(bad, monkeypatch):
    monkeypatch.setenv("DEID_KEEP_STAGING", bad)
    with pytest.raises(ValidationError) as err:
        Settings()
    msg = str(err.value)
    assert repr(bad) in msg and "none | failed | last:N" in msg and "DEID_KEEP_STAGING=last:3" in msg


# ------------------------------------------------------------------------------------ the policy (pure)


def _runs() -> list[StagedRun]:
    # Five finished runs (t = finish time), one live, one unfinished and dead.
    return [StagedRun("rel-a", 10.0, "released"), StagedRun("rel-b", 50.0, "rejected"),
            StagedRun("rel-c", 40.0, "released"), StagedRun("rel-d", 30.0, None),
            StagedRun("rel-e", 20.0, "rejected"), StagedRun("rel-live", None, None, live=True),
            StagedRun("rel-dead", None, None, live=False)]


@pytest.mark.parametrize("policy, kept", [
    ("none", set()), ("all", {"rel-a", "rel-b", "rel-c", "rel-d", "rel-e"}), ("failed", {"rel-b", "rel-e"}),
    ("last:0", set()), ("last:1", {"rel-b"}), ("last:2", {"rel-b", "rel-c"}), ("last:3", {"rel-b", "rel-c", "rel-d"}),
    ("last:9", {"rel-a", "rel-b", "rel-c", "rel-d", "rel-e"})])
def test_plan_keeps_what_the_policy_says_and_never_touches_live_or_unfinished_runs(policy, kept):
    plan = {d.release_id: d.action for d in plan_retention(_runs(), StagingRetention.parse(policy))}
    assert plan.pop("rel-live") == "live" and plan.pop("rel-dead") == "unfinished"
    assert {r for r, a in plan.items() if a == "keep"} == kept
    assert {r for r, a in plan.items() if a == "trim"} == {"rel-a", "rel-b", "rel-c", "rel-d", "rel-e"} - kept


def test_last_n_breaks_equal_finish_times_by_release_id():
    runs = [StagedRun("rel-2", 5.0), StagedRun("rel-1", 5.0), StagedRun("rel-3", 5.0)]
    plan = plan_retention(runs, StagingRetention.parse("last:2"))
    assert [d.action for d in plan] == ["keep", "keep", "trim"]


# ------------------------------------------------------------------------------------ a fabricated staging tree


def _finished(data: Path, rid: str, *, verdict: str | None, mtime: float, payload: int) -> Path:
    """A finished run's staging: lock (released), verdict marker, quarantine table and ``payload`` bytes of work."""
    lock = RunLock.create(data / "staging" / rid)
    lock.close()
    layout = StagingLayout(lock.path)
    layout.quarantine.write_bytes(b"q" * 100)
    (layout.aligned_dir).mkdir()
    layout.aligned_part(0).write_bytes(b"a" * payload)
    layout.partition_dir("p000").mkdir(parents=True)
    (layout.partition_dir("p000") / "x.parquet").write_bytes(b"p" * payload)
    layout.complete.write_text(json.dumps({"verdict": verdict}) if verdict else "")
    os.utime(layout.complete, (mtime, mtime))
    return lock.path


def test_apply_trims_to_the_kept_files_counts_the_bytes_and_leaves_live_and_dead_runs(tmp_path):
    data, reports = tmp_path / "data", tmp_path / "reports"
    old = _finished(data, "rel-old", verdict="released", mtime=1000, payload=3000)
    rej = _finished(data, "rel-rej", verdict="rejected", mtime=2000, payload=5000)
    # An older run's empty marker: its report tells the verdict.
    legacy = _finished(data, "rel-legacy", verdict=None, mtime=3000, payload=7000)
    (reports / "rel-legacy").mkdir(parents=True)
    (reports / "rel-legacy" / "report.json").write_text(json.dumps({"verdict": "rejected"}))
    live = RunLock.create(data / "staging" / "rel-live")  # held: a live run
    (live.path / "ingested.parquet").write_bytes(b"i" * 4000)
    dead = data / "staging" / "rel-dead"  # no marker: recovery's business
    RunLock.create(dead).close()
    (dead / "ingested.parquet").write_bytes(b"i" * 4000)
    try:
        work = {d: tree_bytes(d) for d in (old, rej, legacy)}
        dry = apply_retention(data, reports, StagingRetention.parse("failed"), dry_run=True)
        assert all(tree_bytes(d) == n for d, n in work.items())  # a dry run removes nothing
        assert set(dry.freed) == {"rel-old"} and dry.freed["rel-old"] > 2 * 3000
        res = apply_retention(data, reports, StagingRetention.parse("failed"))
        assert res.freed == dry.freed and {p.name for p in old.iterdir()} == KEPT
        assert res.kept["rel-old"] == tree_bytes(old) == work[old] - res.freed["rel-old"]
        assert tree_bytes(rej) == work[rej] and tree_bytes(legacy) == work[legacy]  # rejected: kept whole
        # Then the default: every finished run trimmed, the same few files left in each.
        res = apply_retention(data, reports, StagingRetention())
        assert set(res.freed) == {"rel-old", "rel-rej", "rel-legacy"} and res.freed["rel-old"] == 0
        for d in (old, rej, legacy):
            assert {p.name for p in d.iterdir()} == KEPT
        assert (live.path / "ingested.parquet").stat().st_size == 4000  # live: untouched
        assert (dead / "ingested.parquet").exists()  # unfinished: left to recovery
        actions = {d.release_id: d.action for d in res.decisions}
        assert actions["rel-live"] == "live" and actions["rel-dead"] == "unfinished"
    finally:
        live.close()


def test_last_n_keeps_the_newest_runs_whole(tmp_path):
    data = tmp_path / "data"
    runs = {f"rel-{i}": _finished(data, f"rel-{i}", verdict="released", mtime=1000 + i, payload=1000)
            for i in range(5)}
    apply_retention(data, None, StagingRetention.parse("last:2"))
    whole = {rid for rid, d in runs.items() if {p.name for p in d.iterdir()} != KEPT}
    assert whole == {"rel-3", "rel-4"}


def test_deid_gc_says_what_it_frees_and_refuses_live_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DEID_PROJECT_DIR", str(tmp_path))
    monkeypatch.delenv("DEID_KEEP_STAGING", raising=False)
    done = _finished(tmp_path / "data", "rel-done", verdict="released", mtime=1000, payload=2000)
    live = RunLock.create(tmp_path / "data" / "staging" / "rel-live")
    (live.path / "ingested.parquet").write_bytes(b"i" * 4000)
    live.complete()  # finished its work but still holds its lock: still live
    try:
        before = tree_bytes(done)
        assert main(["gc", "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert tree_bytes(done) == before and "dry run: nothing removed" in out
        freed = before - sum((done / n).stat().st_size for n in KEPT) - os.lstat(done).st_size
        assert f"rel-done: would free {freed} bytes" in out and "rel-live: live" in out
        assert main(["gc"]) == 0
        out = capsys.readouterr().out
        assert f"rel-done: freed {freed} bytes" in out and f"total: freed {freed} bytes" in out
        assert {p.name for p in done.iterdir()} == KEPT
        assert (live.path / "ingested.parquet").exists()
    finally:
        live.close()
    monkeypatch.setenv("DEID_KEEP_STAGING", "most")
    assert main(["gc"]) == 2
    assert "DEID_KEEP_STAGING='most'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ per-stage CPU and RSS


def test_stage_usage_counts_cpu_of_children_and_the_stage_peak(tmp_path):
    warm = np.ones(40 * 2 ** 20 // 8)  # a peak before the stage: the stage's own peak must not include it
    del warm
    start = sample_start()
    a = np.ones(24 * 2 ** 20 // 8)  # 24 MiB touched in this process
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    subprocess.run([sys.executable, "-c", busy], check=True)  # a waited-for child's CPU
    u = stage_usage(start)
    del a
    assert set(u) == {"wall", "cpu", "peak_rss_mib", "tree_peak_rss_mib"}
    assert u["cpu"] >= 0.3 and u["wall"] > 0
    assert u["peak_rss_mib"] >= 24 and u["tree_peak_rss_mib"] >= u["peak_rss_mib"]
    both = merge_usage(u, {"wall": 1.0, "cpu": 2.0, "peak_rss_mib": 1.0, "tree_peak_rss_mib": None})
    assert both["wall"] == pytest.approx(u["wall"] + 1.0, abs=1e-4) and both["cpu"] == pytest.approx(u["cpu"] + 2)
    assert both["peak_rss_mib"] == u["peak_rss_mib"] and both["tree_peak_rss_mib"] == u["tree_peak_rss_mib"]


def test_stage_seconds_old_and_new_shapes_validate_and_render():
    schema = load_schema()["properties"]["configuration"]
    new = {"align": {"wall": 4.06, "cpu": 7.9, "peak_rss_mib": 310.2, "tree_peak_rss_mib": 901.0}}
    old = {"align": 4.0623}
    for shape in (new, old):
        jsonschema.validate({"stage_seconds": shape}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"stage_seconds": {"align": {"wall": 1.0}}}, schema)
    assert stage_usage_of(4.0623) == {"wall": 4.0623, "cpu": None, "peak_rss_mib": None, "tree_peak_rss_mib": None}
    assert _setting_value("stage_seconds", old) == "align 4.1"
    assert _setting_value("stage_seconds", new) == "align 4.1 (CPU 7.9, peak 310/901 MiB)"


# ------------------------------------------------------------------------------------ two real runs


def _image_hashes(release_dir: Path) -> Counter:
    return Counter(hashlib.sha256(p.read_bytes()).hexdigest() for p in (release_dir / "images").iterdir())


def test_default_policy_leaves_the_kept_files_and_gc_then_re_release_is_bit_identical(tmp_path, monkeypatch,
                                                                                      capsys):
    from deid.intake.synth import make_synthetic_drop
    from deid.operations.runner import run_release
    from deid.run_config import RunConfig

    drop = make_synthetic_drop(tmp_path / "drop", people=15, images_per_person=2, seed=2, image_size=96,
                               labels=False)  # no utility labels: the gate judges privacy only
    project = tmp_path / "project"
    quick = dict(project_dir=project, identity_embed_max=0, deep_attack_sample=20, cv_repeats=1)
    # The first run as before the policy (all kept), then `deid gc` with the default policy frees it.
    first = run_release(drop, RunConfig.resolve(Settings(keep_staging="all", **quick), k=3))
    assert first.verdict == "released", first.report.reasons
    full = tree_bytes(first.staging)
    assert (first.staging / "ingested.parquet").exists() and (first.staging / "deidentified").is_dir()
    monkeypatch.setenv("DEID_PROJECT_DIR", str(project))
    monkeypatch.delenv("DEID_KEEP_STAGING", raising=False)
    assert main(["gc"]) == 0
    out = capsys.readouterr().out
    kept = tree_bytes(first.staging)
    assert {p.name for p in first.staging.iterdir()} == KEPT and kept < 10_000 < full
    assert f"total: freed {full - kept} bytes" in out
    # The re-release of the same drop (every person returning) under the default policy: same images, bit for bit.
    second = run_release(drop, RunConfig.resolve(Settings(**quick), k=3))
    assert second.verdict == "released", second.report.reasons
    assert _image_hashes(second.release_dir) == _image_hashes(first.release_dir)
    for run in (first, second):
        assert {p.name for p in run.staging.iterdir()} == KEPT
    staging = tree_bytes(project / "data" / "staging")
    print(f"\nstaging: first run {full} bytes kept whole, {kept} after gc; both runs now {staging} bytes")
    assert staging < 2 * 10_000
    # The report's stage seconds carry the CPU and peaks of each stage.
    stages = second.report.configuration["stage_seconds"]
    assert {"ingest", "align", "gate"} <= set(stages)
    assert all(v["cpu"] is not None and v["peak_rss_mib"] > 0 for v in stages.values())
