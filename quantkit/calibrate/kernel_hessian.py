"""Streaming second moment ``H = sum x x^T`` of a GEMM-like layer's input, in the kernel's K order.

For ``MatMul`` / ``Gemm`` the rows are the input's last axis; for a 2-D ``Conv`` they are the
NHWC im2col patches ``k = (kh * KW + kw) * C + c`` (padding 0.0, as the float model pads) — the order
in which ONNX Runtime's u8 x s8 kernels pair products (:mod:`quantkit.scheme.saturation`).  Used by
pair-constrained GPTQ (:mod:`quantkit.algorithms.pair_rounding`).  Memory ``O(K^2)``; layers with
``K > max_k`` are not collected (the caller falls back to a data-free rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from quantkit.errors import CalibrationError
from quantkit.scheme.saturation import im2col_nhwc

__all__ = ["ConvGeometry", "KernelHessian"]


@dataclass(frozen=True)
class ConvGeometry:
    kernel: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilations: tuple[int, int] = (1, 1)


class KernelHessian:
    """``update(x)`` with the layer input (``[N, C, H, W]`` for a Conv, ``[..., K]`` otherwise)."""

    def __init__(self, k: int, conv: ConvGeometry | None = None, max_rows_per_update: int = 65536,
                 seed: int = 0) -> None:
        self.K = int(k)
        self.conv = conv
        self.H = np.zeros((self.K, self.K), np.float64)
        self.count = 0
        self.max_rows = max_rows_per_update
        self._rng = np.random.default_rng(seed)

    def update(self, x: np.ndarray) -> None:
        a = np.asarray(x, np.float32)
        if self.conv is not None:
            if a.ndim != 4:
                raise CalibrationError(f"KernelHessian: a Conv input must be 4-D, got shape {a.shape}")
            c = self.conv
            rows, _, _ = im2col_nhwc(a, c.kernel, c.strides, c.pads, c.dilations, 0.0)
        else:
            rows = a.reshape(-1, a.shape[-1])
        if rows.shape[1] != self.K:
            raise CalibrationError(f"KernelHessian: rows of width {rows.shape[1]}, expected K={self.K}")
        if rows.shape[0] > self.max_rows:  # uniform subsample: H is an average, the scale cancels in GPTQ
            rows = rows[self._rng.choice(rows.shape[0], self.max_rows, replace=False)]
        finite = np.all(np.isfinite(rows), axis=1)
        r64 = rows[finite].astype(np.float64)
        self.H += r64.T @ r64
        self.count += r64.shape[0]

    def merge(self, other: KernelHessian) -> None:
        self.H += other.H
        self.count += other.count

    def hessian(self) -> np.ndarray | None:
        return None if self.count == 0 else self.H / self.count


def collect_kernel_hessians(
    model_proto: object,
    dataset: object,
    layers: dict[str, tuple[str, int, ConvGeometry | None]],
    *,
    batch_size: int,
    max_batch_output_bytes: int,
    progress: bool,
) -> dict[str, np.ndarray]:
    """One pass of the FP32 model over ``dataset``: ``H / rows`` of every layer in ``layers``
    (``layer -> (input tensor, K, conv geometry)``).  Not cached: ``K^2`` floats per layer."""
    import functools

    from quantkit.calibrate.gather import Request, gather

    if not layers:
        return {}
    requests = {
        layer: Request(tensor, functools.partial(KernelHessian, k, geo), lambda st: None)
        for layer, (tensor, k, geo) in layers.items()
    }
    got = gather(model_proto, dataset, requests, cache=None, batch_size=batch_size,  # type: ignore[arg-type]
                 max_batch_output_bytes=max_batch_output_bytes, progress=progress)
    out = {}
    for layer in layers:
        h = got.collectors[layer].hessian()
        if h is not None:
            out[layer] = h
    return out
