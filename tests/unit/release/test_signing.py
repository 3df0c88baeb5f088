"""Keys, canonical JSON and signatures (deid.release.signing)."""
from __future__ import annotations

import json
import math
import os
import random
import stat

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given, settings
from hypothesis import strategies as st

from deid.errors import ConfigError, StateError
from deid.release.signing import (
    canonical_json,
    ensure_signing_key,
    generate_private_key,
    load_private_key,
    load_public_key,
    public_key_fingerprint,
    sign_bytes,
    verify_bytes,
    write_keypair,
)

# JSON values: finite floats only, string keys.
json_scalars = st.none() | st.booleans() | st.integers(-(2**60), 2**60) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=5),
    max_leaves=25,
)


def _shuffled(obj, rng: random.Random):
    """Same value, every dict rebuilt with its keys in a random insertion order."""
    if isinstance(obj, dict):
        items = list(obj.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(obj, list):
        return [_shuffled(v, rng) for v in obj]
    return obj


@settings(max_examples=150, deadline=None)
@given(value=st.dictionaries(st.text(max_size=6), json_values, max_size=6), seed=st.integers(0, 2**32 - 1))
def test_canonical_json_is_stable_under_key_order(value, seed):
    permuted = _shuffled(value, random.Random(seed))
    assert canonical_json(permuted) == canonical_json(value)
    # and it round-trips to an equal value
    assert json.loads(canonical_json(value).decode("utf-8")) == value


def test_canonical_json_exact_bytes():
    obj = {"b": 1, "a": [1.5, None, True], "é": "ü"}
    assert canonical_json(obj) == '{"a":[1.5,null,true],"b":1,"é":"ü"}'.encode("utf-8")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_canonical_json_rejects_non_finite(bad):
    with pytest.raises(ValueError, match="finite"):
        canonical_json({"rate": bad})


def test_sign_and_verify_bytes():
    key = generate_private_key()
    sig = sign_bytes(b"payload", key)
    assert len(sig) == 64
    assert verify_bytes(b"payload", sig, key.public_key())
    assert not verify_bytes(b"payloaD", sig, key.public_key())
    assert not verify_bytes(b"payload", sig, generate_private_key().public_key())
    assert not verify_bytes(b"payload", sig[:-1], key.public_key())


def test_fingerprint_is_sha256_of_raw_public_key():
    import hashlib

    key = generate_private_key().public_key()
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert len(raw) == 32
    assert public_key_fingerprint(key) == "sha256:" + hashlib.sha256(raw).hexdigest()


def test_write_keypair_modes_and_roundtrip(tmp_path):
    priv, pub = write_keypair(tmp_path, name="k1")
    assert priv == tmp_path / "k1.pem" and pub == tmp_path / "k1.pub.pem"
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    # (The PEM label is split so that secret scanners do not mistake this test for a key.)
    assert priv.read_bytes().startswith(b"-----BEGIN " + b"PRIVATE KEY-----")
    assert b"BEGIN PUBLIC KEY" in pub.read_bytes()
    private_key = load_private_key(priv)
    public_key = load_public_key(pub)
    assert public_key_fingerprint(private_key.public_key()) == public_key_fingerprint(public_key)
    assert verify_bytes(b"x", sign_bytes(b"x", private_key), public_key)


def test_write_keypair_refuses_overwrite(tmp_path):
    priv, _ = write_keypair(tmp_path, name="k")
    before = priv.read_bytes()
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        write_keypair(tmp_path, name="k")
    assert priv.read_bytes() == before
    # a lone public key also blocks, and no private key is left behind
    (tmp_path / "other.pub.pem").write_bytes(b"x")
    with pytest.raises(ConfigError, match="other.pub.pem"):
        write_keypair(tmp_path, name="other")
    assert not (tmp_path / "other.pem").exists()


def test_key_readable_by_others_is_refused(tmp_path):
    priv, _ = write_keypair(tmp_path)
    os.chmod(priv, 0o644)
    with pytest.raises(ConfigError) as err:
        load_private_key(priv)
    msg = str(err.value)
    assert str(priv) in msg and "0644" in msg and f"chmod 600 {priv}" in msg
    os.chmod(priv, 0o600)
    load_private_key(priv)


def test_passphrase_protected_key_roundtrips(tmp_path):
    priv, pub = write_keypair(tmp_path, passphrase=b"correct horse")
    assert b"BEGIN ENCRYPTED PRIVATE KEY" in priv.read_bytes()
    key = load_private_key(priv, passphrase=b"correct horse")
    assert public_key_fingerprint(key.public_key()) == public_key_fingerprint(load_public_key(pub))
    with pytest.raises(ConfigError, match="wrong passphrase"):
        load_private_key(priv, passphrase=b"wrong")
    with pytest.raises(ConfigError, match="no passphrase was given"):
        load_private_key(priv)


def test_missing_and_foreign_keys_are_clear_errors(tmp_path):
    # Issue 29 item 10: what to do, as a command (`deid keygen`), never a Python function to call.
    with pytest.raises(ConfigError, match="does not exist") as missing:
        load_private_key(tmp_path / "nope.pem")
    assert "`deid keygen --out DIR`" in str(missing.value) and "write_keypair" not in str(missing.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_public_key(tmp_path / "nope.pub.pem")
    ec_key = ec.generate_private_key(ec.SECP256R1())
    p = tmp_path / "ec.pem"
    p.write_bytes(ec_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    os.chmod(p, 0o600)
    with pytest.raises(ConfigError, match="not Ed25519"):
        load_private_key(p)
    junk = tmp_path / "junk.pem"
    junk.write_bytes(b"not a key")
    os.chmod(junk, 0o600)
    with pytest.raises(ConfigError, match="not a readable PEM"):
        load_private_key(junk)


def test_ensure_signing_key_development_is_created_once(tmp_path):
    keys_dir = tmp_path / "keys"
    first = ensure_signing_key(configured=None, keys_dir=keys_dir)
    assert first.origin == "development"
    assert first.path == keys_dir / "dev_signing.pem"
    assert first.public_path == keys_dir / "dev_signing.pub.pem"
    assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(first.path.stat().st_mode) == 0o600
    second = ensure_signing_key(configured=None, keys_dir=keys_dir)
    assert second.fingerprint == first.fingerprint


def test_development_key_warning_once_per_process_and_key(tmp_path, caplog):
    """Issue 29 item 10: a run looks the key up more than once; one warning, naming `deid keygen`."""
    import logging

    from deid.release import signing

    keys_dir = tmp_path / "keys"
    with caplog.at_level(logging.WARNING, logger="deid.release.signing"):
        for _ in range(3):
            ensure_signing_key(configured=None, keys_dir=keys_dir)
        signing.warn_development_key(keys_dir / "dev_signing.pem")
    warned = [r.getMessage() for r in caplog.records if "development key" in r.getMessage()]
    assert len(warned) == 1 and "`deid keygen --out DIR`" in warned[0], warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deid.release.signing"):
        ensure_signing_key(configured=None, keys_dir=tmp_path / "other")  # another key: its own warning
    assert sum("development key" in r.getMessage() for r in caplog.records) == 1


def test_ensure_signing_key_configured(tmp_path):
    priv, pub = write_keypair(tmp_path, name="prod", passphrase=b"pw")
    sk = ensure_signing_key(configured=priv, keys_dir=tmp_path / "unused", passphrase_env_value=b"pw")
    assert sk.origin == "configured" and sk.path == priv and sk.public_path == pub
    assert sk.fingerprint == public_key_fingerprint(load_public_key(pub))
    assert not (tmp_path / "unused").exists()
    # without the .pub.pem the public key is derived
    pub.unlink()
    sk2 = ensure_signing_key(configured=priv, keys_dir=tmp_path / "unused", passphrase_env_value=b"pw")
    assert sk2.public_path is None and sk2.fingerprint == sk.fingerprint
    # a stale .pub.pem of another key is refused
    other_priv, other_pub = write_keypair(tmp_path, name="other")
    other_pub.rename(pub)
    with pytest.raises(StateError, match="does not belong"):
        ensure_signing_key(configured=priv, keys_dir=tmp_path / "unused", passphrase_env_value=b"pw")
