"""Issue 13: a k-Same release encodes each cluster's image once and hashes what it wrote."""
from __future__ import annotations

import hashlib

import numpy as np

from deid.operations.worker_rows import IndexedRows
from deid.release.manifest import list_release
from deid.release.publish import stage_release
from deid.reporting.report import hash_tree


def _files(root):
    return sorted(hashlib.sha256(p.read_bytes()).hexdigest() for p in (root / "images").iterdir())


def test_distinct_rows_give_the_bytes_of_one_encoding_per_record_and_their_digests(tmp_path):
    rng = np.random.default_rng(0)
    table = rng.integers(0, 256, (4, 6 * 5), dtype=np.uint8)
    index = np.array([2, 0, 2, 1, 3, 0, 2, 1, 1])
    clusters = [f"c{i}" for i in index]
    labels = {"g": ["a"] * len(index)}
    shared = stage_release(tmp_path / "a", images=IndexedRows(table, index), shape=(6, 5), clusters=clusters,
                           labels=labels)
    plain = stage_release(tmp_path / "b", images=table[index], shape=(6, 5), clusters=clusters, labels=labels)
    assert _files(shared.path) == _files(plain.path) and len(_files(shared.path)) == len(index)
    listed = {a["path"]: (a["sha256"], a["bytes"]) for a in hash_tree(shared.path) if a["path"].startswith("images/")}
    assert dict(shared.images.known()) == listed
    # The digests taken as the files were written are what reading them gives.
    known, _ = list_release(shared.path, known=shared.images)
    assert known.to_table().equals(list_release(shared.path)[0].to_table())
