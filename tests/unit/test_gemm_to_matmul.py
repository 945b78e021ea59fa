"""Gemm(A, B, C) with a constant B -> MatMul(A, alpha * B') + Add(beta * C): same outputs as ORT's Gemm."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from quantkit.prep.gemm_to_matmul import gemm_to_matmul


@pytest.mark.parametrize(
    "trans_b,alpha,beta,bias", [(1, 1.0, 1.0, True), (0, 0.5, 2.0, True), (1, 1.0, 1.0, False)]
)
def test_gemm_rewrite_is_exact(trans_b: int, alpha: float, beta: float, bias: bool) -> None:
    rng = np.random.default_rng(0)
    B = rng.standard_normal((8, 6) if trans_b else (6, 8)).astype(np.float32)
    C = rng.standard_normal(8).astype(np.float32)
    inputs = ["a", "B"] + (["C"] if bias else [])
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("Gemm", inputs, ["y"], name="fc", transB=trans_b, alpha=alpha, beta=beta)],
        "g",
        [onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, ["N", 6])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 8])],
        [onnx.numpy_helper.from_array(B, "B"), onnx.numpy_helper.from_array(C, "C")],
    )
    proto = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 18)])
    m = ir.from_proto(proto)
    assert gemm_to_matmul(m) == 1
    ops = [n.op_type for n in m.graph]
    assert ops == (["MatMul", "Add"] if bias else ["MatMul"]) and next(iter(m.graph)).name == "fc"
    a = rng.standard_normal((3, 6)).astype(np.float32)
    run = [
        ort.InferenceSession(x.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]
        for x in (proto, ir.to_proto(m))
    ]
    np.testing.assert_allclose(run[1], run[0], rtol=1e-5, atol=1e-5)
    assert "B" not in m.graph.initializers  # the [N, K] original is gone; only the [K, N] copy remains


def test_gemm_with_transposed_a_is_left_alone() -> None:
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("Gemm", ["a", "B"], ["y"], transA=1)],
        "g",
        [onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [6, 3])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3, 8])],
        [onnx.numpy_helper.from_array(np.ones((6, 8), np.float32), "B")],
    )
    m = ir.from_proto(onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 18)]))
    assert gemm_to_matmul(m) == 0
