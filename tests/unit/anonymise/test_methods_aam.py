"""k-Same-M on a fitted shape and appearance model (deid.anonymise.methods_aam), on small synthetic ground truth."""
from __future__ import annotations

import cv2
import numpy as np
import pytest
from method_checks import check_claimed_structure

from deid.anonymise.methods import deidentify, parrot_for
from deid.anonymise.methods_aam import KSameAAM, fit_appearance_model, fit_pca, flow_shapes
from deid.errors import ConfigError

SHAPE = (32, 28)


def texture(rng, shape=SHAPE):
    """A smooth random texture with edges (blurred noise, contrast-stretched), float32."""
    t = cv2.GaussianBlur(rng.normal(size=shape).astype(np.float32), (0, 0), 1.5)
    return (128 + 90 * t / np.abs(t).max()).astype(np.float32)


def landmarks(shape=SHAPE):
    """A 4 x 3 grid of landmarks inside the frame (x, y)."""
    h, w = shape
    gx, gy = np.meshgrid(np.linspace(6, w - 7, 3), np.linspace(6, h - 7, 4))
    return np.column_stack([gx.ravel(), gy.ravel()])


def moved_faces(n_people=8, per_person=2, seed=0):
    """One texture per person, each image shifted and scaled at random; the landmarks move with it."""
    rng = np.random.default_rng(seed)
    bases = [texture(rng) for _ in range(n_people)]
    people = np.repeat(np.arange(n_people), per_person)
    pts0 = landmarks()
    faces, points = [], []
    for p in people:
        s = rng.uniform(0.93, 1.07)
        dx, dy = rng.uniform(-2, 2, size=2)
        m = np.float32([[s, 0, dx], [0, s, dy]])
        faces.append(cv2.warpAffine(bases[p], m, SHAPE[::-1], flags=cv2.INTER_CUBIC, borderMode=cv2.BORDER_REFLECT))
        points.append(pts0 * s + [dx, dy])
    x = np.clip(np.rint(np.array(faces)), 0, 255).astype(np.uint8).reshape(len(people), -1)
    return x, people, points


def test_shape_model_recovers_known_modes():
    rng = np.random.default_rng(1)
    mean = landmarks().ravel()
    modes = np.linalg.qr(rng.normal(size=(len(mean), 2)))[0].T  # two orthonormal shape modes
    b = rng.normal(size=(300, 2)) * [3.0, 1.0]
    shapes = mean + b @ modes
    model = fit_pca(shapes, variance=0.999, max_components=10)
    assert model.n_modes == 2  # noise-free rank 2: no third mode, however small the variance asked
    assert abs(modes[0] @ model.components[0]) > 0.999 and abs(modes[1] @ model.components[1]) > 0.999
    np.testing.assert_allclose(model.variances, b.var(axis=0, ddof=1), rtol=0.05)
    np.testing.assert_allclose(model.mean, shapes.mean(axis=0))
    # Inside the AAM: the same modes from the landmark sets of faces (the appearance is fitted beside them).
    faces = np.stack([texture(rng) for _ in range(len(shapes[:40]))])
    aam = fit_appearance_model(faces, shapes[:40].reshape(40, -1, 2), variance=0.999, max_components=10)
    assert aam.shape.n_modes == 2
    sub = fit_pca(shapes[:40], variance=0.999, max_components=10)
    np.testing.assert_allclose(np.abs(aam.shape.components @ sub.components.T), np.eye(2), atol=1e-9)
    assert 0 < aam.appearance.n_modes <= 10 and aam.weight > 0


def test_fewer_modes_when_less_variance_is_asked():
    rng = np.random.default_rng(2)
    X = rng.normal(size=(50, 6)) * [10, 5, 1, 0.5, 0.1, 0.05]
    assert fit_pca(X, variance=0.7, max_components=6).n_modes == 1
    assert fit_pca(X, variance=0.999, max_components=6).n_modes >= 4
    assert fit_pca(X, variance=1.0, max_components=3).n_modes == 3
    same = fit_pca(np.tile(X[:1], (5, 1)), variance=1.0, max_components=6)
    assert same.n_modes == 0 and np.allclose(same.mean, X[0])


@pytest.mark.parametrize("with_points", [True, False])
def test_rendered_mean_of_identical_inputs_is_the_input(with_points):
    face = np.clip(np.rint(texture(np.random.default_rng(3))), 0, 255).astype(np.uint8)
    x = np.tile(face.reshape(1, -1), (6, 1))
    points = [landmarks()] * 6 if with_points else None
    model = KSameAAM(3, shape=SHAPE).fit(x, people=np.arange(6), points=points)
    released = model.fit_transform(x, people=np.arange(6), points=points)
    assert model.shape_source_ == ("points" if with_points else "flow")
    assert model.model_.combined.n_modes == 0  # nothing varies: the model is its mean
    assert np.abs(released.astype(int) - face.reshape(1, -1)).max() <= 1


def test_k_rules_identical_clusters_and_the_parrot_remakes_the_release():
    x, people, points = moved_faces(n_people=9, per_person=2, seed=4)
    k = 3
    released, clusters = deidentify(x, shape=SHAPE, people=people, method="k-same-aam", k=k, n_components=8,
                                    points=points)
    check_claimed_structure("k-same-aam", released, clusters, people, k)
    for c in np.unique(clusters):  # no person above 1/k of a cluster
        assert np.bincount(people[clusters == c]).max() * k <= (clusters == c).sum()
    assert not (released == x).all(axis=1).any()
    parrot = parrot_for("k-same-aam", shape=SHAPE, people=people, k=k, n_components=8, points=points)
    np.testing.assert_array_equal(parrot(x), released)
    # Label partitions: every cluster inside one, the parrot still remakes it.
    parts = np.where(people < 5, "a", "b")
    rel_p, cl_p = deidentify(x, shape=SHAPE, people=people, partitions=parts, method="k-same-aam", k=k,
                             n_components=8, points=points)
    check_claimed_structure("k-same-aam", rel_p, cl_p, people, k, list(parts))
    np.testing.assert_array_equal(parrot_for("k-same-aam", shape=SHAPE, people=people, partitions=parts, k=k,
                                             n_components=8, points=points)(x), rel_p)


def test_shape_source_points_or_flow_and_clusters_in_parameter_space():
    x, people, points = moved_faces(n_people=6, per_person=1, seed=5)
    m = KSameAAM(2, shape=SHAPE, n_components=6).fit(x, people=people, points=points)
    assert m.shape_source_ == "points"
    np.testing.assert_allclose(m.model_.mean_shape, np.mean(points, axis=0))
    # The clusters are KSame's on the model's combined parameters; the rendered face is the cluster mean's.
    from deid.anonymise.ksame import KSame

    np.testing.assert_array_equal(KSame(2).fit(m.parameters_, people=people, images=None).labels_, m.labels_)
    c0 = m.parameters_[m.labels_ == 0].mean(axis=0)
    np.testing.assert_allclose(m.averages_[0], m.model_.render(c0).ravel())
    mixed = [None] + points[1:]  # one face without points: a flow grid on every face
    f = KSameAAM(2, shape=SHAPE, n_components=6).fit(x, people=people, points=mixed)
    assert f.shape_source_ == "flow" and f.model_.mean_shape.shape[1] == 2
    # The flow grid follows a known shift of a face (grid step 8: 4 x 4 points on the 32 x 28 frame).
    face = texture(np.random.default_rng(6))
    shifted = cv2.warpAffine(face, np.float32([[1, 0, 1.5], [0, 1, -1.0]]), SHAPE[::-1], borderMode=cv2.BORDER_REFLECT)
    s = flow_shapes(np.stack([face, face, shifted]), n_iter=1)
    inner = (s[0, :, 0] > 6) & (s[0, :, 0] < SHAPE[1] - 7) & (s[0, :, 1] > 6) & (s[0, :, 1] < SHAPE[0] - 7)
    assert inner.any()
    np.testing.assert_allclose(np.median((s[2] - s[0])[inner], axis=0), [1.5, -1.0], atol=0.35)


def test_errors_name_the_parameter():
    x, people, _ = moved_faces(n_people=4, per_person=1, seed=7)
    for kw, match in (({"variance": 0}, "variance=0"), ({"grid_step": 1}, "grid_step=1"), ({"flow": "lk"}, "flow='lk'"),
                      ({"n_iter": 0}, "n_iter=0"), ({"n_components": 0}, "n_components=0")):
        with pytest.raises(ConfigError, match=match):
            KSameAAM(2, shape=SHAPE, **kw).fit(x, people=people)
    with pytest.raises(ConfigError, match="k=1"):
        KSameAAM(1, shape=SHAPE).fit(x, people=people)
    with pytest.raises(ConfigError, match="options="):
        deidentify(x, shape=SHAPE, people=people, method="k-same-aam", k=2, options={"warp": 1})


def test_the_partition_stage_releases_k_same_aam_and_says_where_its_shapes_came_from(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from deid.operations import worker_deidentify

    x, people, points = moved_faces(n_people=6, per_person=1, seed=8)
    for with_points in (True, False):
        root = tmp_path / f"partition-{with_points}"
        root.mkdir()
        pq.write_table(pa.table({
            "record_id": [f"r{i:03d}" for i in range(len(x))], "subject_id": [f"s{p}" for p in people],
            "features": pa.array([[0.0] * 4] * len(x), pa.list_(pa.float32())),
            "pixels": [row.tobytes() for row in x],
            "points": [p.ravel().tolist() if with_points else None for p in points]}), root / "part-0.parquet")
        part = worker_deidentify.deidentify_partition(str(root), str(tmp_path / f"out-{with_points}" / "d.parquet"), k=2,
                                           method="k-same-aam", shape=SHAPE)
        assert part.shape_sources == {"points" if with_points else "flow": len(part.clusters)}
        assert all(c.people >= 2 for c in part.clusters) and sum(c.size for c in part.clusters) == len(x)
        got = pq.read_table(part.path)
        released = np.frombuffer(b"".join(got.column("pixels").to_pylist()), np.uint8).reshape(len(x), -1)
        want, _ = deidentify(x, shape=SHAPE, people=[f"s{p}" for p in people], method="k-same-aam", k=2,
                             points=points if with_points else None)
        order = [int(r[1:]) for r in got.column("record_id").to_pylist()]
        np.testing.assert_array_equal(released, want[order])
