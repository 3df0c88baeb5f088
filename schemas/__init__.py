"""The data contracts, installed as ``deid.schemas``: the Arrow schemas (:mod:`deid.schemas.arrow`), the report and
attestation JSON Schemas (``report.schema.json``, ``attestation.schema.json``) and the Great Expectations suites
(``expectations/<name>.json``).

The lowest base of the layers (pyproject's import-linter contract): every layer may read it, it imports no other
part of deid. Code reads the JSON files as package data, ``importlib.resources.files("deid.schemas")``, never by
path: the directory is ``schemas/`` in the repository and ``deid/schemas/`` in an installed wheel.
"""
