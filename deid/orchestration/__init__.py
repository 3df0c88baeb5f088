"""The Prefect plumbing that is neither a flow nor a task: the API server connection (:mod:`.prefect_api`), the
run logs and progress in the UI (:mod:`.logs`), the Dask cluster (:mod:`.cluster`), the drop watcher
(:mod:`.watch`) and the reports server (:mod:`.reports_server`).

The flows and deployments are :mod:`deid.flows`, the tasks :mod:`deid.tasks`; these modules serve them and the
command line (``deid run``, ``deid server``, ``deid watch``) without loading a flow. With those two, the only
part of deid that imports Prefect (``tests/integration/test_core_purity.py`` checks the core never does). The stages'
order and logic live in the core (:mod:`deid.operations.runner`, the stage modules it names). Import the
submodules explicitly: importing this package loads nothing.
"""
