"""A value read inside a subgraph (an ``If`` branch reading an outer tensor) stays float: the layer that makes it
stays float too (no Q without readers, no unfused layer), the rest of the model is quantized and runs, and the
kernel check does not isolate the ``If`` (its body reads values that are no inputs of the node)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh


def _if_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def w(*sh: int) -> np.ndarray:
        return (rng.standard_normal(sh) * np.sqrt(2.0 / np.prod(sh[1:]))).astype(np.float32)

    inits = [nh.from_array(w(8, 3, 3, 3), "W1"), nh.from_array(w(8, 8, 3, 3), "W2"), nh.from_array(w(8, 8, 3, 3), "W3"),
             nh.from_array(w(8, 8, 3, 3), "W4"), nh.from_array(np.array(0.0, np.float32), "zero")]
    then_g = h.make_graph([h.make_node("Conv", ["r1", "W2"], ["t"], pads=[1, 1, 1, 1], name="then_conv"),
                           h.make_node("Relu", ["t"], ["t_out"], name="then_relu")], "then", [],
                          [h.make_tensor_value_info("t_out", T.FLOAT, None)])
    else_g = h.make_graph([h.make_node("Conv", ["r1", "W3"], ["e"], pads=[1, 1, 1, 1], name="else_conv"),
                           h.make_node("Sigmoid", ["e"], ["e_out"], name="else_sigmoid")], "else", [],
                          [h.make_tensor_value_info("e_out", T.FLOAT, None)])
    nodes = [h.make_node("Conv", ["input", "W1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
             h.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             h.make_node("ReduceMean", ["input"], ["m"], keepdims=0, name="mean"),
             h.make_node("Greater", ["m", "zero"], ["cond"], name="greater"),
             h.make_node("If", ["cond"], ["br"], then_branch=then_g, else_branch=else_g, name="branch"),
             h.make_node("Conv", ["br", "W4"], ["c4"], pads=[1, 1, 1, 1], name="conv4"),
             h.make_node("Relu", ["c4"], ["r4"], name="relu4"),
             h.make_node("Conv", ["r4", "W4"], ["y"], pads=[1, 1, 1, 1], name="conv5")]
    g = h.make_graph(nodes, "ifnet", [h.make_tensor_value_info("input", T.FLOAT, ["N", 3, 16, 16])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["N", 8, 16, 16])], inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def test_a_value_read_inside_an_if_branch_stays_float() -> None:
    from quantkit.api import quantize
    from tests.conftest import image_batches

    model = _if_model()
    recipe = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False}}}
    res = quantize(model, image_batches(2), recipe, evaluation_data=image_batches(1, seed=2), progress=False)
    assert "conv1" in res.plan.skipped and "subgraph" in res.plan.skipped["conv1"]
    assert {"conv4", "conv5"} <= set(res.plan.layers)
    # the branches' own layers are named with why they stay float
    assert {"then_conv", "else_conv"} <= {f["layer"] for f in res.report["float_layers"]}
    assert "inside a subgraph" in res.plan.skipped["then_conv"]
    assert res.report["census"]["leftover_by_kind"]["stray"] == 0, res.report["census"]
    assert not res.report["unfused"], res.report["unfused"]
    import onnx_ir as ir

    proto = ir.to_proto(res.model)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = image_batches(1, seed=3)[0]["input"]
    (got,) = sess.run(None, {"input": x})
    (ref,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": x})
    assert 10 * np.log10(np.sum(ref**2) / np.sum((ref - got) ** 2)) > 20
