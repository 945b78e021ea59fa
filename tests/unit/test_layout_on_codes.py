"""``DQ -> Transpose / Reshape -> Q`` on one per-tensor grid is emitted as the layout op on the 8-bit codes (exact):
ONNX Runtime's level-1 transpose optimizer used to move such a Transpose out of its group and leave a DQ -> Q
pair that nothing fuses (FocalNet: 60 stray nodes, now 40)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from quantkit.lowering.qdq import _layout_on_codes


def _graph(op: str, scale2: float) -> object:
    inits = [numpy_helper.from_array(np.array(0.05, np.float32), "s"),
             numpy_helper.from_array(np.array(scale2, np.float32), "s2"),
             numpy_helper.from_array(np.array(128, np.uint8), "z"),
             numpy_helper.from_array(np.array([2, 12], np.int64), "shape")]
    layout = (helper.make_node("Transpose", ["xd"], ["t"], perm=[0, 2, 1], name="layout") if op == "Transpose"
              else helper.make_node("Reshape", ["xd", "shape"], ["t"], name="layout"))
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q0"),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq0"),
             layout,
             helper.make_node("QuantizeLinear", ["t", "s2", "z"], ["tq"], name="q1"),
             helper.make_node("DequantizeLinear", ["tq", "s2", "z"], ["y"], name="dq1")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _run(proto: object, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("op", ["Transpose", "Reshape"])
def test_a_layout_op_between_one_grid_moves_onto_the_codes_exactly(op: str) -> None:
    x = np.random.default_rng(0).uniform(-6, 6, (2, 3, 4)).astype(np.float32)
    before = _graph(op, 0.05)
    model = ir.from_proto(before)
    assert _layout_on_codes(model.graph) == 1
    after = ir.to_proto(model)
    assert [n.op_type for n in after.graph.node] == ["QuantizeLinear", op, "DequantizeLinear"]
    np.testing.assert_array_equal(_run(after, x), _run(before, x))


def test_another_grid_is_left_alone() -> None:
    model = ir.from_proto(_graph("Transpose", 0.07))
    assert _layout_on_codes(model.graph) == 0
    assert len(list(model.graph)) == 5
