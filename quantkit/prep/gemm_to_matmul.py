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

from quantkit.lowering.select import ORIGINAL_OP_TYPE, constant_array, recipe_op_type
from quantkit.ops import TORCH_NAME_SCOPES

__all__ = ["fold_gemm_scales", "gemm_to_matmul", "untranspose_gemm_inputs"]


def _attr(node: ir.Node, name: str, default: float) -> float:
    a = node.attributes.get(name)
    return default if a is None else float(a.value)


def fold_gemm_scales(model: ir.Model) -> int:
    """``Gemm`` with ``alpha`` / ``beta`` other than 1 and constant ``B`` (and ``C``): ``alpha`` folded into ``B``,
    ``beta`` into ``C`` (new initializers when others read them), both attributes set to 1 - the same product up
    to the float rounding of the scaled constants.  ONNX Runtime fuses a QDQ ``Gemm`` into ``QGemm`` only with
    ``beta`` 1: a scaled one stayed a float Gemm between stray DequantizeLinear nodes.  Returns how many."""
    from quantkit.lowering.nbits import _const
    from quantkit.lowering.qdq import _Namer

    graph = model.graph
    namer = _Namer(graph)
    done = 0
    for node in list(graph):
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx"):
            continue
        alpha, beta = _attr(node, "alpha", 1.0), _attr(node, "beta", 1.0)
        b = node.inputs[1] if len(node.inputs) > 1 else None
        c = node.inputs[2] if len(node.inputs) > 2 else None
        w = constant_array(b)
        carr = constant_array(c) if c is not None else None
        if (alpha == 1.0 and (beta == 1.0 or c is None)) or w is None or (c is not None and carr is None):
            continue
        if alpha != 1.0:
            node.replace_input_with(1, _const(graph, namer, f"{b.name or node.name}_alpha",  # type: ignore[union-attr]
                                              (w * np.float32(alpha)).astype(np.float32)))
        if c is not None and carr is not None and beta != 1.0:
            node.replace_input_with(2, _const(graph, namer, f"{c.name or node.name}_beta",
                                              (carr * np.float32(beta)).astype(np.float32)))
        node.attributes.pop("alpha", None)
        node.attributes.pop("beta", None)
        for v in (b, c):
            if v is not None and not v.uses() and v.name in graph.initializers and not v.is_graph_output():
                del graph.initializers[str(v.name)]
        done += 1
    return done


def untranspose_gemm_inputs(model: ir.Model) -> int:
    """``Gemm(A, B, transA=1)`` with a constant ``B`` and an activation ``A``: ``A`` transposed by a ``Transpose`` node
    before it and ``transA`` cleared - the same product.  ONNX Runtime's ``QGemm`` takes ``transA = 0`` only, so the
    layer stayed float ("Gemm with transA=1"); the Transpose moves 8-bit codes in an int8 chain.  Returns how many."""
    from quantkit.lowering.qdq import _Namer

    graph = model.graph
    namer = _Namer(graph)
    done = 0
    for node in list(graph):
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        ta = node.attributes.get("transA")
        a, b = node.inputs[0], node.inputs[1]
        if ta is None or ta.as_int() != 1 or a is None or constant_array(a) is not None or constant_array(b) is None:
            continue
        t = ir.node("Transpose", [a], attributes={"perm": [1, 0]}, name=namer(f"{node.name or 'gemm'}/transpose_a"))
        graph.insert_before(node, t)
        node.replace_input_with(0, t.outputs[0])
        node.attributes.pop("transA", None)
        done += 1
    return done


def gemm_to_matmul(model: ir.Model, only: set[str] | None = None) -> int:
    """Rewrite every eligible Gemm in ``model`` (in place; only those named in ``only`` when given);
    return how many."""
    from quantkit.lowering.nbits import _const, _drop_if_unused, _replace_node
    from quantkit.lowering.qdq import _Namer

    graph = model.graph
    namer = _Namer(graph)
    done = 0
    for node in list(graph):
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or _attr(node, "transA", 0) != 0:
            continue
        if only is not None and node.name not in only:
            continue
        a, b = node.inputs[0], node.inputs[1]
        c = node.inputs[2] if len(node.inputs) > 2 else None
        w = constant_array(b)
        alpha, beta = _attr(node, "alpha", 1.0), _attr(node, "beta", 1.0)
        carr = constant_array(c) if c is not None and beta != 1.0 else None
        if a is None or w is None or w.ndim != 2 or (c is not None and beta != 1.0 and carr is None):
            continue
        w2 = (w.T if _attr(node, "transB", 0) else w).astype(np.float32)
        if alpha != 1.0:
            w2 = (w2 * np.float32(alpha)).astype(np.float32)
        name = node.name or "gemm"
        wv = _const(
            graph,
            namer,
            f"{b.name or name}_kn" if b is not None else f"{name}_weight_kn",
            np.ascontiguousarray(w2),
        )
        mm = ir.node("MatMul", [a, wv], name=name, outputs=[ir.Value(name=namer(f"{name}/matmul_out"))])
        mm.metadata_props[ORIGINAL_OP_TYPE] = recipe_op_type(node)  # overrides by op_type still match
        if TORCH_NAME_SCOPES in node.metadata_props:  # ... and by module path
            mm.metadata_props[TORCH_NAME_SCOPES] = node.metadata_props[TORCH_NAME_SCOPES]
        last = mm
        if c is not None:
            cv = (
                c
                if carr is None
                else _const(graph, namer, f"{c.name}_scaled", (carr * np.float32(beta)).astype(np.float32))
            )
            graph.insert_before(node, mm)
            last = ir.node("Add", [mm.outputs[0], cv], name=f"{name}/bias", outputs=[ir.Value(name=None)])
        _replace_node(graph, node, last)  # last takes the Gemm's output (name, uses, graph-output slot)
        _drop_if_unused(graph, b)
        done += 1
    return done
