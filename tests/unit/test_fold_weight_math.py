"""Weights computed from weights (weight standardization, as BiT / NFNet "StdConv" export it) are folded into
constants by the prep pipeline beyond onnxscript's size limits, so the layer can be quantized (it stayed float:
"weight is not a constant")."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh


def _std_conv_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32, 3, 3)).astype(np.float32)  # 18432 elements: over onnxscript's 8192
    w0 = rng.standard_normal((32, 3, 3, 3)).astype(np.float32) * 0.3
    nodes = [
        h.make_node("Conv", ["input", "w0"], ["c0"], pads=[1, 1, 1, 1], name="conv0"),
        h.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        h.make_node("ReduceMean", ["w", "axes"], ["mu"], keepdims=1, name="w_mean"),
        h.make_node("Sub", ["w", "mu"], ["wc"], name="w_center"),
        h.make_node("Mul", ["wc", "wc"], ["wc2"], name="w_sq"),
        h.make_node("ReduceMean", ["wc2", "axes"], ["var"], keepdims=1, name="w_var"),
        h.make_node("Add", ["var", "eps"], ["ve"], name="w_eps"),
        h.make_node("Sqrt", ["ve"], ["sd"], name="w_sd"),
        h.make_node("Div", ["wc", "sd"], ["ws"], name="w_std"),
        h.make_node("Conv", ["r0", "ws"], ["y"], pads=[1, 1, 1, 1], name="std_conv"),
    ]
    inits = [nh.from_array(w0, "w0"), nh.from_array(w, "w"), nh.from_array(np.array([1, 2, 3], np.int64), "axes"),
             nh.from_array(np.array(1e-5, np.float32), "eps")]
    g = h.make_graph(nodes, "stdconv", [h.make_tensor_value_info("input", T.FLOAT, ["N", 3, 16, 16])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["N", 64, 16, 16])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 18)])
    m.ir_version = 8
    return m


def test_standardized_weight_is_folded_and_the_conv_quantized() -> None:
    from quantkit.api import quantize
    from quantkit.prep.pipeline import prepare
    from tests.conftest import image_batches

    model = _std_conv_model()
    prepped = prepare(ir.from_proto(model)).model
    conv = next(n for n in prepped.graph if n.name == "std_conv")
    assert conv.inputs[1] is not None and conv.inputs[1].const_value is not None  # a constant now
    assert not [n for n in prepped.graph if n.op_type in ("ReduceMean", "Sqrt", "Div")]
    x = image_batches(1, seed=4)[0]["input"]
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    got = ort.InferenceSession(ir.to_proto(prepped).SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)  # the same function
    recipe = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}}}
    res = quantize(model, image_batches(2), recipe, evaluation_data=image_batches(1, seed=2), progress=False)
    assert "std_conv" in res.plan.layers, res.plan.skipped.get("std_conv")
