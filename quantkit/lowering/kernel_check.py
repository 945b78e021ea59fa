"""Kernel-exact verification: do ONNX Runtime's fused int8 kernels compute what the QDQ math says?

A fused graph is not yet a right one.  On x86 CPUs without VNNI the u8 x s8 kernels add product pairs
in saturating int16 (:mod:`quantkit.scheme.saturation`), so the same model can be right on one machine
and wrong on another.  Two checks, both on the emitted ONNX model:

* :func:`portability` — from the weights alone: for every int8 GEMM-like layer (QLinearConv / QGemm /
  QLinearMatMul / MatMulInteger(ToFloat) / DynamicQuantizeMatMul after fusion), the weight pairs in
  the kernel's K order that some uint8 activation can push out of int16.  A model without such pairs
  is exact on every CPU class, for every input; one with them is exact only on VNNI / ARM.
* :func:`kernel_vs_reference` — on data: the model run as users will (``ORT_ENABLE_ALL``: the fused
  kernels of *this* CPU) against the QDQ reference (``ORT_DISABLE_ALL``: DequantizeLinear -> float op
  -> QuantizeLinear, the math the model states).  Every quantized activation is exposed in both runs;
  the first one whose codes part (SQNR of kernel vs reference below ``part_db``) names the layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import numpy_helper

from quantkit.scheme.saturation import (
    PAIR_LIMIT,
    conv_saturation_excess,
    exact_int_matmul,
    is_depthwise,
    kernel_view,
    pair_violations,
    saturation_excess,
)
from quantkit.scheme.target import CPU_CLASSES, cpu_class_saturates

if TYPE_CHECKING:
    from quantkit.staging import StagedModel

__all__ = ["KernelCheck", "PairRisk", "emulate_saturation", "energies", "with_outputs", "kernel_vs_reference", "pair_risks", "portability"]

_DIRECT_INT8 = {"MatMulInteger": 1, "MatMulIntegerToFloat": 1, "DynamicQuantizeMatMul": 1,
                # QOperator-format models (ONNX Runtime's quantize_static with QuantFormat.QOperator)
                "QLinearConv": 3, "ConvInteger": 1, "QGemm": 3, "QLinearMatMul": 3}  # fmt: skip
_EMULATED_DIRECT = ("MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul")
"""The direct int8 ops :func:`emulate_saturation` emulates (activation codes input 0, weight input 1, a MatMul)."""
_VIEW_KIND = {"QLinearConv": "Conv", "ConvInteger": "Conv", "QGemm": "Gemm"}
"""The kernel layout of a direct int8 op's weight (:func:`quantkit.scheme.saturation.kernel_view`); others: MatMul."""
_QDQ_WEIGHTED = {"Conv": 1, "Gemm": 1, "MatMul": 1}


@dataclass(frozen=True)
class PairRisk:
    """One int8 layer's weight pairs against the int16 bound (kernel K order)."""

    layer: str
    op_type: str
    pairs: int
    at_risk: int  # pairs some uint8 activation saturates on x86 without VNNI
    worst_pair_sum: int  # max |q0 + q1| over same-sign pairs (<= 128 is safe)

    def as_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "op": self.op_type, "pairs": self.pairs, "at_risk": self.at_risk,
                "worst_pair_sum": self.worst_pair_sum}


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return default


def pair_risks(model: onnx.ModelProto) -> list[PairRisk]:
    """Every layer of ``model`` that ONNX Runtime runs as a u8 x s8 GEMM, with its weight pairs."""
    inits = {t.name: t for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    out: list[PairRisk] = []

    def int8_init(name: str) -> np.ndarray | None:
        t = inits.get(name)
        if t is None or t.data_type != onnx.TensorProto.INT8:
            return None
        return numpy_helper.to_array(t)

    for node in model.graph.node:
        q = None
        if node.op_type in _DIRECT_INT8 and node.domain in ("", "com.microsoft") and len(node.input) > 1:
            q = int8_init(node.input[_DIRECT_INT8[node.op_type]])
        elif node.op_type in _QDQ_WEIGHTED and len(node.input) > 1:
            wdq, xdq = producer.get(node.input[1]), producer.get(node.input[0])
            if (wdq is not None and wdq.op_type == "DequantizeLinear" and xdq is not None
                    and xdq.op_type == "DequantizeLinear"):
                q = int8_init(wdq.input[0])
        if q is None or q.ndim < 2:
            continue
        group = _attr(node, "group", 1)
        kind = _VIEW_KIND.get(node.op_type, node.op_type)
        if kind == "Conv" and is_depthwise(tuple(q.shape), group):
            continue  # MLAS's depthwise kernel accumulates in int32: exact
        view = kernel_view(q, kind, trans_b=_attr(node, "transB", 0) == 1, group=group)
        bad = pair_violations(view)
        k = view.shape[-2]
        p = view.astype(np.int32)
        if k % 2:
            p = np.concatenate([p, np.zeros((*p.shape[:-2], 1, p.shape[-1]), np.int32)], axis=-2)
        p = p.reshape(*p.shape[:-2], -1, 2, p.shape[-1])
        worst = int(max(np.maximum(p, 0).sum(axis=-2).max(initial=0), -np.minimum(p, 0).sum(axis=-2).min(initial=0)))
        out.append(PairRisk(node.name, node.op_type, int(bad.size), int(bad.sum()), worst))
    return out


def portability(model: onnx.ModelProto, risks: list[PairRisk] | None = None) -> dict[str, Any]:
    """Per CPU class: is the model's int8 arithmetic exact there for every input (from its weights)?"""
    risks = pair_risks(model) if risks is None else risks
    risky = [r for r in risks if r.at_risk]
    table = {}
    for cls in CPU_CLASSES:
        if cpu_class_saturates(cls):
            table[cls] = {
                "exact": not risky,
                "why": (f"all {len(risks)} int8 GEMM layers obey the int16 pair bound (|q0+q1| <= {PAIR_LIMIT})"
                        if not risky else
                        f"{len(risky)} of {len(risks)} int8 GEMM layers have weight pairs that saturate int16 "
                        f"(first: {risky[0].layer}, {risky[0].at_risk} pairs, worst |q0+q1| = "
                        f"{risky[0].worst_pair_sum})"),
            }
        else:
            table[cls] = {"exact": True, "why": "int8 products accumulate in int32"}
    return {"classes": table, "layers_at_risk": [r.as_dict() for r in risky], "int8_gemm_layers": len(risks)}


_CHUNK = 1 << 14  # values per step of energies()


def energies(ref: np.ndarray, got: np.ndarray, zero_point: float | None = None) -> tuple[float, float, int]:
    """``(sum r^2, sum (r - g)^2, count |r - g| > 1)`` over two arrays of the same size, ``r = ref - zero_point``,
    ``g = got - zero_point`` (``zero_point``: the arrays are codes, measured around the quantized 0; the count is of
    codes more than one step apart, 0 without one).

    In cache-sized chunks: each chunk in float32 (codes and their differences are exact there; BLAS dot products
    of 16k values, relative error ~1e-7) and the chunks' sums in float64 - a few times faster than float64
    temporaries the size of the tensor; a chunk whose float32 squares overflow, or of any other type, in float64."""
    x, y = np.asarray(got).ravel(), np.asarray(ref).ravel()
    sig = noise = 0.0
    far = 0
    for lo in range(0, y.size, _CHUNK):
        yc, xc = y[lo : lo + _CHUNK], x[lo : lo + _CHUNK]
        for dt in (np.float32, np.float64):
            r = yc.astype(dt)
            d = np.subtract(r, xc, dtype=dt)
            if zero_point is not None:
                np.subtract(r, zero_point, out=r, dtype=dt)
            with np.errstate(over="ignore"):  # an overflowing float32 chunk is redone in float64
                s, n = float(np.dot(r, r)), float(np.dot(d, d))
            if np.isfinite(s) and np.isfinite(n) or dt is np.float64:
                break
        sig += s
        noise += n
        if zero_point is not None:
            far += int(np.count_nonzero(np.abs(d) > 1))
    return sig, noise, far


@dataclass
class _Agg:
    sig: float = 0.0
    noise: float = 0.0
    far: int = 0  # codes differing by more than 1
    n: int = 0

    def add(self, got: np.ndarray, ref: np.ndarray, zero_point: float | None) -> None:
        sig, noise, far = energies(ref, got, zero_point)
        self.sig += sig
        self.noise += noise
        self.far += far
        self.n += int(np.size(ref))

    @property
    def db(self) -> float:
        return float("inf") if self.noise == 0 else float(10 * np.log10(max(self.sig, 1e-300) / self.noise))


@dataclass
class KernelCheck:
    """What :func:`kernel_vs_reference` found.  ``layers``: per quantized tensor, the layer alone (fed the
    reference's input codes) - ``off`` is the fraction of its codes more than one step from the QDQ
    math; ``drift_db``: the same tensor in the whole-model runs (rounding ties compound with depth)."""

    samples: int = 0
    outputs: dict[str, dict[str, float]] = field(default_factory=dict)
    layers: list[dict[str, Any]] = field(default_factory=list)
    first_parted: dict[str, Any] | None = None
    agree: bool = True
    emulated_avx2: dict[str, float] = field(default_factory=dict)  # layer -> accumulators wrong on x86-avx2

    def as_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "outputs": self.outputs, "first_parted": self.first_parted,
                "agree": self.agree, "layers": self.layers, "emulated_x86_avx2": self.emulated_avx2}


_THROUGH = frozenset({"Relu", "Clip", "LeakyRelu", "DequantizeLinear", "QuantizeLinear"})
"""Nodes between a layer and a QuantizeLinear of its (activated, requantized) output."""


def _quantized_tensors(model: onnx.ModelProto) -> list[tuple[str, str, float]]:
    """(QuantizeLinear output, layer that produced its input, zero point) in graph order.  The layer is found
    through a folded ``Relu`` / ``Clip`` and through a ``DQ -> Relu -> Q`` requantization (select rule 12: a
    ``LeakyRelu`` on the codes) back to the op that made the values - never a DequantizeLinear's name, which no
    recipe override can name."""
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: t for t in model.graph.initializer}
    outs = []
    for n in model.graph.node:
        if n.op_type != "QuantizeLinear" or not n.output:
            continue
        src = producer.get(n.input[0])
        for _ in range(8):  # Relu / Clip / LeakyRelu(0) <- DQ <- Q <- the layer
            if src is None or src.op_type not in _THROUGH or not src.input:
                break
            up = producer.get(src.input[0])
            if up is None:
                break
            src = up
        zp_t = inits.get(n.input[2]) if len(n.input) > 2 else None
        if zp_t is not None:
            zp = float(np.mean(numpy_helper.to_array(zp_t)))
        else:  # a zero point computed at run time (per-token): the grid's midpoint
            zp = 128.0 if len(n.input) > 2 else 0.0
        outs.append((n.output[0], src.name if src is not None else n.input[0], zp))
    return outs


def _float_int8_layers(model: onnx.ModelProto, codes: set[str]) -> list[tuple[str, str]]:
    """(output, layer) of every QDQ MatMul / Gemm that multiplies quantized activation codes by int8 weights
    and hands a *float* result on (no QuantizeLinear after it): after fusion a ``MatMulIntegerToFloat`` /
    ``QGemm`` with float output, whose saturation no code comparison would see."""
    producer = {o: n for n in model.graph.node for o in n.output}
    int8 = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8}
    quantized_after = {n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input}
    out = []
    for n in model.graph.node:
        if n.op_type not in ("MatMul", "Gemm") or len(n.input) < 2 or not n.output:
            continue
        a, w = producer.get(n.input[0]), producer.get(n.input[1])
        if a is None or w is None or a.op_type != "DequantizeLinear" or w.op_type != "DequantizeLinear":
            continue
        if a.input[0] in codes and w.input[0] in int8 and n.output[0] not in quantized_after:
            out.append((n.output[0], n.name or n.output[0]))
    return out


_FLOAT_TOL = 1e-4  # a float-output layer's element is "off" when it differs by more than this x max |reference|
_MAX_LAYER_NODES = 16  # a float-output layer whose isolated subgraph is larger (run-time scales) is not checked


def _direct_layers_model(model: onnx.ModelProto, env: dict[str, np.ndarray]
                         ) -> tuple[bytes, dict[str, dict[str, np.ndarray]], list[str], list[onnx.NodeProto]] | None:
    """Every ``MatMulIntegerToFloat`` node alone, side by side in one model (one session instead of one per
    node; each node is the fused kernel already, with nothing to fuse across them): constant inputs as
    initializers, computed inputs (A, and a per-token scale / zero point) as graph inputs fed from the
    reference run.  Returns the model, each node's constants (by output), the computed input names and the
    nodes; None when no node had all its computed inputs captured."""
    inits = {t.name: t for t in model.graph.initializer}
    nodes: list[onnx.NodeProto] = []
    computed: list[str] = []
    consts: dict[str, dict[str, np.ndarray]] = {}
    used: dict[str, onnx.TensorProto] = {}
    for node in model.graph.node:
        if node.op_type != "MatMulIntegerToFloat" or not node.output or node.input[0] not in env:
            continue
        comp = [node.input[0]] + [i for i in node.input[1:] if i and i not in inits]
        if any(i not in env for i in comp):
            continue
        nodes.append(node)
        computed.extend(i for i in comp if i not in computed)
        consts[node.output[0]] = {i: numpy_helper.to_array(inits[i]) for i in node.input[1:] if i and i in inits}
        used.update({i: inits[i] for i in node.input[1:] if i and i in inits})
    if not nodes:
        return None
    ins = [onnx.helper.make_tensor_value_info(i, onnx.helper.np_dtype_to_tensor_dtype(np.asarray(env[i]).dtype), None)
           for i in computed]
    g = onnx.helper.make_graph(nodes, "layers", ins,
                               [onnx.helper.make_empty_tensor_value_info(n.output[0]) for n in nodes], list(used.values()))
    m = onnx.helper.make_model(g, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return m.SerializeToString(), consts, computed, nodes


def _matmul_integer_to_float_math(node: onnx.NodeProto, a: np.ndarray, c: dict[str, np.ndarray]) -> np.ndarray:
    """What ``MatMulIntegerToFloat`` states, in exact integer arithmetic then float64:
    ``(A - a_zp) @ (B - b_zp) * a_scale * b_scale + bias``."""
    ins = list(node.input) + [""] * (7 - len(node.input))
    b = c[ins[1]].astype(np.int64)
    za = c[ins[4]].astype(np.int64) if ins[4] else np.int64(0)
    zb = c[ins[5]].astype(np.int64) if ins[5] else np.int64(0)
    acc = exact_int_matmul(a.astype(np.int64) - za, b - zb)
    y = acc.astype(np.float64) * (c[ins[2]].astype(np.float64) * c[ins[3]].astype(np.float64))
    return y + c[ins[6]].astype(np.float64) if ins[6] else y


class _Opener:
    """Sessions of the kernel check's models: from bytes, or - with the checked model staged on disk
    (:mod:`quantkit.staging`) - sub-models written next to its weights (their initializers reference them)."""

    def __init__(self, model: onnx.ModelProto, staged: StagedModel | None) -> None:
        self.staged = staged
        self.graph = model if staged is None else staged.graph()  # what sub-models copy initializers from

    def open(self, blob: bytes, *levels: str) -> list[Any]:
        from quantkit.evaluate.latency import make_session

        src: bytes | str = blob if self.staged is None else self.staged.area.write_bytes(blob, "part-")
        return [make_session(src, level=level) for level in levels]


def _float_layer_rows(model: onnx.ModelProto, codes: set[str], env: dict[str, np.ndarray],
                      cache: dict[str, Any], opener: _Opener | None = None
                      ) -> list[tuple[str, str, np.ndarray, np.ndarray]]:
    """Each float-output int8 layer run alone on the reference's input codes, fused and as the math it
    states: a QDQ MatMul / Gemm against its ``ORT_DISABLE_ALL`` run, a ``MatMulIntegerToFloat`` (whose
    reference run would use the same kernel) against exact integer arithmetic in NumPy."""
    from quantkit.evaluate.latency import make_session

    opener = opener if opener is not None else _Opener(model, None)
    rows = []
    if "::direct" not in cache:
        built = _direct_layers_model(model, env)
        cache["::direct"] = None if built is None else (make_session(built[0], level="all"), *built[1:])
    direct = cache["::direct"]
    if direct is not None and all(i in env for i in direct[2]):
        sess, consts, computed, nodes = direct
        feed = {i: np.asarray(env[i]) for i in computed}
        got = sess.run([n.output[0] for n in nodes], feed)
        for n, y in zip(nodes, got, strict=True):
            rows.append((n.output[0], n.name or n.output[0], y,
                         _matmul_integer_to_float_math(n, feed[n.input[0]], {**consts[n.output[0]], **feed})))
    layers = _float_int8_layers(model, codes)
    if "::float" not in cache:  # every float-output layer alone, side by side: one session per level
        iso = _isolation_model(opener.graph, [t for t, _ in layers], codes, env, max_nodes=_MAX_LAYER_NODES)
        cache["::float"] = None if iso is None else (*opener.open(iso[0], "all", "disabled"), iso[1])
    combined = cache["::float"]
    if combined is not None:
        fused, ref, mapping = combined
        feed = {name: env[src] for v in mapping.values() for name, src in v[1].items()}
        outs = [v[0] for v in mapping.values()]
        got, want = fused.run(outs, feed), ref.run(outs, feed)
        names = dict(layers)
        rows.extend((t, names[t], g, w) for t, g, w in zip(mapping, got, want, strict=True))
        return rows
    for t, layer in layers:
        if t not in cache:
            lm = _layer_model(opener.graph, t, codes, env)
            if lm is not None and len(onnx.load_from_string(lm).graph.node) > _MAX_LAYER_NODES:
                lm = None
            cache[t] = None if lm is None else tuple(opener.open(lm, "all", "disabled"))
        pair = cache[t]
        if pair is None:
            continue
        ins = {i.name: env[i.name] for i in pair[0].get_inputs()}
        rows.append((t, layer, pair[0].run([t], ins)[0], pair[1].run([t], ins)[0]))
    return rows


def _ints(node: onnx.NodeProto, name: str, default: list[int]) -> list[int]:
    for a in node.attribute:
        if a.name == name:
            return list(a.ints)
    return default


def emulate_saturation(model: onnx.ModelProto, env: dict[str, np.ndarray], layers: set[str]) -> dict[str, float]:
    """For each layer in ``layers`` (names of QDQ Conv / Gemm / MatMul or MatMulInteger(ToFloat) nodes),
    the fraction of its int32 accumulators that the ``x86-avx2`` kernel would get wrong on the input codes
    in ``env`` (tensor name -> value, e.g. from a reference run), emulated in NumPy
    (:func:`quantkit.scheme.saturation.saturation_excess`: the saturating sum minus the exact one).  Layers
    whose input codes are not in ``env`` are left out."""
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: t for t in model.graph.initializer}
    out: dict[str, float] = {}

    def arr(name: str) -> np.ndarray | None:
        t = inits.get(name)
        return None if t is None else numpy_helper.to_array(t)

    for node in model.graph.node:
        if node.name not in layers or len(node.input) < 2:
            continue
        if node.op_type in _DIRECT_INT8 and node.op_type not in _EMULATED_DIRECT:
            continue  # QOperator ops (QLinearConv, ConvInteger, ...): flagged by pair_risks, not emulated
        if node.op_type in _DIRECT_INT8:
            x, w, xzp = env.get(node.input[0]), arr(node.input[1]), 0
        else:
            xdq, wdq = producer.get(node.input[0]), producer.get(node.input[1])
            if xdq is None or wdq is None or xdq.op_type != "DequantizeLinear" or wdq.op_type != "DequantizeLinear":
                continue
            x, w = env.get(xdq.input[0]), arr(wdq.input[0])
            z = arr(xdq.input[2]) if len(xdq.input) > 2 else None
            xzp = int(np.asarray(z).reshape(-1)[0]) if z is not None else 0
        if x is None or w is None or w.dtype != np.int8:
            continue
        if x.dtype == np.int8:  # ONNX Runtime runs s8 activations as u8 (+128)
            x, xzp = (x.astype(np.int16) + 128).astype(np.uint8), xzp + 128
        if node.op_type == "Conv":
            if x.ndim != 4:
                continue
            kw = {"group": _attr(node, "group", 1), "strides": tuple(_ints(node, "strides", [1, 1])),
                  "pads": tuple(_ints(node, "pads", [0, 0, 0, 0])), "dilations": tuple(_ints(node, "dilations", [1, 1])),
                  "x_zero_point": xzp}
            excess = conv_saturation_excess(x, w, **kw)  # type: ignore[arg-type]
        else:
            view = kernel_view(w, node.op_type, trans_b=_attr(node, "transB", 0) == 1)[0]
            excess = saturation_excess(x.reshape(-1, x.shape[-1]), view)
        # the saturating int32 accumulator differs from the exact one where the excess is not a multiple of 2**32
        out[node.name] = float(np.mean(excess % (1 << 32) != 0)) if excess.size else 0.0
    return out


def _layer_nodes(model: onnx.ModelProto, target: str, codes: set[str], ref: dict[str, np.ndarray]
                 ) -> tuple[list[onnx.NodeProto], list[str]] | None:
    """The nodes of ``model`` that compute quantized tensor ``target`` from other quantized tensors
    (``codes``) and those input tensors, in graph order; None if they compute nothing."""
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name for t in model.graph.initializer}
    graph_inputs = {i.name for i in model.graph.input}
    keep: list[onnx.NodeProto] = []
    seen: set[int] = set()
    inputs: list[str] = []
    stack = [target]
    while stack:
        t = stack.pop()
        if t in inits or t == "":
            continue
        if (t in codes and t != target) or t in graph_inputs:
            if t not in inputs:
                inputs.append(t)
            continue
        n = producer.get(t)
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        keep.append(n)
        stack.extend(n.input)
    if not any(n.op_type not in ("QuantizeLinear", "DequantizeLinear") for n in keep):
        return None
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in keep for a in n.attribute):
        return None  # an If / Loop / Scan: its body reads outer values that are no inputs of the node
    if any(i not in ref for i in inputs):
        return None
    order = {id(n): i for i, n in enumerate(model.graph.node)}
    keep.sort(key=lambda n: order[id(n)])
    return keep, inputs


def _layer_model(model: onnx.ModelProto, target: str, codes: set[str], ref: dict[str, np.ndarray]) -> bytes | None:
    """The part of ``model`` that computes quantized tensor ``target`` from other quantized tensors
    (``codes``), as a model whose inputs are those tensors; None if it computes nothing."""
    part = _layer_nodes(model, target, codes, ref)
    if part is None:
        return None
    keep, inputs = part
    used = {i for n in keep for i in n.input}
    g = onnx.helper.make_graph(
        keep, "layer",
        [onnx.helper.make_tensor_value_info(i, onnx.helper.np_dtype_to_tensor_dtype(ref[i].dtype), None)
         for i in inputs],
        [onnx.helper.make_empty_tensor_value_info(target)],
        [t for t in model.graph.initializer if t.name in used],
    )
    m = onnx.helper.make_model(g, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return m.SerializeToString()


def _isolation_model(model: onnx.ModelProto, targets: list[str], codes: set[str], ref: dict[str, np.ndarray],
                     max_nodes: int | None = None) -> tuple[bytes, dict[str, tuple[str, dict[str, str]]]] | None:
    """Every layer of :func:`_layer_model` side by side in one model (one session instead of one per layer).

    Copy ``k`` renames each of its tensors ``x`` (not the initializers, which the copies share) to
    ``x::k`` and its nodes alike, so the copies share nothing computed and ONNX Runtime fuses each exactly
    as it fuses that layer alone.  Returns the model and ``target -> (output name, {input name: tensor})``;
    None when there is nothing to check (a layer whose nodes carry a subgraph is not checked alone)."""
    inits = {t.name for t in model.graph.initializer}
    nodes: list[onnx.NodeProto] = []
    ins: list[onnx.ValueInfoProto] = []
    outs: list[onnx.ValueInfoProto] = []
    mapping: dict[str, tuple[str, dict[str, str]]] = {}
    used: set[str] = set()
    for k, t in enumerate(targets):
        part = _layer_nodes(model, t, codes, ref)
        if part is None:
            continue
        keep, inputs = part
        if max_nodes is not None and len(keep) > max_nodes:
            continue

        def rn(x: str, k: int = k) -> str:
            return x if (x == "" or x in inits) else f"{x}::{k}"

        for n in keep:
            c = onnx.NodeProto()
            c.CopyFrom(n)
            c.name = f"{n.name or n.output[0]}::{k}"
            c.input[:] = [rn(i) for i in n.input]
            c.output[:] = [rn(o) for o in n.output]
            used.update(i for i in n.input if i in inits)
            nodes.append(c)
        for i in inputs:
            ins.append(onnx.helper.make_tensor_value_info(rn(i), onnx.helper.np_dtype_to_tensor_dtype(ref[i].dtype),
                                                          None))
        outs.append(onnx.helper.make_empty_tensor_value_info(rn(t)))
        mapping[t] = (rn(t), {rn(i): i for i in inputs})
    if not mapping:
        return None
    g = onnx.helper.make_graph(nodes, "layers", ins, outs, [t for t in model.graph.initializer if t.name in used])
    m = onnx.helper.make_model(g, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    return m.SerializeToString(), mapping


def with_outputs(model: onnx.ModelProto, tensors: Sequence[str]) -> bytes:
    """``model`` with ``tensors`` as extra graph outputs, serialized."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    have = {o.name for o in m.graph.output}
    for t in tensors:
        if t not in have:
            m.graph.output.append(onnx.helper.make_empty_tensor_value_info(t))
            have.add(t)
    return m.SerializeToString()


RANDOM_OPS = ("RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike", "Multinomial", "Bernoulli")
"""Ops whose output differs from run to run: a model holding one cannot be compared with itself run by run."""


def random_ops(model: onnx.ModelProto) -> list[str]:
    """``"<op type> '<node>'"`` of every node of ``model`` (subgraphs included) that draws random numbers."""
    out: list[str] = []

    def walk(graph: onnx.GraphProto) -> None:
        for n in graph.node:
            if n.op_type in RANDOM_OPS and n.domain in ("", "ai.onnx"):
                out.append(f"{n.op_type} '{n.name or n.output[0]}'")
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
                for g in a.graphs:
                    walk(g)

    walk(model.graph)
    return out


def kernel_vs_reference(
    model: onnx.ModelProto, feeds: Any, *, samples: int = 16, layer_samples: int = 2, max_off: float = 1e-3,
    emulate: set[str] | None = None, staged: StagedModel | None = None, observer: Any = None,
) -> KernelCheck:
    """Run ``model`` with the fused kernels of this CPU (``ORT_ENABLE_ALL``) and as the QDQ reference
    (``ORT_DISABLE_ALL``) on up to ``samples`` feeds (an iterable of feed dicts).

    * outputs: SQNR and top-1 agreement (last axis) of the fused run against the reference;
    * per quantized tensor, the layer that computes it *alone*, on the reference's own input codes
      (first ``layer_samples`` feeds): with identical inputs the kernel may differ from the QDQ math by
      one step where float rounding ties, never by more - unless int16 pair sums saturate or an int32
      accumulator wraps.  A layer with more than ``max_off`` of its codes off by more than one step has
      *parted*; ``agree`` is False when any has.
    In the whole-model runs the one-step differences compound with depth (reported as ``drift_db``,
    not judged).  ``emulate``: layers whose ``x86-avx2`` saturation is emulated on the first feed's
    reference codes (:func:`emulate_saturation`).  ``staged``: ``model`` staged on disk (:mod:`quantkit.staging`):
    the sessions open it and its sub-models by path instead of serializing the weights again.  ``observer``
    (``tensors``, ``wants_more()``, ``observe(feed, values)``): the reference run also exposes its ``tensors``
    (the fused run does not: exposing a layer's float output would block its fusion) and hands their values of
    each feed to it while it wants more."""
    from quantkit.evaluate.latency import make_session

    opener = _Opener(model, staged)
    qt = _quantized_tensors(model)
    zps = {t: z for t, _, z in qt}
    init_names = {t.name for t in model.graph.initializer} | {i.name for i in model.graph.input}
    # computed inputs of MatMulIntegerToFloat (per-token codes, scales, zero points): captured for the
    # layer-alone check, not compared themselves
    direct_ins = list(dict.fromkeys(i for n in model.graph.node if n.op_type == "MatMulIntegerToFloat"
                                    for i in n.input if i and i not in init_names))
    exposed = [t for t, _, _ in qt] + direct_ins
    observed = list(observer.tensors) if observer is not None and observer.wants_more() else []
    if staged is not None:
        fused = make_session(staged.variant(exposed), level="all")
        ref = make_session(staged.variant(exposed + observed), level="disabled")
    else:
        fused = opener.open(with_outputs(model, exposed), "all")[0]
        ref = opener.open(with_outputs(model, exposed + observed), "disabled")[0]
    out_names = [o.name for o in model.graph.output]
    t_names = [t for t, _, _ in qt if t not in out_names]
    names = out_names + t_names
    agg = {n: _Agg() for n in names}
    iso = {t: _Agg() for t in t_names}
    top1 = dict.fromkeys(out_names, 0)
    rows = dict.fromkeys(out_names, 0)
    layer_sessions: dict[str, Any] = {}
    float_sessions: dict[str, Any] = {}
    float_iso: dict[str, tuple[str, _Agg, list[int]]] = {}
    res = KernelCheck()
    for feed in feeds:
        a = dict(zip(names, fused.run(names, feed), strict=True))
        extra = [i for i in direct_ins if i not in names]
        watch = [t for t in dict.fromkeys(observed) if t not in names and t not in extra] if observed else []
        b_all = ref.run(names + extra + watch, feed)
        b = dict(zip(names, b_all[:len(names)], strict=True))
        direct_env = dict(zip(extra, b_all[len(names):len(names) + len(extra)], strict=True))
        if observed and observer.wants_more():
            seen = {**dict(zip(watch, b_all[len(names) + len(extra):], strict=True)), **direct_env, **b}
            observer.observe(feed, [seen[t] for t in observer.tensors])
        for n in names:
            y = np.asarray(b[n])
            if not np.issubdtype(y.dtype, np.number):
                continue
            agg[n].add(a[n], y, zps.get(n))
            if n in top1 and y.ndim >= 2 and y.shape[-1] > 1 and np.issubdtype(y.dtype, np.floating):
                top1[n] += int(np.sum(np.argmax(a[n], -1) == np.argmax(y, -1)))
                rows[n] += int(np.prod(y.shape[:-1]))
        if res.samples == 0 and emulate:
            res.emulated_avx2 = emulate_saturation(model, {**{k: np.asarray(v) for k, v in feed.items()}, **b},
                                                   emulate)
        if res.samples < layer_samples:
            env = {**{k: np.asarray(v) for k, v in feed.items()}, **direct_env, **b}
            if "::all" not in layer_sessions:  # every layer alone, side by side in one session
                built = _isolation_model(opener.graph, t_names, set(t_names), env)
                layer_sessions["::all"] = None if built is None else (opener.open(built[0], "all")[0], built[1])
            combined = layer_sessions["::all"]
            if combined is not None:
                sess, mapping = combined
                got = sess.run([v[0] for v in mapping.values()],
                               {name: env[src] for v in mapping.values() for name, src in v[1].items()})
                for t, y in zip(mapping, got, strict=True):
                    iso[t].add(y, b[t], zps.get(t))
            for t in t_names if combined is None else ():
                if t not in layer_sessions:
                    lm = _layer_model(opener.graph, t, set(t_names), env)
                    layer_sessions[t] = None if lm is None else opener.open(lm, "all")[0]
                sess = layer_sessions[t]
                if sess is None:
                    continue
                ins = {i.name: env[i.name] for i in sess.get_inputs()}
                iso[t].add(sess.run([t], ins)[0], b[t], zps.get(t))
            for t, layer, got, want in _float_layer_rows(model, set(t_names), env, float_sessions, opener):
                entry = float_iso.setdefault(t, (layer, _Agg(), [0]))
                entry[1].add(got, want, None)
                tol = _FLOAT_TOL * max(float(np.max(np.abs(want))), 1e-30)
                entry[2][0] += int(np.sum(np.abs(np.asarray(got, np.float64) - want) > tol))
        res.samples += 1
        if res.samples >= samples:
            break

    for n in out_names:
        if agg[n].n == 0:
            continue
        d: dict[str, float] = {"sqnr_db": agg[n].db}
        if rows[n]:
            d["top1_agreement"] = top1[n] / rows[n]
        res.outputs[n] = d
    for t, layer, _ in qt:
        if t not in iso or iso[t].n == 0:
            continue
        g = iso[t]
        off = g.far / g.n
        row = {"tensor": t, "layer": layer, "off": off, "sqnr_db": g.db, "drift_db": agg[t].db}
        res.layers.append(row)
        if res.first_parted is None and off > max_off:
            res.first_parted = row
    for t, (layer, fagg, far) in float_iso.items():  # float-output int8 layers: no whole-model drift measured
        off = far[0] / max(fagg.n, 1)
        row = {"tensor": t, "layer": layer, "off": off, "sqnr_db": fagg.db, "drift_db": None, "float_output": True}
        res.layers.append(row)
        if off > max_off and res.first_parted is None:
            res.first_parted = row
    res.agree = res.first_parted is None
    return res
