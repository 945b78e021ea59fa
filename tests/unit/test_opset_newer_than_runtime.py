"""A model exported at a default-domain opset newer than this ONNX Runtime's quantization kernels (opset 28 for ONNX
Runtime 1.32: the float model runs, QuantizeLinear-28 has no kernel) is converted down to the newest opset those
kernels exist for before any work; it ended in an internal error (the emitted model could not be loaded)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh
from onnx import version_converter

import quantkit
from quantkit.prep.pipeline import _qdq_runs, qdq_opset_limit


def _cnn(opset: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    g = h.make_graph([h.make_node("Conv", ["x", "W", "B"], ["c"], pads=[1, 1, 1, 1]), h.make_node("Relu", ["c"], ["r"]),
                      h.make_node("GlobalAveragePool", ["r"], ["p"]), h.make_node("Flatten", ["p"], ["f"]),
                      h.make_node("Gemm", ["f", "W2", "B2"], ["y"], transB=1)],
                     "cnn", [h.make_tensor_value_info("x", T.FLOAT, ["n", 3, 16, 16])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["n", 5])],
                     [nh.from_array((rng.standard_normal((8, 3, 3, 3)) / 5).astype(np.float32), "W"),
                      nh.from_array(np.zeros(8, np.float32), "B"),
                      nh.from_array((rng.standard_normal((5, 8)) / 3).astype(np.float32), "W2"),
                      nh.from_array(np.zeros(5, np.float32), "B2")])  # fmt: skip
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 21)])
    m.ir_version = 10
    if opset != 21:
        m = version_converter.convert_version(m, opset)
        m.ir_version = onnx.IR_VERSION
    return m


def test_the_newest_onnx_opset_is_converted_down_to_runnable_quantization_kernels() -> None:
    newest = onnx.defs.onnx_opset_version()
    limit = qdq_opset_limit(newest)
    assert limit is not None and _qdq_runs(limit) and limit <= newest
    m = _cnn(newest)
    rng = np.random.default_rng(1)
    data = [{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(8)]
    rec = {"version": 1, "name": "newest-opset", "report": {"latency": {"enabled": False}}}
    res = quantkit.quantize(m, data, rec, evaluate=False, progress=False)
    proto = ir.to_proto(res.model)
    opset = next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx"))
    assert opset == limit
    assert any(n.op_type == "QuantizeLinear" for n in proto.graph.node)
    y = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, data[0])[0]
    ref = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, data[0])[0]
    assert y.shape == ref.shape and np.all(np.isfinite(y))
