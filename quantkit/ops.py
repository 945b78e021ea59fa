"""Which ONNX operators quantkit lowers to INT8 QDQ, and in which role.

The roles follow what ONNX Runtime's CPU provider fuses (measured; see the README, "What the lowering does"):

* **weighted** ops carry a constant weight that is stored as int8 and read through a
  per-channel ``DequantizeLinear``; their activation input gets ``Q -> DQ``.
  ``Conv`` needs a quantized output to become ``QLinearConv``; ``MatMul``/``Gemm``
  may keep a float output (``MatMulIntegerToFloat`` / ``QGemm`` with float output).
* **glue** ops (``Add``, pooling, ``Concat``, ``Mul``, ``Sigmoid``, ``HardSigmoid``) have QLinear
  kernels of their own; they are only worth quantizing inside an int8 chain (inputs already quantized,
  at least one consumer quantized) - quantizing a transformer's residual ``Add`` just adds
  error, quantizing a CNN's keeps the whole block in int8.  A constant operand of ``Add`` / ``Mul``
  (``x + 3``, a per-channel scale) is stored as an integer initializer read through a DequantizeLinear,
  so that ONNX Runtime's selector sees a DQ on every input.  ``HardSigmoid(x; a, b)`` has no QLinear
  kernel: it is emitted as ``Add(x, b/a)`` whose QuantizeLinear has the scale ``s/a`` and zero point at
  the grid minimum (the saturation of Q *is* ``clip(., 0, 1/a)``), read by its consumers with the scale
  ``s`` (``a * clip(x + b/a, 0, 1/a) = HardSigmoid(x)``): one ``QLinearAdd``.  HardSwish reaches the
  lowering as ``x * HardSigmoid(x)`` (:mod:`quantkit.prep.hard_swish`), i.e. ``QLinearAdd`` + ``QLinearMul``.
  A pre-activation ``BatchNormalization`` reaches it as an exact per-channel shift ``x + B``
  (:mod:`quantkit.prep.preact_batchnorm`) and is emitted as ``Add(x, B)``: one ``QLinearAdd``.
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
from typing import Any


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
    {"Add", "Mul", "GlobalAveragePool", "AveragePool", "Concat", "Sigmoid", "HardSigmoid", "BatchNormalization"})
"""``BatchNormalization`` is glue only in the exact ``x + B`` form (scale 1, mean 0, variance + epsilon 1) that
:mod:`quantkit.prep.preact_batchnorm` writes for a pre-activation BatchNorm: lowered as ``Add(x, B)``
(``QLinearAdd``); any other BatchNorm that no layer absorbed has no int8 kernel and stays float."""
PASSTHROUGH: frozenset[str] = frozenset({"Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "MaxPool", "Split",
                                        "Slice", "Expand", "Tile", "DepthToSpace", "Gather", "Resize"})
"""Measured on ONNX Runtime 1.32's CPU provider (``DQ -> op -> Q`` with one scale and zero point on both sides:
the op then runs on the codes, bit-exact): all of these; ``Split`` into several outputs too.  ``Resize`` only in
``nearest`` mode (a ``linear`` / ``cubic`` Resize keeps its DQ and Q: no int8 kernel, it stays a float island),
``Gather`` only with constant indices (a channel or token picked out of an activation), ``SpaceToDepth`` and
``Pad`` are not dropped (a ``Pad`` before a ``Conv`` is folded into the Conv's pads by :mod:`quantkit.prep`)."""
RESCALE: frozenset[str] = frozenset({"Mul", "Div"})
"""Ops that are a *rescale* when one operand is a positive scalar constant (``Div``: the divisor); any other
``Div`` stays float (ONNX Runtime has no QLinear kernel for it), any other ``Mul`` is glue."""
ABSORBABLE: frozenset[str] = frozenset({"Relu", "Clip"})
QUANTIZABLE_OPS: frozenset[str] = frozenset(WEIGHTED) | GLUE | PASSTHROUGH | RESCALE

LAYER_OPS: dict[str, tuple[str, ...]] = {"int4": ("MatMul", "Gemm"), "int8_weight": ("MatMul", "Gemm"),
                                         "int8_dynamic": ("MatMul", "Gemm"), "fp16": ("MatMul", "Gemm", "Conv"),
                                         "bf16": ("MatMul", "Gemm", "Conv")}
"""The op types (with a constant weight) each linear-only format (``quantkit.formats.LINEAR_ONLY_FORMATS``) is
lowered on; any other node a recipe gives one of these formats stays as it was (the report says so)."""

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
    "BatchNormalization": ("QLinearAdd",),  # only the exact x + B form, emitted as Add(x, B)
}

ORT_INT8_OPS: frozenset[str] = frozenset({
    # fused into a QLinear / integer kernel (QDQSelectorActionTransformer: Conv, MatMul, Gemm, unary, binary,
    # variadic and Where rules)
    "Conv", "MatMul", "Gemm", "Add", "Mul", "Concat", "AveragePool", "GlobalAveragePool", "LeakyRelu", "Sigmoid",
    "Softmax", "Where",
    # run on the integer data with the Q/DQ pair dropped (its drop / split rules)
    "MaxPool", "Resize", "Split", "ReduceMax", "ReduceMin", "ArgMax", "Expand", "Flatten", "Gather",
    "GatherElements", "Reshape", "Slice", "Squeeze", "Tile", "Transpose", "Unsqueeze",
    # removed when the quantized range already enforces them (ReluQuantFusion / ClipQuantFusion)
    "Relu", "Clip",
})
"""Operators ONNX Runtime's CPU provider (1.32) runs on int8 data when they sit between DequantizeLinear and
QuantizeLinear.  Any other operator between a DQ and a Q - ``LayerNormalization``, ``Gelu``, ``Erf``, an unfolded
``BatchNormalization``, ``Div`` by a tensor, ``Pow``, ``ReduceMean`` over channels - has no int8 kernel: it runs in
float, and the DQ before it and the Q after it are the boundary of a *float island*, not a stray round trip."""

DELIBERATELY_FLOAT: dict[str, str] = {
    "Softmax": "QLinearSoftmax exists but runs ~9x slower than the float Softmax (docs/int8-lowering.md)",
}
"""Operators that have an int8 form in ONNX Runtime which quantkit does not use, and why."""

GEMM_LIKE_FLOAT_KERNELS: frozenset[str] = frozenset({
    "Conv", "MatMul", "Gemm", "FusedConv", "FusedGemm", "FusedMatMul", "NhwcFusedConv", "ReorderInput",
    "ReorderOutput"})
"""Float GEMM-like kernels (and the NCHWc reorders around a float Conv) of ONNX Runtime's optimized graph: a DQ
into one of them enters a layer the plan keeps in float (reported with its reason in the report's float layers)."""


def float_island_reason(op_type: str) -> str | None:
    """Why a float ``op_type`` between a DequantizeLinear and a QuantizeLinear is a deliberate float island (no
    int8 kernel in ONNX Runtime, an int8 kernel quantkit does not use, or a layer kept in float), else None: an
    op with an int8 kernel left in float there is a stray round trip.  ``op_type`` may carry a domain prefix
    (``com.microsoft.Gelu``) as the census writes it."""
    op = op_type.split(".")[-1]
    if op.startswith("Resize(") and op != "Resize(nearest)":
        return (f"{op}: ONNX Runtime runs only a nearest Resize on int8 codes; a {op[7:-1]} Resize has no int8 "
                "kernel")
    if op in DELIBERATELY_FLOAT:
        return DELIBERATELY_FLOAT[op]
    if op in GEMM_LIKE_FLOAT_KERNELS:
        return f"float {op}: a layer the plan keeps in float (see the report's float layers)"
    if op in ORT_INT8_OPS or op in ("QuantizeLinear", "DequantizeLinear"):
        return None
    return f"{op} has no int8 kernel in ONNX Runtime's CPU provider"


def batchnorm_shift(bn: Any) -> Any:
    """``B`` (a float32 vector) when ``bn`` (an ``onnx_ir`` node) is an inference-mode ``BatchNormalization`` that
    is exactly ``x + B`` per channel - scale 1, mean 0, ``float32(var + epsilon) == 1``, constant initializers:
    the form :mod:`quantkit.prep.preact_batchnorm` writes - else None.  Such a BatchNorm is int8 glue, emitted as
    ``Add(x, B)``."""
    import numpy as np

    if bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx") or len(bn.inputs) != 5:
        return None
    training = bn.attributes.get("training_mode")
    if (training is not None and training.as_int() != 0) or any(
            o.uses() or o.is_graph_output() for o in bn.outputs[1:]):
        return None
    params = []
    for v in bn.inputs[1:]:
        if v is None or v.is_graph_input() or v.const_value is None:
            return None
        a = np.asarray(v.const_value.numpy())
        if a.dtype != np.float32 or a.ndim != 1:
            return None
        params.append(a)
    scale, b, mean, var = params
    eps_attr = bn.attributes.get("epsilon")
    eps = np.float32(eps_attr.as_float() if eps_attr is not None else 1e-5)  # ONNX's default epsilon
    if not (scale.shape == b.shape == mean.shape == var.shape and np.all(scale == 1.0) and np.all(mean == 0.0)
            and np.all(var + eps == np.float32(1.0))):
        return None
    return b


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
