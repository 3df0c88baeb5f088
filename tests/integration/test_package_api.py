"""The package's public API (issue 30 item 7): ``deid.__version__`` and the names ``deid.__all__`` lists."""
from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

import deid


def test_version_is_the_installed_distributions():
    assert deid.__version__ == version("deid")


def test_every_public_name_resolves_to_its_module_object():
    from deid.evaluation.gate import evaluate
    from deid.reporting.verify import verify_report

    assert deid.evaluate is evaluate and deid.verify_report is verify_report
    for name in deid.__all__:
        assert getattr(deid, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        deid.nope  # noqa: B018


def test_importing_deid_imports_none_of_the_heavy_packages():
    code = ("import sys, deid; heavy = [m for m in ('prefect', 'sklearn', 'dlib', 'great_expectations', 'cv2') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out
