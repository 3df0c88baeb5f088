"""deid.heap: the memory a stage freed goes back to the OS (Arrow's pool keeps it otherwise; issue 13)."""
import numpy as np
import psutil
import pyarrow as pa

from deid.heap import release_free_memory


def test_arrow_buffers_freed_by_a_stage_leave_the_process_when_released():
    proc = psutil.Process()
    # From a clean pool: pages earlier tests in this worker freed into the allocators would otherwise serve
    # these arrays without growing the RSS (the test then failed by test order, not by what it checks).
    release_free_memory()
    before = proc.memory_info().rss
    rng = np.random.default_rng(0)
    # Many small Arrow arrays, as a stage's tables leave them: freed into the pool's pages, not to the OS.
    arrays = [pa.array(rng.random(1000)) for _ in range(20_000)]  # ~160 MB
    grown = proc.memory_info().rss - before
    assert grown > 100 * 2**20, "the arrays did not take the memory this test needs to see it return"
    del arrays
    kept = proc.memory_info().rss - before
    release_free_memory()
    after = proc.memory_info().rss - before
    assert after < 0.5 * grown, (
        f"{after / 2**20:.0f} MiB of {grown / 2**20:.0f} MiB freed still held after release_free_memory "
        f"({kept / 2**20:.0f} MiB before it)")
