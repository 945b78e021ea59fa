"""A ``MatMul`` whose constant weight is the first operand (``y = W @ x``) rewritten with the weight second (exact).

quantkit (and ONNX Runtime's int8 kernels: ``MatMulIntegerToFloat`` / ``QLinearMatMul`` take per-column scales of
the second operand) quantize a MatMul's weight as its second operand; ``W @ x`` - a token-mixing layer written as
a matrix product, a fixed graph propagation ``A @ X`` with a constant ``A`` - stayed float with the misleading
reason that its weight was not a constant.  For a 2-D constant ``W`` and ``x`` of rank ``r``::

    W @ x  ==  Transpose(Transpose(x, swap last two) @ W^T, swap last two)    (r >= 2)
    W @ x  ==  x @ W^T                                                         (r == 1)

The MatMul keeps its name (recipe overrides by layer name still match); the two ``Transpose`` nodes move 8-bit
codes when the chain around them is int8 (:mod:`quantkit.lowering.qdq`), and the latency guard keeps the float
model where they cost more than the int8 product saves.  An ``x`` of unknown rank, a weight of rank other than 2 or a
non-float weight is left as it is.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

__all__ = ["constant_left_matmul"]


def constant_left_matmul(model: ir.Model) -> int:
    """Rewrite every ``MatMul(constant 2-D W, x)`` of ``model``'s main graph (module doc); returns how many."""
    from quantkit.lowering.nbits import _const, _drop_if_unused, _replace_node
    from quantkit.lowering.qdq import _Namer

    graph = model.graph
    namer = _Namer(graph)
    done = 0
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        w, x = node.inputs
        if w is None or x is None or w.const_value is None or x.const_value is not None or x.shape is None:
            continue
        arr = np.asarray(w.const_value.numpy())
        rank = len(x.shape)
        if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.floating) or rank < 1:
            continue
        base = node.name or w.name or "matmul"
        wt = _const(graph, namer, f"{base}_weight_transposed", np.ascontiguousarray(arr.T))
        nodes: list[ir.Node] = []
        data = x
        perm = [*range(rank - 2), rank - 1, rank - 2] if rank >= 2 else []
        if rank >= 2:
            nodes.append(ir.node("Transpose", [x], attributes={"perm": perm}, name=namer(f"{base}/transpose_in")))
            data = nodes[-1].outputs[0]
        mm = ir.node("MatMul", [data, wt], name=node.name)
        mm.metadata_props.update(node.metadata_props)
        nodes.append(mm)
        if rank >= 2:
            nodes.append(ir.node("Transpose", [mm.outputs[0]], attributes={"perm": perm},
                                 name=namer(f"{base}/transpose_out")))  # fmt: skip
        for n in nodes[:-1]:
            graph.insert_before(node, n)
        _replace_node(graph, node, nodes[-1])
        _drop_if_unused(graph, w)
        done += 1
    return done
