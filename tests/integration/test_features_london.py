"""A real feature drop: the dlib ResNet embeddings of the aligned London faces, released at k=5.

The embeddings are derived data made here (a module-scoped fixture, ~25 s of CPU: alignment and
204 forward passes), never committed; the London photographs are read in place.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from deid.intake.features import read_feature_drop, write_feature_drop
from deid.operations.features import resolve_feature_people
from deid.operations.runner import run_release
from deid.run_config import RunConfig
from deid.settings import Settings
from helpers import load_london_aligned, london_descriptors

# One worker with test_recognizer's London tests: London is embedded once (helpers.london_descriptors).
pytestmark = [pytest.mark.slow, pytest.mark.london, pytest.mark.xdist_group("london-dlib")]

K = 5


@pytest.fixture(scope="module")
def london_embeddings(tmp_path_factory) -> Path:
    """The London drop as a feature drop: 128-d dlib descriptors, subject ids, gender and expression."""
    _, people, gender, expression = load_london_aligned(smiling="smile")
    vectors = london_descriptors()
    return write_feature_drop(tmp_path_factory.mktemp("london") / "london-dlib", vectors=vectors,
                              subject_ids=people, labels={"gender": gender, "expression": expression},
                              name="london-dlib", license="cc-by-4.0")


def _release(drop: Path, root: Path, **kw) -> SimpleNamespace:
    settings = Settings(project_dir=root, signing_key=None, linkage_key=None, seed=None)
    return SimpleNamespace(**run_release(drop, RunConfig.resolve(settings, k=K, kind="features", **kw)).summary())


def test_london_dlib_embeddings_released_at_k5(london_embeddings, tmp_path):
    drop = read_feature_drop(london_embeddings)
    assert drop.dim == 128 and drop.records_in >= 200 and drop.people >= 100
    res = _release(london_embeddings, tmp_path, method="k-same-select")
    report = json.loads(Path(res.report).read_text())
    print("\nLondon dlib k=5:", res.verdict, "records", res.dataset)
    for r in res.privacy["reidentification"]:
        print(f"  {r['attacker']}/{r['mode']}: {r['rate']:.3f} [{r['lower']:.3f}, {r['upper']:.3f}] n={r['n_probes']}")
    for u in res.utility:
        if u.get("protocol") == "cross-fit":
            print(f"  utility {u['label']}: {u['original_accuracy']:.3f} -> {u['deidentified_accuracy']:.3f} "
                  f"delta [{u['delta_lower']:.3f}, {u['delta_upper']:.3f}] n={u['n_test_images']} {u['gate_status']}")
    assert res.verdict == "released", res.reasons
    assert all(r["rate"] <= 1 / K + 1e-9 for r in res.privacy["reidentification"])
    assert res.privacy["exact_bound"] and res.privacy["max_person_share"] <= 1 / K + 1e-12
    # Real people: two photographs of one person are not near-duplicates, so no ids were merged.
    assert report["configuration"]["identity"]["face_merges"] == 0
    cross = {u["label"]: u for u in res.utility if u.get("protocol") == "cross-fit"}
    assert cross["gender"]["gate_status"] == "pass" and cross["gender"]["original_accuracy"] > 0.9
    assert res.dataset["records_released"] + res.dataset["records_suppressed"] + \
        res.dataset["records_quarantined"] == drop.records_in


def test_london_noise_control_rejected_and_duplicates_merged(london_embeddings, tmp_path):
    res = _release(london_embeddings, tmp_path / "noise", method="noise", sigma=0.5)
    assert res.verdict == "rejected"
    assert max(r["lower"] for r in res.privacy["reidentification"]) > 1 / K
    drop = read_feature_drop(london_embeddings)
    rng = np.random.default_rng(0)
    copies = drop.vectors[0] + 0.01 * drop.vectors.std(axis=0) * rng.standard_normal((K, drop.dim))
    dup = write_feature_drop(tmp_path / "dup", vectors=np.vstack([drop.vectors, copies]),
                             subject_ids=[*drop.subject_ids, *(f"fake{j}" for j in range(K))])
    identity = resolve_feature_people(read_feature_drop(dup))
    assert len(set(identity.person[-K:]) | {identity.person[0]}) == 1
    assert identity.resolution.n_people == drop.people
