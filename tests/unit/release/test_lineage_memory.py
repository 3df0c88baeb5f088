"""Issue 13: registered averages live on disk (staging row file, sealed registry packs), read when asked.

The lineage at a million faces registers 200,000 averages (1.5 GB): the release being built keeps its
new clusters' averages in a row file next to the de-identified parts, and the registry seals them
beside its entries instead of inline. Same clusters, same images, same attack results; registries
written before still load; a modified or missing pack is refused with a clear message.
"""
from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest

from deid.operations.worker_rows import IndexedRows, RowFile
from deid.release.lineage import release_from_clusters
from deid.release.lineage_state import LineageError, StoredImage, empty_state
from deid.release.lineage_checks import check_structure
from deid.release.lineage_differencing import differencing_attack
from deid.release.lineage_registry import Registry

KEY = bytes(range(32))


def _world():
    rng = np.random.default_rng(7)
    X = rng.integers(0, 256, (40, 30), dtype=np.uint8)
    people = [f"p{i}" for i in range(40)]
    fps = [hashlib.sha256(x.tobytes()).hexdigest() for x in X]
    # release 1: {0..4}, {10..14}; release 2: {0..3, 5} (one swap), {10..15} (one added): the attack finds both
    lab1, lab2 = np.full(40, -1), np.full(40, -1)
    lab1[[0, 1, 2, 3, 4]], lab1[[10, 11, 12, 13, 14]] = 0, 1
    lab2[[0, 1, 2, 3, 5]], lab2[[10, 11, 12, 13, 14, 15]] = 0, 1
    return X, people, fps, lab1, lab2


def _images(X, lab):
    out = np.zeros_like(X)
    for c in set(lab[lab >= 0].tolist()):
        out[lab == c] = np.clip(np.rint(X[lab == c].mean(axis=0)), 0, 255).astype(np.uint8)
    return out


def _on_disk(images: np.ndarray, path) -> IndexedRows:
    """The images as lineage_new_labels gives them: each distinct row once in a RowFile, rows indexing it."""
    distinct, index = np.unique(images, axis=0, return_inverse=True)
    path.write_bytes(distinct.tobytes())
    return IndexedRows(RowFile(path, len(distinct), images.shape[1]), index.reshape(-1))


def _rel(state, X, people, fps, lab, rid, images):
    return release_from_clusters(state, people, fps, key=KEY, release_id=rid, k=5, method="k-same", labels=lab,
                                 images=images, shape=(5, 6))


def test_stored_averages_give_the_same_clusters_checks_and_attack_as_arrays(tmp_path):
    X, people, fps, lab1, lab2 = _world()
    s0 = empty_state("synthetic")
    # In memory, as before.
    r1 = _rel(s0, X, people, fps, lab1, "r1", _images(X, lab1))
    s1 = s0.with_entry(r1.to_entry())
    r2 = _rel(s1, X, people, fps, lab2, "r2", _images(X, lab2))
    ref = differencing_attack(s1, r2, X, original_people=people)
    assert not ref.passed
    # On disk: new clusters' averages in a row file, the registered ones sealed in the registry's pack.
    reg = Registry.open(tmp_path, "synthetic", KEY)
    d1 = _rel(s0, X, people, fps, lab1, "r1", _on_disk(_images(X, lab1), tmp_path / "r1.u8"))
    assert all(isinstance(c.image, StoredImage) for c in d1.new_clusters)
    t1 = reg.append_release(reg.load(), d1)
    t1 = reg.load()
    assert all(isinstance(c.image, StoredImage) for c in t1.clusters.values())
    d2 = _rel(t1, X, people, fps, lab2, "r2", _on_disk(_images(X, lab2), tmp_path / "r2.u8"))
    for a, b in zip(r2.new_clusters, d2.new_clusters):
        assert a.key == b.key and a.members == b.members and np.array_equal(a.image, np.asarray(b.image))
        assert a.image_sha256 == b.image_sha256
    for key, c in s1.clusters.items():
        assert np.array_equal(c.image, np.asarray(t1.clusters[key].image))
    assert differencing_attack(t1, d2, X, original_people=people) == ref
    assert [c.to_dict() for c in check_structure(t1, d2)] == [c.to_dict() for c in check_structure(s1, r2)]
    # A stored average crosses to another process as a reference (the gate helper), not as pixels.
    back = pickle.loads(pickle.dumps(t1.clusters["r1/00000"].image))
    assert np.array_equal(np.asarray(back), s1.clusters["r1/00000"].image)


def test_a_registry_with_inline_averages_still_loads_and_takes_sealed_ones_after(tmp_path):
    X, people, fps, lab1, lab2 = _world()
    reg = Registry.open(tmp_path, "synthetic", KEY)
    r1 = _rel(reg.load(), X, people, fps, lab1, "r1", _images(X, lab1))
    state = reg._append(reg.init(), r1.to_entry())   # as deid wrote it before: the averages inline (base64)
    assert not (reg.root / "images").exists()
    old = reg.load()
    assert all(isinstance(c.image, np.ndarray) for c in old.clusters.values())
    r2 = _rel(old, X, people, fps, lab2, "r2", _images(X, lab2))
    r2 = type(r2)(**{**r2.__dict__, "new_clusters": tuple(c for c in r2.new_clusters if c.key == "r2/00001")})
    reg.append_release(state, r2)
    both = reg.load()
    assert isinstance(both.clusters["r1/00000"].image, np.ndarray)
    assert isinstance(both.clusters["r2/00001"].image, StoredImage)
    assert np.array_equal(np.asarray(both.clusters["r2/00001"].image), _images(X, lab2)[10])


@pytest.mark.parametrize("tamper", ["flip", "missing"])
def test_a_modified_or_missing_pack_is_refused(tmp_path, tamper):
    X, people, fps, lab1, _ = _world()
    reg = Registry.open(tmp_path, "synthetic", KEY)
    reg.append_release(reg.load(), _rel(reg.load(), X, people, fps, lab1, "r1", _images(X, lab1)))
    (pack,) = (reg.root / "images").iterdir()
    if tamper == "flip":
        data = bytearray(pack.read_bytes())
        data[-3] ^= 0x01
        pack.write_bytes(bytes(data))
    else:
        pack.unlink()
    state = reg.load()   # the entries are intact: the averages are read (and checked) when asked
    msg = "does not authenticate" if tamper == "flip" else "images/ directory"
    with pytest.raises(LineageError, match=msg):
        np.asarray(state.clusters["r1/00001"].image)


def test_new_records_get_their_cluster_numbered_in_record_order_and_their_image_from_disk(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from deid.operations.worker_lineage import lineage_new_labels

    rng = np.random.default_rng(3)
    ids = [f"r{i:04d}" for i in range(60)]
    new = sorted(rng.choice(60, 45, replace=False).tolist())   # records of new people, in drop order
    shade = {c: rng.integers(0, 256, 6, dtype=np.uint8) for c in "abcdefg"}
    parts = []
    for n, chunk in enumerate(np.array_split(rng.permutation(new)[:40], 2)):   # 5 new records withheld
        rows = [ids[i] for i in chunk]
        cl = [f"p{n}-{'abcdefg'[rng.integers(0, 7)]}" for _ in rows]
        pq.write_table(pa.table({"record_id": rows, "cluster": cl,
                                 "pixels": [shade[c[-1]].tobytes() for c in cl]}), tmp_path / f"p{n}.parquet")
        parts.append(str(tmp_path / f"p{n}.parquet"))
    plan = type("Plan", (), {"new_records": tuple(new)})()
    labels, images = lineage_new_labels(plan, ids, parts)
    # Reference: the earlier per-record loop.
    where = {}
    for p in parts:
        t = pq.read_table(p).to_pydict()
        where.update({r: (c, px) for r, c, px in zip(t["record_id"], t["cluster"], t["pixels"])})
    names: dict = {}
    want = [names.setdefault(where[ids[i]][0], len(names)) if ids[i] in where else -1 for i in new]
    assert labels.tolist() == want and (labels == -1).sum() == 5
    for j, i in enumerate(new):
        px = np.frombuffer(where[ids[i]][1], np.uint8) if ids[i] in where else np.zeros(6, np.uint8)
        assert np.array_equal(images[j], px)
    assert isinstance(images.stored_image(int(np.flatnonzero(labels >= 0)[0])), StoredImage)
