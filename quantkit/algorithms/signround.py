"""SignRound (Cheng et al. 2023, "Optimize Weight Rounding via Signed Gradient Descent for the
Quantization of LLMs", the AutoRound family), for ``y = x @ W`` with ``W`` ``[K, N]``.

Every weight gets a learnable rounding offset ``V`` in ``[-0.5, 0.5]``; with ``S`` the group scale
(``g`` rows of K, per output column)::

    q = clip(round(W / S + V) + d + Z, 0, 2^b - 1)          W_hat = (q - Z) * S

``S`` and ``Z`` are the starting point's: round to nearest on quantkit's grid with the clipping search of
:func:`~quantkit.algorithms.rtn.clip_ranges` (symmetric: the signed scale ``e / -2^(b-1)`` of
``group_weight_codes``, ``Z = 2^(b-1)``; asymmetric: min-max, ``Z`` from ``compute_qparams``), or GPTQ's
(``init: gptq``).  ``d`` is the fixed integer offset that makes ``V = 0`` reproduce the starting codes
exactly (0 for RTN).  ``learn_clip: true`` also learns a clip factor per group and column (``alpha`` in
``[min_clip, 1]`` times the min-max scale; asymmetric: ``alpha`` for the max, ``beta`` for the min, the
zero point re-rounded, as AutoRound does); measured worse here, so off by default.

Objective: the layer's output reconstruction error on the calibration activations,
``tr(dW^T H dW) = sum_t ||x_t (W_hat - W)||^2`` with ``H = sum_t x_t^T x_t`` (``[K, K]``, from
:class:`~quantkit.calibrate.layer_stats.LayerStats`, i.e. all calibration tokens, not a row sample;
``percdamp * mean(diag H)`` added to its diagonal as GPTQ does).  Its gradient with respect to ``W_hat``
is ``2 H dW`` (float32, torch; with the scales fixed, updated each step from the weights whose rounding flipped,
see :func:`_refine_fixed_scales`), carried through the
straight-through rounding (gradient 1; 0 where the grid clips) to ``V`` (written out; autograd when the
clip factors learn).

**Relaxed own term** (``relaxed``, default on; the one departure from the paper).  With the full-batch
loss the straight-through gradient of ``V_i`` is ``S (H_ii dW_i + sum_{j!=i} H_ij dW_j)``; its first
term has the sign of the weight's own rounding error whatever ``V_i`` is, so sign descent pushes every
offset to its rounding boundary and the loss grows after the first steps (on a correlated random
layer to 1.5-2.5x RTN's loss, best iterate 0.95x; on real SmolLM2 layers best iterate 0.61-0.83x RTN;
AutoRound's mini-batch noise hides this).  The own term is therefore taken at the continuous point,
``H_ii S^2 (W / S + V - round(W / S + V))``, so ``V_i`` is pulled toward the coordinate-wise optimum
``-sum_{j!=i} H_ij dW_j / (H_ii S)`` and rounds there (0.45x RTN on the random layer, 0.22-0.35x on the
SmolLM2 layers; GPTQ: 0.35x and 0.13-0.33x).

Signed gradient descent: ``V -= lr_t * sign(dL/dV)`` with ``lr_t = lr * (1 - t / iters)`` (linear decay,
``lr = 1 / iters`` by default, ``iters = 50``), then ``V`` is clipped to ``[-0.5, 0.5]``.  The loss is
evaluated at every iterate and the best one is kept; at the end it is compared in float64 with the
starting point, so the result is never worse than its initialisation (RTN / GPTQ) on the (damped)
layer loss.

Combined with AWQ (``awq`` option ``signround: true``): the AWQ-scaled weights ``diag(s) W`` are
refined on the scaled inputs' Hessian ``diag(1/s) H diag(1/s)``, starting from GPTQ's result when
``gptq: true`` too, else from AWQ's clipped RTN (see :mod:`quantkit.algorithms.awq`).

The result is on quantkit's grid (:class:`WOQResult`: codes, float32 scales, zero points; symmetric =
the signed-scale grid with zero point ``2^(b-1)``), stored as chosen.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np

from quantkit.algorithms.rtn import clip_ranges
from quantkit.algorithms.scale_refit import hessian_loss as _hessian_loss
from quantkit.algorithms.scale_refit import refit_scales
from quantkit.algorithms.woq import WOQResult, check_weight, register_weight_algorithm, resolve_group_size
from quantkit.calibrate.layer_stats import LayerStats
from quantkit.errors import CalibrationError, RecipeError
from quantkit.scheme.qparams import dequantize, group_weight_codes

__all__ = ["SIGNROUND_OPTIONS", "refit_rounds", "signround", "signround_from", "signround_refine"]

SIGNROUND_OPTIONS = frozenset(
    {"iters", "lr", "min_clip", "init", "percdamp", "narrow", "hessian", "learn_clip", "relaxed", "clip_lr_scale",
     "refit", "refit_iters", "equalize"}
)


def signround_refine(
    w: np.ndarray,
    H: np.ndarray,
    init: WOQResult,
    *,
    iters: int = 100,
    lr: float | None = None,
    min_clip: float = 0.5,
    narrow: bool = False,
    learn_clip: bool = True,
    relaxed: bool = True,
    clip_lr_scale: float = 1.0,
) -> WOQResult:
    """Signed-gradient refinement of ``init`` (codes / scales of ``w`` ``[K, N]`` on quantkit's grid) under
    the loss ``tr((W_hat - w)^T H (W_hat - w))``; ``H`` float ``[K, K]`` (damped by the caller)."""
    # torch's own thread count (the cores, unless the caller set it): its float32 matmuls split the output, not
    # the sums, so the codes are the same as on one thread (checked bit for bit on 576 x 1536 .. 2048 x 2048), and
    # on 2 cores two threads took 0.55-0.62x the time of one from 576 x 1536 to 5632 x 2048, SmolLM2's
    # llama-int4 recipe 83.7 s of SignRound instead of 109.1 s, the same model (one thread had been chosen for its
    # CPU time: busy-waiting OpenMP threads spend ~10x more of it; the wall time is what a run waits for)
    if not learn_clip:
        return _refine_fixed_scales(w, H, init, iters=iters, lr=lr, relaxed=relaxed)
    return _refine_learned_clip(w, H, init, iters=iters, lr=lr, min_clip=min_clip, narrow=narrow,
                                relaxed=relaxed, clip_lr_scale=clip_lr_scale)


def _refine_learned_clip(w: np.ndarray, H: np.ndarray, init: WOQResult, *, iters: int, lr: float | None,
                         min_clip: float, narrow: bool, relaxed: bool, clip_lr_scale: float) -> WOQResult:
    """:func:`signround_refine` with learned clip factors (autograd)."""
    import torch

    K, N = w.shape
    g, bits, sym = init.group_size, init.bits, init.symmetric
    kb = -(-K // g)
    qmax = float((1 << bits) - 1)
    base_s, _, base_z = group_weight_codes(w, bits, g, symmetric=sym, narrow=narrow)
    init_loss = _hessian_loss(H, init.dequantize() - w)
    if iters <= 0 or init_loss <= 0.0:
        return init
    rep = np.minimum(np.arange(K) // g, kb - 1)

    with torch.no_grad():
        Wt = torch.from_numpy(np.ascontiguousarray(w, np.float32))
        Ht = torch.from_numpy(np.ascontiguousarray(H, np.float32))
        idx = torch.from_numpy(rep)
        hdiag = torch.from_numpy(np.ascontiguousarray(np.diag(H), np.float32))[:, None]
    ratio = np.where(base_s != 0, init.scales / np.where(base_s != 0, base_s, 1), 1.0)
    ratio = np.clip(ratio, min_clip, 1.0).astype(np.float32)
    if sym:
        s0 = torch.from_numpy(base_s.astype(np.float32))
        zc = float(1 << (bits - 1))
        lo = hi = None
    else:
        starts = np.arange(0, K, g)
        lo_np = np.minimum(np.minimum.reduceat(w, starts, axis=0), 0.0).astype(np.float32)
        hi_np = np.maximum(np.maximum.reduceat(w, starts, axis=0), 0.0).astype(np.float32)
        lo, hi = torch.from_numpy(lo_np), torch.from_numpy(hi_np)

    def qparams(a: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Group scales ``[kb, N]`` (differentiable) and zero points (constant)."""
        if sym:
            return s0 * a, torch.full_like(s0, zc)
        width = a * hi - b * lo  # type: ignore[operator]
        s = torch.where(width > 0, width / qmax, torch.ones_like(width))
        z = torch.clamp(torch.round(-(b * lo).detach() / s.detach()), 0, qmax)  # type: ignore[operator]
        return s, z

    # integer offsets d that make V = 0 reproduce the initial codes
    with torch.no_grad():
        a0 = torch.from_numpy(ratio)
        s_init, z_init = qparams(a0, a0.clone() if not sym else None)
        S, Z = s_init[idx], z_init[idx]
        d = torch.from_numpy(init.codes.astype(np.float32)) - (torch.round(Wt / S) + Z)

    V = torch.zeros((K, N), dtype=torch.float32, requires_grad=True)
    alpha = a0.clone().requires_grad_(True)
    beta = a0.clone().requires_grad_(True) if not sym else None
    params = [p for p in (V, alpha, beta) if p is not None and p.requires_grad]
    lr0 = 1.0 / iters if lr is None else float(lr)
    best = (np.inf, V.detach().clone(), alpha.detach().clone(), None if beta is None else beta.detach().clone())

    def forward() -> torch.Tensor:
        s, z = qparams(alpha, beta)
        S, Z = s[idx], z[idx]
        u = Wt / S + V
        r = u + (torch.round(u) - u).detach()  # straight-through rounding
        q = torch.clamp(r + d + Z, 0.0, qmax)
        return (q - Z) * S - Wt

    for t in range(iters + 1):
        D = forward()
        with torch.no_grad():
            G = Ht @ D
            loss = float(torch.sum(G * D))
        if loss < best[0]:
            best = (loss, V.detach().clone(), alpha.detach().clone(), None if beta is None else beta.detach().clone())
        if t == iters:
            break
        for p in params:
            p.grad = None
        torch.sum(D * G).backward()
        if relaxed:  # the weight's own term on the continuous offset: V -> -(sum_{j != i} H_ij dW_j) / (H_ii S)
            with torch.no_grad():
                s_, _ = qparams(alpha, beta)
                S_ = s_[idx]
                V.grad += S_ * hdiag * (S_ * (V + d) - D) * (V.grad != 0)  # type: ignore[operator]
        step = lr0 * (1.0 - t / iters)
        with torch.no_grad():
            V -= step * torch.sign(V.grad)  # type: ignore[arg-type]
            V.clamp_(-0.5, 0.5)
            for c in (alpha, beta):
                if c is not None and c.requires_grad:
                    c.sub_(clip_lr_scale * step * torch.sign(c.grad))  # type: ignore[arg-type]
                    c.clamp_(min_clip, 1.0)

    _, Vb, ab, bb = best
    with torch.no_grad():
        s, z = qparams(ab, bb)
        S, Z = s[idx], z[idx]
        q = torch.clamp(torch.round(Wt / S + Vb) + d + Z, 0.0, qmax)
    scales = s.numpy().astype(np.float32)
    zps = z.numpy().astype(np.uint8) if not sym else np.full((kb, N), 1 << (bits - 1), np.uint8)
    codes = q.numpy().astype(np.uint8)
    if not sym:  # the zero point as stored: rint of the float64 value, as compute_qparams
        zps = z.numpy().astype(np.uint8)
    res = WOQResult(codes, scales, zps, bits, g, sym, input_scale=init.input_scale)
    if _hessian_loss(H, dequantize(codes, scales, zps, axis=0, block_size=g) - w) >= init_loss:
        return init
    return res


def _refine_fixed_scales(w: np.ndarray, H: np.ndarray, init: WOQResult, *, iters: int, lr: float | None,
                         relaxed: bool, dense_frac: float = 0.03) -> WOQResult:
    """:func:`signround_refine` with the scales / zero points of ``init`` kept (only the offsets ``V`` learn):
    the gradient is written out (no autograd).

    Its costly term is ``G = H dW``.  A step moves every offset by at most ``lr_t``, so only the weights whose
    rounding flips change ``dW``: 1.6% of a 1536 x 576 layer's weights at the first step, 0.005% at the last.  ``G``
    is therefore updated by the flipped entries alone, ``G += H dW_delta`` (a sparse ``[N, K]`` times dense
    ``[K, K]`` product, ``nnz * K`` multiply-adds), and recomputed whole when more than ``dense_frac`` of the
    weights flip: 2.8x faster on that layer than the full product per step, the same codes up to float32 rounding
    in ``G``.  Everything is held transposed (``[N, K]``, rows = output columns) so the sparse rows are contiguous.
    """
    import torch

    K, N = w.shape
    g, bits = init.group_size, init.bits
    qmax = float((1 << bits) - 1)
    init_loss = _hessian_loss(H, init.dequantize() - w)
    if iters <= 0 or init_loss <= 0.0:
        return init
    rep = np.minimum(np.arange(K) // g, init.scales.shape[0] - 1)

    def tt(a: np.ndarray) -> torch.Tensor:  # [K, N] -> contiguous float32 [N, K]
        return torch.from_numpy(np.ascontiguousarray(np.asarray(a, np.float32).T))

    with torch.no_grad():
        Ht = torch.from_numpy(np.ascontiguousarray(H, np.float32))  # symmetric: dW^T H = (H dW)^T
        S = tt(init.scales[rep])
        Z = tt(init.zero_points[rep])
        hd = torch.from_numpy(np.ascontiguousarray(np.diag(H), np.float32))[None, :]
        Wn = tt(w) / S
        d = tt(init.codes) - (torch.round(Wn) + Z)  # V = 0 -> the initial codes
        lo, hi = -Z - d, qmax - Z - d  # round(W / S + V) must stay in [lo, hi] (the grid)
        hdS2 = hd * S * S
        V = torch.zeros((N, K), dtype=torch.float32)
        best_loss, best_V = np.inf, V.clone()
        lr0 = 1.0 / iters if lr is None else float(lr)
        rc_prev: torch.Tensor | None = None
        D = G = torch.empty(0)
        for t in range(iters + 1):
            u = Wn + V
            r = torch.round(u)
            rc = torch.clamp(r, lo, hi)
            flips = None if rc_prev is None else (rc != rc_prev).nonzero()
            if flips is None or flips.shape[0] > dense_frac * K * N:
                D = (rc + d - Wn).mul_(S)  # (W_hat - W)^T = (rc + d + Z - Z) * S - W
                G = D @ Ht
            elif flips.shape[0] and rc_prev is not None:
                n, k = flips[:, 0], flips[:, 1]
                delta = (rc[n, k] - rc_prev[n, k]).mul_(S[n, k])
                D[n, k] += delta
                with warnings.catch_warnings():  # torch: "Sparse CSR tensor support is in beta state"
                    warnings.filterwarnings("ignore", message="Sparse CSR", category=UserWarning)
                    sp = torch.sparse_csr_tensor(_csr_rows(n, N), k, delta, (N, K), check_invariants=False)
                G += torch.sparse.mm(sp, Ht)
            rc_prev = rc
            loss = float(torch.dot(G.view(-1), D.view(-1)))
            if loss < best_loss:
                best_loss, best_V = loss, V.clone()
            if t == iters:
                break
            grad = G * S  # dL/dV through the straight-through rounding (up to the factor 2)
            if relaxed:  # the weight's own term on the continuous offset u instead of the rounded rc
                grad.addcmul_(hdS2, u.sub_(rc))
            step = torch.sign(grad).mul_(r == rc)  # no gradient where the grid clips
            V.sub_(step, alpha=lr0 * (1.0 - t / iters)).clamp_(-0.5, 0.5)
        r = torch.clamp(torch.round(Wn + best_V), lo, hi)
        codes = np.ascontiguousarray((r + d + Z).numpy().T).astype(np.uint8)
    res = WOQResult(codes, init.scales, init.zero_points, bits, g, init.symmetric, input_scale=init.input_scale)
    if _hessian_loss(H, res.dequantize() - w) >= init_loss:
        return init
    return res


def _csr_rows(rows: Any, n_rows: int) -> Any:
    """CSR row pointers for row indices sorted ascending (``nonzero``'s order)."""
    import torch

    counts = torch.bincount(rows, minlength=n_rows)
    crow = torch.zeros(n_rows + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=crow[1:])
    return crow


def signround_from(w: np.ndarray, H: np.ndarray, init: WOQResult, *, iters: int = 50, percdamp: float = 0.01,
                   lr: float | None = None, refit: int = 0, refit_iters: int | None = None) -> WOQResult:
    """Refine another algorithm's result ``init`` of ``w`` (RTN, GPTQ) by signed gradient descent on the
    offsets, its scales kept, with ``H`` damped by ``percdamp * mean(diag H)`` (used by AWQ's ``signround``);
    then ``refit`` rounds of :func:`refit_rounds` (``refit_iters`` steps each, default ``iters``)."""
    damp = percdamp * float(np.mean(np.diag(H)))
    Hd = H + damp * np.eye(H.shape[0]) if damp > 0.0 else H
    res = signround_refine(w, Hd, init, iters=iters, lr=lr, learn_clip=False)
    return refit_rounds(w, Hd, res, refit=refit, refit_iters=iters if refit_iters is None else refit_iters, lr=lr)


@register_weight_algorithm("signround")
def signround(
    W: np.ndarray,
    *,
    bits: int = 4,
    group_size: int | None = 128,
    symmetric: bool = True,
    stats: LayerStats | None = None,
    **options: Any,
) -> WOQResult:
    """SignRound-quantize ``W`` ``[K, N]`` (module docstring).  Options: ``iters`` (50), ``lr`` (``1 / iters``),
    ``min_clip`` (0.5, the smallest clip factor), ``init`` (``rtn`` | ``gptq``: the starting codes and
    scales), ``percdamp`` (0.01), ``narrow`` (False), ``learn_clip`` (False: the clip factors stay at the
    RTN search's; True learns them too, measured worse), ``relaxed`` (True), ``hessian`` (``[K, K]``, instead
    of ``stats``), ``refit`` (0: rounds of the best scales for the codes
    (:func:`~quantkit.algorithms.scale_refit.refit_scales`), each followed by ``refit_iters`` (``iters``) steps of
    rounding on the new scales, and the scales refitted once more at the end; ``refit_iters: 0``: the scales
    only), ``equalize`` (False: True searches an input scale against the int8 activations of ``MatMulNBits`` at
    ``accuracy_level`` 4, :mod:`quantkit.algorithms.equalize`; the weights are then rounded in the scaled space and
    the result carries ``input_scale``; needs ``stats`` with sampled rows)."""
    unknown = set(options) - SIGNROUND_OPTIONS
    if unknown:
        raise RecipeError(f"signround: unknown options {sorted(unknown)}; allowed: {sorted(SIGNROUND_OPTIONS)}")
    iters = int(options.get("iters", 50))
    lr = options.get("lr")
    min_clip = float(options.get("min_clip", 0.5))
    init = str(options.get("init", "rtn"))
    percdamp = float(options.get("percdamp", 0.01))
    narrow = bool(options.get("narrow", False))
    learn_clip = bool(options.get("learn_clip", False))
    relaxed = bool(options.get("relaxed", True))
    clip_lr_scale = float(options.get("clip_lr_scale", 1.0))
    equalize = options.get("equalize", False)
    if not isinstance(equalize, bool):
        raise RecipeError(f"signround: equalize must be true or false (got {equalize!r})")
    refit = int(options.get("refit", 0))
    refit_iters = int(options.get("refit_iters", iters))
    if init not in ("rtn", "gptq"):
        raise RecipeError(f"signround: init {init!r} is not supported; allowed: gptq, rtn")
    if refit < 0 or refit_iters < 0:
        raise RecipeError(
            f"signround: refit and refit_iters must be >= 0 (got refit={refit}, refit_iters={refit_iters})")
    if iters < 0 or not 0.0 < min_clip <= 1.0 or (lr is not None and float(lr) <= 0.0) or percdamp < 0.0:
        raise RecipeError(
            f"signround: need iters >= 0, 0 < min_clip <= 1, lr > 0, percdamp >= 0 "
            f"(got iters={iters}, min_clip={min_clip}, lr={lr}, percdamp={percdamp})"
        )
    w = check_weight(W, bits)
    K = w.shape[0]
    hessian = options.get("hessian")
    if hessian is not None:
        H = np.array(hessian, np.float64)
    elif stats is not None and stats.count:
        H = stats.hessian()  # a new array (H / count): damped in place below
    else:
        raise CalibrationError("signround needs calibration statistics (stats=LayerStats) of the layer input")
    if H.shape != (K, K):
        raise CalibrationError(f"signround: Hessian shape {H.shape} does not match the weight's K={K}")
    g = resolve_group_size(K, group_size)
    s_in = None
    if equalize:
        if stats is None or stats.samples.shape[0] == 0:
            raise CalibrationError("signround: equalize needs calibration statistics with sampled input rows "
                                   "(stats=LayerStats)")
        from quantkit.algorithms.equalize import equalize_scale

        s_in, _ = equalize_scale([w], stats, bits=bits, group_size=g, symmetric=symmetric)
        if s_in is not None:  # round diag(s) W against the Hessian of x / s
            w = (w * s_in[:, None]).astype(np.float32)
            s64 = s_in.astype(np.float64)
            H = H / np.outer(s64, s64)
    if init == "gptq":
        from quantkit.algorithms.gptq import gptq

        start = gptq(w, bits=bits, group_size=g, symmetric=symmetric, hessian=H, narrow=narrow)
    else:
        mn, mx = clip_ranges(w, bits, g, symmetric=symmetric, narrow=narrow, importance=np.diag(H))
        sc, q, z = group_weight_codes(w, bits, g, symmetric=symmetric, narrow=narrow, min_val=mn, max_val=mx)
        start = WOQResult(q, sc, z, bits, g, symmetric)
    damp = percdamp * float(np.mean(np.diag(H)))
    if damp > 0.0:
        H[np.diag_indices(K)] += damp  # H + damp I without a K x K identity and a second copy
    res = signround_refine(w, H, start, iters=iters, lr=None if lr is None else float(lr), min_clip=min_clip,
                           narrow=narrow, learn_clip=learn_clip, relaxed=relaxed, clip_lr_scale=clip_lr_scale)
    res = refit_rounds(w, H, res, refit=refit, refit_iters=refit_iters, lr=None if lr is None else float(lr),
                       relaxed=relaxed)
    return res if s_in is None else dataclasses.replace(res, input_scale=s_in)


def refit_rounds(w: np.ndarray, H: np.ndarray, res: WOQResult, *, refit: int, refit_iters: int,
                 lr: float | None = None, relaxed: bool = True) -> WOQResult:
    """``refit`` rounds of: the best scales for the codes of ``res`` (:func:`refit_scales`), then ``refit_iters``
    steps of rounding on those scales; the scales refitted once more at the end (``refit_iters: 0``: the scales
    only).  ``H`` as for :func:`signround_refine` (damped by the caller)."""
    for r in range(refit):  # the best scales for these codes, then the codes again for those scales, ...
        res = refit_scales(w, H, res)
        if refit_iters:
            res = signround_refine(w, H, res, iters=refit_iters, lr=lr, learn_clip=False, relaxed=relaxed)
            if r == refit - 1:  # ... and the scales once more for the last codes
                res = refit_scales(w, H, res)
    return res


signround.options = SIGNROUND_OPTIONS  # what the recipe may pass (checked when it loads)
