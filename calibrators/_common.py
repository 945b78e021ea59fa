"""What the built-in calibrators share: option checks and the histogram-calibrator base class.

Every calibrator is constructed with keyword arguments ``axis`` (``None``: per-tensor),
``dtype`` (the integer grid the range is chosen *for*, a name from
:data:`quantkit.scheme.dtypes.INT_TYPES`) and ``symmetric`` (symmetric or asymmetric grid,
as in :func:`quantkit.scheme.compute_qparams`), plus its own options.

:class:`HistogramCalibrator` streams into a :class:`~quantkit.calibrate.stats.TensorStatistics`
(exact min / max and a batching-independent histogram) and leaves one method to the
subclass: ``_range(stats) -> (lo, hi)``.  :meth:`HistogramCalibrator.compute_range` then
enforces, whatever the subclass computed, ``min(stats.min, 0) <= lo <= 0 <= hi <= max(stats.max, 0)``:
the range contains 0 (as :func:`~quantkit.scheme.compute_qparams` requires anyway) and never
extends past the data.  Because the statistics are per-tensor, so are these calibrators.

Imports: only :mod:`quantkit.calibrate.base`, the leaf modules ``histogram`` / ``stats`` and
:mod:`quantkit.scheme` — never ``quantkit.calibrate.collect`` — so that ``import calibrators``
and ``import quantkit.calibrate`` work in either order.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import numpy as np

from quantkit.calibrate.stats import TensorStatistics
from quantkit.errors import CalibrationError, RecipeError
from quantkit.scheme.dtypes import INT_TYPES, IntType

__all__ = ["HistogramCalibrator", "check_grid", "check_number"]

H = TypeVar("H", bound="HistogramCalibrator")


def check_grid(calibrator: str, dtype: object, symmetric: object) -> IntType:
    """Validate the ``dtype`` / ``symmetric`` options; :class:`RecipeError` naming the bad one."""
    if not isinstance(dtype, str) or dtype not in INT_TYPES:
        raise RecipeError(
            f"{calibrator} calibrator: dtype={dtype!r} is not allowed; allowed: {sorted(INT_TYPES)}"
        )
    if not isinstance(symmetric, bool):
        raise RecipeError(f"{calibrator} calibrator: symmetric={symmetric!r} must be true or false")
    return INT_TYPES[dtype]


def check_number(
    calibrator: str,
    option: str,
    value: object,
    *,
    integer: bool,
    lo: float,
    hi: float,
    lo_open: bool = False,
    allowed: str,
) -> float:
    """Validate a numeric option in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); :class:`RecipeError` otherwise."""
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    ok = isinstance(value, kinds) and not isinstance(value, bool | np.bool_)
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        raise RecipeError(f"{calibrator} calibrator: {option}={value!r} is not allowed; allowed: {allowed}")
    return float(value)  # type: ignore[arg-type]


class HistogramCalibrator(abc.ABC):
    """Base of the per-tensor calibrators that choose a range from :class:`TensorStatistics`.

    Subclasses set ``name`` (via ``@register_calibrator``), add their options to ``__init__``
    (calling ``super().__init__(axis=..., dtype=..., symmetric=...)``), return them from
    :meth:`options` and implement :meth:`_range`.
    """

    name: ClassVar[str]

    def __init__(self, *, axis: int | None = None, dtype: str = "uint8", symmetric: bool = False) -> None:
        label = getattr(type(self), "name", type(self).__name__)
        if axis is not None:
            raise RecipeError(
                f"{label} calibrator: axis={axis!r} is not allowed; histogram calibrators are per-tensor "
                "only (axis=null); use 'minmax' for per-channel activation ranges"
            )
        self.axis: int | None = None
        self.int_type = check_grid(label, dtype, symmetric)
        self.dtype = dtype
        self.symmetric = symmetric
        self.stats = TensorStatistics()

    # ---------------------------------------------------------------- subclass interface
    def options(self) -> dict[str, Any]:
        """The calibrator's own options (beyond axis / dtype / symmetric), as passed to ``__init__``."""
        return {}

    @abc.abstractmethod
    def _range(self, stats: TensorStatistics) -> tuple[float, float]:
        """``(lo, hi)`` from statistics with ``stats.count > 0`` and ``stats.absmax > 0``."""

    # ---------------------------------------------------------------- construction
    def settings(self) -> dict[str, Any]:
        """Every constructor keyword: ``dtype``, ``symmetric`` and :meth:`options`."""
        return {"dtype": self.dtype, "symmetric": self.symmetric, **self.options()}

    @classmethod
    def from_statistics(cls: type[H], stats: TensorStatistics, **options: Any) -> H:
        """A calibrator (constructed with ``options``) whose range comes from already-collected ``stats``.

        ``stats`` is copied, so later updates of either do not affect the other.
        """
        if not isinstance(stats, TensorStatistics):
            raise TypeError(f"from_statistics() needs a TensorStatistics, got {type(stats).__name__}")
        cal = cls(**options)
        cal.stats = stats.copy()
        return cal

    @classmethod
    def from_state(cls: type[H], state: Mapping[str, Any], **options: Any) -> H:
        """A calibrator (constructed with ``options``) restored from :meth:`state`."""
        cal = cls(**options)
        cal.load_state(state)
        return cal

    # ---------------------------------------------------------------- Calibrator protocol
    def update(self, x: np.ndarray) -> None:
        """Stream one batch into the statistics (keeps no reference to ``x``)."""
        self.stats.update(x)

    def merge(self, other: Any) -> None:
        """Fold in the statistics of a calibrator of the same class and settings (exact)."""
        if type(other) is not type(self) or other.settings() != self.settings():
            raise ValueError(
                f"merge() needs a {type(self).__name__} with the same settings {self.settings()}"
            )
        self.stats.merge(other.stats)

    def state(self) -> dict[str, np.ndarray | float | int]:
        """The statistics' state (see :meth:`TensorStatistics.state`); settings come from the constructor."""
        return self.stats.state()

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` returned."""
        self.stats = TensorStatistics.from_state(state)

    def compute_range(self) -> tuple[np.ndarray, np.ndarray]:
        """``(min, max)`` float32 of shape ``()``; ``[0, 0]`` if only zeros or non-finite values were seen."""
        st = self.stats
        if st.count == 0:
            if st.nonfinite == 0:
                raise CalibrationError(
                    f"{self.name} calibrator received no data (update() was never called with values)"
                )
            return np.zeros((), np.float32), np.zeros((), np.float32)
        lo_bound, hi_bound = min(st.min, 0.0), max(st.max, 0.0)
        if lo_bound == hi_bound:
            return np.zeros((), np.float32), np.zeros((), np.float32)
        lo, hi = self._range(st)
        lo = float(np.clip(lo, lo_bound, 0.0))
        hi = float(np.clip(hi, 0.0, hi_bound))
        return _to_float32_within(lo, lo_bound), _to_float32_within(hi, hi_bound)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({opts})"


def _to_float32_within(v: float, bound: float) -> np.ndarray:
    """``v`` as a float32 0-d array, rounded toward 0 if rounding would pass ``bound`` (same sign as ``v``)."""
    f = np.float32(v)
    if abs(float(f)) > abs(bound):
        f = np.nextafter(f, np.float32(0.0))
    return np.asarray(f, np.float32)
