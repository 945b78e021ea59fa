"""A float16 ONNX model (``model.half()`` before the export): computed in float32 by prep, quantized to int8 like
any float32 model, its float16 inputs and outputs kept (it was shipped unquantized: every layer 'weight dtype
float16 is not float32')."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from quantkit.api import quantize
from quantkit.prep.pipeline import prepare
from tests.conftest import image_batches, tiny_cnn


def _as_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every float32 initializer, input and output in float16, and a float16 ``Constant`` node and a
    ``Cast(to=float16)`` inside (what half-precision exports contain)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for i, t in enumerate(g.initializer):
        if t.data_type == TensorProto.FLOAT:
            g.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))
    for v in [*g.input, *g.output]:
        v.type.tensor_type.elem_type = TensorProto.FLOAT16
    del g.value_info[:]
    # the logits scaled by a float16 Constant after a float -> float16 round trip
    out = g.output[0].name
    last = next(n for n in g.node if out in n.output)
    last.output[list(last.output).index(out)] = "logits_raw"
    g.node.extend([
        helper.make_node("Cast", ["logits_raw"], ["logits_f32"], to=TensorProto.FLOAT),
        helper.make_node("Cast", ["logits_f32"], ["logits_f16"], to=TensorProto.FLOAT16),
        helper.make_node("Constant", [], ["half"], value=numpy_helper.from_array(np.array(0.5, np.float16))),
        helper.make_node("Mul", ["logits_f16", "half"], [out]),
    ])
    onnx.checker.check_model(m)
    return m


def _half_batches(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    return [{k: v.astype(np.float16) for k, v in b.items()} for b in image_batches(n, seed=seed)]


def test_prep_computes_a_float16_model_in_float32_behind_its_float16_interface() -> None:
    half = _as_float16(tiny_cnn())
    prepared = ir.to_proto(prepare(ir.from_proto(half)).model)
    types = {v.name: v.type.tensor_type.elem_type for v in prepared.graph.value_info}
    inner_f16 = [n for n, t in types.items() if t == TensorProto.FLOAT16]
    assert not inner_f16, inner_f16
    assert not [t.name for t in prepared.graph.initializer if t.data_type == TensorProto.FLOAT16]
    assert [v.type.tensor_type.elem_type for v in [*prepared.graph.input, *prepared.graph.output]] == [
        TensorProto.FLOAT16, TensorProto.FLOAT16]
    assert [v.name for v in prepared.graph.output] == [v.name for v in half.graph.output]
    x = _half_batches(1, seed=5)[0]
    run = {k: ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]
           for k, m in (("half", half), ("prepared", prepared))}
    assert run["prepared"].dtype == np.float16
    # the same function up to the float16 roundings between operators the float32 graph no longer makes
    np.testing.assert_allclose(run["prepared"].astype(np.float32), run["half"].astype(np.float32), rtol=2e-2,
                               atol=2e-2)


def test_a_float16_model_is_quantized_to_int8_and_keeps_its_float16_interface() -> None:
    half = _as_float16(tiny_cnn())
    rec = {"version": 1, "target": {"isa": "portable"}, "report": {"latency": {"enabled": False}}}
    res = quantize(half, _half_batches(4, seed=1), rec, evaluation_data=_half_batches(2, seed=3), progress=False)
    kernels = res.report["census"]["quantized_kernels"]
    assert kernels.get("QLinearConv", 0) == 3 and kernels.get("QGemm", 0) == 1, kernels
    assert not [f for f in res.report.get("float_layers") or [] if "float16" in str(f.get("reason"))]
    proto = ir.to_proto(res.model)
    assert [v.type.tensor_type.elem_type for v in [*proto.graph.input, *proto.graph.output]] == [
        TensorProto.FLOAT16, TensorProto.FLOAT16]
    x = _half_batches(1, seed=7)[0]
    y = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]
    y0 = ort.InferenceSession(half.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, x)[0]
    assert y.dtype == np.float16
    ref = y0.astype(np.float64)
    sqnr = 10 * np.log10(np.sum(ref**2) / np.sum((ref - y.astype(np.float64)) ** 2))
    assert sqnr > 25.0, sqnr
    assert res.report["fidelity"]["logits"]["sqnr_db"] > 25.0
