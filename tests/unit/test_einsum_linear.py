"""Linear layers written as Einsum with a constant weight (JAX / TensorFlow conversions, hand-written PyTorch) are
rewritten as MatMul by prep - exact - so they quantize; ONNX Runtime has no int8 Einsum, and they stayed float
with a misleading reason."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import quantkit
from quantkit.prep import prepare
from quantkit.prep.einsum import linear_einsum


@pytest.mark.parametrize(("eq", "want"), [
    ("btd,dk->btk", False), ("btd,kd->btk", True), ("...d,dk->...k", False), ("bd, dk -> bk", False),
    ("bhqd,bhkd->bhqk", None), ("btd,dk->bkt", None), ("btd,dd->btd", None), ("btd,de,ek->btk", None),
    ("btd,dk", None), ("bdt,dk->btk", None), ("...d,dk->k", None),
])
def test_which_equations_are_linear_layers(eq: str, want: bool | None) -> None:
    assert linear_einsum(eq) is want


def _model(eqs: list[str]) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i, eq in enumerate(eqs):
        shape = (16, 16)
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.25).astype(np.float32), f"W{i}"))
        out = "y" if i == len(eqs) - 1 else f"h{i}"
        nodes.append(helper.make_node("Einsum", [x, f"W{i}"], [out], equation=eq, name=f"dense{i}"))
        x = out
    g = helper.make_graph(nodes, "e", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 5, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 5, 16])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_the_rewrite_is_exact_and_the_layers_quantize() -> None:
    m = _model(["btd,dk->btk", "btd,kd->btk", "...d,dk->...k"])
    x = np.random.default_rng(1).standard_normal((3, 5, 16)).astype(np.float32)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    p = prepare(ir.from_proto(m)).model
    assert [n.op_type for n in p.graph] == ["MatMul"] * 3 and [n.name for n in p.graph] == ["dense0", "dense1",
                                                                                             "dense2"]
    got = ort.InferenceSession(ir.to_proto(p).SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    cal = [{"x": np.random.default_rng(s).standard_normal((4, 5, 16)).astype(np.float32)} for s in range(4)]
    rec: dict = {"version": 1, "name": "einsum", "report": {"latency": {"enabled": False}}}
    res = quantkit.quantize(m, cal, rec, evaluation_data=cal[:2], progress=False)
    assert set(res.plan.layers) >= {"dense0", "dense1", "dense2"} and res.report["fidelity"]["y"]["sqnr_db"] > 25
    # overrides by op_type: Einsum keep matching the rewritten layers
    rec["quantization"] = {"overrides": [{"op_type": "Einsum", "format": "fp32"}]}
    res = quantkit.quantize(m, cal, rec, evaluate=False, progress=False)
    assert not res.plan.layers


@pytest.mark.parametrize(("eq", "want"), [
    ("abc,cde->abde", ([0, 1, 2], 1, 2)), ("abcd,cde->abe", ([0, 1, 2], 2, 1)), ("abc,dce->abde", ([1, 0, 2], 1, 2)),
    ("aecd,abcd->acbe", None), ("abc,cde->abed", ([0, 2, 1], 1, 2)), ("abc,ace->abe", None),
])
def test_keras_einsum_dense_equations(eq: str, want: object) -> None:
    from quantkit.prep.einsum import einsum_layer

    assert einsum_layer(eq) == want


def test_multi_head_projections_with_3d_weights_become_matmuls() -> None:
    """Keras' EinsumDense: q = abc,cde->abde (to heads), o = abcd,cde->abe (back); exact, and both quantize."""
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 4, 8)) * 0.25).astype(np.float32), "wq"),
             numpy_helper.from_array((rng.standard_normal((4, 8, 16)) * 0.25).astype(np.float32), "wo")]
    nodes = [helper.make_node("Einsum", ["x", "wq"], ["q"], equation="abc,cde->abde", name="q_dense"),
             helper.make_node("Relu", ["q"], ["r"], name="act"),
             helper.make_node("Einsum", ["r", "wo"], ["y"], equation="abcd,cde->abe", name="o_dense")]
    g = helper.make_graph(nodes, "k", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 5, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 5, 16])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    p = prepare(ir.from_proto(m)).model
    assert not any(n.op_type == "Einsum" for n in p.graph)
    got = ort.InferenceSession(ir.to_proto(p).SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    cal = [{"x": rng.standard_normal((4, 5, 16)).astype(np.float32)} for _ in range(4)]
    res = quantkit.quantize(m, cal, {"version": 1, "name": "k", "report": {"latency": {"enabled": False}}},
                            evaluation_data=cal[:2], progress=False)
    assert {"q_dense", "o_dense"} <= set(res.plan.layers) and res.report["fidelity"]["y"]["sqnr_db"] > 25
