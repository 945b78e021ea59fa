"""Fold a zero ``Pad`` into the ``Conv`` that consumes it.

Rule
----
``Conv(Pad(x, pads=p, mode="constant", value=0), W, B, pads=q)`` with ``p`` zero on the
batch and channel axes is the same convolution as ``Conv(x, W, B, pads=q + p_spatial)``:
a convolution's own padding *is* zero padding of its input.  Exporters of TensorFlow-style
"same" padding (EfficientNet-Lite among them) emit such explicit ``Pad`` nodes; left in
place, a ``Pad`` between a ``DequantizeLinear`` and a ``Conv`` stops ONNX Runtime from
fusing the QDQ group into ``QLinearConv``, so the convolution would run in float.

``check`` refuses (with a reason) when the Pad is not constant-mode, the pad value is
not a constant zero, the pads are not constant, batch/channel axes are padded, pads are
negative, the Conv uses ``auto_pad`` other than ``NOTSET``, or the padded tensor has
another consumer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchResult, RewriteRuleClassBase, RewriteRuleSet

__all__ = ["FoldPadIntoConv", "fold_pad_rules"]


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    if value.const_value is not None:
        return np.asarray(value.const_value.numpy())
    return None


class FoldPadIntoConv(RewriteRuleClassBase):
    """``Conv(Pad(x, p, 0))`` -> ``Conv(x, pads = pads + p[spatial])``."""

    def __init__(self) -> None:
        super().__init__(name="FoldPadIntoConv")

    def pattern(self, op: Any, x: ir.Value) -> Any:
        return op.Conv(op.Pad(x, _allow_other_inputs=True, _outputs=["padded"]), _allow_other_inputs=True,
                       _outputs=["conv_out"])

    def check(self, context: Any, x: ir.Value, padded: ir.Value, conv_out: ir.Value) -> MatchResult:
        del context, x
        result = MatchResult()
        pad, conv = padded.producer(), conv_out.producer()
        assert pad is not None and conv is not None  # guaranteed by the pattern
        mode = pad.attributes.get("mode")
        if mode is not None and mode.as_string() != "constant":
            return result.fail(f"Pad {pad.name!r} mode is {mode.as_string()!r}, not 'constant'")
        ins = list(pad.inputs)
        if len(ins) < 2:
            return result.fail(f"Pad {pad.name!r} has no pads input (opset < 11)")
        pads = _const(ins[1])
        if pads is None:
            return result.fail(f"Pad {pad.name!r} pads are not constant")
        if len(ins) > 2 and ins[2] is not None:
            val = _const(ins[2])
            if val is None or np.any(val != 0):
                return result.fail(f"Pad {pad.name!r} pads with a non-zero or non-constant value")
        if len(ins) > 3 and ins[3] is not None:
            return result.fail(f"Pad {pad.name!r} has an 'axes' input")
        rank = pads.size // 2
        if rank < 3 or np.any(pads < 0):
            return result.fail(f"Pad {pad.name!r} pads {pads.tolist()} are negative or not N-C-spatial")
        begin, end = pads[:rank], pads[rank:]
        if begin[0] or begin[1] or end[0] or end[1]:
            return result.fail(f"Pad {pad.name!r} pads the batch or channel axis")
        ap = conv.attributes.get("auto_pad")
        if ap is not None and ap.as_string() not in ("NOTSET", ""):
            return result.fail(f"Conv {conv.name!r} uses auto_pad={ap.as_string()}")
        if padded.is_graph_output() or len(list(padded.uses())) != 1:
            return result.fail(f"the output of Pad {pad.name!r} has other consumers")
        return result

    def rewrite(self, op: Any, x: ir.Value, padded: ir.Value, conv_out: ir.Value) -> Any:
        pad, conv = padded.producer(), conv_out.producer()
        assert pad is not None and conv is not None
        pads = _const(pad.inputs[1])
        assert pads is not None
        rank = pads.size // 2
        spatial = rank - 2
        old = conv.attributes.get("pads")
        q = list(old.as_ints()) if old is not None else [0] * (2 * spatial)
        new = [int(q[i]) + int(pads[2 + i]) for i in range(spatial)] + [
            int(q[spatial + i]) + int(pads[rank + 2 + i]) for i in range(spatial)
        ]
        attrs = {k: v for k, v in conv.attributes.items() if k not in ("pads", "auto_pad")}
        attrs["pads"] = ir.AttrInt64s("pads", new)
        return op.Conv(x, *conv.inputs[1:], _name=conv.name, **{k: v for k, v in attrs.items()})


def fold_pad_rules() -> RewriteRuleSet:
    return RewriteRuleSet([FoldPadIntoConv.rule()])
