"""INT8 W8A8 lowering with *dynamic* activation quantization of ``MatMul(x, W)`` layers.

Weights: symmetric int8 per output column on ``[-127, 127]`` (scale ``[N]``).  Activations are
quantized at run time, so no activation range is calibrated (the calibration data only choose
SmoothQuant's ``s``, see :mod:`quantkit.algorithms.smoothquant`).  Two granularities:

* ``per_token`` (default): one scale per row of ``x`` (per token of an LLM)::

      x2 = Reshape(x, [-1, K]);  a = max(ReduceMax(|x2|, axis 1) / 127, 1e-12)     # [M, 1]
      q  = QuantizeLinear(x2, a, 128, axis 0)                                       # uint8
      y  = Reshape(MatMulIntegerToFloat(q, W_q, a, w_scale, 128[, bias]), [*x.shape[:-1], N])

  ONNX Runtime (1.32, CPU) runs ``MatMulIntegerToFloat`` with an ``[M, 1]`` ``a_scale`` as one
  fused int8 GEMM (RUNTIME.md: 0.17 ms vs FP32 0.45 ms at 128x576x1536); it wants uint8
  activations (int8 ones run ~6x slower), hence the +128 zero point.  The zero point of
  ``QuantizeLinear`` must have the scale's shape ``[M]``: it is ``Expand``-ed from a constant.
* ``per_tensor``: one ``com.microsoft.DynamicQuantizeMatMul(x, W_q, w_scale[, bias])``
  (ORT's own dynamic quantization: one asymmetric uint8 scale for the whole ``x``).

The int8 GEMM keeps the layer's name ``L`` (the census maps it); helper nodes are named ``L/...`` so
profiles attribute their time to ``L``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from quantkit.errors import RecipeError
from quantkit.lowering.nbits import _const, _drop_if_unused, _find, _replace_node
from quantkit.lowering.qdq import _Namer
from quantkit.lowering.select import constant_array

__all__ = ["GRANULARITIES", "lower_int8_dynamic"]

GRANULARITIES = ("per_token", "per_tensor")


def lower_int8_dynamic(
    model: ir.Model,
    node_name: str,
    w_q: np.ndarray,
    w_scale: np.ndarray,
    *,
    granularity: str = "per_token",
) -> ir.Node:
    """Replace ``MatMul(x, W)`` named ``node_name`` by a dynamic-activation int8 GEMM.

    ``w_q`` int8 ``[K, N]`` and ``w_scale`` ``[N]`` are the (already smoothed) weight codes; a
    SmoothQuant input scale must have been applied to ``x`` by the caller."""
    if granularity not in GRANULARITIES:
        raise RecipeError(
            f"layer {node_name!r}: activation granularity {granularity!r}; allowed: {list(GRANULARITIES)}"
        )
    graph = model.graph
    node = _find(graph, node_name, ("MatMul",))
    x, w = node.inputs[0], node.inputs[1]
    if x is None or w is None or constant_array(w) is None:
        raise RecipeError(f"layer {node_name!r}: int8 needs a constant weight (input 1)")
    K, N = (int(d) for d in w_q.shape)
    namer = _Namer(graph)
    base = w.name or node_name
    wq_v = _const(graph, namer, f"{base}_int8", np.ascontiguousarray(w_q, np.int8))
    ws_v = _const(graph, namer, f"{base}_int8_scale", np.ascontiguousarray(w_scale, np.float32))
    model.opset_imports.setdefault("com.microsoft", 1)
    if granularity == "per_tensor":
        new = ir.node(
            "DynamicQuantizeMatMul",
            [x, wq_v, ws_v],
            domain="com.microsoft",
            name=node.name,
            outputs=[ir.Value(name=None)],
        )
        _replace_node(graph, node, new)
        _drop_if_unused(graph, w)
        return new

    def c(name: str, arr: np.ndarray) -> ir.Value:
        return _const(graph, namer, f"{node_name}/{name}", arr)

    def add(op: str, inputs: list[ir.Value | None], tag: str, **attrs: Any) -> ir.Value:
        n = ir.node(
            op,
            inputs,
            attributes=attrs or None,
            name=namer(f"{node_name}/{tag}"),
            outputs=[ir.Value(name=namer(f"{node_name}/{tag}_out"))],
        )
        graph.insert_before(node, n)
        return n.outputs[0]

    x2 = add("Reshape", [x, c("rows_shape", np.array([-1, K], np.int64))], "rows")
    ab = add("Abs", [x2], "abs")
    if model.opset_imports.get("", 0) >= 18:  # axes became an input in opset 18
        mx = add("ReduceMax", [ab, c("axis1", np.array([1], np.int64))], "absmax", keepdims=1)
    else:
        mx = add("ReduceMax", [ab], "absmax", keepdims=1, axes=[1])
    sc0 = add("Div", [mx, c("qmax", np.array([127.0], np.float32))], "scale_raw")
    sc = add("Max", [sc0, c("tiny", np.array([1e-12], np.float32))], "scale")  # all-zero rows
    sc1 = add("Reshape", [sc, c("flat", np.array([-1], np.int64))], "scale_1d")
    shp = add("Shape", [sc1], "rows_count")
    zpv = add("Expand", [c("zp128", np.array([128], np.uint8)), shp], "zero_points")
    q = add("QuantizeLinear", [x2, sc1, zpv], "quantize", axis=0)
    mm = ir.node(
        "MatMulIntegerToFloat",
        [q, wq_v, sc, ws_v, c("a_zp", np.array(128, np.uint8))],
        domain="com.microsoft",
        name=node.name,  # the int8 GEMM carries the layer name (census, profiles)
        outputs=[ir.Value(name=namer(f"{node_name}/y_rows"))],
    )
    graph.insert_before(node, mm)
    lead = add("Shape", [x], "lead_shape", end=-1)
    oshape = add("Concat", [lead, c("n", np.array([N], np.int64))], "out_shape", axis=0)
    new = ir.node("Reshape", [mm.outputs[0], oshape], name=namer(f"{node_name}/output_rows"),
                  outputs=[ir.Value(name=None)])
    _replace_node(graph, node, new)
    _drop_if_unused(graph, w)
    return new
