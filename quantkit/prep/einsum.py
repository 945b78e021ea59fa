"""Rewrite a linear layer written as ``Einsum`` with a constant weight as ``MatMul`` (exact).

JAX / TensorFlow conversions and hand-written PyTorch write dense layers as ``einsum("btd,dk->btk", x, W)``.
ONNX Runtime has no int8 ``Einsum`` kernel, so such a layer stayed float ("not in an int8 chain").  An
``Einsum`` that contracts the last axis of ``x`` with one axis of a constant 2-D ``W`` and appends ``W``'s other
axis is ``MatMul(x, W)`` (``W`` transposed once when it is written ``kd``)::

    Einsum("...d,dk->...k", x, W)  ==  MatMul(x, W)
    Einsum("btd,kd->btk", x, W)    ==  MatMul(x, W^T)

Anything else (batched contractions between two activations - attention scores -, several contracted axes,
repeated letters, broadcast ellipses in other places) is left as it is.  The node keeps its name and output,
and recipe overrides by ``op_type: Einsum`` keep matching (the original op type is kept in its metadata).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from quantkit.lowering.select import ORIGINAL_OP_TYPE

__all__ = ["einsum_to_matmul", "linear_einsum"]


def linear_einsum(equation: str) -> bool | None:
    """For an equation ``x, W -> y`` of a linear layer: whether ``W`` is written ``kd`` (needs a transpose), or
    None when the equation is not a linear layer over the last axis of ``x``."""
    eq = equation.replace(" ", "")
    if eq.count("->") != 1:
        return None
    lhs, out = eq.split("->")
    parts = lhs.split(",")
    if len(parts) != 2:
        return None
    a, b = parts
    if "." in b or len(b) != 2 or b[0] == b[1]:
        return None
    a_core, out_core = a, out
    if a.startswith("..."):
        if not out.startswith("..."):
            return None
        a_core, out_core = a[3:], out[3:]
    if "." in a_core or "." in out_core or not a_core or len(set(a_core)) != len(a_core):
        return None
    contracted = a_core[-1]
    if contracted not in b or contracted in out_core:
        return None
    kept = b[1] if b[0] == contracted else b[0]
    if kept in a_core or out_core != a_core[:-1] + kept:
        return None
    return b[0] != contracted  # "kd": the weight is stored transposed


def einsum_to_matmul(model: ir.Model) -> int:
    """Rewrite every linear ``Einsum`` with a constant 2-D float weight (module doc); returns how many."""
    graph = model.graph
    done = 0
    for node in list(graph):
        if node.op_type != "Einsum" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        eq = node.attributes.get("equation")
        w = node.inputs[1]
        if eq is None or w is None or w.const_value is None or node.inputs[0] is None:
            continue
        transposed = linear_einsum(eq.as_string())
        arr = np.asarray(w.const_value.numpy())
        if transposed is None or arr.ndim != 2 or not np.issubdtype(arr.dtype, np.floating):
            continue
        weight = w
        if transposed:
            t = np.ascontiguousarray(arr.T)
            name = f"{node.name or w.name}_weight"
            weight = ir.Value(name=name, type=ir.TensorType(ir.DataType.from_numpy(t.dtype)), shape=ir.Shape(t.shape),
                              const_value=ir.tensor(t, name=name))
            graph.register_initializer(weight)
        mm = ir.node("MatMul", [node.inputs[0], weight], name=node.name, outputs=[ir.Value(name=None)])
        mm.metadata_props.update(node.metadata_props)
        mm.metadata_props[ORIGINAL_OP_TYPE] = "Einsum"
        graph.insert_before(node, mm)
        old = node.outputs[0]
        name, old.name = old.name or "", None
        out = mm.outputs[0]
        out.name, out.type, out.shape = name, old.type, old.shape
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        if transposed and not w.uses() and w.name and w.name in graph.initializers and not w.is_graph_output():
            del graph.initializers[w.name]
        done += 1
    return done
