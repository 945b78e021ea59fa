"""Write a decomposed GELU as one node: the ``erf`` form as ``Gelu``, the ``tanh`` form as ``FastGelu``.

Rule
----
Below opset 20 ONNX has no ``Gelu`` operator, and exporters write GELU as its definition, exact or tanh-approximated::

    Gelu(x)      ==  x * 0.5 * (1 + Erf(x / sqrt(2)))
    FastGelu(x)  ==  x * 0.5 * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))

in one of a few orders: ``(x * (1 + g)) * 0.5`` (torch's TorchScript exporter), ``(x * 0.5) * (1 + g)``,
``x * ((1 + g) * 0.5)`` (torch's dynamo exporter), with ``x / sqrt(2)`` or ``x * (1 / sqrt(2))`` inside the Erf,
``Pow(x, 3)`` or ``x * (x * x)`` for the cube, and either operand order of every ``Add`` and ``Mul``.  Each becomes one
``com.microsoft.Gelu(x)`` / ``com.microsoft.FastGelu(x)``: the node ONNX Runtime's own ``GeluFusion`` /
``FastGeluFusion`` makes of it in every float model it optimizes, so the FP32 graph ORT runs is the same as before.

Why before quantization: in a quantized model, ``x`` reaches the pattern through a DequantizeLinear, and ONNX
Runtime's QDQ propagation may give each of ``x``'s readers (the ``Div`` and the ``Mul``) its own DequantizeLinear -
after an int8 convolution followed by a ``Reshape`` / ``Transpose``, for instance.  The fusion then sees different
inputs and no longer matches: the pattern runs as five to nine float ops, in places between stray Q/DQ pairs, instead
of one float island.  Fused here, it is one node from the start, whatever ORT's propagation does.

A candidate is left as it is when a constant is not a scalar of the GELU's values (to float32 rounding), ``x`` is
not float32 (the float16 pass runs first), or an intermediate value is read by anything else or is a graph output.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

__all__ = ["fuse_erf_gelu"]

GELU_DOMAIN = "com.microsoft"
SQRT2 = math.sqrt(2.0)
TANH_BETA = math.sqrt(2.0 / math.pi)
TANH_KAPPA = 0.044715
_RTOL = 1e-5  # float32 rounding of the constants (and a few more ulps for exporters that compute them)


def _scalar(v: ir.Value | None) -> float | None:
    """The value of a constant with one element, else None."""
    if v is None or v.const_value is None:
        return None
    arr = np.asarray(v.const_value.numpy())
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


def _is(v: ir.Value | None, value: float) -> bool:
    got = _scalar(v)
    return got is not None and math.isclose(got, value, rel_tol=_RTOL)


def _binary(node: ir.Node | None, op_type: str) -> ir.Node | None:
    """``node`` when it is a default-domain ``op_type`` with two inputs, else None."""
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    return node


def _op(v: ir.Value | None, op_type: str) -> ir.Node | None:
    """The producer of ``v`` when it is a binary ``op_type`` (:func:`_binary`), else None."""
    return _binary(v.producer() if v is not None else None, op_type)


def _split_const(node: ir.Node, value: float) -> ir.Value | None:
    """The other input of a commutative binary ``node`` one of whose inputs is the constant ``value``."""
    a, b = node.inputs
    if _is(b, value):
        return a
    if _is(a, value):
        return b
    return None


def _erf_arg(arg: ir.Value | None) -> tuple[ir.Value, list[ir.Node]] | None:
    """``x`` and the node of ``x / sqrt2`` or ``x * (1/sqrt2)``."""
    div = _op(arg, "Div")
    if div is not None and _is(div.inputs[1], SQRT2) and div.inputs[0] is not None:
        return div.inputs[0], [div]
    mul = _op(arg, "Mul")
    if mul is not None:
        x = _split_const(mul, 1.0 / SQRT2)
        if x is not None:
            return x, [mul]
    return None


def _is_cube_of(v: ir.Value | None, x: ir.Value) -> list[ir.Node] | None:
    """The nodes of ``Pow(x, 3)``, ``x * (x * x)`` or ``(x * x) * x`` when ``v`` is one of them."""
    pow_ = _op(v, "Pow")
    if pow_ is not None:
        return [pow_] if pow_.inputs[0] is x and _is(pow_.inputs[1], 3.0) else None
    outer = _op(v, "Mul")
    if outer is None:
        return None
    for i in (0, 1):
        sq = _op(outer.inputs[1 - i], "Mul")
        if outer.inputs[i] is x and sq is not None and sq.inputs[0] is x and sq.inputs[1] is x:
            return [sq, outer]
    return None


def _tanh_arg(arg: ir.Value | None) -> tuple[ir.Value, list[ir.Node]] | None:
    """``x`` and the nodes of ``sqrt(2/pi) * (x + 0.044715 * cube(x))``."""
    beta = _op(arg, "Mul")
    inner = _split_const(beta, TANH_BETA) if beta is not None else None
    add = _op(inner, "Add")
    if beta is None or add is None:
        return None
    for i in (0, 1):
        x, k = add.inputs[i], add.inputs[1 - i]
        kap = _op(k, "Mul")
        if x is None or kap is None:
            continue
        cube = _split_const(kap, TANH_KAPPA)
        nodes = _is_cube_of(cube, x) if cube is not None else None
        if nodes is not None:
            return x, [*nodes, kap, add, beta]
    return None


def _only_use(v: ir.Value) -> ir.Node | None:
    """The one node reading ``v`` (once), unless ``v`` is a graph output."""
    uses = list(v.uses())
    if len(uses) != 1 or v.is_graph_output():
        return None
    return uses[0].node


def _tail(gate: ir.Value, x: ir.Value) -> list[ir.Node] | None:
    """The two ``Mul`` nodes that make ``x * 0.5 * gate`` in one of the three orders (the last one first)."""
    m = _binary(_only_use(gate), "Mul")
    if m is None:
        return None
    other = m.inputs[1] if m.inputs[0] is gate else m.inputs[0]
    if other is x:  # (x * gate) * 0.5
        last = _binary(_only_use(m.outputs[0]), "Mul")
        return [last, m] if last is not None and _split_const(last, 0.5) is m.outputs[0] else None
    if _is(other, 0.5):  # x * (gate * 0.5)
        last = _binary(_only_use(m.outputs[0]), "Mul")
        return [last, m] if last is not None and x in last.inputs and m.outputs[0] in last.inputs else None
    xh = _op(other, "Mul")  # (x * 0.5) * gate
    if xh is not None and _split_const(xh, 0.5) is x and _only_use(xh.outputs[0]) is m:
        return [m, xh]
    return None


def _match(node: ir.Node) -> tuple[str, ir.Value, list[ir.Node]] | None:
    """``(op, x, nodes)`` when ``node`` (an ``Erf`` or ``Tanh``) is the core of a GELU; ``nodes[0]`` makes its
    output."""
    if node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    if node.op_type == "Erf":
        head, op = _erf_arg(node.inputs[0]), "Gelu"
    elif node.op_type == "Tanh":
        head, op = _tanh_arg(node.inputs[0]), "FastGelu"
    else:
        return None
    if head is None:
        return None
    x, front = head
    if x.dtype is not None and x.dtype != ir.DataType.FLOAT:
        return None
    for n in front:  # every value inside the pattern is read only inside it (x excepted)
        users = {u.node for u in n.outputs[0].uses()}
        if n.outputs[0].is_graph_output() or not users <= {*front, node}:
            return None
    add = _binary(_only_use(node.outputs[0]), "Add")
    if add is None or _split_const(add, 1.0) is not node.outputs[0]:
        return None
    tail = _tail(add.outputs[0], x)
    if tail is None:
        return None
    return op, x, [*tail, add, node, *reversed(front)]


def fuse_erf_gelu(model: ir.Model) -> int:
    """Write every decomposed GELU of ``model``'s main graph as one ``com.microsoft.Gelu`` / ``FastGelu`` (in place);
    returns how many.  The new node takes the last node's name and output (name, type, shape, graph-output slot);
    the model imports the ``com.microsoft`` domain when it gained one."""
    from quantkit.lowering.nbits import _replace_node

    graph = model.graph
    done = 0
    for node in list(graph):
        if node.graph is not graph:  # removed by an earlier match
            continue
        found = _match(node)
        if found is None:
            continue
        op, x, nodes = found
        last = nodes[0]
        fused = ir.node(op, [x], domain=GELU_DOMAIN, name=last.name)
        last.name = None
        _replace_node(graph, last, fused)
        for n in nodes[1:]:
            graph.remove(n, safe=True)
        done += 1
    if done:
        model.opset_imports.setdefault(GELU_DOMAIN, 1)
        graph.opset_imports.setdefault(GELU_DOMAIN, 1)
    return done
