"""SmoothQuant: migrate activation outliers into the weights before W8A8 quantization.

For a linear layer ``y = x @ W`` (``W`` ``[K, N]``), any positive per-input-channel vector
``s`` ``[K]`` gives the same product::

    y = (x / s) @ (diag(s) W)

LLM activations have a few input channels with outliers ~100x the rest; quantizing ``x``
per token then spends the whole int8 grid on them.  SmoothQuant (Xiao et al., 2023) picks

    s_k = max|x_k|^alpha / max_n |W_kn|^(1 - alpha)

so the per-channel ranges of ``x / s`` and ``diag(s) W`` meet in between (``alpha`` = 0.5
balances them).  Layers that read the same ``x`` (q/k/v, gate/up) share one ``s``, computed
from the largest weight magnitude over all of them, so ``1 / s`` can be folded into the
preceding normalization's gamma (see :func:`quantkit.lowering.nbits.apply_input_scale`).

``alpha`` may be searched per group (``alpha: auto``): each candidate is scored by the output
error of the *quantized* layers (per-token int8 activations, per-column int8 weights) on a
bounded sample of calibration rows, and the best is kept.

:class:`ChannelAbsMax` streams ``max |x_k|`` over calibration batches in O(K) memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from quantkit.errors import RecipeError

__all__ = ["ALPHA_GRID", "ChannelAbsMax", "int8_weight_per_column", "smooth_scales", "w8a8_error"]

ALPHA_GRID = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


class ChannelAbsMax:
    """Streams ``max |x|`` per channel of the last axis, plus a bounded random row sample."""

    def __init__(self, max_rows: int = 256, seed: int = 0) -> None:
        self.absmax: np.ndarray | None = None
        self.rows: np.ndarray | None = None
        self.max_rows = max_rows
        self.seen = 0
        self._rng = np.random.default_rng(seed)

    def update(self, x: np.ndarray) -> None:
        if x.ndim == 0 or x.size == 0:
            return
        x2 = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
        m = np.max(np.abs(x2), axis=0)
        self.absmax = m if self.absmax is None else np.maximum(self.absmax, m)
        if self.max_rows:
            # reservoir sample of rows (uniform over everything seen)
            take = x2[self._rng.choice(x2.shape[0], size=min(self.max_rows, x2.shape[0]), replace=False)]
            if self.rows is None:
                self.rows = take.copy()
            else:
                pool = np.concatenate([self.rows, take])
                weights = np.concatenate(
                    [np.full(len(self.rows), self.seen), np.full(len(take), x2.shape[0])]
                )
                p = weights / weights.sum()
                keep = self._rng.choice(len(pool), size=min(self.max_rows, len(pool)), replace=False, p=p)
                self.rows = pool[np.sort(keep)]
        self.seen += x2.shape[0]

    def merge(self, other: ChannelAbsMax) -> None:
        if other.absmax is None:
            return
        self.absmax = other.absmax if self.absmax is None else np.maximum(self.absmax, other.absmax)
        if other.rows is not None:
            self.rows = (
                other.rows if self.rows is None else np.concatenate([self.rows, other.rows])[: self.max_rows]
            )
        self.seen += other.seen

    def state(self) -> dict[str, Any]:
        return {
            "absmax": np.zeros(0, np.float32) if self.absmax is None else self.absmax,
            "rows": np.zeros((0, 0), np.float32) if self.rows is None else self.rows,
            "max_rows": self.max_rows,
            "seen": self.seen,
        }

    @classmethod
    def from_state(cls, st: Mapping[str, Any]) -> ChannelAbsMax:
        obj = cls(int(st["max_rows"]))
        a = np.asarray(st["absmax"], np.float32)
        r = np.asarray(st["rows"], np.float32)
        obj.absmax = a if a.size else None
        obj.rows = r if r.size else None
        obj.seen = int(st["seen"])
        return obj


def int8_weight_per_column(w: np.ndarray, *, pair_safe: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-column int8 codes ``[K, N]`` on ``[-127, 127]`` and scales ``[N]``.

    Uses the scheme module's qparams and ``QuantizeLinear`` arithmetic (bit-exact with ORT).
    ``pair_safe``: codes obey the int16 pair bound of x86 CPUs without VNNI
    (:func:`quantkit.algorithms.pair_rounding.pair_safe_weight`)."""
    from quantkit.algorithms.pair_rounding import pair_safe_weight
    from quantkit.scheme.qparams import QuantSpec, quantize, weight_qparams

    spec = QuantSpec(dtype="int8", symmetric=True, granularity="channel", axis=1, narrow=True)
    scale, zp = weight_qparams(np.asarray(w, np.float32), spec)
    q = quantize(w, scale, zp, axis=1)
    if pair_safe:
        q, scale, _ = pair_safe_weight(np.asarray(w, np.float32), np.asarray(q), np.asarray(scale), np.asarray(zp),
                                       op_type="MatMul")
    return np.asarray(q, np.int8), np.asarray(scale, np.float32)


def smooth_scales(absmax_x: np.ndarray, weights: Sequence[np.ndarray], alpha: float) -> np.ndarray:
    """``s_k = max|x_k|^alpha / max|W_k.|^(1-alpha)`` over all ``weights`` (each ``[K, N_i]``).

    Channels that never fire (``max|x_k| = 0``) or have all-zero weights keep ``s_k = 1``."""
    if not 0.0 <= alpha <= 1.0:
        raise RecipeError(f"smoothquant alpha={alpha!r} is outside [0, 1]")
    ax = np.asarray(absmax_x, np.float64)
    aw = np.max(np.stack([np.max(np.abs(np.asarray(w, np.float64)), axis=1) for w in weights]), axis=0)
    ok = (ax > 0) & (aw > 0)
    s = np.ones_like(ax)
    s[ok] = ax[ok] ** alpha / aw[ok] ** (1.0 - alpha)
    s = np.clip(s, 1e-5, 1e5)
    return s.astype(np.float32)


def _per_token_dq(x: np.ndarray) -> np.ndarray:
    """Dequantized per-row symmetric int8 (uint8 + 128 storage, as the emitted graph does)."""
    sc = np.maximum(np.max(np.abs(x), axis=1, keepdims=True) / np.float32(127), np.float32(1e-12))
    q = np.clip(np.round(x / sc), -128, 127)
    return (q * sc).astype(np.float32)


def w8a8_error(
    rows: np.ndarray, weights: Sequence[np.ndarray], s: np.ndarray | None, *, per_token: bool,
    pair_safe: bool = False,
) -> float:
    """Relative output error ``sum ||xW - Q(x/s) Q(sW)||^2 / sum ||xW||^2`` over ``weights``."""
    x = np.asarray(rows, np.float32)
    xs = x if s is None else x / s
    if per_token:
        xq = _per_token_dq(xs)
    else:
        a = float(np.max(np.abs(xs))) / 127 or 1e-12
        xq = (np.clip(np.round(xs / a), -128, 127) * a).astype(np.float32)
    num = den = 0.0
    for w in weights:
        ws = w if s is None else w * s[:, None]
        q, sc = int8_weight_per_column(ws, pair_safe=pair_safe)
        ref = x @ w
        got = xq @ (q.astype(np.float32) * sc)
        num += float(np.sum((ref - got).astype(np.float64) ** 2))
        den += float(np.sum(ref.astype(np.float64) ** 2))
    return num / max(den, 1e-30)


def choose_alpha(
    stats: ChannelAbsMax, weights: Sequence[np.ndarray], alpha: float | str, *, per_token: bool,
    pair_safe: bool = False,
) -> tuple[np.ndarray | None, float | None, dict[str, float]]:
    """``(s, alpha, errors)`` for one group of layers sharing an input.

    ``alpha`` a number: that value.  ``"auto"``: the grid value (or no smoothing at all) with
    the least :func:`w8a8_error` on the sampled rows.  ``s`` is ``None`` when smoothing lost."""
    if stats.absmax is None:
        return None, None, {}
    if alpha != "auto":
        a = float(alpha)
        return smooth_scales(stats.absmax, weights, a), a, {}
    if stats.rows is None or len(stats.rows) == 0:
        return smooth_scales(stats.absmax, weights, 0.5), 0.5, {}
    errors = {"none": w8a8_error(stats.rows, weights, None, per_token=per_token, pair_safe=pair_safe)}
    best_s, best_a, best_e = None, None, errors["none"]
    for a in ALPHA_GRID:
        s = smooth_scales(stats.absmax, weights, a)
        e = w8a8_error(stats.rows, weights, s, per_token=per_token, pair_safe=pair_safe)
        errors[f"{a:g}"] = e
        if e < best_e:
            best_s, best_a, best_e = s, a, e
    return best_s, best_a, errors
