"""Operations: the release run's stages, the workers they submit, the run ledger and crash safety.

The stage modules (:mod:`.ingest_align`, :mod:`.featurize_partition`, :mod:`.person_search`,
:mod:`.deidentify_lineage`, :mod:`.release_staging`, :mod:`.gate_publish`, :mod:`.run_setup`) hold one function per
stage. Each takes contracts (:mod:`deid.contracts`) in and returns one out, with no Prefect: the heavy per-part
work goes to an :class:`~deid.pool.Executor` as the ``worker_*`` modules' functions; ``logger`` (optional, default
the stage module's) receives the stage's progress and warnings, e.g. Prefect's run logger.
:mod:`deid.operations.runner` calls them in order; the Prefect tasks of :mod:`deid.tasks.stages` are one-line
adapters around them.
"""
