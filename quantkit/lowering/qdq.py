"""INT8 static QDQ lowering: insert QuantizeLinear/DequantizeLinear as planned.

Given a :class:`~quantkit.lowering.select.QuantPlan` and calibrated ranges, edit the
``onnx_ir`` model in place:

* every planned activation tensor ``T`` gets one ``QuantizeLinear`` (``T -> T_q``) and a
  dedicated ``DequantizeLinear`` per consumer (ONNX Runtime's QDQ selectors need a DQ
  with a single consumer).  When ``T`` is produced by a quantized node, *all* of its
  consumers read through a DQ, so the producer's only consumer is its Q - which is what
  lets ONNX Runtime fuse ``DQ -> op -> Q`` into one QLinear kernel;
* a layer kept float (fp32 override) that reads such a tensor - a Conv/ConvTranspose/Gemm
  with a float weight - gets a per-axis DQ (the same scale in every channel, exact), since
  ONNX Runtime would otherwise quantize its weight per tensor (:func:`float_weighted_reader`);
* every quantized weight is stored as an integer initializer (per output channel,
  symmetric by default) read by ``DequantizeLinear(axis=c)``; the float copy is dropped;
* a Conv/Gemm bias becomes int32 with scale ``s_x * s_w[c]`` and zero point 0, read by
  ``DequantizeLinear(axis=0)`` - the form ``QLinearConv``/``QGemm`` consume;
* folded ``Relu``/``Clip(lo, hi)`` outputs use a range inside ``[lo, hi]``; when the
  float32 product ``scale * (qmax - zp)`` would exceed ``hi`` by rounding, the scale is
  stepped down one ulp at a time, since ONNX Runtime removes the activation only if the
  quantized range lies within the clip range (to 1 float epsilon);
* a constant operand of a quantized ``Add`` / ``Mul`` becomes an integer initializer (the grid of the
  node's activation input) read by its own DequantizeLinear (:func:`quantized_constant`), so that
  ONNX Runtime fuses the node into ``QLinearAdd`` / ``QLinearMul``;
* a quantized ``HardSigmoid(x; a, b)`` becomes ``Add(x, b/a)`` (same node name) whose QuantizeLinear has
  the scale ``s/a`` while its consumers' DequantizeLinear keep the scale ``s`` of the planned output
  (a *relabel*: ``a * DQ(q; s/a, z) == DQ(q; s, z)``); the zero point sits at the grid minimum, so Q's
  saturation is ``clip(x + b/a, 0, 1/a)`` and the group is one ``QLinearAdd``
  (:func:`_hard_sigmoids_as_add`); a HardSigmoid folded into the Conv / Gemm before it
  (:attr:`QuantPlan.folded_gates`, a squeeze-excite gate) is removed instead: ``b/a`` joins the layer's
  bias and the layer's own QuantizeLinear (scale ``s/a``) writes the gate's codes - one ``QLinearConv``;
* a quantized ``BatchNormalization`` - an exact per-channel shift ``x + B`` (:mod:`quantkit.prep.preact_batchnorm`)
  - becomes ``Add(x, B)`` (same node name), i.e. ``QLinearAdd`` (:func:`_batchnorm_shifts_as_add`);
* a rescale (``Mul`` / ``Div`` by a positive scalar, :attr:`QuantPlan.rescales`) is removed: its consumers
  read its input's QuantizeLinear through a DequantizeLinear whose scale is multiplied by the factor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from quantkit.algorithms.bias_correction import bias_shift
from quantkit.algorithms.pair_rounding import pair_safe_weight
from quantkit.errors import CalibrationError
from quantkit.lowering.select import QuantPlan, TensorQuant, clip_bounds, constant_array
from quantkit.ops import WEIGHTED
from quantkit.scheme.dtypes import int_type
from quantkit.scheme.qparams import (
    QuantSpec,
    bias_int32,
    compute_qparams,
    dequantize,
    quantize,
    weight_qparams,
)
from quantkit.scheme.target import Target


@dataclass(frozen=True)
class TensorParams:
    """Final quantization parameters of one activation tensor."""

    name: str
    scale: float
    zero_point: int
    dtype: str
    note: str = ""


@dataclass(frozen=True)
class WeightParams:
    """Final quantization parameters of one layer's weight."""

    layer: str
    dtype: str
    symmetric: bool
    axis: int | None
    scale_min: float
    scale_max: float
    zero_point_range: tuple[int, int]
    weight_sqnr_db: float
    pair_safe_channels: int = 0  # output channels re-rounded / rescaled to obey the int16 pair bound


@dataclass
class LoweringResult:
    tensors: dict[str, TensorParams] = field(default_factory=dict)
    weights: dict[str, WeightParams] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    target: Target | None = None  # the CPU class the weights were rounded for


class _Namer:
    """Unique value/node names derived from a base name."""

    def __init__(self, graph: ir.Graph) -> None:
        self.used: set[str] = set()
        for node in graph.all_nodes() if hasattr(graph, "all_nodes") else graph:
            if node.name:
                self.used.add(node.name)
            for v in node.outputs:
                if v.name:
                    self.used.add(v.name)
        for v in graph.inputs:
            if v.name:
                self.used.add(v.name)
        self.used.update(graph.initializers)

    def __call__(self, base: str) -> str:
        name, i = base, 1
        while name in self.used:
            i += 1
            name = f"{base}_{i}"
        self.used.add(name)
        return name


def _sqnr_db(ref: np.ndarray, approx: np.ndarray) -> float:
    num = float(np.sum(ref.astype(np.float64) ** 2))
    den = float(np.sum((ref.astype(np.float64) - approx) ** 2))
    if den == 0.0:
        return float("inf")
    return 10.0 * np.log10(max(num, 1e-30) / den)


def activation_params(tq: TensorQuant, lo: float, hi: float) -> TensorParams:
    """Scale / zero point of one activation tensor from its calibrated range."""
    it = int_type(tq.dtype)
    note = ""
    if tq.clip is not None:
        clo, chi = tq.clip
        lo, hi = max(lo, clo), min(hi, chi)
        if clo == 0.0:
            # Fold Relu/Clip(0, hi): zero point at the grid minimum makes Q's saturation the activation.
            lo = 0.0
            scale_arr, zp_arr = compute_qparams(np.float32(0.0), np.float32(max(hi, 0.0)), tq.dtype, symmetric=False)
            scale = np.float32(scale_arr)
            if np.isfinite(chi):
                span = np.float32(it.qmax - it.qmin)
                while np.float32(scale * span) > np.float32(chi) and scale > 0:
                    scale = np.nextafter(scale, np.float32(0.0), dtype=np.float32)
            note = f"folded {'Relu' if not np.isfinite(chi) else f'Clip(0, {chi:g})'} (zero point at grid minimum)"
            if tq.symmetric:
                note += "; symmetric request overridden for this tensor so the activation folds exactly"
            return TensorParams(tq.name, float(scale), int(zp_arr), tq.dtype, note)
    scale_arr, zp_arr = compute_qparams(np.float32(lo), np.float32(hi), tq.dtype, symmetric=tq.symmetric)
    return TensorParams(tq.name, float(scale_arr), int(zp_arr), tq.dtype, note)


def as_uint8_storage(tp: TensorParams) -> TensorParams:
    """The same int8 grid stored as uint8: ``q_u8 = q_s8 + 128``, zero point + 128, same scale.

    ``round(x/s) + zp`` saturated to [-128, 127] plus 128 equals ``round(x/s) + zp + 128``
    saturated to [0, 255], so the dequantized values are bit-identical.  ONNX Runtime's CPU
    provider does this conversion itself, but only for a Q with a single DQ consumer; a
    shared int8 Q leaves its consumers with mixed int8/uint8 inputs and unfused.
    """
    if tp.dtype != "int8":
        return tp
    note = (tp.note + "; " if tp.note else "") + "int8 grid stored as uint8 (zero point + 128) for the CPU provider"
    return TensorParams(tp.name, tp.scale, tp.zero_point + 128, "uint8", note)


def lower_int8(
    model: ir.Model,
    plan: QuantPlan,
    ranges: Mapping[str, tuple[np.ndarray, np.ndarray]],
    *,
    activation_storage: str = "uint8",
    matmul_form: str = "fused",
    input_means: Mapping[str, np.ndarray] | None = None,
    target: Target | None = None,
    hessians: Mapping[str, Any] | None = None,
    pair_cache: dict[tuple[str, bytes], tuple[np.ndarray, np.ndarray, int]] | None = None,
) -> LoweringResult:
    """Insert Q/DQ and quantize weights in ``model`` (in place); return the parameters used.

    ``activation_storage="uint8"`` stores int8-grid activations as uint8 (see
    :func:`as_uint8_storage`, exact); ``"as_requested"`` keeps the recipe's type.
    ``matmul_form="fused"`` emits float-output MatMul layers as one ``MatMulIntegerToFloat``
    with the bias inside (:func:`fuse_float_output_linears`); ``"qdq"`` keeps the QDQ form.
    ``input_means`` (layer -> per-channel mean of its activation input, from calibration)
    turns on bias correction (:mod:`quantkit.algorithms.bias_correction`).
    ``target``: when its CPU class saturates int16 pair sums (``x86-avx2``, ``portable``), int8
    weights are rounded to obey the pair bound (:func:`quantkit.algorithms.pair_rounding.pair_safe_weight`),
    so the fused kernels stay exact there; ``hessians`` (layer -> input second moment in kernel K
    order, :func:`hessian_requests`) lets that rounding compensate its error (pair-constrained GPTQ).
    ``pair_cache``: memo of that rounding per (layer, weight scale), for callers that lower one model
    many times (the search).
    """
    graph = model.graph
    if model.opset_imports.get("", 0) < 13:
        model.opset_imports[""] = 13  # per-axis QuantizeLinear/DequantizeLinear
    namer = _Namer(graph)
    result = LoweringResult(target=target)

    # 1. activation qparams
    for name, tq in plan.tensors.items():
        if tq.inherit_from is not None:
            continue
        if name not in ranges:
            raise CalibrationError(f"no calibrated range for tensor {name!r} (consumers: {', '.join(tq.consumers)})")
        lo, hi = ranges[name]
        tp = activation_params(tq, float(np.min(lo)), float(np.max(hi)))
        result.tensors[name] = as_uint8_storage(tp) if activation_storage == "uint8" else tp
    pending = {k: v for k, v in plan.tensors.items() if v.inherit_from is not None}
    while pending:
        progressed = False
        for name, tq in list(pending.items()):
            src = result.tensors.get(tq.inherit_from or "")
            if src is not None:
                if tq.factor != 1.0:
                    result.tensors[name] = TensorParams(
                        name, float(np.float32(src.scale) * np.float32(tq.factor)), src.zero_point, src.dtype,
                        f"rescale of {src.name} by {tq.factor:g}: its codes, read with the scale times {tq.factor:g} "
                        "(no node)")
                else:
                    result.tensors[name] = TensorParams(name, src.scale, src.zero_point, src.dtype,
                                                        f"inherits {src.name}")
                del pending[name]
                progressed = True
        if not progressed:
            missing = ", ".join(sorted(pending))
            raise CalibrationError(f"cannot resolve inherited quantization parameters for {missing}")

    values: dict[str, ir.Value] = {}
    for node in graph:
        for v in node.outputs:
            if v.name:
                values[v.name] = v
    for v in graph.inputs:
        if v.name:
            values[v.name] = v

    def const(name: str, arr: np.ndarray) -> ir.Value:
        val = ir.Value(name=namer(name), const_value=ir.tensor(arr, name=None))
        val.const_value.name = val.name  # type: ignore[union-attr]
        graph.register_initializer(val)
        return val

    # the activation tensor each weighted layer reads (for its bias scale), before edits
    act_inputs = {
        n.name or "": (n.inputs[0].name or "")
        for n in graph
        if n.name in plan.layers and n.op_type in WEIGHTED and n.inputs[0] is not None
    }

    # 2. HardSigmoid as a relabelled Add, integer constants of glue ops, activation Q / DQ, rescales dropped
    q_scales = _hard_sigmoids_as_add(graph, plan, result, const, namer, values)
    _batchnorm_shifts_as_add(graph, plan, result, const)
    _quantize_glue_constants(graph, plan, result, namer, const)
    _insert_activation_qdq(graph, plan, result, namer, const, values, q_scales)
    # 3. weights and biases
    _lower_weights(graph, plan, result, namer, const, act_inputs, input_means, target, hessians, pair_cache)

    if plan.dynamic_lstms:  # select rule 11
        from quantkit.lowering.lstm import lower_dynamic_lstms

        pair_safe = target is not None and target.pair_safe
        for layer in lower_dynamic_lstms(graph, set(plan.dynamic_lstms), const, pair_safe=pair_safe):
            result.notes[layer] = ("DynamicQuantizeLSTM (com.microsoft): int8 weights, one scale per gate row; "
                                   "input and hidden state quantized at run time")
            if "com.microsoft" not in model.opset_imports:
                model.opset_imports["com.microsoft"] = 1
    if plan.tables:  # select rule 13
        from quantkit.lowering.tables import lower_gather_tables

        for layer, table in lower_gather_tables(graph, set(plan.tables), const).items():
            result.notes[layer] = (f"GatherBlockQuantized (com.microsoft): 8-bit rows, a scale and zero point per "
                                   f"{table.block} values")
            result.weights[layer] = WeightParams(layer, "uint8", False, 1, table.scale_min, table.scale_max,
                                                 table.zero_point_range, table.sqnr_db)
        if "com.microsoft" not in model.opset_imports:
            model.opset_imports["com.microsoft"] = 1
    _layout_on_codes(graph)
    _shape_on_codes(graph)
    _relus_on_codes(graph)
    if matmul_form == "fused":
        fused = fuse_float_output_linears(model, plan, result)
        for layer in fused:
            result.notes[layer] = "MatMulIntegerToFloat with the bias folded in (com.microsoft)"
    _drop_unused_initializers(graph)
    return result


def quantized_constant(c: np.ndarray, dtype: str) -> tuple[np.ndarray, np.float32, int]:
    """``(codes, scale, zero_point)`` of a float constant operand on an 8-bit grid of ``dtype``.

    A scalar is stored as one code, with the zero point at 0 (int8) or at the end of the grid away from the
    value's sign (uint8: 0 for a positive value, 255 for a negative one) and the scale, of ``|c| / steps`` and
    the power of two that represents it exactly when there is one (``3 = 192 * 2**-6``), whichever dequantizes
    closer to ``c``.  A tensor gets the asymmetric per-tensor grid of its range (0 included): ``QLinearAdd`` /
    ``QLinearMul`` take one scale per input."""
    it = int_type(dtype)
    c = np.asarray(c, np.float32)
    if c.size == 1:
        v = float(c.reshape(()))
        zp = 0 if it.qmin < 0 else (it.qmin if v >= 0 else it.qmax)
        if v == 0.0:
            return np.full(c.shape, zp, it.numpy_dtype), np.float32(1.0), zp
        steps = (it.qmax - zp) if v > 0 else (zp - it.qmin)
        options = []
        for scale in (np.float32(abs(v) / steps), np.float32(2.0 ** np.ceil(np.log2(abs(v) / steps)))):
            code = int(np.clip(zp + np.rint(v / float(scale)), it.qmin, it.qmax))
            options.append((abs(float(np.float32((code - zp) * scale)) - v), code, scale))
        _, code, scale = min(options, key=lambda o: o[0])
        return np.full(c.shape, code, it.numpy_dtype), np.float32(scale), zp
    scale_arr, zp_arr = compute_qparams(np.float32(c.min()), np.float32(c.max()), dtype, symmetric=False)
    scale = np.float32(scale_arr)
    return quantize(c, scale, zp_arr), scale, int(zp_arr)


def _hard_sigmoids_as_add(graph: ir.Graph, plan: QuantPlan, result: LoweringResult, const: Any, namer: _Namer,
                          values: dict[str, ir.Value]) -> dict[str, float]:
    """Rewrite every quantized ``HardSigmoid(x; a, b)`` as ``Add(x, b/a)`` in place (same node, same output
    value), or fold it into the Conv / Gemm before it (``plan.folded_gates``: the layer's bias grows by
    ``b/a``, the node goes, ``values`` maps the gate's tensor to the layer's output); returns
    ``tensor -> scale of its QuantizeLinear`` (``s/a``, the consumers keep ``s``).

    Math: with the zero point at the grid minimum ``z``, ``Q(x + b/a; s/a, z)`` saturates exactly where
    ``a*x + b`` leaves ``[0, 1]`` (``255 * s <= 1``, rule 4 of :mod:`quantkit.lowering.select`), and
    ``DQ(q; s, z) = a * DQ(q; s/a, z)``: the codes are those of ``Q(HardSigmoid(x); s, z)``."""
    q_scales: dict[str, float] = {}
    for node in list(graph):
        folded = (node.name or "") in plan.folded_gates
        if node.op_type != "HardSigmoid" or node.domain not in ("", "ai.onnx") or not (
                node.name in plan.layers or folded):
            continue
        out = node.outputs[0]
        tp = result.tensors.get(out.name or "")
        if tp is None:
            raise CalibrationError(f"HardSigmoid {node.name!r}: its output {out.name!r} has no quantization parameters")
        a_attr, b_attr = node.attributes.get("alpha"), node.attributes.get("beta")
        alpha = np.float32(a_attr.as_float() if a_attr is not None else 0.2)
        beta = np.float32(b_attr.as_float() if b_attr is not None else 0.5)
        q_scale = float(np.float32(np.float64(tp.scale) / np.float64(alpha)))
        if folded:
            x = node.inputs[0]
            layer = x.producer() if x is not None else None
            if x is None or layer is None or layer.name not in plan.layers:
                raise CalibrationError(f"HardSigmoid {node.name!r} is planned folded but its layer is not int8")
            spec = WEIGHTED[layer.op_type]
            w = constant_array(layer.inputs[spec.weight_input])
            assert w is not None and spec.bias_input is not None
            tb = layer.attributes.get("transB")
            n = int(w.shape[0] if layer.op_type == "Conv" or (tb is not None and tb.as_int() == 1) else w.shape[1])
            shift = np.full(n, -np.float64(beta) / np.float64(alpha))
            _apply_bias_shift(graph, layer, spec.bias_input, shift, const)
            name = out.name or ""
            out.replace_all_uses_with(x)
            graph.remove(node, safe=True)
            x.name = namer(f"{x.name}_plus_{node.name}_offset")  # it now holds a*x + b (scaled), not x
            values[name] = x
            q_scales[name] = q_scale
            result.notes[layer.name or ""] = (
                f"HardSigmoid {node.name!r} folded: bias + {float(beta / alpha):g}, output Q scale {q_scale:.4g} read "
                f"with scale {tp.scale:.4g} (Q's saturation is the clip; no node)")
            continue
        offset = const(f"{node.name}_offset", np.array(np.float64(beta) / np.float64(alpha), np.float32))
        node.op_type = "Add"
        node.attributes.clear()
        node.resize_inputs(2)
        node.replace_input_with(1, offset)
        name = out.name or ""
        out.name = namer(f"{name}_plus_offset")  # it holds x + b/a; the gate's name goes to its dequantized value
        values[name] = out
        q_scales[name] = q_scale
        result.notes[node.name or ""] = (
            f"HardSigmoid emitted as Add(x, {float(beta / alpha):g}) -> Q(scale {tp.scale / float(alpha):.4g}), read with "
            f"scale {tp.scale:.4g} (QLinearAdd; Q's saturation is the clip)")
    return q_scales


def _batchnorm_shifts_as_add(graph: ir.Graph, plan: QuantPlan, result: LoweringResult, const: Any) -> None:
    """Rewrite every quantized ``BatchNormalization`` - an exact per-channel shift ``x + B``
    (:func:`quantkit.ops.batchnorm_shift`) - as ``Add(x, B)`` in place (same node, same output),
    ``B`` broadcast along axis 1; its constant is then quantized like any glue constant (``QLinearAdd``)."""
    from quantkit.ops import batchnorm_shift

    for node in list(graph):
        if node.op_type != "BatchNormalization" or node.name not in plan.layers:
            continue
        b = batchnorm_shift(node)
        x = node.inputs[0]
        rank = len(x.shape) if x is not None and x.shape is not None else None
        if b is None or rank is None or rank < 2:
            raise CalibrationError(f"BatchNormalization {node.name!r} is planned int8 but is not an exact shift of "
                                   "known rank")
        shift = const(f"{node.name}_shift", b.reshape(1, -1, *([1] * (rank - 2))).astype(np.float32))
        node.op_type = "Add"
        node.attributes.clear()
        node.resize_inputs(2)
        node.replace_input_with(1, shift)
        result.notes[node.name or ""] = "pre-activation BatchNormalization (exact per-channel shift) emitted as Add " \
                                        "(QLinearAdd)"


def _quantize_glue_constants(graph: ir.Graph, plan: QuantPlan, result: LoweringResult, namer: _Namer,
                             const: Any) -> None:
    """Give every float constant operand of a quantized ``Add`` / ``Mul`` an integer initializer and a
    DequantizeLinear of its own, on the grid type of the node's activation input."""
    for node in list(graph):
        if node.op_type not in ("Add", "Mul") or node.name not in plan.layers:
            continue
        acts = [result.tensors[v.name or ""] for v in node.inputs if v is not None and (v.name or "") in result.tensors]
        dtype = acts[0].dtype if acts else "uint8"
        for idx, v in enumerate(list(node.inputs)):
            c = constant_array(v) if v is not None and (v.name or "") not in result.tensors else None
            if c is None or c.dtype != np.float32:
                continue
            codes, scale, zp = quantized_constant(c, dtype)
            base = f"{node.name}_const{idx}"
            it = int_type(dtype)
            dq = ir.node(
                "DequantizeLinear",
                [const(f"{base}_quantized", codes), const(f"{base}_scale", np.array(scale, np.float32)),
                 const(f"{base}_zero_point", np.array(zp, it.numpy_dtype))],
                name=namer(f"{base}_DequantizeLinear"), outputs=[ir.Value(name=namer(f"{base}_dequantized"))],
            )
            graph.insert_before(node, dq)
            node.replace_input_with(idx, dq.outputs[0])
            err = float(np.max(np.abs(dequantize(codes, scale, zp) - c)))
            prev = result.notes.get(node.name or "")
            result.notes[node.name or ""] = (prev + "; " if prev else "") + (
                f"constant input {idx} stored as {dtype} (scale {float(scale):.4g}, max error {err:.3g})")


def _insert_activation_qdq(graph: ir.Graph, plan: QuantPlan, result: LoweringResult, namer: _Namer,
                           const: Any, values: dict[str, ir.Value], q_scales: Mapping[str, float] | None = None,
                           ) -> None:
    """One QuantizeLinear per planned tensor and a DequantizeLinear per consumer (see the module doc);
    ``q_scales``: tensors whose QuantizeLinear has another scale than their DequantizeLinears (a relabel).
    A rescale's output reuses its input's QuantizeLinear, and the rescale node is removed."""
    q_outs: dict[str, ir.Value] = {}
    rescale_nodes: list[ir.Node] = []
    for name, tp in result.tensors.items():
        found = values.get(name)
        if found is None:
            raise CalibrationError(f"planned tensor {name!r} is not in the graph")
        v = found
        it = int_type(tp.dtype)
        scale_v = const(f"{name}_scale", np.array(tp.scale, dtype=np.float32))
        zp_v = const(f"{name}_zero_point", np.array(tp.zero_point, dtype=it.numpy_dtype))
        producer = v.producer()
        rescale = producer is not None and (producer.name or "") in plan.rescales
        producer_quantized = producer is not None and (
            producer.name in plan.layers or rescale or _folded(producer, plan))
        # readers inside a subgraph (an If / Loop / Scan body reading an outer value) keep the float value: the
        # DequantizeLinear would have to live in that subgraph, and its layers are not planned
        uses = [u for u in v.uses() if u.node.graph is graph]
        readers = [u for u in uses if (producer_quantized or u.node.name in plan.layers)
                   and (u.node.name or "") not in plan.rescales]
        if rescale:
            assert producer is not None
            src = plan.tensors[name].inherit_from or ""
            if src not in q_outs or v.is_graph_output():
                raise CalibrationError(f"rescale {producer.name!r}: its input {src!r} is not quantized")
            q_out = q_outs[src]
            rescale_nodes.append(producer)
        else:
            q_scale_v = scale_v
            if name in (q_scales or {}):
                q_scale_v = const(f"{name}_quantize_scale", np.array((q_scales or {})[name], dtype=np.float32))
            q_node = ir.node(
                "QuantizeLinear", [v, q_scale_v, zp_v], name=namer(f"{name}_QuantizeLinear"),
                outputs=[ir.Value(name=namer(f"{name}_quantized"))],
            )
            if producer is not None:
                graph.insert_after(producer, q_node)
            else:
                graph.insert_before(next(iter(graph)), q_node)
            q_out = q_node.outputs[0]
        q_outs[name] = q_out
        per_channel_dq: dict[tuple[int, int], tuple[ir.Value, ir.Value]] = {}
        # a relabelled tensor's value no longer holds it (an Add's or a layer's output, before the clip): its
        # name goes to the first dequantized copy, so what the float graph calls it is still found by name
        keep_name = name if name in (q_scales or {}) and v.name != name else None
        for use in readers:
            consumer, idx = use.node, use.idx
            dq_inputs, dq_attrs = [q_out, scale_v, zp_v], {}
            float_reader = None if consumer.name in plan.layers else float_weighted_reader(consumer, idx)
            if float_reader is not None:
                # A float Conv/Gemm reading a per-tensor DQ: give it a per-axis DQ (same scale and zero
                # point in every channel, bit-identical) so ORT's WeightBiasQuantization leaves it float.
                axis, n = float_reader
                if (axis, n) not in per_channel_dq:
                    per_channel_dq[(axis, n)] = (
                        const(f"{name}_scale_per_channel", np.full(n, tp.scale, np.float32)),
                        const(f"{name}_zero_point_per_channel", np.full(n, tp.zero_point, it.numpy_dtype)),
                    )
                dq_inputs = [q_out, *per_channel_dq[(axis, n)]]
                dq_attrs = {"axis": axis}
                result.notes[consumer.name or ""] = (
                    f"stays float: reads {name} through a per-channel DequantizeLinear (ONNX Runtime would "
                    "otherwise quantize its weight per tensor)"
                )
            dq = ir.node(
                "DequantizeLinear", dq_inputs, attributes=dq_attrs, name=namer(f"{name}_DequantizeLinear"),
                outputs=[ir.Value(name=keep_name or namer(f"{name}_dequantized"))],
            )
            keep_name = None
            graph.insert_before(consumer, dq)
            consumer.replace_input_with(idx, dq.outputs[0])
        if v.is_graph_output() and producer_quantized:
            dq = ir.node(
                "DequantizeLinear", [q_out, scale_v, zp_v],
                name=namer(f"{name}_DequantizeLinear_output"), outputs=[ir.Value(name=None)],
            )
            q_prod = q_out.producer()
            assert q_prod is not None
            graph.insert_after(q_prod, dq)
            for i, out in enumerate(graph.outputs):
                if out is v:
                    v.name = namer(f"{name}_prequant")
                    dq.outputs[0].name = name
                    dq.outputs[0].type = v.type
                    dq.outputs[0].shape = v.shape
                    graph.outputs[i] = dq.outputs[0]
    for node in rescale_nodes:  # every reader now reads the source's codes through its own DQ
        if list(node.outputs[0].uses()) or node.outputs[0].is_graph_output():
            raise CalibrationError(f"rescale {node.name!r}: its output still has float readers")
        graph.remove(node, safe=True)


def _pair_safe(node: ir.Node, lp: Any, w: np.ndarray, wq: np.ndarray, w_scale: Any, w_zp: Any,
               hessian: Any,
               pair_cache: dict[tuple[str, bytes], tuple[np.ndarray, np.ndarray, int]] | None,
               ) -> tuple[np.ndarray, Any, int]:
    """The layer's int8 codes rounded to the int16 pair bound (memoised per layer and weight scale)."""
    memo_key = (node.name or "", np.asarray(w_scale, np.float32).tobytes() + np.asarray(w_zp).tobytes())
    if pair_cache is not None and memo_key in pair_cache:
        return pair_cache[memo_key]
    g = node.attributes.get("group")
    tb = node.attributes.get("transB")
    it_w = int_type(lp.weight_dtype)
    out = pair_safe_weight(
        w, wq, np.asarray(w_scale), np.asarray(w_zp), op_type=node.op_type,
        trans_b=tb is not None and tb.as_int() == 1, group=g.as_int() if g is not None else 1,
        qmin=max(it_w.qmin, -127) if lp.weight_symmetric else it_w.qmin, qmax=it_w.qmax, hessian=hessian,
    )
    if pair_cache is not None:
        pair_cache[memo_key] = out
    return out


def _lower_weights(graph: ir.Graph, plan: QuantPlan, result: LoweringResult, namer: _Namer, const: Any,
                   act_inputs: dict[str, str],
                   input_means: Mapping[str, np.ndarray] | None, target: Target | None,
                   hessians: Mapping[str, Any] | None,
                   pair_cache: dict[tuple[str, bytes], tuple[np.ndarray, np.ndarray, int]] | None) -> None:
    """Integer weights (per channel, pair-safe for saturating targets) and int32 biases of every planned
    weighted layer, read through DequantizeLinear; bias correction when ``input_means`` are given."""
    weight_cache: dict[int, tuple[ir.Value, ir.Value, ir.Value, int, np.ndarray, np.ndarray]] = {}
    for node in list(graph):
        lp = plan.layers.get(node.name or "")
        if lp is None or node.op_type not in WEIGHTED:
            continue
        spec_w = WEIGHTED[node.op_type]
        w_val = node.inputs[spec_w.weight_input]
        assert w_val is not None
        w = constant_array(w_val)
        assert w is not None
        if node.op_type == "Conv":
            axis = 0
        elif node.op_type == "Gemm":
            tb = node.attributes.get("transB")
            axis = 0 if (tb is not None and tb.as_int() == 1) else 1
        else:
            axis = 1
        per_channel = lp.weight_granularity == "channel"
        key = id(w_val)
        if key not in weight_cache:
            spec = QuantSpec(
                dtype=lp.weight_dtype, symmetric=lp.weight_symmetric,
                granularity="channel" if per_channel else "tensor", axis=axis if per_channel else None,
                narrow=True,  # weights: [-127, 127] grid, the largest weight exact (see compute_qparams)
            )
            w_scale, w_zp = weight_qparams(w, spec)
            w_scale = _bias_safe_scale(node, spec_w.bias_input, w_scale, result.tensors.get(act_inputs.get(node.name or "", "")))
            wq = quantize(w, w_scale, w_zp, axis=axis if per_channel else None)
            n_safe = 0
            if target is not None and target.pair_safe and lp.weight_dtype == "int8":
                wq, w_scale, n_safe = _pair_safe(node, lp, w, wq, w_scale, w_zp, (hessians or {}).get(node.name or ""),
                                                 pair_cache)
                if n_safe:  # after any note an earlier pass left on this layer (a HardSigmoid folded into it)
                    prev = result.notes.get(node.name or "")
                    result.notes[node.name or ""] = (prev + "; " if prev else "") + (
                        f"{n_safe} output channel(s) rounded to the int16 pair bound (exact on x86 without VNNI)"
                    )
            base = w_val.name or node.name or "weight"
            wq_v = const(f"{base}_quantized", wq)
            ws_v = const(f"{base}_scale", np.asarray(w_scale, dtype=np.float32))
            wz_v = const(f"{base}_zero_point", np.asarray(w_zp, dtype=wq.dtype))
            deq = dequantize(wq, w_scale, w_zp, axis=axis if per_channel else None)
            weight_cache[key] = (wq_v, ws_v, wz_v, axis, np.asarray(w_scale, np.float32), deq)
            zr = np.asarray(w_zp)
            result.weights[node.name or ""] = WeightParams(
                layer=node.name or "", dtype=lp.weight_dtype, symmetric=lp.weight_symmetric,
                axis=axis if per_channel else None,
                scale_min=float(np.min(w_scale)), scale_max=float(np.max(w_scale)),
                zero_point_range=(int(zr.min()), int(zr.max())), weight_sqnr_db=_sqnr_db(w, deq),
                pair_safe_channels=n_safe,
            )
        wq_v, ws_v, wz_v, axis, w_scale_arr, w_hat = weight_cache[key]
        attrs = {"axis": axis} if w_scale_arr.ndim == 1 else {}
        shift = None
        if input_means is not None and (node.name or "") in input_means:
            g = node.attributes.get("group")
            tb = node.attributes.get("transB")
            shift = bias_shift(node.op_type, w, w_hat, input_means[node.name or ""],
                               group=g.as_int() if g is not None else 1, trans_b=tb is not None and tb.as_int() == 1)
            if shift is not None:
                _apply_bias_shift(graph, node, spec_w.bias_input, shift, const)
                prev = result.notes.get(node.name or "")
                result.notes[node.name or ""] = (prev + "; " if prev else "") + (
                    f"bias corrected: |shift| mean {float(np.mean(np.abs(shift))):.3g}, max {float(np.max(np.abs(shift))):.3g}"
                )
        dq = ir.node(
            "DequantizeLinear", [wq_v, ws_v, wz_v], attributes=attrs,
            name=namer(f"{node.name}_weight_DequantizeLinear"), outputs=[ir.Value(name=namer(f"{w_val.name}_dequantized"))],
        )
        graph.insert_before(node, dq)
        node.replace_input_with(spec_w.weight_input, dq.outputs[0])

        if spec_w.bias_input is not None and len(node.inputs) > spec_w.bias_input:
            b_val = node.inputs[spec_w.bias_input]
            b = constant_array(b_val)
            x_params = result.tensors.get(act_inputs.get(node.name or "", ""))
            if b is not None and b_val is not None and x_params is not None:
                ws = w_scale_arr if w_scale_arr.ndim == 1 else np.full(b.shape, w_scale_arr, np.float32)
                b_scale = (np.float32(x_params.scale) * ws).astype(np.float32)
                bq = bias_int32(b, np.float32(x_params.scale), ws)
                bq_v = const(f"{b_val.name or node.name}_quantized", bq)
                bs_v = const(f"{b_val.name or node.name}_scale", np.asarray(b_scale, np.float32))
                bz_v = const(f"{b_val.name or node.name}_zero_point", np.zeros(bq.shape, np.int32))
                bdq = ir.node(
                    "DequantizeLinear", [bq_v, bs_v, bz_v], attributes={"axis": 0},
                    name=namer(f"{node.name}_bias_DequantizeLinear"),
                    outputs=[ir.Value(name=namer(f"{b_val.name}_dequantized"))],
                )
                graph.insert_before(node, bdq)
                node.replace_input_with(spec_w.bias_input, bdq.outputs[0])


# Room left in the int32 accumulator of QLinearConv / QGemm beside the bias: 2**30 for the bias, the
# other half for sum(x_q * w_q) (K * 255 * 127 < 2**30 for K < 33000).
_BIAS_INT32_LIMIT = float(2**30)


def _bias_safe_scale(node: ir.Node, bias_input: int | None, w_scale: Any, x_params: TensorParams | None) -> Any:
    """Raise the weight scale of output channels whose int32 bias ``b / (s_x * s_w)`` would not fit.

    BatchNorm folding can leave dead channels with weights ~1e-8 and a large bias: their per-channel
    weight scale is tiny, the int32 bias saturates and - worse - the fused kernel's int32 accumulator
    wraps around, so the kernel and the QDQ math part (seen on EfficientNet-Lite0's stem).  With
    ``s_w >= |b| / (s_x * 2**30)`` the bias fits with room to spare; the weights of such a channel are
    so small next to its bias that the coarser grid costs nothing measurable."""
    if bias_input is None or x_params is None or len(node.inputs) <= bias_input:
        return w_scale
    b = constant_array(node.inputs[bias_input])
    if b is None:
        return w_scale
    floor = np.abs(b.astype(np.float64)) / (float(x_params.scale) * _BIAS_INT32_LIMIT)
    ws = np.asarray(w_scale, np.float64)
    if ws.ndim == 0:
        return np.asarray(max(float(ws), float(np.max(floor, initial=0.0))), np.float32)
    if floor.shape != ws.shape:
        return w_scale
    return np.maximum(ws, floor).astype(np.float32)


def hessian_requests(model: ir.Model, plan: QuantPlan, max_k: int = 16384) -> dict[str, tuple[str, int, Any]]:
    """``layer -> (input tensor, K, conv geometry)`` of the planned int8 GEMM-like layers whose weight
    pairs pair-constrained GPTQ can use (2-D Conv with one group, Gemm, MatMul; ``K <= max_k``)."""
    from quantkit.calibrate.kernel_hessian import ConvGeometry

    out: dict[str, tuple[str, int, Any]] = {}
    for node in model.graph:
        lp = plan.layers.get(node.name or "")
        if lp is None or node.op_type not in WEIGHTED or lp.weight_dtype != "int8" or node.inputs[0] is None:
            continue
        w = constant_array(node.inputs[WEIGHTED[node.op_type].weight_input])
        if w is None or w.ndim < 2:
            continue
        geo = None
        if node.op_type == "Conv":
            g = node.attributes.get("group")
            if w.ndim != 4 or (g is not None and g.as_int() != 1):
                continue

            def ints(name: str, default: list[int], node: ir.Node = node) -> tuple[int, ...]:
                a = node.attributes.get(name)
                return tuple(a.as_ints()) if a is not None else tuple(default)

            ap = node.attributes.get("auto_pad")
            if ap is not None and ap.as_string() not in ("NOTSET", ""):
                continue
            geo = ConvGeometry(kernel=(int(w.shape[2]), int(w.shape[3])), strides=ints("strides", [1, 1]),  # type: ignore[arg-type]
                               pads=ints("pads", [0, 0, 0, 0]), dilations=ints("dilations", [1, 1]))  # type: ignore[arg-type]
            k = int(w.shape[1] * w.shape[2] * w.shape[3])
        elif node.op_type == "Gemm":
            tb = node.attributes.get("transB")
            k = int(w.shape[1] if tb is not None and tb.as_int() == 1 else w.shape[0])
        else:
            k = int(w.shape[-2])
        if k <= max_k:
            out[node.name or ""] = (node.inputs[0].name or "", k, geo)
    return out


# Ops whose float weights ONNX Runtime (>= 1.20, Level-1 ``WeightBiasQuantization``) quantizes on its own
# when input 0 comes from a DequantizeLinear with a *scalar* scale (and the output reaches a Q).
_AUTO_QUANTIZED_BY_ORT = frozenset({"Conv", "ConvTranspose", "Gemm"})


def float_weighted_reader(node: ir.Node, idx: int) -> tuple[int, int] | None:
    """``(axis, channels)`` of the activation input of a layer that must stay float, else None.

    ONNX Runtime's ``WeightBiasQuantization`` treats ``DQ(per-tensor) -> Conv/ConvTranspose/Gemm``
    with a float32 weight initializer (output into a ``QuantizeLinear``, also through a ``Clip``)
    as a quantized layer whose weight was forgotten: it quantizes that weight to *per-tensor*
    int8 and the bias to int32, and the layer runs as ``QLinearConv``/``QGemm``.  An fp32 override
    inside an int8 chain thus silently became a per-tensor int8 layer (on a depthwise Conv, far
    worse than the per-channel int8 it replaced).  The transformer only fires for a scalar input
    scale, so such a layer gets its own per-axis DQ (one identical scale per channel: exact).
    Returns None when ORT would not touch the node, or when the channel count is 1 (a 1-element
    scale counts as scalar, nothing to gain).
    """
    if idx != 0 or node.op_type not in _AUTO_QUANTIZED_BY_ORT or node.domain not in ("", "ai.onnx"):
        return None
    ins = list(node.inputs)
    w = constant_array(ins[1]) if len(ins) > 1 else None
    if w is None or w.dtype != np.float32:
        return None
    if node.op_type == "Conv":
        g = node.attributes.get("group")
        if w.ndim < 3:
            return None
        axis, n = 1, int(w.shape[1]) * (g.as_int() if g is not None else 1)
    elif node.op_type == "ConvTranspose":
        if w.ndim < 3:
            return None
        axis, n = 1, int(w.shape[0])
    else:  # Gemm: A is [M, K] (or [K, M] with transA)
        if w.ndim != 2:
            return None
        ta, tb = node.attributes.get("transA"), node.attributes.get("transB")
        axis = 0 if ta is not None and ta.as_int() != 0 else 1
        n = int(w.shape[1] if tb is not None and tb.as_int() != 0 else w.shape[0])
    return (axis, n) if n > 1 else None


def _const_dtype(v: ir.Value | None) -> np.dtype | None:
    a = constant_array(v)
    return None if a is None else a.dtype


def fuse_float_output_linears(model: ir.Model, plan: QuantPlan, result: LoweringResult) -> list[str]:
    """Rewrite ``DQ(x_q) -> MatMul(., DQ(W_q)) [-> Add(b)]`` with a float output into one
    ``com.microsoft.MatMulIntegerToFloat(x_q, W_q, s_x, s_w, zp_x, zp_w, b)``.

    Math: ``y = s_x * s_w[n] * sum_k (x_q[k] - zp_x) (W_q[k, n] - zp_w[n]) + b[n]`` - exactly what
    the QDQ form computes, in one kernel.  Measured on ORT 1.32 (``eval/probes/linear_forms.py``):
    the QDQ form fuses the MatMul but leaves the bias ``Add`` separate, and when the input shapes
    are static ORT's ``MatMulAddFusion`` turns it into a float Gemm that dequantizes the weight on
    every run (~20x slower); this form is 3-13% faster and immune to that.  Only for uint8
    activations (int8 ones run ~6x slower in this kernel).  Returns the rewritten layer names.
    """
    graph = model.graph
    done: list[str] = []
    for node in list(graph):
        lp = plan.layers.get(node.name or "")
        if lp is None or node.op_type != "MatMul" or (node.outputs[0].name or "") in result.tensors:
            continue
        x_in, w_in = node.inputs[0], node.inputs[1]
        x_dq = x_in.producer() if x_in is not None else None
        w_dq = w_in.producer() if w_in is not None else None
        if x_dq is None or w_dq is None or x_dq.op_type != "DequantizeLinear" or w_dq.op_type != "DequantizeLinear":
            continue
        if _const_dtype(x_dq.inputs[2]) != np.uint8 or len(list(x_in.uses())) != 1:  # type: ignore[union-attr]
            continue
        out = node.outputs[0]
        bias = None
        final = out
        users = list(out.uses())
        if len(users) == 1 and users[0].node.op_type == "Add" and not out.is_graph_output():
            add = users[0].node
            other = add.inputs[1 - users[0].idx]
            b = constant_array(other)
            n = constant_array(w_dq.inputs[0])
            if b is not None and n is not None and b.dtype == np.float32 and b.ndim == 1 and b.shape[0] == n.shape[1]:
                bias, final = other, add.outputs[0]
        inputs = [x_dq.inputs[0], w_dq.inputs[0], x_dq.inputs[1], w_dq.inputs[1], x_dq.inputs[2], w_dq.inputs[2]]
        if bias is not None:
            inputs.append(bias)
        new = ir.node(
            "MatMulIntegerToFloat", inputs, domain="com.microsoft", name=node.name,
            outputs=[ir.Value(name=None, type=final.type, shape=final.shape)],
        )
        graph.insert_before(node, new)
        was_output = final.is_graph_output()
        final.replace_all_uses_with(new.outputs[0], replace_graph_outputs=True)
        if was_output:
            for i, o in enumerate(graph.outputs):
                if o is final:
                    graph.outputs[i] = new.outputs[0]
        name = final.name
        final.name = None
        new.outputs[0].name = name
        dead = [node] + ([final.producer()] if bias is not None else []) + [x_dq]
        graph.remove([d for d in dead if d is not None], safe=True)
        if not list(w_dq.outputs[0].uses()):
            graph.remove(w_dq, safe=True)
        done.append(node.name or "")
    if done:
        model.opset_imports.setdefault("com.microsoft", 1)
    return done


def _apply_bias_shift(graph: ir.Graph, node: ir.Node, bias_input: int | None, shift: np.ndarray, const: Any) -> None:
    """Subtract ``shift`` from the layer's float bias (creating one for a bias-less Conv/Gemm, or
    using the constant ``Add`` that follows a MatMul); the int32 quantization comes after."""
    if bias_input is not None:
        ins = list(node.inputs)
        cur = constant_array(ins[bias_input]) if len(ins) > bias_input and ins[bias_input] is not None else None
        base = np.zeros(shift.shape, np.float32) if cur is None else cur.astype(np.float64)
        if base.shape != shift.shape:
            return
        new = const(f"{node.name}_bias_corrected", (base - shift).astype(np.float32))
        if len(ins) <= bias_input:
            node.resize_inputs(bias_input + 1)
        node.replace_input_with(bias_input, new)
        return
    users = list(node.outputs[0].uses())
    if len(users) == 1 and users[0].node.op_type == "Add":
        add, idx = users[0].node, 1 - users[0].idx
        cur = constant_array(add.inputs[idx])
        if cur is not None and cur.shape == shift.shape:
            add.replace_input_with(idx, const(f"{node.name}_bias_corrected", (cur - shift).astype(np.float32)))


def _folded(node: ir.Node, plan: QuantPlan) -> bool:
    """Whether ``node`` is a Relu/Clip folded into a quantized producer's output."""
    if node.op_type not in ("Relu", "Clip") or node.inputs[0] is None:
        return False
    p = node.inputs[0].producer()
    return p is not None and p.name in plan.layers and len(list(node.inputs[0].uses())) == 1


_LAYOUT_OPS = ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten")
"""Ops that only move elements: on a per-tensor grid they commute with QuantizeLinear (:func:`_layout_on_codes`)."""


def _same_grid(dq: ir.Node, q: ir.Node) -> bool:
    """``dq`` and ``q`` use one per-tensor grid: equal scalar scales, equal zero points of one type."""
    if len(dq.inputs) < 2 or len(q.inputs) < 2 or dq.attributes.get("axis") is not None \
            or q.attributes.get("axis") is not None or q.attributes.get("output_dtype") is not None:
        return False
    s1, s2 = constant_array(dq.inputs[1]), constant_array(q.inputs[1])
    z1 = constant_array(dq.inputs[2]) if len(dq.inputs) > 2 else None
    z2 = constant_array(q.inputs[2]) if len(q.inputs) > 2 else None
    if s1 is None or s2 is None or s1.size != 1 or s2.size != 1 or float(s1.reshape(())) != float(s2.reshape(())):
        return False
    if z1 is None or z2 is None:
        return z1 is None and z2 is None
    return z1.dtype == z2.dtype and z1.size == 1 and z2.size == 1 and int(z1.reshape(())) == int(z2.reshape(()))


def _layout_on_codes(graph: ir.Graph) -> int:
    """``DequantizeLinear -> Transpose / Reshape / ... -> QuantizeLinear`` on one per-tensor grid becomes the layout
    op on the 8-bit codes (exact: moving elements commutes with quantizing them); returns how many.  ONNX Runtime
    would drop the pair itself in its QDQ pass - but its level-1 transpose optimizer runs first and can move the
    ``Transpose`` out of the group (to cancel it against another), leaving a DequantizeLinear -> QuantizeLinear pair
    behind that nothing fuses (FocalNet's modulation, MaxViT's grid attention)."""
    done = 0
    for node in list(graph):
        if node.op_type not in _LAYOUT_OPS or node.domain not in ("", "ai.onnx") or not node.inputs \
                or node.inputs[0] is None or len(node.outputs) != 1:
            continue
        x, out = node.inputs[0], node.outputs[0]
        dq = x.producer()
        if dq is None or dq.op_type != "DequantizeLinear" or len(x.uses()) != 1 or x.is_graph_output():
            continue
        uses = list(out.uses())
        if len(uses) != 1 or out.is_graph_output():
            continue
        q = uses[0].node
        if q.op_type != "QuantizeLinear" or q.graph is not graph or q.outputs[0].is_graph_output() \
                or not _same_grid(dq, q) or dq.inputs[0] is None:
            continue
        codes_out = q.outputs[0]
        name, codes_type = codes_out.name, codes_out.type or dq.inputs[0].type
        node.replace_input_with(0, dq.inputs[0])
        out.type = codes_type  # the codes' element type (the float annotation would fail the model's load)
        codes_out.replace_all_uses_with(out, replace_graph_outputs=False)
        graph.remove(q, safe=True)
        graph.remove(dq, safe=True)
        out.name = name
        done += 1
    return done


def _q_max_value(q: ir.Node) -> float | None:
    """The largest value a per-tensor QuantizeLinear's grid represents, or None (not per-tensor / not constant)."""
    if len(q.inputs) < 3 or q.attributes.get("axis") is not None:
        return None
    s, z = constant_array(q.inputs[1]), constant_array(q.inputs[2])
    if s is None or z is None or s.size != 1 or z.size != 1:
        return None
    return float(s.reshape(())) * float(int(np.iinfo(z.dtype).max) - int(z.reshape(())))


def _relus_on_codes(graph: ir.Graph) -> int:
    """``DequantizeLinear -> Relu / Clip(0, hi) -> QuantizeLinear`` on two per-tensor grids becomes
    ``DQ -> LeakyRelu(alpha=0) -> Q``, which ONNX Runtime fuses into ``QLinearLeakyRelu`` (a 256-entry table on the
    codes, one pass); returns how many (select rule 12).  ONNX Runtime removes a Relu before a QuantizeLinear whose
    zero point is the grid minimum - right when the DQ and Q share a grid, but between two grids it leaves a
    DequantizeLinear -> QuantizeLinear requantization that nothing fuses (a stray round trip).  ``Clip(0, hi)``
    qualifies only when the Q's grid ends at or below ``hi`` (its saturation is the upper bound)."""
    done = 0
    for node in list(graph):
        if node.op_type not in ("Relu", "Clip") or node.domain not in ("", "ai.onnx") or not node.inputs \
                or node.inputs[0] is None or len(node.outputs) != 1 or node.outputs[0].is_graph_output():
            continue
        dq = node.inputs[0].producer()
        uses = list(node.outputs[0].uses())
        if dq is None or dq.op_type != "DequantizeLinear" or len(uses) != 1:
            continue
        q = uses[0].node
        if q.op_type != "QuantizeLinear" or q.graph is not graph or _q_max_value(q) is None \
                or _q_max_value(dq) is None or _same_grid(dq, q) or _const_dtype(dq.inputs[2]) != _const_dtype(
                    q.inputs[2]):  # QLinearLeakyRelu reads and writes one code type
            continue
        bounds = clip_bounds(node)  # Relu: (0, inf)
        if bounds is None or bounds[0] != 0.0 or (_q_max_value(q) or 0.0) > bounds[1] * (1.0 + 1e-6):
            continue
        relu = ir.node("LeakyRelu", [node.inputs[0]], attributes={"alpha": 0.0}, name=node.name,
                       outputs=[ir.Value(name=None, type=node.outputs[0].type, shape=node.outputs[0].shape)])
        graph.insert_before(node, relu)
        name = node.outputs[0].name
        node.outputs[0].replace_all_uses_with(relu.outputs[0], replace_graph_outputs=False)
        graph.remove(node, safe=True)
        relu.outputs[0].name = name
        done += 1
    return done


_SHAPE_OPS = ("Shape", "Size")
"""Ops that read only a tensor's shape: the 8-bit codes have the float tensor's shape (:func:`_shape_on_codes`)."""


def _shape_on_codes(graph: ir.Graph) -> int:
    """A ``DequantizeLinear`` read only by ``Shape`` / ``Size`` nodes is dropped: they read its 8-bit codes instead
    (exact: dequantizing keeps the shape); returns how many.  ONNX Runtime cannot drop such a DQ itself with a
    dynamic axis, so it dequantized a whole activation to learn its shape (FocalNet: 12 of the 51 DQ nodes in its
    optimized graph, PoolFormer 4 of 30)."""
    done = 0
    for dq in list(graph):
        if dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx") or not dq.inputs \
                or dq.inputs[0] is None or len(dq.outputs) != 1 or dq.outputs[0].is_graph_output():
            continue
        out = dq.outputs[0]
        uses = list(out.uses())
        if not uses or any(u.node.op_type not in _SHAPE_OPS or u.node.domain not in ("", "ai.onnx")
                           or u.node.graph is not graph for u in uses):
            continue
        out.replace_all_uses_with(dq.inputs[0], replace_graph_outputs=False)
        graph.remove(dq, safe=True)
        done += 1
    return done


def _drop_unused_initializers(graph: ir.Graph) -> None:
    graph_inputs = {id(v) for v in graph.inputs}
    for name in list(graph.initializers):
        v = graph.initializers[name]
        if not list(v.uses()) and id(v) not in graph_inputs and not v.is_graph_output():
            del graph.initializers[name]
