"""k-Same-Eigen and model-based k-Same-M (deid.anonymise.methods_ksame) on synthetic ground truth."""
from __future__ import annotations

import cv2
import numpy as np
import pytest

from deid.errors import ConfigError
from deid.alignment.features import Eigenfaces
from deid.anonymise.methods import deidentify, parrot_for
from deid.anonymise.methods_ksame import KSameEigen, KSameM, model_average, sharpness

SHAPE = (40, 36)


def textured(rng, shape=SHAPE):
    """A smooth random texture with edges (blurred noise, contrast-stretched)."""
    t = cv2.GaussianBlur(rng.normal(size=shape).astype(np.float32), (0, 0), 1.5)
    return 128 + 90 * t / np.abs(t).max()


def misaligned_faces(n_people=12, per_person=2, max_shift=3.0, seed=0):
    """One shared 'face' texture, shifted at random per image, plus a smooth per-person shading.

    The shading (a brightness ramp, invisible to the Laplacian) dominates eigenface distances,
    so clusters group people, not shifts: pixel averages then ghost, as on real faces.
    """
    rng = np.random.default_rng(seed)
    base = textured(rng)
    people = np.repeat(np.arange(n_people), per_person)
    gy, gx = np.mgrid[0:SHAPE[0], 0:SHAPE[1]] / np.array(SHAPE).reshape(2, 1, 1)
    shading = [a * (np.cos(t) * gx + np.sin(t) * gy - 0.5) for a, t in
               zip(rng.uniform(20, 40, n_people), rng.uniform(0, 2 * np.pi, n_people))]
    out = []
    for p in people:
        dx, dy = rng.uniform(-max_shift, max_shift, size=2)
        m = np.float32([[1, 0, dx], [0, 1, dy]])
        out.append(cv2.warpAffine(base.astype(np.float32), m, SHAPE[::-1], borderMode=cv2.BORDER_REFLECT) + shading[p])
    return np.clip(np.rint(np.array(out)), 0, 255).astype(np.uint8).reshape(len(people), -1), people


def assert_k_structure(released, clusters, people, k):
    for c in np.unique(clusters):
        members = clusters == c
        assert (released[members] == released[members][0]).all()  # the k-Same structure: identical images
        assert len(set(np.asarray(people)[members])) >= k


def test_ksame_eigen_is_the_pca_reconstruction_of_the_cluster_mean_coefficients():
    x, people = misaligned_faces(seed=1)
    released, clusters = deidentify(x, shape=SHAPE, people=people, method="k-same-eigen", k=3, n_components=10)
    assert_k_structure(released, clusters, people, 3)
    # Independent ground truth: same eigenfaces, mean coefficients per cluster, reconstruct.
    e = Eigenfaces(10, random_state=0).fit(x)
    z = e.transform(x).astype(np.float64)
    for c in np.unique(clusters):
        want = e.mean_ + z[clusters == c].mean(axis=0) @ e.components_.astype(np.float64)
        assert np.abs(released[clusters == c][0].astype(float) - np.clip(want, 0, 255)).max() <= 0.5 + 1e-3
    # Same clusters as pixel k-Same (both cluster on the same coefficients).
    _, pixel_clusters = deidentify(x, shape=SHAPE, people=people, method="k-same", k=3, n_components=10)
    np.testing.assert_array_equal(clusters, pixel_clusters)


def test_model_average_undoes_translation_where_the_pixel_mean_ghosts():
    rng = np.random.default_rng(2)
    face = textured(rng).astype(np.float32)
    shifted = np.stack([cv2.warpAffine(face, np.float32([[1, 0, dx], [0, 1, dy]]), SHAPE[::-1],
                                       borderMode=cv2.BORDER_REFLECT) for dx, dy in ((-2, 1), (2, -1), (0, 2), (1, -2))])
    avg = model_average(shifted)
    inner = (slice(6, -6), slice(6, -6))
    pixel = shifted.mean(axis=0)
    lap = lambda a: cv2.Laplacian(a.astype(np.float64), cv2.CV_64F)[inner].var()  # noqa: E731
    assert lap(avg) > 2 * lap(pixel)
    assert lap(avg) > 0.5 * lap(face)


def test_ksame_m_members_share_one_image_sharper_than_pixel_ksame():
    x, people = misaligned_faces(seed=3)
    released, clusters = deidentify(x, shape=SHAPE, people=people, method="k-same-m", k=3, n_components=10)
    assert_k_structure(released, clusters, people, 3)
    pixel, pixel_clusters = deidentify(x, shape=SHAPE, people=people, method="k-same", k=3, n_components=10)
    np.testing.assert_array_equal(clusters, pixel_clusters)
    first = np.unique(clusters, return_index=True)[1]
    s_m, s_px = sharpness(released[first], shape=SHAPE), sharpness(pixel[first], shape=SHAPE)
    s_src = np.array([sharpness(x[clusters == c], shape=SHAPE).mean() for c in clusters[first]])
    assert np.median(s_m / s_px) > 1.3, (s_m, s_px)  # measured 1.53
    assert np.median(s_m / s_src) > 0.85, (s_m, s_src)  # nearly as sharp as the members themselves
    dis, _ = deidentify(x, shape=SHAPE, people=people, method="k-same-m", k=3, n_components=10,
                        options={"flow": "dis"})
    assert np.median(sharpness(dis[first], shape=SHAPE) / s_px) > 1.3


def test_ksame_family_parrots_and_errors():
    x, people = misaligned_faces(n_people=8, seed=4)
    for method in ("k-same-eigen", "k-same-m"):
        released, _ = deidentify(x, shape=SHAPE, people=people, method=method, k=2, n_components=8)
        np.testing.assert_array_equal(parrot_for(method, shape=SHAPE, people=people, k=2, n_components=8)(x), released)
    with pytest.raises(ConfigError, match="k=1"):
        KSameEigen(1).fit(x, people=people)
    with pytest.raises(ConfigError, match="flow='lk'"):
        KSameM(2, shape=SHAPE, flow="lk").fit(x, people=people)
    with pytest.raises(ConfigError, match="n_iter=0"):
        KSameM(2, shape=SHAPE, n_iter=0).fit(x, people=people)
    with pytest.raises(ConfigError, match="shape="):
        KSameM(2, shape=(10, 10)).fit(x, people=people)
    with pytest.raises(ConfigError, match="options="):
        deidentify(x, shape=SHAPE, people=people, method="k-same-m", k=2, options={"warp": 1})


def test_partitioned_runs_stay_inside_their_partition():
    from deid.anonymise.methods import REGISTRY

    x, people = misaligned_faces(n_people=12, seed=5)
    parts = np.where(people < 6, "a", "b")
    for method in ("k-same-eigen", "k-same-m"):
        released, clusters = deidentify(x, shape=SHAPE, people=people, partitions=parts, method=method, k=3,
                                        n_components=6)
        assert_k_structure(released, clusters, people, 3)
        assert REGISTRY[method].partitions_by_labels  # (the test's subject: never skip what follows)
        assert all(len(set(parts[clusters == c])) == 1 for c in np.unique(clusters))
        alone, _ = deidentify(x[parts == "b"], shape=SHAPE, people=people[parts == "b"], method=method, k=3,
                              n_components=6)
        np.testing.assert_array_equal(released[parts == "b"], alone)
        parrot = parrot_for(method, shape=SHAPE, people=people, partitions=parts, k=3, n_components=6)
        np.testing.assert_array_equal(parrot(x), released)
