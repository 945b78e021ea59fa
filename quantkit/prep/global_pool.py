"""Rewrite a spatial ``ReduceMean`` as ``GlobalAveragePool``.

Rule
----
For ``x`` of rank ``r >= 3`` laid out ``[N, C, *spatial]``::

    ReduceMean(x, axes = [2, ..., r-1], keepdims = 1)  ==  GlobalAveragePool(x)
    ReduceMean(x, axes = [2, ..., r-1], keepdims = 0)  ==  Flatten(GlobalAveragePool(x), axis = 1)

(the mean over all spatial positions of each channel; ``Flatten`` drops the trailing 1s).  PyTorch
exports ``x.mean((2, 3))`` as the ``ReduceMean`` form; ONNX Runtime fuses a QDQ ``GlobalAveragePool``
into ``QLinearGlobalAveragePool`` but leaves a QDQ ``ReduceMean`` in float between a stray
DequantizeLinear and QuantizeLinear, so the rewrite is what keeps such a CNN's int8 chain unbroken.

``check`` refuses (with a reason) when the rank of ``x`` is unknown or below 3, the axes are not
constant, or they are not exactly the spatial axes (negative axes are normalised first).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

__all__ = ["SpatialReduceMeanToGlobalAveragePool", "global_pool_rules"]


def _axes(node: ir.Node) -> list[int] | None:
    """The ``axes`` of a ReduceMean: attribute (opset < 18) or constant second input (opset >= 18)."""
    attr = node.attributes.get("axes")
    if attr is not None:
        return [int(a) for a in attr.as_ints()]
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        cv = node.inputs[1].const_value
        return None if cv is None else [int(a) for a in np.asarray(cv.numpy()).reshape(-1)]
    return None


class SpatialReduceMeanToGlobalAveragePool(RewriteRuleClassBase):
    """``ReduceMean(x, spatial axes)`` -> ``GlobalAveragePool(x)`` (``Flatten``-ed when ``keepdims=0``)."""

    def __init__(self) -> None:
        super().__init__(name="SpatialReduceMeanToGlobalAveragePool")

    def pattern(self, op: Any, x: ir.Value) -> Any:
        return op.ReduceMean(x, _allow_other_inputs=True, _outputs=["mean"])

    def check(self, context: Any, x: ir.Value, mean: ir.Value) -> MatchResult:
        del context
        result = MatchResult()
        node = mean.producer()
        assert node is not None  # guaranteed by the pattern
        rank = len(x.shape) if x.shape is not None else None
        if rank is None or rank < 3:
            return result.fail(f"ReduceMean {node.name!r}: input rank {rank} is unknown or below 3")
        axes = _axes(node)
        if axes is None:
            return result.fail(f"ReduceMean {node.name!r}: axes are missing or not constant")
        if sorted(a % rank for a in axes) != list(range(2, rank)):
            return result.fail(f"ReduceMean {node.name!r}: axes {axes} are not the spatial axes of a rank-{rank} input")
        nse = node.attributes.get("noop_with_empty_axes")
        if nse is not None and nse.as_int() != 0:
            return result.fail(f"ReduceMean {node.name!r}: noop_with_empty_axes is set")
        return result

    def rewrite(self, op: Any, x: ir.Value, mean: ir.Value) -> Any:
        node = mean.producer()
        assert node is not None
        kd = node.attributes.get("keepdims")
        pooled = op.GlobalAveragePool(x, _name=node.name)
        if kd is None or kd.as_int() == 1:
            return pooled
        return op.Flatten(pooled, axis=1, _name=f"{node.name}/flatten")


def global_pool_rules() -> RewriteRuleSet:
    return RewriteRuleSet([SpatialReduceMeanToGlobalAveragePool.rule()])
