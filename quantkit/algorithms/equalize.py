"""Input equalization for W4A8: an input scale that evens out the channels the kernel's int8 activations round badly.

At ``accuracy_level`` 4 ONNX Runtime's ``MatMulNBits`` quantizes its input to int8 per row and per block of
``block_size`` input channels (the weights' group size), symmetric, the block's largest ``|x|`` on the largest level
(:func:`act_fake_quant` does the same in NumPy; a test checks it against the kernel).  One input channel much larger
than the others of its block (the output of a norm whose weight has a few large entries; the "massive activations"
of many LLMs) sets a step that rounds the rest of the block to a few levels: the layer's output error grows by more
than its 4-bit weights cost.

The same function is computed by ``(x / s) @ (diag(s) W)`` for any positive ``s`` ``[K]``.  Dividing the outlier
channels by ``s`` shrinks the int8 step of their block; multiplying their weight rows by ``s`` widens those rows'
range in the 4-bit groups.  :func:`equalize_scale` picks, for the layers that read one input, among

* ``s = 1`` (nothing changes), and
* per block of the kernel: the channels whose calibrated ``max |x|`` is above the block's ``p``-th percentile ``t``
  divided by ``(max |x| / t) ** beta``, for ``(p, beta)`` in :data:`CANDIDATES` (from the top channel brought to
  the next ones, to the top tenth half-way),

the one whose output error is least with the activations rounded as the kernel rounds them and the weights rounded
to the nearest level of their clipped ranges (the starting point of SignRound / the clipping search of RTN), on
calibration rows.  The weights are then quantized in the scaled space (the rounding algorithm gets ``diag(s) W`` and
the Hessian of ``x / s``) and the layer carries ``input_scale = s``: the lowering folds ``1 / s`` into the norm
before it (q/k/v, gate/up) or into up_proj's per-column scales (down_proj), exactly and for free.

Measured on SmolLM2-135M (eval/results/recipe_history.md#llama-int4):

* per layer (16 groups of 4 blocks, W4A8 output error on held-out rows after SignRound): the choice removes about
  half of the error the int8 activations add (error energy 0.0453 -> 0.0437; weight-only 0.0422), mostly on q/k/v
  and gate/up;
* the llama-int4 recipe with ``equalize: true``: 72 of 90 groups scaled, the W4A8 check's median ratio 1.04 ->
  1.016, level 4's perplexity cost on held-out *Persuasion* 0.33 -> 0.13; but the weights rounded in the scaled space
  lost about as much (the same model at level 0: 37.15 vs 36.95), so held-out perplexity did not move (37.28 / 12.88
  vs 37.29 / 12.82; a second build 37.36 / 12.68: within the build-to-build spread).  The recipe leaves it off; it
  is for models whose outlier inputs make the W4A8 check keep layers at level 0 (a planted outlier: the group stays
  on the fast kernel, its level-4 error ratio halved);
* AWQ's scale (``mean |x| ** alpha`` searched on the round-to-nearest error) removed as much activation error but
  cost the weights more (held-out *Persuasion* 37.80 with SignRound after it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from quantkit.algorithms.rtn import clip_ranges
from quantkit.calibrate.layer_stats import LayerStats
from quantkit.scheme.qparams import dequantize, group_weight_codes

__all__ = ["CANDIDATES", "PROXY_CLIP_GRID", "SEARCH_ROWS", "act_fake_quant", "candidate_scale", "equalize_scale"]

CANDIDATES: tuple[tuple[float, float], ...] = ((99.0, 1.0), (95.0, 0.75), (90.0, 0.5))
"""``(p, beta)``: per block of the kernel, channels above the block's ``p``-th percentile ``t`` of ``max |x|``
divided by ``(max |x| / t) ** beta``.  A small fixed search space (``s = 1`` is always a candidate too), not a
setting of one model: the search picks per layer group by measured error."""

SEARCH_ROWS = 1024
"""Calibration rows (the first of the layer's random reservoir sample) the candidates are scored on: a cost bound."""

PROXY_CLIP_GRID: tuple[float, ...] = (1.0, 0.9, 0.8)
"""The clip factors of the candidates' round-to-nearest weights (RTN's own search uses 9): on SmolLM2's 16 measured
layer groups the choice it leads to was as good as the full grid's (W4A8 error energy after SignRound 0.04368 vs
0.04367; no clipping at all: 0.04405) at a third of the search's cost."""


def act_fake_quant(x: np.ndarray, block: int, bits: int = 8) -> np.ndarray:
    """``x`` ``[M, K]`` quantized and dequantized as ``MatMulNBits`` at ``accuracy_level`` 4 quantizes its input:
    per row and per block of ``block`` columns (the last block may be shorter), symmetric, step
    ``max|x| / (2^(bits-1) - 1)``, rounded to nearest; an all-zero block stays zero."""
    x = np.asarray(x, np.float32)
    K = x.shape[1]
    starts = np.arange(0, K, block)
    amax = np.maximum.reduceat(np.abs(x), starts, axis=1)
    step = amax / np.float32((1 << (bits - 1)) - 1)
    step = np.repeat(step, np.diff(np.append(starts, K)), axis=1)
    safe = np.where(step > 0, step, np.float32(1.0))
    return (np.rint(x / safe) * step).astype(np.float32)


def candidate_scale(amax: np.ndarray, block: int, p: float, beta: float) -> np.ndarray:
    """The input scale of candidate ``(p, beta)`` from the per-channel ``max |x|`` ``amax`` ``[K]`` (float32, >= 1)."""
    amax = np.asarray(amax, np.float64)
    s = np.ones(amax.shape[0], np.float64)
    for a in range(0, amax.shape[0], block):
        blk = amax[a : a + block]
        t = float(np.percentile(blk, p))
        if t > 0.0:
            s[a : a + block] = np.maximum(blk / t, 1.0) ** beta
    return s.astype(np.float32)


def _rounded(w: np.ndarray, importance: np.ndarray, bits: int, g: int, symmetric: bool) -> np.ndarray:
    mn, mx = clip_ranges(w, bits, g, symmetric=symmetric, importance=importance, grid=PROXY_CLIP_GRID)
    sc, q, z = group_weight_codes(w, bits, g, symmetric=symmetric, min_val=mn, max_val=mx)
    return dequantize(q, sc, z, axis=0, block_size=g)


def equalize_scale(Ws: Sequence[np.ndarray], stats: LayerStats, *, bits: int, group_size: int, symmetric: bool,
                   act_bits: int = 8, rows: int = SEARCH_ROWS) -> tuple[np.ndarray | None, dict[str, float]]:
    """The input scale for the layers ``Ws`` (``[K, N_i]``, reading one input whose statistics are ``stats``), or
    None when ``s = 1`` scores best; with the scores (relative output error, W4A8-rounded) of every candidate."""
    X = np.asarray(stats.samples[:rows], np.float32)
    if X.shape[0] == 0:
        return None, {}
    W = np.concatenate([np.asarray(w, np.float32) for w in Ws], axis=1)
    K = W.shape[0]
    ref = X @ W
    norm = float(np.linalg.norm(ref)) or 1.0
    amax = np.maximum(np.max(np.abs(X), axis=0), np.float32(1e-12))
    diag_h = np.einsum("ij,ij->j", X, X, dtype=np.float64) / X.shape[0]
    scores: dict[str, float] = {}
    best: tuple[float, np.ndarray | None] = (np.inf, None)
    for label, s in [("1", None)] + [(f"p{p:g}^{b:g}", candidate_scale(amax, group_size, p, b)) for p, b in CANDIDATES]:
        if s is not None and np.all(s == 1.0):
            continue  # no channel above the percentile: the same as s = 1
        sv = np.ones(K, np.float32) if s is None else s
        wq = _rounded((W * sv[:, None]).astype(np.float32), diag_h / (sv.astype(np.float64) ** 2), bits, group_size,
                      symmetric)
        err = float(np.linalg.norm(act_fake_quant(X / sv, group_size, act_bits) @ wq - ref)) / norm
        scores[label] = err
        if err < best[0]:
            best = (err, s)
    return best[1], scores
