"""Modern mobile CNN blocks lower to int8 chains ONNX Runtime fuses: HardSwish, HardSigmoid, squeeze-excite
(HardSigmoid and Sigmoid gates), SiLU, ``x * relu6(x + 3) / 6`` and a constant ``Add`` - with no stray
QuantizeLinear / DequantizeLinear left inside the optimized graph (see quantkit.ops, docs/int8-lowering.md)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantkit.api import quantize
from quantkit.lowering.qdq import quantized_constant
from quantkit.lowering.select import rescale_factor, select
from quantkit.prep import prepare
from quantkit.recipe import load_recipe
from tests.conftest import image_batches
from tests.tiny_graphs import TinyGraph

C = 16


def _recipe() -> dict[str, Any]:
    return {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}}}


def _block(kind: str, seed: int = 0) -> onnx.ModelProto:
    """input[N,3,16,16] -> Conv3x3 -> <block> -> Conv3x3 -> Relu -> out: one mobile block between two int8 Convs."""
    g = TinyGraph(seed)
    rng, w, c, node = g.rng, g.w, g.c, g.node

    x = node("Conv", ["input", w("w0", C, 3, 3, 3), w("b0", C, s=0.1)], "c0", pads=[1, 1, 1, 1])
    if kind == "hardswish":
        a = node("HardSwish", [x], "a0")
    elif kind == "hardsigmoid_default":  # ONNX defaults alpha 0.2, beta 0.5 (Add offset 2.5, range [0, 5])
        a = node("Mul", [x, node("HardSigmoid", [x], "h")], "a0")
    elif kind == "silu":
        a = node("Mul", [x, node("Sigmoid", [x], "s")], "a0")
    elif kind == "relu6_div":  # x * relu6(x + 3) / 6 as other exporters write it: the Div is a rescale
        r6 = node("Clip", [node("Add", [x, c("three", 3.0)], "t"), c("zero", 0.0), c("six", 6.0)], "r6")
        a = node("Div", [node("Mul", [x, r6], "m"), "six"], "a0")
    elif kind == "const_add":  # a per-channel constant Add inside the chain (QLinearAdd with a constant operand)
        a = node("Add", [x, c("shift", rng.standard_normal((1, C, 1, 1)) * 0.5)], "a0")
    elif kind == "const_mul":  # a per-channel scale inside the chain (QLinearMul with a constant operand)
        a = node("Mul", [c("gain", rng.uniform(0.5, 1.5, (1, C, 1, 1))), x], "a0")
    elif kind == "layer_scale":  # a per-channel scale spanning decades: no 8-bit grid holds it
        a = node("Mul", [x, c("gamma", np.geomspace(1e-4, 1.0, C).reshape(1, C, 1, 1))], "a0")
    elif kind in ("se_hardsigmoid", "se_sigmoid"):
        x = node("Relu", [x], "r0")
        p = node("GlobalAveragePool", [x], "p")
        f1 = node("Relu", [node("Conv", [p, w("wf1", 4, C, 1, 1), w("bf1", 4, s=0.1)], "f1")], "r1")
        f2 = node("Conv", [f1, w("wf2", C, 4, 1, 1), w("bf2", C, s=0.1)], "f2")
        gate = (node("HardSigmoid", [f2], "g", alpha=1 / 6, beta=0.5) if kind == "se_hardsigmoid"
                else node("Sigmoid", [f2], "g"))
        a = node("Mul", [gate, x], "a0")  # the gate first, as torchvision exports it
    elif kind == "channel_shuffle":  # ShuffleNet: split, one branch convolved, concat, shuffle the channels
        x = node("Relu", [x], "r0")
        sp = g.multi("Split", [x, c("halves", [C // 2, C // 2], np.int64)], ["s0", "s1"], "split_node", axis=1)
        b = node("Relu", [node("Conv", [sp[1], w("wb", C // 2, C // 2, 1, 1), w("bb", C // 2, s=0.1)], "cb")], "rb")
        cat = node("Concat", [sp[0], b], "cat", axis=1)
        c("shape5", [-1, 2, C // 2, 16, 16], np.int64)
        c("shape4", [-1, C, 16, 16], np.int64)
        t = node("Transpose", [node("Reshape", [cat, "shape5"], "r5")], "tr", perm=[0, 2, 1, 3, 4])
        a = node("Reshape", [t, "shape4"], "a0")
    elif kind in ("resize_nearest", "resize_linear"):  # a decoder's upsampling x2, then a strided Conv back down
        x = node("Relu", [x], "r0")
        c("scales", [1, 1, 2, 2])
        up = node("Resize", [x, "", "scales"], "up", mode=kind.split("_")[1])
        a = node("Relu", [node("Conv", [up, w("wd", C, C, 2, 2, s=0.2), w("bd", C, s=0.1)], "cd", strides=[2, 2])],
                 "a0")
    elif kind == "aspp":  # DeepLabV3's ASPP: conv branches and a pooled branch upsampled (linear), concatenated
        x = node("Relu", [x], "r0")
        b1 = node("Relu", [node("Conv", [x, w("wa", C, C, 1, 1), w("ba", C, s=0.1)], "ca")], "ra")
        b2 = node("Relu", [node("Conv", [x, w("wb", C, C, 3, 3), w("bb", C, s=0.1)], "cb", pads=[2, 2, 2, 2],
                                dilations=[2, 2])], "rb")
        p = node("GlobalAveragePool", [x], "p")
        pc = node("Relu", [node("Conv", [p, w("wp", C, C, 1, 1), w("bp", C, s=0.1)], "cp")], "rp")
        c("scales", [1, 1, 16, 16])
        up = node("Resize", [pc, "", "scales"], "up", mode="linear")
        a = node("Concat", [b1, b2, up], "a0", axis=1)
        y = node("Relu", [node("Conv", [a, w("w1", C, 3 * C, 3, 3, s=0.1), w("b1", C, s=0.1)], "c1",
                               pads=[1, 1, 1, 1])], "out")
        return g.model(kind, y, ["N", C, 16, 16])
    elif kind == "slice":  # a slice of the channels (a split written as Slice), zero-padded back by a Concat
        x = node("Relu", [x], "r0")
        for n, v in (("st", [0]), ("en", [C // 2]), ("ax", [1])):
            c(n, v, np.int64)
        half = node("Slice", [x, "st", "en", "ax"], "half")
        b = node("Relu", [node("Conv", [half, w("wb", C // 2, C // 2, 3, 3), w("bb", C // 2, s=0.1)], "cb",
                               pads=[1, 1, 1, 1])], "rb")
        a = node("Concat", [half, b], "a0", axis=1)
    else:
        raise ValueError(kind)
    y = node("Relu", [node("Conv", [a, w("w1", C, C, 3, 3, s=0.1), w("b1", C, s=0.1)], "c1", pads=[1, 1, 1, 1])],
             "out")
    return g.model(kind, y, ["N", C, 16, 16])


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray], level: str = "all") -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                                   "disabled": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}[level]
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]


def _sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    ref64 = ref.astype(np.float64)
    return float(10 * np.log10(np.sum(ref64**2) / max(np.sum((ref64 - got) ** 2), 1e-30)))


# Every block's ops, each with the fused kernel it must become (and no float op of the block left).
EXPECTED = {
    "hardswish": {"QLinearConv": 2, "QLinearAdd": 1, "QLinearMul": 1},
    "hardsigmoid_default": {"QLinearConv": 2, "QLinearAdd": 1, "QLinearMul": 1},
    "silu": {"QLinearConv": 2, "QLinearSigmoid": 1, "QLinearMul": 1},
    "relu6_div": {"QLinearConv": 2, "QLinearAdd": 1, "QLinearMul": 1},
    "const_add": {"QLinearConv": 2, "QLinearAdd": 1},
    "const_mul": {"QLinearConv": 2, "QLinearMul": 1},
    # the HardSigmoid gate is folded into the second SE Conv (bias + 3, Q's saturation is the clip): no node
    "se_hardsigmoid": {"QLinearConv": 4, "QLinearGlobalAveragePool": 1, "QLinearMul": 1},
    "se_sigmoid": {"QLinearConv": 4, "QLinearGlobalAveragePool": 1, "QLinearSigmoid": 1, "QLinearMul": 1},
    # the Split, Reshape / Transpose / Reshape and the Resize / Slice run on the codes (no kernel of their own)
    "channel_shuffle": {"QLinearConv": 3, "QLinearConcat": 1},
    "resize_nearest": {"QLinearConv": 3},
    "slice": {"QLinearConv": 3, "QLinearConcat": 1},
}
LAYOUT_OPS = {"channel_shuffle": 5}  # its own Transpose, and ORT back to NCHW and to NHWC around the 5-D shuffle
FLOAT_OPS = ("HardSwish", "HardSigmoid", "Sigmoid", "Mul", "Add", "Div", "Clip", "Relu", "Conv", "GlobalAveragePool",
             "QuickGelu", "FusedConv")


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_block_is_one_fused_int8_chain(kind: str) -> None:
    model = _block(kind)
    res = quantize(model, image_batches(8), _recipe(), evaluation_data=image_batches(4, seed=9), progress=False)
    kernels = res.census.quantized_kernels
    assert kernels == EXPECTED[kind], kernels
    # nothing of the block runs in float, and the only Q/DQ left are the graph input's Q and output's DQ
    ops = {k.split(".")[-1] for k in res.census.op_counts}
    assert not ops & set(FLOAT_OPS), res.census.op_counts
    assert all(item.at_graph_input or item.at_graph_output for item in res.census.leftovers), \
        res.census.leftover_qdq_nodes
    assert res.report["census"]["leftover_by_kind"]["stray"] == 0
    # no layout churn: the whole chain stays in ORT's NHWC int8 form (one Transpose in, one out)
    assert res.census.op_counts.get("Transpose", 0) == LAYOUT_OPS.get(kind, 2), res.census.op_counts
    assert all(f.fused for f in res.census.per_layer.values()), res.census.per_layer
    # fused kernels compute the QDQ math the graph states (ORT_ENABLE_ALL vs ORT_DISABLE_ALL, every layer)
    check = res.report["kernels"]["check"]
    assert check["agree"], check["first_parted"]
    # Fidelity vs FP32 on held-out inputs.  8-bit activations on a full-range signal give ~48 dB; these blocks
    # requantize 3-5 times on calibrated (not full-scale) ranges and measure 33-38 dB.  30 dB leaves margin for
    # calibration noise, while the failures this guards against fall below it: a QuantizeLinear that loses the
    # relabel (its scale s instead of s/a) measured 8.6 dB (HardSwish) and 23.4 dB (the SE gate, a mild gate in
    # this tiny net), a rescale read with the unscaled grid -8.5 dB.
    feed = image_batches(1, seed=42, batch=4)[0]
    sq = _sqnr_db(_run(model, feed), _run(ir.to_proto(res.model), feed))
    assert sq > 30, sq


def test_rescale_and_gate_bookkeeping() -> None:
    """The Div of ``x * relu6(x+3) / 6`` emits no node (its consumer reads the Mul's codes with scale s/6); the
    SE gate HardSigmoid is folded into the Conv before it; the HardSwish gate (x also feeds the Mul) is an Add."""
    res = quantize(_block("relu6_div"), image_batches(4), _recipe(), evaluate=False, progress=False)
    assert res.plan.rescales == {"a0_node": pytest.approx(1 / 6)}
    assert "a0_node" not in {n.name for n in res.model.graph}
    scaled = res.lowering.tensors["a0"]
    assert scaled.scale == pytest.approx(res.lowering.tensors["m"].scale / 6, rel=1e-6)
    assert scaled.zero_point == res.lowering.tensors["m"].zero_point
    # the Clip(0, 6) after Add(x, 3) is folded into the Add's output range: zero point 0, 255 * s <= 6
    r6 = res.lowering.tensors["r6"]
    assert r6.zero_point == 0 and np.float32(r6.scale) * np.float32(255) <= np.float32(6.0)

    res = quantize(_block("se_hardsigmoid"), image_batches(4), _recipe(), evaluate=False, progress=False)
    assert res.plan.folded_gates == {"g_node": "f2_node"}
    assert "g_node" not in res.plan.layers and "HardSigmoid" not in {n.op_type for n in res.model.graph}
    assert "folded" in res.lowering.notes["f2_node"]

    res = quantize(_block("hardsigmoid_default"), image_batches(4), _recipe(), evaluate=False, progress=False)
    add = next(n for n in res.model.graph if n.name == "h_node")
    assert add.op_type == "Add"  # the HardSigmoid node, rewritten: Add(x, beta/alpha) with a relabelled Q
    h = res.lowering.tensors["h"]
    q = next(n for n in res.model.graph if n.op_type == "QuantizeLinear" and n.inputs[0] is add.outputs[0])
    q_scale = float(q.inputs[1].const_value.numpy())  # type: ignore[union-attr]
    assert q_scale == pytest.approx(h.scale / 0.2, rel=1e-6) and h.zero_point == 0


def test_relabelled_hardsigmoid_is_the_qdq_of_hardsigmoid() -> None:
    """``Q(x + b/a; s/a, 0)`` read as ``DQ(.; s, 0)`` equals ``DQ(Q(HardSigmoid(x); s, 0))`` up to one code
    where float rounding meets a tie: the Add form is the HardSigmoid's own QDQ math, not an approximation."""
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-8, 8, 4000), np.linspace(-3.2, 3.2, 641)]).astype(np.float32)
    for alpha, beta in ((1 / 6, 0.5), (0.2, 0.5), (0.25, 0.4)):
        a, b = np.float32(alpha), np.float32(beta)
        s = np.float32(1.0 / 255)
        ref = np.clip(np.rint(np.clip(a * x + b, 0, 1) / s), 0, 255)
        got = np.clip(np.rint((x + np.float32(b / a)) / np.float32(s / a)), 0, 255)
        assert np.max(np.abs(ref - got)) <= 1 and np.mean(ref != got) < 0.01


def test_hardswish_rewrite_is_exact_in_float() -> None:
    """prep writes HardSwish as x * HardSigmoid(x, 1/6, 1/2) - its ONNX definition; ONNX Runtime computes both the
    same (bit for bit on random inputs, including the kinks at +-3), and its FP32 optimized graph is unchanged."""
    model = _block("hardswish")
    prepared = prepare(ir.from_proto(model)).model
    ops = Counter(n.op_type for n in prepared.graph)
    assert ops["HardSwish"] == 0 and ops["HardSigmoid"] == 1 and ops["Mul"] == 1
    hs = next(n for n in prepared.graph if n.op_type == "HardSigmoid")
    assert hs.attributes["alpha"].as_float() == pytest.approx(1 / 6) and hs.attributes["beta"].as_float() == 0.5
    rng = np.random.default_rng(3)
    feed = {"input": rng.uniform(-4, 4, (4, 3, 16, 16)).astype(np.float32)}
    for level in ("all", "disabled"):
        ref = _run(model, feed, level)
        got = _run(ir.to_proto(prepared), feed, level)
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    # the bare op too, on values straddling the kinks
    x = np.concatenate([rng.uniform(-10, 10, 5000), np.linspace(-3.01, 3.01, 6021)]).astype(np.float32)
    g = helper.make_graph([helper.make_node("HardSwish", ["x"], ["y"])], "hs",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [x.size])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [x.size])])
    bare = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    bare.ir_version = 8
    bare_prepared = ir.to_proto(prepare(ir.from_proto(bare)).model)
    np.testing.assert_array_equal(_run(bare_prepared, {"x": x}), _run(bare, {"x": x}))


def test_quantized_constant_represents_scalars_exactly() -> None:
    for v in (3.0, 2.5, 6.0, 0.5, -3.0, -0.5):
        for dtype in ("uint8", "int8"):
            codes, scale, zp = quantized_constant(np.array(v, np.float32), dtype)
            assert float(np.float32((int(codes) - zp) * scale)) == v, (v, dtype)
    codes, scale, zp = quantized_constant(np.array(1 / 3, np.float32), "uint8")
    assert abs((int(codes) - zp) * float(scale) - 1 / 3) < 1e-7
    arr = np.linspace(-1, 2, 7, dtype=np.float32).reshape(1, 7, 1, 1)
    codes, scale, zp = quantized_constant(arr, "uint8")
    assert codes.dtype == np.uint8 and np.max(np.abs((codes.astype(np.float32) - zp) * scale - arr)) <= scale / 2 + 1e-7


def _node(op: str, ins: list[ir.Value | None]) -> ir.Node:
    return ir.node(op, ins, outputs=[ir.Value(name="y")])


def test_rescale_factor_only_for_positive_scalar_constants() -> None:
    x = ir.Value(name="x", shape=ir.Shape([1, 4, 2, 2]))

    def const(v: Any) -> ir.Value:
        return ir.Value(name="c", const_value=ir.tensor(np.asarray(v, np.float32)))

    assert rescale_factor(_node("Mul", [x, const(0.5)])) == 0.5
    assert rescale_factor(_node("Mul", [const(2.0), x])) == 2.0
    assert rescale_factor(_node("Div", [x, const(4.0)])) == 0.25
    assert rescale_factor(_node("Mul", [x, const([[[[2.0]]]])])) == 2.0  # [1,1,1,1]: no broadcast beyond x
    assert rescale_factor(_node("Mul", [x, const(-2.0)])) is None  # a sign flip is not a relabel
    assert rescale_factor(_node("Div", [const(2.0), x])) is None  # 2 / x
    assert rescale_factor(_node("Mul", [x, const([1.0, 2.0, 3.0, 4.0])])) is None  # per channel: QLinearMul
    assert rescale_factor(_node("Mul", [x, x])) is None


def test_non_foldable_ops_stay_float_with_a_reason() -> None:
    """A decreasing HardSigmoid (alpha < 0) and a Div by a negative constant have no int8 form here."""
    model = _block("hardsigmoid_default")
    for n in model.graph.node:
        if n.op_type == "HardSigmoid":
            n.attribute.append(helper.make_attribute("alpha", -0.2))
    prepared = prepare(ir.from_proto(model)).model
    plan = select(prepared, load_recipe(_recipe()))
    assert "alpha" in plan.skipped["h_node"] and "h_node" not in plan.layers

    model = _block("relu6_div")
    for t in model.graph.initializer:
        if t.name == "six":
            t.CopyFrom(numpy_helper.from_array(np.array(-6.0, np.float32), "six"))
    prepared = prepare(ir.from_proto(model), fold_constants=False).model
    plan = select(prepared, load_recipe(_recipe()))
    assert "Div" in plan.skipped["a0_node"] and not plan.rescales


def test_a_constant_factor_spanning_decades_stays_float() -> None:
    """QLinearMul reads its constant on one 8-bit grid: a layer scale of 1e-4 .. 1 would lose its small channels
    entirely, so that Mul stays float (with its reason) rather than silently zeroing them."""
    plan = select(prepare(ir.from_proto(_block("layer_scale"))).model, load_recipe(_recipe()))
    assert "a0_node" not in plan.layers and "constant factor loses" in plan.skipped["a0_node"]


def test_a_linear_resize_is_a_float_island_not_a_stray() -> None:
    """Only a nearest Resize runs on int8 codes: a linear one stays float between its DQ and the next Conv's Q,
    reported as a float island with its reason (never as a stray round trip)."""
    res = quantize(_block("resize_linear"), image_batches(8), _recipe(), evaluation_data=image_batches(4, seed=9),
                   progress=False)
    assert res.census.op_counts.get("Resize") == 1
    assert res.report["census"]["leftover_by_kind"]["stray"] == 0, res.census.leftover_qdq_nodes
    islands = res.report["census"]["float_islands"]
    assert "Resize(linear)" in islands and "nearest" in islands["Resize(linear)"]["reason"], islands
    assert "linear" in res.plan.skipped["up_node"], res.plan.skipped


def test_a_concat_with_a_float_input_is_quantized_on_its_output_grid() -> None:
    """Rule 7: DeepLabV3's ASPP concatenates int8 branches with a pooled branch upsampled by a float
    Resize(linear).  The float input gets a Q on the Concat output's grid, so the Concat is one QLinearConcat (no
    DQ per int8 branch, float Concat and Q: 4 stray round trips in DeepLabV3-MobileNetV3 before), and the fused
    model computes the QDQ math."""
    model = _block("aspp")
    res = quantize(model, image_batches(8), _recipe(), evaluation_data=image_batches(4, seed=9), progress=False)
    kernels = res.census.quantized_kernels
    assert kernels.get("QLinearConcat") == 1 and kernels.get("QLinearConv") == 5, kernels
    assert res.report["census"]["leftover_by_kind"]["stray"] == 0, res.census.leftover_qdq_nodes
    assert "Resize(linear)" in res.report["census"]["float_islands"]
    tq = res.plan.tensors["up"]
    assert tq.inherit_from == "a0" and tq.consumers == ("a0_node",), tq
    assert res.report["kernels"]["check"]["agree"], res.report["kernels"]["check"]["first_parted"]
    feed = image_batches(1, seed=42, batch=4)[0]
    sq = _sqnr_db(_run(model, feed), _run(ir.to_proto(res.model), feed))
    assert sq > 30, sq
