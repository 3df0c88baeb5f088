"""One BLAS thread for a block of small products, without scanning the process's libraries each time.

``threadpoolctl.threadpool_limits`` looks up every loaded shared library on each call (2-11 ms,
more the more libraries a run has loaded); the gate and k-Same enter such a block hundreds of
times per run. One :class:`threadpoolctl.ThreadpoolController`, made on first use, finds the
BLAS libraries once; its ``limit`` then only switches their thread counts.
"""
from __future__ import annotations

import threading
from typing import Any

_controller: Any = None
_lock = threading.Lock()


def one_blas_thread() -> Any:
    """Context manager: numpy's and scipy's BLAS run single-threaded inside it."""
    global _controller
    if _controller is None:
        with _lock:
            if _controller is None:
                import scipy.linalg  # noqa: F401, PLC0415 - scipy's own OpenBLAS is loaded before the lookup
                from threadpoolctl import ThreadpoolController  # noqa: PLC0415

                _controller = ThreadpoolController()
    return _controller.limit(limits=1, user_api="blas")
