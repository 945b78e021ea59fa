"""SignRound (signed-gradient rounding, the AutoRound family): grid, layer loss vs RTN / GPTQ, options."""

from __future__ import annotations

import numpy as np
import pytest

from quantkit.algorithms.awq import awq
from quantkit.algorithms.gptq import gptq
from quantkit.algorithms.rtn import rtn
from quantkit.algorithms.signround import SIGNROUND_OPTIONS, signround
from quantkit.algorithms.woq import WEIGHT_ALGORITHMS, WOQResult, get_weight_algorithm
from quantkit.calibrate.layer_stats import LayerStats
from quantkit.errors import CalibrationError, RecipeError


def _random_case(K: int = 256, N: int = 64, seed: int = 0) -> tuple[np.ndarray, LayerStats]:
    """Gaussian weight; inputs with a dense random correlation and four large channels."""
    rng = np.random.default_rng(seed)
    W = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    A = rng.standard_normal((K, K)) * 0.3 + np.eye(K)
    X = rng.standard_normal((2048, K)) @ A
    X[:, :4] *= 10.0
    st = LayerStats(K, max_rows=256)
    st.update(X.astype(np.float32))
    return W, st


def _structured_case(K: int = 256, N: int = 48, seed: int = 3) -> tuple[np.ndarray, LayerStats]:
    """Low-rank weight with outlier rows; AR(1) inputs (neighbouring features correlated at 0.9), like the
    smooth, strongly correlated activations of a transformer block."""
    rng = np.random.default_rng(seed)
    W = (rng.standard_normal((K, 8)) @ rng.standard_normal((8, N)) * 0.02).astype(np.float32)
    W[rng.choice(K, 6, replace=False)] *= 8.0
    e = rng.standard_normal((2048, K))
    X = np.empty_like(e)
    X[:, 0] = e[:, 0]
    for k in range(1, K):
        X[:, k] = 0.9 * X[:, k - 1] + np.sqrt(1 - 0.81) * e[:, k]
    X *= np.linspace(0.5, 3.0, K)
    st = LayerStats(K, max_rows=256)
    st.update(X.astype(np.float32))
    return W, st


def _layer_loss(W: np.ndarray, st: LayerStats, res: WOQResult) -> float:
    """``tr(dW^T H dW) = sum_t ||x_t (W_hat - W)||^2`` on the calibration rows."""
    D = (res.effective_weight() - W).astype(np.float64)
    return float(np.sum((st.hessian() @ D) * D))


def test_registered_and_options_validated() -> None:
    W, st = _random_case(64, 8)
    assert get_weight_algorithm("signround") is signround
    assert "signround" in WEIGHT_ALGORITHMS.names()
    assert set(signround.options) == SIGNROUND_OPTIONS  # what a recipe may pass (checked at load time)
    with pytest.raises(RecipeError, match=r"signround: unknown options \['bogus'\]; allowed: .*iters.*min_clip"):
        signround(W, bits=4, group_size=32, symmetric=True, stats=st, bogus=1)
    with pytest.raises(RecipeError, match="init 'awq' is not supported; allowed: gptq, rtn"):
        signround(W, bits=4, group_size=32, symmetric=True, stats=st, init="awq")
    with pytest.raises(RecipeError, match="min_clip"):
        signround(W, bits=4, group_size=32, symmetric=True, stats=st, min_clip=0.0)
    with pytest.raises(CalibrationError, match="needs calibration statistics"):
        signround(W, bits=4, group_size=32, symmetric=True, stats=None)
    with pytest.raises(CalibrationError, match="does not match"):
        signround(W, bits=4, group_size=32, symmetric=True, stats=None, hessian=np.eye(3))
    assert "signround" in awq.options


@pytest.mark.parametrize("symmetric", [True, False])
def test_codes_on_quantkits_grid(symmetric: bool) -> None:
    """Codes in [0, 15]; the scales / zero points are RTN's (clip search) ones: the signed-scale symmetric
    grid with zero point 8, or the asymmetric min-max grid; only the rounding differs."""
    W, st = _random_case(200, 24)  # K not a multiple of the group: a short last group
    res = signround(W, bits=4, group_size=64, symmetric=symmetric, stats=st)
    ref = rtn(W, bits=4, group_size=64, symmetric=symmetric, stats=st)
    assert res.codes.dtype == np.uint8 and int(res.codes.max()) <= 15
    assert res.scales.shape == (4, 24) and res.group_size == 64 and res.symmetric is symmetric
    np.testing.assert_array_equal(res.scales, ref.scales)
    np.testing.assert_array_equal(res.zero_points, ref.zero_points)
    if symmetric:
        assert np.all(res.zero_points == 8) and np.any(res.scales < 0)  # signed scales (extreme exact at -8)
    assert np.mean(res.codes != ref.codes) > 0.01  # it did re-round
    # every weight stays within one grid step of RTN's value (V in [-0.5, 0.5])
    assert int(np.max(np.abs(res.codes.astype(int) - ref.codes.astype(int)))) <= 1


@pytest.mark.parametrize("case", [_random_case, _structured_case])
@pytest.mark.parametrize("symmetric", [True, False])
def test_beats_rtn_on_the_layer_loss(case, symmetric: bool) -> None:  # type: ignore[no-untyped-def]
    W, st = case()
    base = _layer_loss(W, st, rtn(W, bits=4, group_size=64, symmetric=symmetric, stats=st))
    loss = _layer_loss(W, st, signround(W, bits=4, group_size=64, symmetric=symmetric, stats=st))
    assert loss < 0.8 * base, (loss, base)


def test_relaxed_self_term_is_what_makes_it_work() -> None:
    """Plain straight-through sign descent on the full-batch loss drifts every offset to its rounding
    boundary (the weight's own term always points away from its RTN value); the relaxed own term
    converges.  Both are never worse than RTN (best iterate, checked against the start)."""
    W, st = _random_case()
    base = _layer_loss(W, st, rtn(W, bits=4, group_size=64, symmetric=True, stats=st))
    plain = _layer_loss(W, st, signround(W, bits=4, group_size=64, symmetric=True, stats=st, relaxed=False))
    relaxed = _layer_loss(W, st, signround(W, bits=4, group_size=64, symmetric=True, stats=st))
    assert relaxed < plain <= base * 1.0001


@pytest.mark.parametrize("symmetric", [True, False])
def test_learned_clip_factors(symmetric: bool) -> None:
    """``learn_clip``: the per-group clip factors learn too (autograd path); scales stay within
    [min_clip, 1] of the min-max scale, and the result is no worse than RTN on the layer loss."""
    W, st = _structured_case(128, 32)
    ref = rtn(W, bits=4, group_size=32, symmetric=symmetric, stats=st)
    minmax = rtn(W, bits=4, group_size=32, symmetric=symmetric, stats=st, clip=False)
    res = signround(W, bits=4, group_size=32, symmetric=symmetric, stats=st, learn_clip=True, iters=30)
    assert int(res.codes.max()) <= 15
    if symmetric:
        ratio = res.scales / minmax.scales
        assert np.all(ratio <= 1.0 + 1e-6) and np.all(ratio >= 0.5 - 1e-6)
    assert _layer_loss(W, st, res) <= _layer_loss(W, st, ref) * 1.0001


def test_gptq_init_is_never_worse_than_gptq() -> None:
    W, st = _structured_case()
    g = _layer_loss(W, st, gptq(W, bits=4, group_size=64, symmetric=True, stats=st))
    s = _layer_loss(W, st, signround(W, bits=4, group_size=64, symmetric=True, stats=st, init="gptq", lr=0.005))
    assert s <= g * 1.0001


def test_awq_then_gptq_then_signround() -> None:
    W, st = _random_case(128, 32)
    kw = dict(bits=4, group_size=32, symmetric=True, stats=st, n_grid=5)
    a = awq(W, **kw, gptq=True)
    b = awq(W, **kw, gptq=True, signround=True)
    np.testing.assert_array_equal(a.input_scale, b.input_scale)  # the same AWQ scale
    assert _layer_loss(W, st, b) <= _layer_loss(W, st, a) * 1.0001
    c = awq(W, **kw, signround=True)  # AWQ's clipped RTN, refined
    assert _layer_loss(W, st, c) < 0.9 * _layer_loss(W, st, awq(W, **kw))


def test_deterministic() -> None:
    W, st = _random_case(128, 32, seed=7)
    a = signround(W, bits=4, group_size=32, symmetric=True, stats=st, iters=20)
    b = signround(W.copy(), bits=4, group_size=32, symmetric=True, stats=st, iters=20)
    np.testing.assert_array_equal(a.codes, b.codes)
    np.testing.assert_array_equal(a.scales, b.scales)


@pytest.mark.parametrize("symmetric", [False, True])
def test_sparse_updates_match_the_full_product(symmetric: bool) -> None:
    """The step's ``H dW`` updated by the flipped weights alone gives the codes of the full product every step
    (``dense_frac=0``), up to float32 ties: the sparse path must be exercised (steps with few flips) and agree."""
    from quantkit.algorithms.signround import _refine_fixed_scales
    from quantkit.scheme.qparams import group_weight_codes

    W, st = _random_case(256, 96, seed=5)
    H = st.hessian()
    H[np.diag_indices(256)] += 0.01 * float(np.mean(np.diag(H)))
    sc, q, z = group_weight_codes(W, 4, 64, symmetric=symmetric)
    start = WOQResult(q, sc, z, 4, 64, symmetric)
    full = _refine_fixed_scales(W, H, start, iters=40, lr=None, relaxed=True, dense_frac=0.0)
    sparse = _refine_fixed_scales(W, H, start, iters=40, lr=None, relaxed=True, dense_frac=0.5)
    assert not np.array_equal(full.codes, start.codes)
    assert np.mean(full.codes == sparse.codes) > 0.999
    a, b = _layer_loss(W, st, full), _layer_loss(W, st, sparse)
    assert abs(a - b) <= 1e-3 * a
    assert b < 0.7 * _layer_loss(W, st, start)


def test_zero_iterations_is_rtn() -> None:
    W, st = _random_case(128, 16)
    res = signround(W, bits=4, group_size=32, symmetric=True, stats=st, iters=0)
    ref = rtn(W, bits=4, group_size=32, symmetric=True, stats=st)
    np.testing.assert_array_equal(res.codes, ref.codes)


@pytest.mark.parametrize("symmetric", [False, True])
def test_refit_scales_is_the_least_squares_optimum(symmetric: bool) -> None:
    """With the codes and zero points kept, ``refit_scales`` returns the scales of the weighted least-squares
    solution, column by column: no other scales lower ``tr(dW^T H dW)``."""
    from quantkit.algorithms.scale_refit import refit_scales

    W, st = _random_case(K=96, N=12)
    H = st.hessian()
    start = signround(W, bits=4, group_size=32, symmetric=symmetric, stats=st, iters=10)
    res = refit_scales(W, H, start)
    assert np.array_equal(res.codes, start.codes) and np.array_equal(res.zero_points, start.zero_points)
    L = np.linalg.cholesky(H)  # tr(D^T H D) = sum_n ||L^T d_n||^2
    for n in range(W.shape[1]):  # the scales of column n as an ordinary least-squares problem
        c = start.codes[:, n].astype(np.float64) - np.repeat(start.zero_points[:, n], 32).astype(np.float64)
        D = np.zeros((96, 3))
        for gi in range(3):
            D[gi * 32:(gi + 1) * 32, gi] = c[gi * 32:(gi + 1) * 32]
        s, *_ = np.linalg.lstsq(L.T @ D, L.T @ W[:, n].astype(np.float64), rcond=None)
        np.testing.assert_allclose(res.scales[:, n], s, rtol=2e-4)
    assert _layer_loss(W, st, res) < _layer_loss(W, st, start)


def test_refit_rounds_lower_the_layer_loss() -> None:
    """``refit: n`` alternates the best scales for the codes and SignRound's codes for those scales: each round
    keeps or lowers the layer loss; the option is validated."""
    W, st = _structured_case()
    losses = [_layer_loss(W, st, signround(W, bits=4, group_size=64, symmetric=False, stats=st, refit=r))
              for r in (0, 1, 2)]
    assert losses[1] < losses[0] and losses[2] <= losses[1] * (1 + 1e-9)
    with pytest.raises(RecipeError, match="refit"):
        signround(W, bits=4, group_size=64, stats=st, refit=-1)


def test_gptq_refit_lowers_the_layer_loss() -> None:
    """GPTQ's ``refit``: same codes, scales refitted, lower layer loss (on the undamped Hessian)."""
    W, st = _structured_case()
    plain = gptq(W, bits=4, group_size=64, symmetric=False, stats=st)
    fitted = gptq(W, bits=4, group_size=64, symmetric=False, stats=st, refit=True)
    assert np.array_equal(plain.codes, fitted.codes)
    assert _layer_loss(W, st, fitted) < _layer_loss(W, st, plain)
