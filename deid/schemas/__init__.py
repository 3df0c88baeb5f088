"""Data contracts: Arrow schemas, the report JSON schema and the Expectation suites (importlib.resources)."""
