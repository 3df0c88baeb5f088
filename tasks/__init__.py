"""The Prefect tasks of the release flow, installed as ``deid.tasks``.

:mod:`deid.tasks.stages` holds the one-line task adapters around the core stages (the stage functions
:class:`deid.operations.runner.Steps` names) and :data:`~deid.tasks.stages.STEPS`, which hands them to
:func:`deid.operations.runner.run_release`. Importing this package loads nothing.
"""
