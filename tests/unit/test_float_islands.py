"""Blocks whose int8 chain used to break into a stray float round trip: a pre-activation BatchNorm after a
Concat (DenseNet), a residual stream that also feeds a LayerNorm (ConvNeXt); and the honest census of what must
stay float - a DequantizeLinear into an op with no int8 kernel in ONNX Runtime is a *float island* with its
reason, not a stray Q/DQ (quantkit.prep.preact_batchnorm, quantkit.lowering.select rule 2,
quantkit.report.build.classify_leftovers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from quantkit.api import quantize
from quantkit.prep import prepare
from tests.conftest import image_batches
from tests.tiny_graphs import TinyGraph

C = 8


def _graph(kind: str, seed: int = 0, gamma_sign: float = 1.0) -> onnx.ModelProto:
    """``input[N,3,16,16] -> Conv -> Relu -> <block> -> Conv -> Relu -> out``."""
    g = TinyGraph(seed)
    rng, w, c, node = g.rng, g.w, g.c, g.node

    x = node("Relu", [node("Conv", ["input", w("w0", C, 3, 3, 3), w("b0", C, s=0.1)], "c0", pads=[1, 1, 1, 1])],
             "r0")
    if kind == "dense":  # DenseNet: Concat -> BatchNorm -> Relu -> Conv (the BN cannot fold into a layer)
        y = node("Conv", [x, w("w1", C, C, 3, 3, s=0.1)], "c1", pads=[1, 1, 1, 1])
        cat = node("Concat", [x, y], "cat", axis=1)
        gamma = rng.uniform(0.5, 2.0, 2 * C) * gamma_sign
        bn = node("BatchNormalization", [cat, c("g", gamma), c("be", rng.uniform(-0.5, 0.5, 2 * C)),
                                         c("mu", rng.uniform(-0.2, 0.5, 2 * C)), c("var", rng.uniform(0.2, 2.0, 2 * C))],
                  "bn")
        a = node("Conv", [node("Relu", [bn], "r1"), w("w2", C, 2 * C, 1, 1, s=0.2)], "c2")
    elif kind == "preact":  # a BatchNorm after an activation (pre-activation block): nothing to fold it into
        bn = node("BatchNormalization", [x, c("g", rng.uniform(0.5, 2.0, C) * gamma_sign),
                                         c("be", rng.uniform(-0.5, 0.5, C)), c("mu", rng.uniform(-0.2, 0.5, C)),
                                         c("var", rng.uniform(0.2, 2.0, C))], "bn")
        a = node("Conv", [node("Relu", [bn], "r1"), w("w2", C, C, 1, 1, s=0.2)], "c2")
    elif kind == "layernorm":  # ConvNeXt's downsample: Conv -> LayerNorm (channels last) -> Conv
        t = node("Transpose", [x], "t0", perm=[0, 2, 3, 1])
        ln = node("LayerNormalization", [t, c("lg", rng.uniform(0.5, 1.5, C)), c("lb", rng.uniform(-0.2, 0.2, C))],
                  "ln", axis=-1)
        a = node("Transpose", [ln], "t1", perm=[0, 3, 1, 2])
    elif kind == "residual_to_layernorm":  # a residual Add read by an int8 Conv and by a float LayerNorm
        y = node("Conv", [x, w("w1", C, C, 3, 3, s=0.1)], "c1", pads=[1, 1, 1, 1])
        r = node("Add", [x, y], "res")
        t = node("Transpose", [r], "t0", perm=[0, 2, 3, 1])
        ln = node("LayerNormalization", [t, c("lg", rng.uniform(0.5, 1.5, C)), c("lb", rng.uniform(-0.2, 0.2, C))],
                  "ln", axis=-1)
        z = node("Conv", [r, w("w2", C, C, 1, 1, s=0.2)], "c2")
        v = node("Conv", [node("Transpose", [ln], "t1", perm=[0, 3, 1, 2]), w("w4", C, C, 1, 1, s=0.2)], "c4")
        a = node("Add", [z, v], "a0")
    else:
        raise ValueError(kind)
    out = node("Relu", [node("Conv", [a, w("w3", C, C, 3, 3, s=0.1), w("b3", C, s=0.1)], "c3", pads=[1, 1, 1, 1])],
               "out")
    return g.model(kind, out, ["N", C, 16, 16])


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feed)[0]


def _sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    ref64 = ref.astype(np.float64)
    return float(10 * np.log10(np.sum(ref64**2) / max(np.sum((ref64 - got) ** 2), 1e-30)))


def _quantize(model: onnx.ModelProto) -> Any:
    rec = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}}}
    return quantize(model, image_batches(8), rec, evaluation_data=image_batches(4, seed=9), progress=False)


def test_preact_batchnorm_is_rewritten_exactly_in_float() -> None:
    model = _graph("dense")
    prep = prepare(ir.from_proto(model))
    assert prep.applied["preact_batchnorm"] == 1
    from quantkit.ops import batchnorm_shift

    [bn] = [n for n in prep.model.graph if n.op_type == "BatchNormalization"]
    assert batchnorm_shift(bn) is not None  # still a BatchNorm in float (ORT's fast FP32 path), now exactly x + b/a
    feed = image_batches(1, seed=3)[0]
    ref, got = _run(model, feed), _run(ir.to_proto(prep.model), feed)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))


def test_dense_block_is_one_int8_chain() -> None:
    model = _graph("dense")
    res = _quantize(model)
    assert res.census.quantized_kernels == {"QLinearConv": 4, "QLinearConcat": 1, "QLinearAdd": 1}
    assert "BatchNormalization" not in res.census.op_counts
    kinds = res.report["census"]["leftover_by_kind"]
    assert kinds["stray"] == 0 and kinds["float_island"] == 0, res.census.leftover_qdq_nodes
    assert all(item.at_graph_input or item.at_graph_output for item in res.census.leftovers)
    check = res.report["kernels"]["check"]
    assert check["agree"], check["first_parted"]  # the fused kernels compute the QDQ math, layer by layer
    feed = image_batches(1, seed=42, batch=4)[0]
    assert _sqnr_db(_run(model, feed), _run(ir.to_proto(res.model), feed)) > 30


def test_preact_block_is_one_int8_chain_and_a_negative_scale_stays_a_float_island_with_its_reason() -> None:
    res = _quantize(_graph("preact"))
    assert res.census.quantized_kernels == {"QLinearConv": 3, "QLinearAdd": 1}
    assert res.report["census"]["leftover_by_kind"]["float_island"] == 0
    model = _graph("preact", gamma_sign=-1.0)  # Relu(-|a| x + b) is not |a| Relu(...): no rewrite
    assert prepare(ir.from_proto(model)).applied["preact_batchnorm"] == 0
    res = _quantize(model)
    cen = res.report["census"]
    assert cen["leftover_by_kind"]["stray"] == 0, cen["leftover_qdq_nodes"]
    assert cen["leftover_by_kind"]["float_island"] == 1
    assert "no int8 kernel" in cen["float_islands"]["BatchNormalization"]["reason"]
    assert res.census.quantized_kernels == {"QLinearConv": 3}


def _head(flatten: str) -> onnx.ModelProto:
    """``Conv -> Relu -> BatchNorm -> Relu -> GlobalAveragePool -> Flatten | Reshape -> Gemm``: the last
    pre-activation BatchNorm of a DenseNet / pre-activation ResNet before its classifier."""
    rng = np.random.default_rng(1)
    t = numpy_helper.from_array
    inits = [t((rng.standard_normal((C, 3, 3, 3)) * 0.3).astype(np.float32), "w0"),
             t(rng.uniform(0.5, 2.0, C).astype(np.float32), "g"), t(rng.uniform(-0.5, 0.5, C).astype(np.float32), "be"),
             t(rng.uniform(-0.2, 0.5, C).astype(np.float32), "mu"), t(rng.uniform(0.2, 2.0, C).astype(np.float32), "var"),
             t((rng.standard_normal((10, C)) * 0.3).astype(np.float32), "fc_w"),
             t((rng.standard_normal(10) * 0.1).astype(np.float32), "fc_b"), t(np.array([-1, C], np.int64), "shape")]
    nodes = [helper.make_node("Conv", ["input", "w0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
             helper.make_node("BatchNormalization", ["r0", "g", "be", "mu", "var"], ["bn"], name="bn"),
             helper.make_node("Relu", ["bn"], ["r1"], name="relu1"),
             helper.make_node("GlobalAveragePool", ["r1"], ["p"], name="pool"),
             (helper.make_node("Flatten", ["p"], ["f"], name="flat") if flatten == "Flatten" else
              helper.make_node("Reshape", ["p", "shape"], ["f"], name="flat")),
             helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["logits"], name="fc", transB=1)]
    g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 3, 16, 16])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_preact_batchnorm_before_a_classifier_head_scales_the_head() -> None:
    for flatten in ("Flatten", "Reshape"):
        model = _head(flatten)
        prep = prepare(ir.from_proto(model))
        assert prep.applied["preact_batchnorm"] == 1, flatten
        feed = image_batches(1, seed=3)[0]
        ref, got = _run(model, feed), _run(ir.to_proto(prep.model), feed)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
        res = _quantize(model)
        assert res.census.quantized_kernels == {"QLinearConv": 1, "QLinearAdd": 1, "QLinearGlobalAveragePool": 1,
                                                "QGemm": 1}, (flatten, res.census.quantized_kernels)
        assert res.report["census"]["leftover_by_kind"]["stray"] == 0
        check = res.report["kernels"]["check"]
        assert check["agree"], check["first_parted"]


def test_layernorm_is_a_float_island_not_a_stray() -> None:
    res = _quantize(_graph("layernorm"))
    cen = res.report["census"]
    assert cen["leftover_by_kind"]["stray"] == 0, cen["leftover_qdq_nodes"]
    assert cen["float_islands"]["LayerNormalization"]["count"] == 1
    assert "LayerNormalization has no int8 kernel" in cen["float_islands"]["LayerNormalization"]["reason"]
    assert res.census.quantized_kernels.get("QLinearConv") == 2


def test_a_residual_add_read_by_int8_and_float_ops_stays_int8() -> None:
    res = _quantize(_graph("residual_to_layernorm"))
    assert "res_node" in res.plan.layers  # one int8 consumer is enough: the float one reads a chain exit
    assert res.census.quantized_kernels == {"QLinearConv": 5, "QLinearAdd": 2}
    cen = res.report["census"]
    assert cen["leftover_by_kind"]["stray"] == 0, cen["leftover_qdq_nodes"]
    assert cen["float_islands"]["LayerNormalization"]["count"] == 1  # the LayerNorm's DQ enters an island
    check = res.report["kernels"]["check"]
    assert check["agree"], check["first_parted"]
