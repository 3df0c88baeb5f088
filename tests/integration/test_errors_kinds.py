"""Errors by kind: bad configuration, bad input data and inconsistent stored state raise their own types,
and the CLI's exit code follows from the type alone (deid.cli.EXIT_BY_TYPE), never from the message."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from deid.cli import EXIT_BAD_INPUT, EXIT_STATE, exit_code_for, main
from deid.errors import ConfigError, DataError, DeidError, DropError, StateError


def _drop(tmp_path: Path, manifest: str | None = "image,subject_id,gender\na.png,p1,f\n",
          yaml: str | None = None) -> Path:
    drop = tmp_path / "drop"
    drop.mkdir()
    if manifest is not None:
        (drop / "manifest.csv").write_text(manifest, encoding="utf-8")
    if yaml is not None:
        (drop / "drop.yaml").write_text(yaml, encoding="utf-8")
    return drop


def _settings(tmp_path: Path):
    from deid.settings import Settings

    return Settings(project_dir=tmp_path / "project")


# --- configuration: settings, CLI options, parameters
def _k_is_one(tmp_path, monkeypatch):
    from deid.run_config import RunConfig

    RunConfig.resolve(_settings(tmp_path), k=1)


def _mistyped_method(tmp_path, monkeypatch):
    from deid.run_config import RunConfig

    RunConfig.resolve(_settings(tmp_path), method="k-same-slect")


def _bad_setting(tmp_path, monkeypatch):
    from deid.cli import _settings as cli_settings

    monkeypatch.setenv("DEID_K", "five")
    cli_settings()


def _bad_gate_setting(tmp_path, monkeypatch):
    from deid.evaluation.gate_types import GateConfig

    GateConfig.from_settings(_settings(tmp_path), k=5, method="k-same", confidence=0.2)


# --- input data: the drop's manifest, files, labels, vectors
def _no_manifest(tmp_path, monkeypatch):
    from deid.intake.drop import read_drop

    read_drop(_drop(tmp_path, manifest=None))


def _mistyped_label(tmp_path, monkeypatch):
    from deid.intake.drop import read_drop

    read_drop(_drop(tmp_path), labels=["gendr"])


def _drop_yaml_not_yaml(tmp_path, monkeypatch):
    from deid.intake.drop import read_drop

    read_drop(_drop(tmp_path, yaml="name: [unclosed\n"))


def _sequence_of_two_people(tmp_path, monkeypatch):
    from deid.anonymise.sequences import check_sequences

    check_sequences(["s1", "s1"], [0, 1], people=["p", "q"], n=2)


def _vectors_with_nan(tmp_path, monkeypatch):
    import numpy as np

    from deid.anonymise.features import deidentify_vectors

    X = np.ones((4, 3))
    X[1, 2] = np.nan
    deidentify_vectors(X, people=["a", "b", "c", "d"], method="k-same", k=2)


def _card_without_header(tmp_path, monkeypatch):
    from deid.release.card import split_card

    split_card("# a dataset card without its YAML header\n")


# --- stored state: keys present but inconsistent, staging, ledger, the report the run built
def _stale_public_key(tmp_path, monkeypatch):
    from deid.release.signing import ensure_signing_key, write_keypair

    keys = tmp_path / "keys"
    write_keypair(keys, name="dev_signing")
    write_keypair(tmp_path / "other", name="dev_signing")
    os.replace(tmp_path / "other" / "dev_signing.pub.pem", keys / "dev_signing.pub.pem")
    ensure_signing_key(configured=None, keys_dir=keys)


def _symlink_in_staged_release(tmp_path, monkeypatch):
    from deid.reporting.report import hash_tree

    (tmp_path / "real.txt").write_text("x")
    release = tmp_path / "release"
    release.mkdir()
    os.symlink(tmp_path / "real.txt", release / "link.txt")
    hash_tree(release)


def _report_the_schema_refuses(tmp_path, monkeypatch):
    from deid.reporting.report import validate_report

    validate_report({"release_id": "rel-1"})


def _ledger_entry_not_claimed(tmp_path, monkeypatch):
    from deid.operations.ledger import Ledger

    led = Ledger(tmp_path / "ledger.sqlite")
    led.sight("/in/a", "sha256:aa")
    led.finish("sha256:aa", by="run-1", release_id="rel-1", verdict="released", report="r")


@pytest.mark.parametrize("make, kind, code", [
    (_k_is_one, ConfigError, EXIT_BAD_INPUT),
    (_mistyped_method, ConfigError, EXIT_BAD_INPUT),
    (_bad_setting, ConfigError, EXIT_BAD_INPUT),
    (_bad_gate_setting, ConfigError, EXIT_BAD_INPUT),
    (_no_manifest, DropError, EXIT_BAD_INPUT),
    (_mistyped_label, DropError, EXIT_BAD_INPUT),
    (_drop_yaml_not_yaml, DropError, EXIT_BAD_INPUT),
    (_sequence_of_two_people, DataError, EXIT_BAD_INPUT),
    (_vectors_with_nan, DataError, EXIT_BAD_INPUT),
    (_card_without_header, DataError, EXIT_BAD_INPUT),
    (_stale_public_key, StateError, EXIT_STATE),
    (_symlink_in_staged_release, StateError, EXIT_STATE),
    (_report_the_schema_refuses, StateError, EXIT_STATE),
    (_ledger_entry_not_claimed, StateError, EXIT_STATE),
], ids=lambda v: v.__name__.strip("_") if callable(v) and not isinstance(v, type) else None)
def test_each_bad_input_raises_its_kind_and_maps_to_its_exit_code(tmp_path, monkeypatch, make, kind, code):
    with pytest.raises(DeidError) as err:
        make(tmp_path, monkeypatch)
    assert type(err.value) is kind, f"{type(err.value).__name__}: {err.value}"
    # The kinds do not overlap: data is never configuration, state never data.
    base = DataError if issubclass(kind, DataError) else kind
    assert not isinstance(err.value, tuple({ConfigError, DataError, StateError} - {base}))
    assert exit_code_for(err.value) == code
    assert len(str(err.value).splitlines()) == 1  # one line for the steward


def test_run_on_a_file_or_nothing_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "manifest.csv").write_text("image,subject_id\n")
    for target, says in ((tmp_path / "manifest.csv", "is a file; give the drop directory"),
                         (tmp_path / "absent", "does not exist or is not a directory")):
        assert main(["run", str(target)]) == EXIT_BAD_INPUT
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("deid run: ") and says in err[0], err


def test_run_with_inconsistent_keys_is_a_state_error_before_any_work(tmp_path, monkeypatch, capsys):
    from deid.release.signing import write_keypair

    project = tmp_path / "project"
    keys = project / "data" / "keys"
    write_keypair(keys, name="dev_signing")
    (keys / "dev_signing.pem").unlink()  # a public key left without its private key
    monkeypatch.setenv("DEID_PROJECT_DIR", str(project))
    drop = _drop(tmp_path)
    assert main(["run", str(drop), "--k", "3"]) == EXIT_STATE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("deid run: error: ") and "without its private key" in err[0], err
    assert not list(project.rglob("report.json"))  # refused before the run started: nothing signed
