"""Bias correction: remove the mean output shift that weight quantization introduces.

For a layer ``y = W x + b`` whose weight is replaced by its quantize-dequantize ``Ŵ``, the
expected output moves by ``E[Ŵx] - E[Wx] = (Ŵ - W) E[x]`` (Nagel et al., "Data-Free
Quantization", 2019).  Measuring ``E[x]`` per input channel on the calibration data and
setting ``b' = b - (Ŵ - W) E[x]`` makes the quantized layer unbiased again.

* ``Conv``: ``E[x]`` per input channel (mean over batch and space);
  ``Δ[o] = Σ_{i,k} (Ŵ - W)[o, i, k] · E[x][g(o)·I_g + i]`` with ``g(o)`` the group of
  output channel ``o`` (depthwise included).  Zero padding at the borders is ignored
  (the correction is exact for interior outputs).
* ``MatMul`` ``[K, N]`` / ``Gemm``: ``Δ[n] = Σ_k (Ŵ - W)[k, n] · E[x][k]`` with ``E[x]``
  the mean over every leading axis.

Per-channel depthwise weights (9 values per channel) are where this matters most: their
rounding errors do not average out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


class ChannelMean:
    """Streams the mean of an activation per channel (``axis``), O(C) memory."""

    def __init__(self, axis: int) -> None:
        self.axis = axis
        self.sum: np.ndarray | None = None
        self.count = 0

    def update(self, x: np.ndarray) -> None:
        if x.ndim == 0:
            return
        ax = self.axis % x.ndim
        if x.shape[ax] == 0:  # no channel to average (an empty layer is refused before calibration)
            return
        others = tuple(i for i in range(x.ndim) if i != ax)
        s = np.sum(x.astype(np.float64), axis=others)
        self.sum = s if self.sum is None else self.sum + s
        self.count += x.size // x.shape[ax]

    def merge(self, other: ChannelMean) -> None:
        if other.sum is not None:
            self.sum = other.sum if self.sum is None else self.sum + other.sum
            self.count += other.count

    @property
    def mean(self) -> np.ndarray | None:
        return None if self.sum is None or self.count == 0 else self.sum / self.count

    def state(self) -> dict[str, Any]:
        return {"axis": self.axis, "sum": np.zeros(0) if self.sum is None else self.sum, "count": self.count}

    @classmethod
    def from_state(cls, st: Mapping[str, Any]) -> ChannelMean:
        obj = cls(int(st["axis"]))
        s = np.asarray(st["sum"], np.float64)
        obj.sum = s if s.size else None
        obj.count = int(st["count"])
        return obj


def bias_shift(op_type: str, w: np.ndarray, w_hat: np.ndarray, mean_x: np.ndarray, *, group: int = 1,
               trans_b: bool = False) -> np.ndarray | None:
    """``(Ŵ - W) E[x]`` per output channel, or None when the shapes do not line up."""
    d = (w_hat.astype(np.float64) - w.astype(np.float64))
    if op_type == "Conv":
        o, i_g = d.shape[0], d.shape[1]
        if mean_x.shape[0] != i_g * group or o % group:
            return None
        per_group_out = o // group
        m = mean_x.reshape(group, i_g)  # [G, I_g]
        dsum = d.reshape(o, i_g, -1).sum(axis=2)  # [O, I_g]
        g_of_o = np.arange(o) // per_group_out
        return np.einsum("oi,oi->o", dsum, m[g_of_o])
    if op_type in ("MatMul", "Gemm"):
        if op_type == "Gemm" and trans_b:
            d = d.T
        if mean_x.shape[0] != d.shape[0]:
            return None
        return mean_x @ d
    return None
