"""Entry points for Prefect users; the flows themselves live in :mod:`deid.orchestration` (installed with deid)."""
