"""FP16 / BF16 lowering of ``MatMul(x, W)`` layers: what 16-bit means depends on the runtime.

* ``storage`` (ONNX Runtime CPU): ``W`` is stored as a 16-bit initializer and widened by
  ``Cast(to=FLOAT)`` in front of the float MatMul.  ORT's CPU provider has no FP16 MatMul and
  no BF16 MatMul at all (session creation fails, RUNTIME.md), and folds a constant weight's
  Cast back to FP32 at load time (ORT_ENABLE_BASIC and above): the file halves, compute and
  run-time memory stay FP32, and so does the latency.  The only numeric effect is the
  rounding of ``W`` to 16 bits.
* ``native`` (CUDA / TensorRT providers, which have 16-bit GEMMs): the layer computes in 16 bits,
  ``y = Cast_fp32(MatMul(Cast_16(x), W16))``.  Cast boundaries are shared, not duplicated:
  layers that read the same ``x`` reuse one ``Cast_16(x)``, and a ``Cast_fp32`` whose every
  consumer is a ``Cast_16`` to the same type is bypassed (see :func:`merge_casts`).

Helper nodes of layer ``L`` are named ``L/...`` so profiles attribute their time to ``L``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from quantkit.errors import RecipeError
from quantkit.lowering.nbits import _const, _drop_if_unused, _find, _replace_node
from quantkit.lowering.qdq import _Namer
from quantkit.lowering.select import constant_array

__all__ = ["FLOAT16_TYPES", "bf16_round", "lower_cast", "merge_casts", "round_to"]

FLOAT16_TYPES = {"fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}


def bf16_round(w: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16) with round-half-to-even, as ONNX ``Cast`` does."""
    u = np.ascontiguousarray(w, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(w)
    out = rounded.astype(np.uint16)
    out[nan] = 0x7FC0
    return out


def round_to(w: np.ndarray, fmt: str) -> np.ndarray:
    """``w`` rounded to ``fmt`` ("fp16" / "bf16") and widened back to float32 (what the layer computes with)."""
    if fmt == "fp16":
        return np.asarray(w, np.float32).astype(np.float16).astype(np.float32)
    if fmt == "bf16":
        return (bf16_round(w).astype(np.uint32) << 16).view(np.float32)
    raise RecipeError(f"16-bit format {fmt!r}; allowed: {sorted(FLOAT16_TYPES)}")


def _tensor16(w: np.ndarray, fmt: str, name: str) -> ir.TensorProtocol:
    if fmt == "fp16":
        return ir.tensor(np.asarray(w, np.float32).astype(np.float16), name=name)
    import ml_dtypes

    return ir.tensor(bf16_round(w).view(ml_dtypes.bfloat16), name=name)


def lower_cast(model: ir.Model, node_name: str, fmt: str, *, compute: str = "storage") -> ir.Node:
    """Give ``node_name`` (MatMul; Conv / Gemm: storage only) a 16-bit weight (``fmt`` "fp16"/"bf16");
    ``compute`` as in the module doc."""
    if fmt not in FLOAT16_TYPES:
        raise RecipeError(f"layer {node_name!r}: 16-bit format {fmt!r}; allowed: {sorted(FLOAT16_TYPES)}")
    if compute not in ("storage", "native"):
        raise RecipeError(f"layer {node_name!r}: compute {compute!r}; allowed: ['storage', 'native']")
    graph = model.graph
    node = _find(graph, node_name, ("MatMul", "Conv", "Gemm"))
    if node.op_type != "MatMul" and compute != "storage":
        raise RecipeError(
            f"layer {node_name!r} ({node.op_type}): 16-bit compute 'native' is for MatMul; allowed: storage"
        )
    w_val = node.inputs[1]
    w = constant_array(w_val)
    if w is None or w_val is None:
        raise RecipeError(f"layer {node_name!r}: fp16/bf16 needs a constant weight (input 1)")
    namer = _Namer(graph)
    dt = FLOAT16_TYPES[fmt]
    base = w_val.name or node_name
    w16 = _const(graph, namer, f"{base}_{fmt}", _tensor16(w, fmt, f"{base}_{fmt}"))
    if compute == "storage":
        cast = ir.node(
            "Cast",
            [w16],
            attributes={"to": ir.DataType.FLOAT},
            name=namer(f"{node_name}/weight_cast"),
            outputs=[ir.Value(name=namer(f"{base}_{fmt}_widened"))],
        )
        graph.insert_before(node, cast)
        node.replace_input_with(1, cast.outputs[0])
    else:
        x = node.inputs[0]
        if x is None:
            raise RecipeError(f"layer {node_name!r} has no input")
        x16 = _shared_cast(graph, namer, x, dt, node, f"{node_name}/input_cast")
        mm = ir.node(
            "MatMul", [x16, w16], name=node.name, outputs=[ir.Value(name=namer(f"{node_name}/y_{fmt}"))]
        )
        back = ir.node(
            "Cast",
            [mm.outputs[0]],
            attributes={"to": ir.DataType.FLOAT},
            name=namer(f"{node_name}/output_cast"),
            outputs=[ir.Value(name=None)],
        )
        mm.outputs[0].type = ir.TensorType(dt)
        graph.insert_before(node, mm)
        _replace_node(graph, node, back)
        node = mm
    _drop_if_unused(graph, w_val)
    return node


def _shared_cast(
    graph: ir.Graph, namer: _Namer, x: ir.Value, dt: ir.DataType, before: ir.Node, name: str
) -> ir.Value:
    """One ``Cast(x, to=dt)`` per (x, dt): reuse an existing one (q/k/v read one cast of x)."""
    for use in x.uses():
        n = use.node
        to = n.attributes.get("to")
        if n.op_type == "Cast" and to is not None and to.as_int() == dt:
            return n.outputs[0]
    cast = ir.node(
        "Cast",
        [x],
        attributes={"to": dt},
        name=namer(name),
        outputs=[ir.Value(name=namer(f"{x.name}_16"), type=ir.TensorType(dt), shape=x.shape)],
    )
    graph.insert_before(before, cast)
    return cast.outputs[0]


def merge_casts(model: ir.Model) -> int:
    """Bypass ``Cast_16(Cast_fp32(z16))`` chains (z16 already of that 16-bit type); return how many.

    Exact: widening a 16-bit value to float32 and narrowing it back to the same type is the
    identity.  The float32 Cast is removed when nothing else reads it."""
    graph = model.graph
    merged = 0
    for node in list(graph):
        if node.op_type != "Cast" or node.inputs[0] is None:
            continue
        src = node.inputs[0].producer()
        to = node.attributes.get("to")
        if src is None or src.op_type != "Cast" or to is None or src.inputs[0] is None:
            continue
        z = src.inputs[0]
        if (
            z.type is None
            or z.type.dtype != to.as_int()
            or src.attributes["to"].as_int() != ir.DataType.FLOAT
        ):
            continue
        node.outputs[0].replace_all_uses_with(z, replace_graph_outputs=False)
        if not node.outputs[0].is_graph_output():
            graph.remove(node, safe=True)
        merged += 1
        if not list(src.outputs[0].uses()) and not src.outputs[0].is_graph_output():
            graph.remove(src, safe=True)
    return merged
