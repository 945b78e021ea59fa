"""Write the ``erf`` form of GELU as one ``Gelu`` node.

Rule
----
Below opset 20 ONNX has no ``Gelu`` operator, and exporters write the exact GELU as its definition::

    Gelu(x)  ==  x * 0.5 * (1 + Erf(x / sqrt(2)))

in one of a few orders: ``(x * (1 + erf)) * 0.5`` (torch), ``(x * 0.5) * (1 + erf)``, ``x * ((1 + erf) * 0.5)``,
with ``x / sqrt(2)`` or ``x * (1 / sqrt(2))`` inside, and either operand order of every ``Add`` and ``Mul``.  All of
them become one ``com.microsoft.Gelu(x)``: the node ONNX Runtime's own ``GeluFusion`` makes of them in every float
model it optimizes, so the FP32 graph ORT runs is the same one as before.

Why before quantization: in a quantized model, ``x`` reaches the pattern through a DequantizeLinear, and ONNX
Runtime's QDQ propagation may give each of ``x``'s two readers (the ``Div`` and the ``Mul``) its own
DequantizeLinear - after an int8 convolution followed by a ``Reshape`` / ``Transpose``, for instance.  The fusion
then sees two different inputs and no longer matches: the pattern runs as five float ops between stray Q/DQ pairs
instead of one float ``Gelu`` island.  Fused here, it is one node from the start, whatever ORT's propagation does.

``check`` refuses (with a reason) constants that are not scalars of the GELU's values (``0.5``, ``1``,
``sqrt(2)`` / ``1/sqrt(2)``, to float32 rounding) and an ``x`` whose element type is not float32 (the float16 pass
runs first).  An intermediate value read elsewhere keeps the pattern as it is (the rewriter replaces only what the
pattern alone reads).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

__all__ = ["ErfGelu", "erf_gelu_rules", "fuse_erf_gelu"]

GELU_DOMAIN = "com.microsoft"
_VALUES = {"half": 0.5, "one": 1.0, "sqrt2": math.sqrt(2.0), "inv_sqrt2": 1.0 / math.sqrt(2.0)}
_RTOL = 1e-5  # float32 rounding of the constants (and a few more ulps for exporters that compute them)


def _scalar(v: ir.Value | None) -> float | None:
    """The value of a constant with one element, else None."""
    if v is None or v.const_value is None:
        return None
    arr = np.asarray(v.const_value.numpy())
    return float(arr.reshape(-1)[0]) if arr.size == 1 else None


class ErfGelu(RewriteRuleClassBase):
    """One order of ``x * 0.5 * (1 + Erf(x / sqrt(2)))`` -> ``com.microsoft.Gelu(x)``.

    ``order``: ``"outer_half"`` ``(x * (1 + e)) * 0.5``, ``"x_half"`` ``(x * 0.5) * (1 + e)``, ``"inner_half"``
    ``x * ((1 + e) * 0.5)``; ``scale``: ``"Div"`` (``x / sqrt2``) or ``"Mul"`` (``x * 1/sqrt2``)."""

    def __init__(self, order: str, scale: str) -> None:
        super().__init__(name=f"ErfGelu_{order}_{scale}")
        self.order, self.scale = order, scale

    def pattern(self, op: Any, x: ir.Value, s: ir.Value, one: ir.Value, half: ir.Value) -> Any:
        inner = op.Div(x, s) if self.scale == "Div" else op.Mul(x, s)
        gate = op.Add(op.Erf(inner), one)
        if self.order == "outer_half":
            return op.Mul(op.Mul(x, gate), half, _outputs=["y"])
        if self.order == "x_half":
            return op.Mul(op.Mul(x, half), gate, _outputs=["y"])
        return op.Mul(x, op.Mul(gate, half), _outputs=["y"])

    def check(self, context: Any, x: ir.Value, s: ir.Value, one: ir.Value, half: ir.Value, y: ir.Value
              ) -> MatchResult:
        del context
        result = MatchResult()
        if x.dtype is not None and x.dtype != ir.DataType.FLOAT:
            return result.fail(f"GELU input {x.name!r} is {x.dtype}, not float32")
        want = {"s": _VALUES["sqrt2" if self.scale == "Div" else "inv_sqrt2"], "one": 1.0, "half": 0.5}
        for key, value in (("s", s), ("one", one), ("half", half)):
            got = _scalar(value)
            if got is None or not math.isclose(got, want[key], rel_tol=_RTOL):
                return result.fail(f"GELU constant {key} of {y.name!r} is {got}, not {want[key]:.7g}")
        return result

    def rewrite(self, op: Any, x: ir.Value, s: ir.Value, one: ir.Value, half: ir.Value, y: ir.Value) -> Any:
        del s, one, half
        node = y.producer()
        name = node.name if node is not None else None
        return op.Gelu(x, _domain=GELU_DOMAIN, _name=name)


def erf_gelu_rules() -> RewriteRuleSet:
    rules = [ErfGelu.rule(order, scale) for order in ("outer_half", "x_half", "inner_half") for scale in ("Div", "Mul")]
    return RewriteRuleSet(rules, commute=True)


def fuse_erf_gelu(model: ir.Model) -> int:
    """Apply :func:`erf_gelu_rules` to ``model`` (in place); returns how many GELUs were fused.  Each new ``Gelu``
    output takes its input's type and shape (ONNX shape inference does not know the contrib op), and the model
    imports the ``com.microsoft`` domain when it gained one."""
    count = int(erf_gelu_rules().apply_to_model(model))
    if count:
        model.opset_imports.setdefault(GELU_DOMAIN, 1)
        model.graph.opset_imports.setdefault(GELU_DOMAIN, 1)
        for node in model.graph.all_nodes():
            if node.op_type == "Gelu" and node.domain == GELU_DOMAIN:
                src, out = node.inputs[0], node.outputs[0]
                if src is not None and out.type is None and src.type is not None:
                    out.type = src.type
                if src is not None and out.shape is None and src.shape is not None:
                    out.shape = src.shape
    return count
