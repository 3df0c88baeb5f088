"""The study's repeated work is done once (content-keyed memos) without changing a single result."""
from __future__ import annotations

import numpy as np
import pytest

import deid.memo as memo
from deid.memo import Memo, digest, key_for


@pytest.fixture(scope="module")
def small_aligned(tmp_path_factory):
    import deid.study as study
    from deid.intake.synth import make_synthetic_drop

    tmp = tmp_path_factory.mktemp("speed")
    drop = make_synthetic_drop(tmp / "drop", people=10, images_per_person=2, seed=3)
    d = study.load_aligned(drop, tmp / "work")
    return d.pixels, d.people, d.labels, d.shape


def _config(workers: int = 1):
    from deid.evaluation.gate_types import GateConfig
    from deid.study import StudyConfig

    gate = GateConfig(k=2, method="k-same", attackers=("pca-whitened-cosine",), repeats=1, folds=3)
    # A fixed seed (as DEID_SEED): the rows must be reproducible to compare them, and the parrot then re-runs
    # the release's own computation (with a secret seed it uses an independent one: nothing to reuse).
    return StudyConfig(ks=(2, 3), methods=("k-same-select", "k-same-eigen"), gate=gate, workers=workers, seed=0)


def _rows(res) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in res.rows]


def test_digest_keys_content_not_identity():
    a = np.arange(12, dtype=np.uint8).reshape(3, 4)
    assert digest(a) == digest(a.copy()) != digest(a.astype(np.int16))
    assert digest(a) != digest(a.T.copy())  # same bytes count, other shape
    assert digest(["a", np.str_("b")]) == digest(["a", "b"]) != digest(["a", "c"])
    assert digest({"x": [1, 2]}) == digest({"x": [1, 2]}) != digest({"x": [2, 1]})
    assert key_for(np.zeros(memo.MAX_KEY_BYTES + 1, np.uint8)) is None  # too big to hash: not memoised


def test_memo_returns_copies_and_stays_within_its_bytes():
    m = Memo("t", max_bytes=4000)
    calls = []

    def make(v):
        calls.append(v)
        return np.full(100, v, np.float64)  # 800 bytes

    first = m.get_or_compute(b"k1", lambda: make(1))
    first[:] = -1  # a caller mutating its result cannot change the memo
    assert (m.get_or_compute(b"k1", lambda: make(2)) == 1).all() and calls == [1]
    for i in range(10):
        m.get_or_compute(f"x{i}".encode(), lambda i=i: make(i))
    assert m._bytes <= 4000 and m.hits == 1
    m.get_or_compute(b"k1", lambda: make(3))  # evicted (least recently used): recomputed
    assert calls[-1] == 3


@pytest.mark.slow
def test_memoised_study_gives_exactly_the_unmemoised_rows(small_aligned, monkeypatch):
    from deid.anonymise import methods
    from deid.evaluation import utility, utility_protocols
    from deid.study import run_study

    pixels, people, labels, shape = small_aligned
    for m in (methods._DEIDENTIFIED, utility_protocols._CV, utility._ORIGINAL_FOLDS):
        m.clear()
    fast = run_study(pixels, people, labels, shape, _config())
    # The parrot re-runs the release's own computation; the originals' utility side is shared by the points.
    # 4 points x 2 labels: 4 parrot re-runs, 6 originals' grouped CVs and 9 originals' folds need not be redone.
    assert methods._DEIDENTIFIED.hits >= 4 and utility_protocols._CV.hits >= 6 and utility._ORIGINAL_FOLDS.hits >= 9
    monkeypatch.setattr(memo, "ENABLED", False)
    slow = run_study(pixels, people, labels, shape, _config())
    assert _rows(fast) == _rows(slow)
    assert all(np.array_equal(fast.examples[k], slow.examples[k]) for k in slow.examples)


@pytest.mark.slow
def test_parallel_study_gives_the_rows_of_the_serial_one(small_aligned):
    from deid.study import run_study

    pixels, people, labels, shape = small_aligned
    serial = run_study(pixels, people, labels, shape, _config(1))
    parallel = run_study(pixels, people, labels, shape, _config(2))
    assert _rows(serial) == _rows(parallel)
