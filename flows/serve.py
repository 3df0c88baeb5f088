"""The ``release-on-drop`` and nightly ``release-incoming`` flows, for ``prefect deploy`` users.

They live in :mod:`deid.orchestration.serve`; ``deid serve`` serves both.
"""
from deid.orchestration.serve import release_incoming, release_on_drop  # noqa: F401
