"""Rewrite ``Gemm(A, B[, C])`` with a constant ``B`` as ``MatMul(A, W)`` (+ ``Add(C)``).

Rule: ``Gemm`` computes ``Y = alpha * A' @ B' + beta * C`` with ``A' = A^T`` if ``transA`` else ``A``
and ``B' = B^T`` if ``transB`` else ``B``.  When ``transA = 0`` and ``B`` is a constant 2-D
initializer, this equals::

    Y = MatMul(A, W) [+ Add(beta * C)]      with  W = alpha * B'   (a [K, N] constant)

exactly up to float rounding of ``alpha * B'`` (alpha = 1 in every exporter seen: exact).  A
``torch.nn.Linear`` on 2-D input exports as ``Gemm(transB=1)``; the linear-layer search
(:class:`quantkit.search.linear.LinearSpace`) and the weight-only lowerings work on
``MatMul(x, W[K, N])``, so they run this pass on their own copy of the model first.  The
MatMul keeps the Gemm's node name (reports, overrides and profiles keep referring to it);
the Add is named ``<name>/bias``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from quantkit.lowering.select import constant_array

__all__ = ["gemm_to_matmul"]


def _attr(node: ir.Node, name: str, default: float) -> float:
    a = node.attributes.get(name)
    return default if a is None else float(a.value)


def gemm_to_matmul(model: ir.Model) -> int:
    """Rewrite every eligible Gemm in ``model`` (in place); return how many."""
    graph = model.graph
    done = 0
    for node in list(graph):
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or _attr(node, "transA", 0) != 0:
            continue
        a, b = node.inputs[0], node.inputs[1]
        w = constant_array(b)
        if a is None or w is None or w.ndim != 2:
            continue
        alpha, beta = _attr(node, "alpha", 1.0), _attr(node, "beta", 1.0)
        w2 = (w.T if _attr(node, "transB", 0) else w).astype(np.float32)
        if alpha != 1.0:
            w2 = (w2 * np.float32(alpha)).astype(np.float32)
        name = node.name or "gemm"
        wv = ir.Value(
            name=f"{b.name or name}_kn" if b is not None else f"{name}_weight_kn",
            const_value=ir.tensor(np.ascontiguousarray(w2)),
        )
        wv.const_value.name = wv.name  # type: ignore[union-attr]
        graph.register_initializer(wv)
        y = node.outputs[0]
        c = node.inputs[2] if len(node.inputs) > 2 else None
        mm_out = ir.Value(name=f"{name}/matmul_out") if c is not None else ir.Value(name=None)
        mm = ir.node("MatMul", [a, wv], name=name, outputs=[mm_out])
        graph.insert_before(node, mm)
        last = mm
        if c is not None:
            cv = c
            if beta != 1.0:
                carr = constant_array(c)
                if carr is None:
                    graph.remove(mm, safe=True)
                    continue
                cv = ir.Value(
                    name=f"{c.name}_scaled",
                    const_value=ir.tensor((carr * np.float32(beta)).astype(np.float32)),
                )
                cv.const_value.name = cv.name  # type: ignore[union-attr]
                graph.register_initializer(cv)
            add = ir.node("Add", [mm_out, cv], name=f"{name}/bias", outputs=[ir.Value(name=None)])
            graph.insert_after(mm, add)
            last = add
        out = last.outputs[0]
        out.type, out.shape = y.type, y.shape
        y.replace_all_uses_with(out, replace_graph_outputs=True)
        yname = y.name
        y.name = None
        out.name = yname
        graph.remove(node, safe=True)
        if (
            b is not None
            and b.name
            and not list(b.uses())
            and b.name in graph.initializers
            and not b.is_graph_output()
        ):
            del graph.initializers[b.name]
        done += 1
    return done
