"""Weight-only algorithms (RTN, GPTQ, AWQ), their result type and the layer statistics they read."""

from __future__ import annotations

import numpy as np
import pytest

from quantkit.algorithms.awq import awq, awq_shared
from quantkit.algorithms.gptq import (
    FLOAT64_MAX_K,
    gptq,
    gptq_factor,
    inverse_hessian_cholesky,
    obs_rounding,
    work_precision,
)
from quantkit.algorithms.rtn import rtn
from quantkit.algorithms.woq import WEIGHT_ALGORITHMS, WOQResult, get_weight_algorithm
from quantkit.calibrate.layer_stats import LayerStats
from quantkit.errors import CalibrationError, RecipeError, UnknownNameError
from quantkit.memory import GPTQ_FLOAT64_MAX_K


def _weight(K: int, N: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((K, N)) * 0.05).astype(np.float32)


def _correlated_inputs(n: int, K: int, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((K, K)) * 0.3 + np.eye(K)
    X = rng.standard_normal((n, K)) @ A
    X[:, :4] *= 10.0
    return X.astype(np.float32)


def _out_err(X: np.ndarray, W: np.ndarray, res: WOQResult) -> float:
    return float(np.linalg.norm(X @ W - X @ res.effective_weight()))


# -- result type and registry ---------------------------------------------------------------------
def test_registry_and_unknown_name() -> None:
    assert get_weight_algorithm("gptq") is gptq
    assert {"rtn", "gptq", "awq"} <= set(WEIGHT_ALGORITHMS.names())
    with pytest.raises(UnknownNameError, match="known weight algorithms: .*awq.*gptq.*rtn"):
        get_weight_algorithm("nope")
    with pytest.raises(RecipeError, match="unknown options"):
        rtn(_weight(8, 4), bits=4, group_size=8, symmetric=True, stats=None, bogus=1)


def test_result_dequantize_known_answer() -> None:
    codes = np.array([[0, 15], [8, 9], [3, 4]], np.uint8)
    res = WOQResult(
        codes,
        np.array([[0.5, 2.0], [1.0, 1.0]], np.float32),
        np.array([[8, 8], [1, 2]], np.uint8),
        4,
        2,
        False,
        input_scale=np.array([1.0, 2.0, 4.0], np.float32),
    )
    np.testing.assert_array_equal(res.dequantize(), [[-4.0, 14.0], [0.0, 2.0], [2.0, 2.0]])
    np.testing.assert_array_equal(res.effective_weight(), [[-4.0, 14.0], [0.0, 1.0], [0.5, 0.5]])


# -- RTN ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("g", [32, 128, None])
def test_rtn_error_bound(bits: int, symmetric: bool, g: int | None) -> None:
    W = _weight(200, 24) + (0.0 if symmetric else 0.03)
    res = rtn(W, bits=bits, group_size=g, symmetric=symmetric, clip=False)  # plain min-max grid
    gs = 200 if g is None else g
    assert res.group_size == gs and res.scales.shape == (-(-200 // gs), 24)
    assert res.codes.max() < 2**bits
    if symmetric:
        assert np.all(res.zero_points == 2 ** (bits - 1))
    step = np.abs(np.repeat(res.scales, gs, axis=0)[:200])
    err = np.abs(W - res.dequantize())
    # asymmetric: |W - W_hat| <= s / 2 everywhere.  Symmetric (signed scale, the group's extreme e exact at
    # -2^(b-1)): <= s / 2 inside the grid, up to one step for values beyond +(2^(b-1) - 1) s on the other
    # side of e; plus the float32 rounding of s amplified by the code (1e-4 covers 8 bits)
    inside = np.abs(W) <= (2 ** (bits - 1) - 1) * step if symmetric else np.ones(W.shape, bool)
    assert np.all(err[inside] <= step[inside] * (0.5 + 1e-4))
    assert np.all(err <= step * (1.0 + 1e-4))


def test_rtn_symmetric_int4_mapping() -> None:
    W = np.array([[-1.5], [-0.2], [0.0], [0.2], [1.5]], np.float32)
    res = rtn(W, bits=4, group_size=None, symmetric=True, clip=False)
    # signed scale e / -8 with e = -1.5 (the value of largest magnitude; a tie takes the minimum)
    assert res.scales[0, 0] == np.float32(1.5 / 8) and res.zero_points[0, 0] == 8
    # int4 value v in [-8, 7] stored as v + 8: -1.5 -> -8 exactly -> 0; -0.2/0.1875 -> -1 -> 7; +1.5 -> 8 saturates -> 15
    assert res.codes[:, 0].tolist() == [0, 7, 8, 9, 15]
    pos = rtn(np.array([[1.5], [0.2], [0.0], [-0.2], [-1.4]], np.float32), bits=4, group_size=None, symmetric=True,
              clip=False)
    assert pos.scales[0, 0] == np.float32(-1.5 / 8) and pos.codes[0, 0] == 0  # a negative scale: 1.5 exact at -8


def test_signed_grid_beats_the_absmax_over_7_5_grid() -> None:
    """ONNX Runtime's signed-scale grid (extreme exact at -8, step absmax/8) against absmax/7.5."""
    W = _weight(512, 256, seed=5)
    X = np.random.default_rng(6).standard_normal((256, 512)).astype(np.float32)
    signed = rtn(W, bits=4, group_size=128, symmetric=True, clip=False)
    Wg = W.reshape(4, 128, 256)
    s75 = np.abs(Wg).max(axis=1, keepdims=True) / 7.5
    old = (np.clip(np.rint(Wg / s75), -8, 7) * s75).reshape(512, 256)
    err_old = float(np.linalg.norm(X @ W - X @ old))
    assert _out_err(X, W, signed) < 0.95 * err_old


def test_clip_search_lowers_the_weighted_error() -> None:
    W = _weight(512, 256, seed=7)
    X = np.random.default_rng(8).standard_normal((256, 512)).astype(np.float32)
    plain = rtn(W, bits=4, group_size=128, symmetric=True, clip=False)
    clipped = rtn(W, bits=4, group_size=128, symmetric=True)
    assert _out_err(X, W, clipped) < 0.97 * _out_err(X, W, plain)


def test_rtn_full_grid_beats_narrow() -> None:
    W = _weight(512, 256, seed=5)
    X = np.random.default_rng(6).standard_normal((256, 512)).astype(np.float32)
    full = rtn(W, bits=4, group_size=128, symmetric=True)
    narrow = rtn(W, bits=4, group_size=128, symmetric=True, narrow=True)
    assert _out_err(X, W, full) < 0.97 * _out_err(X, W, narrow)


# -- GPTQ -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_beats_rtn_on_correlated_inputs(symmetric: bool) -> None:
    K, N = 256, 64
    W = _weight(K, N)
    X = _correlated_inputs(2048, K)
    stats = LayerStats(K)
    stats.update(X[:1024])
    Xt = X[1024:]  # held-out rows
    e_rtn = _out_err(Xt, W, rtn(W, bits=4, group_size=128, symmetric=symmetric))
    for act_order in (True, False):
        res = gptq(W, bits=4, group_size=128, symmetric=symmetric, stats=stats, act_order=act_order)
        assert _out_err(Xt, W, res) < 0.7 * e_rtn


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("g", [32, 128, None])
def test_gptq_identity_hessian_equals_rtn(act_order: bool, g: int | None) -> None:
    W = _weight(256, 40)
    ref = rtn(W, bits=4, group_size=g, symmetric=False)
    res = gptq(W, bits=4, group_size=g, symmetric=False, stats=None, hessian=np.eye(256), act_order=act_order)
    np.testing.assert_array_equal(res.codes, ref.codes)
    np.testing.assert_array_equal(res.scales, ref.scales)
    np.testing.assert_array_equal(res.zero_points, ref.zero_points)


def test_gptq_returns_its_own_grid() -> None:
    """act-order uses static groups: the scales are those of the original W (min-max here, clip=False), and
    the codes are what GPTQ rounded to on that grid (no re-quantization of the compensated weights)."""
    K, N = 256, 32
    W = _weight(K, N)
    stats = LayerStats(K)
    stats.update(_correlated_inputs(1024, K))
    res = gptq(W, bits=4, group_size=64, symmetric=True, stats=stats, act_order=True, clip=False)
    np.testing.assert_array_equal(res.scales, rtn(W, bits=4, group_size=64, symmetric=True, clip=False).scales)
    assert not np.array_equal(res.codes, rtn(W, bits=4, group_size=64, symmetric=True, clip=False).codes)


def test_gptq_dead_inputs_and_errors() -> None:
    K, N = 64, 16
    W = _weight(K, N)
    X = _correlated_inputs(512, K)
    X[:, [5, 40]] = 0.0
    stats = LayerStats(K)
    stats.update(X)
    res = gptq(W, bits=4, group_size=32, symmetric=True, stats=stats)
    assert np.all(res.dequantize()[[5, 40]] == 0.0)  # dead rows are zeroed (their input is always 0)
    assert np.all(np.isfinite(res.dequantize()))
    with pytest.raises(CalibrationError, match="needs calibration statistics"):
        gptq(W, bits=4, group_size=32, symmetric=True, stats=None)


def test_inverse_hessian_factor_of_the_ordered_scaled_matrix_in_float32_and_float64() -> None:
    """U^T U = (A + damp I)^-1 with A = scale * H[order][:, order] (a dead input's diagonal 1), gathered from H band
    by band and reversed in its own memory; float64 without order / scale is the plain factor of H, bit for bit."""
    rng = np.random.default_rng(3)
    K = 200
    X = _correlated_inputs(600, K)
    X[:, 7] = 0.0
    H = X.astype(np.float64).T @ X
    order = rng.permutation(K)
    A = 0.25 * H[np.ix_(order, order)]
    d = np.diag(A).copy()
    d[d == 0] = 1.0
    A[np.diag_indices(K)] = d
    A[np.diag_indices(K)] += 0.01 * d.mean()
    ref = np.linalg.inv(A)
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        U = inverse_hessian_cholesky(H, 0.01, order=order, scale=0.25, dtype=dtype)
        assert U.dtype == dtype and np.all(np.tril(U, -1) == 0)
        assert np.abs(U.astype(np.float64).T @ U - ref).max() <= tol * np.abs(ref).max()
    Hd = H.copy()
    Hd[7, 7] = 1.0
    U = inverse_hessian_cholesky(H)
    np.testing.assert_array_equal(U, inverse_hessian_cholesky(Hd))
    np.testing.assert_allclose(U.T @ U, np.linalg.inv(Hd + 0.01 * np.mean(np.diag(Hd)) * np.eye(K)), rtol=1e-9,
                               atol=1e-12 * np.abs(np.linalg.inv(Hd)).max())


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_obs_rounding_updates_in_place_as_the_textbook_loop(order: str, dtype: type) -> None:
    rng = np.random.default_rng(4)
    K, N, B = 45, 9, 8
    U = np.triu(rng.standard_normal((K, K))) + 6 * np.eye(K)
    W = np.array(rng.standard_normal((K, N)), dtype, order=order)
    ref = W.astype(np.float64)
    for i1 in range(0, K, B):  # the reference implementation's loop, float64
        i2 = min(i1 + B, K)
        W1, E1 = ref[i1:i2].copy(), np.zeros((i2 - i1, N))
        for i in range(i2 - i1):
            err = (W1[i] - np.round(W1[i])) / U[i1 + i, i1 + i]
            W1[i + 1 :] -= np.outer(U[i1 + i, i1 + i + 1 : i2], err)
            E1[i] = err
        ref[i2:] -= U[i1:i2, i2:].T @ E1
    obs_rounding(W, U.astype(dtype), lambda r, W1, i: np.round(W1[i]), B)
    np.testing.assert_allclose(W, ref, rtol=0, atol=1e-12 if dtype == np.float64 else 2e-5)


def test_gptq_in_float32_matches_float64() -> None:
    """The float32 factorization and row loop (the reference implementation's precision): the same output error
    as float64 to 0.1% and almost every code the same, with an outlier channel in the inputs."""
    K, N = 512, 96
    W = _weight(K, N)
    X = _correlated_inputs(2048, K)
    X[:, 11] *= 30.0
    stats = LayerStats(K)
    stats.update(X)
    H = stats.hessian()
    r32 = gptq(W, bits=4, group_size=128, symmetric=False, stats=stats, precision="float32")
    r64 = gptq(W, bits=4, group_size=128, symmetric=False, stats=stats, precision="float64")

    def err(r: WOQResult) -> float:
        d = (W - r.effective_weight()).astype(np.float64)
        return float(np.sum((H @ d) * d))

    assert abs(err(r32) - err(r64)) <= 1e-3 * err(r64)
    assert np.mean(r32.codes == r64.codes) >= 0.99
    np.testing.assert_array_equal(r32.scales, r64.scales)  # the static groups' grid: from W, not the loop
    assert stats.hessian(np.float32).dtype == np.float32
    np.testing.assert_array_equal(stats.hessian(np.float32), H.astype(np.float32))
    np.testing.assert_array_equal(stats.diagonal(), np.diag(H))
    with pytest.raises(RecipeError, match="precision 'float16'.*allowed: auto, float32, float64"):
        gptq(W, bits=4, group_size=128, stats=stats, precision="float16")
    # auto: float64 for this narrow layer (bit for bit), float32 above FLOAT64_MAX_K inputs
    r_auto = gptq(W, bits=4, group_size=128, symmetric=False, stats=stats)
    np.testing.assert_array_equal(r_auto.codes, r64.codes)
    assert work_precision(K) == "float64" and work_precision(FLOAT64_MAX_K + 1) == "float32"
    assert GPTQ_FLOAT64_MAX_K == FLOAT64_MAX_K


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_gptq_column_slices_sharing_one_factor_are_the_whole_layer_bit_for_bit(precision: str) -> None:
    """A wide layer (an lm_head) goes in column slices that share one factorization of the Hessian (the K^3 part):
    the same codes and scales as the whole layer; a factor of other settings is refused."""
    K, N = 320, 700
    W = _weight(K, N, seed=5)
    stats = LayerStats(K)
    stats.update(_correlated_inputs(1500, K))
    whole = gptq(W, bits=4, group_size=64, symmetric=False, stats=stats, precision=precision)
    f = gptq_factor(stats, K=K, precision=precision)
    parts = [gptq(np.ascontiguousarray(W[:, j : j + 256]), bits=4, group_size=64, symmetric=False, stats=stats,
                  precision=precision, factor=f) for j in range(0, N, 256)]
    np.testing.assert_array_equal(np.concatenate([q.codes for q in parts], axis=1), whole.codes)
    np.testing.assert_array_equal(np.concatenate([q.scales for q in parts], axis=1), whole.scales)
    np.testing.assert_array_equal(np.concatenate([q.zero_points for q in parts], axis=1), whole.zero_points)
    with pytest.raises(CalibrationError, match="factor given was computed for .*percdamp=0.01"):
        gptq(W, bits=4, group_size=64, stats=stats, precision=precision, percdamp=0.02, factor=f)


# -- AWQ ------------------------------------------------------------------------------------------
def _salient_inputs(n: int, K: int, seed: int = 2) -> np.ndarray:
    X = np.random.default_rng(seed).standard_normal((n, K)).astype(np.float32)
    X[:, [3, 50, 100, K - 7]] *= 20.0
    return X


@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_no_worse_than_rtn_with_salient_channels(symmetric: bool) -> None:
    K, N = 256, 64
    W = _weight(K, N)
    X = _salient_inputs(2048, K)
    stats = LayerStats(K, max_rows=512)
    stats.update(X[:1024])
    Xt = X[1024:]
    res = awq(W, bits=4, group_size=128, symmetric=symmetric, stats=stats)
    assert res.input_scale is not None and res.input_scale.shape == (K,)
    # the layer computes (x / s) @ W_hat
    y = (Xt / res.input_scale) @ res.dequantize()
    e_awq = float(np.linalg.norm(Xt @ W - y))
    e_rtn = _out_err(Xt, W, rtn(W, bits=4, group_size=128, symmetric=symmetric))
    assert e_awq < 0.9 * e_rtn


def test_awq_shared_scale() -> None:
    K = 128
    Ws = [_weight(K, 32, seed=1), _weight(K, 48, seed=2)]
    stats = LayerStats(K, max_rows=256)
    stats.update(_salient_inputs(512, K))
    r1, r2 = awq_shared(Ws, stats, bits=4, group_size=64)
    assert r1.input_scale is not None and r2.input_scale is not None
    np.testing.assert_array_equal(r1.input_scale, r2.input_scale)
    assert r1.shape == (K, 32) and r2.shape == (K, 48)
    with pytest.raises(CalibrationError):
        awq(Ws[0], bits=4, group_size=64, symmetric=True, stats=LayerStats(K))


# -- LayerStats -----------------------------------------------------------------------------------
def test_layer_stats_moments_merge_state() -> None:
    rng = np.random.default_rng(0)
    K = 16
    X = rng.standard_normal((3, 100, K)).astype(np.float32)
    rows = X.reshape(-1, K).astype(np.float64)
    st = LayerStats(K, max_rows=50)
    for b in X:
        st.update(b)
    ref = rows.T @ rows  # float32 products, float64 sums: float32's precision relative to the largest entry
    np.testing.assert_allclose(st.H, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    np.testing.assert_allclose(st.mean_abs, np.abs(rows).mean(0), rtol=1e-12)
    assert st.count == 300 and st.samples.shape == (50, K)
    # every sampled row is one of the inputs
    assert all(any(np.array_equal(r, x) for x in X.reshape(-1, K)) for r in st.samples[:5])
    a, b = LayerStats(K, max_rows=50, seed=1), LayerStats(K, max_rows=50, seed=2)
    a.update(X[0])
    b.update(X[1:])
    a.merge(b)
    np.testing.assert_allclose(a.H, ref, rtol=0, atol=1e-6 * np.abs(ref).max())
    assert a.count == 300 and a.samples.shape == (50, K)
    c = LayerStats.from_state(st.state())
    np.testing.assert_array_equal(c.H, st.H)
    np.testing.assert_array_equal(c.samples, st.samples)
    c.update(X[0])
    st.update(X[0])
    np.testing.assert_array_equal(c.samples, st.samples)  # the RNG state travels too
    with pytest.raises(CalibrationError):
        st.update(np.zeros((2, K + 1), np.float32))


def test_layer_stats_reservoir_is_uniform() -> None:
    K, m = 1, 200
    st = LayerStats(K, max_rows=m, seed=3)
    for i in range(100):
        st.update(np.arange(i * 100, (i + 1) * 100, dtype=np.float32)[:, None])
    s = st.samples[:, 0]
    assert len(np.unique(s)) == m
    # uniform over 0..9999: mean 5000, sd of the mean ~ 2887 / sqrt(200) ~ 204
    assert abs(float(s.mean()) - 4999.5) < 4 * 204
    assert st.samples.nbytes == m * K * 4  # memory does not grow with the stream


def test_awq_then_gptq_beats_awq_alone_on_correlated_salient_inputs() -> None:
    K, N = 256, 64
    W = _weight(K, N)
    X = _salient_inputs(2048, K) + 0.5 * _correlated_inputs(2048, K)
    stats = LayerStats(K, max_rows=512)
    stats.update(X[:1024])
    Xt = X[1024:]

    def err(res: WOQResult) -> float:
        assert res.input_scale is not None
        return float(np.linalg.norm(Xt @ W - (Xt / res.input_scale) @ res.dequantize()))

    plain = awq(W, bits=4, group_size=128, symmetric=True, stats=stats)
    combo = awq(W, bits=4, group_size=128, symmetric=True, stats=stats, gptq=True)
    np.testing.assert_array_equal(plain.input_scale, combo.input_scale)  # the same AWQ scale
    assert err(combo) < 0.95 * err(plain)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("K", "g", "bits"), [(576, 128, 4), (576, 32, 4), (200, 64, 8), (96, 96, 4)])
@pytest.mark.parametrize("weighted", [False, True])
def test_grouped_clip_search_chooses_as_the_generic_one(dtype: type, K: int, g: int, bits: int, weighted: bool) -> None:
    """The default grid's clip search in the grouped layout picks, bit for bit, the range the generic search (each
    shrink through group_weight_codes and a float64 dequantization) picks - ragged last groups, all-zero groups
    and float64 weights included."""
    from quantkit.algorithms.rtn import CLIP_GRID, _generic_search, _grouped_search

    rng = np.random.default_rng(K + g + bits)
    N = 37
    w = (rng.standard_normal((K, N)) * rng.gamma(1.0, 1.0, (1, N))).astype(dtype)
    w[:, 3] = 0.0
    w[: min(g, K), 5] = 0.0
    kb = -(-K // g)
    pad = kb * g - K
    wp = np.pad(w, ((0, pad), (0, 0))).reshape(kb, g, N)
    mn, mx = wp.min(axis=1), wp.max(axis=1)
    impg = np.pad(rng.gamma(1.0, 1.0, K), (0, pad)).reshape(kb, g, 1) if weighted else None
    kw = {"symmetric": True, "narrow": False, "impg": impg, "grid": CLIP_GRID}
    fast = _grouped_search(w, wp, mn, mx, bits, g, **kw)
    np.testing.assert_array_equal(fast, _generic_search(w, wp, mn, mx, bits, g, **kw))
    if bits == 4:
        assert len(np.unique(fast)) > 1  # the search did choose shrunk ranges somewhere


def test_rtn_effective_by_column_slices_is_the_whole_matrix_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search rounds a wide weight (a 49k-column lm_head) by column slices, a tied one into the table's
    layout: RTN's groups run along K, so the values are the whole matrix's, bit for bit (ragged groups and a
    ragged last slice included)."""
    import quantkit.search.linear as L
    from quantkit.algorithms.woq import get_weight_algorithm

    fn = get_weight_algorithm("rtn")
    rng = np.random.default_rng(7)
    W = (rng.standard_normal((72, 1000)) * rng.uniform(0.01, 1.0, (1, 1000))).astype(np.float32)
    monkeypatch.setattr(L, "_RTN_SLICE_BYTES", 4 * 72 * 137)  # slices of 137 columns: the last one ragged
    for kw in ({"bits": 4, "group_size": 32, "symmetric": True}, {"bits": 4, "group_size": 20, "symmetric": False},
               {"bits": 8, "group_size": None, "symmetric": True}):
        whole = fn(W, stats=None, **kw).effective_weight()
        sliced = L._rtn_effective(fn, W, False, stats=None, **kw)
        table = np.ascontiguousarray(W.T)
        tied = L._rtn_effective(fn, table.T, True, stats=None, **kw)
        assert tied.T.flags.c_contiguous  # built in the table's layout: fed without a transposed copy
        np.testing.assert_array_equal(sliced.view(np.uint32), whole.view(np.uint32))
        np.testing.assert_array_equal(np.ascontiguousarray(tied).view(np.uint32), whole.view(np.uint32))
