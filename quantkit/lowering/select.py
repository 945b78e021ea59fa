"""Decide which nodes run in INT8 and where Q/DQ pairs go (no graph edits here).

Input: a prepared ``onnx_ir`` model and a recipe.  Output: a :class:`QuantPlan` that
lists the quantized layers (with their resolved :class:`~quantkit.recipe.LayerPlan`) and
every activation tensor that gets a ``QuantizeLinear``, with the tensor whose
statistics set its range.  The same plan drives calibration (which tensors to observe)
and lowering (where to insert Q/DQ), so what is calibrated is what ships.

Rules (see :mod:`quantkit.ops` for the op roles):

1. A *weighted* node is quantized when the recipe resolves it to ``int8`` and its weight
   is a constant of the expected rank.
2. *Glue* and *passthrough* nodes are quantized only inside an int8 chain: every
   activation input is produced by a quantized node (directly or through a foldable
   ``Relu``/``Clip``) and at least one consumer of its output is quantized (its output needs a
   QuantizeLinear anyway; a float consumer beside it reads a DequantizeLinear, a chain exit - e.g. a
   ConvNeXt residual ``Add`` read by the next int8 depthwise Conv and by a float ``LayerNormalization``:
   ``QLinearAdd`` + one DQ instead of two DQs, a float ``Add`` and a Q).  This is found as a
   greatest fixed point (start with all candidates, drop violators until stable).  A pool
   (``GlobalAveragePool`` / ``AveragePool``) may *end* a chain: its output, smaller than its
   input, is what gets dequantized for a float consumer (e.g. a classifier in another format).
3. The output of a quantized node is quantized when its kernel needs it (Conv, glue,
   passthrough) or when a quantized node consumes it.  MatMul/Gemm outputs that only
   feed float ops stay float (``MatMulIntegerToFloat``) - no pointless requantization.
   A tensor's dtype, symmetry and calibrator come from the quantized layer that produces it,
   else from its first quantized consumer (graph order).
4. A quantized output whose only consumer is ``Relu``/``Clip(lo, hi)`` is not quantized
   itself; the activation's output is, on a range clipped to ``[lo, hi]`` with the zero
   point at the grid minimum when ``lo == 0`` (so Q's saturation *is* the activation and
   ONNX Runtime removes it: exact).  A ``HardSigmoid`` output is always quantized on a range
   clipped to ``[0, 1]`` (zero point at the grid minimum): the lowering emits it as an ``Add`` whose
   Q saturation is the clip (:mod:`quantkit.ops`), and never folds a following activation.  A
   ``HardSigmoid(a, b)`` that is the only consumer of a quantized Conv / Gemm (a squeeze-excite gate) is
   folded into it like a Relu (:attr:`QuantPlan.folded_gates`): the lowering adds ``b/a`` to the layer's
   bias and writes the gate's codes with the layer's own QuantizeLinear (scale ``s/a``) - no node at all.
5. A ``BatchNormalization`` is glue only as an exact per-channel shift ``x + B`` (the form
   :mod:`quantkit.prep.preact_batchnorm` gives a pre-activation BatchNorm): the lowering emits ``Add(x, B)``.
6. A *rescale* (``Mul`` / ``Div`` by a positive scalar constant ``c``) is kept like a passthrough
   (quantized input, every consumer quantized, no activation folded after it); its output inherits
   its input's quantization with the scale multiplied by ``c`` (``1/c`` for ``Div``) and the node
   itself is dropped by the lowering (:attr:`QuantPlan.rescales`).
7. A ``Concat`` with some quantized inputs and some from float ops (DeepLabV3's ASPP: four int8 branches and a
   pooled branch upsampled by a float ``Resize(linear)``) is kept in the chain: each float input gets a
   QuantizeLinear on the Concat output's grid (inherited: no range of its own), so ``QLinearConcat`` computes
   exactly what quantizing the float concatenation would (one rounding on the output grid), without a
   DequantizeLinear per int8 input, a float Concat and a QuantizeLinear of the whole output.
8. A ``MatMul``'s bias - ``Add(MatMul(x, W), b)``, ``b`` a constant vector over ``W``'s columns, the Add the
   product's only reader (:func:`bias_matmul`) - is part of the layer, never glue (:attr:`QuantPlan.layer_biases`):
   the layer's output is the Add's, quantized when an int8 op reads it (a chain goes on through it) and the
   lowering emits one ``MatMulIntegerToFloat`` with the bias inside, then that QuantizeLinear - one rounding,
   where a quantized product and a ``QLinearAdd`` of the bias would round twice (a LeViT-style block, whose
   BatchNorm folded into the MatMul leaves ``MatMul -> Add -> Reshape -> HardSwish``).
9. An ``Add`` of an int8 branch and an upsampled one - ``Add(lateral, Resize(coarser))``, the top-down path of a
   feature pyramid (FPN, UperNet, a U-Net decoder), the ``Resize`` bilinear so a float island - is kept in the
   chain: the Resize output gets a QuantizeLinear of its own (calibrated on its range), and ``QLinearAdd`` adds
   the two (a DequantizeLinear of the int8 lateral into a float ``Add``, then a QuantizeLinear for the next int8
   Conv, was a stray round trip).
10. A ``Split`` (or another op with several outputs that runs on the codes) stays in a chain when an int8 op reads
   one of its outputs: every output gets the input's grid, and an output only float ops read is dequantized - a
   chain exit (FocalNet's projection split into the query, the context and the gates, the gates read by float
   ``Mul`` ops: the whole Split was dropped from the chain, so ``q * modulator`` stayed float between a
   DequantizeLinear of the int8 modulator and a QuantizeLinear for the next MatMul, 12 stray round trips).
   Measured and not taken: keeping *any* same-shape ``Add`` / ``Mul`` of an int8 and a float tensor in the chain
   (a QuantizeLinear on the float input): on FocalNet-T it took the residual ``Add`` ops in too - 12 strays
   again, 0.8 dB lower output SQNR and slower than with this rule alone.
11. An ``LSTM`` with constant float weights that the plan puts in int8 (``layout`` 0) is lowered to ONNX Runtime's
   ``DynamicQuantizeLSTM`` (:attr:`QuantPlan.dynamic_lstms`): ``W`` and ``R`` int8, symmetric, one scale per gate
   row, the input and hidden state quantized at run time by the kernel - no QuantizeLinear (ONNX Runtime has no QDQ
   LSTM); nothing of it is calibrated.  Before, an LSTM stayed float without a word (a recurrent text classifier
   came out 0.9998 of its size).
12. A ``Relu`` / ``Clip(0, hi)`` that is *not* its quantized producer's only reader - a pre-activation residual unit,
   ``x + conv(relu(conv(relu(x))))`` (DPT / Depth Anything's fusion blocks, a pre-activation ResNet without its
   BatchNorm), where the stream ``x`` is read by the ``Relu`` and by the residual ``Add`` - keeps the chain: its
   output is quantized on its own clipped range (zero point at the grid minimum), its readers count as the
   producer's int8 readers (rule 2), and the lowering emits it as ``LeakyRelu(alpha=0)`` between the DQ and the Q,
   which ONNX Runtime runs as ``QLinearLeakyRelu`` on the codes (:func:`quantkit.lowering.qdq._relus_on_codes`).
   Before, the residual ``Add`` stayed float and the ``Relu`` sat between a DequantizeLinear and a QuantizeLinear
   of another grid, which ONNX Runtime's Relu removal left as a stray requantizing round trip.
13. A ``Gather`` of rows from a constant float table (``[V, D]``, axis 0, at least :data:`MIN_TABLE_BYTES`) that
   only Gathers read - a word or position embedding - gets an 8-bit table when the plan puts it in int8
   (:attr:`QuantPlan.tables`): the lowering emits ONNX Runtime's ``GatherBlockQuantized`` (one scale and zero point
   per block of a row, :mod:`quantkit.lowering.tables`); its output stays float, so nothing of it is calibrated.
   A table that a MatMul reads too (a tied output projection) stays float.  Before, every table stayed float: an
   encoder's int8 file kept its word embedding at 4 bytes a value (MiniLM-L6: 0.65 of the FP32 file, ONNX
   Runtime's ``quantize_dynamic`` 0.26).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from quantkit.ops import ABSORBABLE, GLUE, PASSTHROUGH, QUANTIZABLE_OPS, RESCALE, WEIGHTED, module_path
from quantkit.recipe.plan import LayerPlan, PrecisionPlan, as_plan
from quantkit.recipe.schema import RecipeModel
from quantkit.scheme.qparams import compute_qparams, dequantize, quantize


@dataclass(frozen=True)
class TensorQuant:
    """One activation tensor that gets a QuantizeLinear."""

    name: str
    dtype: str  # "uint8" | "int8"
    symmetric: bool
    calibrator: str
    clip: tuple[float, float] | None = None  # folded Relu/Clip bounds
    inherit_from: str | None = None  # passthrough output: reuse this tensor's qparams
    consumers: tuple[str, ...] = ()
    producer: str | None = None
    note: str = ""
    factor: float = 1.0  # rescale output: the inherited scale times this (a positive constant)


@dataclass
class QuantPlan:
    """The result of selection: layers and tensors to quantize, and why others were not."""

    layers: dict[str, LayerPlan] = field(default_factory=dict)
    tensors: dict[str, TensorQuant] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # node name -> reason it stays float
    rescales: dict[str, float] = field(default_factory=dict)  # rescale node -> factor (no node emitted)
    folded_gates: dict[str, str] = field(default_factory=dict)  # HardSigmoid -> the Conv/Gemm it is folded into
    layer_biases: dict[str, str] = field(default_factory=dict)  # bias Add -> the MatMul whose bias it is (rule 8)
    dynamic_lstms: dict[str, LayerPlan] = field(default_factory=dict)  # LSTM -> plan: int8 weights, dynamic (rule 11)
    tables: dict[str, LayerPlan] = field(default_factory=dict)  # Gather -> plan: an 8-bit table (rule 13)

    def calibrated_tensors(self) -> dict[str, TensorQuant]:
        """Tensors whose range comes from calibration (not inherited)."""
        return {k: v for k, v in self.tensors.items() if v.inherit_from is None}


ORIGINAL_OP_TYPE = "quantkit.original_op_type"
"""Node metadata set by graph rewrites that change a layer's op type (Gemm -> MatMul): recipe overrides
by ``op_type`` keep matching the op the user saw in the exported model."""


def recipe_op_type(node: ir.Node) -> str:
    """The op type recipe overrides match: the original one when a rewrite changed it."""
    return node.metadata_props.get(ORIGINAL_OP_TYPE, node.op_type)


def layer_plan(plan: PrecisionPlan, node: ir.Node) -> LayerPlan:
    """``node``'s entry in ``plan`` (matched by name, module path and the op type the user saw)."""
    return plan.layer(node.name or "", recipe_op_type(node), module_path(node))


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The numpy value of a constant (initializer or ``Constant`` node output), else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    prod = value.producer()
    if prod is not None and prod.op_type == "Constant" and prod.domain == "":
        attr = prod.attributes.get("value")
        if attr is not None:
            return attr.as_tensor().numpy()
    return None


def clip_bounds(node: ir.Node) -> tuple[float, float] | None:
    """(lo, hi) of a Relu or a Clip with constant bounds, else None."""
    if node.op_type == "Relu":
        return (0.0, float("inf"))
    if node.op_type != "Clip":
        return None
    lo, hi = -float("inf"), float("inf")
    if "min" in node.attributes:  # opset < 11
        lo = node.attributes["min"].as_float()
    if "max" in node.attributes:
        hi = node.attributes["max"].as_float()
    ins = list(node.inputs)
    if len(ins) > 1 and ins[1] is not None:
        a = constant_array(ins[1])
        if a is None:
            return None
        lo = float(a)
    if len(ins) > 2 and ins[2] is not None:
        a = constant_array(ins[2])
        if a is None:
            return None
        hi = float(a)
    return (lo, hi)


def _activation_inputs(node: ir.Node) -> list[int]:
    """Indices of the inputs of a quantized node that carry activations (need Q/DQ)."""
    if node.op_type in WEIGHTED:
        return [0]
    if node.op_type in PASSTHROUGH:
        return [0]
    return [i for i, v in enumerate(node.inputs) if v is not None and constant_array(v) is None]


def rescale_factor(node: ir.Node) -> float | None:
    """``c`` when ``node`` is ``Mul(x, c)`` / ``Mul(c, x)`` (``1/c`` for ``Div(x, c)``) with ``c`` a positive, finite
    float32 scalar constant (one element, of a rank no larger than ``x``'s so it cannot broadcast ``x`` up),
    else None.  Such a node is a *rescale*: ``c * DQ(q; s, z) == DQ(q; c*s, z)``, so no node is needed."""
    if node.op_type not in RESCALE or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    a, b = node.inputs
    ca, cb = constant_array(a), constant_array(b)
    if node.op_type == "Div":
        x, c = (a, cb) if ca is None else (None, None)
    elif (ca is None) == (cb is None):
        return None
    else:
        x, c = (a, cb) if ca is None else (b, ca)
    if x is None or c is None or c.dtype != np.float32 or c.size != 1:
        return None
    if c.ndim > 0 and (x.shape is None or len(x.shape) < c.ndim):
        return None
    v = float(c.reshape(()))
    if not np.isfinite(v) or v <= 0.0:
        return None
    return 1.0 / v if node.op_type == "Div" else v


def _passthrough_ok(node: ir.Node) -> str | None:
    """None if a passthrough candidate runs on the codes in ONNX Runtime, else the reason it cannot."""
    if not node.inputs or node.inputs[0] is None or constant_array(node.inputs[0]) is not None:
        return "its data input is a constant"
    if node.op_type == "Resize":
        mode = node.attributes.get("mode")
        m = mode.as_string() if mode is not None else "nearest"
        if m != "nearest":
            return f"Resize in {m!r} mode (ONNX Runtime runs only a nearest Resize on int8 codes; it stays float)"
    if node.op_type == "Gather" and (len(node.inputs) < 2 or constant_array(node.inputs[1]) is None):
        return "Gather with computed indices"
    return None


def _glue_ok(node: ir.Node) -> str | None:
    """None if a glue / rescale candidate can be quantized, else the reason it cannot."""
    if node.op_type in PASSTHROUGH:
        return _passthrough_ok(node)
    if node.op_type == "BatchNormalization":
        from quantkit.ops import batchnorm_shift

        if batchnorm_shift(node) is None:
            return ("BatchNormalization that no layer absorbs and that is not an exact per-channel shift (no int8 "
                    "kernel in ONNX Runtime; quantkit.prep.preact_batchnorm rewrites it when a Relu and Convs with "
                    "positive-scale channels follow)")
    if node.op_type == "Div" and rescale_factor(node) is None:
        return "Div by a non-constant or a non-positive / non-scalar value (no int8 kernel)"
    if node.op_type == "HardSigmoid":
        a = node.attributes.get("alpha")
        alpha = a.as_float() if a is not None else 0.2
        if not (np.isfinite(alpha) and alpha > 0.0):
            return f"HardSigmoid with alpha {alpha:g} <= 0 (decreasing: the Add form needs alpha > 0)"
    if node.op_type in ("Add", "Mul"):
        for v in node.inputs:
            c = constant_array(v)
            if c is not None and c.dtype != np.float32:
                return f"constant operand of dtype {c.dtype} (only float32 constants are quantized)"
            if c is not None and node.op_type == "Mul" and c.size > 1 and rescale_factor(node) is None:
                err = _per_tensor_relative_error(c)
                if err > MAX_CONSTANT_FACTOR_ERROR:
                    return (f"constant factor loses {100 * err:.0f}% on one 8-bit per-tensor grid (QLinearMul takes "
                            f"one scale per input; allowed: {100 * MAX_CONSTANT_FACTOR_ERROR:.0f}%)")
    return None


MAX_CONSTANT_FACTOR_ERROR = 0.02
"""The largest relative error a ``Mul``'s constant tensor (a per-channel scale) may take on the 8-bit per-tensor
grid ``QLinearMul`` reads it with; a scale spanning decades (a layer scale of 1e-6 .. 1) stays float instead."""


def _per_tensor_relative_error(c: np.ndarray) -> float:
    """Max ``|DQ(Q(c)) - c| / |c|`` over the non-zero elements of ``c`` on its asymmetric 8-bit grid."""
    scale, zp = compute_qparams(np.float32(c.min()), np.float32(c.max()), "uint8", symmetric=False)
    back = dequantize(quantize(c.astype(np.float32), scale, zp), scale, zp)
    nz = np.abs(c) > 0
    return float(np.max(np.abs(back - c)[nz] / np.abs(c)[nz])) if np.any(nz) else 0.0


def _not_constant_why(w: ir.Value) -> str:
    """Why a weight input is not a constant, in the words the report shows."""
    prod = w.producer()
    if prod is not None and prod.op_type in ("Transpose", "Reshape", "Cast") and prod.inputs and prod.inputs[0] is not None:
        src = prod.inputs[0]
        if src.const_value is not None and any(user is not prod for user, _ in src.uses()):
            return (f"weight is a {prod.op_type} of the constant {src.name!r}, which other nodes read too (a tied "
                    "embedding table and its head): kept as one float table, so this layer stays float (an int4 / "
                    "int8_weight format quantizes a tied head with the table)")
    return "weight is not a constant (activation x activation product stays float)"


def _weighted_ok(node: ir.Node) -> str | None:
    """None if the weighted node can be quantized, else the reason it cannot."""
    spec = WEIGHTED[node.op_type]
    ins = list(node.inputs)
    w_in = ins[spec.weight_input] if len(ins) > spec.weight_input else None
    if w_in is None:
        return "no weight input"
    w = constant_array(w_in)
    if w is None:
        return _not_constant_why(w_in)
    if w.dtype != np.float32:
        return (f"weight dtype {w.dtype} is not float32 (quantkit quantizes float32 models: export the model in "
                "float32, or convert its float16 tensors to float32 first)")
    if constant_array(ins[0]) is not None:
        return "activation input is a constant"
    if node.op_type == "Conv" and w.ndim not in (3, 4, 5):
        return f"Conv weight rank {w.ndim}"
    if node.op_type in ("Gemm", "MatMul") and w.ndim != 2:
        return f"{node.op_type} weight rank {w.ndim} (only 2-D weights are quantized)"
    if node.op_type == "Gemm":
        if node.attributes.get("transA") is not None and node.attributes["transA"].as_int() != 0:
            return "Gemm with transA=1"
    if spec.bias_input is not None and len(ins) > spec.bias_input and ins[spec.bias_input] is not None:
        b = constant_array(ins[spec.bias_input])
        if b is None or b.ndim != 1:
            return "bias is not a constant vector"
    return None


def _int8_candidates(model: ir.Model, precision: PrecisionPlan, plan: QuantPlan) -> dict[str, ir.Node]:
    """Rule 1: the nodes the precision plan puts in static int8 (into ``plan.layers``; others into
    ``plan.skipped`` with the reason)."""
    q = precision.recipe.quantization
    allowed_ops = QUANTIZABLE_OPS if q.op_types == "auto" else frozenset(q.op_types)
    nodes: dict[str, ir.Node] = {}
    for node in model.graph:
        if node.op_type not in QUANTIZABLE_OPS or node.domain not in ("", "ai.onnx"):
            continue
        name = node.name or ""
        nodes[name] = node
        lp = layer_plan(precision, node)
        if lp.op_type != node.op_type:  # matched as the original op; lowered as the node it is now
            lp = dataclasses.replace(lp, op_type=node.op_type)
        if node.op_type not in allowed_ops:
            plan.skipped[name] = f"op type {node.op_type} not in quantization.op_types"
            continue
        if lp.format != "int8":
            plan.skipped[name] = f"the plan keeps it {lp.format} ({lp.rule})"
            continue
        why = _weighted_ok(node) if node.op_type in WEIGHTED else _glue_ok(node)
        if why is None and _read_in_subgraph(node, model.graph):
            why = ("its output is read inside a subgraph (an If / Loop / Scan body), which keeps float values: "
                   "the DequantizeLinear would have to live in that body")  # fmt: skip
        if why:
            plan.skipped[name] = why
            continue
        gate_of = _gate_producer(node, model) if q.fold_clip_ranges else None
        if gate_of is not None:  # folded if its producer ends up int8 (rule 4), else it stays float
            plan.folded_gates[name] = gate_of.name or ""
            continue
        bias_of = bias_matmul(node)
        if bias_of is not None:  # the MatMul's bias (rule 8), when the MatMul ends up int8; else float
            plan.layer_biases[name] = bias_of.name or ""
            continue
        plan.layers[name] = lp
    for node in model.graph:  # rule 11: an LSTM with constant weights the plan puts in int8
        if node.op_type == "LSTM" and node.domain in ("", "ai.onnx"):
            lp = layer_plan(precision, node)
            why = (f"the plan keeps it {lp.format} ({lp.rule})" if lp.format != "int8" else _lstm_ok(node))
            if why:
                plan.skipped[node.name or ""] = why
            else:
                plan.dynamic_lstms[node.name or ""] = lp
    for node in model.graph.all_nodes():  # layers inside If / Loop / Scan bodies: named, with why they stay float
        if (node.graph is not model.graph and node.op_type in WEIGHTED and node.domain in ("", "ai.onnx")
                and node.name and node.name not in plan.skipped):
            plan.skipped[node.name] = ("inside a subgraph (an If / Loop / Scan body): subgraphs keep float values "
                                       "(quantkit quantizes the main graph)")
    return nodes


MIN_TABLE_BYTES = 64 * 1024
"""Smaller tables (a token-type embedding of 2 rows) stay float: a few KB saved for a rounding of every row."""


def _axis(node: ir.Node) -> int:
    ax = node.attributes.get("axis")
    return ax.as_int() if ax is not None else 0


def _int8_tables(model: ir.Model, precision: PrecisionPlan, plan: QuantPlan) -> None:
    """Rule 13: the Gathers of constant tables that get 8-bit rows (into ``plan.tables``)."""
    q = precision.recipe.quantization
    if q.op_types != "auto" and "Gather" not in q.op_types:
        return
    for node in model.graph:
        name = node.name or ""
        if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or name in plan.layers or not node.inputs:
            continue
        table = node.inputs[0]
        arr = constant_array(table) if table is not None and not table.is_graph_input() else None
        if arr is None or arr.dtype != np.float32 or arr.ndim != 2 or arr.nbytes < MIN_TABLE_BYTES:
            continue
        if _axis(node) not in (0, -2) or arr.shape[1] < 16:
            continue
        lp = layer_plan(precision, node)
        if lp.format != "int8":
            plan.skipped[name] = f"the plan keeps it {lp.format} ({lp.rule})"
            continue
        others = sorted({f"{u.node.op_type} {u.node.name!r}" for u in table.uses()  # type: ignore[union-attr]
                         if u.node.op_type != "Gather" or u.idx != 0 or _axis(u.node) not in (0, -2)})
        if others:
            plan.skipped[name] = (f"its table is also read by {', '.join(others[:2])} (a tied weight): it stays "
                                  "float")
            continue
        plan.tables[name] = lp
        plan.skipped.pop(name, None)


def _lstm_ok(node: ir.Node) -> str | None:
    """Why an LSTM cannot become ``DynamicQuantizeLSTM`` (rule 11), or None."""
    layout = node.attributes.get("layout")
    if layout is not None and layout.as_int() != 0:
        return "LSTM with layout=1 (batch first): ONNX Runtime's DynamicQuantizeLSTM has no layout attribute"
    for i, what in ((1, "W"), (2, "R")):
        v = node.inputs[i] if len(node.inputs) > i else None
        if v is None or v.const_value is None or v.is_graph_input():
            return f"LSTM weight {what} is not a constant"
        if v.const_value.dtype != ir.DataType.FLOAT or len(v.const_value.shape) != 3:
            return f"LSTM weight {what} is not a 3-D float32 constant"
    return None


def _read_in_subgraph(node: ir.Node, graph: ir.Graph) -> bool:
    """Whether a subgraph of another node reads ``node``'s output (or, through one Relu / Clip that alone reads
    it, that activation's output: what the layer's output quantizer would cover)."""
    for out in node.outputs:
        uses = list(out.uses())
        if any(u.node.graph is not graph for u in uses):
            return True
        if len(uses) == 1 and uses[0].node.op_type in ABSORBABLE:
            if any(u.node.graph is not graph for o in uses[0].node.outputs for u in o.uses()):
                return True
    return False


def bias_matmul(node: ir.Node) -> ir.Node | None:
    """The ``MatMul`` whose bias ``node`` is (rule 8): ``node`` is ``Add(MatMul(x, W), b)`` (either order) with ``b``
    a constant float32 vector of one value per output column of the constant 2-D ``W``, and the Add is the
    product's only reader (the product is not a graph output); else None."""
    if node.op_type != "Add" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    for i in (0, 1):
        v, b_v = node.inputs[i], node.inputs[1 - i]
        p = v.producer() if v is not None else None
        if p is None or p.op_type != "MatMul" or p.domain not in ("", "ai.onnx") or _weighted_ok(p) is not None:
            continue
        w, b = constant_array(p.inputs[1]), constant_array(b_v)
        if w is None or b is None or b.dtype != np.float32 or b.ndim != 1 or b.shape[0] != w.shape[1]:
            continue
        assert v is not None  # p is its producer
        if len(_consumers(v)) != 1 or v.is_graph_output():
            continue
        return p
    return None


def _gate_producer(node: ir.Node, model: ir.Model) -> ir.Node | None:
    """The Conv / Gemm a ``HardSigmoid`` can be folded into (it is that layer's only consumer, the layer has a
    bias slot of one value per output channel, nothing is a graph output), else None."""
    if node.op_type != "HardSigmoid" or node.inputs[0] is None:
        return None
    x = node.inputs[0]
    p = x.producer()
    if p is None or p.op_type not in ("Conv", "Gemm") or p.domain not in ("", "ai.onnx") or _weighted_ok(p):
        return None
    if len(_consumers(x)) != 1 or x.is_graph_output() or node.outputs[0].is_graph_output():
        return None
    if _bias_channels(p) is None:
        return None
    return p


def _bias_channels(node: ir.Node) -> int | None:
    """Output channels of a Conv / Gemm whose bias (if any) is one value per channel, else None."""
    spec = WEIGHTED[node.op_type]
    w = constant_array(node.inputs[spec.weight_input])
    if w is None:
        return None
    if node.op_type == "Conv":
        n = int(w.shape[0])
    else:
        tb = node.attributes.get("transB")
        n = int(w.shape[0] if tb is not None and tb.as_int() == 1 else w.shape[1])
    ins = list(node.inputs)
    if spec.bias_input is not None and len(ins) > spec.bias_input and ins[spec.bias_input] is not None:
        b = constant_array(ins[spec.bias_input])
        if b is None or b.shape != (n,):
            return None
    return n


REDUCING = frozenset({"GlobalAveragePool", "AveragePool"})
"""Glue ops that shrink their input: at the end of an int8 chain (e.g. before a classifier in another format)
they stay int8 and their output is dequantized, rather than dequantizing the larger input."""


def _consumers(v: ir.Value) -> list[ir.Node]:
    return [u.node for u in v.uses()]


def _biased_layer(plan: QuantPlan, node: ir.Node | None) -> ir.Node | None:
    """``node`` when it is a quantized layer; the quantized MatMul when ``node`` is its bias Add (rule 8)."""
    if node is None:
        return None
    if node.name in plan.layers:
        return node
    if plan.layer_biases.get(node.name or "") in plan.layers and node.inputs[0] is not None:
        for v in node.inputs:
            p = v.producer() if v is not None else None
            if p is not None and p.name == plan.layer_biases[node.name or ""]:
                return p
    return None


def _q_producer(plan: QuantPlan, v: ir.Value) -> ir.Node | None:
    """The quantized node whose (possibly activation-folded, possibly biased: rule 8) output is ``v``."""
    p = v.producer()
    if p is None:
        return None
    layer = _biased_layer(plan, p)
    if layer is not None:
        return layer
    bounds = clip_bounds(p) if p.op_type in ABSORBABLE else None
    if bounds is not None and p.inputs[0] is not None:
        pp = _biased_layer(plan, p.inputs[0].producer())
        if pp is not None and (len(_consumers(p.inputs[0])) == 1 or bounds[0] == 0.0):  # rule 4, rule 12
            return pp
    if (p.name or "") in plan.folded_gates and plan.folded_gates[p.name or ""] in plan.layers:
        return p.inputs[0].producer() if p.inputs[0] is not None else None
    return None


def select(model: ir.Model, recipe: RecipeModel | PrecisionPlan) -> QuantPlan:
    """Build the :class:`QuantPlan` of ``model``'s static-int8 layers under a precision plan (or a recipe,
    resolved as :meth:`PrecisionPlan.from_recipe`): rules 1-6 of the module doc."""
    precision = as_plan(recipe)
    plan = QuantPlan()
    nodes = _int8_candidates(model, precision, plan)
    _keep_int8_chains(model, plan, nodes)
    _place_tensors(model, plan, precision.recipe.quantization)
    for gate, prod in list(plan.folded_gates.items()):  # rule 4: only gates whose layer is int8 and quantized
        if prod not in plan.layers or (nodes[gate].outputs[0].name or "") not in plan.tensors:
            del plan.folded_gates[gate]
            plan.skipped[gate] = "HardSigmoid after a layer that stays float (or keeps a float output)"
    for add, mm in list(plan.layer_biases.items()):  # rule 8: only the biases of int8 MatMuls
        if mm not in plan.layers:
            del plan.layer_biases[add]
            plan.skipped[add] = f"the bias of MatMul {mm!r}, which stays float"
    _int8_tables(model, precision, plan)
    for name in list(plan.layers):  # rule 6: a rescale is not a layer - the lowering drops it
        f = rescale_factor(nodes[name])
        if f is not None:
            plan.rescales[name] = f
            del plan.layers[name]
    return plan


_NO_FOLD = frozenset({"HardSigmoid"})
"""Glue ops whose output quantization is fixed by the op itself (rule 4): no activation is folded after them."""


def _folds_after(node: ir.Node) -> bool:
    """Whether a Relu/Clip consuming ``node``'s output may be folded into its output quantization."""
    return node.op_type not in _NO_FOLD and rescale_factor(node) is None


def _relu_on_codes(node: ir.Node) -> bool:
    """Whether ``node`` is a ``Relu`` / ``Clip(0, hi)`` that ONNX Runtime can run on 8-bit codes (rule 12: emitted
    as ``LeakyRelu(alpha=0)``, fused into ``QLinearLeakyRelu``; the upper bound is the output grid's saturation)."""
    if node.op_type not in ABSORBABLE or node.domain not in ("", "ai.onnx"):
        return False
    bounds = clip_bounds(node)
    return bounds is not None and bounds[0] == 0.0 and bounds[1] > 0.0


def _keep_int8_chains(model: ir.Model, plan: QuantPlan, nodes: Mapping[str, ir.Node]) -> None:
    """Rule 2: glue / passthrough nodes stay int8 only inside a chain (greatest fixed point)."""
    graph_outputs = {id(v) for v in model.graph.outputs}
    changed = True
    while changed:
        changed = False
        for name in list(plan.layers):
            node = nodes[name]
            if node.op_type not in GLUE and node.op_type not in PASSTHROUGH and node.op_type not in RESCALE:
                continue
            reason = None
            if not _float_inputs_ok(plan, node):
                reason = "an input comes from a float op (quantizing it would add a Q/DQ round trip)"
            if reason is None:
                for out in node.outputs:
                    users = _consumers(out)
                    folded: list[ir.Node] = []
                    for u in users:
                        if u.op_type in ABSORBABLE and len(users) == 1 and _folds_after(node):
                            folded.extend(_consumers(u.outputs[0]))
                        elif _relu_on_codes(u):  # rule 12: a Relu beside other readers runs on the codes
                            folded.extend([u, *_consumers(u.outputs[0])])
                        else:
                            folded.append(u)
                    if node.op_type in REDUCING and id(out) not in graph_outputs:
                        continue  # a pool may end a chain: its (smaller) output is dequantized instead
                    if id(out) in graph_outputs or not any(u.name in plan.layers for u in folded):
                        reason = "its output feeds only float ops or the graph output"
                        break
                if (reason is not None and len(node.outputs) > 1 and node.op_type in PASSTHROUGH
                        and _float_inputs_ok(plan, node) and any(id(out) not in graph_outputs and any(
                            u.name in plan.layers for u in _consumers(out)) for out in node.outputs)):  # fmt: skip
                    reason = None  # rule 10: a Split an int8 op reads on one output (the others: chain exits)
            if reason:
                del plan.layers[name]
                plan.skipped[name] = f"not in an int8 chain: {reason}"
                changed = True


def _float_inputs(plan: QuantPlan, node: ir.Node) -> list[ir.Value]:
    """The activation inputs of ``node`` that no quantized node produces."""
    out = []
    for i in _activation_inputs(node):
        v = node.inputs[i]
        if v is not None and _q_producer(plan, v) is None:
            out.append(v)
    return out


def _float_inputs_ok(plan: QuantPlan, node: ir.Node) -> bool:
    """Rule 2's input condition: every activation input is quantized - or, for a ``Concat`` with at least one
    quantized input (rule 7), the float ones are quantized on the Concat's own output grid."""
    floats = _float_inputs(plan, node)
    if not floats:
        return True
    if len(floats) >= len(_activation_inputs(node)):
        return False
    if node.op_type == "Concat":
        return True
    # rule 9: an Add of an int8 branch and an upsampled one (a feature pyramid's top-down path)
    return node.op_type == "Add" and all((p := v.producer()) is not None and p.op_type == "Resize" for v in floats)


def _add_tensor(plan: QuantPlan, v: ir.Value, lp: LayerPlan, consumer: str | None, **kw: object) -> None:
    name = v.name or ""
    prev = plan.tensors.get(name)
    cons = tuple(sorted({*(prev.consumers if prev else ()), *((consumer,) if consumer else ())}))
    if prev is not None:
        plan.tensors[name] = TensorQuant(**{**prev.__dict__, "consumers": cons})
        return
    prod = v.producer()
    plan.tensors[name] = TensorQuant(name=name, dtype=lp.act_dtype, symmetric=lp.act_symmetric,
                                     calibrator=lp.calibrator, consumers=cons,
                                     producer=prod.name if prod is not None else None, **kw)  # type: ignore[arg-type]


def _output_target(node: ir.Node, q: Any, graph_outputs: set[int], plan_gates: Mapping[str, str] | None = None,
                   biases: Mapping[str, str] | None = None) -> tuple[ir.Value, tuple[float, float] | None]:
    """The tensor that carries this quantized node's output Q (after its bias Add, rule 8, and a folded
    activation)."""
    out = node.outputs[0]
    if node.op_type == "HardSigmoid":
        return out, (0.0, 1.0)
    plan_gates = plan_gates or {}
    users = _consumers(out)
    if node.op_type == "MatMul" and len(users) == 1 and (users[0].name or "") in (biases or {}):
        out = users[0].outputs[0]
        users = _consumers(out)
    if q.fold_clip_ranges and len(users) == 1 and id(out) not in graph_outputs and _folds_after(node):
        act = users[0]
        if (act.name or "") in plan_gates and node.op_type in WEIGHTED:
            return act.outputs[0], (0.0, 1.0)
        bounds = clip_bounds(act)
        if act.op_type in ABSORBABLE and bounds is not None and bounds[0] <= 0.0 <= bounds[1]:
            return act.outputs[0], bounds
    return out, None


def _place_tensors(model: ir.Model, plan: QuantPlan, q: Any) -> None:
    """Rules 3 and 4: which tensors get a QuantizeLinear, and with whose scheme."""
    graph_outputs = {id(v) for v in model.graph.outputs}
    for node in [n for n in model.graph if n.name in plan.layers]:
        lp = plan.layers[node.name or ""]
        factor = rescale_factor(node)
        target, bounds = _output_target(node, q, graph_outputs, plan.folded_gates, plan.layer_biases)
        for i in _activation_inputs(node):
            v = node.inputs[i]
            if v is None or node.op_type in PASSTHROUGH or factor is not None:
                continue  # a passthrough's / rescale's input is quantized by its producer (it is in an int8 chain)
            p = v.producer()
            qp = _q_producer(plan, v)
            if qp is None and node.op_type == "Concat" and (v.name or "") not in plan.tensors:  # rule 7
                _add_tensor(plan, v, lp, node.name, inherit_from=target.name,
                            note=f"a float input of Concat {node.name!r}, on its output's grid (the rounding "
                                 "quantizing the concatenation makes)")  # fmt: skip
                continue
            if p is not None and p.op_type in ABSORBABLE and qp is not None and q.fold_clip_ranges:
                _add_tensor(plan, v, plan.layers[qp.name or ""], node.name, clip=clip_bounds(p))
            elif p is not None and (p.name or "") in plan.folded_gates and qp is not None and q.fold_clip_ranges:
                _add_tensor(plan, v, plan.layers[qp.name or ""], node.name, clip=(0.0, 1.0))
            else:
                _add_tensor(plan, v, lp, node.name)
        if node.op_type in PASSTHROUGH and len(node.outputs) > 1:  # Split: every output on the input's grid
            src_v = node.inputs[0]
            src_name = src_v.name if src_v is not None else None
            src_tq = plan.tensors.get(src_name or "")
            for out in node.outputs:  # (an output read by float ops only is dequantized: ONNX Runtime runs a
                is_out = id(out) in graph_outputs  # Split on the codes only when every output has its Q)
                if (_consumers(out) and not (is_out and not q.quantize_outputs)) or (is_out and q.quantize_outputs):
                    lp_out = lp if src_tq is None else dataclasses.replace(
                        lp, calibrator=src_tq.calibrator, act_dtype=src_tq.dtype, act_symmetric=src_tq.symmetric)
                    _add_tensor(plan, out, lp_out, None, inherit_from=src_name)
            continue
        users = _consumers(target)
        needs = node.op_type not in WEIGHTED or not WEIGHTED[node.op_type].float_output_ok
        feeds_q = any(u.name in plan.layers for u in users)
        is_out = id(target) in graph_outputs
        if not (needs or (feeds_q and not (is_out and not q.quantize_outputs)) or (is_out and q.quantize_outputs)):
            continue
        if node.op_type in PASSTHROUGH or factor is not None:
            src = node.inputs[_activation_inputs(node)[0]] if factor is not None else node.inputs[0]
            src_name = src.name if src is not None else None
            src_tq = plan.tensors.get(src_name or "")
            if src_tq is not None:  # same grid and range as its source: same calibrator too
                lp = dataclasses.replace(lp, calibrator=src_tq.calibrator, act_dtype=src_tq.dtype,
                                         act_symmetric=src_tq.symmetric)
            extra = {} if factor is None else {"factor": factor, "note": f"rescale by {factor:g} (no node)"}
            _add_tensor(plan, target, lp, None, inherit_from=src_name, **extra)
        else:
            _add_tensor(plan, target, lp, None, clip=bounds)


def layer_names(plan: QuantPlan) -> Mapping[str, str]:
    """Quantized layer name -> op type."""
    return {k: v.op_type for k, v in plan.layers.items()}
