"""CLI exit codes: one per kind of verification failure; bad input is 2."""
import pytest

from deid.cli import EXIT_BAD_INPUT, main, verify_exit_code


@pytest.mark.parametrize("problems, code", [
    (["bad signature: report.json.sig does not match"], 3),
    (["wrong key: report names signer sha256:a, the given public key is sha256:b"], 4),
    (["missing file images/x.png"], 5),
    (["hash mismatch images/x.png: sha256 ..."], 6),
    (["extra unlisted file images/y.png"], 7),
    (["extra unlisted file a", "hash mismatch b", "missing file c"], 6),
    (["report.json is not in canonical form"], 1),
])
def test_verify_exit_codes(problems, code):
    assert verify_exit_code(problems) == code


def test_verify_missing_report_dir_is_a_failure_not_a_crash(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "nope")]) == 5
    assert "missing file" in capsys.readouterr().out


def test_run_rejects_bad_k_with_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["run", str(tmp_path), "--k", "1"])
    assert exc.value.code == EXIT_BAD_INPUT
