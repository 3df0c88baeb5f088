"""The gate re-runs k-same-m with the landmark points the release used (parrot attacker, utility folds).

A k-same-m release shaped from landmark points and one shaped by optical flow are different
releases: an attacker who re-runs the method without the points parrots the wrong one.
"""
from __future__ import annotations

import numpy as np

from deid.anonymise.methods import deidentify, method_runner
from deid.evaluation.gate_types import GateConfig, GateInputs
from deid.evaluation.gate_privacy import privacy_checks
from deid.evaluation.gate_utility import utility_checks

SHAPE = (24, 20)
K = 3


def _faces(n_people: int = 9, per_person: int = 2, seed: int = 0):
    """Seeded textured faces, each with three landmarks (the same face points, shifted with the face)."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(40, 215, size=SHAPE)
    people = np.repeat([f"p{i}" for i in range(n_people)], per_person)
    faces, points = [], []
    for who in range(len(people)):
        dy, dx = rng.integers(-2, 3, size=2)
        faces.append(np.roll(base, (dy, dx), axis=(0, 1)) + rng.normal(0, 8, SHAPE) + 3 * (who // per_person))
        points.append([6.0 + dx, 8.0 + dy, 14.0 + dx, 8.0 + dy, 10.0 + dx, 16.0 + dy])  # flat (x, y), as staged
    return np.clip(faces, 0, 255).astype(np.uint8).reshape(len(people), -1), people, points


def test_the_parrot_and_the_utility_folds_rerun_k_same_m_with_the_records_points():
    x, people, points = _faces()
    released, clusters = deidentify(x, shape=SHAPE, people=list(people), method="k-same-m", k=K, n_components=8,
                                    points=points)
    runner = method_runner("k-same-m", shape=SHAPE, k=K, n_components=8, seed=1)
    calls: list[tuple[np.ndarray, list | None]] = []

    def spy(images, **kw):
        calls.append((np.asarray(images).astype(np.uint8), kw.get("points")))  # the utility folds pass floats
        return runner(images, **kw)

    gender = np.asarray(["f" if int(p[1:]) % 2 else "m" for p in people], dtype=object)
    inputs = GateInputs.from_arrays(shape=SHAPE, people=people, released=released, originals=x,
                                    clusters=np.asarray(clusters, dtype=object), labels={"gender": gender},
                                    partitions=np.asarray(["p000"] * len(x), dtype=object), deidentify=spy,
                                    points=points)
    config = GateConfig(k=K, method="k-same-m", labels=("gender",), attackers=("pca-whitened-cosine",),
                        modes=("parrot",), folds=2, repeats=1, n_components=8)
    privacy_checks(inputs, config, exact=True)
    n_parrot = len(calls)
    utility_checks(inputs, config)
    assert n_parrot >= 1 and len(calls) > n_parrot  # the parrot's gallery, then the utility folds
    of_face = {row.tobytes(): p for row, p in zip(x, points)}
    for images, got in calls:
        # Every re-run got each face's own points, in the order of the faces it re-runs.
        assert got is not None and got == [of_face[row.tobytes()] for row in images]
