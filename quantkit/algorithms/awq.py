"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"), for ``y = x @ W`` with ``W`` ``[K, N]``.

Salient input channels (large mean ``|x|``) are protected by scaling them up before
quantization and dividing the activation by the same factor::

    y = x @ W = (x / s) @ (diag(s) W)  ~  (x / s) @ Q(diag(s) W)

1. **Scale search.**  ``s = mean|x|^alpha`` (clamped at ``1e-4``, normalised by
   ``sqrt(max(s) min(s))``), ``alpha`` on ``n_grid = 20`` points of ``[0, 1]``; keep the
   ``alpha`` minimising ``|| (X / s) Q(diag(s) W) - X W ||^2`` on the reservoir rows ``X`` of
   :class:`~quantkit.calibrate.layer_stats.LayerStats`.  ``alpha = 0`` (``s = 1``) is plain RTN, so
   the chosen scale is never worse than RTN on those rows.
2. **Clipping search.**  For each group (``g`` rows of K) and output column, shrink the
   group's range ``[min, max]`` by ``r`` in ``{1, 0.95, ..., 0.55}`` (``max_shrink = 0.5``) and keep
   the ``r`` minimising that group's share of the output error
   ``|| X'_G (Q_r(W'_G) - W'_G) ||^2`` (``X' = X / s``, ``W' = diag(s) W``).  ``r = 1`` is included.

``diag(s)^-1`` cannot be folded into ``MatMulNBits`` (its scales are per group and output
column, not per input row), so the result carries ``input_scale = s``:
``y = (x / s) @ W_hat``.  The lowering (:mod:`quantkit.lowering.nbits`) folds ``1 / s`` into
a preceding normalisation / constant ``Mul`` when every consumer shares it, else inserts a
``Mul``.  Layers reading the same input (q/k/v; gate/up) must share one ``s``:
:func:`awq_shared` searches it on the concatenated weight ``[W_1 | W_2 | ...]``, whose
loss is the sum of the layers' output errors.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from quantkit.algorithms.woq import WOQResult, check_weight, register_weight_algorithm, resolve_group_size
from quantkit.calibrate.layer_stats import LayerStats
from quantkit.errors import CalibrationError, RecipeError
from quantkit.scheme.qparams import dequantize, group_weight_codes

__all__ = ["awq", "awq_shared"]


def _fake_quant(w: np.ndarray, bits: int, g: int, symmetric: bool, narrow: bool) -> np.ndarray:
    s, q, z = group_weight_codes(w, bits, g, symmetric=symmetric, narrow=narrow)
    return dequantize(q, s, z, axis=0, block_size=g)


def awq_shared(
    Ws: list[np.ndarray],
    stats: LayerStats | None,
    *,
    bits: int = 4,
    group_size: int | None = 128,
    symmetric: bool = True,
    n_grid: int = 20,
    max_shrink: float = 0.5,
    max_rows: int = 1024,
    clip_rows: int = 512,
    narrow: bool = False,
    gptq: bool = False,
    signround: bool = False,
    iters: int = 50,
    refit: int = 0,
    refit_iters: int | None = None,
) -> list[WOQResult]:
    """AWQ for layers that read the same input: one input scale ``s`` ``[K]`` for all of ``Ws``.

    ``gptq=True`` (AWQ then GPTQ): after the scale search, the scaled weights ``diag(s) W`` are rounded by
    GPTQ with the Hessian of the scaled inputs ``X / s`` (``diag(1/s) H diag(1/s)``) instead of the
    clipping search + round-to-nearest.  ``signround=True``: the result (GPTQ's or the clipped RTN's) is then
    refined by signed gradient descent on the same scaled Hessian (:func:`quantkit.algorithms.signround.signround_from`,
    ``iters`` steps, then ``refit`` rounds of scale refits with ``refit_iters`` steps each, as for ``signround``)."""
    if iters < 0 or refit < 0 or (refit_iters is not None and refit_iters < 0):
        raise RecipeError(f"awq: need iters, refit, refit_iters >= 0 (got iters={iters}, refit={refit}, "
                          f"refit_iters={refit_iters})")
    if stats is None or stats.count == 0 or stats.samples.shape[0] == 0:
        raise CalibrationError("awq needs calibration statistics with sampled input rows (stats=LayerStats)")
    mats = [check_weight(W, bits) for W in Ws]
    K = mats[0].shape[0]
    if any(m.shape[0] != K for m in mats) or stats.K != K:
        raise CalibrationError(
            f"awq_shared: weights {[m.shape for m in mats]} and stats K={stats.K} disagree on K"
        )
    widths = [m.shape[1] for m in mats]
    W = np.concatenate(mats, axis=1)
    g = resolve_group_size(K, group_size)
    X = stats.samples[:max_rows].astype(np.float32)
    out = X @ W
    x_mean = np.maximum(stats.mean_abs, 1e-4)

    # 1. scale search
    best_loss, best_s = np.inf, np.ones(K, np.float32)
    for alpha in np.linspace(0.0, 1.0, n_grid):
        s64 = x_mean**alpha
        s64 = s64 / np.sqrt(s64.max() * s64.min())
        s = s64.astype(np.float32)
        Wq = _fake_quant((W * s[:, None]).astype(np.float32), bits, g, symmetric, narrow)
        loss = float(np.mean(((X / s) @ Wq - out) ** 2))
        if loss < best_loss:
            best_loss, best_s = loss, s
    s = best_s

    # 2. clipping search on W' = diag(s) W with inputs X' = X / s
    Ws_ = (W * s[:, None]).astype(np.float32)
    if gptq:
        from quantkit.algorithms.gptq import gptq as run_gptq

        s64 = s.astype(np.float64)
        Hs = stats.hessian() / np.outer(s64, s64)
        r = run_gptq(Ws_, bits=bits, group_size=g, symmetric=symmetric, hessian=Hs, narrow=narrow)
        if signround:
            r = _signround(Ws_, Hs, r, iters, refit, refit_iters)
        sc, q, z = r.scales, r.codes, r.zero_points
        return _split(q, sc, z, widths, bits, g, symmetric, s)
    Xc = (X[:clip_rows] / s).astype(np.float32)
    starts = np.arange(0, K, g)
    mn = np.minimum.reduceat(Ws_, starts, axis=0)
    mx = np.maximum.reduceat(Ws_, starts, axis=0)
    best_err = np.full(mn.shape, np.inf)
    best_r = np.ones(mn.shape, np.float32)
    for i in range(max(1, int(max_shrink * n_grid))):
        r = np.float32(1.0 - i / n_grid)
        sc, q, z = group_weight_codes(
            Ws_, bits, g, symmetric=symmetric, narrow=narrow, min_val=mn * r, max_val=mx * r
        )
        D = dequantize(q, sc, z, axis=0, block_size=g) - Ws_
        err = np.stack([np.sum((Xc[:, b : b + g] @ D[b : b + g]) ** 2, axis=0) for b in starts])
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_r = np.where(better, r, best_r)
    sc, q, z = group_weight_codes(
        Ws_, bits, g, symmetric=symmetric, narrow=narrow, min_val=mn * best_r, max_val=mx * best_r
    )
    if signround:
        s64 = s.astype(np.float64)
        r = _signround(Ws_, stats.hessian() / np.outer(s64, s64), WOQResult(q, sc, z, bits, g, symmetric), iters,
                       refit, refit_iters)
        sc, q, z = r.scales, r.codes, r.zero_points

    return _split(q, sc, z, widths, bits, g, symmetric, s)


def _signround(w: np.ndarray, H: np.ndarray, init: WOQResult, iters: int, refit: int,
               refit_iters: int | None) -> WOQResult:
    from quantkit.algorithms.signround import signround_from

    return signround_from(w, H, init, iters=iters, refit=refit, refit_iters=refit_iters)


def _split(q: np.ndarray, sc: np.ndarray, z: np.ndarray, widths: list[int], bits: int, g: int, symmetric: bool,
           s: np.ndarray) -> list[WOQResult]:
    """One result per layer from the column blocks of the concatenated weights (one shared input scale)."""
    results = []
    offsets = np.cumsum([0, *widths])
    for a, b in zip(offsets[:-1], offsets[1:], strict=True):
        results.append(WOQResult(np.ascontiguousarray(q[:, a:b]), np.ascontiguousarray(sc[:, a:b]),
                                 np.ascontiguousarray(z[:, a:b]), bits, g, symmetric, input_scale=s.copy()))
    return results


AWQ_OPTIONS = frozenset({"n_grid", "max_shrink", "max_rows", "clip_rows", "narrow", "gptq", "signround", "iters",
                         "refit", "refit_iters"})


@register_weight_algorithm("awq")
def awq(
    W: np.ndarray,
    *,
    bits: int = 4,
    group_size: int | None = 128,
    symmetric: bool = True,
    stats: LayerStats | None = None,
    **options: Any,
) -> WOQResult:
    """AWQ of a single layer (see :func:`awq_shared`; options: n_grid, max_shrink, max_rows, clip_rows, narrow,
    gptq = AWQ's scales then GPTQ rounding, signround = then signed-gradient refinement with iters, refit,
    refit_iters as for ``signround``)."""
    allowed = AWQ_OPTIONS
    if set(options) - allowed:
        raise RecipeError(
            f"awq: unknown options {sorted(set(options) - allowed)}; allowed: {sorted(allowed)}"
        )
    return awq_shared([W], stats, bits=bits, group_size=group_size, symmetric=symmetric, **options)[0]


awq.options = AWQ_OPTIONS  # what the recipe may pass (checked when it loads)
