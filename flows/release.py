"""The ``release`` flow, for ``prefect deploy`` (entrypoint ``flows/release.py:release``) and scripts.

It lives in :mod:`deid.orchestration.flow`; ``run_flow`` returns the run's result for either verdict.
"""
from deid.orchestration.flow import release, run_flow  # noqa: F401
