"""A streaming histogram of signed values whose result does not depend on how the data was batched.

Layout.  ``bins`` (even) equal bins over the symmetric range ``[-R, R]``, ``R = 2**e`` a power
of two, bin width ``w = 2R / bins``, ``h = bins / 2`` bins on each side of 0.  A finite value
``x`` goes to the bin with signed offset ``b = f(t)`` from the middle (array index ``b + h``),
where ``t = (x / R) * h`` and::

    f(t) = ceil(t) - 1   for t > 0      bin b >= 0 is  (b w, (b+1) w]   (bin 0 is [0, w])
    f(t) = floor(t)      for t <= 0     bin b <  0 is  [b w, (b+1) w)

i.e. every bin is closed on the side away from 0.  ``f`` maps ``[-h, h]`` onto ``[-h, h-1]``, so
``x = ±R`` lands in the outermost bins and no clipping is ever needed.

Range.  ``R`` is the smallest power of two ``>= max|x|`` over everything seen (clamped below at
``2**-126``, the smallest normal float32, so that it is never denormal; ``R = 1`` while only
zeros have been seen).  When a batch has ``max|x| > R``, ``R`` is doubled ``d`` times and the
counts are re-binned by ``b -> floor(b / 2**d)``.

Why re-binning is exact, and the result independent of batching.  Doubling ``R`` doubles
``w``; the new edges are ``-2R + 2jw`` and the old ones ``-2R + (k + h) w``.  Every new edge that
lies inside the old range ``[-R, R]`` is therefore an old edge (index ``k = 2j - h``, an integer
because ``bins`` is even), so each new bin is a union of whole old bins: counts move, none is
split.  Which old bins: the binning itself commutes with the re-binning, ``f(t / 2) =
floor(f(t) / 2)`` for every ``t`` in ``[-h, h]`` — for ``t <= 0`` this is ``floor(t/2) =
floor(floor(t)/2)``; for ``t > 0`` with ``n = ceil(t)`` it is ``ceil(n/2) - 1 = floor((n-1)/2)``.
It holds for the computed ``t`` as well, because ``x / R`` and ``x / (2R)`` differ by an exact
power-of-two factor and float rounding commutes with such factors (barring underflow to
float64 subnormals).  Applying it ``d`` times gives ``floor(b / 2**d)``.  Hence a value binned
at any ``R`` and re-binned to a larger ``R'`` sits in exactly the bin it would have been put in
at ``R'`` directly; the final ``R`` depends only on the global ``max|x|``, and counts are
additive, so the final histogram is identical for every split and order of the data (and
:meth:`StreamingHistogram.merge` equals histogramming the union once).

Non-finite values (NaN, ±inf) are not binned; they are counted in ``nonfinite``.
Memory is O(bins) whatever the number of samples.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["StreamingHistogram", "histogram_quantile"]

_MIN_EXP = -126  # R >= 2**-126: the smallest normal float32
_MAX_EXP = 1023  # 2**1024 overflows float64


def _exponent_for(amax: float) -> int:
    """Smallest ``e`` with ``2**e >= amax`` (``amax > 0``), clamped to ``[_MIN_EXP, _MAX_EXP]``."""
    m, e = math.frexp(amax)  # amax = m * 2**e, 0.5 <= m < 1
    e = e - 1 if m == 0.5 else e
    return min(max(e, _MIN_EXP), _MAX_EXP)


def histogram_quantile(counts: npt.ArrayLike, edges: npt.ArrayLike, q: npt.ArrayLike) -> np.ndarray:
    """Quantiles ``q`` (in ``[0, 1]``) of a histogram, interpolating linearly inside a bin.

    With ``N = sum(counts)`` and ``C_k`` the cumulative count up to the right edge of bin ``k``,
    the quantile ``q`` lies in the first bin ``k`` with ``C_k >= qN`` and is
    ``edges[k] + (qN - C_{k-1}) / counts[k] * (edges[k+1] - edges[k])`` (values uniform inside
    a bin).  ``q = 0`` gives the left edge of the first non-empty bin, ``q = 1`` the right
    edge of the last one.  Returns float64 of ``q``'s shape; NaN when ``N == 0``.
    """
    c = np.asarray(counts, np.float64)
    e = np.asarray(edges, np.float64)
    qa = np.clip(np.asarray(q, np.float64), 0.0, 1.0)
    cum = np.cumsum(c)
    total = cum[-1] if cum.size else 0.0
    if total <= 0:
        return np.full(qa.shape, np.nan)
    target = qa * total
    # first bin whose cumulative count reaches the target; q = 0 -> first non-empty bin
    k = np.searchsorted(cum, target, side="left")
    k = np.where(target <= 0, np.argmax(c > 0), k)
    k = np.minimum(k, c.size - 1)
    before = np.where(k > 0, cum[np.maximum(k - 1, 0)], 0.0)
    frac = np.where(c[k] > 0, (target - before) / np.where(c[k] > 0, c[k], 1.0), 0.0)
    return np.asarray(e[k] + np.clip(frac, 0.0, 1.0) * (e[k + 1] - e[k]))


_CHUNK = 1 << 16  # values binned per step of StreamingHistogram._add_finite
_SCRATCH = threading.local()


def _scratch(dtype: np.dtype[Any]) -> tuple[np.ndarray, ...]:
    """This thread's reused buffers for one chunk: t, b (``dtype``), two masks, the indices."""
    bufs: dict[Any, tuple[np.ndarray, ...]] = _SCRATCH.__dict__.setdefault("bufs", {})
    key = np.dtype(dtype)
    if key not in bufs:
        bufs[key] = (np.empty(_CHUNK, key), np.empty(_CHUNK, key), np.empty(_CHUNK, bool), np.empty(_CHUNK, bool),
                     np.empty(_CHUNK, np.intp))
    return bufs[key]


class StreamingHistogram:
    """Histogram of signed values over ``[-R, R]``, ``R`` a power of two (see the module docstring).

    Args:
        bins: number of equal bins, even and ``>= 64``.

    Attributes:
        counts: int64 array of length ``bins``.
        nonfinite: number of NaN / ±inf values seen (not binned).
    """

    def __init__(self, bins: int = 8192) -> None:
        if isinstance(bins, bool) or not isinstance(bins, int | np.integer) or bins < 64 or bins % 2:
            raise ValueError(
                f"StreamingHistogram: bins={bins!r} is not allowed; allowed: an even integer >= 64"
            )
        self.bins = int(bins)
        self.counts = np.zeros(self.bins, np.int64)
        self.nonfinite = 0
        self._exp: int | None = None  # R = 2**_exp; None while only zeros were seen

    # ---------------------------------------------------------------- geometry
    @property
    def R(self) -> float:  # noqa: N802  (the symbol of the math)
        """Half-width of the histogram range (a power of two; 1.0 while only zeros were seen)."""
        return 1.0 if self._exp is None else math.ldexp(1.0, self._exp)

    @property
    def total(self) -> int:
        """Number of finite values binned."""
        return int(self.counts.sum())

    def edges(self) -> np.ndarray:
        """The ``bins + 1`` bin edges ``-R + k * 2R / bins`` (float64, exact)."""
        r = self.R
        return -r + np.arange(self.bins + 1, dtype=np.float64) * (2.0 * r / self.bins)

    def centers(self) -> np.ndarray:
        """The ``bins`` bin centres (float64)."""
        e = self.edges()
        return 0.5 * (e[:-1] + e[1:])

    def abs_counts(self) -> np.ndarray:
        """Histogram of ``|x|`` over ``[0, R]`` with ``bins / 2`` bins (the two halves folded onto each other).

        Bin ``j`` holds the values with ``|x|`` in bin ``j`` of the positive side or in its mirror
        ``h - 1 - j`` of the negative side (``h = bins / 2``).
        """
        h = self.bins // 2
        return self.counts[h:] + self.counts[:h][::-1]

    # ---------------------------------------------------------------- streaming
    def update(self, x: npt.ArrayLike) -> None:
        """Bin one batch (any shape); NaN / ±inf are counted in :attr:`nonfinite`, not binned."""
        arr = np.asarray(x, dtype=np.float64).ravel()
        if arr.size == 0:
            return
        finite = np.isfinite(arr)
        if not finite.all():
            self.nonfinite += int(arr.size - np.count_nonzero(finite))
            arr = arr[finite]
            if arr.size == 0:
                return
        self._add_finite(arr, float(np.max(np.abs(arr))))

    def _add_finite(self, values: np.ndarray, amax: float) -> None:
        """Bin finite float64 ``values`` with ``max|values| == amax`` (used by ``TensorStatistics``)."""
        if amax > 0.0:
            self._grow_to(_exponent_for(amax))
        if self._exp is None:  # only zeros so far: they all go to the middle bin at every R
            self.counts[self.bins // 2] += values.size
            return
        h = self.bins // 2
        # t = x * (h / R): h / R is exact (R a power of two), so this equals (x / R) * h bit for bit.
        scale = h / math.ldexp(1.0, self._exp)  # a power of two
        if values.dtype == np.float32 and not (2.0**-120 < scale < 2.0**120):
            values = values.astype(np.float64)  # keep the power-of-two scaling exact (no float32 overflow)
        # in chunks through small reused buffers: every pass stays in cache, and no call allocates (and page-faults
        # in) temporaries the size of the tensor
        s = values.dtype.type(scale)
        t_buf, b_buf, e_buf, p_buf, i_buf = _scratch(values.dtype)
        for lo in range(0, values.size, _CHUNK):
            v = values[lo : lo + _CHUNK]
            k = v.size
            t = np.multiply(v, s, out=t_buf[:k])
            b = np.floor(t, out=b_buf[:k])
            on_edge = np.equal(b, t, out=e_buf[:k])  # f(t) = ceil(t) - 1 = t - 1 for positive integer t
            if on_edge.any():  # (values on a bin's right edge): b - 1 there
                np.logical_and(on_edge, np.greater(t, 0, out=p_buf[:k]), out=on_edge)
                np.subtract(b, on_edge, out=b)
            b += h  # b is an integer in [-h, h - 1]: adding h is exact in float
            idx = i_buf[:k]
            idx[...] = b  # straight to the index type bincount uses (no second cast inside it)
            if self._exp == _MAX_EXP:  # only values beyond 2**1023 can fall outside
                np.clip(idx, 0, self.bins - 1, out=idx)
            self.counts += np.bincount(idx, minlength=self.bins)

    def _grow_to(self, exp: int) -> None:
        """Make ``R >= 2**exp`` by doubling, merging bins exactly (``b -> floor(b / 2**d)``)."""
        if self._exp is None:
            self._exp = exp  # the counts hold zeros only, in the middle bin at any R
            return
        d = exp - self._exp
        if d <= 0:
            return
        self.counts = _rebin(self.counts, d)
        self._exp = exp

    def merge(self, other: StreamingHistogram) -> None:
        """Add ``other``'s counts (the one with the smaller ``R`` is re-binned up first); exact."""
        if not isinstance(other, StreamingHistogram) or other.bins != self.bins:
            raise ValueError("merge() needs a StreamingHistogram with the same number of bins")
        theirs = other.counts
        if other._exp is not None:
            if self._exp is None or other._exp > self._exp:
                self._grow_to(other._exp)
            elif other._exp < self._exp:
                theirs = _rebin(theirs, self._exp - other._exp)
        self.counts = self.counts + theirs
        self.nonfinite += other.nonfinite

    # ---------------------------------------------------------------- statistics
    def quantile(self, q: npt.ArrayLike) -> np.ndarray:
        """Quantiles of the signed values (see :func:`histogram_quantile`)."""
        return histogram_quantile(self.counts, self.edges(), q)

    def abs_quantile(self, q: npt.ArrayLike) -> np.ndarray:
        """Quantiles of ``|x|`` from the folded histogram :meth:`abs_counts` over ``[0, R]``."""
        h = self.bins // 2
        return histogram_quantile(self.abs_counts(), self.edges()[h:], q)

    # ---------------------------------------------------------------- (de)serialisation
    def state(self) -> dict[str, np.ndarray | float | int]:
        """``counts`` (int64), ``range`` (``R``; 0.0 while only zeros were seen), ``nonfinite``."""
        return {
            "counts": self.counts.copy(),
            "range": 0.0 if self._exp is None else self.R,
            "nonfinite": self.nonfinite,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> StreamingHistogram:
        """Rebuild from :meth:`state` (values may be numbers or 0-d arrays, as read from ``.npz``)."""
        counts = np.asarray(state["counts"])
        if counts.ndim != 1 or counts.dtype.kind not in "iu" or np.any(counts < 0):
            raise ValueError("histogram state: 'counts' must be a 1-D array of non-negative integers")
        hist = cls(int(counts.size))
        hist.counts = counts.astype(np.int64, copy=True)
        hist.nonfinite = int(np.asarray(state["nonfinite"]))
        r = float(np.asarray(state["range"]))
        if r != 0.0:
            m, e = math.frexp(r)
            if m != 0.5 or not _MIN_EXP <= e - 1 <= _MAX_EXP:
                raise ValueError(f"histogram state: range={r} is not a power of two in [2**-126, 2**1023]")
            hist._exp = e - 1
        elif np.any(np.delete(hist.counts, hist.bins // 2)):
            raise ValueError("histogram state: range 0 (only zeros seen) but counts outside the middle bin")
        return hist

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StreamingHistogram):
            return NotImplemented
        return (
            self.bins == other.bins
            and self._exp == other._exp
            and self.nonfinite == other.nonfinite
            and bool(np.array_equal(self.counts, other.counts))
        )

    __hash__ = None  # type: ignore[assignment]  # mutable: not hashable

    def __repr__(self) -> str:
        return f"StreamingHistogram(bins={self.bins}, R={self.R}, total={self.total}, nonfinite={self.nonfinite})"


def _rebin(counts: np.ndarray, d: int) -> np.ndarray:
    """Counts after doubling ``R`` ``d`` times: the bin at offset ``b`` moves to ``floor(b / 2**d)``."""
    bins = counts.size
    h = bins // 2
    offsets = np.arange(bins, dtype=np.int64) - h
    new_idx = np.right_shift(offsets, min(d, 62)) + h  # arithmetic shift == floor division by 2**d
    out = np.zeros(bins, np.int64)
    np.add.at(out, new_idx, counts)
    return out
