"""Min-max calibrator: the range is the smallest / largest value seen.

Per batch ``b`` (reducing over every axis except ``axis``, if set)::

    m_b = min(x_b),  M_b = max(x_b)

* without ``momentum``: ``min = min_b m_b``, ``max = max_b M_b`` — independent of the
  batch size and of the order of the batches;
* with ``momentum`` μ ∈ [0, 1): an exponential moving average per batch,
  ``min ← μ·min + (1−μ)·m_b`` (same for ``max``), the first batch initialising it.  This
  damps outliers but depends on batch size and order.

Non-finite values (NaN, ±inf) are ignored and counted (``state()["nonfinite"]``): one
overflowing activation would otherwise make every scale of the tensor infinite.  A
channel that never saw a finite value gets the range ``[0, 0]``.  Memory is O(C).

``dtype`` / ``symmetric`` (the grid the range is for) are accepted like every calibrator's and
validated, but do not change a min-max range.  :meth:`MinMaxCalibrator.from_statistics` builds
the per-tensor, momentum-free calibrator from collected
:class:`~quantkit.calibrate.stats.TensorStatistics` (its exact ``min`` / ``max``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from calibrators._common import check_grid
from quantkit.calibrate.base import register_calibrator
from quantkit.calibrate.stats import TensorStatistics
from quantkit.errors import CalibrationError, RecipeError

__all__ = ["MinMaxCalibrator"]


@register_calibrator("minmax")
class MinMaxCalibrator:
    """Running (or moving-average) per-tensor / per-channel min and max."""

    name: ClassVar[str] = "minmax"

    def __init__(
        self,
        *,
        axis: int | None = None,
        dtype: str = "uint8",
        symmetric: bool = False,
        momentum: float | None = None,
    ) -> None:
        check_grid("minmax", dtype, symmetric)
        self.dtype = dtype
        self.symmetric = symmetric
        if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
            raise RecipeError(f"minmax calibrator: axis={axis!r} must be an integer or null")
        if momentum is not None and (
            isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0.0 <= momentum < 1.0
        ):
            raise RecipeError(
                f"minmax calibrator: momentum={momentum!r} is not allowed; allowed: null or 0 <= momentum < 1"
            )
        self.axis = axis
        self.momentum = None if momentum is None else float(momentum)
        self._min: np.ndarray | None = None  # float64, shape () or (C,)
        self._max: np.ndarray | None = None
        self._batches = 0
        self._nonfinite = 0

    @classmethod
    def from_statistics(cls, stats: TensorStatistics, **options: Any) -> MinMaxCalibrator:
        """A per-tensor calibrator whose range is ``[stats.min, stats.max]`` (``options`` as for ``__init__``).

        ``axis`` and ``momentum`` are refused (:class:`RecipeError`): the statistics are per-tensor
        and do not keep the per-batch extremes a moving average needs.
        """
        cal = cls(**options)
        for option, value in (("axis", cal.axis), ("momentum", cal.momentum)):
            if value is not None:
                raise RecipeError(
                    f"minmax calibrator: {option}={value!r} cannot be computed from collected per-tensor "
                    f"statistics; allowed: null"
                )
        if stats.count or stats.nonfinite:
            # +inf / -inf when only non-finite values were seen -> compute_range gives [0, 0], as update does
            cal._min = np.asarray(stats.min, np.float64)
            cal._max = np.asarray(stats.max, np.float64)
        cal._batches = stats.batches
        cal._nonfinite = stats.nonfinite
        return cal

    @classmethod
    def from_state(cls, state: Mapping[str, Any], **options: Any) -> MinMaxCalibrator:
        """A calibrator (constructed with ``options``) restored from :meth:`state`."""
        cal = cls(**options)
        cal.load_state(dict(state))
        return cal

    def _reduce_axes(self, x: np.ndarray) -> tuple[int, ...] | None:
        if self.axis is None:
            return None
        if not -x.ndim <= self.axis < x.ndim:
            raise CalibrationError(
                f"minmax calibrator: axis={self.axis} is out of range for a tensor of shape {x.shape}"
            )
        a = self.axis % x.ndim
        return tuple(i for i in range(x.ndim) if i != a)

    def update(self, x: np.ndarray) -> None:
        """Fold one batch into the running statistics (keeps no reference to ``x``)."""
        arr = np.asarray(x)
        if arr.size == 0:
            return
        axes = self._reduce_axes(arr)
        bmin = np.asarray(arr.min(axis=axes), np.float64)
        bmax = np.asarray(arr.max(axis=axes), np.float64)
        if arr.dtype.kind == "f" and not (np.all(np.isfinite(bmin)) and np.all(np.isfinite(bmax))):
            # Slow path only when a NaN/inf is present (min/max propagate NaN, so finite results mean none).
            finite = np.isfinite(arr)
            self._nonfinite += int(arr.size - np.count_nonzero(finite))
            bmin = np.asarray(np.min(arr, axis=axes, where=finite, initial=np.inf), np.float64)
            bmax = np.asarray(np.max(arr, axis=axes, where=finite, initial=-np.inf), np.float64)
        if self._min is None or self._max is None:
            self._min, self._max = bmin, bmax
        else:
            if bmin.shape != self._min.shape:
                raise CalibrationError(
                    f"minmax calibrator: batch has {bmin.shape} channels along axis {self.axis}, "
                    f"earlier batches had {self._min.shape}"
                )
            if self.momentum is None:
                self._min = np.minimum(self._min, bmin)
                self._max = np.maximum(self._max, bmax)
            else:
                # EMA; a channel with no finite value yet (±inf) is initialised by the first finite one.
                self._min = _weighted(self._min, bmin, self.momentum)
                self._max = _weighted(self._max, bmax, self.momentum)
        self._batches += 1

    def compute_range(self) -> tuple[np.ndarray, np.ndarray]:
        """``(min, max)`` float32; ``[0, 0]`` for channels without finite data."""
        if self._min is None or self._max is None:
            raise CalibrationError(
                "minmax calibrator received no data (update() was never called with values)"
            )
        seen = np.isfinite(self._min) & np.isfinite(self._max)
        lo = np.where(seen, self._min, 0.0).astype(np.float32)
        hi = np.where(seen, self._max, 0.0).astype(np.float32)
        return lo, hi

    def merge(self, other: Any) -> None:
        """Combine with another minmax calibrator of the same settings.

        Running min-max merges exactly (elementwise min / max).  Moving averages cannot be
        merged exactly; they are combined as the batch-count-weighted mean of the two.
        """
        if not isinstance(other, MinMaxCalibrator) or (other.axis, other.momentum) != (
            self.axis,
            self.momentum,
        ):
            raise ValueError("merge() needs a MinMaxCalibrator with the same axis and momentum")
        if other._min is None or other._max is None:
            return
        if self._min is None or self._max is None:
            self._min, self._max = other._min.copy(), other._max.copy()
        elif self._min.shape != other._min.shape:
            raise CalibrationError(f"cannot merge ranges of shapes {self._min.shape} and {other._min.shape}")
        elif self.momentum is None:
            self._min = np.minimum(self._min, other._min)
            self._max = np.maximum(self._max, other._max)
        else:
            w = self._batches / (self._batches + other._batches)
            self._min = _weighted(self._min, other._min, w)
            self._max = _weighted(self._max, other._max, w)
        self._batches += other._batches
        self._nonfinite += other._nonfinite

    def state(self) -> dict[str, np.ndarray | float | int]:
        """``min``, ``max`` (float64 arrays, ±inf where unseen), ``batches``, ``nonfinite``."""
        if self._min is None or self._max is None:
            return {"batches": 0, "nonfinite": self._nonfinite}
        return {
            "min": self._min.copy(),
            "max": self._max.copy(),
            "batches": self._batches,
            "nonfinite": self._nonfinite,
        }

    def load_state(self, state: dict[str, np.ndarray | float | int]) -> None:
        """Restore what :meth:`state` returned (settings come from the constructor)."""
        self._batches = int(state["batches"])
        self._nonfinite = int(state["nonfinite"])
        if "min" in state:
            self._min = np.array(state["min"], np.float64)
            self._max = np.array(state["max"], np.float64)
        else:
            self._min = self._max = None


def _weighted(a: np.ndarray, b: np.ndarray, w: float) -> np.ndarray:
    """``w·a + (1−w)·b`` where both are finite, else whichever is finite."""
    both = np.isfinite(a) & np.isfinite(b)
    return np.where(both, w * a + (1 - w) * b, np.where(np.isfinite(a), a, b))
