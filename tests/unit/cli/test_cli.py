"""CLI exit codes: one per kind (type) of verification failure; bad input is 2."""
import pytest

from deid.cli import EXIT_BAD_INPUT, main, verify_exit_code
from deid.errors import BadSignature, HashMismatch, MissingFile, UnlistedFile, VerificationError, WrongKey


@pytest.mark.parametrize("failures, code", [
    ([BadSignature("bad signature: report.json.sig does not match")], 3),
    ([WrongKey("wrong key: report names signer sha256:a, the given public key is sha256:b")], 4),
    ([MissingFile("missing file images/x.png")], 5),
    ([HashMismatch("hash mismatch images/x.png: sha256 ...")], 6),
    ([UnlistedFile("extra unlisted file images/y.png")], 7),
    ([UnlistedFile("extra unlisted file a"), HashMismatch("hash mismatch b"), MissingFile("missing file c")], 6),
    ([VerificationError("report.json is not in canonical form")], 1),
    # The type decides, never the wording: a message that reads like another kind changes nothing.
    ([VerificationError("bad signature: looks like one, is not typed as one")], 1),
    ([HashMismatch("extra unlisted file (worded like another kind)")], 6),
])
def test_verify_exit_codes(failures, code):
    assert verify_exit_code(failures) == code


def test_verify_mistyped_path_is_bad_input_not_a_crash(tmp_path, capsys):
    # Issue 29: a path that is not there is bad input (2), not a verification failure (5 was "missing file").
    assert main(["verify", str(tmp_path / "nope")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    # The positional is a release or a report directory (issue 29 item 8): named "path".
    assert "deid verify: path" in err and "nope is not a directory" in err and "ATTESTATION.json" in err
    (tmp_path / "report").mkdir()
    assert main(["verify", str(tmp_path / "report"), "--release", str(tmp_path / "typo")]) == EXIT_BAD_INPUT
    # A report directory that exists without its report.json is still a missing file of a signed run.
    assert main(["verify", str(tmp_path / "report")]) == 5
    assert "missing file" in capsys.readouterr().out


def test_version_is_the_package_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"deid {version('deid')}"


def test_run_rejects_bad_k_with_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["run", str(tmp_path), "--k", "1"])
    assert exc.value.code == EXIT_BAD_INPUT


def test_method_help_and_messages_come_from_the_registry():
    """One method list (issue 30): the CLI's --method help names every registered method once, in its group, and
    the feature-drop refusal names exactly the registry's image-only methods; a method added to the registry
    appears in both without another edit."""
    from deid.method_registry import FEATURE_ONLY, IMAGE_ONLY_METHODS, REGISTRY, method_help
    from deid.errors import ConfigError
    from deid.run_config import _check_run

    text = method_help()
    head = text.split(". Feature drops take")[0]
    for name in (*REGISTRY, *FEATURE_ONLY):
        assert head.count(name + ",") + head.count(name + ":") + head.count(name + " (") == 1, name
    assert set(IMAGE_ONLY_METHODS) == {n for n, s in REGISTRY.items() if not s.on_features}
    assert {"blur", "pixelate", "k-same-aam"} <= set(IMAGE_ONLY_METHODS)
    with pytest.raises(ConfigError) as err:
        _check_run(5, "k-same-aam", "features")
    assert ", ".join(IMAGE_ONLY_METHODS) + " need face images" in str(err.value)
