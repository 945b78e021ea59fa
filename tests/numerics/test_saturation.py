"""The int16 pair saturation of u8 x s8 kernels on x86 without VNNI: emulator, bound, pair-safe rounding.

Numeric checks against ONNX Runtime compare with the kernel *of the running CPU class* as emulated by
:func:`quantkit.scheme.saturation.emulate_u8s8`, so they hold on VNNI and non-VNNI machines alike; the
other class is covered by the emulator itself (checked against brute force here).
"""

from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from quantkit.algorithms.pair_rounding import pair_gptq, pair_safe_weight
from quantkit.scheme.saturation import (
    PAIR_LIMIT,
    constrained_round,
    conv_saturation_excess,
    emulate_u8s8,
    exact_int_matmul,
    from_kernel_view,
    kernel_view,
    pair_safe_codes,
    pair_violations,
    saturating_conv_reference,
)
from quantkit.scheme.target import _read_cpu, cpu_class_saturates


def _running_saturates() -> bool:
    return cpu_class_saturates(_read_cpu().cpu_class)


def _matmul_integer(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    g = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, list(a.shape))],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [a.shape[0], w.shape[1]])],
        [numpy_helper.from_array(w, "w")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"a": a})[0]


def test_ort_matmul_integer_is_the_emulated_kernel_of_this_cpu() -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (16, 64)).astype(np.uint8)
    w = rng.integers(-128, 128, (64, 32)).astype(np.int8)
    got = _matmul_integer(a, w)
    np.testing.assert_array_equal(got, emulate_u8s8(a, w, saturate=_running_saturates()))
    # the two classes really differ on full-range codes (so the line above tests something)
    assert np.mean(emulate_u8s8(a, w) != emulate_u8s8(a, w, saturate=False)) > 0.3


def _dense_u8s8(a: np.ndarray, q: np.ndarray, saturate: bool) -> np.ndarray:
    """Every pair formed and clipped: the emulator's definition, written out."""
    k = a.shape[1]
    a64 = np.concatenate([a.astype(np.int64), np.zeros((a.shape[0], k % 2), np.int64)], axis=1)
    q64 = np.concatenate([q.astype(np.int64), np.zeros((k % 2, q.shape[1]), np.int64)], axis=0)
    pair = a64[:, 0::2, None] * q64[None, 0::2] + a64[:, 1::2, None] * q64[None, 1::2]  # [M, P, N]
    return (np.clip(pair, -32768, 32767) if saturate else pair).sum(axis=1).astype(np.int32)


@pytest.mark.parametrize(("m", "k", "n", "lo", "hi", "qlim", "chunk"), [
    (7, 33, 5, 0, 256, 128, None), (16, 64, 24, 0, 256, 128, 3), (5, 1, 3, 0, 256, 128, None),
    (9, 40, 11, 0, 60, 128, None), (6, 20, 4, -200, 200, 128, None), (4, 32, 8, 0, 256, 40, None),
    (0, 8, 3, 0, 256, 128, None),
])
def test_emulator_forms_only_the_pairs_that_can_clip_with_the_same_result(
        m: int, k: int, n: int, lo: int, hi: int, qlim: int, chunk: int | None) -> None:
    # the emulator adds sat16(pair) - pair for the pairs that can clip to the exact sum (float64 BLAS): the same
    # accumulators as clipping every pair, for uint8 codes, small codes, odd K, any-sign inputs, empty inputs
    rng = np.random.default_rng(m * 1000 + k)
    a = rng.integers(lo, hi, (m, k)).astype(np.uint8 if lo >= 0 else np.int32)
    q = rng.integers(-qlim, qlim, (k, n)).astype(np.int8)
    for sat in (True, False):
        np.testing.assert_array_equal(emulate_u8s8(a, q, saturate=sat, chunk=chunk), _dense_u8s8(a, q, sat))
        np.testing.assert_array_equal(emulate_u8s8(a, q, saturate=sat, max_elements=7), _dense_u8s8(a, q, sat))


def test_exact_int_matmul_is_the_int64_matmul() -> None:
    rng = np.random.default_rng(4)
    a = rng.integers(0, 256, (2, 9, 300)).astype(np.uint8)
    b = rng.integers(-128, 128, (300, 17)).astype(np.int8)
    got = exact_int_matmul(a, b)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, np.matmul(a.astype(np.int64), b.astype(np.int64)))
    wide = rng.integers(-255, 256, (7, 2000))  # float32 blocks of 258 steps (255 * 255 * 258 < 2**24)
    w = rng.integers(-255, 256, (2000, 5))
    np.testing.assert_array_equal(exact_int_matmul(wide, w), wide @ w)
    worst = np.full((1, 1030), 255, np.int64)  # every partial sum at its largest, across block edges
    np.testing.assert_array_equal(exact_int_matmul(worst, np.full((1030, 2), -255, np.int64)), [[-255 * 255 * 1030] * 2])
    mid = rng.integers(-2**20, 2**20, (3, 40))  # too wide for float32 blocks: float64
    np.testing.assert_array_equal(exact_int_matmul(mid, mid.T), mid @ mid.T)
    big = np.full((1, 4), 2**40, np.int64)  # partial sums past 2**53: the int64 path, still exact
    np.testing.assert_array_equal(exact_int_matmul(big, np.full((4, 1), 2**11, np.int64)), [[2**53]])


def test_pair_safe_weights_are_exact_on_every_class_in_ort() -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    s = np.abs(w).max(0) / 127
    codes, _, changed = pair_safe_codes(w[None], s[None])
    assert changed.any() and not pair_violations(codes).any()
    a = rng.integers(0, 256, (32, 64)).astype(np.uint8)
    exact = emulate_u8s8(a, codes[0], saturate=False)
    np.testing.assert_array_equal(emulate_u8s8(a, codes[0], saturate=True), exact)
    np.testing.assert_array_equal(_matmul_integer(a, codes[0]), exact)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-128, 127), min_size=2, max_size=2))
def test_pair_bound_matches_brute_force(pair: list[int]) -> None:
    q = np.array(pair, np.int32).reshape(2, 1)
    sums = [a0 * pair[0] + a1 * pair[1] for a0, a1 in itertools.product((0, 255), repeat=2)]  # extremes suffice
    assert bool(pair_violations(q)[0, 0]) == any(v > 32767 or v < -32768 for v in sums)


@settings(max_examples=40, deadline=None)
@given(st.floats(-140, 140), st.floats(-140, 140))
def test_constrained_round_is_the_best_safe_pair(u0: float, u1: float) -> None:
    got = constrained_round(np.array([[u0], [u1]]), -127, 127)[:, 0]
    assert not pair_violations(got.reshape(2, 1).astype(np.int32)).any()
    best = min(
        ((q0 - u0) ** 2 + (q1 - u1) ** 2, q0, q1)
        for q0 in range(-127, 128) for q1 in range(-127, 128)
        if not ((q0 > 0 and q1 > 0 and q0 + q1 > PAIR_LIMIT) or (q0 < 0 and q1 < 0 and q0 + q1 < -PAIR_LIMIT))
    )
    assert (got[0] - u0) ** 2 + (got[1] - u1) ** 2 <= best[0] + 1e-9


@pytest.mark.parametrize(("op", "shape", "group", "trans_b"), [
    ("Conv", (8, 3, 3, 3), 1, False), ("Conv", (8, 4, 3, 3), 2, False), ("Conv", (16, 16, 1, 1), 1, False),
    ("Gemm", (10, 16), 1, True), ("Gemm", (16, 10), 1, False), ("MatMul", (16, 10), 1, False),
])
def test_kernel_view_round_trip(op: str, shape: tuple[int, ...], group: int, trans_b: bool) -> None:
    w = np.arange(np.prod(shape)).reshape(shape)
    v = kernel_view(w, op, trans_b=trans_b, group=group)
    np.testing.assert_array_equal(from_kernel_view(v, shape, op, trans_b=trans_b, group=group), w)


def test_conv_kernel_order_is_nhwc_im2col() -> None:
    # K index = (kh * KW + kw) * C + c: channel fastest
    w = np.zeros((1, 3, 2, 2), np.int64)
    for c, i, j in itertools.product(range(3), range(2), range(2)):
        w[0, c, i, j] = 100 * c + 10 * i + j
    col = kernel_view(w, "Conv")[0][:, 0]
    assert list(col[:4]) == [0, 100, 200, 1]


def test_conv_emulation_without_saturation_is_the_exact_conv() -> None:
    rng = np.random.default_rng(2)
    x = rng.integers(0, 256, (2, 4, 7, 6)).astype(np.uint8)
    w = rng.integers(-128, 128, (6, 4, 3, 3)).astype(np.int8)
    pads, zp = (1, 0, 1, 2), 7
    got = saturating_conv_reference(x, w, strides=(2, 1), pads=pads, x_zero_point=zp, saturate=False)
    xp = np.pad(x.astype(np.int64), ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])), constant_values=zp)
    oh, ow = got.shape[2], got.shape[3]
    ref = np.zeros_like(got, dtype=np.int64)
    for i, j in itertools.product(range(oh), range(ow)):
        patch = xp[:, :, 2 * i : 2 * i + 3, j : j + 3]
        ref[:, :, i, j] = np.einsum("nchw,ochw->no", patch, w.astype(np.int64))
    np.testing.assert_array_equal(got, ref)
    assert (saturating_conv_reference(x, w, strides=(2, 1), pads=pads, x_zero_point=zp) != got).any()


@pytest.mark.parametrize(("c_in", "group"), [(4, 1), (4, 2), (4, 4)])
def test_conv_saturation_excess_is_saturating_minus_exact(c_in: int, group: int) -> None:
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (2, c_in, 7, 6)).astype(np.uint8)
    w = rng.integers(-128, 128, (8, c_in // group, 3, 3)).astype(np.int8)
    kw = {"group": group, "strides": (2, 1), "pads": (1, 0, 1, 2), "x_zero_point": 7}
    want = (saturating_conv_reference(x, w, **kw).astype(np.int64)  # type: ignore[arg-type]
            - saturating_conv_reference(x, w, saturate=False, **kw))  # type: ignore[arg-type]
    got = conv_saturation_excess(x, w, **kw)  # type: ignore[arg-type]
    assert got.shape == want.shape and (group == c_in or want.any())
    np.testing.assert_array_equal(got, want)


def test_depthwise_conv_never_saturates() -> None:
    x = np.full((1, 4, 5, 5), 255, np.uint8)
    w = np.full((4, 1, 3, 3), 127, np.int8)
    kw = {"group": 4, "pads": (1, 1, 1, 1)}
    np.testing.assert_array_equal(saturating_conv_reference(x, w, **kw),  # type: ignore[arg-type]
                                  saturating_conv_reference(x, w, saturate=False, **kw))  # type: ignore[arg-type]
    q, s, changed = pair_safe_weight(w.astype(np.float32), w, np.ones(4, np.float32), np.zeros(4, np.int8),
                                     op_type="Conv", group=4)
    assert changed == 0 and q is w


def test_pair_safe_weight_with_hessian_beats_the_data_free_rounding_on_correlated_inputs() -> None:
    rng = np.random.default_rng(3)
    K, N, T = 64, 24, 4096
    base = rng.standard_normal((T, K // 4))
    x = np.repeat(base, 4, axis=1) + 0.3 * rng.standard_normal((T, K))  # strongly correlated neighbours
    w = rng.standard_normal((K, N))
    H = x.T @ x / T
    s = np.abs(w).max(0) / 127
    y = x @ w
    q_g = pair_gptq(w, s * 1.6, H)
    assert not pair_violations(q_g).any()
    q_c, s_c, _ = pair_safe_codes(w[None], s[None])
    err_c = np.sum((x @ (q_c[0] * s_c[0]) - y) ** 2)
    q_rtn = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
    q, s2, changed = pair_safe_weight(w.astype(np.float32), q_rtn, s.astype(np.float32), np.zeros(N, np.int8),
                                      op_type="MatMul", hessian=H)
    assert changed > 0 and not pair_violations(kernel_view(q, "MatMul")).any()
    err = np.sum((x @ (q * s2) - y) ** 2)
    # measured: 0.54x the data-free rounding's output error (and below unconstrained RTN's) on this input
    assert err < 0.8 * err_c
    # with H = I pair-constrained GPTQ is exactly the constrained rounding
    np.testing.assert_array_equal(pair_gptq(w, s, np.eye(K)), constrained_round(w / s, -127, 127))


@settings(max_examples=40, deadline=None)
@given(kh=st.integers(1, 5), stride=st.integers(1, 3), dil=st.integers(1, 2), pad=st.integers(0, 2),
       seed=st.integers(0, 2**16))
def test_sampled_im2col_rows_equal_the_full_im2col(kh: int, stride: int, dil: int, pad: int, seed: int) -> None:
    """The Hessian builds only the sampled patches: they must be exactly those rows of the full im2col."""
    from quantkit.scheme.saturation import im2col_nhwc, im2col_rows_nhwc

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 12, 9)).astype(np.float32)
    args = ((kh, max(1, kh - 1)), (stride, 1), (pad, 0, pad, 1), (dil, 1), 0.0)
    full, _, _ = im2col_nhwc(x, *args)
    if full.shape[0] == 0:
        return
    rows = rng.choice(full.shape[0], min(11, full.shape[0]), replace=False)
    np.testing.assert_array_equal(im2col_rows_nhwc(x, *args, rows), full[rows])


def test_the_kernel_hessian_keeps_exact_diagonal_blocks_and_block_gptq_is_gptq_per_block() -> None:
    """The pair-safe Hessian is kept as its diagonal blocks, accumulated by buffered in-place rank-k updates: each
    block equals the same rows' ``x^T x / n``; GPTQ with the blocks is GPTQ run block by block (the error of a
    block's rows spread over that block only), and with one block it is GPTQ with the full matrix."""
    from quantkit.calibrate.kernel_hessian import BlockDiagonal, KernelHessian

    rng = np.random.default_rng(5)
    K, N = 300, 40
    x = rng.standard_normal((5000, K)).astype(np.float32)
    x[:, 1::2] += x[:, 0::2]
    kh = KernelHessian(K, max_rows_per_update=10**9, block=64)
    for part in np.array_split(x, 7):  # uneven updates: some flush, some wait in the buffer
        kh.update(part)
    bd = kh.hessian()
    assert isinstance(bd, BlockDiagonal) and [b.shape[0] for b in bd.blocks] == [64, 64, 64, 64, 44]
    full = x.astype(np.float64).T @ x / len(x)
    for o, b in zip(bd.offsets, bd.blocks, strict=True):
        np.testing.assert_allclose(b, full[o : o + len(b), o : o + len(b)], rtol=1e-5, atol=1e-5)
    w = rng.standard_normal((K, N)) * 0.05
    s = np.abs(w).max(0) / 127 * 0.6
    per_block = np.concatenate([pair_gptq(w[o : o + len(b)], s, b) for o, b in zip(bd.offsets, bd.blocks, strict=True)])
    np.testing.assert_array_equal(pair_gptq(w, s, bd), per_block)
    one = KernelHessian(K, max_rows_per_update=10**9, block=None)
    one.update(x)
    h1 = one.hessian()
    assert h1 is not None and len(h1.blocks) == 1
    np.testing.assert_array_equal(pair_gptq(w, s, h1), pair_gptq(w, s, h1.blocks[0]))
    d = rng.standard_normal((K, N))
    from quantkit.algorithms.pair_rounding import _objective

    np.testing.assert_allclose(_objective(d, bd), _objective(d, bd.dense()), rtol=1e-5)
    np.testing.assert_allclose(_objective(d, bd), bd.quadratic(d), rtol=1e-5)
    # the kept blocks are what pair-constrained GPTQ needs: its error stays below the data-free rounding's
    q_rtn = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
    q, s2, changed = pair_safe_weight(w.astype(np.float32), q_rtn, s.astype(np.float32), np.zeros(N, np.int8),
                                      op_type="MatMul", hessian=bd)
    q_c, s_c, _ = pair_safe_codes(w[None], s[None])
    assert changed > 0 and not pair_violations(kernel_view(q, "MatMul")).any()
    assert np.sum((x @ (q * s2) - x @ w) ** 2) < np.sum((x @ (q_c[0] * s_c[0]) - x @ w) ** 2)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), qmin=st.sampled_from([-127, -128]), scale=st.floats(0.3, 3.0))
def test_the_first_of_a_pair_by_its_sum_equals_the_sign_split(seed: int, qmin: int, scale: float) -> None:
    """pair_gptq's row loop tells a breaking pair by ``|q0 + q1|`` alone when every code is within the pair
    limit: the same codes as the general test on the positive and negative parts."""
    from quantkit.algorithms.pair_rounding import _first_of_pair

    rng = np.random.default_rng(seed)
    u0, u1 = rng.uniform(-140, 140, 257) * scale, rng.uniform(-140, 140, 257) * scale
    q0 = np.clip(np.rint(u0), qmin, 127)
    np.testing.assert_array_equal(_first_of_pair(u0, q0, u1, qmin, 127, narrow=True),
                                  _first_of_pair(u0, q0, u1, qmin, 127, narrow=False))


def test_pair_gptq_does_not_depend_on_its_lazy_block_size() -> None:
    """The lazy-update block is a speed setting: the codes agree for any block (up to float rounding of the
    block products, which may move a code that sits on a rounding tie)."""
    rng = np.random.default_rng(11)
    K, N = 512, 96
    x = rng.standard_normal((4096, K))
    x[:, 1::2] += 0.8 * x[:, 0::2]
    H = x.T @ x / len(x)
    w = rng.standard_normal((K, N)) * 0.05
    s = np.abs(w).max(0) / 127 * 0.7
    ref = pair_gptq(w, s, H, block_size=128)
    for bs in (2, 32, 64, 512):
        q = pair_gptq(w, s, H, block_size=bs)
        assert not pair_violations(q).any()
        assert np.mean(q != ref) < 1e-3, bs
    # an odd K (a 7x7x3 stem): the last row's partner is the kernel's zero padding
    w_odd = rng.standard_normal((147, 40)) * 0.05
    s_odd = np.abs(w_odd).max(0) / 127 * 0.6
    np.testing.assert_array_equal(pair_gptq(w_odd, s_odd, np.eye(147)), constrained_round(w_odd / s_odd, -127, 127))


def test_the_scale_search_by_column_slices_equals_the_whole_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    import quantkit.scheme.saturation as sat

    rng = np.random.default_rng(2)
    w = rng.standard_normal((2, 300, 70)) * 0.05
    w[:, ::5] *= 4
    s = np.abs(w).max(1) / 127
    whole = pair_safe_codes(w, s, steps=8)
    monkeypatch.setattr(sat, "_SEARCH_ELEMENTS", 300 * 9)  # 9 columns per slice
    sliced = pair_safe_codes(w, s, steps=8)
    assert whole[2].sum() > 20
    for a, b in zip(whole, sliced, strict=True):
        np.testing.assert_array_equal(a, b)
