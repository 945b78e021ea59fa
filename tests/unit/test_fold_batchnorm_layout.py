"""BatchNormalization read through a Reshape / Transpose folded into the linear layer before it
(:mod:`quantkit.prep.fold_batchnorm_layout`): exact in float (ONNX Runtime with its own fusions off), and refused
whenever the layout node could mix features or a value is shared."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx.parser
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from quantkit.prep import prepare
from quantkit.prep.fold_batchnorm_layout import fold_batchnorm_through_layout


def _model(text: str, arrays: dict[str, np.ndarray]) -> onnx.ModelProto:
    model = onnx.parser.parse_model(text)
    model.graph.initializer.extend(numpy_helper.from_array(a, name) for name, a in arrays.items())
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model)


def _bn(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    return {"g": rng.uniform(0.5, 1.5, n).astype(np.float32), "be": rng.standard_normal(n).astype(np.float32),
            "mu": rng.standard_normal(n).astype(np.float32), "var": rng.uniform(0.1, 2.0, n).astype(np.float32)}


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # ORT would fold the BN itself
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feed)[0]


def _ops(model: ir.Model) -> dict[str, int]:
    return dict(collections.Counter(n.op_type for n in model.graph))


RESHAPE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 7, 16] x) => (float[2, 7, 12] y) {{
    {body}
    z = Reshape (h, flat)
    n = BatchNormalization <epsilon = 0.001> (z, g, be, mu, var)
    y = Reshape (n, back)
}}
"""
TRANSPOSE = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 7, 16] x) => (float[2, 12, 7] y) {{
    {body}
    z = Transpose <perm = [0, 2, 1]> (h)
    n = BatchNormalization (z, g, be, mu, var)
    y = Relu (n)
}}
"""
BODIES = {"matmul": "h = MatMul (x, w)", "matmul_add": "m = MatMul (x, w)\n    h = Add (m, b)",
          "add_commuted": "m = MatMul (x, w)\n    h = Add (b, m)"}


@pytest.mark.parametrize("body", sorted(BODIES))
@pytest.mark.parametrize("layout", ["reshape", "transpose"])
def test_fold_is_exact(layout: str, body: str) -> None:
    rng = np.random.default_rng(3)
    arrays = {"w": rng.standard_normal((16, 12)).astype(np.float32), **_bn(rng, 12),
              "flat": np.array([-1, 12], np.int64), "back": np.array([2, 7, 12], np.int64)}
    if "Add" in BODIES[body]:
        arrays["b"] = rng.standard_normal(12).astype(np.float32)
    text = (RESHAPE if layout == "reshape" else TRANSPOSE).format(body=BODIES[body])
    if layout == "transpose":
        del arrays["flat"], arrays["back"]
    proto = _model(text, arrays)
    model = ir.serde.deserialize_model(proto)
    assert fold_batchnorm_through_layout(model) == 1
    assert "BatchNormalization" not in _ops(model)
    assert _ops(model)["Add"] == 1 and _ops(model)["MatMul"] == 1
    feed = {"x": rng.standard_normal((2, 7, 16)).astype(np.float32)}
    after = ir.serde.serialize_model(model)
    onnx.checker.check_model(after)
    np.testing.assert_allclose(_run(after, feed), _run(proto, feed), rtol=0, atol=1e-4)


@pytest.mark.parametrize("case", ["control", "mixing_reshape", "perm_keeps_sequence_on_axis_1", "shared_weight",
                                  "product_read_twice", "training_outputs"])
def test_refused(case: str) -> None:
    rng = np.random.default_rng(5)
    arrays = {"w": rng.standard_normal((16, 12)).astype(np.float32), **_bn(rng, 12)}
    body = "h = MatMul (x, w)"
    extra = ""
    outputs = "float[2, 12, 7] y"
    layout = "z = Transpose <perm = [0, 2, 1]> (h)"
    bn = "n = BatchNormalization (z, g, be, mu, var)\n    y = Relu (n)"
    if case == "mixing_reshape":  # [2, 7, 12] -> [12, 14]: 168 elements, the feature axis not kept
        layout = "z = Reshape (h, flat)"
        arrays["flat"] = np.array([12, 14], np.int64)
        arrays.update(_bn(rng, 14))
        outputs = "float[12, 14] y"
    elif case == "perm_keeps_sequence_on_axis_1":
        layout = "z = Transpose <perm = [2, 1, 0]> (h)"
        arrays.update(_bn(rng, 7))
        outputs = "float[12, 7, 2] y"
    elif case == "shared_weight":
        extra = "\n    u = MatMul (x, w)\n    v = ReduceSum <keepdims = 0> (u)"
        outputs += ", float v"
    elif case == "product_read_twice":
        extra = "\n    v = ReduceSum <keepdims = 0> (h)"
        outputs += ", float v"
    elif case == "training_outputs":
        bn = "n, rm, rv = BatchNormalization <training_mode = 1> (z, g, be, mu, var)\n    y = Relu (n)"
        outputs += ", float[12] rm, float[12] rv"
    text = f"""
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 7, 16] x) => ({outputs}) {{
    {body}
    {layout}
    {bn}{extra}
}}
"""
    proto = _model(text, arrays)
    model = ir.serde.deserialize_model(proto)
    assert fold_batchnorm_through_layout(model) == (1 if case == "control" else 0)
    assert _ops(model).get("BatchNormalization", 0) == (0 if case == "control" else 1)


def test_prepare_folds_linear_bn_through_reshape() -> None:
    """The pass runs inside ``prepare`` and the prepared model computes the same function."""
    rng = np.random.default_rng(9)
    arrays = {"w": rng.standard_normal((16, 12)).astype(np.float32), **_bn(rng, 12),
              "flat": np.array([-1, 12], np.int64), "back": np.array([2, 7, 12], np.int64)}
    proto = _model(RESHAPE.format(body=BODIES["matmul"]), arrays)
    model = ir.serde.deserialize_model(proto)
    result = prepare(model)
    assert result.applied["fold_batchnorm_layout"] == 1
    assert "BatchNormalization" not in _ops(model)
    feed = {"x": rng.standard_normal((2, 7, 16)).astype(np.float32)}
    np.testing.assert_allclose(_run(ir.serde.serialize_model(model), feed), _run(proto, feed), rtol=0, atol=1e-4)
