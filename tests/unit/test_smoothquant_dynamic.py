"""SmoothQuant scales and the dynamic-activation INT8 lowering (exact against a NumPy model of ORT)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from quantkit.algorithms.smoothquant import (
    ChannelAbsMax,
    choose_alpha,
    int8_weight_per_column,
    smooth_scales,
    w8a8_error,
)
from quantkit.errors import RecipeError
from quantkit.lowering.dynamic import lower_int8_dynamic
from quantkit.lowering.nbits import apply_input_scale
from quantkit.scheme.saturation import emulate_u8s8, pair_violations
from quantkit.scheme.target import _read_cpu, cpu_class_saturates


def _model(K: int, N: int, seed: int = 0) -> tuple[ir.Model, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    gamma = (rng.random(K) + 0.5).astype(np.float32)
    W = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    text = f"""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[B, T, {K}] x) => (float[B, T, {N}] y) {{
        h = Mul(x, gamma)
        y = MatMul(h, W)
    }}"""
    proto = onnx.parser.parse_model(text)
    proto.graph.node[0].name, proto.graph.node[1].name = "norm", "proj"
    proto.graph.initializer.extend(
        [onnx.numpy_helper.from_array(gamma, "gamma"), onnx.numpy_helper.from_array(W, "W")]
    )
    return ir.from_proto(proto), gamma, W


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    s = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def _outlier_x(K: int, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((2, 16, K)).astype(np.float32)
    x[..., 3] *= 40.0  # an outlier channel, as in LLM activations
    return x


def test_per_token_lowering_is_exact_against_numpy() -> None:
    K, N = 64, 48
    model, gamma, W = _model(K, N)
    q, sc = int8_weight_per_column(W)
    lower_int8_dynamic(model, _matmul_name(model), q, sc)
    x = _outlier_x(K)
    got = _run(model, x)
    h = (x * gamma).reshape(-1, K)
    a = np.maximum(np.abs(h).max(1, keepdims=True) / np.float32(127), np.float32(1e-12))
    codes = np.clip(np.round(h / a), -128, 127)  # uint8 storage with zero point 128 == int8 grid
    # the kernel of the running CPU class: raw uint8 codes x int8 weights (int16 pair sums saturate on x86
    # without VNNI), the zero point compensated exactly with the column sums
    acc = emulate_u8s8((codes + 128).astype(np.uint8), q, saturate=cpu_class_saturates(_read_cpu().cpu_class))
    acc = acc.astype(np.int64) - 128 * q.astype(np.int64).sum(axis=0)
    ref = acc * a * sc
    # float32 accumulation order differs only: bound well below one activation quantization step
    np.testing.assert_allclose(got.reshape(-1, N), ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    exact = (codes * a) @ (q.astype(np.float32) * sc)
    if not cpu_class_saturates(_read_cpu().cpu_class):
        np.testing.assert_allclose(got.reshape(-1, N), exact, rtol=1e-4, atol=1e-4 * float(np.abs(exact).max()))


def test_pair_safe_per_token_lowering_is_exact_on_every_cpu_class() -> None:
    K, N = 64, 48
    model, gamma, W = _model(K, N)
    q, sc = int8_weight_per_column(W, pair_safe=True)
    assert not pair_violations(q).any()
    lower_int8_dynamic(model, _matmul_name(model), q, sc)
    x = _outlier_x(K)
    got = _run(model, x)
    h = (x * gamma).reshape(-1, K)
    a = np.maximum(np.abs(h).max(1, keepdims=True) / np.float32(127), np.float32(1e-12))
    codes = np.clip(np.round(h / a), -128, 127)
    u8 = (codes + 128).astype(np.uint8)
    np.testing.assert_array_equal(emulate_u8s8(u8, q), emulate_u8s8(u8, q, saturate=False))
    exact = (codes * a) @ (q.astype(np.float32) * sc)
    np.testing.assert_allclose(got.reshape(-1, N), exact, rtol=1e-4, atol=1e-4 * float(np.abs(exact).max()))
    ops = [n.op_type for n in model.graph]
    assert "MatMulIntegerToFloat" in ops and "MatMul" not in ops


def _matmul_name(model: ir.Model) -> str:
    return "proj"


def test_per_tensor_lowering_is_dynamic_quantize_matmul() -> None:
    model, _, W = _model(32, 16)
    q, sc = int8_weight_per_column(W)
    lower_int8_dynamic(model, _matmul_name(model), q, sc, granularity="per_tensor")
    assert [n.op_type for n in model.graph] == ["Mul", "DynamicQuantizeMatMul"]
    with pytest.raises(RecipeError, match="allowed: .*per_token"):
        lower_int8_dynamic(model, "x", q, sc, granularity="per_row")


def test_smoothing_is_exact_in_float_and_folds_into_the_preceding_mul() -> None:
    K, N = 64, 48
    model, _, W = _model(K, N)
    x = _outlier_x(K)
    ref = _run(model, x)
    st = ChannelAbsMax()
    st.update(x * model.graph.initializers["gamma"].const_value.numpy())  # type: ignore[union-attr]
    s = smooth_scales(st.absmax, [W], 0.5)  # type: ignore[arg-type]
    name = _matmul_name(model)
    how = apply_input_scale(model, [name], s)
    assert "folded into Mul" in how
    model.graph.initializers["W"].const_value = ir.tensor(W * s[:, None])  # type: ignore[union-attr]
    node = next(n for n in model.graph if n.op_type == "MatMul")
    node.replace_input_with(1, model.graph.initializers["W"])
    np.testing.assert_allclose(_run(model, x), ref, rtol=1e-4, atol=1e-4)


def test_smoothing_reduces_w8a8_error_on_outlier_channels() -> None:
    K, N = 64, 48
    rng = np.random.default_rng(3)
    W = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    x = _outlier_x(K).reshape(-1, K)
    st = ChannelAbsMax(max_rows=32)
    st.update(x)
    plain = w8a8_error(x, [W], None, per_token=False)
    s, alpha, errs = choose_alpha(st, [W], "auto", per_token=False)
    assert s is not None and alpha is not None
    assert w8a8_error(x, [W], s, per_token=False) < plain / 2
    assert set(errs) >= {"none", "0.5"}
    with pytest.raises(RecipeError, match="alpha"):
        smooth_scales(st.absmax, [W], 1.5)  # type: ignore[arg-type]


def test_channel_absmax_state_round_trip_and_merge() -> None:
    a, b = ChannelAbsMax(max_rows=8), ChannelAbsMax(max_rows=8)
    x = _outlier_x(16)
    a.update(x[:1])
    b.update(x[1:])
    a.merge(b)
    np.testing.assert_array_equal(a.absmax, np.abs(x).reshape(-1, 16).max(0))  # type: ignore[arg-type]
    r = ChannelAbsMax.from_state(a.state())
    np.testing.assert_array_equal(r.absmax, a.absmax)  # type: ignore[arg-type]
    assert r.seen == 32 and r.rows is not None and r.rows.shape == (8, 16)
