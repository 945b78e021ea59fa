"""A float16 model computed in float32: what quantkit calibrates and quantizes.

A model exported in half precision (``model.half()`` before the export, or converted to float16 for a GPU) has
float16 weights and activations; quantkit's calibrators, algorithms and int8 kernels work on float32, and ONNX
Runtime's CPU provider computes most float16 operators by casting to float32 anyway.  :func:`float16_to_float32`
rewrites such a graph (in place) so that every tensor inside it is float32 while its interface stays what the user
feeds and reads:

* every float16 constant (initializer, ``Constant`` node, ``ConstantOfShape`` value) becomes float32 - exact, each
  float16 value is a float32 value;
* every ``Cast`` / random / ``EyeLike`` node producing float16 produces float32 instead, and every float16 value of
  the graph (and of its subgraphs) is typed float32;
* a float16 graph input is read through ``Cast(to=float)``, a float16 graph output is written by
  ``Cast(to=float16)``: the quantized model takes and returns what the original did.

The model's function changes only by the float16 roundings it no longer makes between its operators (the float32
model is the reference the report calls FP32).  Mixed models (float32 interface, float16 inside) are rewritten the
same way.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from quantkit.irtools import all_graphs

__all__ = ["float16_to_float32"]

log = logging.getLogger("quantkit")

F16, F32 = ir.DataType.FLOAT16, ir.DataType.FLOAT
_DTYPE_ATTR_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "EyeLike",
                             "Multinomial", "Bernoulli"})


def _f32_tensor(t: ir.TensorProtocol, name: str | None) -> ir.TensorProtocol:
    return ir.tensor(np.asarray(t.numpy(), np.float32), name=name)


def _is_f16(v: ir.Value | None) -> bool:
    return v is not None and v.dtype == F16


def float16_to_float32(model: ir.Model) -> int:
    """Rewrite ``model`` (in place) as the module doc says; returns the number of float16 tensors and nodes
    converted (0: the model had none and is unchanged)."""
    graphs = all_graphs(model)
    graph = model.graph
    changed = 0
    # the interface first: which inputs / outputs the user feeds and reads in float16
    f16_inputs = [v for v in graph.inputs if _is_f16(v)]
    f16_outputs = [v for v in graph.outputs if _is_f16(v)]
    for g in graphs:
        for v in g.initializers.values():
            if v.const_value is not None and v.const_value.dtype == F16:
                v.const_value = _f32_tensor(v.const_value, v.name)
                v.dtype = F32
                changed += 1
        for v in [*g.inputs, *g.outputs]:
            if _is_f16(v) and g is not graph:  # a subgraph's interface is internal
                v.dtype = F32
                changed += 1
    for node in ir.traversal.RecursiveGraphIterator(graph):
        if node.domain in ("", "ai.onnx"):
            if node.op_type == "Cast" and node.attributes.get("to") is not None \
                    and node.attributes["to"].as_int() == F16.value:
                node.attributes["to"] = ir.AttrInt64("to", F32.value)
                changed += 1
            elif node.op_type in ("Constant", "ConstantOfShape") and node.attributes.get("value") is not None:
                t = node.attributes["value"].as_tensor()
                if t.dtype == F16:
                    node.attributes["value"] = ir.AttrTensor("value", _f32_tensor(t, t.name))
                    changed += 1
            elif node.op_type in _DTYPE_ATTR_OPS and node.attributes.get("dtype") is not None \
                    and node.attributes["dtype"].as_int() == F16.value:
                node.attributes["dtype"] = ir.AttrInt64("dtype", F32.value)
                changed += 1
        for out in node.outputs:
            if _is_f16(out):
                out.dtype = F32
                changed += 1
    for i, v in enumerate(f16_inputs):
        wide = ir.Value(name=f"{v.name}_float32", type=ir.TensorType(F32), shape=v.shape)
        v.replace_all_uses_with(wide)
        cast = ir.node("Cast", [v], attributes={"to": F32.value}, outputs=[wide], name=f"{v.name}_to_float32_{i}")
        if len(graph):
            graph.insert_before(graph[0], cast)
        else:
            graph.append(cast)
    for i, v in enumerate(f16_outputs):
        name = v.name
        v.dtype = F32
        narrow = ir.Value(name=None, type=ir.TensorType(F16), shape=v.shape)
        cast = ir.node("Cast", [v], attributes={"to": F16.value}, outputs=[narrow], name=f"{name}_to_float16_{i}")
        graph.append(cast)
        graph.outputs[graph.outputs.index(v)] = narrow
        v.name = f"{name}_float32"
        narrow.name = name
    changed += len(f16_inputs) + len(f16_outputs)
    if changed:
        log.info("float16 model: computed in float32 (%d float16 tensors / nodes converted; %d input(s) and %d "
                 "output(s) keep float16 through a Cast)", changed, len(f16_inputs), len(f16_outputs))
    return changed
