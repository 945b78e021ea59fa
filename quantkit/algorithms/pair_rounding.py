"""Pair-aware int8 weight rounding: exact on x86 CPUs without VNNI at the least accuracy cost.

The rule (:mod:`quantkit.scheme.saturation`): in the kernel's K order, every same-sign pair of int8
weight codes must have ``|q0 + q1| <= 128``, or some uint8 activation saturates the int16 pair sum.
Only output channels (columns of the kernel view) that break the rule are touched; two candidate
fixes are computed for them and the better one is kept per channel:

* **scale search + constrained rounding** (:func:`~quantkit.scheme.saturation.pair_safe_codes`):
  the channel's scale grows by ``alpha in [1, 127/64]`` (the upper end is 7-bit weights) and each
  offending pair is rounded onto the boundary ``q0 + q1 = +-128`` at least squared error.
* **pair-constrained GPTQ** (:func:`pair_gptq`, when the layer input's second moment
  ``H = sum x x^T`` in kernel K order is known; scales ``alpha * s`` for ``alpha`` in
  :data:`GPTQ_ALPHAS`, and the scale the search above chose): rows are rounded in K order as in GPTQ
  (Frantar et al. 2022) with the OBS update of the rows not yet rounded; the first row of a pair
  takes the boundary midpoint when the pair would break the rule, the second is clipped to
  ``[-128 - min(q0, 0), 128 - max(q0, 0)]``.  The error the constraint introduces is spread over
  the other inputs of the same channel, weighted by how the inputs co-vary, instead of being left
  where it falls.

The choice per channel is by the output-error objective ``d^T H d`` (``d`` the weight error) when
``H`` is known, else by ``||d||^2``.
"""

from __future__ import annotations

import numpy as np

from quantkit.algorithms.gptq import inverse_hessian_cholesky
from quantkit.calibrate.kernel_hessian import BlockDiagonal
from quantkit.scheme.saturation import (
    PAIR_LIMIT,
    constrained_round,
    from_kernel_view,
    is_depthwise,
    kernel_view,
    pair_safe_codes,
    pair_violations,
)

__all__ = ["GPTQ_ALPHAS", "SCALE_STEPS", "pair_gptq", "pair_safe_weight"]

GPTQ_ALPHAS: tuple[float, ...] = (1.35,)
"""Scale multipliers tried with pair-constrained GPTQ besides the scale the search chose: at alpha = 1 many codes
sit at the pair bound and the error feedback, pushed into neighbours that are themselves at the bound, can
compound; a little headroom lets the compensation land.  The best per channel wins.  On ResNet-18 (random
weights, 4175 offending channels) the searched scale won 81% of the channels, alpha 1.35 9%, 1.15 and 1.6 5%
each, alpha 1 0.6%: the searched scale and 1.35 alone cost 0.1-0.2 dB of output SQNR and 40% of the time."""
SCALE_STEPS = 4
"""Points of the data-free scale search (:func:`~quantkit.scheme.saturation.pair_safe_codes`) when the layer's
Hessian is known (its result is then only GPTQ's starting scale and one of its candidates); 24 without it.  From
8 to 4 points (2 cores, random-weight models built for ``x86-avx2``): output SQNR ResNet-18 34.29 -> 34.26 dB,
DistilBERT 36.25 -> 36.17 dB, the calibrator choice (which lowers the model) 9.1 -> 8.3 s on DistilBERT."""


Prepared = list[tuple[int, np.ndarray, np.ndarray]]
"""Per diagonal block of ``H``: ``(first input, U, dead)``, ``U`` the upper Cholesky factor of the block's damped
inverse and ``dead`` its inputs that never fire."""


def _prepared(hessian: np.ndarray | BlockDiagonal, percdamp: float) -> Prepared:
    """:data:`Prepared` of ``hessian`` (a dense ``[K, K]`` matrix is one block)."""
    blocks = (hessian.blocks if isinstance(hessian, BlockDiagonal) else (hessian,))
    offsets = hessian.offsets if isinstance(hessian, BlockDiagonal) else (0,)
    out = []
    for o, b in zip(offsets, blocks, strict=True):
        H = np.array(b, np.float64)
        dead = np.diag(H) == 0
        H[dead, dead] = 1.0
        out.append((o, inverse_hessian_cholesky(H, percdamp), dead))
    return out


def pair_gptq(
    w: np.ndarray, scale: np.ndarray, hessian: np.ndarray | BlockDiagonal | None = None, *, qmin: int = -127,
    qmax: int = 127, percdamp: float = 0.01, block_size: int = 32, prepared: Prepared | None = None,
) -> np.ndarray:
    """GPTQ-round ``w [K, N]`` (kernel K order) to symmetric int8 codes with per-column ``scale [N]``,
    every same-sign pair ``(2j, 2j+1)`` obeying ``|q0 + q1| <= 128``.  Returns int8 codes ``[K, N]``.
    ``hessian``: dense, or its diagonal blocks (GPTQ with ``H`` zero off the blocks: each block's rows are
    rounded with the error spread over the block's later rows only).  ``prepared``: :func:`_prepared` of the
    Hessian, when several scales are tried on one layer.  ``block_size``: rows per lazy update (the same result
    for any size up to float rounding); the loop updates the rest of its block a pair of rows at a time and the
    rows after the block in one matrix product, so small blocks move the work into BLAS: 32 rows took 0.06 s where
    128 took 0.11-0.14 s (768 x 4096 columns, measured with the row-by-row loop; 0.018 and 0.027 s at 512 columns;
    identical codes), 2 cores."""
    K, N = w.shape
    if prepared is None:
        if hessian is None:
            raise ValueError("pair_gptq needs the hessian or its prepared factor")
        prepared = _prepared(hessian, percdamp)
    Wm = np.array(w, np.float64)
    for o, _, dead in prepared:
        Wm[o : o + dead.size][dead, :] = 0.0
    s = np.asarray(scale, np.float64).reshape(N)
    Q = np.zeros((K, N), np.int32)

    # codes within [-PAIR_LIMIT, PAIR_LIMIT] break the rule exactly when |q0 + q1| > PAIR_LIMIT (both then have
    # the sum's sign): one sum instead of the four sign splits (the row loop is NumPy call overhead per row)
    narrow = qmin >= -PAIR_LIMIT and qmax <= PAIR_LIMIT

    def rounded(u: np.ndarray) -> np.ndarray:
        q = np.rint(u)
        np.maximum(q, qmin, out=q)
        np.minimum(q, qmax, out=q)
        return q

    def second_of_pair(qa: np.ndarray, q: np.ndarray) -> np.ndarray:
        """The second code clipped to the bound its partner ``qa`` leaves (a no-op where the pair obeys it)."""
        if narrow and not bool((np.abs(qa + q) > PAIR_LIMIT).any()):
            return q
        return np.clip(q, np.maximum(qmin, -PAIR_LIMIT - np.minimum(qa, 0)),
                       np.minimum(qmax, PAIR_LIMIT - np.maximum(qa, 0)))

    # GPTQ's row loop (quantkit.algorithms.gptq.obs_rounding) taken a pair of rows at a time: the first row is
    # rounded jointly with its partner's current target, its error updates the partner, the partner is rounded
    # and clipped, and the two errors update the block's later rows in one product (the same arithmetic as two
    # rank-1 updates up to float rounding; half the NumPy calls of the row-by-row loop)
    bs = max(2, block_size - block_size % 2)  # pairs never straddle a block (and Hessian blocks are even)
    for o, U, _ in prepared:
        part = Wm[o : o + U.shape[0]]  # updated in place
        k1 = part.shape[0]
        for i1 in range(0, k1, bs):
            i2 = min(i1 + bs, k1)
            W1 = part[i1:i2].copy()
            E1 = np.zeros_like(W1)
            U1 = U[i1:i2, i1:i2]
            n = i2 - i1
            for i in range(0, n, 2):
                r = o + i1 + i
                u0 = W1[i] / s
                q0 = rounded(u0)
                if i + 1 == n:  # the last row of an odd K: its partner is the kernel's zero padding
                    Q[r] = q0
                    E1[i] = (W1[i] - q0 * s) / U1[i, i]
                    break
                q0 = _first_of_pair(u0, q0, W1[i + 1] / s, qmin, qmax, narrow)
                Q[r] = q0
                E1[i] = (W1[i] - q0 * s) / U1[i, i]
                W1[i + 1] -= U1[i, i + 1] * E1[i]
                q1 = second_of_pair(q0, rounded(W1[i + 1] / s))
                Q[r + 1] = q1
                E1[i + 1] = (W1[i + 1] - q1 * s) / U1[i + 1, i + 1]
                if i + 2 < n:
                    W1[i + 2 :] -= U1[i : i + 2, i + 2 :].T @ E1[i : i + 2]
            part[i2:] -= U[i1:i2, i2:].T @ E1
    return Q.astype(np.int8)


def _first_of_pair(u0: np.ndarray, q0: np.ndarray, u1: np.ndarray, qmin: int, qmax: int,
                   narrow: bool = False) -> np.ndarray:
    """The first code of each pair :func:`~quantkit.scheme.saturation.constrained_round` gives targets
    ``(u0, u1)`` (``q0`` = their clipped ``rint``), for one row of a pair without its general reshaping.
    ``narrow``: every code within ``[-PAIR_LIMIT, PAIR_LIMIT]`` (the sum alone then tells a pair that breaks it)."""
    q1 = np.clip(np.rint(u1), qmin, qmax)
    if narrow:
        total = q0 + q1
        pos, neg = total > PAIR_LIMIT, total < -PAIR_LIMIT
    else:
        pos = np.maximum(q0, 0) + np.maximum(q1, 0) > PAIR_LIMIT
        neg = np.minimum(q0, 0) + np.minimum(q1, 0) < -PAIR_LIMIT
    if not (pos.any() or neg.any()):
        return q0
    d = u0 - u1
    tp = np.clip(np.rint((d + PAIR_LIMIT) / 2), max(qmin, PAIR_LIMIT - qmax), min(qmax, PAIR_LIMIT - qmin))
    tn = np.clip(np.rint((d - PAIR_LIMIT) / 2), max(qmin, -PAIR_LIMIT - qmax), min(qmax, -PAIR_LIMIT - qmin))
    return np.where(pos, tp, np.where(neg, tn, q0))


def _objective(d: np.ndarray, hessian: np.ndarray | BlockDiagonal | None) -> np.ndarray:
    """Per column: ``d^T H d`` (or ``||d||^2``) for weight errors ``d [K, N]``.  The products run in float32 (it
    only ranks a column's candidate roundings; half the time of float64 products), the sums over blocks in
    float64."""
    if hessian is None:
        return np.sum(d * d, axis=0)
    if isinstance(hessian, BlockDiagonal):
        return hessian.quadratic(d, np.float32)
    d32 = np.asarray(d, np.float32)
    return np.einsum("kn,kn->n", d32, np.asarray(hessian, np.float32) @ d32).astype(np.float64)


def pair_safe_weight(
    w: np.ndarray, q: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, *, op_type: str, trans_b: bool = False,
    group: int = 1, qmin: int = -127, qmax: int = 127, hessian: np.ndarray | BlockDiagonal | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Make the int8 codes ``q`` of weight ``w`` (ONNX layout; ``scale`` per output channel or scalar)
    obey the pair bound in the kernel order of ``op_type``.  Returns ``(codes, scale, changed)`` in the
    same layouts; ``changed`` counts the output channels whose codes or scale moved.  Depthwise Conv
    weights and weights that already obey the bound come back unchanged.

    ``hessian``: the layer input's ``sum x x^T`` in kernel K order (``[K, K]`` or its diagonal blocks,
    ``group == 1`` only).
    A per-tensor scale or a nonzero zero point stays as it is and only the rounding is constrained."""
    if op_type == "Conv" and is_depthwise(tuple(w.shape), group):
        return q, scale, 0
    view_q = kernel_view(q, op_type, trans_b=trans_b, group=group)
    bad = np.asarray(pair_violations(view_q).any(axis=-2))  # [G, N]
    if not bad.any():
        return q, scale, 0
    view_w = kernel_view(w, op_type, trans_b=trans_b, group=group).astype(np.float64)
    g, k, n = view_w.shape
    sc = np.asarray(scale, np.float32)
    zp = np.asarray(zero_point, np.int64)
    per_channel = sc.ndim == 1 and sc.size == g * n
    if not (per_channel and not zp.any()):
        s_cols = np.broadcast_to(sc.reshape(g, n) if per_channel else sc.reshape(1, 1), (g, n)).astype(np.float64)
        z_cols = np.broadcast_to(zp.reshape(g, n) if zp.size == g * n else zp.reshape(1, 1), (g, n))
        codes = constrained_round(view_w / s_cols[:, None, :] + z_cols[:, None, :], qmin, qmax).astype(np.int8)
        changed = (codes != view_q).any(axis=1)
        return (from_kernel_view(codes, tuple(w.shape), op_type, trans_b=trans_b, group=group), sc,
                int(changed.sum()))
    s0 = sc.reshape(g, n)
    H = hessian if (hessian is not None and g == 1 and np.shape(hessian) == (k, k)) else None
    codes, new_s, _ = pair_safe_codes(view_w, s0, qmin=qmin, qmax=qmax, **({} if H is None else {"steps": SCALE_STEPS}))
    if H is not None:
        cols = np.flatnonzero(bad[0])
        wc = view_w[0][:, cols]
        best_err = _objective(codes[0][:, cols].astype(np.float64) * new_s[0, cols] - wc, H)
        searched = new_s[0, cols].copy()
        prep = _prepared(H, 0.01)
        scales = [(s0[0, cols].astype(np.float64) * a).astype(np.float32) for a in GPTQ_ALPHAS] + [searched]
        # GPTQ's inverse-Hessian factor depends on H alone and columns are rounded independently, so every
        # candidate scale runs in one pass: the columns side by side, once per scale
        nc = len(cols)
        q_all = pair_gptq(np.tile(wc, (1, len(scales))), np.concatenate(scales), qmin=qmin, qmax=qmax,
                          prepared=prep)
        for j, s_a in enumerate(scales):
            q_g = q_all[:, j * nc : (j + 1) * nc]
            err_g = _objective(q_g.astype(np.float64) * s_a - wc, H)
            take = err_g < best_err
            best_err = np.where(take, err_g, best_err)
            codes[0][:, cols[take]] = q_g[:, take]
            new_s[0, cols[take]] = s_a[take]
    out_q = from_kernel_view(codes, tuple(w.shape), op_type, trans_b=trans_b, group=group)
    return out_q, new_s.reshape(sc.shape).astype(np.float32), int(bad.sum())
