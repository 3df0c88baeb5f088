"""CLI exit codes come from their tables: verify's help text from VERIFY_EXIT, lineage errors by their type."""
from __future__ import annotations

import pytest

from deid.cli import EXIT_STATE, VERIFY_EXIT, build_parser, main


def test_verify_help_lists_every_code_of_the_table(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["verify", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for kind, code in VERIFY_EXIT:
        words = {"WrongKey": "wrong key", "BadSignature": "bad signature", "HashMismatch": "hash mismatch",
                 "MissingFile": "missing file", "UnlistedFile": "unlisted file"}[kind.__name__]
        assert f"{code} {words}" in text


def test_a_lineage_error_exits_as_stored_state(monkeypatch, tmp_path, capsys):
    import deid.release.lineage as lineage
    import deid.release.lineage_registry as registry
    import deid.release.linkage as linkage

    class Stored:
        where = tmp_path

        def exists(self):
            return True

        def load(self):
            return None

    def corrupt(*_, **__):
        raise lineage.LineageError("entry 2 does not authenticate")

    monkeypatch.setattr(linkage, "load_linkage_key", lambda path: b"k" * 32)
    monkeypatch.setattr(registry.Registry, "open", classmethod(lambda cls, *a, **kw: Stored()))
    monkeypatch.setattr(lineage, "describe_lineage", corrupt)
    assert main(["lineage", "ds", "--data-dir", str(tmp_path)]) == EXIT_STATE
    assert "does not authenticate" in capsys.readouterr().err
