"""Weights computed in the graph from constants are folded by prep (quantkit.prep.weight_subgraphs): weight
standardization as torch exports it (BiT, timm's StdConv2d: Reshape -> BatchNormalization(training_mode=1) ->
Reshape -> Conv) left every such convolution in float, silently ("weight is not a constant")."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import quantkit
from quantkit.prep import prepare


def _std_conv_model(shared: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    o, c, k = 8, 3, 3
    inits = [numpy_helper.from_array(rng.standard_normal((1, o, c * k * k)).astype(np.float32), "w_flat"),
             numpy_helper.from_array(np.ones(o, np.float32), "ones"), numpy_helper.from_array(np.zeros(o, np.float32),
                                                                                             "zeros"),
             numpy_helper.from_array(np.array([o, c, k, k], np.int64), "wshape"),
             numpy_helper.from_array(rng.standard_normal(o).astype(np.float32) * 0.1, "bias"),
             numpy_helper.from_array(rng.standard_normal((10, o)).astype(np.float32) * 0.3, "fc_w")]
    nodes = [
        helper.make_node("ReduceMean", ["w_flat"], ["mean"], axes=[0, 2], keepdims=0),
        helper.make_node("ReduceMean", ["w_flat"], ["mean_k"], axes=[0, 2], keepdims=1),
        helper.make_node("Sub", ["w_flat", "mean_k"], ["centred"]),
        helper.make_node("Mul", ["centred", "centred"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["var"], axes=[0, 2], keepdims=0),
        helper.make_node("BatchNormalization", ["w_flat", "ones", "zeros", "mean", "var"], ["w_norm", "rm", "rv"],
                         epsilon=1e-8, momentum=1.0, training_mode=1),
        helper.make_node("Reshape", ["w_norm", "wshape"], ["w"]),
        helper.make_node("Conv", ["x", "w", "bias"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "fc_w"], ["logits"], name="fc", transB=1),
    ]
    outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])]
    if shared:  # the standardized weight is also a graph output: it must stay computed
        outs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [o, c, k, k]))
    g = helper.make_graph(nodes, "std", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, 16, 16])],
                          outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_a_standardized_weight_becomes_a_constant_and_the_model_computes_the_same() -> None:
    m = _std_conv_model()
    x = np.random.default_rng(1).standard_normal((2, 3, 16, 16)).astype(np.float32)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    res = prepare(ir.from_proto(m))
    p = res.model
    conv = next(n for n in p.graph if n.op_type == "Conv")
    assert conv.inputs[1].const_value is not None and res.applied["weight_subgraphs"] == 1
    assert not any(n.op_type == "BatchNormalization" for n in p.graph)
    got = ort.InferenceSession(ir.to_proto(p).SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_weight_also_read_elsewhere_is_left_computed() -> None:
    p = prepare(ir.from_proto(_std_conv_model(shared=True))).model
    conv = next(n for n in p.graph if n.op_type == "Conv")
    assert conv.inputs[1].const_value is None


def test_the_convolution_is_quantized() -> None:
    rng = np.random.default_rng(2)
    cal = [{"x": rng.standard_normal((4, 3, 16, 16)).astype(np.float32)} for _ in range(4)]
    rec = {"version": 1, "name": "std", "report": {"latency": {"enabled": False}}}
    res = quantkit.quantize(_std_conv_model(), cal, rec, evaluation_data=cal[:2], progress=False)
    assert "conv" in res.plan.layers and res.census.quantized_kernels.get("QLinearConv") == 1


def test_a_tied_table_under_the_lm_heads_transpose_is_not_copied() -> None:
    """MatMul(h, Transpose(E)) with E also read by the embedding's Gather: folding the Transpose would store the
    table twice and break the tied lm_head / embedding lowering."""
    rng = np.random.default_rng(3)
    e = numpy_helper.from_array(rng.standard_normal((300, 64)).astype(np.float32), "E")  # past onnxscript's limit
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h"], name="embed"),
             helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0], name="head_t"),
             helper.make_node("MatMul", ["h", "Et"], ["logits"], name="lm_head")]
    g = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 5])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5, 300])], [e])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    p = prepare(ir.from_proto(m)).model
    head = next(n for n in p.graph if n.op_type == "MatMul")
    assert head.inputs[1].const_value is None and len(p.graph.initializers) == 1


def test_the_raw_weight_is_not_kept_beside_the_folded_one() -> None:
    p = prepare(ir.from_proto(_std_conv_model())).model
    assert "w_flat" not in p.graph.initializers


def test_a_tied_head_left_float_says_why() -> None:
    """BERT's masked-LM decoder reads the transpose of the embedding table: the reason named it an activation x
    activation product."""
    rng = np.random.default_rng(5)
    e = numpy_helper.from_array(rng.standard_normal((300, 64)).astype(np.float32), "E")
    w = numpy_helper.from_array((rng.standard_normal((64, 64)) * 0.1).astype(np.float32), "W")
    nodes = [helper.make_node("Gather", ["E", "ids"], ["h"], name="embed"),
             helper.make_node("MatMul", ["h", "W"], ["h2"], name="dense"),
             helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0], name="head_t"),
             helper.make_node("MatMul", ["h2", "Et"], ["logits"], name="decoder")]
    g = helper.make_graph(nodes, "mlm", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 5])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 5, 300])], [e, w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    cal = [{"ids": np.random.default_rng(s).integers(0, 300, (2, 5)).astype(np.int64)} for s in range(3)]
    res = quantkit.quantize(m, cal, {"version": 1, "name": "mlm", "report": {"latency": {"enabled": False}}},
                            evaluate=False, progress=False)
    assert "a tied embedding table" in res.plan.skipped["decoder"] and "dense" in res.plan.layers
