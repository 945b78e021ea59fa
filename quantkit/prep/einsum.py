"""Rewrite a linear layer written as ``Einsum`` with a constant weight as ``MatMul`` (exact).

JAX / TensorFlow conversions and hand-written PyTorch write dense layers as ``einsum("btd,dk->btk", x, W)``.
ONNX Runtime has no int8 ``Einsum`` kernel, so such a layer stayed float ("not in an int8 chain").  An
``Einsum`` that contracts the last axis of ``x`` with one axis of a constant 2-D ``W`` and appends ``W``'s other
axis is ``MatMul(x, W)`` (``W`` transposed once when it is written ``kd``)::

    Einsum("...d,dk->...k", x, W)  ==  MatMul(x, W)
    Einsum("btd,kd->btk", x, W)    ==  MatMul(x, W^T)

Keras' ``EinsumDense`` writes multi-head projections with 3-D weights: the contracted axes of ``W`` are then
flattened into one (``x`` reshaped to match) and its kept axes into one (the output reshaped back)::

    Einsum("abc,cde->abde", x, W)  ==  Reshape(MatMul(x, W.reshape(c, d * e)), [0, 0, d, e])
    Einsum("abcd,cde->abe", x, W)  ==  MatMul(Reshape(x, [0, 0, c * d]), W.reshape(c * d, e))

Anything else (contractions between two activations - attention scores -, a weight axis shared with ``x``'s
batch axes, repeated letters, broadcast ellipses in other places) is left as it is.  The node keeps its name and output,
and recipe overrides by ``op_type: Einsum`` keep matching (the original op type is kept in its metadata).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from quantkit.lowering.select import ORIGINAL_OP_TYPE

__all__ = ["einsum_layer", "einsum_to_matmul", "linear_einsum"]


def linear_einsum(equation: str) -> bool | None:
    """For an equation ``x, W -> y`` of a linear layer with a 2-D ``W`` (:func:`einsum_layer` with one contracted
    and one kept axis): whether ``W`` is written ``kd`` (needs a transpose); None for any other equation."""
    layer = einsum_layer(equation)
    if layer is None or layer[1:] != (1, 1):
        return None
    return layer[0] != [0, 1]


def einsum_layer(equation: str) -> tuple[list[int], int, int] | None:
    """For ``x, W -> y`` contracting trailing axes of ``x`` with axes of a constant ``W`` and appending ``W``'s
    other axes (Keras' ``EinsumDense``: ``abc,cde->abde`` to heads, ``abcd,cde->abe`` back): ``(perm, k, r)`` -
    ``W.transpose(perm)`` is ``[contracted (in x's order) ..., kept (in y's order) ...]`` with ``k`` contracted and
    ``r`` kept axes; None when the equation is not such a layer."""
    eq = equation.replace(" ", "")
    if eq.count("->") != 1:
        return None
    lhs, out = eq.split("->")
    parts = lhs.split(",")
    if len(parts) != 2:
        return None
    a, b = parts
    if a.startswith("..."):
        if not out.startswith("..."):
            return None
        a, out = a[3:], out[3:]
    if any("." in t for t in (a, b, out)) or not a or not b or len(set(a)) != len(a) or len(set(b)) != len(b):
        return None
    contracted = [c for c in a if c in b and c not in out]
    kept_w = [c for c in out if c in b]
    k, r = len(contracted), len(kept_w)
    if not k or not r or a[len(a) - k:] != "".join(contracted) or set(b) != set(contracted) | set(kept_w):
        return None
    prefix = a[: len(a) - k]
    if any(c in b for c in prefix) or out != prefix + "".join(kept_w):
        return None
    perm = [b.index(c) for c in contracted] + [b.index(c) for c in kept_w]
    return perm, k, r


def einsum_to_matmul(model: ir.Model) -> int:
    """Rewrite every linear ``Einsum`` with a constant float weight (module doc); returns how many."""
    from quantkit.lowering.nbits import _const, _drop_if_unused, _replace_node
    from quantkit.lowering.qdq import _Namer

    graph = model.graph
    namer = _Namer(graph)
    done = 0
    for node in list(graph):
        if node.op_type != "Einsum" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        eq = node.attributes.get("equation")
        w, x = node.inputs[1], node.inputs[0]
        if eq is None or w is None or w.const_value is None or x is None:
            continue
        layer = einsum_layer(eq.as_string())
        arr = np.asarray(w.const_value.numpy())
        if layer is None or not np.issubdtype(arr.dtype, np.floating) or arr.ndim != sum(layer[1:]):
            continue
        perm, k, r = layer
        rank = len(x.shape) if x.shape is not None else 0
        if (k > 1 or r > 1) and x.shape is None:
            continue  # the Reshapes need the input's rank
        w2 = np.ascontiguousarray(arr.transpose(perm))
        kept_dims = [int(d) for d in w2.shape[k:]]
        w2 = w2.reshape(int(np.prod(w2.shape[:k])), int(np.prod(kept_dims)))
        base = node.name or w.name or "einsum"
        weight = w if perm == [0, 1] else _const(graph, namer, f"{base}_weight", w2)
        nodes: list[ir.Node] = []
        data = x
        if k > 1:  # x [..., c, d] -> [..., c * d]
            shape = _const(graph, namer, f"{base}_in_shape", np.array([0] * (rank - k) + [-1], np.int64))
            nodes.append(ir.node("Reshape", [x, shape], name=f"{base}/reshape_in"))
            data = nodes[-1].outputs[0]
        mm = ir.node("MatMul", [data, weight], name=node.name)
        mm.metadata_props.update(node.metadata_props)
        mm.metadata_props[ORIGINAL_OP_TYPE] = "Einsum"
        nodes.append(mm)
        if r > 1:  # [..., d * e] -> [..., d, e]
            shape = _const(graph, namer, f"{base}_out_shape", np.array([0] * (rank - k) + kept_dims, np.int64))
            nodes.append(ir.node("Reshape", [mm.outputs[0], shape], name=f"{base}/reshape_out"))
        for n in nodes[:-1]:
            graph.insert_before(node, n)
        _replace_node(graph, node, nodes[-1])
        if weight is not w:
            _drop_if_unused(graph, w)
        done += 1
    return done
