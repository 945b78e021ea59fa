"""GELU written as ``x * 0.5 * (1 + Erf(x / sqrt 2))`` (every exporter below opset 20) becomes one
``com.microsoft.Gelu`` (its tanh approximation one ``com.microsoft.FastGelu``) before quantization (quantkit.prep.erf_gelu): the same function, and no stray Q/DQ where
ONNX Runtime's QDQ propagation would give the pattern's two readers of ``x`` two DequantizeLinear nodes."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantkit.api import quantize
from quantkit.prep import prepare
from quantkit.prep.erf_gelu import fuse_erf_gelu
from tests.conftest import image_batches
from tests.tiny_graphs import TinyGraph

C = 8


def _gelu_nodes(order: str, scale: str, x: str = "x", swap: bool = False) -> list[onnx.NodeProto]:
    """One exporter's GELU of ``x`` into ``y`` (constants ``s``, ``one``, ``half``, and for the tanh forms ``three``,
    ``kappa``); ``scale``: ``Div`` / ``Mul`` (``x / sqrt2``, ``x * 1/sqrt2`` into an Erf) or ``tanh-pow`` /
    ``tanh-mul`` (``sqrt(2/pi) * (x + 0.044715 * x^3)`` into a Tanh, the cube as ``Pow(x, 3)`` or ``x * (x * x)``);
    ``swap`` flips every operand pair of the commutative ``Add`` / ``Mul``."""
    def pair(a: str, b: str) -> list[str]:
        return [b, a] if swap else [a, b]

    if scale.startswith("tanh"):
        cube = ([helper.make_node("Pow", [x, "three"], ["c3"])] if scale == "tanh-pow" else
                [helper.make_node("Mul", [x, x], ["c2"]), helper.make_node("Mul", pair(x, "c2"), ["c3"])])
        nodes = [*cube, helper.make_node("Mul", pair("c3", "kappa"), ["k"]), helper.make_node("Add", pair(x, "k"), ["a"]),
                 helper.make_node("Mul", pair("s", "a"), ["i"]), helper.make_node("Tanh", ["i"], ["e"])]
    else:
        nodes = [helper.make_node(scale, [x, "s"], ["i"]), helper.make_node("Erf", ["i"], ["e"])]
    nodes.append(helper.make_node("Add", pair("e", "one"), ["g"]))
    if order == "outer_half":  # (x * (1 + e)) * 0.5 (torch's TorchScript exporter)
        return nodes + [helper.make_node("Mul", pair(x, "g"), ["m"]), helper.make_node("Mul", pair("m", "half"), ["y"])]
    if order == "x_half":  # (x * 0.5) * (1 + e)
        return nodes + [helper.make_node("Mul", pair(x, "half"), ["m"]), helper.make_node("Mul", pair("m", "g"), ["y"])]
    # x * ((1 + e) * 0.5) (torch's dynamo exporter)
    return nodes + [helper.make_node("Mul", pair("half", "g"), ["m"]), helper.make_node("Mul", pair(x, "m"), ["y"])]


def _constants(scale: str, half: float = 0.5) -> list[onnx.TensorProto]:
    t = numpy_helper.from_array
    s = {"Div": math.sqrt(2.0), "Mul": 1.0 / math.sqrt(2.0)}.get(scale, math.sqrt(2.0 / math.pi))
    return [t(np.array(s, np.float32), "s"), t(np.array(1.0, np.float32), "one"), t(np.array(half, np.float32), "half"),
            t(np.array(3.0, np.float32), "three"), t(np.array(0.044715, np.float32), "kappa")]


def _model(order: str, scale: str, *, swap: bool = False, half: float = 0.5, extra_output: str | None = None
           ) -> onnx.ModelProto:
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])]
    if extra_output:
        outs.append(helper.make_tensor_value_info(extra_output, TensorProto.FLOAT, [2, 16]))
    g = helper.make_graph(_gelu_nodes(order, scale, swap=swap), "gelu",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])], outs,
                          _constants(scale, half))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the graph as written
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feed)[0]


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("scale", ["Div", "Mul", "tanh-pow", "tanh-mul"])
@pytest.mark.parametrize("order", ["outer_half", "x_half", "inner_half"])
def test_every_gelu_form_becomes_one_node_with_the_same_values(order: str, scale: str, swap: bool) -> None:
    model = _model(order, scale, swap=swap)
    m = ir.from_proto(model)
    assert fuse_erf_gelu(m) == 1
    [node] = list(m.graph)
    assert (node.op_type, node.domain) == ("FastGelu" if scale.startswith("tanh") else "Gelu", "com.microsoft")
    assert node.outputs[0].name == "y" and node.outputs[0].is_graph_output()
    assert m.opset_imports.get("com.microsoft") == 1
    out = node.outputs[0]
    assert out.dtype == ir.DataType.FLOAT and out.shape is not None and list(out.shape) == [2, 16]
    x = np.linspace(-6, 6, 32, dtype=np.float32).reshape(2, 16)
    ref, got = _run(model, {"x": x}), _run(ir.to_proto(m), {"x": x})
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", ["Div", "tanh-mul"])
@pytest.mark.parametrize("change", ["half", "shared_erf", "shared_inner"])
def test_a_near_miss_is_left_as_written(change: str, scale: str) -> None:
    """A constant that is not the GELU's (0.6 for 0.5), or an intermediate value read elsewhere (the Erf / Tanh
    output, or the value inside it, is also a graph output): no rewrite."""
    model = (_model("outer_half", scale, half=0.6) if change == "half" else
             _model("outer_half", scale, extra_output="e" if change == "shared_erf" else "i"))
    before = [n.op_type for n in model.graph.node]
    m = ir.from_proto(model)
    assert fuse_erf_gelu(m) == 0
    assert [n.op_type for n in m.graph] == before


def _segformer_ffn(order: str, scale: str = "Div") -> onnx.ModelProto:
    """SegFormer's Mix-FFN in miniature: ``Conv -> depthwise Conv -> Reshape -> Transpose -> GELU -> MatMul``, the
    GELU as torch's exporters write it at opset 18."""
    g = TinyGraph(0)
    w, c, node = g.w, g.c, g.node
    x = node("Relu", [node("Conv", ["input", w("w0", C, 3, 3, 3), w("b0", C, s=0.1)], "c0", pads=[1, 1, 1, 1])], "r0")
    x = node("Conv", [x, w("w1", C, 1, 3, 3), w("b1", C, s=0.1)], "c1", pads=[1, 1, 1, 1], group=C)
    x = node("Transpose", [node("Reshape", [x, c("shp", [0, C, -1], np.int64)], "rs")], "tp", perm=[0, 2, 1])
    g.inits.extend(_constants(scale))
    g.nodes.extend(_gelu_nodes(order, scale, x=x))
    out = node("Add", [node("MatMul", ["y", w("w3", C, C)], "mm"), w("b3", C, s=0.1)], "out")
    m = g.model("ffn", out, ["N", 256, C])
    m.opset_import[0].version = 18
    return m


@pytest.mark.parametrize(("order", "scale"), [("inner_half", "Div"), ("outer_half", "Div"), ("x_half", "tanh-pow")])
def test_gelu_after_an_int8_convolution_is_one_float_island(order: str, scale: str) -> None:
    """Before the rewrite, the dynamo form (``inner_half``) left a stray DequantizeLinear into the GELU's last
    ``Mul`` (ORT's QDQ propagation split the Transpose's DQ between the Div and that Mul): 8 of them in
    SegFormer-B0.  Now the GELU is one float ``Gelu`` between the int8 convolutions and the int8 MatMul."""
    model = _segformer_ffn(order, scale)
    op = "FastGelu" if scale.startswith("tanh") else "Gelu"
    assert prepare(ir.from_proto(model)).applied["erf_gelu"] == 1
    rec = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}}}
    res = quantize(model, image_batches(8), rec, evaluation_data=image_batches(4, seed=9), progress=False)
    cen = res.report["census"]
    assert cen["leftover_by_kind"]["stray"] == 0, cen["leftover_qdq_nodes"]
    assert cen["float_islands"][op]["count"] == 1
    assert "Erf" not in res.census.op_counts and "Tanh" not in res.census.op_counts
    assert res.census.quantized_kernels.get("QLinearConv") == 2
    feed = image_batches(1, seed=42, batch=4)[0]
    so = ort.SessionOptions()
    so.log_severity_level = 3
    ref = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feed)[0]
    got = ort.InferenceSession(ir.to_proto(res.model).SerializeToString(), so,
                               providers=["CPUExecutionProvider"]).run(None, feed)[0]
    err = float(np.sum((ref.astype(np.float64) - got) ** 2))
    assert 10 * math.log10(float(np.sum(ref.astype(np.float64) ** 2)) / max(err, 1e-30)) > 25
