"""deid: release face datasets with a formal guarantee (k-Same, k-Same-Select), judged by a gate.

The package is the Prefect-free core; ``deid.flows`` (the flows and deployments, ``flows/`` in the repository),
``deid.tasks`` (the tasks, ``tasks/``) and ``deid.orchestration`` (their plumbing) adapt it to Prefect. The names
below are the public API, imported on first use (``import deid`` stays light: the command line imports Prefect,
scikit-learn and dlib only when a command needs them).

- :func:`read_drop`, :func:`make_synthetic_drop`: a drop (manifest + files) read, or made for tests.
- :func:`deidentify`: one method on aligned faces (k-Same, k-Same-Select, k-Same-Eigen, k-Same-M, ...).
- :class:`GateConfig`, :func:`evaluate`: the release gate (exact k checks, attacks with intervals, utility).
- :class:`RunConfig`, :func:`run_release`: a whole release run, without Prefect.
- :func:`verify_report`: check a signed report and the release it describes.
- :func:`run_study`: the comparison study of methods and strengths.
"""
from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("deid")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0+unknown"

_API = {
    "read_drop": "deid.intake.drop",
    "make_synthetic_drop": "deid.intake.synth",
    "deidentify": "deid.anonymise.methods",
    "GateConfig": "deid.evaluation.gate_types",
    "evaluate": "deid.evaluation.gate",
    "RunConfig": "deid.run_config",
    "run_release": "deid.operations.runner",
    "verify_report": "deid.reporting.verify",
    "run_study": "deid.study",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    """The public names, each imported from its module the first time it is asked for (PEP 562)."""
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'deid' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
