"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"), for ``y = x @ W`` with ``W`` ``[K, N]``.

Objective: ``min_{W_hat} ||X W - X W_hat||_F^2 = tr((W - W_hat)^T H (W - W_hat))`` with
``H = X^T X`` (``[K, K]``, from :class:`~quantkit.calibrate.layer_stats.LayerStats`).  Rows of ``W``
(input features) are quantized one at a time; after row ``q`` is rounded, the optimal
(OBS) update of the rows not yet quantized is

    delta_F = -(w_q - quant(w_q)) / [H_F^-1]_qq  *  [H_F^-1]_{q, F}

and the paper's reformulation makes all ``H_F^-1`` rows available at once from the upper
Cholesky factor ``U`` of ``H^-1`` (``H^-1 = U^T U``): the error of row ``i`` is
``E_i = (w_i - quant(w_i)) / U_ii`` and rows ``j > i`` get ``W_j -= U_ij E_i``.

Details, as in the reference implementation:

* damping: ``H += percdamp * mean(diag(H)) * I`` (``percdamp = 0.01``); retried with 10x more
  damping if the Cholesky factorisation fails;
* dead inputs (``H_ii = 0``, the feature is always 0): ``H_ii = 1`` and the row of ``W`` is set to 0;
* lazy batch updates: rows are processed in blocks of ``block_size = 128``; inside a
  block the updates are applied row by row, the rest of ``W`` is updated once per block
  (``W[i2:] -= U[i1:i2, i2:]^T E``);
* groups: min-max qparams of each group of ``g`` rows (the grid of
  :func:`~quantkit.scheme.qparams.group_weight_codes`), computed when the group's first row
  is reached, i.e. from the weights already updated by all earlier rows;
* precision: the factorization and the row loop in float32, as the reference implementation (which runs on a
  GPU), for layers of more than :data:`FLOAT64_MAX_K` inputs, float64 below (``precision: auto``); the Hessian is
  gathered reordered, band by band, into one ``K x K`` array that LAPACK factorizes and inverts in place, and the
  lazy block updates are one in-place GEMM each; the column slices of a wide layer share one factorization
  (:class:`GPTQFactor`);
* act-order (``act_order=True``): rows are processed in order of decreasing ``H_ii``.
  Groups must stay contiguous in the original K order (``MatMulNBits`` and blocked
  ``DequantizeLinear`` groups are contiguous along K), so this uses the "static groups"
  variant: every group's qparams are computed up front from the (dead-zeroed) original ``W``.

The returned codes and scales are exactly those GPTQ rounded to: nothing is re-quantized
afterwards (re-fitting scales to the GPTQ output moves every weight again and undoes the
error compensation).  With ``H = I`` there is nothing to compensate and the result equals RTN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg

from quantkit.algorithms.rtn import clip_ranges
from quantkit.algorithms.woq import WOQResult, check_weight, register_weight_algorithm, resolve_group_size
from quantkit.calibrate.layer_stats import LayerStats
from quantkit.errors import CalibrationError, RecipeError
from quantkit.scheme.qparams import dequantize, group_weight_codes, quantize

__all__ = ["FLOAT64_MAX_K", "GPTQFactor", "gptq", "gptq_factor", "inverse_hessian_cholesky", "obs_rounding",
           "work_precision"]

FLOAT64_MAX_K = 4096
"""``precision: auto``: the widest layer input factorized in float64 (a ``K x K`` float64 of 128 MB, 3.7 s against
float32's 3.1 s for a 4096 x 4096 layer on 2 cores); wider layers are factorized in float32, where the time and memory
grow as ``K^3`` / ``K^2`` (a 7B down_proj, K = 11008: 12.2 s and 0.76 GB instead of 21 s and 1.36 GB)."""


def work_precision(K: int) -> str:
    """The dtype ``precision: auto`` computes a layer with ``K`` inputs in."""
    return "float64" if K <= FLOAT64_MAX_K else "float32"


def inverse_hessian_cholesky(H: np.ndarray, percdamp: float = 0.01, *, order: np.ndarray | None = None,
                             scale: float = 1.0, dtype: Any = np.float64) -> np.ndarray:
    """Upper Cholesky factor ``U`` of ``(A + damp I)^-1`` (``= U^T U``) with ``A = scale * H[order][:, order]``
    (dead inputs, ``A_ii = 0``, get ``A_ii = 1``) and ``damp = percdamp * mean(diag A)``, computed in ``dtype``.

    If ``A + damp I`` is not positive definite the damping is multiplied by 10 (up to 6 times).  ``H`` is only
    read, a band of rows at a time: the work takes one ``K x K`` array of ``dtype`` (float32: a quarter of the
    float64 copies a direct ``inv`` / ``cholesky`` would hold).
    """
    K = H.shape[0]
    idx = np.arange(K) if order is None else np.asarray(order)
    diag = np.diag(H)[idx].astype(np.float64) * scale
    dead = diag == 0
    diag[dead] = 1.0
    damp = percdamp * float(np.mean(diag))
    if damp <= 0.0:
        damp = percdamp
    # With J the reversal permutation, J A J = L L^T gives A = R R^T with R = J L J upper triangular, so
    # A^-1 = (R^-1)^T R^-1 and U = R^-1 = J L^-1 J: one Cholesky and one triangular inverse instead of
    # inverse + second Cholesky.  J A J is gathered (and cast) straight from H, a band of rows at a time.
    rev = idx[::-1]
    Ar = np.empty((K, K), dtype)
    band = max(1, (64 << 20) // (8 * K))
    potrf, trtri = scipy.linalg.lapack.get_lapack_funcs(("potrf", "trtri"), (Ar,))
    for _ in range(7):
        for a in range(0, K, band):
            rows = np.asarray(H[rev[a:a + band]])[:, rev]
            np.multiply(rows, scale, out=Ar[a:a + band], casting="same_kind")
        d = Ar.reshape(-1)[:: K + 1]  # a view of the diagonal
        d[dead[::-1]] = 1.0
        d += damp
        # Ar is symmetric, so its Fortran-ordered view Ar.T is the same matrix: LAPACK then works in Ar's memory
        L, info = potrf(Ar.T, lower=1, clean=1, overwrite_a=1)
        if info == 0:
            Linv, info = trtri(L, lower=1, overwrite_c=1)
            if info == 0:  # Linv is Fortran-ordered: Linv.T is C-ordered, reversed it is U^T
                return _reverse_in_place(Linv.T).T
        damp *= 10.0  # (Ar refilled from H: the failed factorization overwrote part of it)
    raise CalibrationError("gptq: the Hessian is not positive definite even with heavy damping")


def _reverse_in_place(a: np.ndarray) -> np.ndarray:
    """``a[::-1, ::-1]`` of a C-contiguous square array, in its own memory (reversing both axes reverses the
    flat array), swapped a band at a time instead of copying the whole matrix."""
    a = np.ascontiguousarray(a)
    f = a.reshape(-1)
    n = f.size
    half = n // 2
    step = 1 << 22
    for i in range(0, half, step):
        j = min(i + step, half)
        tmp = f[i:j].copy()
        f[i:j] = f[n - j:n - i][::-1]
        f[n - j:n - i] = tmp[::-1]
    return a


def obs_rounding(Wm: np.ndarray, U: np.ndarray, round_row: Callable[[int, np.ndarray, int], np.ndarray],
                 block_size: int) -> None:
    """GPTQ's row loop with lazy block updates (module docstring), the rounding left to ``round_row``.

    ``round_row(r, W1, i)`` rounds row ``r`` (= row ``i`` of the current block ``W1``, already updated by
    every earlier row) and returns its dequantized value; the OBS update then spreads the row's error
    ``(w_r - dq) / U_rr`` over the rows not yet rounded.  ``Wm`` is updated in place."""
    K = Wm.shape[0]
    gemm = scipy.linalg.blas.get_blas_funcs("gemm", (Wm, U))
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        W1 = Wm[i1:i2].copy()
        E1 = np.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            dq = round_row(i1 + i, W1, i)
            err = (W1[i] - dq) / U1[i, i]
            W1[i + 1 :] -= np.outer(U1[i, i + 1 :], err)
            E1[i] = err
        if i2 < K:  # Wm[i2:] -= U[i1:i2, i2:]^T E1, written in place (as its transpose, Fortran-ordered): no
            # temporary the size of the rows left - a wide layer's largest array after W itself
            out = gemm(-1.0, E1.T, U[i1:i2, i2:], beta=1.0, c=Wm[i2:].T, overwrite_c=1)
            if not np.shares_memory(out, Wm):  # (BLAS worked on a copy: a non-contiguous Wm, mixed dtypes)
                Wm[i2:] = out.T


@dataclass(frozen=True)
class GPTQFactor:
    """What GPTQ derives from a layer's Hessian alone, whatever its weight: the processing order ``perm``
    (act-order), the diagonal ``diag`` of ``H / count`` (original order; dead inputs at 1), the ``dead`` inputs and the
    upper factor ``U`` of the reordered, damped inverse (:func:`inverse_hessian_cholesky`).  A wide layer's column
    slices share one (the factorization is the ``K^3`` part of the work)."""

    K: int
    percdamp: float
    act_order: bool
    precision: str
    perm: np.ndarray
    diag: np.ndarray
    dead: np.ndarray
    U: np.ndarray


def gptq_factor(stats: LayerStats | None = None, hessian: np.ndarray | None = None, *, K: int | None = None,
                percdamp: float = 0.01, act_order: bool = True, precision: str = "auto") -> GPTQFactor:
    """:class:`GPTQFactor` of ``stats`` (``Σxᵀx / count``, read in place) or of ``hessian`` (``[K, K]``); ``K``, when
    given, is checked against the Hessian's."""
    if precision not in ("auto", "float32", "float64"):
        raise RecipeError(f"gptq: precision {precision!r} is not supported; allowed: auto, float32, float64")
    scale = 1.0
    if hessian is not None:
        H = np.asarray(hessian)
    elif stats is not None:
        if stats.count == 0:
            raise CalibrationError("LayerStats: no inputs were collected for this layer")
        H, scale = stats.H, 1.0 / stats.count  # read in place: H / count is taken a band of rows at a time
    else:
        raise CalibrationError("gptq needs calibration statistics (stats=LayerStats) of the layer input")
    k = H.shape[0]
    if H.shape != (k, k) or (K is not None and k != K):
        raise CalibrationError(f"gptq: Hessian shape {H.shape} does not match the weight's K={K}")
    work = work_precision(k) if precision == "auto" else precision
    diag = np.diag(H).astype(np.float64) * scale
    dead = diag == 0
    diag[dead] = 1.0
    perm = np.argsort(-diag, kind="stable") if act_order else np.arange(k)
    U = inverse_hessian_cholesky(H, percdamp, order=perm, scale=scale, dtype=np.dtype(work))
    return GPTQFactor(k, percdamp, act_order, work, perm, diag, dead, U)


@register_weight_algorithm("gptq")
def gptq(
    W: np.ndarray,
    *,
    bits: int = 4,
    group_size: int | None = 128,
    symmetric: bool = True,
    stats: LayerStats | None = None,
    percdamp: float = 0.01,
    act_order: bool = True,
    block_size: int = 128,
    narrow: bool = False,
    hessian: np.ndarray | None = None,
    clip: bool = True,
    precision: str = "auto",
    factor: GPTQFactor | None = None,
    refit: bool = False,
    **options: Any,
) -> WOQResult:
    """GPTQ-quantize ``W`` ``[K, N]`` using the input second moment from ``stats`` (or ``hessian``).

    Returns the codes / scales GPTQ chose (groups of ``group_size`` rows along K).  ``precision``: the dtype of the
    factorization and the row loop: ``float32`` (the reference implementation's; half the time and memory of
    float64 on a wide layer, the same output error on real layers), ``float64``, or ``auto``: float64 up to
    :data:`FLOAT64_MAX_K` inputs (a ``K x K`` of at most 128 MB: cheap), float32 above.  ``factor``: the Hessian's
    factorization from :func:`gptq_factor` with the same settings, shared by the column slices of a wide layer.
    ``refit``: after the rounding, the group scales that minimise the layer's output error for the chosen codes
    (:func:`~quantkit.algorithms.scale_refit.refit_scales`, on the undamped Hessian).
    """
    if options:
        raise RecipeError(
            f"gptq: unknown options {sorted(options)}; allowed: percdamp, act_order, block_size, narrow, hessian, clip, "
            "precision, refit"
        )
    if precision not in ("auto", "float32", "float64"):
        raise RecipeError(f"gptq: precision {precision!r} is not supported; allowed: auto, float32, float64")
    w32 = check_weight(W, bits)
    K, N = w32.shape
    if factor is None:
        factor = gptq_factor(stats, hessian, K=K, percdamp=percdamp, act_order=act_order, precision=precision)
    elif (factor.K, factor.percdamp, factor.act_order, factor.precision) != (
            K, percdamp, act_order, precision if precision != "auto" else work_precision(K)):
        raise CalibrationError(f"gptq: the factor given was computed for K={factor.K}, percdamp={factor.percdamp}, "
                               f"act_order={factor.act_order}, precision={factor.precision}, not this call's")
    g = resolve_group_size(K, group_size)
    kb = -(-K // g)
    dtype = "uint4" if bits == 4 else "uint8"
    work = np.dtype(factor.precision)
    perm, diag, U = factor.perm, factor.diag, factor.U
    Wm = np.asarray(w32[perm], work)  # the rows in processing order: the one working copy of W
    Wm[factor.dead[perm], :] = 0.0

    def group_qparams(rows: np.ndarray, imp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        r32 = rows.astype(np.float32)
        mn = mx = None
        if clip:  # the range of least H-diagonal-weighted rounding error (see rtn.clip_ranges)
            mn, mx = clip_ranges(r32, bits, rows.shape[0], symmetric=symmetric, narrow=narrow, importance=imp)
        s, _, z = group_weight_codes(r32, bits, rows.shape[0], symmetric=symmetric, narrow=narrow,
                                     min_val=mn, max_val=mx)
        return s[0], z[0]

    scales = np.zeros((kb, N), np.float32)
    zeros = np.zeros((kb, N), np.uint8)
    static = act_order or g == K
    if static:
        at = np.argsort(perm)  # where each original row is in Wm
        for b in range(kb):
            scales[b], zeros[b] = group_qparams(Wm[at[b * g : (b + 1) * g]], diag[b * g : (b + 1) * g])

    group_of = perm // g  # group (original order) of each processed row

    # blocks aligned to groups so that a group's rows are up to date when its qparams are taken
    B = block_size if static or block_size % g == 0 else g * max(1, -(-block_size // g))
    B = max(B, 1)
    Q = np.zeros((K, N), np.uint8)

    def round_row(r: int, W1: np.ndarray, i: int) -> np.ndarray:
        gi = int(group_of[r])
        if not static and r % g == 0:
            scales[gi], zeros[gi] = group_qparams(W1[i : i + g], diag[r : r + g])
        q = quantize(W1[i].astype(np.float32), scales[gi], zeros[gi], axis=0, dtype=dtype)
        Q[perm[r]] = q
        return np.asarray(dequantize(q, scales[gi], zeros[gi], axis=0), work)

    obs_rounding(Wm, U, round_row, B)
    res = WOQResult(Q, scales, zeros, bits, g, symmetric)
    if refit:
        from quantkit.algorithms.scale_refit import refit_scales

        if hessian is None and (stats is None or not stats.count):
            raise CalibrationError("gptq: refit needs the layer's Hessian (stats or hessian)")
        H = np.asarray(hessian, np.float64) if hessian is not None else stats.hessian()  # type: ignore[union-attr]
        res = refit_scales(w32, H, res)
    return res
