"""Values that rewrites and the lowering create carry their element type: untyped ones were dropped from the
serialized model with a stderr line each ("The value type for shape [b,64] is not known ... Skipping
serialization"), up to 20 per run on a CNN whose spatial mean became GlobalAveragePool + Flatten."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import quantkit


def _mean_cnn() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 3, 3, 3)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array((rng.standard_normal((10, 16)) * 0.3).astype(np.float32), "fc")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("ReduceMean", ["r"], ["m"], name="mean", axes=[2, 3], keepdims=0),
             helper.make_node("Gemm", ["m", "fc"], ["logits"], name="head", transB=1)]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def test_no_value_is_left_without_a_type(capfd: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(1)
    cal = [{"x": rng.standard_normal((4, 3, 16, 16)).astype(np.float32)} for _ in range(4)]
    res = quantkit.quantize(_mean_cnn(), cal, {"version": 1, "name": "t", "report": {"latency": {"enabled": False}}},
                            evaluation_data=cal[:2], progress=False)
    assert res.plan.layers
    untyped = [v.name for n in res.model.graph for v in n.outputs if v.shape is not None and v.type is None]
    assert untyped == []
    assert "value type for shape" not in capfd.readouterr().err
