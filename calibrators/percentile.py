"""Percentile calibrator: clip the range at a quantile of the data.

With ``p = percentile / 100`` and ``Q(q)`` the ``q``-quantile read off the streaming histogram
(linear interpolation inside a bin, see :func:`quantkit.calibrate.histogram.histogram_quantile`):

* asymmetric grid: ``lo = Q(1 - p)``, ``hi = Q(p)`` — each tail loses a fraction ``1 - p``;
* symmetric grid: ``t = Q_|x|(p)``, the ``p``-quantile of ``|x|`` (the histogram folded at 0),
  and the range is ``[-t, t]`` — a fraction ``1 - p`` of all values is clipped in total.

The result is then widened to contain 0 and clipped to ``[min(data), max(data)]``
(:class:`~calibrators._common.HistogramCalibrator`); ``percentile = 100`` is min-max.
Per-tensor only.
"""

from __future__ import annotations

from typing import Any, ClassVar

from calibrators._common import HistogramCalibrator, check_number
from quantkit.calibrate.base import register_calibrator
from quantkit.calibrate.stats import TensorStatistics

__all__ = ["PercentileCalibrator"]


@register_calibrator("percentile")
class PercentileCalibrator(HistogramCalibrator):
    """Range at the ``percentile``-th percentile (default 99.99, allowed ``(50, 100]``)."""

    name: ClassVar[str] = "percentile"

    def __init__(
        self,
        *,
        axis: int | None = None,
        dtype: str = "uint8",
        symmetric: bool = False,
        percentile: float = 99.99,
    ) -> None:
        super().__init__(axis=axis, dtype=dtype, symmetric=symmetric)
        self.percentile = check_number(
            "percentile",
            "percentile",
            percentile,
            integer=False,
            lo=50.0,
            hi=100.0,
            lo_open=True,
            allowed="a number in (50, 100]",
        )

    def options(self) -> dict[str, Any]:
        return {"percentile": self.percentile}

    def _range(self, stats: TensorStatistics) -> tuple[float, float]:
        p = self.percentile / 100.0
        if self.symmetric:
            t = float(stats.hist.abs_quantile(p))
            return -t, t
        lo, hi = stats.hist.quantile([1.0 - p, p])
        return float(lo), float(hi)
