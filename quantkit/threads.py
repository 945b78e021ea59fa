"""BLAS threads while quantkit's whole-graph path alternates NumPy / SciPy work with ONNX Runtime sessions.

A quantization run interleaves the two all the time: a calibration batch in ONNX Runtime, then its statistics
(and, for the ``x86-avx2`` target, the input second moments: ``ssyrk`` per 256-wide block) in NumPy; per layer,
a Cholesky factor and GPTQ's block updates; then a candidate model in ONNX Runtime again.  Both libraries size
their thread pools to every core, and OpenBLAS's workers keep spinning for a while after each call, so on a small
machine each library's threads take cores from the other's next call.  The matrices quantkit factors and
multiplies are small (256-wide Hessian blocks, one layer's weights), where a second BLAS thread buys little.
Measured on 2 cores (x86-vnni, nothing else running), OpenBLAS limited to one thread, same models, same results:
ResNet-18 built for ``x86-avx2`` 10.9 -> 8.2 s (a 256 x 256 ``dpotrf`` 6.6 -> 0.4 ms inside the run, 0.3 ms
alone either way), BERT-base 59.7 -> 51.6 s, ResNet-18 for ``x86-vnni`` 5.4 -> 4.6 s.

:func:`blas_threads` limits the BLAS pools the process has loaded (``threadpoolctl``) for the length of a
``with`` block and restores them after: the default is one thread; ``$QUANTKIT_BLAS_THREADS`` sets another count,
or ``all`` leaves the libraries' own setting.  ONNX Runtime's pools and torch's are not touched.  The layer-wise
LLM path does not use it (its build runs in a process of its own; SignRound's torch keeps torch's thread count).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from quantkit.errors import QuantkitError

__all__ = ["BLAS_THREADS_ENV", "blas_thread_limit", "blas_threads"]

BLAS_THREADS_ENV = "QUANTKIT_BLAS_THREADS"


def blas_thread_limit() -> int | None:
    """The BLAS thread count quantkit's whole-graph runs use: ``$QUANTKIT_BLAS_THREADS`` (a positive integer, or
    ``all``: ``None``, the libraries' own setting), else 1."""
    raw = os.environ.get(BLAS_THREADS_ENV, "").strip().lower()
    if not raw:
        return 1
    if raw == "all":
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise QuantkitError(f"{BLAS_THREADS_ENV}={raw!r}: allowed values: a positive integer (threads), or 'all' "
                            "(the BLAS libraries' own setting)")
    return n


@contextmanager
def blas_threads(limit: int | None = None) -> Iterator[None]:
    """Limit the loaded BLAS libraries to ``limit`` threads (default :func:`blas_thread_limit`) inside the block.

    Without ``threadpoolctl`` (or with ``all``) the block runs unchanged."""
    n = blas_thread_limit() if limit is None else limit
    if n is None:
        yield
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # a dependency; an environment without it runs as before
        yield
        return
    with threadpool_limits(limits=n, user_api="blas"):
        yield
