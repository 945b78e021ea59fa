"""W4A8 input equalization (quantkit.algorithms.equalize) and SignRound's ``equalize`` option, one layer at a time."""

from __future__ import annotations

import numpy as np
import pytest

from quantkit.algorithms.awq import awq
from quantkit.algorithms.equalize import CANDIDATES, act_fake_quant, candidate_scale, equalize_scale
from quantkit.algorithms.signround import signround
from quantkit.calibrate.layer_stats import LayerStats
from quantkit.errors import CalibrationError, RecipeError

K, N, G = 256, 96, 128


def _layer(seed: int = 0, outlier: float = 40.0) -> tuple[np.ndarray, np.ndarray, LayerStats]:
    """A layer whose input has one channel ``outlier`` times the others (a norm weight's large entry); its weight row is
    ordinary, so the float function depends on it as on any other channel."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    x = rng.standard_normal((4096, K)).astype(np.float32)
    x[:, 9] *= outlier
    stats = LayerStats(K, max_rows=2048)
    stats.update(x[:2048])
    return w, x[2048:], stats


def _w4a8_error(x: np.ndarray, w: np.ndarray, res) -> float:  # type: ignore[no-untyped-def]
    """Relative output error on rows ``x`` with the input rounded as the level-4 kernel rounds it."""
    s = np.ones(K, np.float32) if res.input_scale is None else res.input_scale
    y = act_fake_quant(x / s, G) @ res.dequantize()
    return float(np.linalg.norm(y - x @ w) / np.linalg.norm(x @ w))


def test_act_fake_quant_rounds_per_row_and_block() -> None:
    x = np.array([[1.0, -0.5, 0.26, 100.0, 0.3, 0.0]], np.float32)
    q = act_fake_quant(x, 3)  # blocks [1, -0.5, 0.26] and [100, 0.3, 0]: steps 1/127 and 100/127
    np.testing.assert_allclose(q[0, :3], np.rint(x[0, :3] * 127) / 127, rtol=1e-6)
    np.testing.assert_allclose(q[0, 3:], [100.0, 0.0, 0.0], atol=1e-5)  # 0.3 < half a step of 0.79: rounded to 0
    assert np.all(act_fake_quant(np.zeros((2, 5), np.float32), 4) == 0)  # an all-zero block stays zero


def test_candidate_scale_touches_only_the_channels_above_the_percentile() -> None:
    amax = np.ones(2 * G, np.float32)
    amax[9], amax[G + 3] = 64.0, 4.0
    s = candidate_scale(amax, G, 99.0, 1.0)
    assert s[9] > 10 and s[G + 3] > 1.5 and np.all(np.delete(s, [9, G + 3]) == 1.0)
    assert np.all(candidate_scale(amax, G, 99.0, 0.5)[[9, G + 3]] < s[[9, G + 3]])  # beta < 1: part of the way


def test_the_search_scales_the_outlier_and_scores_every_candidate() -> None:
    w, _, stats = _layer()
    s, scores = equalize_scale([w], stats, bits=4, group_size=G, symmetric=False)
    assert s is not None and s[9] > 2.0 and np.median(s) == 1.0
    assert set(scores) == {"1"} | {f"p{p:g}^{b:g}" for p, b in CANDIDATES}
    assert min(scores.values()) < scores["1"]
    # no outlier: nothing to gain over s = 1 worth the weights' cost on the most spread candidates
    w2, _, flat = _layer(outlier=1.0)
    s2, scores2 = equalize_scale([w2], flat, bits=4, group_size=G, symmetric=False)
    assert scores2[min(scores2, key=scores2.__getitem__)] > 0.9 * scores2["1"]  # the choice changes little there


def test_signround_equalize_lowers_the_w4a8_error_on_held_out_rows() -> None:
    w, held, stats = _layer()
    plain = signround(w, bits=4, group_size=G, symmetric=False, stats=stats, iters=20)
    eq = signround(w, bits=4, group_size=G, symmetric=False, stats=stats, iters=20, equalize=True)
    assert plain.input_scale is None and eq.input_scale is not None
    assert _w4a8_error(held, w, eq) < 0.9 * _w4a8_error(held, w, plain)


def test_signround_equalize_needs_sampled_rows_and_a_boolean() -> None:
    w, _, stats = _layer()
    with pytest.raises(RecipeError, match="equalize must be true or false"):
        signround(w, bits=4, group_size=G, stats=stats, equalize="yes")
    with pytest.raises(CalibrationError, match="equalize needs calibration statistics"):
        signround(w, bits=4, group_size=G, hessian=np.eye(K), equalize=True)


def test_awq_signround_takes_signround_refit_options() -> None:
    """``refit_iters: 0``: the scales refitted to the codes (a least-squares optimum for them): same codes, lower
    error on the calibration rows; bad counts refused."""
    w, _, stats = _layer(outlier=1.0)
    x = stats.samples.astype(np.float32)
    base = awq(w, bits=4, group_size=G, symmetric=False, stats=stats, signround=True, iters=10)
    refit = awq(w, bits=4, group_size=G, symmetric=False, stats=stats, signround=True, iters=10, refit=1, refit_iters=0)
    np.testing.assert_array_equal(base.codes, refit.codes)

    def err(r) -> float:  # type: ignore[no-untyped-def]
        return float(np.linalg.norm((x / r.input_scale) @ r.dequantize() - x @ w))

    assert err(refit) < err(base)
    with pytest.raises(RecipeError, match="refit"):
        awq(w, bits=4, group_size=G, stats=stats, signround=True, refit=-1)
