"""deid.settings: each parameter's range, declared once."""
import pytest

from deid.errors import ConfigError


def test_each_parameter_range_is_declared_once_on_the_setting():
    """Issue 30: k, sigma and block are checked from the range their Settings field declares; the run
    configuration's and the CLI's messages state that range, whatever it is."""
    import argparse

    from deid.cli import _k
    from deid.run_config import _check_run
    from deid.settings import declared_range, in_declared_range, range_text

    assert declared_range("k") == (2, True, 1000, True, True) and range_text("k") == "an integer from 2 to 1000"
    assert range_text("sigma") == "a number in (0, 100]"
    assert range_text("block") == "an integer from 2 to 64"
    assert not in_declared_range("k", True) and not in_declared_range("k", 2.0) and in_declared_range("k", 2)
    assert not in_declared_range("sigma", 0) and in_declared_range("sigma", 100) and not in_declared_range("sigma", 100.5)
    for bad in (1, 1001):
        with pytest.raises(ConfigError, match=f"k={bad} must be an integer from 2 to 1000"):
            _check_run(bad, "k-same-select")
        with pytest.raises(argparse.ArgumentTypeError, match="must be an integer from 2 to 1000"):
            _k(str(bad))
    assert _k("1000") == 1000
