"""MSE calibrator: the range whose quantize-dequantize error over the histogram is least.

Candidates.  With ``lo0 = min(data, 0)``, ``hi0 = max(data, 0)`` and ``n = candidates``, the
candidate ranges are ``[α·lo0, α·hi0]`` for ``α = 1/n, 2/n, …, 1`` (so for data with
``min >= 0`` only ``hi`` shrinks, and ``α = 1`` is min-max).

Error.  For each candidate, ``(scale, zero_point) = compute_qparams(α·lo0, α·hi0, dtype,
symmetric=symmetric)`` and the expected squared error is estimated on the histogram's bin
centres ``c_k`` weighted by their counts ``n_k``::

    E(α) = Σ_k n_k · (c_k − dequantize(quantize(c_k, scale, zero_point), scale, zero_point))²

with exactly the rounding and saturation of :func:`quantkit.scheme.quantize` /
:func:`~quantkit.scheme.dequantize` (what ONNX Runtime will do), evaluated for all candidates
at once as one ``(candidates, non-empty bins)`` array.  The chosen range is the ``argmin``
(the largest ``α`` among equal errors, i.e. the least clipping).  Per-tensor only.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from calibrators._common import HistogramCalibrator, check_number
from quantkit.calibrate.base import register_calibrator
from quantkit.calibrate.stats import TensorStatistics
from quantkit.scheme.qparams import compute_qparams, dequantize, quantize

__all__ = ["MSECalibrator"]


@register_calibrator("mse")
class MSECalibrator(HistogramCalibrator):
    """Range ``[α·min, α·max]`` minimising the histogram's expected quantization MSE (``candidates`` α's)."""

    name: ClassVar[str] = "mse"

    def __init__(
        self,
        *,
        axis: int | None = None,
        dtype: str = "uint8",
        symmetric: bool = False,
        candidates: int = 200,
    ) -> None:
        super().__init__(axis=axis, dtype=dtype, symmetric=symmetric)
        self.candidates = int(
            check_number(
                "mse",
                "candidates",
                candidates,
                integer=True,
                lo=1,
                hi=100_000,
                allowed="an integer in [1, 100000]",
            )
        )

    def options(self) -> dict[str, Any]:
        return {"candidates": self.candidates}

    def candidate_ranges(self, stats: TensorStatistics) -> tuple[np.ndarray, np.ndarray]:
        """The candidate ``(lo, hi)`` float64 arrays ``α·min(data, 0)``, ``α·max(data, 0)``, α ascending."""
        alphas = np.arange(1, self.candidates + 1, dtype=np.float64) / self.candidates
        return alphas * min(stats.min, 0.0), alphas * max(stats.max, 0.0)

    def errors(self, stats: TensorStatistics, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """``E`` (float64, one per candidate ``[lo[i], hi[i]]``) as in the module docstring."""
        counts = stats.hist.counts
        used = np.flatnonzero(counts)
        x = stats.hist.centers()[used].astype(np.float32)
        w = counts[used].astype(np.float64)
        scale, zp = compute_qparams(lo, hi, self.int_type, symmetric=self.symmetric)
        xs = np.broadcast_to(x, (lo.size, x.size))
        dq = dequantize(quantize(xs, scale, zp, axis=0, dtype=self.int_type), scale, zp, axis=0)
        err = (dq.astype(np.float64) - x.astype(np.float64)) ** 2
        return np.asarray(err @ w)

    def _range(self, stats: TensorStatistics) -> tuple[float, float]:
        lo, hi = self.candidate_ranges(stats)
        e = self.errors(stats, lo, hi)
        best = e.size - 1 - int(np.argmin(e[::-1]))  # last minimum: the widest of equal-error ranges
        return float(lo[best]), float(hi[best])
