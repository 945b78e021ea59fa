"""Which ONNX operators quantkit lowers to INT8 QDQ, and in which role.

The roles follow what ONNX Runtime's CPU provider fuses (measured; see the README, "What the lowering does"):

* **weighted** ops carry a constant weight that is stored as int8 and read through a
  per-channel ``DequantizeLinear``; their activation input gets ``Q -> DQ``.
  ``Conv`` needs a quantized output to become ``QLinearConv``; ``MatMul``/``Gemm``
  may keep a float output (``MatMulIntegerToFloat`` / ``QGemm`` with float output).
* **glue** ops (``Add``, pooling, ``Concat``, ``Mul``, ``Sigmoid``, ``HardSigmoid``) have QLinear
  kernels of their own; they are only worth quantizing inside an int8 chain (inputs already quantized,
  every consumer quantized) - quantizing a transformer's residual ``Add`` just adds
  error, quantizing a CNN's keeps the whole block in int8.  A constant operand of ``Add`` / ``Mul``
  (``x + 3``, a per-channel scale) is stored as an integer initializer read through a DequantizeLinear,
  so that ONNX Runtime's selector sees a DQ on every input.  ``HardSigmoid(x; a, b)`` has no QLinear
  kernel: it is emitted as ``Add(x, b/a)`` whose QuantizeLinear has the scale ``s/a`` and zero point at
  the grid minimum (the saturation of Q *is* ``clip(., 0, 1/a)``), read by its consumers with the scale
  ``s`` (``a * clip(x + b/a, 0, 1/a) = HardSigmoid(x)``): one ``QLinearAdd``.  HardSwish reaches the
  lowering as ``x * HardSigmoid(x)`` (:mod:`quantkit.prep.hard_swish`), i.e. ``QLinearAdd`` + ``QLinearMul``.
* **rescale** ops (``Mul`` / ``Div`` by a positive scalar constant ``c``) emit no node at all inside an
  int8 chain: ``c * DQ(q; s, z) == DQ(q; c*s, z)``, so their consumers read the producer's codes through a
  DequantizeLinear whose scale is multiplied by ``c`` (``1/c`` for ``Div``).
* **passthrough** ops move data without changing values; ONNX Runtime drops a
  ``DQ -> op -> Q`` around them when both sides share scale and zero point, so their
  output inherits the input's quantization parameters.
* **absorbable** activations (``Relu``, ``Clip``) disappear when the quantized range of
  their output already enforces them; their output range is folded into the producer's
  quantization.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightedOp:
    """Where the weight/bias sit and which weight axis holds the output channels."""

    weight_input: int
    bias_input: int | None
    float_output_ok: bool


WEIGHTED: dict[str, WeightedOp] = {
    "Conv": WeightedOp(weight_input=1, bias_input=2, float_output_ok=False),
    "Gemm": WeightedOp(weight_input=1, bias_input=2, float_output_ok=True),
    "MatMul": WeightedOp(weight_input=1, bias_input=None, float_output_ok=True),
}
GLUE: frozenset[str] = frozenset(
    {"Add", "Mul", "GlobalAveragePool", "AveragePool", "Concat", "Sigmoid", "HardSigmoid"})
PASSTHROUGH: frozenset[str] = frozenset({"Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "MaxPool"})
RESCALE: frozenset[str] = frozenset({"Mul", "Div"})
"""Ops that are a *rescale* when one operand is a positive scalar constant (``Div``: the divisor); any other
``Div`` stays float (ONNX Runtime has no QLinear kernel for it), any other ``Mul`` is glue."""
ABSORBABLE: frozenset[str] = frozenset({"Relu", "Clip"})
QUANTIZABLE_OPS: frozenset[str] = frozenset(WEIGHTED) | GLUE | PASSTHROUGH | RESCALE

# ONNX Runtime kernels a fused QDQ group of each op type turns into (for reports).
FUSED_KERNELS: dict[str, tuple[str, ...]] = {
    "Conv": ("QLinearConv", "ConvInteger"),
    "MatMul": ("QLinearMatMul", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "MatMulInteger"),
    "Gemm": ("QGemm", "QLinearMatMul", "MatMulIntegerToFloat"),
    "Add": ("QLinearAdd",),
    "Mul": ("QLinearMul",),
    "GlobalAveragePool": ("QLinearGlobalAveragePool",),
    "AveragePool": ("QLinearAveragePool",),
    "Concat": ("QLinearConcat",),
    "Sigmoid": ("QLinearSigmoid",),
    "HardSigmoid": ("QLinearAdd",),  # emitted as Add(x, b/a) with a relabelled output scale
}

TORCH_NAME_SCOPES = "pkg.torch.onnx.name_scopes"
"""Node metadata written by ``torch.onnx.export`` (dynamo): the module scopes a node came from."""


def module_path(node: object) -> str | None:
    """The PyTorch module path a node was exported from (``model.encoder.layer.0.intermediate.dense``),
    from the exporter's ``name_scopes`` metadata; None for graphs without it.  Recipe ``pattern``
    overrides match this path as well as the node name, so recipes read like the model card even when
    the exporter named the node ``node_MatMul_119``."""
    import ast

    raw = getattr(node, "metadata_props", {}).get(TORCH_NAME_SCOPES)
    if not raw:
        return None
    try:
        scopes = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return None
    if not isinstance(scopes, list) or len(scopes) < 2:
        return None
    path = str(scopes[-2])  # the last scope is the op itself ("linear", "conv2d")
    return path or None
