"""The release flow's Prefect tasks live in :mod:`deid.orchestration.tasks` (one-line adapters around
the stage functions :class:`deid.operations.runner.Steps` names); ``STEPS`` hands them to :func:`deid.operations.runner.run_release`."""
from deid.orchestration.tasks import STEPS  # noqa: F401
