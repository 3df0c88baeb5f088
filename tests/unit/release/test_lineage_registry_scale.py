"""Issue 13: appending to the lineage registry does not decrypt and replay every entry again."""
from __future__ import annotations

import dataclasses

import numpy as np

from deid.release import lineage_registry as lr
from deid.release.lineage_state import replay
from integration.release.test_lineage import _two_releases


def _same_state(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "clusters":
            assert x.keys() == y.keys()
            for key in x:
                assert np.array_equal(x[key].image, y[key].image) and x[key].members == y[key].members
        else:
            assert x == y, f.name


def test_appends_equal_a_full_replay_and_skip_reloading_an_unchanged_registry(tmp_path, monkeypatch):
    w, reg, s2 = _two_releases(tmp_path)  # rel-a published, rel-b pending
    loads = []
    monkeypatch.setattr(lr.Registry, "load", lambda self, _load=lr.Registry.load: loads.append(1) or _load(self))
    s3 = reg.mark_published(s2, "rel-b")  # the state is the registry's: no reload
    assert loads == []
    _same_state(s3, replay(s3.dataset, s3.entries, seq=s3.seq, head=s3.head, images=s3.images))
    _same_state(s3, reg.load())
    assert [r.status for r in s3.releases] == ["published", "published"]


def test_a_registry_that_moved_on_is_reloaded_and_refused(tmp_path):
    import pytest

    w, reg, s2 = _two_releases(tmp_path)
    reg.mark_published(s2, "rel-b")
    with pytest.raises(lr.LineageError, match="moved on"):
        reg.mark_abandoned(s2, "rel-b")  # s2 is one entry behind the registry


def test_an_entry_sealed_in_one_buffer_is_the_one_shot_aes_gcm_blob(tmp_path):
    """issue 13: the streaming seal writes exactly ``magic + nonce + AESGCM.encrypt(...)`` and opens as before."""
    import secrets

    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from deid.release.lineage_state import chain_hash, derive_key

    reg = lr.Registry(tmp_path / "reg", key=bytes(range(32)), dataset="ds")
    for n in (0, 1, 15, 16, 17, 4096, 100_003):
        payload = secrets.token_bytes(n)
        blob = reg._seal(lr.MAGIC, "encrypt", 7, payload)
        nonce = bytes(blob[len(lr.MAGIC):len(lr.MAGIC) + lr.NONCE_BYTES])
        want = lr.MAGIC + nonce + AESGCM(derive_key(reg.key, "ds", "encrypt")).encrypt(
            nonce, payload, reg._aad(lr.MAGIC, 7))
        assert bytes(blob) == want
        assert reg._open(lr.MAGIC, "encrypt", 7, bytes(blob), "entry") == payload
    # The chain hash of an entry, fed to SHA-256 in two parts: the hash of the concatenation.
    import hashlib

    prev = "ab" * 32
    assert chain_hash(prev, b"{}") == hashlib.sha256(bytes.fromhex(prev) + b"{}").hexdigest()


def test_an_entry_in_pieces_is_its_canonical_bytes_and_seals_to_the_one_shot_blob(tmp_path):
    """issue 32: the canonical JSON encoded a slice of a long list at a time is the one-piece encoding, byte for
    byte, and the pieces sealed one after the other are ``magic + nonce + AESGCM.encrypt(...)`` of their join."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from deid.release.lineage_state import canonical_bytes, canonical_pieces, chain_hash, derive_key

    w, reg, s2 = _two_releases(tmp_path)
    odd = {"kind": "release", "z": [{"b": 1.5, "a": ["é", "\u2028", "\x00", None, True]}] * 5, "empty": [],
           "a": {"y": [3, 2, 1], "x": "ü"}, "long": list(range(7)), "n": -0.0}
    for doc in (*s2.entries, odd):
        want = canonical_bytes(doc)
        for items in (1, 2, 3, 2048):
            pieces = canonical_pieces(doc, items=items)
            assert b"".join(pieces) == want, (doc.get("kind"), items)
            assert chain_hash("ab" * 32, pieces) == chain_hash("ab" * 32, want) == chain_hash("ab" * 32, doc)
    release_doc = next(d for d in s2.entries if d["kind"] == "release")
    assert len(canonical_pieces(release_doc, items=1)) >= len(release_doc["new_clusters"]) + 2 > 3
    pieces = canonical_pieces(odd, items=2)
    payload = b"".join(pieces)
    blob = reg._seal(lr.MAGIC, "encrypt", 7, pieces)
    assert pieces == []  # let go as they were sealed
    nonce = bytes(blob[len(lr.MAGIC):len(lr.MAGIC) + lr.NONCE_BYTES])
    assert bytes(blob) == lr.MAGIC + nonce + AESGCM(derive_key(reg.key, reg.dataset, "encrypt")).encrypt(
        nonce, payload, reg._aad(lr.MAGIC, 7))
    assert reg._open(lr.MAGIC, "encrypt", 7, bytes(blob), "entry") == payload
