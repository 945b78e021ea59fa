"""prep's identity elimination keeps every graph's outputs (quantkit.prep.identity): onnx_ir's pass renamed an
Identity's input to its output name, which merged two model outputs into one (``y``, ``y_copy = Identity(y)``),
made an ``If`` branch return an outer value (ONNX Runtime refused the model: an internal error) and listed a
``Scan`` body's value twice (ONNX Runtime then computed garbage for the Scan, silently)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from quantkit.prep.identity import eliminate_identities
from quantkit.prep.pipeline import prepare

RNG = np.random.default_rng(0)


def _w(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    m = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _run(m: onnx.ModelProto, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in s.get_outputs()], s.run(None, feed), strict=True))


def _prepared(m: onnx.ModelProto) -> onnx.ModelProto:
    return ir.to_proto(prepare(ir.from_proto(m)).model)


def _same(a: onnx.ModelProto, b: onnx.ModelProto, feed: dict[str, np.ndarray]) -> None:
    ra, rb = _run(a, feed), _run(b, feed)
    assert list(ra) == list(rb)  # the same output names, in order
    for k in ra:
        np.testing.assert_allclose(rb[k], ra[k], rtol=1e-5, atol=1e-6)


def test_an_output_copied_by_identity_stays_two_outputs() -> None:
    g = h.make_graph([h.make_node("MatMul", ["x", "W"], ["y"]), h.make_node("Identity", ["y"], ["y_copy"]),
                      h.make_node("Identity", ["y"], ["inner"]), h.make_node("Relu", ["inner"], ["r"])],
                     "g", [h.make_tensor_value_info("x", T.FLOAT, ["n", 4])],
                     [h.make_tensor_value_info(n, T.FLOAT, ["n", 3]) for n in ("y", "y_copy", "r")],
                     [nh.from_array(_w(4, 3), "W")])  # fmt: skip
    m = _model(g)
    out = _prepared(m)
    assert [o.name for o in out.graph.output] == ["y", "y_copy", "r"]
    assert sum(n.op_type == "Identity" for n in out.graph.node) == 1  # the inner one went, the output copy stays
    _same(m, out, {"x": RNG.standard_normal((2, 4)).astype(np.float32)})


def test_an_if_branch_returning_an_outer_value_keeps_its_identity() -> None:
    then_g = h.make_graph([h.make_node("Identity", ["hid"], ["then_out"])], "then", [],
                          [h.make_tensor_value_info("then_out", T.FLOAT, ["n", 8])])  # fmt: skip
    else_g = h.make_graph([h.make_node("Relu", ["hid"], ["else_out"])], "else", [],
                          [h.make_tensor_value_info("else_out", T.FLOAT, ["n", 8])])  # fmt: skip
    g = h.make_graph([h.make_node("MatMul", ["x", "W1"], ["hid"]), h.make_node("ReduceSum", ["hid"], ["s"], keepdims=0),
                      h.make_node("Greater", ["s", "zero"], ["cond"]),
                      h.make_node("If", ["cond"], ["picked"], then_branch=then_g, else_branch=else_g),
                      h.make_node("MatMul", ["picked", "W2"], ["y"])],
                     "g", [h.make_tensor_value_info("x", T.FLOAT, ["n", 4])], [h.make_tensor_value_info("y", T.FLOAT, ["n", 2])],
                     [nh.from_array(_w(4, 8), "W1"), nh.from_array(_w(8, 2), "W2"),
                      nh.from_array(np.array(0.0, np.float32), "zero")])  # fmt: skip
    m = _model(g)
    out = _prepared(m)  # before the fix: ONNX Runtime refused the branch (its output an outer value)
    for sign in (1.0, -1.0):  # both branches
        x = np.abs(RNG.standard_normal((3, 4))).astype(np.float32) * sign
        _same(m, out, {"x": x})


def test_a_scan_body_output_copied_by_identity_is_not_listed_twice() -> None:
    body = h.make_graph([h.make_node("MatMul", ["s_in", "Ws"], ["a"]), h.make_node("Add", ["a", "xt"], ["c"]),
                         h.make_node("Tanh", ["c"], ["s_out"]), h.make_node("Identity", ["s_out"], ["scan_out"])],
                        "body", [h.make_tensor_value_info("s_in", T.FLOAT, ["n", 6]),
                                 h.make_tensor_value_info("xt", T.FLOAT, ["n", 6])],
                        [h.make_tensor_value_info("s_out", T.FLOAT, ["n", 6]),
                         h.make_tensor_value_info("scan_out", T.FLOAT, ["n", 6])])  # fmt: skip
    g = h.make_graph([h.make_node("Scan", ["s0", "x"], ["sf", "seq"], body=body, num_scan_inputs=1,
                                  scan_input_axes=[1], scan_output_axes=[1]),
                      h.make_node("MatMul", ["sf", "Wo"], ["y"])],
                     "g", [h.make_tensor_value_info("s0", T.FLOAT, ["n", 6]), h.make_tensor_value_info("x", T.FLOAT, ["n", 5, 6])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["n", 2]), h.make_tensor_value_info("seq", T.FLOAT, ["n", 5, 6])],
                     [nh.from_array(_w(6, 6), "Ws"), nh.from_array(_w(6, 2), "Wo")])  # fmt: skip
    m = _model(g)
    out = _prepared(m)
    scan = next(n for n in out.graph.node if n.op_type == "Scan")
    outs = [o.name for o in next(a.g for a in scan.attribute if a.name == "body").output]
    assert len(set(outs)) == len(outs) == 2
    feed = {"s0": RNG.standard_normal((2, 6)).astype(np.float32), "x": RNG.standard_normal((2, 5, 6)).astype(np.float32)}
    _same(m, out, feed)


def test_plain_identities_still_go() -> None:
    g = h.make_graph([h.make_node("Identity", ["x"], ["a"]), h.make_node("Relu", ["a"], ["b"]),
                      h.make_node("Identity", ["b"], ["y"])],
                     "g", [h.make_tensor_value_info("x", T.FLOAT, ["n", 4])], [h.make_tensor_value_info("y", T.FLOAT, ["n", 4])])  # fmt: skip
    model = ir.from_proto(_model(g))
    assert eliminate_identities(model) == 2
    assert [n.op_type for n in model.graph] == ["Relu"]
    assert [o.name for o in model.graph.outputs] == ["y"]
