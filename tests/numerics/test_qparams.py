"""compute_qparams / weight_qparams / bias_int32 / QuantSpec: conventions and properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quantkit.errors import CalibrationError, RecipeError, UnknownNameError
from quantkit.scheme import (
    QuantSpec,
    bias_int32,
    bias_scale,
    compute_qparams,
    dequantize,
    int_type,
    quantize,
    weight_qparams,
)

DTYPES = ["int8", "uint8", "int4", "uint4", "int16", "uint16"]
finite32 = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


def test_int_type_table() -> None:
    assert (int_type("int8").qmin, int_type("int8").qmax) == (-128, 127)
    assert (int_type("uint4").qmin, int_type("uint4").qmax, int_type("uint4").bits) == (0, 15, 4)
    assert int_type("int4").numpy_dtype == np.int8
    assert int_type("int8").grid(reduce_range=True) == (-64, 63)
    assert int_type("uint8").grid(reduce_range=True) == (0, 127)
    with pytest.raises(UnknownNameError, match="int8"):
        int_type("int7")


def test_symmetric_convention() -> None:
    s, z = compute_qparams(-2.0, 1.0, "int8", symmetric=True)
    assert s.dtype == np.float32 and z.dtype == np.int8
    assert s == np.float32(2.0 / 127.5) and z == 0
    s, z = compute_qparams(-2.0, 1.0, "uint8", symmetric=True)
    assert s == np.float32(2.0 / 127.5) and z == 128
    s, z = compute_qparams(-1.0, 3.0, "int4", symmetric=True)
    assert s == np.float32(3.0 / 7.5) and z == 0
    assert compute_qparams(0.0, 1.0, "uint4", symmetric=True)[1] == 8
    assert compute_qparams(0.0, 1.0, "uint16", symmetric=True)[1] == 32768
    # uint8 symmetric is int8 symmetric shifted by +128
    x = np.linspace(-2, 2, 101, dtype=np.float32)
    si, zi = compute_qparams(-2.0, 2.0, "int8", symmetric=True)
    su, zu = compute_qparams(-2.0, 2.0, "uint8", symmetric=True)
    np.testing.assert_array_equal(quantize(x, si, zi).astype(np.int32) + 128, quantize(x, su, zu))


def test_asymmetric_and_zero_included() -> None:
    s, z = compute_qparams(-1.0, 3.0, "uint8", symmetric=False)
    assert s == np.float32(4.0 / 255) and z == 64  # rint(0 - (-1) / (4/255)) = rint(63.75)
    s, z = compute_qparams(2.0, 5.0, "uint8", symmetric=False)  # widened to [0, 5]
    assert s == np.float32(5.0 / 255) and z == 0
    s, z = compute_qparams(-5.0, -2.0, "int8", symmetric=False)  # widened to [-5, 0]
    assert z == 127


def test_zero_and_tiny_ranges_give_finite_positive_scales() -> None:
    s, z = compute_qparams(np.zeros(3), np.zeros(3), "int8", symmetric=False)
    np.testing.assert_array_equal(s, np.ones(3, np.float32))
    np.testing.assert_array_equal(z, [-128, -128, -128])
    s, _ = compute_qparams(0.0, 0.0, "int8", symmetric=True)
    assert s == 1.0
    s, _ = compute_qparams(-1e-45, 1e-45, "int8", symmetric=True)
    assert s == np.finfo(np.float32).tiny
    with pytest.raises(CalibrationError, match="non-finite"):
        compute_qparams(-np.inf, 1.0, "int8", symmetric=False)
    with pytest.raises(CalibrationError):
        compute_qparams(0.0, np.nan, "int8", symmetric=False)


def test_reduce_range() -> None:
    s, z = compute_qparams(0.0, 127.0, "uint8", symmetric=False, reduce_range=True)
    assert s == 1.0 and z == 0
    s, z = compute_qparams(-63.5, 63.5, "int8", symmetric=True, reduce_range=True)
    assert s == 1.0 and z == 0


@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    symmetric=st.booleans(),
    bounds=st.tuples(finite32, finite32),
    fractions=hnp.arrays(np.float64, 64, elements=st.floats(0, 1)),
)
def test_roundtrip_error_at_most_half_step(
    dtype: str, symmetric: bool, bounds: tuple[float, float], fractions: np.ndarray
) -> None:
    """|x - dq(q(x))| <= scale/2 for every x in the (zero-widened) calibrated range; 0 is exact."""
    mn, mx = min(bounds), max(bounds)
    scale, zp = compute_qparams(mn, mx, dtype, symmetric=symmetric)
    lo, hi = min(mn, 0.0), max(mx, 0.0)
    x = np.concatenate([(lo + fractions * (hi - lo)), [lo, hi, 0.0]]).astype(np.float32)
    x = np.clip(x, np.float32(lo), np.float32(hi))
    err = np.abs(x - dequantize(quantize(x, scale, zp, dtype=dtype), scale, zp))
    # The float32 scale (relative error 2**-24) is multiplied by up to |q - zp| <= 2**bits steps, and
    # x/scale and (q - zp) * scale each round once: a few float32 ulps of the range extent, which for
    # 16-bit grids is ~0.004 of a step.
    tol = float(scale) * 0.5 + 4 * float(np.finfo(np.float32).eps) * max(abs(lo), abs(hi)) + 1e-37
    assert err.max() <= tol, (err.max(), tol)
    assert dequantize(quantize(np.float32(0.0), scale, zp, dtype=dtype), scale, zp) == 0.0


@settings(max_examples=50, deadline=None)
@given(w=hnp.arrays(np.float32, (5, 12), elements=st.floats(-100, 100, width=32)), symmetric=st.booleans())
def test_weight_qparams_granularities(w: np.ndarray, symmetric: bool) -> None:
    s, z = weight_qparams(w, QuantSpec("int8", symmetric, "tensor"))
    assert s.shape == () and z.shape == ()
    s, z = weight_qparams(w, QuantSpec("int8", symmetric, "channel", axis=1))
    es, ez = compute_qparams(w.min(axis=0), w.max(axis=0), "int8", symmetric=symmetric)
    np.testing.assert_array_equal(s, es)
    np.testing.assert_array_equal(z, ez)
    s, z = weight_qparams(w, QuantSpec("int4", symmetric, "group", axis=1, group_size=5))
    assert s.shape == (5, 3)
    blocks = [w[:, 0:5], w[:, 5:10], w[:, 10:12]]
    es, ez = compute_qparams(
        np.stack([b.min(axis=1) for b in blocks], 1),
        np.stack([b.max(axis=1) for b in blocks], 1),
        "int4",
        symmetric=symmetric,
    )
    np.testing.assert_array_equal(s, es)
    np.testing.assert_array_equal(z, ez)
    q = quantize(w, s, z, axis=1, block_size=5, dtype="int4")
    err = np.abs(w - dequantize(q, s, z, axis=1, block_size=5))
    assert np.all(err <= np.repeat(s, 5, axis=1)[:, :12] * (0.5 + 1e-4))


def test_weight_qparams_conv_and_matmul_axes() -> None:
    conv = np.random.default_rng(0).normal(size=(8, 3, 3, 3)).astype(np.float32)
    s, _ = weight_qparams(conv, QuantSpec("int8", True, "channel", axis=0))
    np.testing.assert_allclose(s, np.abs(conv).reshape(8, -1).max(axis=1) / 127.5, rtol=1e-7)
    matmul = np.random.default_rng(1).normal(size=(64, 16)).astype(np.float32)  # [K, N]
    s, _ = weight_qparams(matmul, QuantSpec("int4", True, "group", axis=0, group_size=32))
    assert s.shape == (2, 16)
    with pytest.raises(RecipeError, match="axis=2"):
        weight_qparams(matmul, QuantSpec("int8", True, "channel", axis=2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "int3", "symmetric": True}, "dtype='int3'.*allowed"),
        ({"dtype": "int8", "symmetric": True, "granularity": "row"}, "granularity='row'.*allowed"),
        ({"dtype": "int8", "symmetric": True, "granularity": "channel"}, "axis=None"),
        ({"dtype": "int8", "symmetric": True, "axis": 0}, "axis=0"),
        ({"dtype": "int8", "symmetric": True, "granularity": "group", "axis": 0}, "group_size=None"),
        (
            {"dtype": "int8", "symmetric": True, "granularity": "group", "axis": 0, "group_size": 0},
            "group_size=0",
        ),
        ({"dtype": "int8", "symmetric": True, "group_size": 32}, "group_size=32"),
        ({"dtype": "int8", "symmetric": "yes"}, "symmetric='yes'"),
    ],
)
def test_quant_spec_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(RecipeError, match=match):
        QuantSpec(**kwargs)


def test_bias_int32() -> None:
    b = np.array([0.5, -1.25, 1e9, -1e9, 0.0, 3 * 0.5 * 0.25], np.float32)
    q = bias_int32(b, np.float32(0.5), np.array([0.25] * 6, np.float32))
    assert q.dtype == np.int32
    np.testing.assert_array_equal(q, [4, -10, 2**31 - 1, -(2**31), 0, 3])
    assert bias_scale(np.float32(0.1), np.float32(0.3)) == np.float32(0.1) * np.float32(0.3)
    # ties round half to even: 2.5 -> 2, 3.5 -> 4
    np.testing.assert_array_equal(bias_int32([2.5, 3.5], 1.0, 1.0), [2, 4])
    with pytest.raises(CalibrationError):
        bias_int32([1.0], 0.0, 1.0)


@pytest.mark.parametrize(("shape", "axis", "block"), [((576, 40), 0, 128), ((64, 9), 0, 32), ((5, 70), 1, 32),
                                                      ((2100, 2001), 0, 128), ((2001, 2100), 1, 32),
                                                      ((3, 6, 10), 2, 4), ((7,), 0, 3), ((4, 8), -1, 8)])
@pytest.mark.parametrize("zp_dtype", ["uint4", "uint8", None])
def test_blocked_quantize_and_dequantize_match_the_expanded_parameters(shape: tuple[int, ...], axis: int, block: int,
                                                                      zp_dtype: str | None) -> None:
    """quantize / dequantize apply a blocked scale block by block (whole blocks as a view, a ragged last block
    apart): the same codes and values as the scale and zero point repeated to the tensor's shape."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    x.flat[0], x.flat[-1] = np.nan, np.inf
    a = axis % len(shape)
    pshape = tuple(-(-d // block) if i == a else d for i, d in enumerate(shape))
    scale = ((rng.random(pshape) + 0.05) * np.where(rng.random(pshape) < 0.5, -1, 1)).astype(np.float32)
    hi = {"uint4": 16, "uint8": 256}
    zp = None if zp_dtype is None else rng.integers(0, hi[zp_dtype], pshape).astype(np.uint8)
    dtype = zp_dtype or "int8"
    s_full = np.repeat(scale, block, axis=a).take(np.arange(shape[a]), axis=a)
    z_full = (np.zeros((), np.int32) if zp is None else
              np.repeat(zp.astype(np.int32), block, axis=a).take(np.arange(shape[a]), axis=a))
    q = quantize(x, scale, zp, axis=axis, block_size=block, dtype=dtype)
    it = {"uint4": (0, 15), "uint8": (0, 255), "int8": (-128, 127)}[dtype]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        v = np.rint(x / s_full)
    v = np.clip(v, it[0] - z_full, it[1] - z_full)
    v = np.where(np.isnan(v), it[0] - z_full, v)
    np.testing.assert_array_equal(q, (v.astype(np.int32) + z_full).astype(q.dtype))
    dq = dequantize(q, scale, zp, axis=axis, block_size=block)
    np.testing.assert_array_equal(dq, ((q.astype(np.int32) - z_full).astype(np.float32) * s_full).astype(np.float32))
    with pytest.raises(ValueError, match="blocked scale must have shape"):
        quantize(x, scale[..., :1] if scale.shape[-1] > 1 else np.ones((2,) * scale.ndim, np.float32), axis=axis,
                 block_size=block)
