"""A MatMul whose constant weight is the first operand (``y = W @ x``) is quantized (prep rewrites it with the weight
second, exact): it stayed float with the reason "weight is not a constant"; ONNX Runtime's quantize_static
quantizes it."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import quantkit
from quantkit.prep.left_weight import constant_left_matmul

RNG = np.random.default_rng(0)


def _model() -> onnx.ModelProto:
    g = h.make_graph([h.make_node("MatMul", ["W", "x"], ["a"], name="mix"), h.make_node("Relu", ["a"], ["r"]),
                      h.make_node("MatMul", ["r", "W2"], ["y"], name="head")],
                     "g", [h.make_tensor_value_info("x", T.FLOAT, ["n", 16, 20])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["n", 24, 8])],
                     [nh.from_array((RNG.standard_normal((24, 16)) / 4).astype(np.float32), "W"),
                      nh.from_array((RNG.standard_normal((20, 8)) / 4).astype(np.float32), "W2")])  # fmt: skip
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _run(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_the_rewrite_is_exact_and_keeps_the_layer_name() -> None:
    m = _model()
    model = ir.from_proto(m)
    assert constant_left_matmul(model) == 1
    assert [n.op_type for n in model.graph][:3] == ["Transpose", "MatMul", "Transpose"]
    assert [n.name for n in model.graph if n.op_type == "MatMul"] == ["mix", "head"]
    x = RNG.standard_normal((3, 16, 20)).astype(np.float32)
    np.testing.assert_allclose(_run(ir.to_proto(model), x), _run(m, x), rtol=1e-5, atol=1e-5)


def test_a_left_constant_matmul_is_quantized() -> None:
    m = _model()
    data = [{"x": RNG.standard_normal((1, 16, 20)).astype(np.float32)} for _ in range(16)]
    rec = {"version": 1, "name": "left", "report": {"latency": {"enabled": False}}}
    res = quantkit.quantize(m, data, rec, evaluate=False, progress=False)
    assert "mix" not in {r["layer"] for r in res.report["float_layers"]}, res.report["float_layers"]
    assert any(r["layer"] == "mix" for r in res.report["layers"])
    x = RNG.standard_normal((4, 16, 20)).astype(np.float32)
    ref, got = _run(m, x), _run(ir.to_proto(res.model), x)
    sqnr = 10 * np.log10(np.sum(ref**2) / np.sum((ref - got) ** 2))
    assert sqnr > 25, sqnr


def test_a_gemm_with_trans_a_is_quantized() -> None:
    """``Gemm(A, B, transA=1)``: A transposed before it (exact); it stayed float ("Gemm with transA=1")."""
    g = h.make_graph([h.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
                      h.make_node("Gemm", ["xt", "B", "C"], ["g"], name="gemm", transA=1),
                      h.make_node("Relu", ["g"], ["y"])],
                     "g", [h.make_tensor_value_info("x", T.FLOAT, ["n", 16])], [h.make_tensor_value_info("y", T.FLOAT, ["n", 8])],
                     [nh.from_array((RNG.standard_normal((16, 8)) / 4).astype(np.float32), "B"),
                      nh.from_array(np.full(8, 0.1, np.float32), "C")])  # fmt: skip
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    data = [{"x": RNG.standard_normal((1, 16)).astype(np.float32)} for _ in range(16)]
    rec = {"version": 1, "name": "trans-a", "report": {"latency": {"enabled": False}}}
    res = quantkit.quantize(m, data, rec, evaluate=False, progress=False)
    assert "gemm" not in {r["layer"] for r in res.report["float_layers"]}, res.report["float_layers"]
    x = RNG.standard_normal((4, 16)).astype(np.float32)
    ref, got = _run(m, x), _run(ir.to_proto(res.model), x)
    assert 10 * np.log10(np.sum(ref**2) / np.sum((ref - got) ** 2)) > 25
