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
from quantkit.scheme.saturation import im2col_nhwc, im2col_rows_nhwc

__all__ = ["ROWS_PER_K", "ConvGeometry", "KernelHessian"]

ROWS_PER_K = 32
"""Rows (input vectors) sampled per input dimension over the whole calibration pass: a ``K x K`` second
moment estimated from ``32 K`` rows is well conditioned (GPTQ adds 1% damping on top); sampling more only
costs time (the full im2col of a 112 x 112 feature map is 12544 rows per image and dominated the run)."""


@dataclass(frozen=True)
class ConvGeometry:
    kernel: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilations: tuple[int, int] = (1, 1)


class KernelHessian:
    """``update(x)`` with the layer input (``[N, C, H, W]`` for a Conv, ``[..., K]`` otherwise)."""

    def __init__(self, k: int, conv: ConvGeometry | None = None, max_rows_per_update: int | None = None,
                 seed: int = 0) -> None:
        self.K = int(k)
        self.conv = conv
        self.H = np.zeros((self.K, self.K), np.float64)
        self.count = 0
        # H is an average, so a uniform subsample of the rows estimates it (see ROWS_PER_K); the cost stays
        # O(K^2 * rows) per batch instead of growing with the feature-map area (112x112 = 12544 rows/image)
        self.max_rows = max_rows_per_update if max_rows_per_update is not None else ROWS_PER_K * self.K
        self._rng = np.random.default_rng(seed)

    def update(self, x: np.ndarray) -> None:
        a = np.asarray(x, np.float32)
        if self.conv is not None:
            if a.ndim != 4:
                raise CalibrationError(f"KernelHessian: a Conv input must be 4-D, got shape {a.shape}")
            c = self.conv
            n, _, h, w = a.shape
            oh = (h + c.pads[0] + c.pads[2] - c.dilations[0] * (c.kernel[0] - 1) - 1) // c.strides[0] + 1
            ow = (w + c.pads[1] + c.pads[3] - c.dilations[1] * (c.kernel[1] - 1) - 1) // c.strides[1] + 1
            total = n * max(oh, 0) * max(ow, 0)
            if total > self.max_rows:  # sample the patches first: only those are built
                pick = np.sort(self._rng.choice(total, self.max_rows, replace=False))
                rows = im2col_rows_nhwc(a, c.kernel, c.strides, c.pads, c.dilations, 0.0, pick)
            else:
                rows, _, _ = im2col_nhwc(a, c.kernel, c.strides, c.pads, c.dilations, 0.0)
        else:
            rows = a.reshape(-1, a.shape[-1])
            if rows.shape[0] > self.max_rows:
                rows = rows[np.sort(self._rng.choice(rows.shape[0], self.max_rows, replace=False))]
        if rows.shape[1] != self.K:
            raise CalibrationError(f"KernelHessian: rows of width {rows.shape[1]}, expected K={self.K}")
        finite = np.all(np.isfinite(rows), axis=1)
        r = rows if finite.all() else rows[finite]
        # float32 products (sgemm), summed into float64 across batches: each batch adds at most max_rows
        # terms per entry, well inside float32's precision for an average
        self.H += (r.T @ r).astype(np.float64)
        self.count += r.shape[0]

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
    try:
        batches = max(1, -(-len(dataset) // max(1, batch_size)))  # type: ignore[arg-type]
    except TypeError:  # a dataset of unknown length: sample per batch as if it were one
        batches = 1
    requests = {
        layer: Request(tensor, functools.partial(KernelHessian, k, geo, max(64, -(-ROWS_PER_K * k // batches))),
                       lambda st: None)
        for layer, (tensor, k, geo) in layers.items()
    }
    got = gather(model_proto, dataset, requests, cache=None, batch_size=batch_size,  # type: ignore[arg-type]
                 max_batch_output_bytes=max_batch_output_bytes, progress=progress,
                 what="pair-safe rounding: input second moments",
                 uncached="K x K floats per layer, recomputed every run; the activation statistics are cached")
    out = {}
    for layer in layers:
        h = got.collectors[layer].hessian()
        if h is not None:
            out[layer] = h
    return out
