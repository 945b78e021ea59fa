"""A ``DequantizeLinear`` read only by ``Shape`` / ``Size`` is dropped, the shape taken from the 8-bit codes (exact):
ONNX Runtime kept such a DQ, dequantizing a whole activation to learn its shape (FocalNet: 12 of the 51 DQ nodes in
its optimized graph)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantkit.lowering.qdq import _shape_on_codes


def _graph(second_reader: str) -> onnx.ModelProto:
    """``x -> Q -> {DQ -> Shape, DQ -> Relu}`` with a dynamic batch; ``second_reader`` also reads the Shape's DQ."""
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s"),
             numpy_helper.from_array(np.array(128, np.uint8), "z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q0"),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq_shape"),
             helper.make_node("Shape", ["xd"], ["shape"], name="shape"),
             helper.make_node("Size", ["xd"], ["size"], name="size"),
             helper.make_node(second_reader, ["xd"], ["extra"], name="extra"),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd2"], name="dq_relu"),
             helper.make_node("Relu", ["xd2"], ["y"], name="relu")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("shape", TensorProto.INT64, None),
            helper.make_tensor_value_info("size", TensorProto.INT64, None),
            helper.make_tensor_value_info("extra", TensorProto.INT64 if second_reader == "Shape" else TensorProto.FLOAT,
                                          None)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4])], outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _run(proto: onnx.ModelProto, x: np.ndarray, level: ort.GraphOptimizationLevel) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = level
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})


def _dq_count_in_ort(proto: onnx.ModelProto, tmp_path: Path) -> int:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sum(n.op_type == "DequantizeLinear" for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node)


def test_a_dq_read_only_for_its_shape_is_dropped_exactly(tmp_path: Path) -> None:
    x = np.random.default_rng(0).uniform(-6, 6, (2, 3, 4)).astype(np.float32)
    before = _graph("Shape")
    model = ir.from_proto(before)
    assert _shape_on_codes(model.graph) == 1
    after = ir.to_proto(model)
    assert [n.name for n in after.graph.node if n.op_type == "DequantizeLinear"] == ["dq_relu"]
    assert {n.input[0] for n in after.graph.node if n.op_type in ("Shape", "Size")} == {"xq"}
    for level in (ort.GraphOptimizationLevel.ORT_DISABLE_ALL, ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
        for a, b in zip(_run(after, x, level), _run(before, x, level), strict=True):
            np.testing.assert_array_equal(a, b)
    # ONNX Runtime keeps a DQ (one per reader) that only feeds Shape / Size (a dynamic batch): only the Relu's is left
    assert _dq_count_in_ort(before, tmp_path) == 4
    assert _dq_count_in_ort(after, tmp_path) == 1


@pytest.mark.parametrize("reader", ["Relu"])
def test_a_dq_also_read_by_a_float_op_is_left_alone(reader: str) -> None:
    model = ir.from_proto(_graph(reader))
    assert _shape_on_codes(model.graph) == 0
    assert sum(n.op_type == "DequantizeLinear" for n in model.graph) == 2
