"""SplitToSequence in a model below opset 18 (Longformer's chunked attention): onnxscript's constant folding
rewrites it as Split(num_outputs=n), an attribute of opset 18 only, and ONNX Runtime refused the prepared graph -
an internal error ("a bug in quantkit").  Prep now gives such a Split its sizes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import quantkit
from quantkit.prep import prepare


def _model(opset: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 16)) * 0.2).astype(np.float32), n) for n in ("W", "W2")]
    inits += [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("sp", 2), ("i0", 0), ("i1", 1))]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"], name="mm1"),
             helper.make_node("SplitToSequence", ["a", "sp"], ["seq"], axis=1, name="s2s"),
             helper.make_node("SequenceAt", ["seq", "i0"], ["p0"], name="at0"),
             helper.make_node("SequenceAt", ["seq", "i1"], ["p1"], name="at1"),
             helper.make_node("Add", ["p0", "p1"], ["s"], name="add"),
             helper.make_node("MatMul", ["s", "W2"], ["y"], name="mm2")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 2, 16])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def test_a_folded_split_to_sequence_runs_at_the_models_opset() -> None:
    x = np.random.default_rng(1).standard_normal((3, 4, 16)).astype(np.float32)
    for opset in (17, 18):
        m = _model(opset)
        want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        prepared = prepare(ir.from_proto(m)).model
        splits = [n for n in prepared.graph if n.op_type == "Split"]
        assert splits and all(("num_outputs" in n.attributes) == (opset >= 18) for n in splits)
        got = ort.InferenceSession(ir.to_proto(prepared).SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_it_quantizes_end_to_end() -> None:
    rng = np.random.default_rng(2)
    cal = [{"x": rng.standard_normal((4, 4, 16)).astype(np.float32)} for _ in range(4)]
    res = quantkit.quantize(_model(17), cal, {"version": 1, "name": "s2s", "report": {"latency": {"enabled": False}}},
                            evaluation_data=cal[:2], progress=False)
    assert res.report["fidelity"]["y"]["sqnr_db"] > 25
