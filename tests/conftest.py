"""Shared fixtures: the London set location, an isolated project dir, one Prefect server per session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LONDON = ROOT.parent / "shared" / "datasets" / "london"

# Keep Prefect's state out of the user's home and quiet, before anything imports prefect.
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# One BLAS thread per process (as the CLI does): threaded OpenBLAS next to Dask workers thrashes.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")


@pytest.fixture(scope="session")
def london_dir() -> Path:
    """The real London set; its absence is a failure, never a skip (CI always has it)."""
    if not (LONDON / "london_info.csv").is_file():
        pytest.fail(f"the London face set is missing: expected {LONDON} (see DEVELOPERS.md, Data)")
    return LONDON


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """An isolated project dir: data/ and reports/ under tmp, no configured signing key."""
    monkeypatch.setenv("DEID_PROJECT_DIR", str(tmp_path))
    monkeypatch.delenv("DEID_SIGNING_KEY", raising=False)
    monkeypatch.delenv("DEID_DASK_ADDRESS", raising=False)
    return tmp_path


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """One temporary Prefect API (isolated DB) for every flow test of the session."""
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect_home"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
