"""The best group scales for given integer codes: the closed-form step that follows a rounding algorithm.

A rounding algorithm (SignRound, GPTQ) picks each weight's integer code for scales fixed before it starts (the
clipped min-max of each group).  Once the codes are chosen, those scales are no longer the best ones: the layer's
output error ``tr(dW^T H dW)`` is quadratic in the scales, and its minimum is one small linear system per output
column.  :func:`refit_scales` solves it; SignRound's ``refit`` option alternates it with the rounding.
"""

from __future__ import annotations

import numpy as np

from quantkit.algorithms.woq import WOQResult

__all__ = ["hessian_loss", "refit_scales"]


def hessian_loss(H: np.ndarray, D: np.ndarray) -> float:
    """``tr(D^T H D)`` in float64."""
    D64 = D.astype(np.float64)
    return float(np.sum((H @ D64) * D64))


def refit_scales(w: np.ndarray, H: np.ndarray, res: WOQResult, *, chunk: int = 4096) -> WOQResult:
    """The group scales of ``res`` that minimise ``tr(dW^T H dW)`` with its codes and zero points kept.

    For one output column ``n``, ``W_hat[k] = s_g c_k`` with ``c = codes - zero_point`` (``g`` the group of row
    ``k``) is linear in the column's ``G`` scales, so the best scales solve ``A s = b`` with
    ``A[g, h] = sum_{k in g, l in h} c_k H_kl c_l`` and ``b[g] = sum_{k in g} c_k (H w)_k``: a ``G x G`` system per
    column (``G = ceil(K / group_size)``), all columns batched.  The rounding (SignRound, GPTQ) chose the codes for
    the starting scales; these are the exact optimum for those codes.  A column keeps its old scales where its
    system is singular (a group of all-zero ``c``; the symmetric grid's scales are signed); the result is returned
    only when its loss is lower."""
    K, N = res.codes.shape
    g = res.group_size
    kb = res.scales.shape[0]
    starts = np.arange(0, K, g)
    rep = np.minimum(np.arange(K) // g, kb - 1)
    H32 = np.ascontiguousarray(H, np.float32)
    scales = res.scales.copy()
    for c0 in range(0, N, chunk):
        c1 = min(N, c0 + chunk)
        C = res.codes[:, c0:c1].astype(np.float32) - res.zero_points[rep, c0:c1].astype(np.float32)
        HW = H32 @ np.ascontiguousarray(w[:, c0:c1], np.float32)
        b = np.add.reduceat((C * HW).astype(np.float64), starts, axis=0)  # [kb, n]
        A = np.empty((c1 - c0, kb, kb), np.float64)
        for h in range(kb):
            rows = slice(starts[h], min(K, starts[h] + g))
            P = H32[:, rows] @ C[rows]  # [K, n]: H[:, h] c_h
            A[:, :, h] = np.add.reduceat((C * P).astype(np.float64), starts, axis=0).T
        A = 0.5 * (A + A.transpose(0, 2, 1))
        old = res.scales[:, c0:c1].astype(np.float64).T  # [n, kb]
        diag = np.einsum("nii->ni", A)
        ok = np.all(diag > 1e-12 * np.maximum(diag.max(axis=1, keepdims=True), 1e-30), axis=1)
        new = old.copy()
        if np.any(ok):
            try:
                new[ok] = np.linalg.solve(A[ok], b.T[ok][..., None])[..., 0]
            except np.linalg.LinAlgError:  # a system singular in floating point: this chunk keeps its scales
                continue
        good = ok & np.all(np.isfinite(new), axis=1)
        scales[:, c0:c1] = np.where(good[None, :], new.T, old.T).astype(np.float32)
    out = WOQResult(res.codes, scales, res.zero_points, res.bits, g, res.symmetric, input_scale=res.input_scale)
    if hessian_loss(H, out.dequantize() - w) >= hessian_loss(H, res.dequantize() - w):
        return res
    return out
