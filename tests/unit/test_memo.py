"""deid.memo.RowStore: per-row results kept between processes (opt-in), never a failure of the computation."""
import logging

from deid.memo import RowStore

ENV = "DEID_TEST_ROW_STORE"


def test_off_without_its_variable_and_then_nothing_is_written(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    store = RowStore("rows", ENV)
    store.put_many({b"k": b"v"})
    assert store.path() is None and store.get_many([b"k"]) == {}
    assert list(tmp_path.iterdir()) == []


def test_values_come_back_for_their_keys_and_a_stored_key_keeps_its_first_value(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path / "store"))
    store = RowStore("rows", ENV)
    store.put_many({i.to_bytes(2, "big"): bytes([i % 256]) * 2 for i in range(1200)})  # more keys than one query's chunk
    store.put_many({b"\x00\x01": b"other"})
    got = store.get_many([i.to_bytes(2, "big") for i in range(0, 1200, 3)] + [b"absent"])
    assert got == {i.to_bytes(2, "big"): bytes([i % 256]) * 2 for i in range(0, 1200, 3)}
    assert RowStore("rows", ENV).get_many([b"\x00\x01"]) == {b"\x00\x01": b"\x01\x01"}  # another instance, same file
    assert RowStore("other", ENV).get_many([b"\x00\x01"]) == {}  # another computation, another file


def test_a_damaged_store_is_a_miss_with_a_warning_not_an_error(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv(ENV, str(tmp_path))
    (tmp_path / "rows.sqlite").write_bytes(b"not a database" * 100)
    store = RowStore("rows", ENV)
    with caplog.at_level(logging.WARNING, logger="deid.memo"):
        assert store.get_many([b"k"]) == {}
        store.put_many({b"k": b"v"})
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        f"row store {tmp_path / 'rows.sqlite'} not read", f"row store {tmp_path / 'rows.sqlite'} not written"]
