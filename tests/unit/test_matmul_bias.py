"""Rule 8 of :mod:`quantkit.lowering.select`: a MatMul's bias ``Add`` is part of the layer.  Where the biased
output feeds an int8 op, the emitted model runs one ``MatMulIntegerToFloat`` with the bias inside and one
QuantizeLinear (one rounding) - not a ``QLinearMatMul`` and a ``QLinearAdd`` of the bias (two) - and the chain goes
on through it; a BatchNorm after a Linear on a sequence (folded by prep) gives exactly this pattern."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from quantkit.api import quantize
from tests.conftest import image_batches
from tests.tiny_graphs import TinyGraph

C = 16


def _recipe() -> dict[str, Any]:
    return {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}}}


def _model(bn: bool) -> onnx.ModelProto:
    """Conv -> tokens [N, 256, C] -> MatMul + bias -> Relu -> MatMul + bias, or with the first Linear's bias a
    BatchNorm1d over the flattened tokens (Reshape -> BatchNormalization -> Reshape, no Relu: the Reshape before it
    could not carry its clip) as LeViT has it."""
    g = TinyGraph(3)
    x = g.node("Relu", [g.node("Conv", ["input", g.w("w0", C, 3, 3, 3), g.w("b0", C, s=0.1)], "c0",
                               pads=[1, 1, 1, 1])], "r0")
    t = g.node("Transpose", [g.node("Reshape", [x, g.c("to_seq", [0, C, 256], np.int64)], "seq")], "tok",
               perm=[0, 2, 1])
    h = g.node("MatMul", [t, g.w("w1", C, C)], "m1")
    if bn:  # LeViT's Linear without bias + BatchNorm1d over the flattened tokens
        flat = g.node("Reshape", [h, g.c("flat", [-1, C], np.int64)], "flat_out")
        n = g.node("BatchNormalization", [flat, g.c("gamma", g.rng.uniform(0.5, 1.5, C)),
                                          g.c("beta", g.rng.standard_normal(C) * 0.1), g.c("mean", np.zeros(C)),
                                          g.c("var", g.rng.uniform(0.5, 1.5, C))], "bn")
        r = g.node("Reshape", [n, g.c("back", [-1, 256, C], np.int64)], "a1")
    else:
        r = g.node("Relu", [g.node("Add", [h, g.w("bias1", C, s=0.1)], "a1")], "r1")
    y = g.node("Add", [g.node("MatMul", [r, g.w("w2", C, 10)], "m2"), g.w("bias2", 10, s=0.1)], "out")
    return g.model("matmul_bias", y, ["N", 256, 10])


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feed)[0]


def test_bias_is_part_of_the_layer() -> None:
    for bn in (False, True):
        model = _model(bn)
        res = quantize(model, image_batches(8), _recipe(), evaluation_data=image_batches(4, seed=9), progress=False)
        assert set(res.plan.layer_biases.values()) == {"m1_node", "m2_node"}, res.plan.layer_biases
        kernels = res.census.quantized_kernels
        # one product per MatMul, the bias inside it; nothing rounds the bias on its own
        assert kernels.get("MatMulIntegerToFloat") == 2 and "QLinearAdd" not in kernels, kernels
        assert "QLinearMatMul" not in kernels, kernels
        assert res.report["census"]["leftover_by_kind"]["stray"] == 0, res.census.leftover_qdq_nodes
        assert not {"Add", "BatchNormalization"} & {k.split(".")[-1] for k in res.census.op_counts}, \
            res.census.op_counts
        # the first product's output is quantized once (on the Relu's clipped range), and the chain goes on
        first = res.lowering.tensors["a1" if bn else "r1"]
        assert bn or (first.zero_point == 0 and first.dtype == "uint8")
        assert res.report["kernels"]["check"]["agree"]
        feed = image_batches(1, seed=42, batch=2)[0]
        ref, got = _run(model, feed).astype(np.float64), _run(ir.to_proto(res.model), feed)
        sqnr = 10 * np.log10(np.sum(ref**2) / np.sum((ref - got) ** 2))
        assert sqnr > 30, sqnr


def test_a_bias_whose_product_has_another_reader_stays_glue() -> None:
    """When the product is also read elsewhere, the Add is not its bias (rule 8 needs the only reader)."""
    from quantkit.lowering.select import bias_matmul

    g = TinyGraph(1)
    m = g.node("MatMul", ["input", g.w("w", 16, 16)], "m")
    a = g.node("Add", [m, g.w("b", 16, s=0.1)], "a")
    g.node("Add", [a, m], "out")
    model = ir.serde.deserialize_model(g.model("shared", "out", ["N", 3, 16, 16]))
    nodes = {n.name: n for n in model.graph}
    assert bias_matmul(nodes["a_node"]) is None
    assert bias_matmul(nodes["out_node"]) is None  # no constant operand
