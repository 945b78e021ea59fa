"""Histogram statistics and the histogram calibrators (percentile, mse, entropy), with known answers."""

from __future__ import annotations

import io
import math
import time
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from calibrators import EntropyCalibrator, MinMaxCalibrator, MSECalibrator, PercentileCalibrator
from calibrators.entropy import abs_histogram, kl_divergences
from quantkit.calibrate import CALIBRATORS, get_calibrator
from quantkit.calibrate.histogram import StreamingHistogram, histogram_quantile
from quantkit.calibrate.stats import TensorStatistics
from quantkit.errors import CalibrationError, RecipeError, UnknownNameError
from quantkit.scheme.qparams import compute_qparams, dequantize, quantize

HIST_CALIBRATORS: list[type[Any]] = [PercentileCalibrator, MSECalibrator, EntropyCalibrator]
ALL_CALIBRATORS: list[type[Any]] = [MinMaxCalibrator, *HIST_CALIBRATORS]
GRIDS = [("uint8", False), ("int8", True)]


def qdq_mse(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, dtype: str, symmetric: bool) -> float:
    """Mean squared quantize-dequantize error of ``x`` on the grid chosen for ``[lo, hi]``."""
    scale, zp = compute_qparams(lo, hi, dtype, symmetric=symmetric)
    return float(np.mean((dequantize(quantize(x, scale, zp, dtype=dtype), scale, zp) - x) ** 2))


def stream(cal: Any, x: np.ndarray, batch: int) -> Any:
    for start in range(0, x.size, batch):
        cal.update(x[start : start + batch])
    return cal


@pytest.fixture(scope="module")
def outlier_data() -> np.ndarray:
    # 2e6 samples: with fewer, keeping 5 outliers at ±60 unclipped has the lower *total* MSE
    # (rounding cost ∝ N·range², clipping cost ∝ 5·60²), and the mse calibrator rightly keeps them.
    rng = np.random.default_rng(0)
    x = rng.standard_normal(2_000_000).astype(np.float32)
    return np.concatenate([x, np.array([60, -60, 60, -60, 60], np.float32)])


@pytest.fixture(scope="module")
def outlier_stats(outlier_data: np.ndarray) -> TensorStatistics:
    st = TensorStatistics()
    st.update(outlier_data)
    return st


# ---------------------------------------------------------------- StreamingHistogram


def reference_bin(x: float, r: float, bins: int) -> int:
    """Exact (rational) bin index: bins closed on the side away from 0, bin h = [0, w]."""
    h = bins // 2
    t = Fraction(x) / Fraction(r) * h
    b = math.ceil(t) - 1 if t > 0 else math.floor(t)
    return b + h


def test_histogram_bins_exactly_and_sets_r_to_power_of_two() -> None:
    rng = np.random.default_rng(1)
    bins = 64
    x = (rng.standard_normal(500) * 3).astype(np.float32)
    amax = float(np.abs(x).max())
    r = 2.0 ** math.ceil(math.log2(amax))
    w = 2 * r / bins
    # values on edges, at ±R and 0 exercise the closed-away-from-zero convention
    x = np.concatenate([x, np.array([0.0, w, -w, 2 * w, -2 * w, r, -r, w / 2], np.float32)])
    hist = StreamingHistogram(bins)
    hist.update(x)
    assert hist.R == r
    expected = np.bincount([reference_bin(float(v), r, bins) for v in x], minlength=bins)
    np.testing.assert_array_equal(hist.counts, expected)
    assert hist.counts.dtype == np.int64
    np.testing.assert_array_equal(hist.edges(), np.linspace(-r, r, bins + 1))
    np.testing.assert_allclose(hist.centers(), hist.edges()[:-1] + w / 2)


def test_histogram_identical_for_any_batch_split_and_order() -> None:
    rng = np.random.default_rng(2)
    # magnitudes growing over ~10 octaves so that R doubles many times (several at once too)
    parts = [rng.standard_normal(300) * 2.0**k for k in (-6, -2, 0, 3, 1, 9, 4)]
    x = np.concatenate([np.zeros(50), *parts, [2.0**10, -(2.0**10)]]).astype(np.float32)
    once = StreamingHistogram(256)
    once.update(x)
    assert once.R == 2.0 ** math.ceil(math.log2(np.abs(x).max()))
    for seed in range(3):
        perm = np.random.default_rng(seed).permutation(x.size) if seed else np.arange(x.size)
        cuts = np.sort(np.random.default_rng(seed + 10).choice(np.arange(1, x.size), 40, replace=False))
        split = StreamingHistogram(256)
        for chunk in np.split(x[perm], cuts):
            split.update(chunk)
        assert split == once
    # ascending magnitudes: R grows with nearly every batch
    rev = StreamingHistogram(256)
    for chunk in np.array_split(np.sort(np.abs(x)), 7):
        rev.update(chunk)
    ref = StreamingHistogram(256)
    ref.update(np.abs(x))
    assert rev == ref


def test_histogram_merge_equals_histogramming_once() -> None:
    rng = np.random.default_rng(3)
    small = rng.standard_normal(1000) * 0.01
    large = rng.standard_normal(1000) * 100
    whole = StreamingHistogram(128)
    whole.update(np.concatenate([small, large, np.zeros(7)]))
    for first, second in ((small, large), (large, small)):
        a, b, z = StreamingHistogram(128), StreamingHistogram(128), StreamingHistogram(128)
        a.update(first)
        b.update(second)
        z.update(np.zeros(7))
        b_before = b.counts.copy()
        a.merge(z)
        a.merge(b)
        assert a == whole
        np.testing.assert_array_equal(b.counts, b_before)  # merge does not modify its argument
    zero_first = StreamingHistogram(128)
    zero_first.update(np.zeros(7))
    b = StreamingHistogram(128)
    b.update(np.concatenate([small, large]))
    zero_first.merge(b)
    assert zero_first == whole
    with pytest.raises(ValueError, match="same number of bins"):
        whole.merge(StreamingHistogram(64))


def test_histogram_zeros_tiny_values_and_nonfinite() -> None:
    hist = StreamingHistogram(64)
    hist.update(np.zeros(10, np.float32))
    assert hist.R == 1.0 and hist.counts[32] == 10 and hist.total == 10
    # zeros do not pin R: later small values get R = smallest power of two >= max|x|
    hist.update(np.array([0.001, -0.0007], np.float32))
    assert hist.R == 2.0**-9
    tiny = StreamingHistogram(64)
    tiny.update(
        np.array([1e-45, -1e-45], np.float32)
    )  # float32 denormals: R is clamped at the smallest normal
    assert tiny.R == 2.0**-126 and np.isfinite(tiny.edges()).all()
    nan = StreamingHistogram(64)
    nan.update(np.array([np.nan, np.inf, -np.inf, 1.5], np.float32))
    assert nan.nonfinite == 3 and nan.total == 1 and nan.R == 2.0
    for bad in (63, 66.0, 32, True):
        with pytest.raises(ValueError, match="bins"):
            StreamingHistogram(bad)  # type: ignore[arg-type]


def test_histogram_state_round_trip_and_quantiles() -> None:
    rng = np.random.default_rng(4)
    hist = StreamingHistogram(128)
    hist.update(rng.uniform(-3, 5, 10_000))
    hist.update([np.nan])
    buf = io.BytesIO()
    np.savez(buf, **hist.state())  # type: ignore[arg-type]  # what the stats cache does
    buf.seek(0)
    loaded = dict(np.load(buf))
    assert StreamingHistogram.from_state(loaded) == hist
    with pytest.raises(ValueError, match="power of two"):
        StreamingHistogram.from_state({**loaded, "range": 3.0})
    # uniform data: quantiles are linear; 1 % of a bin width of accuracy is plenty here
    w = 2 * hist.R / hist.bins
    np.testing.assert_allclose(hist.quantile([0.0, 0.5, 1.0]), [-3, 1, 5], atol=w)
    # hand-made histogram: 10 values in [0, 1), 30 in [1, 2)
    np.testing.assert_allclose(
        histogram_quantile([10, 30], [0, 1, 2], [0.125, 0.25, 0.625, 1.0]), [0.5, 1.0, 1.5, 2.0]
    )


# ---------------------------------------------------------------- TensorStatistics


def test_tensor_statistics_exact_moments_merge_and_state() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal(5000).astype(np.float32) * 4 + 1
    st = stream(TensorStatistics(bins=256), np.concatenate([x, [np.nan, np.inf]]), 333)
    assert isinstance(st, TensorStatistics)
    assert st.min == float(x.min()) and st.max == float(x.max())
    assert st.count == 5000 and st.nonfinite == 2 and st.batches == 16
    assert st.mean == pytest.approx(float(x.astype(np.float64).mean()), rel=1e-12)
    a, b = TensorStatistics(256), TensorStatistics(256)
    a.update(x[:1234])
    b.update(x[1234:])
    b.update([np.nan, np.inf])
    a.merge(b)
    assert (a.min, a.max, a.count, a.nonfinite) == (st.min, st.max, st.count, st.nonfinite)
    assert a.hist == st.hist
    restored = TensorStatistics.from_state({k: np.asarray(v) for k, v in st.state().items()})
    assert restored.state().keys() == st.state().keys()
    assert all(np.array_equal(restored.state()[k], v) for k, v in st.state().items())
    copy = st.copy()
    copy.update([100.0])
    assert st.max == float(x.max())  # the copy is independent
    with pytest.raises(ValueError, match="count"):
        TensorStatistics.from_state({**st.state(), "count": 1})
    empty = TensorStatistics()
    assert empty.mean is None and empty.absmax == 0.0


# ---------------------------------------------------------------- calibrators: known answers


@pytest.mark.parametrize("dtype,symmetric", GRIDS)
def test_histogram_calibrators_clip_outliers(
    outlier_data: np.ndarray, outlier_stats: TensorStatistics, dtype: str, symmetric: bool
) -> None:
    bulk = outlier_data[np.abs(outlier_data) < 4]
    mm = MinMaxCalibrator.from_statistics(outlier_stats, dtype=dtype, symmetric=symmetric).compute_range()
    assert (float(mm[0]), float(mm[1])) == (-60.0, 60.0)
    mm_err = qdq_mse(bulk, *mm, dtype, symmetric)
    for cls in HIST_CALIBRATORS:
        lo, hi = cls.from_statistics(outlier_stats, dtype=dtype, symmetric=symmetric).compute_range()
        assert lo.dtype == hi.dtype == np.float32 and lo.shape == hi.shape == ()
        assert -30 < float(lo) < 0 < float(hi) < 30, (cls.name, lo, hi)  # well inside ±60
        assert qdq_mse(bulk, lo, hi, dtype, symmetric) < 0.25 * mm_err, cls.name
    # Known answers: Φ⁻¹(0.9999) = 3.719, and the 0.9999 quantile of |x| is Φ⁻¹(0.99995) = 3.891.
    lo, hi = PercentileCalibrator.from_statistics(
        outlier_stats, dtype=dtype, symmetric=symmetric
    ).compute_range()
    expected = 3.891 if symmetric else 3.719
    assert float(hi) == pytest.approx(expected, abs=0.05) and float(lo) == pytest.approx(-expected, abs=0.05)
    # Entropy with 128 levels over 2048 bins of [0, 60] cannot pick below 128/2048*60 = 3.75.
    lo, hi = EntropyCalibrator.from_statistics(
        outlier_stats, dtype=dtype, symmetric=symmetric
    ).compute_range()
    assert 3.75 <= float(hi) < 6 and float(lo) == -float(hi)


def brute_force_best(x: np.ndarray, cal: MSECalibrator, st: TensorStatistics) -> tuple[int, np.ndarray]:
    lo, hi = cal.candidate_ranges(st)
    errs = np.array([qdq_mse(x, a, b, cal.dtype, cal.symmetric) for a, b in zip(lo, hi, strict=True)])
    return int(np.argmin(errs)), errs


@pytest.mark.parametrize(
    "kind,dtype,symmetric",
    [
        ("laplace", "uint8", False),
        ("laplace", "int8", True),
        ("halfnormal", "uint8", False),
        ("outliers", "int8", True),
    ],
)
def test_mse_matches_brute_force_on_raw_data(kind: str, dtype: str, symmetric: bool) -> None:
    rng = np.random.default_rng(6)
    if kind == "laplace":
        x = rng.laplace(0.0, 1.0, 200_000).astype(np.float32)
    elif kind == "halfnormal":
        x = np.abs(rng.standard_normal(200_000)).astype(np.float32) ** 3
    else:
        x = np.concatenate([rng.standard_normal(200_000), [25.0, -25.0]]).astype(np.float32)
    cal = MSECalibrator(dtype=dtype, symmetric=symmetric)
    cal.update(x)
    lo, hi = cal.compute_range()
    best, errs = brute_force_best(x, cal, cal.stats)
    cand_lo, cand_hi = cal.candidate_ranges(cal.stats)
    bin_width = 2 * cal.stats.hist.R / cal.stats.hist.bins
    close = abs(float(hi) - cand_hi[best]) <= bin_width and abs(float(lo) - cand_lo[best]) <= bin_width
    assert close or qdq_mse(x, lo, hi, dtype, symmetric) <= 1.01 * errs[best], (
        lo,
        hi,
        cand_lo[best],
        cand_hi[best],
    )
    assert float(hi) < 0.9 * float(x.max())  # an interior optimum: the search really clips


def test_halfnormal_data_gives_lo_zero() -> None:
    x = np.abs(np.random.default_rng(7).standard_normal(50_000)).astype(np.float32)
    x[:100] = 0.0  # ReLU zeros
    for cls in ALL_CALIBRATORS:
        for dtype, symmetric in GRIDS:
            cal = stream(cls(dtype=dtype, symmetric=symmetric), x, 4096)
            lo, hi = cal.compute_range()
            assert float(lo) == 0.0 and 0 < float(hi) <= float(x.max()), (cls.name, dtype)
    # A ReLU output: half of the values are exact zeros.  That spike is exact on any grid and
    # must not drive the entropy threshold down (left in, it picks t ≈ 1.3 here: 19 % clipped).
    relu = np.maximum(np.random.default_rng(11).standard_normal(400_000), 0).astype(np.float32)
    for dtype, symmetric in GRIDS:
        lo, hi = stream(EntropyCalibrator(dtype=dtype, symmetric=symmetric), relu, 65536).compute_range()
        assert float(lo) == 0.0 and 3.0 < float(hi) <= float(relu.max()), (dtype, hi)
    # one-sided uint8 uses all 256 levels for [0, t]; the symmetric int8 grid only 128 of them
    st = TensorStatistics()
    st.update(x)
    assert EntropyCalibrator(dtype="uint8").levels(st) == 256
    assert EntropyCalibrator(dtype="int8", symmetric=True).levels(st) == 128


def test_batch_size_one_and_thirty_two_give_identical_histograms_and_ranges() -> None:
    rng = np.random.default_rng(8)
    x = np.concatenate([rng.standard_normal(1500) * 0.5, [9.0, -7.0], rng.standard_normal(500) * 3])
    x = x.astype(np.float32)
    for cls in ALL_CALIBRATORS:
        for dtype, symmetric in GRIDS:
            one = stream(cls(dtype=dtype, symmetric=symmetric), x, 1)
            many = stream(cls(dtype=dtype, symmetric=symmetric), x[::-1].copy(), 32)
            if cls is not MinMaxCalibrator:
                assert one.stats.hist == many.stats.hist
            r1, r32 = one.compute_range(), many.compute_range()
            assert (r1[0].tobytes(), r1[1].tobytes()) == (r32[0].tobytes(), r32[1].tobytes()), cls.name


def test_degenerate_data() -> None:
    for cls in ALL_CALIBRATORS:
        for data in (np.zeros(100, np.float32), np.array([np.nan, np.inf], np.float32)):
            lo, hi = stream(cls(), data, 7).compute_range()
            assert np.isfinite(lo) and np.isfinite(hi) and float(lo) <= 0.0 <= float(hi)
            assert lo.dtype == hi.dtype == np.float32
        with pytest.raises(CalibrationError, match="no data"):
            cls().compute_range()
    # a constant positive tensor: one-sided uint8 keeps [0, 5] (no clipping of the only value)
    for cls in HIST_CALIBRATORS:
        lo, hi = stream(cls(), np.full(1000, 5.0, np.float32), 100).compute_range()
        assert (float(lo), float(hi)) == (0.0, 5.0), cls.name


# ---------------------------------------------------------------- entropy internals


def kl_reference(h: np.ndarray, levels: int, i: int) -> float:
    """KL(P‖Q) of one candidate, written out directly from the entropy module docstring."""
    p = h[:i].copy()
    p[i - 1] += h[i:].sum()
    group = np.arange(i) * levels // i  # bin k -> group floor(k L / i)
    q = np.zeros(i)
    for j in range(levels):
        members = (group == j) & (p > 0)
        if members.any():
            q[members] = h[:i][group == j].sum() / members.sum()
    pn = p / p.sum()
    qn = q / q.sum() if q.sum() > 0 else q
    keep = pn > 0
    return float(np.sum(pn[keep] * np.log(pn[keep] / np.maximum(qn[keep], 1e-10))))


def test_entropy_vectorised_kl_matches_reference() -> None:
    rng = np.random.default_rng(9)
    h = rng.poisson(3.0, 300).astype(np.float64) * (rng.uniform(size=300) > 0.3)
    h[-40:-25] = 0.0  # an empty stretch: P's last bin gets only outliers there
    h[:20] = 0.0  # empty head: Q is all zero for thresholds <= 20 (KL from the eps floor alone)
    stops = np.array([16, 17, 20, 33, 100, 261, 270, 299, 300])
    got = kl_divergences(h, 16, stops)
    want = [kl_reference(h, 16, int(i)) for i in stops]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_entropy_rebinning_keeps_mass_and_is_fast(outlier_stats: TensorStatistics) -> None:
    h = abs_histogram(outlier_stats, 2048)
    assert h.size == 2048 and h.sum() == pytest.approx(outlier_stats.count)
    assert h[-1] == pytest.approx(5.0)  # the outliers at |x| = 60 = max|x| end up in the last bin
    for dtype, symmetric in GRIDS:
        cal = EntropyCalibrator.from_statistics(outlier_stats, dtype=dtype, symmetric=symmetric)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            cal.compute_range()
            times.append(time.perf_counter() - t0)
        assert min(times) < 0.05  # required budget: < 50 ms per tensor at bins=2048 (measured ~4 ms)


# ---------------------------------------------------------------- protocol: registry, options, state


def test_registry_lists_all_four() -> None:
    assert {"minmax", "percentile", "mse", "entropy"} <= set(CALIBRATORS.names())
    assert get_calibrator("entropy") is EntropyCalibrator
    with pytest.raises(UnknownNameError) as info:
        get_calibrator("kl")
    for name in ("minmax", "percentile", "mse", "entropy"):
        assert name in str(info.value)


def test_options_are_validated_with_recipe_errors() -> None:
    for cls in HIST_CALIBRATORS:
        with pytest.raises(RecipeError, match="axis=1") as info:
            cls(axis=1)
        assert cls.name in str(info.value)
        with pytest.raises(RecipeError, match="dtype='int3'"):
            cls(dtype="int3")
        with pytest.raises(RecipeError, match="symmetric='yes'"):
            cls(symmetric="yes")
    for bad in (50, 100.5, True, "99", float("nan")):
        with pytest.raises(RecipeError, match="percentile="):
            PercentileCalibrator(percentile=bad)  # type: ignore[arg-type]
    assert PercentileCalibrator(percentile=100).percentile == 100.0
    with pytest.raises(RecipeError, match="candidates=0"):
        MSECalibrator(candidates=0)
    with pytest.raises(RecipeError, match="stride=0"):
        EntropyCalibrator(stride=0)
    with pytest.raises(RecipeError, match="bins=2.5"):
        EntropyCalibrator(bins=2.5)  # type: ignore[arg-type]
    with pytest.raises(RecipeError, match="dtype='fp8'"):
        MinMaxCalibrator(dtype="fp8")
    st = TensorStatistics()
    st.update([1.0, -2.0])
    for option in ({"axis": 0}, {"momentum": 0.9}):
        with pytest.raises(RecipeError, match=next(iter(option))):
            MinMaxCalibrator.from_statistics(st, **option)


@pytest.mark.parametrize("cls", ALL_CALIBRATORS)
def test_state_round_trip_merge_and_from_statistics(cls: type[Any]) -> None:
    rng = np.random.default_rng(10)
    x = np.concatenate([rng.standard_normal(20_000), [15.0, -12.0]]).astype(np.float32)
    opts = {"dtype": "int8", "symmetric": True}
    streamed = stream(cls(**opts), x, 1000)
    want = streamed.compute_range()

    buf = io.BytesIO()
    np.savez(buf, **streamed.state())
    buf.seek(0)
    restored = cls.from_state(dict(np.load(buf)), **opts)
    assert [r.tobytes() for r in restored.compute_range()] == [r.tobytes() for r in want]

    st = stream(TensorStatistics(), x, 777)
    from_stats = cls.from_statistics(st, **opts)
    assert [r.tobytes() for r in from_stats.compute_range()] == [r.tobytes() for r in want]

    a, b = cls(**opts), cls(**opts)
    a.update(x[:5000])
    b.update(x[5000:])
    a.merge(b)
    assert [r.tobytes() for r in a.compute_range()] == [r.tobytes() for r in want]
    if cls is not MinMaxCalibrator:
        with pytest.raises(ValueError, match="same settings"):
            a.merge(cls(dtype="uint8"))
