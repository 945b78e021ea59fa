"""Per-tensor statistics collected once and shared by every histogram calibrator.

:class:`TensorStatistics` streams, over all finite values ``x_i`` of one tensor:

* ``min = min_i x_i`` and ``max = max_i x_i`` — exact, independent of batching;
* ``count = N`` and ``sum = Σ x_i`` (float64), hence ``mean = sum / count``;
* ``nonfinite``: the number of NaN / ±inf values (ignored everywhere else);
* ``hist``: a :class:`~quantkit.calibrate.histogram.StreamingHistogram` of the values — also
  independent of batching (see that module).

Memory is O(bins).  :meth:`TensorStatistics.state` is a flat dict of arrays and numbers
(what the on-disk statistics cache stores); :meth:`TensorStatistics.from_state` rebuilds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from quantkit.calibrate.histogram import StreamingHistogram

__all__ = ["TensorStatistics"]


class TensorStatistics:
    """Exact running min / max / count / sum and a streaming histogram of one tensor (per-tensor)."""

    def __init__(self, bins: int = 8192) -> None:
        self.hist = StreamingHistogram(bins)
        self.min = np.inf  # over finite values; +inf / -inf while none was seen
        self.max = -np.inf
        self.count = 0
        self.sum = 0.0
        self.batches = 0

    @property
    def bins(self) -> int:
        """Number of histogram bins."""
        return self.hist.bins

    @property
    def nonfinite(self) -> int:
        """Number of NaN / ±inf values seen."""
        return self.hist.nonfinite

    @property
    def mean(self) -> float | None:
        """``sum / count`` over finite values; ``None`` before any finite value."""
        return self.sum / self.count if self.count else None

    @property
    def absmax(self) -> float:
        """``max(|min|, |max|)`` over finite values (0.0 before any)."""
        return max(-self.min, self.max, 0.0) if self.count else 0.0

    def update(self, x: npt.ArrayLike) -> None:
        """Fold one batch (any shape) into the statistics; keeps no reference to ``x``."""
        # float32 data is binned in float32 (scaling by a power of two and floor are exact there);
        # other float types are widened to float64.  Fast path: min/max are finite iff every value is.
        a = np.asarray(x)
        arr = a.ravel() if a.dtype in (np.float32, np.float64) else a.astype(np.float64).ravel()
        self.batches += 1
        if arr.size == 0:
            return
        lo, hi = float(arr.min()), float(arr.max())
        if not (np.isfinite(lo) and np.isfinite(hi)):
            finite = np.isfinite(arr)
            self.hist.nonfinite += int(arr.size - np.count_nonzero(finite))
            arr = arr[finite]
            if arr.size == 0:
                return
            lo, hi = float(arr.min()), float(arr.max())
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)
        self.count += int(arr.size)
        self.sum += float(arr.sum(dtype=np.float64))
        self.hist._add_finite(arr, max(-lo, hi))  # same package; saves a second isfinite/abs pass

    def merge(self, other: TensorStatistics) -> None:
        """Fold in another tensor's statistics (same ``bins``); equals having streamed both."""
        if not isinstance(other, TensorStatistics):
            raise ValueError(f"merge() needs a TensorStatistics, got {type(other).__name__}")
        self.hist.merge(other.hist)
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        self.count += other.count
        self.sum += other.sum
        self.batches += other.batches

    def copy(self) -> TensorStatistics:
        """An independent copy."""
        return TensorStatistics.from_state(self.state())

    def state(self) -> dict[str, np.ndarray | float | int]:
        """Flat dict: ``min``, ``max``, ``count``, ``sum``, ``batches`` and the histogram's
        ``counts``, ``range``, ``nonfinite``."""
        return {
            "min": float(self.min),
            "max": float(self.max),
            "count": self.count,
            "sum": float(self.sum),
            "batches": self.batches,
            **self.hist.state(),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> TensorStatistics:
        """Rebuild from :meth:`state` (numbers may be 0-d arrays, as read back from ``.npz``).

        Raises ``KeyError`` for a missing field and ``ValueError`` for an inconsistent one.
        """
        hist = StreamingHistogram.from_state(state)
        stats = cls(hist.bins)
        stats.hist = hist
        stats.min = float(np.asarray(state["min"]))
        stats.max = float(np.asarray(state["max"]))
        stats.count = int(np.asarray(state["count"]))
        stats.sum = float(np.asarray(state["sum"]))
        stats.batches = int(np.asarray(state["batches"]))
        if stats.count != hist.total:
            raise ValueError(f"statistics state: count={stats.count} but the histogram holds {hist.total}")
        if stats.count and not (np.isfinite(stats.min) and np.isfinite(stats.max) and stats.min <= stats.max):
            raise ValueError(f"statistics state: invalid min={stats.min}, max={stats.max}")
        return stats

    def __repr__(self) -> str:
        return (
            f"TensorStatistics(count={self.count}, min={self.min}, max={self.max}, "
            f"nonfinite={self.nonfinite}, bins={self.bins})"
        )
