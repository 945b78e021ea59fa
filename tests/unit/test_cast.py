"""FP16 / BF16 lowering: storage form (exact 16-bit rounding of the weight) and native form (shared,
merged casts)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from quantkit.errors import RecipeError
from quantkit.lowering.cast import bf16_round, lower_cast, merge_casts, round_to


def _chain(K: int = 32) -> onnx.ModelProto:
    """x -> a -> b (chained) and x -> c (shares a's input)."""
    rng = np.random.default_rng(0)
    p = onnx.parser.parse_model(f"""<ir_version: 9, opset_import: ["" : 18]>
    g (float[B, {K}] x) => (float[B, {K}] y, float[B, {K}] z) {{
        h = MatMul(x, Wa)
        y = MatMul(h, Wb)
        z = MatMul(x, Wc)
    }}""")
    for n, name in zip(p.graph.node, ("a", "b", "c"), strict=True):
        n.name = name
    for w in ("Wa", "Wb", "Wc"):
        p.graph.initializer.append(
            onnx.numpy_helper.from_array(rng.standard_normal((K, K)).astype(np.float32), w)
        )
    return p


def _run(m: ir.Model, x: np.ndarray) -> list[np.ndarray]:
    s = ort.InferenceSession(ir.to_proto(m).SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})


def test_bf16_rounding_is_round_half_even_like_onnx_cast() -> None:
    x = np.array([1.0, 1.00390625, 1.01171875, -3.3e-5, np.inf, 65504.0], np.float32)
    # ONNX Runtime's own Cast(float -> bfloat16 -> float) is the reference
    g = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Cast", ["x"], ["b"], to=onnx.TensorProto.BFLOAT16),
            onnx.helper.make_node("Cast", ["b"], ["y"], to=onnx.TensorProto.FLOAT),
        ],
        "c",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [6])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [6])],
    )
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(
        onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 18)]).SerializeToString(),
        so,
        providers=["CPUExecutionProvider"],
    ).run(None, {"x": x})[0]
    np.testing.assert_array_equal(round_to(x, "bf16"), ref)
    assert bf16_round(np.array([np.nan], np.float32))[0] == 0x7FC0


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_storage_form_is_exactly_the_rounded_weight(fmt: str) -> None:
    p = _chain()
    m = ir.from_proto(p)
    for n in ("a", "b", "c"):
        lower_cast(m, n, fmt)
    x = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    y, z = _run(m, x)
    w = {t.name: onnx.numpy_helper.to_array(t) for t in p.graph.initializer}
    np.testing.assert_allclose(y, (x @ round_to(w["Wa"], fmt)) @ round_to(w["Wb"], fmt), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(z, x @ round_to(w["Wc"], fmt), rtol=1e-5, atol=1e-4)
    kinds = {t.data_type for t in ir.to_proto(m).graph.initializer}
    assert kinds == {onnx.TensorProto.FLOAT16 if fmt == "fp16" else onnx.TensorProto.BFLOAT16}


def test_native_form_shares_and_merges_casts() -> None:
    m = ir.from_proto(_chain())
    for n in ("a", "b", "c"):
        lower_cast(m, n, "fp16", compute="native")
    casts_before = [n for n in m.graph if n.op_type == "Cast"]
    # a and c read x: one shared Cast(x); a's fp32 output cast feeds only b's fp16 input cast
    assert sum(1 for n in casts_before if n.name.endswith("input_cast")) == 2
    assert merge_casts(m) == 1
    ops = [n.op_type for n in m.graph]
    assert ops.count("Cast") == 3  # Cast(x), and one fp32 cast per graph output
    x = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    y, z = _run(m, x)  # ORT CPU runs fp16 MatMul (inserting its own casts)
    assert y.dtype == np.float32 and np.all(np.isfinite(y)) and z.shape == (3, 32)


def test_errors_name_layer_and_allowed_values() -> None:
    m = ir.from_proto(_chain())
    with pytest.raises(RecipeError, match="allowed: \\['bf16', 'fp16'\\]"):
        lower_cast(m, "a", "fp8")
    with pytest.raises(RecipeError, match="compute 'gpu'"):
        lower_cast(m, "a", "fp16", compute="gpu")
