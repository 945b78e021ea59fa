"""Round-to-nearest (RTN) weight-only quantization with min-max group scales.

For each group ``G`` of ``g`` consecutive rows of ``W`` ``[K, N]`` and each column ``n``:

* asymmetric: ``s = (max - min) / (2^b - 1)``, ``z = round(-min / s)`` (range widened to contain 0),
* symmetric: ``s = absmax / (2^(b-1) - 1/2)``, ``z = 2^(b-1)`` (8 for 4 bits),

and ``code = clip(round_half_even(W / s) + z, 0, 2^b - 1)``, so ``|W - W_hat| <= s / 2``.

Symmetric grid: the *full* int4 grid ``[-8, 7]`` with ``s = absmax / 7.5`` (``+absmax``
rounds to 7.5 -> saturates at 7, half a step off; ``-absmax`` is exact at -8) versus the
*narrow* grid ``[-7, 7]`` with ``s = absmax / 7``.  The full grid has a 7 % smaller step and
uses all 16 levels; on Gaussian and on real LLM weights its output error is lower
(``tests/unit/test_woq.py::test_rtn_full_grid_beats_narrow`` pins it), so it is the default;
``narrow=True`` selects the other.  All the scale math is :func:`quantkit.scheme.qparams.group_weight_codes`.
The symmetric default is ONNX Runtime's signed-scale grid (the group's extreme exact at -8, step
``absmax / 8``), and each group's range is clipped by a small search (:func:`clip_ranges`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from quantkit.algorithms.woq import WOQResult, check_weight, register_weight_algorithm, resolve_group_size
from quantkit.calibrate.layer_stats import LayerStats
from quantkit.errors import RecipeError
from quantkit.scheme.qparams import group_weight_codes, signed_group_scale

__all__ = ["rtn"]


CLIP_GRID: tuple[float, ...] = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.79, 0.76)
"""Shrink factors of a group's range tried by :func:`clip_ranges` (1.0 = plain min-max)."""


_CLIP_CHUNK = 1 << 22
"""Weight elements per block of columns in :func:`clip_ranges`."""


def clip_ranges(
    w: np.ndarray, bits: int, g: int, *, symmetric: bool, narrow: bool = False, importance: np.ndarray | None = None,
    grid: tuple[float, ...] = CLIP_GRID,
) -> tuple[np.ndarray, np.ndarray]:
    """Per group and column, the shrunk range ``(r * min, r * max)`` whose rounding error
    ``sum_k importance_k (w_k - w_hat_k)^2`` is least over ``r`` in ``grid`` (the clipping search of
    HQQ / AWQ: a slightly smaller range trades a few clipped outliers for a finer step everywhere).
    ``importance`` ``[K]``: e.g. the diagonal of the layer input's second moment (default 1).

    Columns are independent: a wide weight (a 49k-row lm_head) is searched in blocks of columns, so the float64
    temporaries stay ~30 MB each instead of several times the weight (the same result)."""
    K, N = w.shape
    step = max(1, _CLIP_CHUNK // max(K, 1))
    if N > step:
        parts = [clip_ranges(w[:, j:j + step], bits, g, symmetric=symmetric, narrow=narrow, importance=importance,
                             grid=grid) for j in range(0, N, step)]
        return np.concatenate([p[0] for p in parts], axis=1), np.concatenate([p[1] for p in parts], axis=1)
    kb = -(-K // g)
    pad = kb * g - K
    wp = np.pad(w, ((0, pad), (0, 0))).reshape(kb, g, N) if pad else w.reshape(kb, g, N)
    mn, mx = wp.min(axis=1), wp.max(axis=1)
    imp = np.ones(K) if importance is None else np.asarray(importance, np.float64)
    impg = (np.pad(imp, (0, pad)) if pad else imp).reshape(kb, g, 1)  # (1.0 when None: skipped, the same sums)
    search = _grouped_search if symmetric and not narrow else _generic_search
    best_r = search(w, wp, mn, mx, bits, g, symmetric=symmetric, narrow=narrow,
                    impg=None if importance is None else impg, grid=grid)
    return (mn * best_r).astype(np.float32), (mx * best_r).astype(np.float32)


def _grouped_search(w: np.ndarray, wp: np.ndarray, mn: np.ndarray, mx: np.ndarray, bits: int, g: int, *,
                    symmetric: bool, narrow: bool, impg: np.ndarray | None, grid: tuple[float, ...]) -> np.ndarray:
    """:func:`clip_ranges`' search for the default grid (symmetric, not narrow) in the grouped layout ``wp``
    ``[kb, g, N]`` (rows padded with zeros): per ``r`` the scales of
    :func:`~quantkit.scheme.qparams.group_weight_codes`, the codes of ``QuantizeLinear`` and the float64 error of
    :func:`_generic_search` - the same choice, bit for bit, without expanding each group's scale and zero point to
    the whole weight nine times (5-6x faster: the sensitivity search rounds every candidate of every layer)."""
    kb, _, N = wp.shape
    best = np.full((kb, N), np.inf)
    best_r = np.ones((kb, N))
    wp32 = wp.astype(np.float32, copy=False)  # what QuantizeLinear divides
    w64 = wp.astype(np.float64, copy=False)  # what the error is taken against
    v = np.empty(wp.shape, np.float32)
    d = np.empty(wp.shape, np.float64)
    half = float(2 ** (bits - 1))
    for r in grid:
        s32 = signed_group_scale(mn * r, mx * r, bits)[:, None, :]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            np.divide(wp32, s32, out=v)
        np.rint(v, out=v)
        np.clip(v, -half, half - 1, out=v)  # codes [0, 2^b - 1] around the zero point 2^(b-1)
        np.multiply(v, s32.astype(np.float64), out=d)  # dequantized: (code - zero point) * scale, exact in float64
        np.subtract(d, w64, out=d)
        np.square(d, out=d)
        if impg is not None:
            np.multiply(d, impg, out=d)
        err = d.sum(axis=1)
        take = err < best
        best = np.where(take, err, best)
        best_r = np.where(take, r, best_r)
    return best_r


def _generic_search(w: np.ndarray, wp: np.ndarray, mn: np.ndarray, mx: np.ndarray, bits: int, g: int, *,
                    symmetric: bool, narrow: bool, impg: np.ndarray | None, grid: tuple[float, ...]) -> np.ndarray:
    """:func:`clip_ranges`' search for any grid: each ``r`` through
    :func:`~quantkit.scheme.qparams.group_weight_codes` and a float64 dequantization."""
    K, N = w.shape
    kb = wp.shape[0]
    pad = kb * g - K
    best = np.full((kb, N), np.inf)
    best_r = np.ones((kb, N))
    for r in grid:
        s, q, z = group_weight_codes(w, bits, g, symmetric=symmetric, narrow=narrow, min_val=mn * r, max_val=mx * r)
        deq = (q.astype(np.float64) - np.repeat(z, g, axis=0)[:K]) * np.repeat(s, g, axis=0)[:K]
        e = (deq - w) ** 2
        ep = np.pad(e, ((0, pad), (0, 0))).reshape(kb, g, N) if pad else e.reshape(kb, g, N)
        err = (ep if impg is None else ep * impg).sum(axis=1)
        take = err < best
        best = np.where(take, err, best)
        best_r = np.where(take, r, best_r)
    return best_r


@register_weight_algorithm("rtn")
def rtn(
    W: np.ndarray,
    *,
    bits: int = 4,
    group_size: int | None = 128,
    symmetric: bool = True,
    stats: LayerStats | None = None,
    narrow: bool = False,
    clip: bool = True,
    **options: Any,
) -> WOQResult:
    """Round-to-nearest quantization of ``W`` ``[K, N]`` in groups of ``group_size`` rows along K.

    ``clip`` (default on): each group's range is shrunk by the :func:`clip_ranges` search, weighted by
    the input's per-feature second moment when ``stats`` are given (else data-free).  ``clip=False`` is
    plain min-max RTN.  ``group_size`` ``None`` / ``-1`` means one group of ``K`` (per output channel).
    """
    if options:
        raise RecipeError(f"rtn: unknown options {sorted(options)}; allowed: narrow, clip")
    w = check_weight(W, bits)
    g = resolve_group_size(w.shape[0], group_size)
    K, N = w.shape
    step = max(1, _CLIP_CHUNK // max(K, 1))
    if N > step:  # columns are independent: in blocks, so the float64 temporaries stay small (same codes)
        parts = [rtn(w[:, j:j + step], bits=bits, group_size=g, symmetric=symmetric, stats=stats, narrow=narrow,
                     clip=clip) for j in range(0, N, step)]
        return WOQResult(np.concatenate([p.codes for p in parts], axis=1),
                         np.concatenate([p.scales for p in parts], axis=1),
                         np.concatenate([p.zero_points for p in parts], axis=1), bits, g, symmetric)
    if clip:
        imp = stats.diagonal() if stats is not None and stats.count else None
        mn, mx = clip_ranges(w, bits, g, symmetric=symmetric, narrow=narrow, importance=imp)
        scales, codes, zps = group_weight_codes(w, bits, g, symmetric=symmetric, narrow=narrow, min_val=mn, max_val=mx)
    else:
        scales, codes, zps = group_weight_codes(w, bits, g, symmetric=symmetric, narrow=narrow)
    return WOQResult(codes, scales, zps, bits, g, symmetric)
