"""Embedding tables -> ONNX Runtime's ``com.microsoft.GatherBlockQuantized`` with 8-bit rows (select rule 13).

A ``Gather`` of rows from a constant float table (a word / position embedding) is a lookup, not arithmetic: there
is nothing for a QDQ kernel to fuse, and ``DequantizeLinear -> Gather`` would dequantize the whole table on every
run (ONNX Runtime does not fold a DequantizeLinear of a constant).  ``GatherBlockQuantized`` reads the rows it
gathers from 8-bit codes and dequantizes only those.  Each row is cut into blocks of :data:`BLOCK` values along
its width (fewer when the row is narrower: the largest power of two up to the width, at least 16; the last block
may be partial), each block with its own scale and uint8 zero point on the range of its values and 0 (so a zero row
- a padding token's - stays exactly zero): ``row[j] = scale[b] * (code[j] - zero_point[b])``, ``b = j // block``.
An encoder's word embedding is often half of its file (MiniLM-L6: 47 of 91 MB in float); as codes it is a quarter
of that.  The node keeps the Gather's name; a table several Gathers read is quantized once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

__all__ = ["BLOCK", "MIN_BLOCK", "TableParams", "block_size", "lower_gather_tables", "quantize_table"]

BLOCK = 128
"""Values per scale along a row (the block size of ONNX Runtime's int4 weights; 8 bits per value + 5 bytes per
block: 1.04 bytes per value)."""
MIN_BLOCK = 16
"""``GatherBlockQuantized``'s smallest block."""


@dataclass(frozen=True)
class TableParams:
    """What one table got: its block, the range of its scales and zero points, its SQNR against the float table."""

    block: int
    scale_min: float
    scale_max: float
    zero_point_range: tuple[int, int]
    sqnr_db: float


def block_size(width: int) -> int:
    """The block of a row of ``width`` values: :data:`BLOCK`, or the largest power of two up to ``width`` (at least
    :data:`MIN_BLOCK`)."""
    if width >= BLOCK:
        return BLOCK
    return max(MIN_BLOCK, 1 << (max(int(width), 1).bit_length() - 1))


def quantize_table(table: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes [V, D] uint8, scales [V, nb] float32, zero points [V, nb] uint8)`` of a float table ``[V, D]``,
    ``nb = ceil(D / block)``: per block the asymmetric 8-bit grid of ``[min(x, 0), max(x, 0)]``, rounded to
    nearest (ties to even)."""
    t = np.asarray(table, np.float32)
    V, D = t.shape
    nb = -(-D // block)
    pad = nb * block - D
    blocks = np.pad(t, ((0, 0), (0, pad)), mode="edge" if D else "constant").reshape(V, nb, block)
    lo = np.minimum(blocks.min(-1), 0.0).astype(np.float32)
    hi = np.maximum(blocks.max(-1), 0.0).astype(np.float32)
    scale = ((hi - lo) / np.float32(255.0)).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    zp = np.clip(np.rint(-lo / scale), 0, 255).astype(np.uint8)
    codes = np.clip(np.rint(blocks / scale[..., None]) + zp[..., None].astype(np.float32), 0, 255).astype(np.uint8)
    return np.ascontiguousarray(codes.reshape(V, nb * block)[:, :D]), scale, zp


def lower_gather_tables(graph: ir.Graph, names: set[str] | frozenset[str],
                        const: Callable[[str, np.ndarray], ir.Value]) -> dict[str, TableParams]:
    """Rewrite the Gathers named ``names`` (in place; select rule 13 checked each: input 0 a constant float 2-D
    table that only Gathers along axis 0 read); returns what each got.  ``const(base, array)`` registers an
    initializer under a fresh name."""
    from quantkit.evaluate.metrics import sqnr_db
    from quantkit.lowering.nbits import _drop_if_unused, _replace_node

    done: dict[str, TableParams] = {}
    packed: dict[int, tuple[ir.Value, ir.Value, ir.Value, TableParams]] = {}
    for node in list(graph):
        if node.op_type != "Gather" or (node.name or "") not in names:
            continue
        table = node.inputs[0]
        assert table is not None and table.const_value is not None  # noqa: S101 - select rule 13 checked it
        if id(table) not in packed:
            arr = np.asarray(table.const_value.numpy())
            bs = block_size(arr.shape[1])
            codes, scales, zps = quantize_table(arr, bs)
            deq = (codes.astype(np.float32) - np.repeat(zps, bs, 1)[:, :arr.shape[1]]) * np.repeat(scales, bs, 1)[
                :, :arr.shape[1]]  # fmt: skip
            params = TableParams(bs, float(scales.min()), float(scales.max()), (int(zps.min()), int(zps.max())),
                                 sqnr_db(arr, deq))
            base = table.name or node.name or "table"
            packed[id(table)] = (const(f"{base}_quantized", codes), const(f"{base}_scale", scales),
                                 const(f"{base}_zero_point", zps), params)
        q, s, z, params = packed[id(table)]
        bs = params.block
        new = ir.node("GatherBlockQuantized", [q, node.inputs[1], s, z], domain="com.microsoft", name=node.name,
                      attributes={"gather_axis": 0, "quantize_axis": 1, "block_size": bs, "bits": 8},
                      outputs=[ir.Value(name=None, type=node.outputs[0].type, shape=node.outputs[0].shape)])
        node.name = None
        _replace_node(graph, node, new)
        _drop_if_unused(graph, table)
        done[new.name or ""] = params
    return done
