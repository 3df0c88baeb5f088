"""The Prefect flows and their deployments, installed as ``deid.flows``.

:mod:`deid.flows.release` holds the ``release`` flow and :func:`~deid.flows.release.run_flow`;
:mod:`deid.flows.serve` the ``release-on-drop`` and nightly ``release-incoming`` flows and the deployments
``deid serve`` serves. Each file is also a ``prefect deploy`` entrypoint loaded by path
(``flows/release.py:release``), so the modules import absolutely (``deid.…``), never relatively. Importing
this package loads nothing (Prefect only loads with a flow module).
"""
