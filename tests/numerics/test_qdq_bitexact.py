"""quantkit.scheme.quantize / dequantize are bit-exact with ONNX Runtime's CPU QuantizeLinear / DequantizeLinear."""

from __future__ import annotations

import numpy as np
import pytest
from ort_qdq import ort_dequantize, ort_quantize

from quantkit.scheme import compute_qparams, dequantize, int_type, quantize

DTYPES = ["int8", "uint8", "int4", "uint4", "int16", "uint16"]


def _ties(scale: np.float32, k: np.ndarray) -> np.ndarray:
    """Values at and next to the .5 ties ``(k + 0.5) * scale`` (float32), where divide vs reciprocal differ."""
    x = ((k + 0.5) * scale).astype(np.float32)
    up = np.nextafter(x, np.float32(np.inf))
    down = np.nextafter(x, np.float32(-np.inf))
    return np.concatenate([x, up, down, (k * scale).astype(np.float32)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_tensor_ties_match_ort(dtype: str) -> None:
    it = int_type(dtype)
    rng = np.random.default_rng(0)
    span = min(it.qmax - it.qmin, 300)
    for _ in range(5):
        scale = np.float32(rng.uniform(1e-3, 2.0))
        zp = np.array(rng.integers(it.qmin, it.qmax + 1), it.numpy_dtype)
        k = rng.integers(-span, span, size=4001) + (it.qmin if not it.signed else 0)
        x = _ties(scale, k)
        ours = quantize(x, scale, zp, dtype=dtype)
        np.testing.assert_array_equal(ours, ort_quantize(x, np.array(scale), zp, dtype))


def test_division_not_reciprocal() -> None:
    """Pin the finding: ORT divides; multiplying by 1/scale gives different integers near ties."""
    scale = np.float32(0.1)
    x = _ties(scale, np.arange(-127, 127))
    ref = ort_quantize(x, np.array(scale), np.array(0, np.int8), "int8")
    by_reciprocal = np.clip(np.rint(x * (np.float32(1) / scale)), -128, 127).astype(np.int8)
    assert np.any(by_reciprocal != ref)
    np.testing.assert_array_equal(quantize(x, scale, np.int8(0)), ref)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int4", "uint4"])
def test_round_before_zero_point_and_half_even(dtype: str) -> None:
    # 0.5 + zp 3 -> 3 (round 0.5 -> 0, then + 3), 1.5 -> 2 + 3 = 5, -0.5 -> 0 + 3, 2.5 -> 2 + 3
    x = np.array([0.5, 1.5, -0.5, 2.5, -1.5, -2.5], np.float32)
    zp = np.array(3, int_type(dtype).numpy_dtype)
    ours = quantize(x, np.float32(1.0), zp, dtype=dtype)
    np.testing.assert_array_equal(ours, ort_quantize(x, np.array(np.float32(1.0)), zp, dtype))
    if int_type(dtype).signed:
        np.testing.assert_array_equal(ours, [3, 5, 3, 5, 1, 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_saturation_and_special_values(dtype: str) -> None:
    it = int_type(dtype)
    x = np.array(
        [np.nan, np.inf, -np.inf, 3e38, -3e38, 1e-45, -1e-45, 0.0, -0.0, 1e6, -1e6, 1e-38, 7.0, -9.0] * 3,
        np.float32,
    )
    for scale in (np.float32(1.0), np.float32(1e-38), np.float32(3e38), np.float32(1e-40)):
        zp = np.array((it.qmin + it.qmax + 1) // 2, it.numpy_dtype)
        ours = quantize(x, scale, zp, dtype=dtype)
        np.testing.assert_array_equal(ours, ort_quantize(x, np.array(scale), zp, dtype))
    assert quantize(np.array([np.nan], np.float32), np.float32(1), zp, dtype=dtype)[0] == it.qmin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_per_axis_match_ort(dtype: str, axis: int) -> None:
    it = int_type(dtype)
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(6, 5, 4)) * 3).astype(np.float32)
    c = x.shape[axis]
    lo, hi = (
        x.min(axis=tuple(i for i in range(3) if i != axis % 3)),
        x.max(axis=tuple(i for i in range(3) if i != axis % 3)),
    )
    scale, zp = compute_qparams(lo, hi, dtype, symmetric=False)
    assert scale.shape == (c,) and zp.dtype == it.numpy_dtype
    q = quantize(x, scale, zp, axis=axis, dtype=dtype)
    np.testing.assert_array_equal(q, ort_quantize(x, scale, zp, dtype, axis=axis))
    np.testing.assert_array_equal(
        dequantize(q, scale, zp, axis=axis), ort_dequantize(q, scale, zp, dtype, axis=axis)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("axis", "block"), [(0, 4), (1, 3), (1, 16), (-1, 2)])
def test_blocked_match_ort(dtype: str, axis: int, block: int) -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(10, 7)).astype(np.float32)
    a = axis % 2
    shape = list(x.shape)
    shape[a] = -(-x.shape[a] // block)
    scale = rng.uniform(0.01, 0.5, size=shape).astype(np.float32)
    it = int_type(dtype)
    zp = rng.integers(it.qmin, it.qmax + 1, size=shape).astype(it.numpy_dtype)
    q = quantize(x, scale, zp, axis=axis, block_size=block, dtype=dtype)
    np.testing.assert_array_equal(q, ort_quantize(x, scale, zp, dtype, axis=axis, block_size=block))
    np.testing.assert_array_equal(
        dequantize(q, scale, zp, axis=axis, block_size=block),
        ort_dequantize(q, scale, zp, dtype, axis=axis, block_size=block),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_per_tensor_full_grid_matches_ort(dtype: str) -> None:
    it = int_type(dtype)
    q = np.arange(it.qmin, it.qmax + 1, max(1, (it.qmax - it.qmin) // 500)).astype(it.numpy_dtype)
    for scale in (np.float32(0.1), np.float32(3.3e-5), np.float32(7e3)):
        zp = np.array(it.qmax - 1, it.numpy_dtype)
        np.testing.assert_array_equal(dequantize(q, scale, zp), ort_dequantize(q, np.array(scale), zp, dtype))
    np.testing.assert_array_equal(
        dequantize(q, np.float32(0.25)), ort_dequantize(q, np.array(np.float32(0.25)), None, dtype)
    )


def test_per_axis_opset13_int8() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 8)).astype(np.float32)
    scale, zp = compute_qparams(x.min(axis=0), x.max(axis=0), "int8", symmetric=True)
    np.testing.assert_array_equal(
        quantize(x, scale, zp, axis=1), ort_quantize(x, scale, zp, "int8", axis=1, opset=13)
    )
