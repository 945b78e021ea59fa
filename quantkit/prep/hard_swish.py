"""Write ``HardSwish`` as ``x * HardSigmoid(x)``.

Rule
----
ONNX defines (opset 14)::

    HardSwish(x)  ==  x * max(0, min(1, x/6 + 1/2))  ==  Mul(x, HardSigmoid(x, alpha = 1/6, beta = 1/2))

so the rewrite is the operator's own definition (ONNX Runtime's CPU provider expands ``HardSwish`` into
exactly these two nodes: the FP32 graph it runs is the same, bit for bit, measured on MobileNetV3-Small and
a squeeze-excite CNN with ORT 1.32).  ONNX Runtime has no QDQ fusion for ``HardSwish``: left whole it runs
in float between a DequantizeLinear and a QuantizeLinear (an island that also breaks the NHWC int8 chain
with two Transposes).  Written as ``Mul(x, HardSigmoid(x))`` both nodes are int8 glue
(:mod:`quantkit.ops`): the ``HardSigmoid`` lowers to one ``QLinearAdd`` (``Add(x, 3)`` whose quantized
range ``[0, 6]`` is the clip, read back with the scale divided by 6), the ``Mul`` to ``QLinearMul``.

Why not ``Add -> Clip -> Mul(1/6)`` here: in the float model those three nodes stop ONNX Runtime from
fusing the activation into the preceding NCHWc ``Conv`` (FP32 MobileNetV3-Small 1.2x slower, the SE CNN
1.7x), and the prepared model is also the FP32 reference of every report.  ``HardSigmoid`` stays one node in
float and becomes the ``Add`` form only where it is quantized (:func:`quantkit.lowering.qdq.lower_int8`).

``check`` refuses (with a reason) a ``HardSwish`` outside the default domain.
"""

from __future__ import annotations

from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

__all__ = ["HardSwishAsMulHardSigmoid", "hard_swish_rules"]

ALPHA = 1.0 / 6.0
BETA = 0.5


class HardSwishAsMulHardSigmoid(RewriteRuleClassBase):
    """``HardSwish(x)`` -> ``Mul(x, HardSigmoid(x, alpha=1/6, beta=1/2))`` (the node name is kept on the Mul)."""

    def __init__(self) -> None:
        super().__init__(name="HardSwishAsMulHardSigmoid")

    def pattern(self, op: Any, x: ir.Value) -> Any:
        return op.HardSwish(x, _outputs=["y"])

    def check(self, context: Any, x: ir.Value, y: ir.Value) -> MatchResult:
        del context, x
        result = MatchResult()
        node = y.producer()
        assert node is not None  # guaranteed by the pattern
        if node.domain not in ("", "ai.onnx"):
            return result.fail(f"HardSwish {node.name!r} is of domain {node.domain!r}")
        return result

    def rewrite(self, op: Any, x: ir.Value, y: ir.Value) -> Any:
        node = y.producer()
        assert node is not None
        gate = op.HardSigmoid(x, alpha=ALPHA, beta=BETA, _name=f"{node.name}/hardsigmoid")
        return op.Mul(x, gate, _name=node.name)


def hard_swish_rules() -> RewriteRuleSet:
    return RewriteRuleSet([HardSwishAsMulHardSigmoid.rule()])
