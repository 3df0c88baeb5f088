"""Tests of the de-identification methods behind one interface (deid.anonymise.methods)."""
from __future__ import annotations

import numpy as np
import pytest

from deid.errors import ConfigError
from deid.anonymise.methods import METHODS, blur, deidentify, guarantee, parrot_for, pixelate

SHAPE = (10, 9)


def faces(n_people=12, per_person=2, seed=0):
    rng = np.random.default_rng(seed)
    people = np.repeat(np.arange(n_people), per_person)
    protos = rng.uniform(30, 220, size=(n_people, SHAPE[0] * SHAPE[1]))
    x = protos[people] + rng.normal(scale=5, size=(len(people), protos.shape[1]))
    return np.clip(np.rint(x), 0, 255).astype(np.uint8), people


def test_pixelate_makes_constant_blocks_with_the_block_mean():
    x, _ = faces(seed=1)
    out = pixelate(x, shape=SHAPE, block=4)
    assert out.dtype == np.uint8 and out.shape == x.shape
    img, src = out[0].reshape(SHAPE), x[0].reshape(SHAPE).astype(float)
    for r0 in range(0, SHAPE[0], 4):
        for c0 in range(0, SHAPE[1], 4):  # edge blocks are 2 rows / 1 column
            block = img[r0:r0 + 4, c0:c0 + 4]
            assert (block == block.flat[0]).all()
            assert block.flat[0] == np.clip(np.rint(src[r0:r0 + 4, c0:c0 + 4].mean()), 0, 255)
    np.testing.assert_array_equal(pixelate(x, shape=SHAPE, block=1), x)


def test_blur_smooths_and_keeps_constant_images():
    x, _ = faces(seed=2)
    out = blur(x, shape=SHAPE, sigma=2.0)
    assert out.dtype == np.uint8 and out.shape == x.shape
    assert out.astype(float).std(axis=1).mean() < 0.6 * x.astype(float).std(axis=1).mean()
    flat = np.full((2, 90), 77, dtype=np.uint8)
    np.testing.assert_array_equal(blur(flat, shape=SHAPE, sigma=3), flat)


def test_ksame_methods_count_people_or_images():
    x, people = faces(n_people=12, per_person=3, seed=3)
    partitions = np.where(people < 6, "f", "m")
    for method in ("k-same", "k-same-select", "k-same-naive"):
        released, clusters = deidentify(x, shape=SHAPE, people=people, partitions=partitions, method=method, k=3,
                                        n_components=10)
        assert released.dtype == np.uint8 and released.shape == x.shape
        for c in np.unique(clusters):
            members = clusters == c
            assert (released[members] == released[members][0]).all()  # one average per cluster
            if method == "k-same-naive":
                assert members.sum() >= 3
            else:
                assert len(set(people[members])) >= 3
            if method == "k-same-select":
                assert len(set(partitions[members])) == 1


def test_parrot_reproduces_the_method_on_the_same_faces():
    x, people = faces(seed=4)
    partitions = np.where(people % 2 == 0, "a", "b")
    for method, kw in (("blur", {"sigma": 1.5}), ("pixelate", {"block": 3}), ("k-same", {"k": 2}),
                       ("k-same-select", {"k": 2}), ("k-same-naive", {"k": 2})):
        released, _ = deidentify(x, shape=SHAPE, people=people, partitions=partitions, method=method, **kw)
        parrot = parrot_for(method, shape=SHAPE, people=people, partitions=partitions, **kw)
        np.testing.assert_array_equal(parrot(x), released)


def test_guarantee_statements():
    assert guarantee("k-same-select", 5).startswith("formal: 1/k = 1/5")
    assert guarantee("k-same", 3).startswith("formal")
    for method in ("blur", "pixelate", "k-same-naive"):
        assert guarantee(method, 5).startswith("no formal guarantee")
    assert {"k-same-select", "k-same", "k-same-naive", "blur", "pixelate"} <= set(METHODS)
    for method in ("k-same-eigen", "k-same-m"):
        assert guarantee(method, 5).startswith("formal: 1/k = 1/5")


def test_registry_is_the_one_source_of_the_method_facts():
    from typing import get_args

    from deid.anonymise.methods import FEATURE_ONLY, K_METHODS, REGISTRY, STRENGTH
    from deid.run_config import RunConfig
    from deid.settings import Method, Settings
    from deid.cli import build_parser

    run = build_parser()._subparsers._group_actions[0].choices["run"]
    cli_methods = next(a.choices for a in run._actions if a.dest == "method")
    assert set(get_args(Method)) == set(METHODS) == set(REGISTRY) == set(STRENGTH)
    assert set(cli_methods) == set(REGISTRY) | set(FEATURE_ONLY)  # feature drops add their controls
    assert {m for m in METHODS if STRENGTH[m] == "k"} == set(K_METHODS)
    selecting = {m for m in METHODS if RunConfig.resolve(Settings(), method=m).select(["gender"])}
    assert selecting == {m for m in METHODS if REGISTRY[m].partitions_by_labels} and "k-same-select" in selecting
    for spec in REGISTRY.values():  # identical images and label partitions only make sense with clusters
        assert spec.clustered or not (spec.identical_within_cluster or spec.partitions_by_labels)


def test_method_errors_name_the_parameter():
    x, people = faces(seed=5)
    with pytest.raises(ConfigError, match="method='median'"):
        deidentify(x, shape=SHAPE, people=people, method="median", k=2)
    with pytest.raises(ConfigError, match="needs sigma"):
        deidentify(x, shape=SHAPE, people=people, method="blur")
    with pytest.raises(ConfigError, match="sigma=-1"):
        blur(x, shape=SHAPE, sigma=-1)
    with pytest.raises(ConfigError, match="block=0"):
        pixelate(x, shape=SHAPE, block=0)
    with pytest.raises(ConfigError, match="partitions"):
        deidentify(x, shape=SHAPE, people=people, method="k-same-select", k=2)
    with pytest.raises(ConfigError, match="shape="):
        deidentify(x, shape=(9, 9), people=people, method="blur", sigma=1)
    with pytest.raises(ConfigError, match="needs people"):
        parrot_for("k-same", shape=SHAPE, k=2)
    with pytest.raises(ConfigError, match="k=1"):
        deidentify(x, shape=SHAPE, people=people, method="k-same", k=1)
