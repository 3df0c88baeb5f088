"""deid.progress: throttled progress lines with the time left, on a fake clock."""
from __future__ import annotations

import logging

import pytest

from deid.errors import ConfigError
from deid.progress import Progress, format_duration, track


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "deid.progress"]


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture(autouse=True)
def _info(caplog):
    caplog.set_level(logging.INFO, logger="deid.progress")


def test_fast_stage_logs_start_milestones_at_most_every_min_seconds_and_the_end(clock, caplog):
    p = Progress("align", every_seconds=15, every_fraction=0.1, min_seconds=2, clock=clock).start(100)
    for _ in range(100):  # one record every 1/16 s: 6.25 s in all, a 10% step every 0.625 s
        clock.t += 0.0625
        p.advance()
    lines = _lines(caplog)
    assert lines[0] == "align: 100 records to do"
    assert lines[-1] == "align: 100/100 records (100%), done in 6 s"
    # 10 milestones, but never two lines within 2 s; the time left is linear in the rate so far.
    assert lines[1:-1] == ["align: 32/100 records (32%), 2 s elapsed, about 4 s left",
                           "align: 64/100 records (64%), 4 s elapsed, about 2 s left",
                           "align: 96/100 records (96%), 6 s elapsed, about < 1 s left"]


def test_slow_stage_heartbeat_and_linear_time_left(clock, caplog):
    p = Progress("gate: attacks", unit="pairs", every_seconds=15, every_fraction=0.5, min_seconds=2,
                 clock=clock).start(20)
    for i in range(19):  # 10 s per pair: the 50% milestone and a heartbeat every >= 15 s
        clock.t += 10
        p.advance(note=f"a{i}")
    lines = _lines(caplog)[1:]
    # Heartbeats at 20 s, 40 s, ... (>= 15 s apart), the 50% line at 100 s.
    assert lines[0] == "gate: attacks: 2/20 pairs (10%), 20 s elapsed, about 3 min 00 s left (last: a1)"
    assert "gate: attacks: 10/20 pairs (50%), 1 min 40 s elapsed, about 1 min 40 s left (last: a9)" in lines
    assert len(lines) == 9  # 2, 4, 6, 8, 10, 12, 14, 16, 18 pairs: one line per 20 s, never more often
    assert p.eta() == pytest.approx(10.0)  # 190 s for 19 pairs: 10 s each, 1 to go
    clock.t += 10
    p.advance()
    assert _lines(caplog)[-1] == "gate: attacks: 20/20 pairs (100%), done in 3 min 20 s"
    p.finish()  # already complete: no second last line
    assert len(_lines(caplog)) == 11


def test_finish_reports_work_that_ended_short_and_track_counts_continue(clock, caplog):
    p = Progress("utility", unit="folds", clock=clock).start(15)
    for i in track(range(12), p):
        clock.t += 1
        if i % 2:
            continue  # a skipped fold still counts as done
    p.finish()
    assert p.done == 12
    assert _lines(caplog)[-1] == "utility: 12/15 folds (80%), done in 12 s"


def test_zero_total_and_bad_arguments(clock, caplog):
    Progress("empty", clock=clock).start(0).finish()
    assert _lines(caplog) == ["empty: 0 records to do"]
    with pytest.raises(ConfigError, match="every_fraction"):
        Progress("x", every_fraction=0)
    with pytest.raises(ConfigError, match="min_seconds"):
        Progress("x", every_seconds=1, min_seconds=5)
    with pytest.raises(ConfigError, match="total=-1"):
        Progress("x").start(-1)
    with pytest.raises(ConfigError, match="needs total"):
        Progress("x").start()


def test_lines_go_to_a_given_logger(clock, caplog):
    other = logging.getLogger("prefect.task_runs.fake")
    caplog.set_level(logging.INFO, logger=other.name)
    Progress("deidentify", logger=other, clock=clock).start(3).advance(3)
    assert [r.getMessage() for r in caplog.records if r.name == other.name] == [
        "deidentify: 3 records to do", "deidentify: 3/3 records (100%), done in < 1 s"]


def test_format_duration():
    assert [format_duration(s) for s in (0.2, 1, 59.4, 60, 125, 3600, 3725)] == [
        "< 1 s", "1 s", "59 s", "1 min 00 s", "2 min 05 s", "1 h 00 min", "1 h 02 min"]


def test_parts_progress_names_parts_and_estimates_time_left_from_measured_costs(clock, caplog):
    from deid.progress import PartsProgress

    # The gate's shape: a costly deep attacker and cross-fit first, six light parts after, on 2 processes.
    parts = [("attack dlib-resnet", 4.0), ("cross-fit", 3.0), *((f"attack a{i}", 1.0) for i in range(6))]
    p = PartsProgress("gate", parts, workers=2, clock=clock, heartbeat=False).start()
    assert _lines(caplog)[0].startswith("gate: 8 parts on 2 process(es): attack dlib-resnet, cross-fit, attack a0")
    clock.t += 15
    p.beat()  # before any part is measured: who runs, for how long, and no invented time left
    assert _lines(caplog)[-1] == ("gate: working; 0/8 parts done, 15 s elapsed, time left measured after the first "
                                  "part; running: attack dlib-resnet (15 s), cross-fit (15 s)")
    clock.t += 15  # cross-fit measured at 30 s: 10 s per unit of weight
    p.done("cross-fit", 30.0)
    # dlib (40 s expected, 30 s run) ends at +10 s; a0 (10 s) starts now on cross-fit's process; the five
    # other light parts fill the earlier-free process: 10+10+10 | 10+10+10+10 -> 40 s, not 7 x 30 s.
    assert p.eta() == pytest.approx(40.0)
    assert _lines(caplog)[-1] == ("gate: part cross-fit done in 30 s; 1/8 parts done, 30 s elapsed, about 40 s left; "
                                  "running: attack dlib-resnet (30 s), attack a0 (< 1 s)")
    clock.t += 10
    p.done("attack dlib-resnet", 40.0)
    for i in range(6):
        clock.t += 5
        p.done(f"attack a{i}", 5.0)  # the light parts are cheaper than their prior: the estimate follows
        if i == 2:
            assert p.eta() < 20
    last = _lines(caplog)[-1]
    assert last.startswith("gate: part attack a5 done in 5 s; all 8 parts done in 1 min 10 s")
    rec = [r for r in caplog.records if r.name == "deid.progress"][-1]
    assert rec.deid_progress == {"stage": "gate", "done": 8, "total": 8, "share": 1.0, "final": True}
    with pytest.raises(ConfigError, match="attack a5"):
        p.done("attack a5")
    with pytest.raises(ConfigError, match="own name"):
        PartsProgress("gate", [("x", 1.0), ("x", 2.0)])
    with pytest.raises(ConfigError, match="weight must be > 0"):
        PartsProgress("gate", [("x", 0.0)])


def test_parts_progress_heartbeat_thread_speaks_while_a_part_runs(caplog):
    import time

    from deid.progress import PartsProgress

    p = PartsProgress("gate", [("slow", 1.0), ("fast", 1.0)], workers=1, every_seconds=0.05).start()
    time.sleep(0.3)
    p.done("slow")
    beats = [x for x in _lines(caplog) if x.startswith("gate: working")]
    assert beats and all("running: slow" in x for x in beats), _lines(caplog)
    p.finish()
    n = len(_lines(caplog))
    time.sleep(0.15)
    assert len(_lines(caplog)) == n  # stopped: no heartbeat after finish()
