"""Streaming second moment ``H = sum x x^T`` of a GEMM-like layer's input, in the kernel's K order.

For ``MatMul`` / ``Gemm`` the rows are the input's last axis; for a 2-D ``Conv`` they are the
NHWC im2col patches ``k = (kh * KW + kw) * C + c`` (padding 0.0, as the float model pads) — the order
in which ONNX Runtime's u8 x s8 kernels pair products (:mod:`quantkit.scheme.saturation`).  Used by
pair-constrained GPTQ (:mod:`quantkit.algorithms.pair_rounding`).

Only the **diagonal blocks** of ``H`` are kept (:data:`BLOCK` consecutive inputs each, :class:`BlockDiagonal`): the
pair constraint moves a few codes by a step or two, and GPTQ spreads that error over the inputs that co-vary
with them, which in K order are the neighbouring channels of the same kernel tap.  The blocks cost
``O(K * BLOCK)`` memory and time instead of ``O(K^2)`` to collect and ``O(K * BLOCK^2)`` instead of ``O(K^3)`` to
factor: the full matrices made the pair-safe build of ResNet-18 take 9x ONNX Runtime's quantizer on 2 cores
(K up to 2304; the 4608-input layers were left out), for an output SQNR within 0.1 dB of the blocks'
(``docs/cpu-classes.md``).  Layers with ``K > max_k`` are not collected (the caller falls back to a data-free
rounding).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from quantkit.errors import CalibrationError
from quantkit.scheme.saturation import im2col_nhwc, im2col_rows_nhwc

__all__ = ["BLOCK", "FLUSH_ROWS", "ROWS_PER_K", "BlockDiagonal", "ConvGeometry", "KernelHessian", "collect_kernel_hessians",
           "finished_hessians", "gather_requests", "sampled_rows"]

BLOCK = 256
"""Inputs per diagonal block of the kept second moment (even: a pair never straddles two blocks)."""


@dataclass(frozen=True)
class BlockDiagonal:
    """A symmetric ``K x K`` matrix kept as its diagonal blocks (float64), ``blocks[i]`` covering inputs
    ``offsets[i] : offsets[i] + len(blocks[i])``; everything off the blocks is taken as 0."""

    blocks: tuple[np.ndarray, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        out, o = [], 0
        for b in self.blocks:
            out.append(o)
            o += b.shape[0]
        return tuple(out)

    @property
    def shape(self) -> tuple[int, int]:
        k = sum(b.shape[0] for b in self.blocks)
        return (k, k)

    def dense(self) -> np.ndarray:
        """The full matrix (zeros off the blocks): for tests and small K."""
        k = self.shape[0]
        out = np.zeros((k, k), np.float64)
        for o, b in zip(self.offsets, self.blocks, strict=True):
            out[o : o + b.shape[0], o : o + b.shape[0]] = b
        return out

    def quadratic(self, d: np.ndarray, dtype: type[np.floating] = np.float64) -> np.ndarray:
        """Per column of ``d [K, N]``: ``d^T H d`` (float64), the products in ``dtype``."""
        out = np.zeros(d.shape[1], np.float64)
        for o, b in zip(self.offsets, self.blocks, strict=True):
            db = np.asarray(d[o : o + b.shape[0]], dtype)
            out += np.einsum("kn,kn->n", db, np.asarray(b, dtype) @ db)
        return out

ROWS_PER_K = 8
"""Rows (input vectors) sampled per input of a diagonal block over the whole calibration pass
(``ROWS_PER_K * min(K, BLOCK)`` in all, 2048 for a full block): GPTQ adds 1% damping on top, and the estimate only
weighs where a constrained pair's error goes.  ResNet-18's output SQNR moved by < 0.1 dB from 8 to 32 rows per
input of the full matrix; with the blocks, 16 -> 8 rows: ResNet-18 34.287 -> 34.287 dB, DistilBERT 36.25 -> 36.21 dB,
its calibration pass 3.6 -> 3.0 s (2 cores).  Sampling more only costs time (the full im2col of a 112 x 112 feature
map is 12544 rows per image and dominated the run)."""


def sampled_rows(k: int, block: int | None = None) -> int:
    """Rows sampled for a layer of ``k`` inputs over the whole pass (:data:`ROWS_PER_K`)."""
    return ROWS_PER_K * min(int(k), BLOCK if block is None else int(block))


@dataclass(frozen=True)
class ConvGeometry:
    kernel: tuple[int, int]
    strides: tuple[int, int] = (1, 1)
    pads: tuple[int, int, int, int] = (0, 0, 0, 0)
    dilations: tuple[int, int] = (1, 1)


FLUSH_ROWS = 512
"""Sampled rows are buffered and added to ``H`` in one symmetric rank-k update per block (BLAS ``ssyrk``) once at
least this many are waiting: the per-batch product of the few hundred rows a batch samples with their ``K x K``
result (plus a float64 copy and sum of it) cost ResNet-18's pair-safe pass 12 s of a 30 s run on 2 cores (64
batches x 18 layers, K up to 2304); the buffered update writes ``H`` in place.  The buffer holds at most
``FLUSH_ROWS x K`` floats per layer (every layer's collector lives through the same pass: 6 MB for a 3072-input
layer) - enough rows for ``ssyrk`` on 256-wide blocks to run near its peak."""


class KernelHessian:
    """``update(x)`` with the layer input (``[N, C, H, W]`` for a Conv, ``[..., K]`` otherwise).

    The diagonal blocks of ``H`` (``block`` inputs each; the last may be shorter) are accumulated in float32 (the
    upper triangles, by ``ssyrk`` in place): the sums are averages over ``ROWS_PER_K * BLOCK`` rows at most, well
    inside float32's precision for a damped second moment.  ``block=None``: one block, the full matrix."""

    def __init__(self, k: int, conv: ConvGeometry | None = None, max_rows_per_update: int | None = None,
                 seed: int = 0, block: int | None = BLOCK) -> None:
        self.K = int(k)
        self.conv = conv
        b = self.K if block is None else max(2, int(block) + int(block) % 2)  # even: pairs stay in a block
        self._bounds = [(i, min(i + b, self.K)) for i in range(0, self.K, b)]
        self.H = [np.zeros((j - i, j - i), np.float32, order="F") for i, j in self._bounds]  # upper (ssyrk)
        self.count = 0
        # H is an average, so a uniform subsample of the rows estimates it (see ROWS_PER_K); the cost stays
        # O(K^2 * rows) per batch instead of growing with the feature-map area (112x112 = 12544 rows/image)
        self.max_rows = max_rows_per_update if max_rows_per_update is not None else sampled_rows(self.K, b)
        self._rng = np.random.default_rng(seed)
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self._flush_rows = FLUSH_ROWS

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
        if r.shape[0]:
            self._pending.append(np.ascontiguousarray(r, np.float32))
            self._pending_rows += r.shape[0]
            self.count += r.shape[0]
        if self._pending_rows >= self._flush_rows:
            self._flush()

    def _flush(self) -> None:
        """Add the buffered rows to ``H``: ``H += R^T R`` on the upper triangle, in place."""
        if not self._pending:
            return
        from scipy.linalg.blas import ssyrk

        r = self._pending[0] if len(self._pending) == 1 else np.concatenate(self._pending)
        self._pending, self._pending_rows = [], 0
        rt = r.T  # [K, rows] in Fortran order: trans=0 computes a block's r.T @ r
        for n, (i, j) in enumerate(self._bounds):
            self.H[n] = ssyrk(1.0, rt if len(self._bounds) == 1 else rt[i:j], beta=1.0, c=self.H[n], trans=0,
                              lower=0, overwrite_c=1)

    def merge(self, other: KernelHessian) -> None:
        self._flush()
        other._flush()
        for a, b in zip(self.H, other.H, strict=True):
            a += b
        self.count += other.count

    def hessian(self) -> BlockDiagonal | None:
        self._flush()
        if self.count == 0:
            return None
        blocks = []
        for h in self.H:
            upper = np.triu(h).astype(np.float64)
            blocks.append((upper + np.triu(upper, 1).T) / self.count)
        return BlockDiagonal(tuple(blocks))


def gather_requests(layers: dict[str, tuple[str, int, ConvGeometry | None]], dataset: object,
                     batch_size: int) -> dict[str, Any]:
    """``layer -> gather Request`` of a :class:`KernelHessian` per layer (``layer -> (input tensor, K, conv
    geometry)``), sampling :func:`sampled_rows` rows over the whole pass.  Never cached (``restore`` gives
    nothing): the calibration pass collects them beside the activation statistics
    (:func:`quantkit.calibrate.gather.gather`'s ``transient``)."""
    import functools

    from quantkit.calibrate.gather import Request

    try:
        batches = max(1, -(-len(dataset) // max(1, batch_size)))  # type: ignore[arg-type]
    except TypeError:  # a dataset of unknown length: sample per batch as if it were one
        batches = 1
    return {layer: Request(tensor, functools.partial(KernelHessian, k, geo, max(64, -(-sampled_rows(k) // batches))),
                           lambda st: None)
            for layer, (tensor, k, geo) in layers.items()}


def finished_hessians(collectors: Mapping[str, Any], layers: Iterable[str]) -> dict[str, BlockDiagonal]:
    """The second moments of ``layers`` from their collectors (layers that saw no finite row left out)."""
    out = {}
    for layer in layers:
        h = collectors[layer].hessian()
        if h is not None:
            out[layer] = h
    return out


def collect_kernel_hessians(
    model_proto: object,
    dataset: object,
    layers: dict[str, tuple[str, int, ConvGeometry | None]],
    *,
    batch_size: int,
    max_batch_output_bytes: int,
    progress: bool,
) -> dict[str, BlockDiagonal]:
    """One pass of the FP32 model over ``dataset``: ``H / rows`` of every layer in ``layers``
    (``layer -> (input tensor, K, conv geometry)``), its diagonal blocks.  Not cached: ``K x BLOCK`` floats
    per layer.  (The static INT8 path collects them in its calibration pass instead; this pass is for a
    plan whose activation statistics are all known already.)"""
    from quantkit.calibrate.gather import gather

    if not layers:
        return {}
    got = gather(model_proto, dataset, gather_requests(layers, dataset, batch_size), cache=None,  # type: ignore[arg-type]
                 batch_size=batch_size, max_batch_output_bytes=max_batch_output_bytes, progress=progress,
                 what="pair-safe rounding: input second moments",
                 uncached="K x 256 floats per layer, recomputed every run; the activation statistics are cached")
    return finished_hessians(got.collectors, layers)
