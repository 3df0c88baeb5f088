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
    import deid.release.lineage_state as lineage
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


def test_a_run_without_a_ui_says_where_its_report_is_instead_of_a_dead_link(tmp_path):
    import logging

    from deid.orchestration.logs import FLOW_RUN_LOGGER, report_instead_of_ui
    from deid.orchestration.prefect_api import PrefectApi

    assert not PrefectApi("temporary").has_ui and not PrefectApi("prefect").has_ui
    assert PrefectApi("deid-server").has_ui
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(FLOW_RUN_LOGGER)
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        with report_instead_of_ui(tmp_path / "reports"):
            logger.info("View at %s", "http://127.0.0.1:8123/runs/flow-run/x")
            logger.info("Beginning flow run")
        logger.info("View at http://127.0.0.1:4200/runs/flow-run/y")  # a server with a UI: kept
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert "8123" not in seen[0] and f"{tmp_path / 'reports'}/<release id>/report.html" in seen[0]
    assert seen[1:] == ["Beginning flow run", "View at http://127.0.0.1:4200/runs/flow-run/y"]
