"""The Prefect layer: the ``release`` flow, its tasks, the deployments, the drop watcher, the Dask cluster.

The only part of deid that imports Prefect (``tests/test_core_purity.py`` checks the core never
does). The stages' order and logic live in the core (:mod:`deid.operations.runner`, the stage modules it names);
the tasks here are one-line adapters. Import the submodules (:mod:`.flow`, :mod:`.serve`, ...)
explicitly: importing this package loads nothing.
"""
