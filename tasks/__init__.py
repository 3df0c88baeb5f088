"""The Prefect tasks of the release flow, installed as ``deid.tasks``.

:mod:`deid.tasks.stages` holds the one-line task adapters around the core stages
(:mod:`deid.operations.pipeline`) and :data:`~deid.tasks.stages.STEPS`, which hands them to
:func:`deid.operations.runner.run_release`. Importing this package loads nothing.
"""
